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
* Under CURVE (and ``options.seal``), at its first bulk request, the client agrees a
  session with the server over CURVE (``seal_hello``) and connects a second, plaintext DEALER to the
  server's data connection; once that connection is up, every request of a
  :data:`~zmqps.wire.ops.BULK_OPS` op or with tensors goes there, each frame sealed
  (:mod:`zmqps.transport.seal`), and its reply comes back sealed. Until then (or if
  the data port cannot be reached, or the server has no data connection) those
  requests go on CURVE like the rest. A new session is agreed when the CURVE
  connection comes back (the server may have restarted), when the server says it
  knows the key no more, and before a key has sealed :data:`REKEY_AFTER` frames.
* The data connection is admitted at its handshake with the session's PLAIN
  credentials (its key id and :func:`~zmqps.transport.seal.credential`, in hex),
  which hold for one connection: each session agreed opens a new data connection
  with its own (the old one is closed: the resendable requests it carried are sent
  again on the new one once its handshake succeeds). A handshake the server refuses
  (it knows the session no more: it restarted, or forgot it while the connection
  was down) agrees a new session, once per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from zmqps.transport.base import (
    TransportObserver,
    TransportStats,
    cancel_and_wait,
    retry_busy,
    within,
)
from zmqps.transport.options import SocketOptions, port_open, send_now, tcp_endpoint
from zmqps.transport.seal import (
    NOTICE,
    OVERHEAD,
    RANDOM_BYTES,
    REKEY_AFTER,
    Opener,
    Sealer,
    SealRefused,
    credential,
    derive,
    key_id_of,
)
from zmqps.wire import ERROR, Limits, Message, Tensor, decode, encode, request
from zmqps.wire.codec import buffer_specs
from zmqps.wire.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ProtocolError,
    ShutdownError,
    ZmqpsError,
    error_from_code,
)
from zmqps.wire.ops import BULK_OPS, SealAgreed, SealHello

__all__ = ["Client", "Landing"]

#: Where a reply's buffer may be opened straight into (sealed replies): given its
#: dtype, shape, kind, ref and offset, a writable buffer of exactly its bytes, or None.
Landing = Callable[[np.dtype[Any], tuple[int, ...], str, int, int], Any]

log = logging.getLogger("zmqps.transport")


class Client:
    """A DEALER connected to ``address``; ``identity`` names this peer to the server."""

    #: :meth:`request` takes ``landing`` (where a sealed reply's buffers are opened)
    lands = True

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
        try:
            self._options.apply_dealer(self._sock, identity.encode())
            self._sock.connect(self.endpoint)
        except zmq.ZMQError as exc:  # an endpoint libzmq cannot parse (a peer named it)
            self._sock.close(linger=0)
            raise InvalidArgument(f"cannot connect to {address[:200]!r}: {exc}") from None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Message]] = {}
        #: frames of the pending requests that may be sent again (attempts > 1), and
        #: whether they went on the data connection (sealed again before a resend)
        self._resendable: dict[int, tuple[bool, list[Any]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._monitor_sock: zmq.asyncio.Socket | None = None
        self._closed = False
        self.stats = TransportStats()
        #: the sealed data connection (under CURVE with ``options.seal``): the sealer
        #: of the session agreed last, the openers of the last two (replies to
        #: requests sealed with the one before may still come)
        self._sealing = (
            self._options.curve is not None
            and self._options.seal
            and self.endpoint.startswith("tcp://")
        )
        self._sealer: Sealer | None = None
        self._openers: dict[bytes, Opener] = {}
        #: where the buffers of a pending request's sealed reply are opened, by id
        self._landing: dict[int, Landing] = {}
        self._agreeing: asyncio.Task[None] | None = None
        self._data_sock: zmq.asyncio.Socket | None = None
        self._data_endpoint = ""
        self._data_up = False
        self._data_tasks: list[asyncio.Task[None]] = []
        self._data_monitor: zmq.asyncio.Socket | None = None

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
                if self._sealer is not None:
                    self._agree_soon()  # the server may have restarted: a new session
                self._resend_pending(sealed=False)

    def _resend_pending(self, sealed: bool) -> None:
        """Send again the resendable requests that went on the connection that is back
        (``sealed``: the data connection; sealed again, with new counters)."""
        again = [
            frames
            for rid, (on_data, frames) in self._resendable.items()
            if on_data == sealed and rid in self._pending and not self._pending[rid].done()
        ]
        if not again:
            return
        where = self._data_endpoint if sealed else self.endpoint
        log.info("connection to %s is back: sending %d requests again", where, len(again))
        for frames in again:
            try:
                self._send_frames(frames, sealed)
            except (zmq.Again, SealRefused):
                return  # the queue is full: the deadlines and attempts take over
            self.stats.resent += 1

    def _send_frames(self, frames: list[Any], sealed: bool) -> None:
        """Send a request's frames: on CURVE, or sealed on the data connection."""
        if not sealed or self._sealer is None or self._data_sock is None:
            send_now(self._sock, frames)
            return
        if self._sealer.next >= REKEY_AFTER:
            self._agree_soon()  # this key goes on until the new one is agreed
        send_now(self._data_sock, self._sealer.seal(frames))
        self.stats.sealed += 1

    # -- the sealed data connection ------------------------------------------------

    def _agree_soon(self) -> None:
        if self._closed or (self._agreeing is not None and not self._agreeing.done()):
            return
        self._agreeing = asyncio.ensure_future(self._agree())

    async def _agree(self) -> None:
        """Agree a session over CURVE; connect to the data port the server names."""
        mine = os.urandom(RANDOM_BYTES)
        # the session this one replaces: the server forgets it (and its credential)
        old = self._sealer.key_id.hex() if self._sealer is not None else None
        try:
            hello = SealHello(random=mine.hex(), retire=old)
            rep = await self._request_once(
                SealHello.OP, hello.to_wire(), (), min(self.timeout, 10.0)
            )
            agreed = SealAgreed.parse(rep.body)
            theirs, key_id = bytes.fromhex(agreed.random), bytes.fromhex(agreed.key)
            if len(theirs) != RANDOM_BYTES or len(key_id) != 8:
                raise ValueError("a random string or key id of the wrong length")
        except (ZmqpsError, ValueError) as exc:
            log.info(
                "%s: no sealed data connection (%s): bulk frames stay on CURVE",
                self.endpoint,
                exc,
            )
            return
        c2s, s2c = derive(mine, theirs, key_id)
        password = credential(mine, theirs, key_id).hex().encode()
        self._openers[key_id] = Opener(s2c, key_id)
        while len(self._openers) > 2:
            del self._openers[next(iter(self._openers))]
        self._sealer = Sealer(c2s, key_id)
        host = self.endpoint.rsplit(":", 1)[0]
        # PLAIN credentials are a connection's: a new session, a new connection (its
        # handshake sends the pending ones again, sealed with the new key)
        self._close_data()
        self._open_data(f"{host}:{agreed.port}", key_id.hex().encode(), password)

    def _open_data(self, endpoint: str, username: bytes, password: bytes) -> None:
        options = self._options
        limit = options.max_msg_size
        options = dataclasses.replace(
            options, curve=None, max_msg_size=limit + OVERHEAD if limit > 0 else limit
        )
        sock: zmq.asyncio.Socket = self._sock.context.socket(zmq.DEALER)
        options.apply_common(sock)  # no routing id: each connection is a new peer
        sock.setsockopt(zmq.PLAIN_USERNAME, username)
        sock.setsockopt(zmq.PLAIN_PASSWORD, password)
        events = (
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        # watched before it connects: an event before the monitor is never seen
        self._data_monitor = sock.get_monitor_socket(events)
        sock.connect(endpoint)
        self._data_sock = sock
        self._data_endpoint = endpoint
        self._data_tasks = [
            asyncio.ensure_future(self._watch_data(self._data_monitor)),
            asyncio.ensure_future(self._read_data(sock)),
        ]

    def _close_data(self) -> None:
        self._data_up = False
        for task in self._data_tasks:
            task.cancel()
        self._data_tasks = []
        if self._data_sock is not None:
            if self._data_monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._data_sock.disable_monitor()
                self._data_monitor.close(linger=0)
                self._data_monitor = None
            self._data_sock.close(linger=0)
            self._data_sock = None
        self._data_endpoint = ""

    async def _watch_data(self, monitor: zmq.asyncio.Socket) -> None:
        from zmq.utils.monitor import parse_monitor_message

        refused = False
        while True:
            event = int(parse_monitor_message(await monitor.recv_multipart())["event"])
            if event == zmq.EVENT_DISCONNECTED:
                self._data_up = False
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and not refused:
                # the server knows this session no more (it restarted, or forgot it
                # while the connection was down): a new one, once per connection
                refused = True
                log.info(
                    "%s refused the session's credentials: agreeing a new one", self._data_endpoint
                )
                self._agree_soon()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._data_up = True
                # back, or a new connection in place of one to a port the server no
                # longer has (it restarted): what was sent on the old one is lost
                self._resend_pending(sealed=True)

    async def _read_data(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            received = sum(len(f) for f in frames)
            self.stats.bytes_in += received
            if self.observer is not None:
                self.observer.bytes_in(received)
            if frames[0].bytes == NOTICE:
                reason = frames[-1].bytes.decode(errors="replace")[:32] if len(frames) > 2 else ""
                log.warning(
                    "%s refused a sealed request (%s): agreeing a new session",
                    self._data_endpoint,
                    reason,
                )
                self._agree_soon()
                continue
            key_id = key_id_of(frames[0])
            opener = self._openers.get(key_id) if key_id is not None else None
            try:
                if opener is None:
                    raise SealRefused("unknown_key", f"a reply from {self._data_endpoint}")
                plain = opener.open(frames, self._land if self._landing else None)
            except SealRefused as exc:
                self.stats.seal_refusals += 1
                if self.observer is not None:
                    self.observer.seal_refused(exc.reason)
                log.warning("%s: %s", self._data_endpoint, exc)
                continue
            except Exception as exc:  # nobody planned it: the reader goes on
                self._reading_failed(exc)
                continue
            self._deliver_safely(plain)

    async def request(
        self,
        op: str,
        body: Mapping[str, Any] | None = None,
        tensors: Sequence[Tensor] = (),
        *,
        timeout: float | None = None,
        attempts: int = 1,
        slot: int | None = None,
        landing: Landing | None = None,
    ) -> Message:
        """Send a request and wait for its reply; raises the typed error of an error reply.
        ``slot``: the PS state it is for, instead of the client's. ``landing``: where
        the buffers of a sealed reply may be opened (:data:`Landing`): the caller then
        finds them there, its copy already made."""
        timeout = self.timeout if timeout is None else timeout
        slot = self.slot if slot is None else slot
        for attempt in range(1, attempts + 1):
            try:
                return await retry_busy(
                    lambda left: self._request_once(
                        op, body, tensors, left, attempts > 1, slot, landing
                    ),
                    timeout,
                )
            except DeadlineExceeded:
                if attempt == attempts:
                    raise
                log.info("%s to %s: no reply in %.1fs, retrying", op, self.endpoint, timeout)
        raise AssertionError("unreachable")

    async def listening(self, timeout: float = 1.0) -> bool:
        """Whether a process accepts connections at the server's address (one slow to
        answer is not one gone)."""
        return await port_open(self.endpoint, timeout)

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

        def settled(done: asyncio.Future[Message]) -> None:
            self._pending.pop(sent[0], None)  # cancelled before it ran: _reply's own
            # cleanup never runs. A reply cut short by this client's close is nobody's
            # error: its caller let it go (a link closed while entries were on their
            # way), and asyncio would print it as never retrieved
            if self._closed and not done.cancelled():
                done.exception()

        task.add_done_callback(settled)
        return task

    async def _request_once(
        self,
        op: str,
        body: Mapping[str, Any] | None,
        tensors: Sequence[Tensor],
        timeout: float,
        resendable: bool = False,
        slot: int | None = None,
        landing: Landing | None = None,
    ) -> Message:
        sent = self._send(op, body, tensors, timeout, resendable, slot)
        if landing is not None:
            self._landing[sent[0]] = landing
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
        head, cap = len(frames[0]), self._limits.max_header_bytes
        if head > cap:
            # the server would drop it unread (a debug line there) and this request time
            # out, retried for as long as its caller waits, with no word of why
            raise InvalidArgument(
                f"{op} to {self.endpoint}: a header of {head:,} bytes, past the {cap:,} a"
                " server reads: the request names too much at once (variables, shards, ids)"
            )
        limit = self._options.max_msg_size
        for f in frames:
            size = getattr(f, "nbytes", None) or len(f)
            if limit > 0 and size > limit:
                raise InvalidArgument(
                    f"{op} to {self.endpoint}: a frame of {size} bytes is over MAXMSGSIZE"
                    f" ({limit}); the peer would drop it and the connection: send smaller chunks"
                )
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        bulk = op in BULK_OPS or bool(tensors)
        sealed = bulk and self._data_up
        if bulk and self._sealing and self._sealer is None:
            self._agree_soon()  # the first bulk request: this one still goes on CURVE
        try:
            self._send_frames(frames, sealed)
        except SealRefused:  # the key is used up: on CURVE until the next is agreed
            self._agree_soon()
            sealed = False
            send_now(self._sock, frames)
        except zmq.Again:
            raise DeadlineExceeded(
                f"{op} to {self.endpoint}: send queue full (peer unreachable?)"
            ) from None
        self._pending[rid] = fut
        if resendable:
            self._resendable[rid] = (sealed, frames)
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
            self._landing.pop(rid, None)
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
            self._deliver_safely(frames)

    def _deliver_safely(self, frames: Sequence[Any]) -> None:
        """:meth:`_deliver`; an error nobody planned for (a bug) does not stop the
        reader, which would leave every later request waiting out its deadline."""
        try:
            self._deliver(frames)
        except Exception as exc:
            self._reading_failed(exc)

    def _reading_failed(self, exc: Exception) -> None:
        """A reply whose reading failed on an error nobody planned for: logged (with
        its traceback) and counted, and every request waiting for a reply fails with
        it at once (its own reply may have been that one) instead of waiting out its
        deadline; the reader goes on."""
        self.stats.bad_messages += 1
        log.error("%s: reading a reply failed: %r", self.endpoint, exc, exc_info=exc)
        self.fail_pending(ProtocolError(f"reading a reply from {self.endpoint} failed: {exc!r}"))

    def _land(self, header: memoryview) -> list[Any]:
        """Where a sealed reply's buffers are opened: its request's landing's answers."""
        rid, specs = buffer_specs(header, self._limits)
        landing = self._landing.get(rid) if rid is not None else None
        fut = self._pending.get(rid) if rid is not None else None
        if landing is None or fut is None or fut.done():
            return []  # a late reply: opened in place
        dests = [landing(*spec) for spec in specs]
        self.stats.landed += sum(d is not None for d in dests)
        return dests

    def _deliver(self, frames: Sequence[Any]) -> None:
        """A reply's frames: matched to its request (or dropped, counted)."""
        try:
            msg = decode(frames, self._limits)
        except ProtocolError as exc:
            self.stats.bad_messages += 1
            log.warning("bad reply from %s: %s", self.endpoint, exc)
            rid = getattr(exc, "request_id", None)
            fut = self._pending.get(rid) if rid is not None else None
            if fut is not None and not fut.done():
                fut.set_exception(exc)
            return
        fut = self._pending.get(msg.id)
        if fut is None or fut.done():
            self.stats.late_replies += 1
            return
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
            if self._agreeing is not None:
                await cancel_and_wait(self._agreeing)
            for task in self._data_tasks:
                await cancel_and_wait(task, zmq.ZMQError)
        finally:  # closed even when this close is cancelled: an open socket hangs ctx.term()
            if self._agreeing is not None:
                self._agreeing.cancel()
            self._close_data()
            if self._watcher is not None:
                self._watcher.cancel()
            if self._monitor_sock is not None:
                # A monitor socket left open hangs ctx.term().
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.disable_monitor()
                self._monitor_sock.close(linger=0)
                self._monitor_sock = None
            self._sock.close(linger=linger_ms)
