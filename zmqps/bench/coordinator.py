"""``zmqps bench coordinator``: what scheduling a function onto a worker costs.

A local cluster on 127.0.0.1 (a chief, 1 PS, 1 or 2 worker servers of
``zmqps.coordinator.digits``); this process is the coordinator. Two figures per
worker count, repeats interleaved:

* **dispatch**: ``noop`` functions (an int in, the int out) scheduled back to back
  and joined: wall time per function (throughput; with 2 workers two run at once),
  and the coordinator's own measure of dispatch overhead (the run request's round
  trip minus the function's execution on the worker, mean per function). A local
  call of the same function is the baseline.
* **steps_per_execution**: digits MLP training steps (batch 32, pull / compute /
  push_pull against the PS) scheduled as functions of 1 step and of 10 steps:
  steps per second of each and their ratio.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from zmqps.config import ClusterSpec
from zmqps.transport import free_ports

__all__ = ["format_coordinator", "run_coordinator"]

JOB = "zmqps.coordinator.digits"


def _cluster(workers: int) -> ClusterSpec:
    ports = free_ports(2 + workers)
    return ClusterSpec(
        chief=f"127.0.0.1:{ports[0]}",
        ps=(f"127.0.0.1:{ports[1]}",),
        worker=tuple(f"127.0.0.1:{p}" for p in ports[2:]),
    )


def _start(cluster: ClusterSpec) -> list[subprocess.Popen[bytes]]:
    spec = json.dumps({"cluster": cluster.to_dict()})
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    base = [sys.executable, "-m", "zmqps"]
    job = ["--model", "mlp", "--dataset", "digits"]
    argvs = [
        [*base, "server", "--role", "chief", "--cluster", spec, *job],
        [*base, "server", "--role", "ps", "--index", "0", "--cluster", spec],
    ]
    argvs += [
        [*base, "worker", "--serve", "--job", JOB, "--index", str(i), "--cluster", spec, *job]
        for i in range(cluster.num_workers)
    ]
    return [
        subprocess.Popen(a, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for a in argvs
    ]


def _noop_round(coord: Any, n: int) -> tuple[float, float]:
    """(µs of wall time per function, mean dispatch overhead in µs) for ``n`` noops."""
    before = coord.stats()
    t0 = time.perf_counter()
    values = [coord.schedule("noop", i) for i in range(n)]
    coord.join()
    wall = time.perf_counter() - t0
    assert [v.fetch() for v in values[:3]] == [0, 1, 2]
    after = coord.stats()
    runs = after["dispatch_runs"] - before["dispatch_runs"]
    seconds = after["dispatch_seconds"] - before["dispatch_seconds"]
    return wall / n * 1e6, seconds / max(1, runs) * 1e6


def _train_round(coord: Any, it: Any, spec: Any, steps: int, per_call: int) -> float:
    """Training steps per second with ``per_call`` steps per scheduled function."""
    t0 = time.perf_counter()
    for _ in range(steps // per_call):
        coord.schedule("train_step", it, spec, steps=per_call)
    coord.join()
    return steps / (time.perf_counter() - t0)


def _local_noop_us(n: int) -> float:
    from zmqps.coordinator.server import FunctionContext
    from zmqps.coordinator.steps import noop

    ctx = FunctionContext(0, 1)
    t0 = time.perf_counter()
    for i in range(n):
        noop(ctx, i)
    return (time.perf_counter() - t0) / n * 1e6


def _one(workers: int, functions: int, steps: int, repeat: int, timeout: float) -> dict[str, Any]:
    from zmqps.coordinator import Coordinator
    from zmqps.roles.job import JobConfig

    cluster = _cluster(workers)
    procs = _start(cluster)
    coord = None
    try:
        coord = Coordinator(cluster, heartbeat_interval=0.5)
        deadline = time.monotonic() + timeout
        while coord.stats()["workers_available"] < workers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {workers} worker servers did not come up")
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a task of the benchmark cluster exited")
            time.sleep(0.1)
        job = JobConfig()
        model = job.build_model(job.load("train"))
        coord.create_variables(model.variables(), dict(job.optimizer))
        it = iter(coord.create_per_worker_dataset("batch_stream", "digits", 32, 0))
        spec = {"kind": model.name, "config": model.config()}
        _noop_round(coord, 100)  # warm up: connections, resources
        _train_round(coord, it, spec, 40, 1)
        noop_us: list[float] = []
        overhead_us: list[float] = []
        rates: dict[int, list[float]] = {1: [], 10: []}
        for r in range(repeat):
            wall, over = _noop_round(coord, functions)
            noop_us.append(wall)
            overhead_us.append(over)
            for per_call in (1, 10) if r % 2 == 0 else (10, 1):
                rates[per_call].append(_train_round(coord, it, spec, steps, per_call))
        stats = coord.stats()
        coord.close(shutdown_workers=True)
        coord = None
        for p in procs:
            p.wait(timeout=60)
        med = {k: statistics.median(v) for k, v in rates.items()}
        return {
            "workers": workers,
            "noop_us_per_function": _summary(noop_us),
            "dispatch_overhead_us": _summary(overhead_us),
            "train_steps_per_s": {str(k): _summary(v) for k, v in rates.items()},
            "spe10_over_spe1": med[10] / med[1],
            "retried": stats["retried"],
        }
    finally:
        if coord is not None:
            coord.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _summary(v: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "samples": v}


def run_coordinator(
    workers: tuple[int, ...] = (1, 2),
    functions: int = 1000,
    steps: int = 400,
    repeat: int = 3,
    timeout: float = 120.0,
) -> dict[str, Any]:
    cases = [_one(w, functions, steps, repeat, timeout) for w in workers]
    return {
        "suite": "coordinator",
        "functions": functions,
        "steps": steps,
        "repeat": repeat,
        "local_noop_us": _local_noop_us(functions),
        "cases": cases,
    }


def format_coordinator(run: dict[str, Any]) -> str:
    lines = [
        f"coordinator: {run['functions']} noop functions and {run['steps']} digits MLP"
        f" training steps per repeat, 1 PS, {run['repeat']} repeats (median, min-max);"
        f" a local call of noop: {run['local_noop_us']:.2f} µs"
    ]
    for c in run["cases"]:
        n, o = c["noop_us_per_function"], c["dispatch_overhead_us"]
        s1, s10 = c["train_steps_per_s"]["1"], c["train_steps_per_s"]["10"]
        lines += [
            f"  {c['workers']} worker(s): noop {n['median']:.0f} µs per function"
            f" ({n['min']:.0f}-{n['max']:.0f}); dispatch overhead {o['median']:.0f} µs"
            f" ({o['min']:.0f}-{o['max']:.0f})",
            f"    train steps/s: steps_per_execution 1: {s1['median']:.0f}"
            f" ({s1['min']:.0f}-{s1['max']:.0f}), 10: {s10['median']:.0f}"
            f" ({s10['min']:.0f}-{s10['max']:.0f}); 10 / 1 = {c['spe10_over_spe1']:.2f}",
        ]
    return "\n".join(lines)
