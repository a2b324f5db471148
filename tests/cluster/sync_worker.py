"""A worker for the sync / SSP cluster tests: softmax regression on a fixed global batch.

Every worker makes the same global batch (fixed seed) and trains on its own contiguous
slice of it, with the loop that serves every mode: ``begin_step``, ``pull``, gradients
of the mean loss over the slice, ``push`` (or, with ``--pipeline``, the built-in
training loop's :class:`~zmqps.roles.overlap.StepPipeline`: ``begin``, gradients,
``end``). What it did goes to ``--out`` as JSON: the
token (sync) or step of each push, whether the PS took it, the pushes the PS dropped.

Faults are injected from here, never from the product: ``--stop-at K`` makes the
process SIGSTOP itself right after ``begin_step`` of its local step K (so it holds a
sync token while stopped); ``--sleep`` slows every step (from ``--sleep-from`` on);
``--hold FILE``: once every push is done, write ``FILE.<index>`` and wait until FILE
exists before leaving (the test acts between the last push and the leave).

The test imports :data:`VARIABLES`, :func:`global_batch` and :func:`loss_and_grads`
to compute the single-process reference.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

import zmqps
from zmqps.roles.overlap import StepPipeline

FEATURES, CLASSES, BATCH = 6, 4, 48
VARIABLES = (
    zmqps.VariableDef("w", (FEATURES, CLASSES), init={"name": "glorot_uniform", "seed": 1}),
    zmqps.VariableDef("b", (CLASSES,), init={"name": "normal", "stddev": 0.1, "seed": 2}),
)
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "sgd": {"name": "sgd", "lr": 0.5},
    "adam": {"name": "adam", "lr": 0.05},
}


def global_batch() -> tuple[np.ndarray, np.ndarray]:
    """The fixed global batch: ``BATCH`` examples, labels from a hidden linear model."""
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(FEATURES, CLASSES)), axis=1)
    return x, y


def my_slice(index: int, workers: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = global_batch()
    n = BATCH // workers
    return x[index * n : (index + 1) * n], y[index * n : (index + 1) * n]


def loss_and_grads(
    params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    """Mean softmax cross-entropy over ``x`` and its gradients (computed in float64)."""
    logits = x.astype(np.float64) @ params["w"].astype(np.float64) + params["b"]
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.mean(np.log(p[np.arange(len(y)), y])))
    d = p
    d[np.arange(len(y)), y] -= 1.0
    d /= len(y)
    return loss, {"w": x.T.astype(np.float64) @ d, "b": d.sum(axis=0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--chief", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--workers", type=int, default=3, help="slices of the global batch")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    p.add_argument("--out", required=True, help="JSON record of this run")
    p.add_argument("--final", help="sync: wait for global step --steps, save the params here")
    p.add_argument("--stop-at", type=int, help="SIGSTOP this process at this local step")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds of extra work per step")
    p.add_argument("--sleep-from", type=int, default=0, help="sleep from this local step on")
    p.add_argument("--hold", help="after the last push: write HOLD.<index>, wait for HOLD")
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="the built-in training loop's steps (StepPipeline: begin, compute, end)",
    )
    args = p.parse_args()

    x, y = my_slice(args.index, args.workers)
    record: dict[str, Any] = {"index": args.index, "pid": os.getpid(), "pushes": []}
    with zmqps.Worker(args.chief, args.index, steps_planned=args.steps) as worker:
        worker.create_variables(VARIABLES, optimizer=OPTIMIZERS[args.optimizer])
        worker.pull()  # before any token (as the built-in CTR loop does): a plain pull
        pipe = StepPipeline(worker) if args.pipeline else None
        for k in range(args.steps):
            if pipe is not None:
                params = pipe.begin()  # begin_step, then this step's values
                step = worker.steps.tag()
            else:
                step = worker.begin_step()
            if k == args.stop_at:
                os.kill(os.getpid(), signal.SIGSTOP)  # resumed by the test's SIGCONT
            if pipe is None:
                params = worker.pull()
            loss, grads = loss_and_grads(params, x, y)
            if args.sleep and k >= args.sleep_from:
                time.sleep(args.sleep)
            if pipe is not None:
                accepted = pipe.end(grads, loss=loss, examples=len(x))
            else:
                accepted = worker.push(grads, loss=loss, examples=len(x))
            record["pushes"].append({"step": step, "accepted": accepted})
        if pipe is not None:
            pipe.close()
        record["dropped"] = dict(worker.client.dropped)
        if args.final:
            # The token of step --steps is handed out once every PS has applied step
            # --steps - 1: then the pulled values are the final model.
            record["final_step"] = worker.begin_step()
            np.savez(args.final, **worker.pull())
        # sync: the tokens a PS handed (the first of each incarnation is the chief's)
        record["tokens_from_ps"] = getattr(worker.steps, "from_ps", None)
        # sync: pulls the push before answered (its reply brought the step's values)
        stats = worker.stats()
        record["fresh_pulls"], record["fresh_misses"] = stats["fresh_pulls"], stats["fresh_misses"]
        if args.hold:
            Path(f"{args.hold}.{args.index}").write_text("pushed\n")
            while not Path(args.hold).exists():
                time.sleep(0.05)
    Path(args.out).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
