"""A reader that meets an error nobody planned for (a bug while a message is read)
must not leave anyone waiting for ever: a PS or a chief whose server stopped reading
ends, failed, naming the error, instead of running on deaf; a client fails the
requests waiting for a reply at once and reads on (loopback, real ZeroMQ)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import zmq.asyncio

from zmqps.cli.launch import free_ports
from zmqps.config import ClusterSpec
from zmqps.roles.chief.serve import serve_chief
from zmqps.roles.configs import ChiefConfig
from zmqps.roles.ps import PSConfig, serve_ps
from zmqps.transport import Client, Server
from zmqps.wire import reply
from zmqps.wire.errors import ProtocolError


async def _cancelled(task: asyncio.Future[Any]) -> None:
    """``task`` ended (cancelled if it runs on): its sockets closed before the context
    is terminated, or the termination would wait for them for ever."""
    task.cancel()
    with contextlib.suppress(BaseException):
        await asyncio.wait_for(task, 30.0)


def _ps(ctx: zmq.asyncio.Context) -> tuple[str, Awaitable[Any]]:
    (port,) = free_ports(1)
    cfg = PSConfig(index=0, bind=f"127.0.0.1:{port}")
    return cfg.bind, serve_ps(cfg, ctx)


def _chief(ctx: zmq.asyncio.Context) -> tuple[str, Awaitable[Any]]:
    # it serves while it waits for PS that never answer
    chief, ps, worker = (f"127.0.0.1:{p}" for p in free_ports(3))
    cfg = ChiefConfig(bind=chief, cluster=ClusterSpec(chief, (ps,), (worker,)))
    return chief, serve_chief(cfg, ctx)


@pytest.mark.parametrize(
    ("start", "error"),
    [
        # the PS: its server's reader waited in serve_ps
        (_ps, r"RuntimeError: ps 0: its server stopped reading.*a bug while reading"),
        # the chief: its reader is one of its watchers, which end it with their error
        (_chief, r"ValueError: a bug while reading"),
    ],
    ids=["ps", "chief"],
)
def test_a_server_whose_reader_failed_ends_failed_saying_why(
    monkeypatch: pytest.MonkeyPatch,
    start: Callable[[zmq.asyncio.Context], tuple[str, Awaitable[Any]]],
    error: str,
) -> None:
    dispatch = Server._dispatch
    broken: list[bool] = []

    def reading(self: Server, frames: list[Any]) -> None:
        if broken:
            raise ValueError("a bug while reading")
        dispatch(self, frames)

    monkeypatch.setattr(Server, "_dispatch", reading)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        endpoint, serving = start(ctx)
        task = asyncio.ensure_future(serving)
        client = Client(ctx, endpoint, "w0:0")
        try:
            await client.request("ping", timeout=5.0, attempts=3)  # it serves
            broken.append(True)
            asking = asyncio.ensure_future(client.request("ping", timeout=30.0))
            done, _ = await asyncio.wait([task], timeout=10.0)
            assert done, "it went on running, deaf, after its reader failed"
            exc = task.exception()
            assert re.search(error, f"{type(exc).__name__}: {exc}"), repr(exc)
            asking.cancel()
        finally:
            await _cancelled(task)
            await client.close()
            ctx.term()

    asyncio.run(main())


def test_a_client_whose_reply_reading_failed_fails_its_requests_and_reads_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error nobody planned for while a reply is read fails the requests waiting
    (at once, not at their deadline) and the next request is answered."""
    deliver = Client._deliver
    broken: list[bool] = []

    def reading(self: Client, frames: Any) -> None:
        if broken:
            broken.clear()
            raise ValueError("a bug while reading a reply")
        deliver(self, frames)

    monkeypatch.setattr(Client, "_deliver", reading)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        server = Server(ctx, "tcp://127.0.0.1:0", lambda m: reply(m), name="t")
        endpoint = server.bind()
        server.start()
        client = Client(ctx, endpoint, "c", timeout=30.0)
        try:
            assert (await client.request("ping")).op == "ok"
            broken.append(True)
            started = time.monotonic()
            with pytest.raises(ProtocolError, match="a bug while reading a reply"):
                await client.request("ping")
            assert time.monotonic() - started < 10  # not its 30 s deadline
            assert (await client.request("ping")).op == "ok"  # the reader went on
            assert client.stats.bad_messages == 1
        finally:
            await client.close()
            await server.stop()
            ctx.term()

    asyncio.run(main())
