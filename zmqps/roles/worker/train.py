"""The built-in training program: this worker's shard of the data, ``job.epochs`` epochs.

A restarted worker resumes after the batches its earlier incarnations really pushed
(:attr:`Worker.steps_done`, read from the PS when it registered): no batch is
trained twice, and the run ends at its planned step. After a restore that went back
to a checkpoint, the loop goes back to the batches that checkpoint holds
(:meth:`Worker.take_rewind`) and trains the later ones again: their pushes were
acknowledged, then taken back by the restore.

With towers (``Worker(devices=...)``), ``job.batch_size`` is each tower's: a step
takes ``batch_size`` examples per tower and is one push of the worker (see
:mod:`zmqps.device.towers`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from zmqps.data import examples_in, shard, steps_per_epoch, stream
from zmqps.roles.job import JobConfig
from zmqps.roles.overlap import StepPipeline
from zmqps.roles.worker.worker import Terminated, Worker
from zmqps.wire.errors import ModelMismatch

__all__ = ["done_line", "due", "retrained_note", "train"]

log = logging.getLogger("zmqps.worker")


def train(
    worker: Worker, job: JobConfig, num_workers: int, *, prefetch: bool = False
) -> dict[str, Any]:
    """The built-in training program: this worker's shard of the data, ``job.epochs``
    epochs, on the worker's device, communication overlapped with compute (see
    :mod:`zmqps.roles.overlap`; ``prefetch`` there)."""
    towers = len(worker.devices)
    job.check_towers(towers)
    if job.is_ctr:
        from zmqps.roles.ctr_job import train_ctr

        return train_ctr(worker, job, num_workers)
    data_set = shard(job.load("train"), worker.index, num_workers)
    model = job.build_model(data_set)
    try:
        worker.create_variables(model.variables(), optimizer=job.optimizer)
    except ModelMismatch as exc:
        raise job.not_the_model(exc) from None
    pipe = StepPipeline(worker, prefetch=prefetch)
    batch = job.batch_size * towers
    per_epoch = steps_per_epoch(len(data_set), batch)
    # the examples it reports are its data's, exact (each epoch's last batch smaller)
    shard_size = len(data_set)
    worker.count_examples_by(lambda c: examples_in(shard_size, batch, c))
    log.info(
        "worker %d: %d examples, %d steps per epoch, %d epochs, on %s",
        worker.index,
        len(data_set),
        per_epoch,
        job.epochs,
        pipe.towers.describe(job.batch_size),
    )
    t_last, s_last = time.perf_counter(), 0
    loss = float("nan")
    total = per_epoch * job.epochs
    seed = job.seed * 1000 + worker.index
    if worker.steps_done:
        log.info(
            "worker %d: resuming after the %d batches its earlier runs pushed",
            worker.index,
            worker.steps_done,
        )
    data_at = worker.position
    stream_ = stream(data_set, batch, job.epochs, seed, data_at)
    try:
        while worker.position < total or worker.finish() is not None:
            pipe.begin()
            if worker.take_rewind() is not None or worker.position != data_at:
                data_at = worker.position  # a restore went back (see the module's doc)
                stream_ = stream(data_set, batch, job.epochs, seed, data_at)
                if data_at >= total:
                    break
            x, y = next(stream_)
            data_at += 1
            started = time.perf_counter()
            loss, grads = pipe.compute(model.loss_and_grads, x, y)
            worker.record_phase("compute", started)
            pipe.end(grads, loss=loss, examples=len(x))
            if worker.stop_requested:
                raise Terminated()
            if due(worker, job.log_every):
                now = time.perf_counter()
                log.info(
                    "worker %d: step %d, global step %d, loss %.4f (%.4f s/batch,"
                    " staleness %d, overlap %.2f)%s",
                    worker.index,
                    worker.net_steps,
                    worker.global_step,
                    loss,
                    (now - t_last) / max(1, worker.step - s_last),
                    worker.staleness,
                    pipe.stats.overlap,
                    retrained_note(worker),
                )
                t_last, s_last = now, worker.step
    finally:
        pipe.close()
    log.info("%s", done_line(worker, loss, pipe.stats.overlap))
    return {"steps": worker.step, "loss": loss, "overlap": pipe.stats.as_dict()}


def done_line(worker: Worker, loss: float, overlap: float | None = None) -> str:
    """The worker's last line: the steps this incarnation did, the global step it last
    saw and its last loss (``overlap``: the step pipeline's). One that did no step (its
    earlier incarnations had pushed all its batches) saw no global step and computed
    no loss: it says so, not "0 steps (global step 0, loss nan)"."""
    if worker.step == 0:
        why = (
            f"its earlier runs pushed all {worker.steps_done} batches of its data"
            if worker.steps_done
            else "its data has no batch to train"
        )
        return f"worker {worker.index}: done, no step of its own: {why}"
    figures = f"global step {worker.global_step}, loss {loss:.4f}"
    if overlap is not None:
        figures += f", overlap {overlap:.2f}"
    skipped = (
        f"; {worker.nonfinite} skipped: gradients not finite or out of range"
        if worker.nonfinite
        else ""
    )
    return (
        f"worker {worker.index}: done after {worker.net_steps} steps ({figures})"
        f"{skipped}{retrained_note(worker)}"
    )


def due(worker: Worker, every: int) -> bool:
    """A progress line is due: every ``every`` steps of this worker that hold (a batch
    trained again after a restore went back is not a new step)."""
    return worker.net_steps > 0 and worker.net_steps % every == 0


def retrained_note(worker: Worker) -> str:
    """What a progress line adds once steps trained batches again (a restore went
    back to a checkpoint that did not hold them): how many, so that the step count it
    shows, which leaves them out, is not taken for all the work done."""
    n = worker.retrained
    if not n:
        return ""
    return f"; {n} batch{'es' * (n != 1)} trained again after a restore went back"
