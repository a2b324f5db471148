"""Request dispatch shared by the ZeroMQ server and the in-memory fake.

Requests whose handler waits (long polls, waits on a step or a write) are pending
until they are answered; their number is bounded per peer (``MAX_PENDING_PER_PEER``)
and in all (``MAX_PENDING``): one more is refused at once with :class:`Busy`
(counted in ``stats.busy``), so no client can pin a server's memory with waits.
When all peers together are at the bound, a peer holding few is not refused while
another holds many long polls: the heaviest peer's oldest long poll is answered
``busy`` (its client asks again; nothing is lost) and the newcomer takes its place.
So a flood of long polls from a few peers cannot shut out the chief's and the
workers' requests (each holds a few).

This is the one boundary where a bad request becomes an error reply: a
:class:`ZmqpsError` keeps its code; anything else becomes ``internal`` and is
logged with its traceback. Nothing here does IO.

A pending request comes back as a :class:`Pending` (await it for the reply); one of
the ops in :data:`~zmqps.wire.ops.LONG_POLLS` says it may be dropped when its peer
disconnects (the server does that: it knows the connections).

A handler that did its request's work and only holds the reply a short while (a sync
push waiting for its step's values or its next token) returns a :class:`Held`: at the
bound it is not refused ``busy`` (that says nothing was done) but answered at once with
what it has (:meth:`Held.now`).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from dataclasses import replace
from typing import Any

from zmqps.logs import LINES_PER_KIND, RateLimitedLog
from zmqps.transport.base import Handler, TransportObserver, TransportStats
from zmqps.wire import ERROR, Limits, Message, decode, error_reply
from zmqps.wire.errors import Busy, ProtocolError, ZmqpsError
from zmqps.wire.ops import LONG_POLLS

__all__ = ["MAX_PENDING", "MAX_PENDING_PER_PEER", "Dispatcher", "Held", "Pending"]

#: Requests of one peer pending at once (a worker or the chief has a few long polls
#: and some pipelined requests; a chief serving 5,000 simulated workers holds one long
#: poll per worker, from many peers).
MAX_PENDING_PER_PEER = 1024
#: Requests pending at once, all peers together (10-17 KiB of a server's memory each
#: while they wait, measured).
MAX_PENDING = 16384
#: Seconds between two log lines about refused requests (all are counted).
_LOG_EVERY_S = 30.0

log = logging.getLogger("zmqps.transport")


class _Polls:
    """The long polls pending per peer, in arrival order, and the peers by how many
    they hold (the heaviest found in O(1))."""

    def __init__(self) -> None:
        self.of: dict[object, dict[int, asyncio.Future[Message]]] = {}
        self._by_count: dict[int, set[object]] = {}
        self._top = 0

    def add(self, peer: object, key: int, task: asyncio.Future[Message]) -> None:
        held = self.of.setdefault(peer, {})
        self._move(peer, len(held), len(held) + 1)
        held[key] = task

    def remove(self, peer: object, key: int) -> None:
        held = self.of.get(peer)
        if held is None or key not in held:
            return
        self._move(peer, len(held), len(held) - 1)
        del held[key]
        if not held:
            del self.of[peer]

    def heaviest(self) -> tuple[object, int]:
        """The peer holding the most long polls (None, 0: none)."""
        if not self._top:
            return None, 0
        return next(iter(self._by_count[self._top])), self._top

    def oldest(self, peer: object) -> tuple[int, asyncio.Future[Message]]:
        return next(iter(self.of[peer].items()))

    def _move(self, peer: object, before: int, after: int) -> None:
        if before:
            bucket = self._by_count[before]
            bucket.discard(peer)
            if not bucket:
                del self._by_count[before]
        if after:
            self._by_count.setdefault(after, set()).add(peer)
        self._top = max(self._top, after)
        while self._top and self._top not in self._by_count:
            self._top -= 1


class Pending:
    """A request whose handler waits: await it for the reply (or cancel it: the
    request is then forgotten, and its peer's pending count goes down)."""

    __slots__ = ("_forget", "_reply", "droppable", "op")

    def __init__(
        self,
        op: str,
        reply: Coroutine[Any, Any, Message],
        forget: Callable[[], None] | None = None,
    ) -> None:
        self.op = op
        #: a long poll: nothing is lost when it is dropped (its client sends it again)
        self.droppable = op in LONG_POLLS
        self._reply = reply
        #: what the reply's own ending does (its room given back), for a reply that is
        #: never awaited
        self._forget = forget

    def __await__(self) -> Generator[Any, None, Message]:
        return self._reply.__await__()

    def close(self) -> None:
        """Forget the reply if it was never awaited (the task awaiting it was cancelled
        before it ran: a long poll whose connection closed in the same turn): its room
        among the pending requests is given back, and the work it waited on stopped.
        Nothing once it began (its own ending does that)."""
        if inspect.getcoroutinestate(self._reply) != inspect.CORO_CREATED:
            return
        self._reply.close()
        if self._forget is not None:
            self._forget()


class Held:
    """The reply to a request whose work is done, held a short while for something
    more it may bring (``wait``); ``now`` answers at once with what there is. A
    dispatcher with no room for one more pending request answers it with ``now``:
    ``busy`` would say nothing was done, and the request sent again would be a
    duplicate of one applied."""

    def __init__(self, wait: Coroutine[Any, Any, Message], now: Callable[[], Message]) -> None:
        self._wait = wait
        self._now = now

    def __await__(self) -> Generator[Any, None, Message]:
        return self._wait.__await__()

    def now(self) -> Message:
        """The reply at once (the wait, never started, is closed)."""
        self._wait.close()
        return self._now()


Outcome = Message | Pending | None


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
        max_pending: int = MAX_PENDING,
        max_pending_per_peer: int = MAX_PENDING_PER_PEER,
        admit: Callable[[object], str | None] | None = None,
    ) -> None:
        self.handler = handler
        #: says why a peer's request must wait (refused ``busy``, nothing done), or None
        self.admit = admit
        self.max_pending = max_pending
        self.max_pending_per_peer = max_pending_per_peer
        #: requests pending per peer (a peer leaves the map with its last one)
        self._pending: dict[object, int] = {}
        self._pending_total = 0
        #: the long polls among them (what may be answered ``busy`` to make room)
        self._polls = _Polls()
        self._keys = itertools.count()
        #: long polls answered ``busy`` to make room, not yet ended
        self._evicted: set[int] = set()
        self._busy_log = RateLimitedLog(log, _LOG_EVERY_S, lines_per_kind=LINES_PER_KIND)
        self._internal_log = RateLimitedLog(log, _LOG_EVERY_S, lines_per_kind=LINES_PER_KIND)
        self.observer = observer
        self.name = name
        self.stats = stats
        self.limits = limits or Limits()
        self.clock_skew = clock_skew

    def dispatch(self, frames: Sequence[Any], peer: object = "", user: str = "") -> Outcome:
        """Serve one request; ``user``: the authenticated name of its sender (CURVE),
        handed to the handler as :attr:`Message.peer`."""
        try:
            msg = decode(frames, self.limits)
        except ProtocolError as exc:
            self.stats.bad_messages += 1
            if self.observer is not None:  # op "unknown": a bad message names no op we trust
                self.observer.request_done("unknown", ProtocolError.code, 0.0)
            rid = getattr(exc, "request_id", None)
            log.debug("%s: bad message from %r: %s", self.name, peer, exc)
            return None if rid is None else error_reply(rid, exc)
        if user:
            msg = replace(msg, peer=user)
        if msg.is_reply:
            self.stats.bad_messages += 1
            return error_reply(msg.id, ProtocolError("servers accept requests only"))
        if msg.deadline is not None and time.time() > msg.deadline + self.clock_skew:
            # past its deadline (its sender gave up on it, or the clocks disagree):
            # dropped unanswered, counted (zmqps_requests_total{status="expired"})
            self.stats.expired += 1
            if self.observer is not None:
                self.observer.request_done(msg.op, "expired", 0.0)
            self._busy_log.warning(
                "%s: dropped %s from %r: its deadline passed %.1f s ago (its sender gave"
                " up on it: sent while this server was stopped, restarting or busy, or a"
                " clock is off)",
                self.name,
                msg.op,
                peer,
                time.time() - msg.deadline,
                key=("expired", peer),
            )
            return None
        self.stats.requests += 1
        self.stats.by_op[msg.op] = self.stats.by_op.get(msg.op, 0) + 1
        started = time.perf_counter()
        why = self.admit(peer) if self.admit is not None else None
        if why is not None:
            return self._observed(msg, self._refuse(msg, peer, why), started)
        try:
            result = self.handler(msg)
        except Exception as exc:
            return self._observed(msg, self.error(msg, exc), started)
        if inspect.isawaitable(result):
            held = self._pending.get(peer, 0)
            refuse = held >= self.max_pending_per_peer
            if not refuse and self._pending_total >= self.max_pending:
                refuse = not self._make_room(peer, held)
            if refuse and isinstance(result, Held):  # its work is done: answered now
                try:
                    out = result.now()
                except Exception as exc:
                    out = self.error(msg, exc)
                return self._observed(msg, out, started)
            if refuse:
                if inspect.iscoroutine(result):
                    result.close()  # never started: nothing was done
                return self._observed(msg, self._busy(msg, peer, held), started)
            self._pending[peer] = held + 1
            self._pending_total += 1
            if msg.op in LONG_POLLS:  # may be answered busy to make room: its own task
                key = next(self._keys)
                task = asyncio.ensure_future(result)
                self._polls.add(peer, key, task)
                return Pending(
                    msg.op,
                    self._finish(msg, task, started, peer, key),
                    lambda: self._forget(peer, key, task),
                )
            return Pending(
                msg.op,
                self._finish(msg, result, started, peer),
                lambda: self._forget(peer, None, result),
            )
        return self._observed(msg, result, started)

    def _forget(self, peer: object, key: int | None, work: Awaitable[Any]) -> None:
        """A pending request whose reply was never awaited: its place is given back (as
        :meth:`_finish` does when it ends) and its work stopped (a long poll's task
        cancelled, a handler never started closed)."""
        self._let_go(peer, key)
        if isinstance(work, asyncio.Future):
            work.cancel()
        elif inspect.iscoroutine(work):
            work.close()

    def _let_go(self, peer: object, key: int | None) -> None:
        """A pending request of ``peer`` ended: its place goes (unless an eviction gave
        it up already), and its long poll (``key``) is forgotten."""
        if key is not None and key in self._evicted:
            self._evicted.discard(key)  # its place was given up when it was evicted
            return
        if key is not None:
            self._polls.remove(peer, key)
        self._release(peer)

    def _make_room(self, peer: object, held: int) -> bool:
        """All peers together hold as many requests as allowed: answer the oldest long
        poll of the peer holding the most ``busy`` (its client asks again), if it holds
        more than ``peer``'s ``held`` + 1; True once room was made."""
        heavy, count = self._polls.heaviest()
        if heavy is None or heavy == peer or count <= held + 1:
            return False
        key, task = self._polls.oldest(heavy)
        self._polls.remove(heavy, key)
        self._evicted.add(key)
        total = self._pending_total
        self._release(heavy)  # its place is the newcomer's from now on
        task.cancel()
        self.stats.busy += 1
        self._busy_log.warning(
            "%s: %d pending in all (the limit): answering a long poll of %r busy to serve"
            " %r (%d pending there, %d here; %d refused so far)",
            self.name,
            total,
            heavy,
            peer,
            count,
            held,
            self.stats.busy,
            key="evict",
        )
        return True

    def _release(self, peer: object) -> None:
        self._pending_total -= 1
        left = self._pending[peer] - 1
        if left:
            self._pending[peer] = left
        else:
            del self._pending[peer]

    @property
    def pending(self) -> int:
        """Requests pending now (all peers)."""
        return self._pending_total

    def _busy(self, msg: Message, peer: object, held: int) -> Message:
        self.stats.busy += 1
        self._busy_log.warning(
            "%s: refusing requests: %d pending from %r, %d in all (limits %d, %d;"
            " %d refused so far)",
            self.name,
            held,
            peer,
            self._pending_total,
            self.max_pending_per_peer,
            self.max_pending,
            self.stats.busy,
        )
        who = "this peer" if held >= self.max_pending_per_peer else "all peers"
        return error_reply(msg.id, Busy(f"{self.name}: too many requests of {who} pending"))

    def _refuse(self, msg: Message, peer: object, why: str) -> Message:
        self.stats.busy += 1
        self._busy_log.warning(
            "%s: refusing requests of %r: %s (%d refused so far)",
            self.name,
            peer,
            why,
            self.stats.busy,
            key="unread",
        )
        return error_reply(msg.id, Busy(f"{self.name}: {why}: read them first"))

    async def _finish(
        self,
        msg: Message,
        result: Awaitable[Message],
        started: float,
        peer: object,
        key: int | None = None,
    ) -> Message:
        try:
            out = await result
        except asyncio.CancelledError:
            if key is None or key not in self._evicted:
                raise
            out = error_reply(
                msg.id,
                Busy(f"{self.name}: too many requests pending here: ask again later"),
            )
        except Exception as exc:
            out = self.error(msg, exc)
        finally:
            self._let_go(peer, key)
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
            # a traceback once per interval per operation: a client that triggers the
            # same failure in a loop cannot flood the log (every one is counted)
            self._internal_log.error(
                "%s: internal error serving %s from %s",
                self.name,
                msg.op,
                msg.sender,
                key=msg.op,
                exc_info=True,
            )
        return error_reply(msg.id, exc)
