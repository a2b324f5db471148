"""A private asyncio event loop in a background thread, for synchronous APIs.

The worker API is synchronous (users write plain training loops) while the
transport is asyncio: calls hop onto this loop and block for the result, or get
a ``concurrent.futures.Future`` to overlap communication with compute.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "zmqps-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

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
