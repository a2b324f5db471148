"""A private asyncio event loop in a background thread, for synchronous APIs.

The worker API is synchronous (users write plain training loops) while the
transport is asyncio: calls hop onto this loop and block for the result, or get
a ``concurrent.futures.Future`` to overlap communication with compute.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from zmqps.wire.errors import ShutdownError

__all__ = ["WAKE_S", "LoopThread", "result"]

T = TypeVar("T")


#: a thread blocked in :func:`result` wakes this often, so that the main thread runs
#: its signal handlers (SIGTERM, Ctrl-C) within this bound wherever it waits
WAKE_S = 0.25
#: signals the loop's thread never takes: the kernel gives them to another thread
#: (the main thread, whose handlers are Python's)
_MAIN_THREAD_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def result(fut: concurrent.futures.Future[T], timeout: float | None = None) -> T:
    """``fut.result(timeout)``, waking every :data:`WAKE_S` seconds: a signal delivered
    to another thread of the process does not interrupt a wait, and the main thread
    runs Python's signal handlers only when it wakes."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = WAKE_S if deadline is None else min(WAKE_S, deadline - time.monotonic())
        try:
            return fut.result(max(0.0, left))
        except concurrent.futures.TimeoutError:  # builtin TimeoutError from 3.11 on
            if fut.done():  # the work itself raised it
                raise
            if deadline is not None and time.monotonic() >= deadline:
                raise


class LoopThread:
    def __init__(self, name: str = "zmqps-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # SIGTERM and SIGINT go to the threads that handle them (so do those of the
        # threads this loop starts: they inherit the mask)
        signal.pthread_sigmask(signal.SIG_BLOCK, _MAIN_THREAD_SIGNALS)
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self.loop.is_closed() or not self._thread.is_alive():
            # its owner was closed: one line (a raw "Event loop is closed" and a warning
            # that the coroutine was never awaited came instead)
            coro.close()
            raise ShutdownError(f"{self._thread.name} is closed: nothing more can be sent")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return result(self.submit(coro), timeout)

    def stop(self) -> None:
        """Stop the loop. Its tasks are cancelled first, so that a thread still blocked
        in :meth:`run` (a function waiting for the cluster to recover when its worker
        leaves) gets ``CancelledError`` instead of waiting for ever, and the process
        can exit."""
        if not self.loop.is_running():
            return

        async def cancel_and_stop() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=2.0)
            await asyncio.sleep(0)  # their callers' futures hear of it
            self.loop.stop()

        asyncio.run_coroutine_threadsafe(cancel_and_stop(), self.loop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()
