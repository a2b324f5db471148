"""Asyncio DEALER client: many requests in flight on one socket, replies matched by id.

Rules of this module:

* One client talks to one peer (one DEALER per peer, DESIGN §5).
* Every request has a deadline: it is carried in the header (the server drops
  it once expired) and enforced here (:class:`DeadlineExceeded`).
* A reply whose id is unknown (late, after its deadline) is dropped and counted.
* An error reply becomes the typed exception of its code, here and only here.
* ``attempts > 1`` resends the *same* message (same body) after a deadline;
  only ops that are idempotent or deduplicated by the server may use it
  (pushes are: (worker, incarnation, sequence)).
* Such requests are also sent again, at once and with the same id, when the
  connection comes back after a disconnect (a partition noticed by the ZMTP
  heartbeat, a restarted peer): whatever was on the lost connection is gone, and
  waiting for the deadline would stall the caller for nothing. The server's
  deadline check still drops a copy that arrives too late.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import zmq
import zmq.asyncio

from zmqps.transport.base import (
    TransportObserver,
    TransportStats,
    cancel_and_wait,
    retry_busy,
    within,
)
from zmqps.transport.options import SocketOptions, send_now, tcp_endpoint
from zmqps.wire import ERROR, Limits, Message, Tensor, decode, encode, request
from zmqps.wire.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ProtocolError,
    ShutdownError,
    ZmqpsError,
    error_from_code,
)

__all__ = ["Client"]

log = logging.getLogger("zmqps.transport")


class Client:
    """A DEALER connected to ``address``; ``identity`` names this peer to the server."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        identity: str,
        *,
        options: SocketOptions | None = None,
        limits: Limits | None = None,
        timeout: float = 30.0,
        observer: TransportObserver | None = None,
        slot: int | None = None,
    ) -> None:
        self.endpoint = tcp_endpoint(address)
        #: the PS state of the server's process every request is for (None: its own)
        self.slot = slot
        #: told about every request made (op, outcome, seconds) and its bytes
        self.observer = observer
        self.identity = identity
        self.timeout = timeout
        self._options = options or SocketOptions()
        self._limits = limits or Limits()
        self._sock: zmq.asyncio.Socket = ctx.socket(zmq.DEALER)
        self._options.apply_dealer(self._sock, identity.encode())
        self._sock.connect(self.endpoint)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Message]] = {}
        #: frames of the pending requests that may be sent again (attempts > 1)
        self._resendable: dict[int, list[Any]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._monitor_sock: zmq.asyncio.Socket | None = None
        self._closed = False
        self.stats = TransportStats()

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read_loop())
            events = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            self._monitor_sock = self._sock.get_monitor_socket(events)
            self._watcher = asyncio.ensure_future(self._watch_connection(self._monitor_sock))

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        from zmq.utils.monitor import parse_monitor_message

        lost = False
        while True:
            event = int(parse_monitor_message(await monitor.recv_multipart())["event"])
            if event == zmq.EVENT_DISCONNECTED:
                lost = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and lost:
                lost = False
                self._resend_pending()

    def _resend_pending(self) -> None:
        again = [
            (rid, frames)
            for rid, frames in self._resendable.items()
            if rid in self._pending and not self._pending[rid].done()
        ]
        if not again:
            return
        log.info("connection to %s is back: sending %d requests again", self.endpoint, len(again))
        for _, frames in again:
            try:
                send_now(self._sock, frames)
            except zmq.Again:
                return  # the queue is full: the deadlines and attempts take over
            self.stats.resent += 1

    async def request(
        self,
        op: str,
        body: Mapping[str, Any] | None = None,
        tensors: Sequence[Tensor] = (),
        *,
        timeout: float | None = None,
        attempts: int = 1,
        slot: int | None = None,
    ) -> Message:
        """Send a request and wait for its reply; raises the typed error of an error reply.
        ``slot``: the PS state it is for, instead of the client's."""
        timeout = self.timeout if timeout is None else timeout
        slot = self.slot if slot is None else slot
        for attempt in range(1, attempts + 1):
            try:
                return await retry_busy(
                    lambda left: self._request_once(op, body, tensors, left, attempts > 1, slot),
                    timeout,
                )
            except DeadlineExceeded:
                if attempt == attempts:
                    raise
                log.info("%s to %s: no reply in %.1fs, retrying", op, self.endpoint, timeout)
        raise AssertionError("unreachable")

    def submit(
        self,
        op: str,
        body: Mapping[str, Any] | None = None,
        tensors: Sequence[Tensor] = (),
        *,
        timeout: float | None = None,
        slot: int | None = None,
    ) -> asyncio.Future[Message]:
        """Send a request now, before returning (its frames are on their way while the
        caller goes on), and the future of its reply: the reply, or the typed error of
        an error reply, or :class:`DeadlineExceeded` past ``timeout``. Sent once: a
        ``busy`` answer is the caller's to handle."""
        timeout = self.timeout if timeout is None else timeout
        slot = self.slot if slot is None else slot
        sent = self._send(op, body, tensors, timeout, False, slot)
        task = asyncio.ensure_future(self._reply(op, timeout, *sent))
        # cancelled before it ran, _reply's own cleanup never runs
        task.add_done_callback(lambda _: self._pending.pop(sent[0], None))
        return task

    async def _request_once(
        self,
        op: str,
        body: Mapping[str, Any] | None,
        tensors: Sequence[Tensor],
        timeout: float,
        resendable: bool = False,
        slot: int | None = None,
    ) -> Message:
        sent = self._send(op, body, tensors, timeout, resendable, slot)
        return await self._reply(op, timeout, *sent)

    def _send(
        self,
        op: str,
        body: Mapping[str, Any] | None,
        tensors: Sequence[Tensor],
        timeout: float,
        resendable: bool,
        slot: int | None,
    ) -> tuple[int, asyncio.Future[Message], int]:
        """Send one request: ``(id, the future of its reply, bytes sent)``; whoever
        gets them must pass them to :meth:`_reply`, which forgets the request."""
        if self._closed:
            raise ShutdownError(f"client to {self.endpoint} is closed")
        self._ensure_reader()
        rid = next(self._ids)
        msg = request(
            op,
            body,
            tensors,
            id=rid,
            sender=self.identity,
            deadline=time.time() + timeout,
            slot=slot,
        )
        frames = encode(msg)
        limit = self._options.max_msg_size
        for f in frames:
            size = getattr(f, "nbytes", None) or len(f)
            if limit > 0 and size > limit:
                raise InvalidArgument(
                    f"{op} to {self.endpoint}: a frame of {size} bytes is over MAXMSGSIZE"
                    f" ({limit}); the peer would drop it and the connection: send smaller chunks"
                )
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        try:
            send_now(self._sock, frames)
        except zmq.Again:
            raise DeadlineExceeded(
                f"{op} to {self.endpoint}: send queue full (peer unreachable?)"
            ) from None
        self._pending[rid] = fut
        if resendable:
            self._resendable[rid] = frames
        self.stats.requests += 1
        sent = sum(getattr(f, "nbytes", None) or len(f) for f in frames)
        self.stats.bytes_out += sent
        return rid, fut, sent

    async def _reply(
        self, op: str, timeout: float, rid: int, fut: asyncio.Future[Message], sent: int
    ) -> Message:
        """The reply to the request :meth:`_send` sent."""
        started = time.perf_counter()
        status = "ok"
        try:
            return await within(fut, timeout)
        except asyncio.TimeoutError:
            self.stats.timeouts += 1
            status = DeadlineExceeded.code
            raise DeadlineExceeded(
                f"{op} to {self.endpoint}: no reply within {timeout:g}s"
            ) from None
        except ZmqpsError as exc:
            status = exc.code
            raise
        finally:
            self._pending.pop(rid, None)
            self._resendable.pop(rid, None)
            if self.observer is not None:
                self.observer.bytes_out(sent)
                self.observer.request_done(op, status, time.perf_counter() - started)

    async def _read_loop(self) -> None:
        sock = self._sock
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except zmq.ZMQError:
                if self._closed:
                    return
                raise
            received = sum(len(f) for f in frames)
            self.stats.bytes_in += received
            if self.observer is not None:
                self.observer.bytes_in(received)
            try:
                msg = decode(frames, self._limits)
            except ProtocolError as exc:
                self.stats.bad_messages += 1
                log.warning("bad reply from %s: %s", self.endpoint, exc)
                rid = getattr(exc, "request_id", None)
                fut = self._pending.get(rid) if rid is not None else None
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
                continue
            fut = self._pending.get(msg.id)
            if fut is None or fut.done():
                self.stats.late_replies += 1
                continue
            self.stats.replies += 1
            if msg.op == ERROR:
                self.stats.errors += 1
                fut.set_exception(error_from_code(msg.body["code"], msg.body["message"]))
            elif not msg.is_reply:
                fut.set_exception(ProtocolError(f"expected a reply, got {msg.op!r}"))
            else:
                fut.set_result(msg)

    def fail_pending(self, exc: BaseException) -> int:
        """Fail every request waiting for a reply with ``exc`` (their peer's state is gone,
        e.g. the cluster was restored); returns how many."""
        n = 0
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
                n += 1
        return n

    async def close(self, linger_ms: int | None = None) -> None:
        """Close the socket. ``linger_ms``: how long what is still queued may wait to
        leave (None: the socket's option; 0 drops it, so that ``ctx.term()`` returns at
        once even when the peer is gone, for requests with nothing to deliver late)."""
        if self._closed:
            return
        self._closed = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ShutdownError(f"client to {self.endpoint} closed"))
        try:
            if self._reader is not None:
                await cancel_and_wait(self._reader, zmq.ZMQError)
            if self._watcher is not None:
                await cancel_and_wait(self._watcher, zmq.ZMQError)
        finally:  # closed even when this close is cancelled: an open socket hangs ctx.term()
            if self._watcher is not None:
                self._watcher.cancel()
            if self._monitor_sock is not None:
                # A monitor socket left open hangs ctx.term().
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.disable_monitor()
                self._monitor_sock.close(linger=0)
                self._monitor_sock = None
            self._sock.close(linger=linger_ms)
