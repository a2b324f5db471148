"""Process-level helpers for zmqps' own child processes (``zmqps launch``'s tasks,
the benchmarks' sides): below the command line, so the benchmarks need not
import it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping

__all__ = [
    "THREAD_VARS",
    "available_memory",
    "blas_threads",
    "exit_with_parent",
    "thread_env",
    "usable_cores",
]

#: what numpy's BLAS (OpenBLAS, MKL) and OpenMP read for their number of threads
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cores() -> int:
    """The cores this process may run on (its affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def available_memory() -> tuple[int, int] | None:
    """``(available, total)`` bytes of this machine's memory (``MemAvailable``,
    ``MemTotal``), or None where they cannot be read."""
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if len(found) != 2:
        return None
    return found["MemAvailable"], found["MemTotal"]


def blas_threads(cores: int, compute_tasks: int, other_tasks: int) -> int:
    """BLAS threads for each of ``compute_tasks`` processes computing on the host: the
    cores left once each of ``other_tasks`` (PS, chief, GPU workers) has one, shared
    (at least 1). Every process of a machine taking all its cores each (BLAS's
    default) oversubscribes it: measured 20x slower on 16 cores (BENCHMARKS.md)."""
    return max(1, (cores - other_tasks) // max(1, compute_tasks))


def thread_env(threads: int, environ: Mapping[str, str]) -> dict[str, str]:
    """``THREAD_VARS`` set to ``threads``, unless ``environ`` sets any of them (the
    user chose): then nothing."""
    if any(v in environ for v in THREAD_VARS):
        return {}
    return dict.fromkeys(THREAD_VARS, str(threads))


def exit_with_parent(pid: int, poll_s: float = 0.5) -> None:
    """Stop this process (SIGTERM to itself) once its parent ``pid`` is gone."""

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="zmqps-parent-watch", daemon=True).start()
