"""Asyncio ROUTER server: receive, dispatch to a handler, reply.

Rules of this module:

* Decoding and error translation live in :mod:`zmqps.transport.dispatch` (shared
  with the in-memory fake). The server never dies because of one request.
* A message whose request id cannot be read is dropped and counted; so is a
  request past its deadline (its sender has already given up on it).
* The ROUTER is read through a reader on its descriptor (``loop.add_reader``), not
  asyncio's socket wrapper: a turn takes every message waiting, up to
  :data:`RECV_BATCH`, and replies are non-blocking sends. The descriptor is
  edge-triggered, so a turn ends only once ``EVENTS`` says no message waits, and a
  reply sent outside a turn looks at ``EVENTS`` again.
* Handlers returning a plain reply run inline, in arrival order; handlers
  returning an awaitable run as tasks the server keeps (and cancels on stop).
* A reply to a gone or non-reading peer is dropped and counted, never blocks.
* A long poll (:data:`~zmqps.wire.ops.LONG_POLLS`) is dropped as soon as the
  connection it came on is gone (a socket monitor's disconnect events, matched by
  the connection's file descriptor): its peer died or will send it again on its new
  connection, so a dead peer's waits pin nothing. The monitor is read before a
  poll is recorded, so a poll of a new connection that reuses a gone one's
  descriptor is never taken for one of the gone connection.
* With CURVE keys (``options.curve``) the ZAP authenticator is running before the
  socket binds, or :meth:`bind` raises; refused clients (ZAP) and failed
  handshakes (a socket monitor: plaintext clients, a wrong server key) are
  counted. Without keys, binding a non-loopback address logs a warning.
* Under CURVE (and ``options.seal``) a second ROUTER, plaintext, is bound next to
  the CURVE one on a port of its own (the data connection). A client agrees a
  session over CURVE (``seal_hello``, answered here, never by the handler) and sends
  its bulk requests there: every frame sealed with its session's key
  (:mod:`zmqps.transport.seal`), its requests served as its allow-list name's, and
  their replies sealed back on that connection. A message that is not sealed with
  a session's key, or replayed, or reordered, is refused before it is decoded:
  counted (``stats.seal_refusals``, the observer's ``seal_refused``), logged
  (rate-limited) and answered with a plaintext notice naming the reason.
* The data connection is a PLAIN server in a ZAP domain of its own: the ZAP
  handler admits a connection only with a live session's key id and credential
  (``Keyring.admit``), so a peer without one sends nothing there, not a frame.
  Its refusals are counted as ``auth_failures`` (``data_refused``: credentials no
  session has; ``data_handshake``: no PLAIN credentials at all, from a socket
  monitor).
* Each server socket keeps at most ``options.max_connections`` connections (its
  monitor's accepted and disconnected events, a set of descriptors): one accepted
  past the bound is shut down at once and counted (``stats.conn_refusals``), so
  peers that connect and stay silent cannot take every descriptor of the process
  (:mod:`zmqps.transport.connections`). Binding raises the process's open files
  limit to leave room for the bound plus a reserve.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import zmq
import zmq.asyncio

from zmqps.logs import LINES_PER_KIND, RateLimitedLog
from zmqps.transport.base import Handler, TransportObserver, TransportStats, cancel_and_wait
from zmqps.transport.connections import (
    Connections,
    monitor_socket,
    release_descriptors,
    reserve_descriptors,
)
from zmqps.transport.dispatch import Dispatcher, Pending
from zmqps.transport.options import SocketOptions, tcp_endpoint
from zmqps.transport.seal import NOTICE, OVERHEAD, RANDOM_BYTES, Keyring, SealRefused, Session
from zmqps.transport.security import (
    acquire_authenticator,
    release_authenticator,
    serve_sessions,
    stop_serving_sessions,
)
from zmqps.transport.unread import TRACK_BYTES, UnreadReplies
from zmqps.wire import Limits, Message, encode, error_reply, reply
from zmqps.wire.errors import InvalidArgument
from zmqps.wire.ops import SealAgreed, SealHello

__all__ = ["MAX_UNREAD", "MAX_UNREAD_PER_PEER", "Server"]

log = logging.getLogger("zmqps.transport")

#: Handshake failures the ZAP handler does not see (it counts its own refusals):
#: protocol errors (a plaintext client: mechanism mismatch; a wrong server key:
#: cryptographic). NO_DETAIL is left out: it is a peer that hung up mid-handshake
#: (a port probe, a client closing), not a refusal.
_HANDSHAKE_FAILED: dict[int, str] = {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake"}


#: ZAP domains of data connections: one per server of the process (its sessions)
_DATA_DOMAINS = itertools.count()

#: Bytes of replies a peer may leave unread before its requests wait (``busy``), and
#: all peers together (``transport/unread.py``; a PS raises both with its shards).
MAX_UNREAD_PER_PEER = 256 << 20
MAX_UNREAD = 1 << 30

#: Seconds between two log lines about failed handshakes on one server (all are counted).
_LOG_EVERY_S = 30.0
#: Messages a wake-up of the receive loop takes off the socket before it lets the
#: event loop run.
RECV_BATCH = 64
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def _waiting(sock: zmq.Socket[Any]) -> bool:
    """A message waits on ``sock`` (one ``EVENTS`` look: it also re-arms the edge of
    the socket's descriptor)."""
    return bool(cast(int, sock.getsockopt(_EVENTS)) & _POLLIN)


#: Seconds between two looks at the socket monitor (disconnects, failed handshakes).
_MONITOR_EVERY_S = 0.25
#: The monitor is also read as soon as an event comes (a reader on its descriptor):
#: a connection past the bound is shut down at once. (Tests turn it off to leave an
#: event unread.)
_MONITOR_ON_EVENT = True


def _protocol_error(value: int) -> str:
    for name in dir(zmq):
        if name.startswith("PROTOCOL_ERROR_") and getattr(zmq, name) == value:
            return name[len("PROTOCOL_ERROR_") :].lower()
    return str(value)


def _port(endpoint: str) -> int:
    try:
        return int(endpoint.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return 0  # not TCP: no port, no bound (nothing is refused)


def _is_loopback(endpoint: str) -> bool:
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", a host name or an interface: reachable from elsewhere


class Server:
    """Serves requests arriving on one ROUTER socket bound to ``address``."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        handler: Handler,
        *,
        name: str = "server",
        options: SocketOptions | None = None,
        limits: Limits | None = None,
        clock_skew: float = 1.0,
        observer: TransportObserver | None = None,
        unread: UnreadReplies | None = None,
    ) -> None:
        self._ctx = ctx
        #: large replies not handed to their connections yet, bounded per peer and in all
        if unread is None:
            unread = UnreadReplies(lambda: MAX_UNREAD_PER_PEER, lambda: MAX_UNREAD)
        self.unread = unread
        self._observer = observer
        self._address = tcp_endpoint(address)
        self._name = name
        self._options = options or SocketOptions()
        #: the ROUTER, used without asyncio's socket wrapper: its descriptor is watched
        #: with ``loop.add_reader`` and every receive and send is non-blocking
        #: (``_on_readable``, ``_send``)
        self._sock: zmq.Socket[Any] | None = None
        self._fd: int | None = None
        self._io_loop: asyncio.AbstractEventLoop | None = None
        self._reading = False  # inside _on_readable: its loop looks at EVENTS anyway
        self._read_scheduled = False
        self._monitor: asyncio.Task[None] | None = None
        self._monitor_sock: zmq.Socket[Any] | None = None
        #: the descriptors of the monitor sockets, watched by the event loop
        self._monitor_fds: list[int] = []
        #: the monitor socket read without asyncio (at any point, never blocking)
        self._events: zmq.Socket[Any] | None = None
        #: the connections of the socket, and of its data connection's, each bounded
        bound = self._options.max_connections
        self.connections = Connections(name, bound, self._connection_refused)
        self.data_connections = Connections(f"{name} data", bound, self._connection_refused)
        #: descriptors this server asked the process to have room for (given back at close)
        self._reserved = 0
        #: long polls waiting, by the descriptor of the connection they came on; each
        #: with its op and start (at most ``MAX_PENDING`` in all: the dispatcher's bound)
        self._polls: dict[int, dict[asyncio.Future[None], tuple[str, float]]] = {}
        self._handshake_log = RateLimitedLog(log, _LOG_EVERY_S, lines_per_kind=LINES_PER_KIND)
        self._gone_log = RateLimitedLog(log, _LOG_EVERY_S, lines_per_kind=LINES_PER_KIND)
        #: replies dropped at a full pipe: one line per interval whatever the peers
        self._hwm_log = RateLimitedLog(log, _LOG_EVERY_S, lines_per_kind=LINES_PER_KIND)
        self._authenticated = False
        self._handler = handler
        #: the data connection's ROUTER (under CURVE with ``options.seal``), read like
        #: the CURVE one; every message on it is sealed (``_dispatch_data``)
        self._data_sock: zmq.Socket[Any] | None = None
        self._data_fd: int | None = None
        self._data_read_scheduled = False
        self._reading_data = False
        #: inside the dispatch of a sealed request (``seal_hello`` is refused there)
        self._on_data = False
        #: the sessions agreed over CURVE, by key id (bounded)
        self.keyring = Keyring()
        self._seal_log = RateLimitedLog(log, _LOG_EVERY_S, lines_per_kind=LINES_PER_KIND)
        #: the data connection's endpoint ("" when there is none)
        self.data_endpoint = ""
        #: the ZAP domain its handshakes are checked in ("" when there is none)
        self._data_domain = ""
        #: its monitor (handshakes without PLAIN credentials), read with the other
        self._data_monitor_sock: zmq.Socket[Any] | None = None
        self._data_events: zmq.Socket[Any] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: done when the server stops (or failed, with the error that stopped it)
        self._loop_task: asyncio.Future[None] | None = None
        self.stats = TransportStats()
        self._dispatcher = Dispatcher(
            self._serve,
            name=name,
            stats=self.stats,
            limits=limits,
            clock_skew=clock_skew,
            observer=observer,
            admit=lambda peer: self.unread.refusal(peer, time.monotonic()),
        )
        self.endpoint = ""

    def bind(self) -> str:
        """Bind the socket; returns the actual endpoint (useful with port 0)."""
        sock: zmq.Socket[Any] = zmq.Socket(self._ctx, zmq.ROUTER)
        curve = self._options.curve
        try:
            self._options.apply_router(sock)
            if curve is not None:
                # Before binding: no connection is ever accepted unauthenticated.
                acquire_authenticator(self._ctx, curve, self._auth_failed)
                self._authenticated = True
            # watched before it binds: every connection is counted
            events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
            if curve is not None:
                events |= zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            self._monitor_sock = self._events = monitor_socket(sock, events)
            sock.bind(self._address)
        except BaseException as exc:
            self._close_monitor(sock)
            sock.close(linger=0)
            self._release()
            if isinstance(exc, zmq.ZMQError):
                raise OSError(f"{self._name}: cannot bind {self._address}: {exc}") from None
            raise
        self._sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.connections.port = _port(self.endpoint)
        reserve_descriptors(self.connections.bound)
        self._reserved += self.connections.bound
        if curve is not None and self._options.seal and self.endpoint.startswith("tcp://"):
            self._bind_data()
        if curve is None and not _is_loopback(self.endpoint):
            log.warning(
                "%s: serving %s in plaintext: anyone who reaches it can read and change"
                " the parameters; run with --keys (zmqps keygen) for CURVE",
                self._name,
                self.endpoint,
            )
        elif curve is not None:
            log.info(
                "%s: CURVE on %s (allow-list %s)", self._name, self.endpoint, curve.allowed_dir
            )
        return self.endpoint

    def _bind_data(self) -> None:
        """Bind the data connection's ROUTER on the CURVE endpoint's host, a port of
        its own (plaintext: every frame on it is sealed), admitting at the handshake
        only the credentials of a live session (PLAIN, checked by the ZAP handler)."""
        options = self._options
        limit = options.max_msg_size
        options = dataclasses.replace(
            options, curve=None, max_msg_size=limit + OVERHEAD if limit > 0 else limit
        )
        sock: zmq.Socket[Any] = zmq.Socket(self._ctx, zmq.ROUTER)
        host = self._address.rsplit(":", 1)[0]
        domain = f"zmqps-data-{next(_DATA_DOMAINS)}"
        try:
            options.apply_router(sock)
            # fail closed as on CURVE: a domain, enforced, served before binding
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
            sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            serve_sessions(self._ctx, domain, self._admit, self._data_auth_failed)
            self._data_domain = domain
            # watched before it binds: no handshake goes unseen
            self._data_monitor_sock = self._data_events = monitor_socket(
                sock,
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED,
            )
            sock.bind(f"{host}:0")
        except BaseException as exc:
            self._close_data_monitor(sock)
            sock.close(linger=0)
            self._close_sockets()
            if isinstance(exc, zmq.ZMQError):
                raise OSError(f"{self._name}: cannot bind {host}:0: {exc}") from None
            raise
        self._data_sock = sock
        self.data_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.data_connections.port = _port(self.data_endpoint)
        reserve_descriptors(self.data_connections.bound)
        self._reserved += self.data_connections.bound
        log.info("%s: sealed data connection on %s", self._name, self.data_endpoint)

    def _admit(self, username: bytes, password: bytes) -> str | None:
        """The ZAP handler's check of a data connection's PLAIN credentials: the user
        id (the session's key id, hex) of a live session, or None (refused)."""
        session = self.keyring.admit(username, password)
        return None if session is None else session.key_id.hex()

    def _data_auth_failed(self, peer: str, reason: str) -> None:
        self.stats.auth_failures += 1
        if self._observer is not None:
            self._observer.auth_failure("data_refused")
        self._handshake_log.warning(
            "%s: refused a data connection from %s (%s); %d refused so far",
            self._name,
            peer,
            reason,
            self.stats.auth_failures,
            key="data",
        )

    def _serve(self, msg: Message) -> Message | Any:
        if msg.op == SealHello.OP:
            return self._seal_hello(msg)
        return self._handler(msg)

    def _seal_hello(self, msg: Message) -> Message:
        """Agree a session with the CURVE peer that asks (its allow-list name)."""
        if self._data_sock is None or self._on_data or not msg.peer:
            raise InvalidArgument(f"{self._name}: no sealed data connection here")
        hello = SealHello.from_wire(msg.body)
        try:
            client_random = bytes.fromhex(hello.random)
        except ValueError:
            client_random = b""
        if len(client_random) != RANDOM_BYTES:
            raise InvalidArgument(f"seal_hello: expected {RANDOM_BYTES} random bytes, in hex")
        if hello.retire is not None:
            with contextlib.suppress(ValueError):  # not hex: nothing to retire
                self.keyring.retire(msg.peer, bytes.fromhex(hello.retire))
        key_id, server_random = self.keyring.agree(msg.peer, client_random)
        port = int(self.data_endpoint.rsplit(":", 1)[1])
        agreed = SealAgreed(random=server_random.hex(), key=key_id.hex(), port=port)
        return reply(msg, agreed.to_wire())

    def _seal_refused(self, exc: SealRefused, identity: bytes, key_id: bytes) -> None:
        """Count, log and answer a refused sealed message (a plaintext notice)."""
        self.stats.seal_refusals += 1
        if self._observer is not None:
            self._observer.seal_refused(exc.reason)
        self._seal_log.warning(
            "%s: %s (%d refused so far)",
            self._name,
            exc,
            self.stats.seal_refusals,
            key=exc.reason,
        )
        sock = self._data_sock
        if sock is None:
            return
        with contextlib.suppress(zmq.ZMQError):
            sock.send_multipart([identity, NOTICE, key_id, exc.reason.encode()], flags=zmq.DONTWAIT)

    def _release(self) -> None:
        if self._data_domain:
            stop_serving_sessions(self._ctx, self._data_domain)
            self._data_domain = ""
        if self._authenticated:
            self._authenticated = False
            release_authenticator(self._ctx, self._auth_failed)

    def _connection_refused(self) -> None:
        self.stats.conn_refusals += 1
        if self._observer is not None:
            self._observer.connection_refused()

    def _auth_failed(self, peer: str, reason: str) -> None:
        self.stats.auth_failures += 1
        if self._observer is not None:
            self._observer.auth_failure("refused")

    async def _watch_monitor(self) -> None:
        while True:
            self._read_monitor()
            await asyncio.sleep(_MONITOR_EVERY_S)

    def _read_monitor(self) -> None:
        """Act on every socket event waiting now (never blocks)."""
        from zmq.utils.monitor import parse_monitor_message

        data = self._data_events
        while data is not None and _waiting(data):
            try:
                event = parse_monitor_message(data.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            kind = int(event["event"])
            if kind == zmq.EVENT_ACCEPTED:
                self.data_connections.accepted(int(event["value"]))
            elif kind == zmq.EVENT_DISCONNECTED:
                self.data_connections.gone(int(event["value"]))
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self._handshake_failed("data_handshake", event)
        events = self._events
        # one EVENTS look (2 us) rather than a receive that raises Again (5 us): a
        # look happens with every long poll
        while events is not None and _waiting(events):
            try:
                event = parse_monitor_message(events.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind = int(event["event"])
            if kind == zmq.EVENT_ACCEPTED:
                self.connections.accepted(int(event["value"]))
            elif kind == zmq.EVENT_DISCONNECTED:
                self.connections.gone(int(event["value"]))
                self._drop_polls(int(event["value"]))
            elif kind in _HANDSHAKE_FAILED:
                self._handshake_failed(_HANDSHAKE_FAILED[kind], event)

    def _handshake_failed(self, kind: str, event: Mapping[str, Any]) -> None:
        self.stats.auth_failures += 1
        if self._observer is not None:
            self._observer.auth_failure(kind)
        # libzmq names only our own endpoint here, not the peer's address.
        self._handshake_log.warning(
            "%s: a %s handshake failed on %s (%s: %s); %d refused so far",
            self._name,
            "data connection" if kind == "data_handshake" else "CURVE",
            event["endpoint"].decode(errors="replace"),
            _protocol_error(int(event["value"])),
            "a client without session credentials?"
            if kind == "data_handshake"
            else "a plaintext client or a wrong server key?",
            self.stats.auth_failures,
            key=kind,
        )

    def _drop_polls(self, fd: int) -> None:
        """The connection on descriptor ``fd`` is gone: drop the long polls it sent."""
        polls = self._polls.pop(fd, None)
        if not polls:
            return
        now = time.perf_counter()
        for task, (op, started) in polls.items():
            task.cancel()
            if self._observer is not None:
                self._observer.request_done(op, "peer_gone", now - started)
        self.stats.gone += len(polls)
        self._gone_log.log(
            logging.INFO,
            "%s: dropped %d long polls of a connection that closed (%d so far)",
            self._name,
            len(polls),
            self.stats.gone,
        )

    def _track_poll(self, frame: Any, task: asyncio.Future[None], op: str) -> None:
        """Remember long poll ``task`` under its connection, until it ends."""
        try:
            fd = int(frame.get(zmq.SRCFD))
        except (AttributeError, zmq.ZMQError):
            return  # not a received frame (or no descriptor): not tracked
        if fd < 0:
            return
        # A disconnect seen now is of a connection that closed before this poll came
        # (a new connection may have the gone one's descriptor): act on it first.
        self._read_monitor()
        polls = self._polls.setdefault(fd, {})
        polls[task] = (op, time.perf_counter())

        def untrack(done: asyncio.Future[None]) -> None:
            held = self._polls.get(fd)
            if held is not None and held.pop(done, None) is not None and not held:
                del self._polls[fd]

        task.add_done_callback(untrack)
        if self.connections.port and not self.connections.is_open(fd):
            # closed, its disconnect read, before this poll of it was (the reader took
            # the monitor's event first): no event will come for it, dropped now (3 to
            # 12 % of the polls of connections that closed at once waited out their
            # wait, up to 300 s each, holding a place)
            self._drop_polls(fd)

    def start(self) -> None:
        """Bind (if not yet) and start receiving (a reader on the socket's descriptor)."""
        if self._sock is None:
            self.bind()
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        self._io_loop = loop
        if self._monitor is None:
            self._monitor = asyncio.ensure_future(self._watch_monitor())
            # read as soon as an event comes (a connection past the bound is shut down
            # at once); the timer of _watch_monitor stays, for an edge taken elsewhere
            for mon in (self._events, self._data_events):
                if mon is not None and _MONITOR_ON_EVENT:
                    fd = int(cast(int, mon.getsockopt(zmq.FD)))
                    self._monitor_fds.append(fd)
                    loop.add_reader(fd, self._read_monitor)
            self._read_monitor()
        self._loop_task = loop.create_future()
        self._fd = int(cast(int, self._sock.getsockopt(zmq.FD)))
        loop.add_reader(self._fd, self._on_readable)
        self._read_soon()  # messages may be waiting already: their edge came before
        if self._data_sock is not None:
            self._data_fd = int(cast(int, self._data_sock.getsockopt(zmq.FD)))
            loop.add_reader(self._data_fd, self._on_data_readable)
            self._read_data_soon()

    def reader_failed(self) -> asyncio.Future[None]:
        """A future that fails with the error that stopped this server's reader (a bug:
        nothing is read from then on, so the process must end, saying why, rather than
        go on deaf); cancelled when the server stops. Call after :meth:`start`."""
        assert self._loop_task is not None, "reader_failed() before start()"
        return self._loop_task

    async def serve_forever(self) -> None:
        if self._loop_task is None:
            self.start()
        assert self._loop_task is not None
        await self._loop_task

    async def stop(self) -> None:
        """Stop receiving, let in-flight handler tasks finish briefly, close the socket.

        The socket is closed whatever happened before (a receive loop that died
        would otherwise leave it open and hang ``ctx.term()``).
        """
        try:
            if self._loop_task is not None:
                task, self._loop_task = self._loop_task, None
                self._stop_reading()
                if not task.done():
                    task.cancel()
            if self._tasks:
                _done, pending = await asyncio.wait(self._tasks, timeout=1.0)
                for t in pending:
                    t.cancel()
        finally:
            try:
                if self._monitor is not None:
                    monitor, self._monitor = self._monitor, None
                    await cancel_and_wait(monitor, zmq.ZMQError)
            finally:  # also when this stop is cancelled
                self._close_sockets()

    def _stop_reading(self) -> None:
        for fd in (self._fd, self._data_fd):
            if fd is not None and self._io_loop is not None:
                with contextlib.suppress(Exception):  # a loop closed already
                    self._io_loop.remove_reader(fd)
        self._fd = None
        self._data_fd = None
        for fd in self._monitor_fds:
            if self._io_loop is not None:
                with contextlib.suppress(Exception):
                    self._io_loop.remove_reader(fd)
        self._monitor_fds.clear()

    def _close_sockets(self) -> None:
        self._stop_reading()
        if self._sock is not None:
            self._close_monitor(self._sock)
            self._sock.close()
            self._sock = None
        if self._data_sock is not None:
            self._close_data_monitor(self._data_sock)
            self._data_sock.close()
            self._data_sock = None
        release_descriptors(self._reserved)
        self._reserved = 0
        self._release()

    def _close_monitor(self, sock: zmq.Socket[Any]) -> None:
        # A monitor socket left open hangs ctx.term().
        if self._monitor_sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            self._events = None
            self._monitor_sock.close(linger=0)
            self._monitor_sock = None

    def _close_data_monitor(self, sock: zmq.Socket[Any]) -> None:
        if self._data_monitor_sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            self._data_events = None
            self._data_monitor_sock.close(linger=0)
            self._data_monitor_sock = None

    def _on_readable(self) -> None:
        """Take the messages waiting, at most :data:`RECV_BATCH` per turn of the event
        loop, and dispatch each.

        The descriptor of a ZeroMQ socket is edge-triggered: it signals when commands
        come, and any call on the socket (a receive, a send, an ``EVENTS`` look) may
        take them. So this looks at ``EVENTS`` until no message waits (which re-arms
        the edge), and a send made outside it looks at ``EVENTS`` after sending
        (:meth:`_send`): a message whose edge that send took is read on the next turn."""
        self._read_scheduled = False
        self._reading = True
        try:
            self._read_batch(lambda: self._sock, self._dispatch, self._read_soon)
        finally:
            self._reading = False

    def _on_data_readable(self) -> None:
        """As :meth:`_on_readable`, for the data connection."""
        self._data_read_scheduled = False
        self._reading_data = True
        try:
            self._read_batch(lambda: self._data_sock, self._dispatch_data, self._read_data_soon)
        finally:
            self._reading_data = False

    def _read_batch(
        self,
        current: Callable[[], zmq.Socket[Any] | None],
        dispatch: Callable[[list[zmq.Frame]], None],
        again: Callable[[], None],
    ) -> None:
        """One turn of a socket's reader: up to ``RECV_BATCH`` waiting messages, each to
        ``dispatch``; ``again`` schedules the next turn of a long burst. ``current``: the
        socket, None once the server closed it (a message may have closed it)."""
        sock = current()
        if sock is None:
            return
        try:
            for _ in range(RECV_BATCH):
                if current() is None or not _waiting(sock):
                    return
                dispatch(sock.recv_multipart(zmq.NOBLOCK, copy=False))
            again()  # a long burst: the rest once timers and replies ran
        except Exception as exc:  # a bug: the server stops, saying why
            self._fail(exc)

    def _read_data_soon(self) -> None:
        if (
            not self._data_read_scheduled
            and self._io_loop is not None
            and self._data_sock is not None
        ):
            self._data_read_scheduled = True
            self._io_loop.call_soon(self._on_data_readable)

    def _dispatch_data(self, frames: list[Any]) -> None:
        """A message of the data connection: opened with its session's key (or refused),
        then served as the session's peer's; its reply goes back sealed."""
        identity = self._arrived(frames)
        if identity is None:
            return
        self.data_connections.heard(frames[0].get(zmq.SRCFD))
        try:
            session, plain = self.keyring.open(frames[1:])
        except SealRefused as exc:
            self._seal_refused(exc, identity, bytes(frames[1].buffer[:8]))
            return
        self._on_data = True
        try:
            outcome = self._dispatcher.dispatch(plain, identity, session.peer)
        finally:
            self._on_data = False
        self._answer(identity, outcome, session)

    def _read_soon(self) -> None:
        if not self._read_scheduled and self._io_loop is not None and self._sock is not None:
            self._read_scheduled = True
            self._io_loop.call_soon(self._on_readable)

    def _fail(self, exc: BaseException) -> None:
        log.error("%s: receiving failed: %r", self._name, exc, exc_info=exc)
        self._stop_reading()
        task = self._loop_task
        if task is not None and not task.done():
            task.set_exception(exc)

    def _arrived(self, frames: list[Any]) -> bytes | None:
        """A received message's sender, its bytes counted (None, counted bad: no body)."""
        if len(frames) < 2:
            self.stats.bad_messages += 1
            return None
        received = sum(len(f) for f in frames[1:])
        self.stats.bytes_in += received
        if self._observer is not None:
            self._observer.bytes_in(received)
        return bytes(frames[0].bytes)

    def _answer(
        self, identity: bytes, outcome: Message | Pending | None, session: Session | None = None
    ) -> asyncio.Future[None] | None:
        """Send a handler's reply now, or once its pending work ends (the task returned)."""
        if outcome is None:
            return None
        if isinstance(outcome, Message):
            self._send(identity, outcome, session)
            return None
        task = asyncio.ensure_future(self._finish(identity, outcome, session))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # cancelled before it ran (its connection closed in the same turn, the server
        # stopping): the reply was never awaited, its room must still be given back
        task.add_done_callback(lambda _: outcome.close())
        return task

    def _dispatch(self, frames: list[Any]) -> None:
        identity = self._arrived(frames)
        if identity is None:
            return
        self.connections.heard(frames[0].get(zmq.SRCFD))
        # the name the allow-list gives the sender's key (the ZAP handler's user id,
        # carried by every frame of an authenticated connection): never on the wire
        user = frames[0].get("User-Id") if self._options.curve is not None else ""
        outcome = self._dispatcher.dispatch(frames[1:], identity, user or "")
        task = self._answer(identity, outcome)
        if task is not None and isinstance(outcome, Pending) and outcome.droppable:
            self._track_poll(frames[0], task, outcome.op)

    async def _finish(
        self, identity: bytes, outcome: Pending, session: Session | None = None
    ) -> None:
        self._send(identity, await outcome, session)

    def _send(self, identity: bytes, msg: Message, session: Session | None = None) -> None:
        """Reply to ``identity``: on the CURVE socket, or sealed with ``session``'s key
        on the data connection the request came on."""
        sock = self._sock if session is None else self._data_sock
        if sock is None:
            return
        try:
            frames = encode(msg)
        except Exception as exc:
            # A handler bug (e.g. a numpy scalar in a reply body) must not kill the
            # receive loop: the caller gets an internal error instead.
            log.exception("%s: cannot encode the reply to request %s", self._name, msg.id)
            self.stats.errors += 1
            msg = error_reply(msg.id, exc)
            frames = encode(msg)
        cap = self._dispatcher.limits.max_header_bytes
        if len(frames[0]) > cap:
            # a client would drop it unread and wait for the reply until its timeout
            log.error(
                "%s: the reply to %s is a header of %d bytes, past the %d a client reads",
                self._name,
                msg.id,
                len(frames[0]),
                cap,
            )
            self.stats.errors += 1
            msg = error_reply(
                msg.id,
                InvalidArgument(
                    f"the reply is a header of {len(frames[0]):,} bytes, past the {cap:,} a"
                    " client reads: ask for less at once"
                ),
            )
            frames = encode(msg)
        if session is not None:
            try:
                frames = session.sealer.seal(frames)
            except SealRefused as exc:  # its key is used up: the client agrees another
                self.keyring.forget(session.key_id)
                self._seal_refused(exc, identity, session.key_id)
                return
            self.stats.sealed += 1
        payload = sum(t.array.nbytes for t in msg.tensors)
        track = payload >= TRACK_BYTES
        try:
            # tracked: every frame zero-copy (pyzmq copies a frame under its copy
            # threshold, 64 KiB, and a copied last frame's tracker is done at once,
            # however long the reply waits unread)
            if not track:  # (the socket's own threshold, read and set only when tracked)
                tracker = sock.send_multipart([identity, *frames], copy=False, flags=zmq.DONTWAIT)
            else:
                threshold = sock.copy_threshold
                sock.copy_threshold = 0
                try:
                    tracker = sock.send_multipart(
                        [identity, *frames], copy=False, track=True, flags=zmq.DONTWAIT
                    )
                finally:
                    sock.copy_threshold = threshold
            if session is None:
                if not self._reading and _waiting(sock):
                    self._read_soon()  # the send may have taken a message's edge
            elif not self._reading_data and _waiting(sock):
                self._read_data_soon()
        except zmq.Again:
            # The peer's pipe is full (HWM): it is not reading; drop and count.
            self.stats.unroutable += 1
            self._hwm_log.warning(
                "%s: reply to %r dropped: peer not reading (HWM)", self._name, identity, key="hwm"
            )
            return
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self.stats.unroutable += 1
                log.debug("%s: reply to gone peer %r dropped", self._name, identity)
                return
            raise
        if track and tracker is not None:
            self.unread.sent(identity, tracker, payload, time.monotonic())
        self.stats.replies += 1
        sent = sum(getattr(f, "nbytes", None) or len(f) for f in frames)
        self.stats.bytes_out += sent
        if self._observer is not None:
            self._observer.bytes_out(sent)
