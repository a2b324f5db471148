"""An in-memory transport with the same contract as the ZeroMQ one, for unit tests.

Messages still go through the real codec (encoded to bytes and decoded again), so
tests exercise the wire format and the trust boundary, just without sockets.
Faults are injected by wrappers in tests/, not by switches here.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from zmqps.transport.base import Handler, TransportObserver, TransportStats, retry_busy, within
from zmqps.transport.dispatch import Dispatcher
from zmqps.wire import ERROR, Message, Tensor, decode, encode, request
from zmqps.wire.errors import DeadlineExceeded, ShutdownError, error_from_code

__all__ = ["FakeClient", "FakeNetwork"]


def _wire_copy(msg: Message) -> list[bytes]:
    return [f if isinstance(f, bytes) else memoryview(f).tobytes() for f in encode(msg)]


class FakeNetwork:
    """Named in-memory servers; clients reach them by address."""

    def __init__(self) -> None:
        self._servers: dict[str, Dispatcher] = {}

    def serve(
        self,
        address: str,
        handler: Handler,
        *,
        name: str = "fake",
        observer: TransportObserver | None = None,
    ) -> TransportStats:
        stats = TransportStats()
        self._servers[address] = Dispatcher(handler, name=name, stats=stats, observer=observer)
        return stats

    def remove(self, address: str) -> None:
        self._servers.pop(address, None)

    def client(
        self, address: str, identity: str, *, timeout: float = 5.0, slot: int | None = None
    ) -> FakeClient:
        return FakeClient(self, address, identity, timeout, slot)

    def _dispatcher(self, address: str) -> Dispatcher | None:
        return self._servers.get(address)


class FakeClient:
    def __init__(
        self,
        net: FakeNetwork,
        address: str,
        identity: str,
        timeout: float,
        slot: int | None = None,
    ) -> None:
        self.endpoint = address
        self.identity = identity
        self.slot = slot
        self.timeout = timeout
        self._net = net
        self._ids = itertools.count(1)
        self._closed = False
        self.stats = TransportStats()

    async def listening(self, timeout: float = 1.0) -> bool:
        """Whether the network serves the address (``Client.listening``)."""
        return self._net._dispatcher(self.endpoint) is not None

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
        if self._closed:
            raise ShutdownError(f"client to {self.endpoint} is closed")
        timeout = self.timeout if timeout is None else timeout
        slot = self.slot if slot is None else slot
        for attempt in range(1, attempts + 1):
            try:
                return await retry_busy(
                    lambda left: within(self._once(op, body, tensors, slot), left),
                    timeout,
                )
            except asyncio.TimeoutError:
                if attempt == attempts:
                    raise DeadlineExceeded(f"{op} to {self.endpoint}: no reply") from None
        raise AssertionError("unreachable")

    async def _once(
        self,
        op: str,
        body: Mapping[str, Any] | None,
        tensors: Sequence[Tensor],
        slot: int | None = None,
    ) -> Message:
        msg = request(op, body, tensors, id=next(self._ids), sender=self.identity, slot=slot)
        self.stats.requests += 1
        await asyncio.sleep(0)
        server = self._net._dispatcher(self.endpoint)
        if server is None:
            await asyncio.Future()  # nobody listens: wait for the deadline, like zmq
        assert server is not None
        frames = _wire_copy(msg)
        if server.observer is not None:
            server.observer.bytes_in(sum(len(f) for f in frames))
        outcome = server.dispatch(frames, self.identity)
        if outcome is None:
            await asyncio.Future()  # dropped: the deadline fires
            raise AssertionError("unreachable")
        out = outcome if isinstance(outcome, Message) else await outcome
        frames = _wire_copy(out)
        if server.observer is not None:
            server.observer.bytes_out(sum(len(f) for f in frames))
        rep = decode(frames)
        self.stats.replies += 1
        if rep.op == ERROR:
            raise error_from_code(rep.body["code"], rep.body["message"])
        return rep

    async def close(self) -> None:
        self._closed = True
