"""The end of a run on the chief: the summary, the final model's evaluation, the export."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from zmqps.export import ExportError
from zmqps.roles.chief.service import ChiefService
from zmqps.roles.client import ParameterClient

__all__ = ["nonfinite_verdict", "summarize"]

log = logging.getLogger("zmqps.chief")


def nonfinite_verdict(nonfinite: int, steps: int, max_share: float) -> str:
    """Why a run with ``nonfinite`` of its ``steps`` refused as not finite failed, or
    "" when that is within ``max_share`` (0: any one fails it)."""
    # a step refused and never ended (a row push refused, no dense push after it, the
    # worker left) is counted skipped but not a step: 73 of 72 steps (101.4%) was said
    steps = max(steps, nonfinite)
    share = nonfinite / max(1, steps)
    if nonfinite == 0 or (share <= max_share and max_share > 0):
        return ""
    return (
        f"{nonfinite} of {steps} steps ({share:.1%}) had non-finite gradients, refused by"
        f" the PS and skipped: more than --max-nonfinite-share {max_share:g}"
    )


def _export_failed(summary: dict[str, Any], exc: ExportError) -> None:
    """The export could not be written (a full disk, say): the run fails (exit code 3,
    never retried: a chief started again would train nothing and fail the same way)."""
    log.error("the export failed: %s", exc)
    summary.setdefault("failed", f"the export failed: {exc}")


async def summarize(service: ChiefService) -> dict[str, Any]:
    """Evaluate the final model (built-in jobs), export it, build the summary."""
    cfg = service.cfg
    m = service.members
    train_s = max(1e-9, m.train_seconds(service.clock()))
    mode = service.consistency
    step = await mode.applied_step()
    mode.global_step = step  # what status says from now on: the step the PS are at
    rate = m.examples_per_second(service.clock())
    summary: dict[str, Any] = {
        "mode": service.mode,
        "ps": cfg.cluster.num_ps,
        "workers": cfg.cluster.num_workers,
        "global_step": step,
        "worker_steps": m.global_step,
        "examples": m.examples,
        "train_seconds": round(train_s, 3),
        # None (null): not known, a chief started after the training with nothing that
        # recorded its seconds (no checkpoint of the run, no record of finished workers)
        "examples_per_second": None if rate is None else round(rate, 1),
        # steps whose gradients the PS refused as not finite (the workers skipped them)
        "nonfinite_steps": m.nonfinite,
    }
    if m.seconds_resumed is not None:
        # a stopped run resumed (``--resume``): train_seconds, examples and the rate
        # count the whole run; this many of its seconds are the stopped part's, as its
        # checkpoint recorded them
        summary["train_seconds_before_resume"] = round(m.seconds_resumed, 3)
    if m.adopted:
        # a chief restarted during the run: what it knows of the time before it
        # comes from its latest checkpoint (the moments after that one are not counted)
        summary["chief_restarted"] = True
    recovery = service.recovery
    # restores to a checkpoint (a PS lost its state): the batches after it were trained
    # again (``rewound_batches``); the workers' steps and examples count them once
    summary["restores"] = recovery.restore_count
    summary["restores_from_scratch"] = recovery.restores_from_scratch  # no checkpoint
    summary["rewound_batches"] = recovery.rewound
    if recovery.recoveries:
        # why and when each (the last few): what was lost, the step restored, how long
        summary["recoveries"] = recovery.recoveries[-5:]
    if recovery.replicated() and recovery.rereplicator is not None:
        # what replication did: fail-overs, promoted copies, copies made again
        summary["replication"] = {
            "factor": cfg.replication,
            "failovers": recovery.failover_count,
            "promotions": recovery.promotions,
            "copies_made": recovery.rereplicator.copies,
            "copies_failed": recovery.rereplicator.failures,
            "restores": recovery.restore_count,
        }
    mover = recovery.mover
    if mover is not None and (
        mover.moves
        or mover.failures
        or mover.wanted is not None
        # a chief started after states moved (its own moves are none): where they are,
        # even when every process serves one again (a scale down, then back up)
        or list(mover.homes.of) != list(range(len(mover.homes.of)))
    ):
        # elastic PS: the processes that served the states at the end, and the moves
        summary["elastic"] = {
            "serving": mover.serving(),
            "moves": mover.moves,
            "moves_failed": mover.failures,
            "moved_bytes": mover.bytes,
            "epoch": mover.homes.epoch,
            "recent_moves": mover.done,
            "scales": mover.scales,
            "asked": mover.wanted,
        }
        unmet = mover.unmet()
        if unmet is not None:
            # the run's work is done: its end does not wait for moves (the final
            # checkpoint and model are of the states where they are)
            summary["elastic"]["unmet"] = unmet
            log.warning("the run ended before the last scale was done: %s", unmet)
    failure = nonfinite_verdict(m.nonfinite, m.global_step, cfg.max_nonfinite_share)
    if failure:
        summary["failed"] = failure
    elif m.nonfinite:
        log.warning(
            "%d of %d steps had non-finite gradients: refused by the PS and skipped",
            m.nonfinite,
            m.global_step,
        )
    job = cfg.job
    placement = service.placement
    if job is None or placement is None:
        return summary
    client = ParameterClient(
        service.ps,
        placement,
        worker="chief",
        incarnation=0,
        shared_memory=False,
        generation=lambda: service.recovery.gen,
        exact=True,  # the final model as the PS keep it (not rounded to a wire dtype)
    )
    if job.is_ctr:
        from zmqps.roles.ctr_job import evaluate_ctr, export_ctr, table_summary

        summary.update(await evaluate_ctr(client, job))
        summary["tables"] = await table_summary(service.ps)
        if cfg.export_dir:
            try:
                path = await export_ctr(client, job, cfg.export_dir, summary)
            except ExportError as exc:
                _export_failed(summary, exc)
            else:
                summary["export_dir"] = str(path)
                log.info("exported the model (its tables' live rows) to %s", path)
        log.info(
            "final model: %s",
            ", ".join(f"{k} {v:.4f}" for k, v in summary.items() if "auc" in k or "logloss" in k),
        )
        return summary
    # data and evaluation in a thread: the chief goes on answering heartbeats meanwhile
    test = await asyncio.to_thread(job.load, "test")
    model = job.build_model(test)
    params = await client.pull()
    metrics = await asyncio.to_thread(model.evaluate, params, test.x, test.y)
    summary.update(
        model=job.model,
        dataset=job.dataset,
        test_accuracy=round(float(metrics["accuracy"]), 4),
        test_loss=round(float(metrics["loss"]), 4),
    )
    if cfg.export_dir:
        from zmqps.data.preprocessing import preprocessing
        from zmqps.export import export_model

        try:
            path = await asyncio.to_thread(
                export_model,
                cfg.export_dir,
                model.signature(),
                params,
                metrics=summary,
                preprocessing=preprocessing(job.dataset),
            )
        except ExportError as exc:
            _export_failed(summary, exc)
        else:
            summary["export_dir"] = str(path)
            log.info("exported the model to %s", path)
    log.info(
        "final model: test accuracy %.4f, test loss %.4f (global step %d)",
        summary["test_accuracy"],
        summary["test_loss"],
        step,
    )
    return summary
