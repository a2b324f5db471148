"""Request dispatch shared by the ZeroMQ server and the in-memory fake.

This is the one boundary where a bad request becomes an error reply: a
:class:`ZmqpsError` keeps its code; anything else becomes ``internal`` and is
logged with its traceback. Nothing here does IO.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Sequence
from typing import Any

from zmqps.transport.base import Handler, TransportObserver, TransportStats
from zmqps.wire import ERROR, Limits, Message, decode, error_reply
from zmqps.wire.errors import ProtocolError, ZmqpsError

__all__ = ["Dispatcher"]

log = logging.getLogger("zmqps.transport")

Outcome = Message | Awaitable[Message] | None


class Dispatcher:
    """Turns request frames into a reply (or an awaitable of one, or None: drop)."""

    def __init__(
        self,
        handler: Handler,
        *,
        name: str,
        stats: TransportStats,
        limits: Limits | None = None,
        clock_skew: float = 1.0,
        observer: TransportObserver | None = None,
    ) -> None:
        self.handler = handler
        self.observer = observer
        self.name = name
        self.stats = stats
        self.limits = limits or Limits()
        self.clock_skew = clock_skew

    def dispatch(self, frames: Sequence[Any], peer: object = "") -> Outcome:
        try:
            msg = decode(frames, self.limits)
        except ProtocolError as exc:
            self.stats.bad_messages += 1
            rid = getattr(exc, "request_id", None)
            log.debug("%s: bad message from %r: %s", self.name, peer, exc)
            return None if rid is None else error_reply(rid, exc)
        if msg.is_reply:
            self.stats.bad_messages += 1
            return error_reply(msg.id, ProtocolError("servers accept requests only"))
        if msg.deadline is not None and time.time() > msg.deadline + self.clock_skew:
            self.stats.expired += 1
            log.debug("%s: dropped expired %s from %r", self.name, msg.op, peer)
            return None
        self.stats.requests += 1
        self.stats.by_op[msg.op] = self.stats.by_op.get(msg.op, 0) + 1
        started = time.perf_counter()
        try:
            result = self.handler(msg)
        except Exception as exc:
            return self._observed(msg, self.error(msg, exc), started)
        if inspect.isawaitable(result):
            return self._finish(msg, result, started)
        return self._observed(msg, result, started)

    async def _finish(self, msg: Message, result: Awaitable[Message], started: float) -> Message:
        try:
            out = await result
        except Exception as exc:
            out = self.error(msg, exc)
        return self._observed(msg, out, started)

    def _observed(self, msg: Message, out: Message, started: float) -> Message:
        if self.observer is not None:
            status = out.body.get("code", "internal") if out.op == ERROR else "ok"
            self.observer.request_done(msg.op, status, time.perf_counter() - started)
        return out

    def error(self, msg: Message, exc: Exception) -> Message:
        self.stats.errors += 1
        if isinstance(exc, ZmqpsError):
            log.debug("%s: %s failed: %s", self.name, msg.op, exc)
        else:
            log.exception("%s: internal error serving %s from %s", self.name, msg.op, msg.sender)
        return error_reply(msg.id, exc)
