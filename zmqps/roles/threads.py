"""A process's threads for passes over large arrays (``core.finite.Parts``).

A PS's check of a large push, and the conversions of a bfloat16 wire (a worker's
gradients narrowed, pulled values widened; a PS's values narrowed for a pull), are on
the path of a reply that someone waits for, and nothing else runs meanwhile. Their
compiled loops release the GIL, so a large array is read by several threads at
once: the cores this process may run on, at most :data:`MAX_THREADS`. The pool is
made at the first large array and its idle threads cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

from zmqps.process import usable_cores

__all__ = ["MAX_THREADS", "CheckThreads"]

#: at most this many threads check one push (the event loop's included)
MAX_THREADS = 4


class CheckThreads:
    """Runs calls at the same time: the first on the calling thread, the others on
    the pool's ``threads - 1`` threads."""

    def __init__(self, threads: int | None = None):
        self.threads = threads if threads is not None else min(MAX_THREADS, usable_cores())
        self._pool: ThreadPoolExecutor | None = None

    def run(self, calls: Sequence[Callable[[], bool]]) -> list[bool]:
        """Every call's result, in order; the first error of a call (in order) is
        raised once every call has finished."""
        if self.threads <= 1:
            return [call() for call in calls]
        if len(calls) > 1 and self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="zmqps-check")
        later = [self._pool.submit(call) for call in calls[1:]] if self._pool else []
        try:
            first = calls[0]()
        finally:  # an error is raised once no call is left running over the arrays
            wait(later)
        return [first, *(f.result() for f in later)]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
