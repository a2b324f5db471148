"""``zmqps bench overlap``: what overlapping communication with compute buys.

A chief, 2 PS and 2 workers (``--workers``) on 127.0.0.1, async; each worker trains an MLP
(784 -> hidden... -> 10, synthetic data) for ``--steps`` steps through
:class:`~zmqps.roles.overlap.StepPipeline` on ``--device``, in three schedules,
interleaved per repeat:

* ``serial``: no overlap; after backprop every gradient leaves in one push_pull
  per PS and the step waits for it (what a plain pull / compute / push loop does);
* ``layers``: each layer's gradients are pushed (push_pull) as soon as backprop has
  finished them, while the earlier layers compute;
* ``prefetch``: the pull for the next step is sent when a step begins, overlapping
  all of it (one more step of staleness).

Per schedule: examples/s of the workers together (median over repeats), the ratio
to serial, and one worker's time split per step: how long each transfer took
(pull, h2d, d2h, push) against how long the step waited for it, and the share of
communication hidden behind compute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

__all__ = ["SCHEDULES", "format_overlap", "phase_split", "run_overlap"]

SCHEDULES = ("serial", "layers", "prefetch")
_OPTIONS: dict[str, dict[str, Any]] = {
    "serial": {"push_bytes": 1 << 62},
    "layers": {"push_bytes": 0},
    "prefetch": {"prefetch": True},
}


def _worker(
    chief: str,
    index: int,
    schedule: str,
    device: str,
    steps: int,
    warmup: int,
    hidden: tuple[int, ...],
    batch: int,
) -> None:
    from zmqps.models import MLP
    from zmqps.roles.overlap import StepPipeline
    from zmqps.roles.worker import Worker

    model = MLP(784, 10, hidden=hidden, seed=1)
    rng = np.random.default_rng(index)
    with Worker(chief, index, device=device, timeout=120) as w:
        dev = w.device
        xs = [dev.asarray(rng.random((batch, 784), dtype=np.float32)) for _ in range(4)]
        ys = [dev.asarray(rng.integers(0, 10, batch)) for _ in range(4)]
        w.create_variables(model.variables(), optimizer={"name": "sgd", "lr": 0.01})
        pipe = StepPipeline(w, **_OPTIONS[schedule])
        t0 = 0.0
        for i in range(warmup + steps):
            if i == warmup:
                t0 = time.perf_counter()
                pipe.stats = type(pipe.stats)()  # time the measured steps only
            params = pipe.begin()
            loss, grads = model.loss_and_grads(
                params, xs[i % 4], ys[i % 4], on_ready=pipe.grads_ready
            )
            pipe.end(grads, loss=loss, examples=batch)
        seconds = time.perf_counter() - t0
        pipe.close()
    rec = {"index": index, "seconds": seconds, "examples": steps * batch, **pipe.stats.as_dict()}
    print(json.dumps(rec), flush=True)


def _one(
    schedule: str,
    device: str,
    steps: int,
    hidden: tuple[int, ...],
    batch: int,
    workers: int,
    timeout: float,
) -> list[dict[str, Any]]:
    from zmqps.bench.common import run_local_cluster

    shape = ",".join(str(h) for h in hidden)

    def argv(chief: str, i: int) -> list[str]:
        me = [sys.executable, "-m", "zmqps.bench.overlap", "--worker"]
        return [*me, chief, str(i), schedule, device, str(steps), shape, str(batch)]

    return run_local_cluster(2, workers, argv, timeout=timeout, what=f"overlap {schedule}")


def run_overlap(
    device: str = "cpu",
    steps: int = 100,
    repeat: int = 3,
    hidden: tuple[int, ...] = (1024, 1024, 1024),
    batch: int = 64,
    workers: int = 2,
    timeout: float = 300.0,
) -> dict[str, Any]:
    samples: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    split: dict[str, dict[str, Any]] = {}
    for r in range(repeat):
        for schedule in SCHEDULES[r % 3 :] + SCHEDULES[: r % 3]:
            recs = _one(schedule, device, steps, hidden, batch, workers, timeout)
            samples[schedule].append(sum(x["examples"] / x["seconds"] for x in recs))
            split[schedule] = recs[0]  # the last repeat's worker 0
    med = {s: statistics.median(v) for s, v in samples.items()}
    return {
        "suite": "overlap",
        "device": device,
        "steps": steps,
        "repeat": repeat,
        "hidden": list(hidden),
        "batch": batch,
        "workers": workers,
        "examples_per_second": {
            s: {"median": med[s], "min": min(v), "max": max(v), "samples": v}
            for s, v in samples.items()
        },
        "ratio_to_serial": {s: med[s] / med["serial"] for s in SCHEDULES},
        "split": split,
    }


def phase_split(rec: dict[str, Any], digits: int = 2) -> str:
    """``pull took/waited h2d ... push ...`` in ms, from an ``OverlapStats.as_dict()``."""
    took, waited = rec["took_seconds"], rec["waited_seconds"]
    return " ".join(
        f"{p} {took[p] * 1000:.{digits}f}/{waited[p] * 1000:.{digits}f}"
        for p in ("pull", "h2d", "d2h", "push")
    )


def format_overlap(run: dict[str, Any]) -> str:
    lines = [
        f"overlap: MLP 784-{'-'.join(map(str, run['hidden']))}-10, batch {run['batch']},"
        f" {run['workers']} workers on {run['device']}, 2 PS, async, {run['steps']} steps;"
        " examples/s (median, min-max), ratio to serial",
    ]
    for s, v in run["examples_per_second"].items():
        lines.append(
            f"  {s:<9} {v['median']:9.0f}   ({v['min']:.0f}-{v['max']:.0f})"
            f"   x{run['ratio_to_serial'][s]:.2f}"
        )
    lines.append("  ms per step of worker 0: took / waited per phase, compute, hidden")
    for s, rec in run["split"].items():
        lines.append(
            f"  {s:<9} step {rec['step_seconds'] * 1000:.2f}: {phase_split(rec)},"
            f" compute {rec['compute_seconds'] * 1000:.2f}, hidden {rec['overlap']:.0%}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument(
        "--worker",
        nargs=7,
        metavar=("CHIEF", "INDEX", "SCHEDULE", "DEVICE", "STEPS", "HIDDEN", "BATCH"),
        required=True,
    )
    a = p.parse_args()
    chief, index, schedule, device, n, hidden, batch = a.worker
    _worker(
        chief,
        int(index),
        schedule,
        device,
        int(n),
        warmup=10,
        hidden=tuple(int(h) for h in hidden.split(",")),
        batch=int(batch),
    )
