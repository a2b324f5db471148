"""Socket options of every zmqps socket, in one frozen dataclass.

Why each default (RELIABILITY.md, "Facts that bite"):

* ``ROUTER_HANDOVER=1``: a peer that connects again with the same routing id (a
  DEALER reconnecting before the server noticed its old connection die) is heard
  again (otherwise it is shut out forever) and the old connection's messages are
  dropped. A DEALER's routing id is its name and 8 random bytes
  (:meth:`SocketOptions.apply_dealer`): handover gives a connection to whoever
  connects with its routing id, and with the bare name (``chief:0``, or a worker's
  name and incarnation, which ``status`` shows) any client could take the chief's
  connection to a PS over for a moment and leave it cut off for good. The name the
  server knows a request by travels in the request itself (and, under CURVE, is the
  allow-list name of the sender's key), never in the routing id.
* ``ROUTER_MANDATORY=1``: a reply to a gone peer raises EHOSTUNREACH (counted)
  instead of vanishing silently.
* No ZMTP heartbeats by default (``heartbeat_ivl_ms`` 0): a dead or cut-off peer is
  noticed by TCP itself, in seconds rather than the ~15 minutes of tcp_retries2:
  keepalive probes on an idle connection (after 2 s, every 1 s, 3 unanswered: about
  5 s) and ``TCP_MAXRT`` (``TCP_USER_TIMEOUT``: data, or a zero window, that makes no
  progress for 5 s ends the connection), on clients and servers alike. (Liveness of
  the *application* is a separate, application-level heartbeat: the kernel answers
  keepalives even when our process is stopped.) ZMTP pings abort libzmq 4.3.5
  (``Assertion failed: !_io_error (src/stream_engine_base.cpp:310)``, SIGABRT) when
  they meet a connection whose reading had stopped (its ``RCVHWM`` reached) and whose
  peer then hung up: a server's own ping timer firing on it (fault schedule 13024,
  three runs out of three), or a client's ping read there and answered with a pong
  (fault schedule 13110: a PS stopped 6 s while its clients kept sending aborted on
  resuming, and without replication its state was lost; zeromq/libzmq issue 4841).
  A child-process replay of the second: 3 aborts out of 3 with clients' pings, none
  out of 6 without (with and without replies). ``heartbeat_ivl_ms`` > 0 turns ZMTP
  heartbeats back on for clients (tests use it to make a drop quick); a server
  (ROUTER) never pings.
* ``LINGER`` bounded: 0 drops the last reply, -1 can hang ``ctx.term()``.
* ``MAXMSGSIZE`` above the largest legitimate frame: large shards travel in chunks. A peer drops
  a larger frame and the connection with no error, so a client refuses to send one
  (a clear error at once instead of a timeout).
* A server's ``RCVHWM`` is small (``server_rcvhwm``, 8 messages per connection):
  what libzmq reads ahead of a busy event loop is bounded by messages (each of frames
  under ``MAXMSGSIZE``); past it the connection is simply not read, and its sender's
  TCP window fills (backpressure, nothing lost; the loop reads a connection's
  messages as fast as it can take them, so a small bound costs nothing). It was
  10,000: one client parked 5.4 GB of 128 MiB pushes in a PS while its loop was busy
  for 1.5 s (with 8, 40 such pushes behind a 2^20-row pull add 0.6 GB at the peak,
  against 3.1 GB). A connection not read is also not read for its ZMTP heartbeats:
  a loop busy past ``heartbeat_timeout_ms`` drops every connection whose pipe is
  full, with the requests it held that the loop had not read. Every request a
  worker may repeat is sent again on the new connection (``attempts`` > 1:
  pushes, deduplicated by sequence; pulls; polls; heartbeats), so it costs a resend,
  not a loss; a request sent once waits for its deadline
  (``tests/integration/test_transport.py::test_a_loop_busy_past_the_heartbeat_timeout_loses_what_queued_past_the_hwm``).
* ``HANDSHAKE_IVL`` 10 s: a connection that never completes its ZMTP handshake (a
  port scanner, a bad greeting) is dropped after 10 s instead of libzmq's 30 s.
* ``curve`` (:class:`~zmqps.transport.security.CurveKeys`): every socket uses CURVE.
  A ROUTER is a CURVE server with ``ZAP_DOMAIN`` set and ``ZAP_ENFORCE_DOMAIN=1``
  (with enforcement but no domain libzmq skips authentication: fail open); the
  server starts the matching ZAP authenticator (:mod:`zmqps.transport.security`).
  A DEALER uses its client pair and the server's public key.
* ``seal`` (under CURVE): bulk requests and their replies travel on a second,
  plaintext TCP connection with every frame sealed by AES-256-GCM under keys agreed
  over CURVE (:mod:`zmqps.transport.seal`); control messages stay on CURVE. That
  connection is admitted at its handshake with the session's PLAIN credentials,
  checked by the ZAP handler (the server and client set them, not these options).
  False puts every byte through CURVE.
* ``max_connections`` (default ``ZMQPS_MAX_CONNECTIONS`` or 4,096; 0: no bound):
  the connections a server socket keeps; one accepted past it is shut down at once
  (:mod:`zmqps.transport.connections`). A server sends no pings, so without a bound
  peers that connect and stay silent hold a descriptor each for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass, field
from typing import Any

import zmq

from zmqps.transport.connections import default_max_connections
from zmqps.transport.security import DOMAIN, CurveKeys
from zmqps.wire.errors import ConfigError
from zmqps.wire.schema import MAX_FRAME_BYTES

__all__ = ["SocketOptions", "send_now", "tcp_endpoint"]


@dataclass(frozen=True)
class SocketOptions:
    hwm: int = 10_000
    #: a server's (ROUTER's) receive high-water mark, messages per connection
    server_rcvhwm: int = 8
    linger_ms: int = 1_000
    #: ZMTP pings of a client (0: none, see above); their timeout and the TTL they carry
    heartbeat_ivl_ms: int = 0
    heartbeat_timeout_ms: int = 5_000
    heartbeat_ttl_ms: int = 10_000
    #: TCP keepalive of an idle connection: first probe, interval, probes (seconds)
    keepalive: tuple[int, int, int] = (2, 1, 3)
    #: TCP_MAXRT (TCP_USER_TIMEOUT): unacknowledged data or a zero window that makes no
    #: progress this long ends the connection
    tcp_maxrt_ms: int = 5_000
    max_msg_size: int = MAX_FRAME_BYTES
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 2_000
    handshake_ivl_ms: int = 10_000
    #: CURVE keys: None is plaintext
    curve: CurveKeys | None = None
    #: under CURVE, bulk frames go sealed on a data connection (see above)
    seal: bool = True
    #: connections a server socket keeps (see above; 0: no bound)
    max_connections: int = field(default_factory=default_max_connections)

    def apply_common(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        sock.setsockopt(zmq.LINGER, self.linger_ms)
        sock.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.heartbeat_timeout_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, self.heartbeat_ttl_ms)
        idle, interval, probes = self.keepalive
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, idle)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, interval)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, probes)
        sock.setsockopt(zmq.TCP_MAXRT, self.tcp_maxrt_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_msg_size)
        sock.setsockopt(zmq.RECONNECT_IVL, self.reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, self.reconnect_ivl_max_ms)
        sock.setsockopt(zmq.HANDSHAKE_IVL, self.handshake_ivl_ms)

    def apply_router(self, sock: zmq.Socket[Any]) -> None:
        self.apply_common(sock)
        sock.setsockopt(zmq.RCVHWM, self.server_rcvhwm)
        # no pings of its own (see above): TCP keepalive and TCP_MAXRT keep liveness
        sock.setsockopt(zmq.HEARTBEAT_IVL, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self.curve is not None:
            if self.curve.server_secret is None:
                raise ConfigError(f"CURVE: no server secret key in {self.curve.source}")
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.curve.server_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.curve.server_secret)
            # Both, always: a domain without enforcement (or enforcement without a
            # domain) lets clients in when no ZAP handler answers.
            sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN.encode())
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def apply_dealer(self, sock: zmq.Socket[Any], identity: bytes) -> None:
        """A client socket named ``identity``: its routing id is that name and 8 random
        bytes, which no other client can guess (see ``ROUTER_HANDOVER`` above)."""
        self.apply_common(sock)
        sock.setsockopt(zmq.ROUTING_ID, b"%s/%s" % (identity, secrets.token_hex(8).encode()))
        if self.curve is not None:
            if self.curve.client_secret is None or self.curve.client_public is None:
                raise ConfigError(f"CURVE: no client key pair for this task in {self.curve.source}")
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.curve.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.curve.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.curve.client_secret)


def tcp_endpoint(address: str) -> str:
    """``host:port`` (or an endpoint already) -> ``tcp://host:port``."""
    if "://" in address:
        return address
    return f"tcp://{address}"


async def port_open(endpoint: str, timeout: float = 1.0) -> bool:
    """Whether something accepts a TCP connection at ``endpoint`` within ``timeout``
    seconds (closed at once, nothing sent: to a zmqps server a port probe, not a
    handshake that failed). Not a TCP endpoint: True (nothing to tell)."""
    if not endpoint.startswith("tcp://"):
        return True
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    host = host.strip("[]")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
    except (OSError, ValueError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def send_now(sock: zmq.Socket[Any], frames: list[Any], track: bool = False) -> Any:
    """Queue ``frames`` without waiting (zero-copy); raises ``zmq.Again`` at the HWM.
    With ``track``, returns the ``MessageTracker`` of the last frame (done once
    ZeroMQ has handed the message to the connection), else None.

    On a ``zmq.asyncio`` socket a DONTWAIT send resolves at once (no send is ever
    left pending, since every zmqps send goes through here), so the outcome is
    read off the returned future. Going through the asyncio socket, rather than a
    blocking shadow, keeps its edge-triggered FD bookkeeping right.
    """
    result = sock.send_multipart(frames, copy=False, track=track, flags=zmq.DONTWAIT)
    if isinstance(result, asyncio.Future) and result.done():
        exc = result.exception()
        if exc is not None:
            raise exc
        result = result.result()
    return result if track else None
