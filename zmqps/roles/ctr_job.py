"""The built-in click-through-rate job (``--model ctr``): training loop and evaluation.

Rules of this module:

* Each step deduplicates the batch's ids (:class:`~zmqps.models.ctr.SparseBatch`),
  pulls every unique row of each hash table once, gathers them per (example, field),
  and pushes one summed gradient per unique row.
* async: the rows of the NEXT batch are pulled while this batch computes and pushes
  (one step staler for ids both batches share, which async tolerates anyway); sync:
  rows must be of the token's step, so they are pulled after the token, together with
  the dense variables.
* Evaluation pulls the test set's rows in pieces, read-only (no row is created for a
  held-out id), and reports ``test_auc``,
  ``test_logloss`` and, for synthetic data, the true model's ``ground_truth_auc`` /
  ``ground_truth_logloss`` on the same examples.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from zmqps.data.batches import examples_in
from zmqps.data.ctr import CTRDataset, auc, logloss
from zmqps.models.ctr import EVAL_PIECE, CTRModel, SparseBatch
from zmqps.roles.channels import RECOVERABLE
from zmqps.roles.client import ParameterClient
from zmqps.roles.job import JobConfig
from zmqps.transport import Requester
from zmqps.wire.errors import ModelMismatch

if TYPE_CHECKING:
    from zmqps.roles.worker import Worker

__all__ = [
    "ctr_metrics",
    "ctr_scores",
    "ctr_scores_summary",
    "evaluate_ctr",
    "export_ctr",
    "table_summary",
    "train_ctr",
]

log = logging.getLogger("zmqps.worker")

Rows = dict[str, np.ndarray]


def _lookups(model: CTRModel, batch: SparseBatch) -> dict[str, np.ndarray]:
    return {name: batch.unique for name in model.tables}


def _rows(
    worker: Worker, model: CTRModel, batch: SparseBatch, fut: concurrent.futures.Future[Rows]
) -> Rows:
    """The prefetched rows, or (the prefetch met a restore) pulled again with recovery."""
    try:
        return fut.result()
    except RECOVERABLE as e:
        log.warning("worker %d: row prefetch failed (%s); pulling again", worker.index, e)
        return {name: worker.pull_rows(name, batch.unique) for name in model.tables}


def _batches(data: CTRDataset, job: JobConfig, worker: Worker) -> Iterator[CTRDataset]:
    skip = worker.steps_done
    for epoch in range(job.epochs):
        for b in data.batches(job.batch_size, epoch, seed=job.seed * 1000 + worker.index):
            if skip:
                skip -= 1
                continue
            yield b


def train_ctr(worker: Worker, job: JobConfig, num_workers: int) -> dict[str, Any]:
    """Train the wide-and-deep CTR model on this worker's shard of the data."""
    from zmqps.roles.worker.train import done_line, due, retrained_note
    from zmqps.roles.worker.worker import Terminated

    data = job.load_ctr("train").shard(worker.index, num_workers)
    model = job.build_ctr_model(data)
    try:
        worker.create_variables(model.variables(), optimizer=job.optimizer)
    except ModelMismatch as exc:
        raise job.not_the_model(exc) from None
    # the examples it reports are its data's, exact (each epoch's last batch smaller)
    shard_size, batch_size = len(data), job.batch_size
    worker.count_examples_by(lambda c: examples_in(shard_size, batch_size, c))
    params = worker.pull()
    asynchronous = worker.steps.pulls_ahead  # rows of the next batch pulled during this one
    it = _batches(data, job, worker)
    batch = next(it, None)
    sparse = SparseBatch.of(batch.ids) if batch is not None else None
    fut = worker.pull_rows_async(_lookups(model, sparse)) if asynchronous and sparse else None
    loss, t_last, s_last = float("nan"), time.perf_counter(), 0
    while batch is not None and sparse is not None:
        worker.begin_step()
        started = time.perf_counter()
        if asynchronous:
            assert fut is not None
            rows = _rows(worker, model, sparse, fut)
        else:
            fut = worker.pull_rows_async(_lookups(model, sparse))
            params = worker.pull()  # the token's step, while the rows travel
            rows = _rows(worker, model, sparse, fut)
        worker.record_phase("pull", started)
        nxt = next(it, None)
        nxt_sparse = SparseBatch.of(nxt.ids) if nxt is not None else None
        if asynchronous and nxt_sparse is not None:
            fut = worker.pull_rows_async(_lookups(model, nxt_sparse))  # overlaps this step
        started = time.perf_counter()
        loss, grads, row_grads = model.loss_and_grads(params, rows, sparse, batch.dense, batch.y)
        worker.record_phase("compute", started)
        for name, g in row_grads.items():
            worker.push_rows(name, sparse.unique, g)
        if asynchronous:
            params = worker.push_pull(grads, loss=loss, examples=len(batch))
        else:
            worker.push(grads, loss=loss, examples=len(batch))
        if worker.stop_requested:
            raise Terminated()
        if due(worker, job.log_every):
            now = time.perf_counter()
            log.info(
                "worker %d: step %d, global step %d, loss %.4f (%.4f s/batch, %d unique ids)%s",
                worker.index,
                worker.net_steps,
                worker.global_step,
                loss,
                (now - t_last) / max(1, worker.step - s_last),
                sparse.unique.size,
                retrained_note(worker),
            )
            t_last, s_last = now, worker.step
        batch, sparse = nxt, nxt_sparse
    log.info("%s", done_line(worker, loss))
    return {"steps": worker.step, "loss": loss}


async def evaluate_ctr(
    client: ParameterClient, job: JobConfig, piece: int = EVAL_PIECE
) -> dict[str, Any]:
    """AUC and log loss of the trained model on the held-out split (the chief's summary).

    The test rows are pulled read-only (``create=False``): ids training never saw read
    as their initial values, what serving reads too, without taking rows on the PS."""
    test = job.load_ctr("test")
    model = job.build_ctr_model(test)
    return ctr_metrics(job, test, await ctr_scores(client, model, test, piece))


async def ctr_scores(
    client: ParameterClient,
    model: CTRModel,
    data: CTRDataset,
    piece: int = EVAL_PIECE,
    compute: Callable[..., Awaitable[Any]] | None = None,
) -> np.ndarray:
    """Click probabilities of ``data`` from the PS: the dense variables pulled once, the
    rows of each piece's ids pulled read-only. ``compute(fn, *args)`` runs the math
    (e.g. ``asyncio.to_thread``; default: here)."""
    params = await client.pull()
    scores = np.empty(len(data), np.float64)
    for lo in range(0, len(data), piece):
        part = data.take(slice(lo, lo + piece))
        sparse = SparseBatch.of(part.ids)
        rows = {
            name: await client.pull_rows(name, sparse.unique, create=False) for name in model.tables
        }
        if compute is None:
            p = model.probabilities(params, rows, sparse, part.dense)
        else:
            p = await compute(model.probabilities, params, rows, sparse, part.dense)
        scores[lo : lo + len(part)] = p
    return scores


def ctr_metrics(job: JobConfig, test: CTRDataset, scores: np.ndarray) -> dict[str, Any]:
    """The summary keys of a CTR evaluation: ``test_auc``, ``test_logloss`` (and the
    true model's ``ground_truth_*`` on synthetic data)."""
    return {
        "model": "ctr",
        "dataset": job.dataset,
        "test_examples": len(test),
        **ctr_scores_summary(test, scores),
    }


def ctr_scores_summary(test: CTRDataset, scores: np.ndarray) -> dict[str, float]:
    """``test_auc``, ``test_logloss`` (rounded as in the summary) and, on synthetic
    data, ``ground_truth_auc`` / ``ground_truth_logloss``."""
    out = {
        "test_auc": round(auc(test.y, scores), 4),
        "test_logloss": round(logloss(test.y, scores), 4),
    }
    if test.p_true is not None:
        out["ground_truth_auc"] = round(auc(test.y, test.p_true), 4)
        out["ground_truth_logloss"] = round(logloss(test.y, test.p_true), 4)
    return out


async def export_ctr(
    client: ParameterClient, job: JobConfig, directory: str, metrics: Mapping[str, Any]
) -> Path:
    """Export the trained CTR model: its dense variables and every table's live rows
    (:func:`zmqps.export.export_model`; ``load_model`` + ``model.predict`` serve it)."""
    from zmqps.data.preprocessing import preprocessing
    from zmqps.export import export_model

    model = job.build_ctr_model(job.load_ctr("test"))
    params = await client.pull()
    tables = {name: await client.table_rows(name) for name in model.tables}
    return await asyncio.to_thread(
        export_model,
        directory,
        model.signature(),
        params,
        tables=tables,
        metrics=metrics,
        preprocessing=preprocessing(job.dataset),
    )


async def table_summary(ps: Sequence[Requester], timeout: float = 10.0) -> dict[str, Any]:
    """Per hash-keyed table, its rows and counters summed over every PS (their
    ``status``): ``{name: {"rows", "created", "admitted", "not_admitted", "evicted"}}``."""
    replies = await asyncio.gather(*(c.request("status", {}, timeout=timeout) for c in ps))
    out: dict[str, dict[str, Any]] = {}
    for rep in replies:
        for name, shards in (rep.body.get("tables") or {}).items():
            acc = out.setdefault(
                name, {"rows": 0, "created": 0, "admitted": 0, "not_admitted": 0, "evicted": {}}
            )
            for st in shards:
                for k in ("rows", "created", "admitted", "not_admitted"):
                    acc[k] += int(st.get(k, 0))
                for reason, n in (st.get("evicted") or {}).items():
                    acc["evicted"][reason] = acc["evicted"].get(reason, 0) + int(n)
    return out
