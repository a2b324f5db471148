"""The bound on the connections a server socket keeps (transport/connections.py):
raw ZMTP peers that complete their handshake and stay silent, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable

import pytest
import zmq
import zmq.asyncio

from zmqps.transport import Client, Server, SocketOptions
from zmqps.wire import Message, reply

pytestmark = pytest.mark.timeout(30)

BOUND = 50
OPTS = SocketOptions(linger_ms=0, max_connections=BOUND)


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())  # type: ignore[arg-type]


def ping(msg: Message) -> Message:
    return reply(msg, {"pong": msg.op})


def hello() -> bytes:
    """A ZMTP 3.0 NULL greeting and READY of a DEALER (all an idle peer sends)."""
    greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
    body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    return greeting + b"\x04" + bytes([len(body)]) + body


async def idle_peer(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(hello())
    await writer.drain()
    return reader, writer


async def closed_by_server(reader: asyncio.StreamReader, wait: float) -> bool:
    """Whether the server ended this connection (read to its end within ``wait``)."""
    try:
        while await asyncio.wait_for(reader.read(4096), wait):
            pass
    except (TimeoutError, asyncio.TimeoutError):
        return False
    except ConnectionError:
        return True
    return True


def open_on(port: int) -> int:
    """Descriptors of this process that are connections accepted on ``port``."""
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            probe = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if probe.type == socket.SOCK_STREAM and probe.getsockname()[1] == port:
                probe.getpeername()
                n += 1
        except (OSError, IndexError, TypeError):
            pass
        finally:
            probe.close()
    return n


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def bounded_server(ctx: zmq.asyncio.Context) -> tuple[Server, str, int]:
    """A started server of ``BOUND`` connections: it, its endpoint, its port."""
    server = Server(ctx, "127.0.0.1:0", ping, name="bounded", options=OPTS)
    endpoint = server.bind()
    server.start()
    return server, endpoint, int(endpoint.rsplit(":", 1)[1])


async def ask(client: Client, attempts: int = 1) -> None:
    rep = await client.request("ping", {}, attempts=attempts)
    assert rep.body == {"pong": "ping"}


def test_idle_peers_past_the_bound_are_shut_down_and_a_client_is_served() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        server, endpoint, port = bounded_server(ctx)
        client = Client(ctx, endpoint, "c0", options=OPTS, timeout=5.0)
        peers: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        try:
            await ask(client)
            flood = 3 * BOUND
            for _ in range(flood):
                peers.append(await idle_peer(port))
            # the server ends every connection past its bound, and keeps the rest
            ended = await asyncio.gather(*(closed_by_server(r, 1.0) for r, _ in peers))
            assert sum(ended) >= flood + 1 - BOUND
            await wait_until(lambda: len(server.connections) <= BOUND)
            assert open_on(port) <= BOUND
            assert server.stats.conn_refusals == sum(ended)
            await ask(client)  # the client connected before the flood is still served
            # once the idle peers leave, new clients are let in again (no drift)
            for _, w in peers:
                w.close()
            await wait_until(lambda: len(server.connections) == 1)
            await wait_until(lambda: open_on(port) == 1)
            peers = [await idle_peer(port) for _ in range(BOUND - 1)]
            assert not any(await asyncio.gather(*(closed_by_server(r, 0.3) for r, _ in peers)))
            assert len(server.connections) == BOUND == open_on(port)
            for _, w in peers:
                w.close()
            await wait_until(lambda: len(server.connections) == 1)
            other = Client(ctx, endpoint, "c1", options=OPTS, timeout=5.0)
            try:
                await ask(other)
            finally:
                await other.close()
        finally:
            for _, w in peers:
                w.close()
            await client.close()
            await server.stop()
            ctx.term()

    run(main)


def test_a_client_refused_at_the_bound_gets_in_once_a_connection_closes() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        server, endpoint, port = bounded_server(ctx)
        peers = [await idle_peer(port) for _ in range(BOUND)]
        await wait_until(lambda: len(server.connections) == BOUND)
        client = Client(ctx, endpoint, "late", options=OPTS, timeout=8.0)
        try:
            # sent on a connection that is shut down: sent again on the next one
            # (as every request a client may repeat is, ``attempts``)
            answer = asyncio.ensure_future(ask(client, attempts=5))
            await wait_until(lambda: server.stats.conn_refusals >= 2)
            # (a refused connection's handshake completes in libzmq before it is shut
            # down, so a request it sent may be served first: not asserted)
            assert len(server.connections) == BOUND
            for _, w in peers[:10]:
                w.close()
            await asyncio.wait_for(answer, 6.0)
            assert len(server.connections) <= BOUND
            # the idle peers kept were never the ones shut down
            assert not any(await asyncio.gather(*(closed_by_server(r, 0.1) for r, _ in peers[10:])))
        finally:
            for _, w in peers:
                w.close()
            await client.close()
            await server.stop()
            ctx.term()

    run(main)


def test_a_missed_disconnect_never_locks_clients_out() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        server = Server(ctx, "127.0.0.1:0", ping, name="bounded", options=OPTS)
        endpoint = server.bind()
        server.start()
        # descriptors counted whose disconnect never came: closed ones, and one that
        # is open but not a connection of this server (its listener's neighbour)
        spare = socket.socket()
        stale = {100_000 + i for i in range(BOUND - 1)} | {spare.fileno()}
        server.connections._accepted.update(dict.fromkeys(stale, 0.0))
        client = Client(ctx, endpoint, "c0", options=OPTS, timeout=5.0)
        try:
            await ask(client)
            assert server.stats.conn_refusals == 0
            assert not server.connections.fds & stale
            assert len(server.connections) == 1
        finally:
            spare.close()
            await client.close()
            await server.stop()
            ctx.term()

    run(main)


def test_at_the_bound_a_connection_that_never_spoke_makes_room_for_a_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One client holding more idle connections than the bound shut every other client
    out until it let go (4,200 of them against 4,096). At the bound, the oldest
    connection that never sent a message (past ``QUIET_GRACE_S``) is shut down to let
    the new one in; a client that spoke is kept."""
    from zmqps.transport import connections

    monkeypatch.setattr(connections, "QUIET_GRACE_S", 0.5)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        server, endpoint, port = bounded_server(ctx)
        spoke = Client(ctx, endpoint, "c0", options=OPTS, timeout=5.0)
        peers: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        late: list[Client] = []
        try:
            await ask(spoke)
            peers = [await idle_peer(port) for _ in range(BOUND - 1)]
            await wait_until(lambda: len(server.connections) == BOUND)
            await asyncio.sleep(0.6)
            for k in range(5):  # each one is let in, an idle peer shut down for it
                late.append(Client(ctx, endpoint, f"late{k}", options=OPTS, timeout=5.0))
                await ask(late[-1])
            assert server.stats.conn_refusals == 0
            assert server.connections.evicted == 5
            ended = await asyncio.gather(*(closed_by_server(r, 0.3) for r, _ in peers))
            assert sum(ended) == 5
            assert ended[:5] == [True] * 5  # the oldest first
            assert len(server.connections) == BOUND
            await ask(spoke)  # the client that spoke was never the one shut down
            for c in late:
                await ask(c)
        finally:
            for _, w in peers:
                w.close()
            for c in (spoke, *late):
                await c.close()
            await server.stop()
            ctx.term()

    run(main)
