"""Wake-ups of long polls, shared by the roles that hold them (the chief's token and
ssp polls, a PS's token polls)."""

from __future__ import annotations

import asyncio

__all__ = ["Changes"]


class Changes:
    """The wake-ups of long polls (tokens, ssp clocks): every waiter is woken at the
    next change, or after its own timeout.

    Each waiter is a future of its own, kept in a dict (O(1) to add and to drop), with
    no lock: a poll's test and its reply run with no await in between. An
    ``asyncio.Condition`` costs O(waiters) per waiter woken (each re-takes its lock,
    whose ``acquire`` looks at every queued waiter): O(workers²) per sync step."""

    def __init__(self) -> None:
        self._waiters: dict[asyncio.Future[None], None] = {}

    def notify_all(self) -> None:
        waiters, self._waiters = self._waiters, {}
        for fut in waiters:
            _resolve(fut)

    async def wait(self, timeout: float) -> None:
        """Until the next :meth:`notify_all`, or ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters[fut] = None
        timer = loop.call_later(timeout, _resolve, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._waiters.pop(fut, None)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
