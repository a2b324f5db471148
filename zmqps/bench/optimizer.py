"""``zmqps bench optimizer``: the PS's dense update speed against in-place BLAS axpy.

One process, no sockets: every repeat times each contender once, in rotating
order, on the same ``--size-mb`` of float32 parameters; figures are GB/s of
parameters updated (bytes of the parameter array / time), medians with min-max,
and ratios to ``saxpy`` (BLAS as configured: multi-threaded) and to
``saxpy-1t`` (BLAS limited to one thread, as the PS's kernels are). The PS
contenders go through :meth:`ShardStore.apply_dense` with 4 MiB gradient chunks,
exactly as a push is applied; ``sgd+check`` and ``adam+check`` first check the
gradient for NaN and infinities as a PS does with every push, so their ratio to the
plain update is what the check costs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from zmqps.core import optimizers
from zmqps.core.finite import first_bad_of
from zmqps.core.store import ShardStore
from zmqps.core.variables import ShardDef
from zmqps.roles.threads import CheckThreads

__all__ = ["format_optimizer", "run_optimizer"]

CONFIGS = {
    "sgd": {"name": "sgd", "lr": 0.01},
    "momentum": {"name": "momentum", "lr": 0.01, "momentum": 0.9},
    "adagrad": {"name": "adagrad", "lr": 0.1},
    "adam": {"name": "adam", "lr": 1e-3},
}


def _store_update(
    name: str, n: int, *, kernels: bool = True, check: bool = False
) -> Callable[[], None]:
    store = ShardStore()
    cols = 1024
    rows = n // cols
    store.create(
        [ShardDef(0, "w", 0, "float32", (rows, cols), 0, rows, {"name": "zeros"}, CONFIGS[name])]
    )
    g = np.full(rows * cols, 1e-3, np.float32)
    step = (4 << 20) // 4
    chunks = [(o, g[o : o + step]) for o in range(0, g.size, step)]
    threads = CheckThreads()  # the PS's own

    def update() -> None:
        old = optimizers.USE_KERNELS
        optimizers.USE_KERNELS = kernels
        try:
            if check:  # what a PS does first: every value finite, else nothing changes
                assert first_bad_of([chunk for _, chunk in chunks], threads) is None
            store.apply_dense(0, chunks, store.get(0).version)
        finally:
            optimizers.USE_KERNELS = old

    update()  # compile / warm up
    return update


def _axpy(n: int, threads: int | None) -> Callable[[], None]:
    from scipy.linalg import blas

    x = np.full(n, 1e-3, np.float32)
    y = np.ones(n, np.float32)

    if threads is None:
        return lambda: blas.saxpy(x, y, a=-0.01)
    from threadpoolctl import threadpool_limits

    def one_thread() -> None:
        with threadpool_limits(threads, "blas"):
            blas.saxpy(x, y, a=-0.01)

    return one_thread


def run_optimizer(size_mb: float = 100.0, repeat: int = 7) -> dict[str, Any]:
    n = max(1024, int(size_mb * (1 << 20)) // 4 // 1024 * 1024)
    contenders: dict[str, Callable[[], None]] = {
        "saxpy": _axpy(n, None),
        "saxpy-1t": _axpy(n, 1),
        **{name: _store_update(name, n) for name in CONFIGS},
        "adam-numpy": _store_update("adam", n, kernels=False),
        # the update as a push gets it: its gradient checked for NaN / infinity first
        "sgd+check": _store_update("sgd", n, check=True),
        "adam+check": _store_update("adam", n, check=True),
    }
    names = list(contenders)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(repeat):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            t = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - t)
    gbs = {k: [n * 4 / t / 1e9 for t in v] for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in gbs.items()}
    return {
        "suite": "optimizer",
        "size_mb": n * 4 / (1 << 20),
        "repeat": repeat,
        "gb_per_s": {
            k: {"median": med[k], "min": min(v), "max": max(v), "repeats": v}
            for k, v in gbs.items()
        },
        "ratios": {
            **{
                f"{k}/{base}": med[k] / med[base]
                for k in names
                if not k.startswith("saxpy")
                for base in ("saxpy", "saxpy-1t")
            },
            # the cost of the non-finite check, measured in this run
            **{f"{k}+check/{k}": med[f"{k}+check"] / med[k] for k in ("sgd", "adam")},
        },
    }


def format_optimizer(run: dict[str, Any]) -> str:
    lines = [
        f"optimizer: dense update of {run['size_mb']:.0f} MB float32, GB/s of parameters"
        f" (median, min-max of {run['repeat']})"
    ]
    for k, v in run["gb_per_s"].items():
        lines.append(f"  {k:<11} {v['median']:7.2f}   ({v['min']:.2f}-{v['max']:.2f})")
    for k, v in run["ratios"].items():
        lines.append(f"  {k:<20} {v:.2f}")
    return "\n".join(lines)
