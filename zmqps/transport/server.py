"""Asyncio ROUTER server: receive, dispatch to a handler, reply.

Rules of this module:

* Decoding and error translation live in :mod:`zmqps.transport.dispatch` (shared
  with the in-memory fake). The server never dies because of one request.
* A message whose request id cannot be read is dropped and counted; so is a
  request past its deadline (its sender has already given up on it).
* Handlers returning a plain reply run inline, in arrival order; handlers
  returning an awaitable run as tasks the server keeps (and cancels on stop).
* A reply to a gone or non-reading peer is dropped and counted, never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any

import zmq
import zmq.asyncio

from zmqps.transport.base import Handler, TransportObserver, TransportStats
from zmqps.transport.dispatch import Dispatcher
from zmqps.transport.options import SocketOptions, send_now, tcp_endpoint
from zmqps.wire import Limits, Message, encode, error_reply

__all__ = ["Server"]

log = logging.getLogger("zmqps.transport")


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
    ) -> None:
        self._ctx = ctx
        self._observer = observer
        self._address = tcp_endpoint(address)
        self._name = name
        self._options = options or SocketOptions()
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self.stats = TransportStats()
        self._dispatcher = Dispatcher(
            handler,
            name=name,
            stats=self.stats,
            limits=limits,
            clock_skew=clock_skew,
            observer=observer,
        )
        self.endpoint = ""

    def bind(self) -> str:
        """Bind the socket; returns the actual endpoint (useful with port 0)."""
        sock = self._ctx.socket(zmq.ROUTER)
        self._options.apply_router(sock)
        try:
            sock.bind(self._address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(f"{self._name}: cannot bind {self._address}: {exc}") from None
        self._sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    def start(self) -> None:
        """Bind (if not yet) and start the receive loop as a task."""
        if self._sock is None:
            self.bind()
        self._loop_task = asyncio.ensure_future(self._recv_loop())

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
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self._tasks:
                _done, pending = await asyncio.wait(self._tasks, timeout=1.0)
                for t in pending:
                    t.cancel()
        finally:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while True:
            frames = await sock.recv_multipart(copy=False)
            self._dispatch(frames)

    def _dispatch(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            self.stats.bad_messages += 1
            return
        identity = frames[0].bytes
        received = sum(len(f) for f in frames[1:])
        self.stats.bytes_in += received
        if self._observer is not None:
            self._observer.bytes_in(received)
        outcome = self._dispatcher.dispatch(frames[1:], identity)
        if outcome is None:
            return
        if isinstance(outcome, Message):
            self._send(identity, outcome)
            return
        task = asyncio.ensure_future(self._finish(identity, outcome))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _finish(self, identity: bytes, outcome: Awaitable[Message]) -> None:
        self._send(identity, await outcome)

    def _send(self, identity: bytes, msg: Message) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            frames = encode(msg)
        except Exception as exc:
            # A handler bug (e.g. a numpy scalar in a reply body) must not kill the
            # receive loop: the caller gets an internal error instead.
            log.exception("%s: cannot encode the reply to request %s", self._name, msg.id)
            self.stats.errors += 1
            frames = encode(error_reply(msg.id, exc))
        try:
            send_now(sock, [identity, *frames])
        except zmq.Again:
            # The peer's pipe is full (HWM): it is not reading; drop and count.
            self.stats.unroutable += 1
            log.warning("%s: reply to %r dropped: peer not reading (HWM)", self._name, identity)
            return
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self.stats.unroutable += 1
                log.debug("%s: reply to gone peer %r dropped", self._name, identity)
                return
            raise
        self.stats.replies += 1
        sent = sum(getattr(f, "nbytes", None) or len(f) for f in frames)
        self.stats.bytes_out += sent
        if self._observer is not None:
            self._observer.bytes_out(sent)
