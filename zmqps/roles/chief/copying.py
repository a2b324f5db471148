"""What the chief's two copiers of PS states share: re-replication
(:mod:`~zmqps.roles.chief.rereplication`, back to R copies) and elastic moves
(:mod:`~zmqps.roles.chief.moves`, a state onto another process). Both copy a live
state at a bounded rate while training goes on, one copy at a time, and both look
at every PS process of the spec with ``ps_state``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zmqps.wire import ops as o
from zmqps.wire.errors import ZmqpsError

if TYPE_CHECKING:
    from zmqps.roles.chief.recovery import RecoveryController
    from zmqps.roles.homes import Homes

__all__ = ["BACKOFF", "StateCopier"]

#: seconds before a failed (state, process) pair is tried again: doubling to the last
BACKOFF = (1.0, 2.0, 4.0, 8.0, 16.0)


class StateCopier:
    """A loop of the chief that copies PS states between processes."""

    def __init__(
        self,
        recovery: RecoveryController,
        homes: Homes,
        *,
        rate: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.recovery = recovery
        self.homes = homes
        #: bytes a second a copy is sent at
        self.rate = rate
        self.clock = clock
        cfg = recovery.cfg
        #: seconds between the loop's looks
        self.interval = min(cfg.heartbeat_interval, cfg.heartbeat_timeout / 4)
        #: the copy under way (None: none)
        self.current: dict[str, Any] | None = None
        #: copies done or given up (the last few, for the status)
        self.done: list[dict[str, Any]] = []
        self.failures = 0
        self.bytes = 0
        #: (state, process) pairs that failed: how many times in a row, and when they
        #: may be tried again (:data:`BACKOFF`)
        self._failed: dict[tuple[int, int], tuple[int, float]] = {}

    def backing_off(self, state: int, q: int) -> bool:
        """Whether a copy of ``state`` onto ``q`` failed lately (not tried again yet)."""
        return self._failed.get((state, q), (0, 0.0))[1] > self.clock()

    def outcome(self, state: int, q: int, ok: bool) -> None:
        """A copy of ``state`` onto ``q`` done (``ok``) or given up (its backoff grows)."""
        if ok:
            self._failed.pop((state, q), None)
            return
        n, _ = self._failed.get((state, q), (0, 0.0))
        self._failed[(state, q)] = (n + 1, self.clock() + BACKOFF[min(n, len(BACKOFF) - 1)])

    async def probe(self, q: int, timeout: float | None = None) -> o.PsStateReply | None:
        """Process ``q``'s ``ps_state`` (None: no answer within ``timeout`` s, by
        default two looks' time)."""
        wait = max(0.5, 2 * self.interval) if timeout is None else timeout
        try:
            rep = await self.homes.processes[q].request("ps_state", timeout=wait)
            return o.PsStateReply.parse(rep.body)
        except ZmqpsError:
            return None
