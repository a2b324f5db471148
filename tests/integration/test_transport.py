"""The transport contract over real ZeroMQ sockets on 127.0.0.1, and (where the
contract is the same) over the in-memory FakeNetwork.

Every test binds port 0, closes what it opens and terminates its context.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

from zmqps.transport import Client, FakeNetwork, Server, SocketOptions, TransportStats
from zmqps.transport.base import Handler, Requester
from zmqps.transport.unread import UnreadReplies
from zmqps.wire import ERROR, Message, Tensor, decode, encode, reply, request
from zmqps.wire.errors import (
    DeadlineExceeded,
    FencedError,
    InvalidArgument,
    NotFound,
    NotReady,
    ProtocolError,
    RemoteError,
    ShutdownError,
    ZmqpsError,
)

pytestmark = pytest.mark.timeout(30)

LOCAL = "127.0.0.1:0"
#: Tests leave nothing worth lingering for; a bounded linger keeps ctx.term() prompt.
OPTS = SocketOptions(linger_ms=0)
KINDS = ["zmq", "fake"]


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def zmq_server(
    ctx: zmq.asyncio.Context, handler: Handler, **kwargs: Any
) -> AsyncIterator[Server]:
    kwargs.setdefault("options", OPTS)
    server = Server(ctx, LOCAL, handler, name="test", **kwargs)
    endpoint = server.bind()
    assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
    server.start()
    try:
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def zmq_client(
    ctx: zmq.asyncio.Context, endpoint: str, identity: str = "c0", timeout: float = 5.0
) -> AsyncIterator[Client]:
    client = Client(ctx, endpoint, identity, options=OPTS, timeout=timeout)
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def serving(
    kind: str, handler: Handler, timeout: float = 5.0
) -> AsyncIterator[tuple[Requester, TransportStats, TransportStats]]:
    """(client, server stats, client stats) for ``handler`` behind transport ``kind``."""
    if kind == "fake":
        net = FakeNetwork()
        stats = net.serve("srv", handler, name="fake")
        fake = net.client("srv", "c0", timeout=timeout)
        try:
            yield fake, stats, fake.stats
        finally:
            await fake.close()
        return
    ctx = zmq.asyncio.Context()
    try:
        async with (
            zmq_server(ctx, handler) as server,
            zmq_client(ctx, server.endpoint, timeout=timeout) as client,
        ):
            yield client, server.stats, client.stats
    finally:
        ctx.term()


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ping_handler(msg: Message) -> Message:
    return reply(msg, {"pong": msg.op})


# --------------------------------------------------------------------------- pipelining


@pytest.mark.parametrize("kind", KINDS)
def test_500_requests_in_flight_on_one_socket_matched_by_id(kind: str) -> None:
    rng = random.Random(7)
    delays = [rng.uniform(0.0, 0.02) for _ in range(500)]
    active = peak = 0

    async def echo(msg: Message) -> Message:
        nonlocal active, peak
        (i,) = msg.body["shards"]
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(delays[i])  # finish out of order
        active -= 1
        (t,) = msg.tensors
        assert t.ref == i and not t.array.flags.owndata  # a view of the frame
        return reply(msg, {"n": i}, [Tensor(t.array * 2, "value", i, i * 3)])

    async def main() -> None:
        async with serving(kind, echo) as (client, sstats, cstats):

            async def one(i: int) -> None:
                payload = np.full(i % 17 + 1, i, dtype=np.int64)
                rep = await client.request("pull", {"shards": [i]}, [Tensor(payload, "value", i)])
                assert rep.body == {"n": i}
                (t,) = rep.tensors
                assert (t.ref, t.offset, t.array.size) == (i, i * 3, i % 17 + 1)
                assert np.all(t.array == 2 * i)

            await asyncio.gather(*(one(i) for i in range(500)))
            assert sstats.requests == 500 and sstats.by_op == {"pull": 500}
            assert cstats.replies == 500
            assert cstats.late_replies == 0 and cstats.timeouts == 0

    run(main)
    assert peak > 50  # really in flight together, not one after another


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(), (0,), (0, 4), (3, 0, 2), (2, 3, 1, 1, 1, 1, 1, 2)])
def test_edge_shaped_tensors_echo(kind: str, shape: tuple[int, ...]) -> None:
    def echo(msg: Message) -> Message:
        return reply(msg, {}, [Tensor(t.array, "rows", t.ref) for t in msg.tensors])

    async def main() -> None:
        async with serving(kind, echo) as (client, _, _):
            arr = np.arange(int(np.prod(shape)), dtype=np.float16).reshape(shape)
            rep = await client.request("pull_rows", {"shards": [1]}, [Tensor(arr, "index", 1)])
            (t,) = rep.tensors
            assert t.array.shape == shape and t.array.dtype == np.float16
            assert np.array_equal(t.array, arr)

    run(main)


# --------------------------------------------------------------------------- deadlines


@pytest.mark.parametrize("kind", KINDS)
def test_slow_handler_gives_deadline_exceeded(kind: str) -> None:
    async def slow(msg: Message) -> Message:
        if msg.op == "status":
            await asyncio.sleep(0.5)
        return reply(msg)

    async def main() -> None:
        async with serving(kind, slow) as (client, _, cstats):
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                await client.request("status", timeout=0.1)
            assert time.monotonic() - t0 < 0.45
            assert (await client.request("ping", timeout=2.0)).op == "ok"  # still usable
            if kind == "zmq":
                assert cstats.timeouts == 1
                # the late reply arrives after its caller gave up: dropped and counted
                await wait_until(lambda: cstats.late_replies == 1)
                assert cstats.replies == 1

    run(main)


def test_server_drops_requests_past_their_deadline() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            async with zmq_server(ctx, ping_handler) as server:
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(server.endpoint)
                try:
                    stale = request("ping", id=1, deadline=time.time() - 30.0)
                    fresh = request("ping", id=2, deadline=time.time() + 30.0)
                    await dealer.send_multipart(encode(stale))
                    await dealer.send_multipart(encode(fresh))
                    rep = decode(await asyncio.wait_for(dealer.recv_multipart(), 5))
                    assert (rep.op, rep.id) == ("ok", 2)
                    assert server.stats.expired == 1
                    assert server.stats.requests == 1  # the stale one never reached the handler
                    assert await dealer.poll(200) == 0  # and got no reply
                finally:
                    dealer.close()
        finally:
            ctx.term()

    run(main)


def test_stuck_server_drops_what_its_clients_gave_up_on() -> None:
    served: list[str] = []

    def handler(msg: Message) -> Message:
        served.append(msg.op)
        if msg.op == "status":
            time.sleep(0.3)  # a handler that blocks the whole loop
        return reply(msg)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            async with (
                zmq_server(ctx, handler, clock_skew=0.0) as server,
                zmq_client(ctx, server.endpoint) as client,
            ):
                status = asyncio.ensure_future(client.request("status", timeout=5.0))
                ping = asyncio.ensure_future(client.request("ping", timeout=0.1))
                assert (await status).op == "ok"
                with pytest.raises(DeadlineExceeded):
                    await ping
                assert server.stats.expired == 1
                assert served == ["status"]
        finally:
            ctx.term()

    run(main)


@pytest.mark.parametrize("attempts", [1, 2])
def test_a_loop_busy_past_the_heartbeat_timeout_loses_what_queued_past_the_hwm(
    attempts: int,
) -> None:
    """A server whose loop is busy past the ZMTP heartbeat timeout while a connection
    holds more than its RCVHWM of requests: libzmq stops reading that connection, no
    heartbeat gets through, and the connection is dropped with the requests it held
    that the loop had not read yet. A request that may be sent again (``attempts`` > 1: every
    worker's push, pull, poll and heartbeat) is sent again on the new connection and
    answered; one that may not waits for its deadline. (Found at 1,000 simulated
    workers over 10 PS, whose pushes were sent once: the run hung.)"""
    opts = SocketOptions(heartbeat_ivl_ms=100, heartbeat_timeout_ms=500, heartbeat_ttl_ms=1000)
    first = [True]

    def handler(msg: Message) -> Message:
        if first[0]:
            first[0] = False
            time.sleep(1.5)  # the loop busy, three heartbeat timeouts
        return reply(msg)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            async with zmq_server(ctx, handler, options=opts) as server:
                client = Client(ctx, server.endpoint, "c0", options=opts, timeout=6.0)
                try:
                    replies = await asyncio.gather(
                        *(client.request("status", attempts=attempts) for _ in range(32)),
                        return_exceptions=True,
                    )
                finally:
                    await client.close()
            lost = [r for r in replies if isinstance(r, BaseException)]
            if attempts == 1:
                assert lost and all(isinstance(r, DeadlineExceeded) for r in lost)
            else:
                assert not lost
                assert client.stats.resent >= 1
        finally:
            ctx.term()

    run(main)


_NOT_READING = """
import sys, time, zmq
from zmqps.transport import SocketOptions
sock = zmq.Context().socket(zmq.ROUTER)
SocketOptions().apply_router(sock)
print(sock.bind_to_random_port("tcp://127.0.0.1"), flush=True)
time.sleep(float(sys.argv[1]))  # a loop that never reads: each connection's pipe fills
print("alive", flush=True)
"""


def test_a_server_that_stopped_reading_survives_its_clients_hanging_up() -> None:
    """A server whose loop does not read (busy, or the process stopped) while clients
    send past its RCVHWM, then hang up (as they do past the heartbeat timeout): libzmq
    4.3.5 aborted the whole process (SIGABRT, ``Assertion failed: !_io_error
    (src/stream_engine_base.cpp:310)``) when the server's own ZMTP ping timer fired on
    such a connection. A server sends no pings of its own (``apply_router``): the
    process lives (fault schedule 13024 killed a PS this way)."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _NOT_READING, "3.5"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        ctx = zmq.Context()
        for k in range(3):  # three connections: reading stops, then each hangs up
            sock = ctx.socket(zmq.DEALER)
            SocketOptions().apply_dealer(sock, b"client-%d" % k)
            sock.connect(f"tcp://127.0.0.1:{port}")
            for _ in range(200):
                sock.send(b"x" * 100)
            time.sleep(0.5)
            sock.close(linger=0)
        out, _ = proc.communicate(timeout=30)
        ctx.term()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"the server exited with {proc.returncode}"
    assert out.strip() == "alive"


@pytest.mark.parametrize("kind", KINDS)
def test_no_server_at_all_gives_deadline_exceeded(kind: str) -> None:
    async def main() -> None:
        if kind == "fake":
            net = FakeNetwork()
            fake = net.client("nobody", "c0", timeout=0.2)
            with pytest.raises(DeadlineExceeded):
                await fake.request("ping")
            await fake.close()
            return
        ctx = zmq.asyncio.Context()
        try:
            async with zmq_client(ctx, f"127.0.0.1:{free_port()}", timeout=0.2) as client:
                t0 = time.monotonic()
                with pytest.raises(DeadlineExceeded):
                    await client.request("ping")
                with pytest.raises(DeadlineExceeded):
                    await client.request("ping", attempts=2)
                assert time.monotonic() - t0 < 2.0
        finally:
            ctx.term()  # linger 0: the unsent requests do not hold it up

    run(main)


# --------------------------------------------------------------------------- errors

ERRORS: list[tuple[Exception, type[ZmqpsError]]] = [
    (NotFound("no shard 12 here"), NotFound),
    (InvalidArgument("shape (3,) != (4,)"), InvalidArgument),
    (FencedError("incarnation 1 replaced by 2"), FencedError),
    (NotReady("variables not created"), NotReady),
    (ProtocolError("a PS does not serve 'register'"), ProtocolError),
    (ValueError("boom"), RemoteError),
    (KeyError("k"), RemoteError),
    (ZeroDivisionError(), RemoteError),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("err", "typ"), ERRORS, ids=lambda e: type(e).__name__)
def test_handler_errors_become_typed_exceptions(
    kind: str, is_async: bool, err: Exception, typ: type[ZmqpsError]
) -> None:
    def sync_handler(msg: Message) -> Message:
        if msg.op == "status":
            raise err
        return reply(msg)

    async def async_handler(msg: Message) -> Message:
        await asyncio.sleep(0)
        return sync_handler(msg)

    async def main() -> None:
        handler = async_handler if is_async else sync_handler
        async with serving(kind, handler) as (client, sstats, _):
            for round_ in range(3):
                with pytest.raises(typ) as info:
                    await client.request("status")
                assert type(info.value) is typ
                if typ is RemoteError:
                    assert info.value.code == "internal"
                    assert type(err).__name__ in str(info.value) or str(err) in str(info.value)
                else:
                    assert str(err) in str(info.value)
                # the server keeps serving everyone
                assert (await client.request("ping")).op == "ok"
                assert sstats.errors == round_ + 1
            assert sstats.requests == 6

    run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_closed_client_refuses_requests(kind: str) -> None:
    async def main() -> None:
        async with serving(kind, ping_handler) as (client, _, _):
            assert (await client.request("ping")).op == "ok"
            await client.close()
            with pytest.raises(ShutdownError):
                await client.request("ping")
            await client.close()  # idempotent

    run(main)


def test_close_fails_pending_requests_with_shutdown() -> None:
    async def never(msg: Message) -> Message:
        await asyncio.sleep(10)
        return reply(msg)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            async with zmq_server(ctx, never) as server:
                client = Client(ctx, server.endpoint, "c0", options=OPTS, timeout=5)
                pending = asyncio.ensure_future(client.request("status"))
                await asyncio.sleep(0.05)
                await client.close()
                with pytest.raises(ShutdownError):
                    await pending
        finally:
            ctx.term()

    run(main)


# --------------------------------------------------------------------------- retries


@pytest.mark.parametrize("kind", KINDS)
def test_retry_after_a_lost_reply(kind: str) -> None:
    calls = 0

    async def first_is_lost(msg: Message) -> Message:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(0.6)  # the first attempt's reply comes too late
        return reply(msg, {"call": calls})

    async def main() -> None:
        nonlocal calls
        async with serving(kind, first_is_lost, timeout=0.25) as (client, _, cstats):
            rep = await client.request("push", _push_body(), attempts=2)
            assert rep.body == {"call": 2}
            assert calls == 2
            if kind == "zmq":
                assert cstats.timeouts == 1
                await wait_until(lambda: cstats.late_replies == 1)
            calls = 0
            with pytest.raises(DeadlineExceeded):
                await client.request("push", _push_body(), attempts=1)

    run(main)


def test_a_lost_connection_coming_back_resends_what_may_be_resent() -> None:
    """Requests on a connection that dies (a partition noticed by the heartbeat, a
    restarted peer) are lost with it. When the connection comes back, those that may
    be sent again (attempts > 1) are, at once, not after their deadline; the others
    wait for their deadline."""
    port = free_port()
    seen: list[str] = []

    def handler(msg: Message) -> Message:
        seen.append(msg.op)
        return reply(msg, {"op": msg.op})

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        hole = ctx.socket(zmq.ROUTER)  # takes the requests, never answers, then goes
        hole.bind(f"tcp://127.0.0.1:{port}")
        client = Client(ctx, f"127.0.0.1:{port}", "c0", options=OPTS, timeout=20.0)
        try:
            push = asyncio.ensure_future(client.request("push", _push_body(), attempts=2))
            once = asyncio.ensure_future(client.request("status", timeout=3.0))
            for _ in range(2):
                await asyncio.wait_for(hole.recv_multipart(), 5.0)
            hole.close(linger=0)
            server = Server(ctx, f"127.0.0.1:{port}", handler, name="back", options=OPTS)
            for _ in range(100):  # zmq closes the hole in its I/O thread: a moment
                try:
                    server.bind()
                    break
                except OSError:
                    await asyncio.sleep(0.02)
            server.start()
            try:
                rep = await asyncio.wait_for(push, 15.0)
                assert rep.body == {"op": "push"}
                with pytest.raises(DeadlineExceeded):
                    await once
            finally:
                await server.stop()
            assert seen == ["push"]
            assert client.stats.resent == 1
            assert client.stats.timeouts == 1  # the status request only
        finally:
            await client.close()
            ctx.term()

    run(main)


def _push_body() -> dict[str, Any]:
    return {"shards": [0], "versions": [0], "worker": "w", "inc": 0, "seq": 1}


# --------------------------------------------------------------------------- large payloads


def test_64mb_tensor_in_4mb_chunks_arrives_intact() -> None:
    n = 16 << 20  # 64 MiB of float32
    step = 1 << 20  # 4 MiB chunks
    data = np.random.default_rng(3).standard_normal(n, dtype=np.float32)
    seen: dict[str, Any] = {}

    def handler(msg: Message) -> Message:
        got = np.empty(n, dtype=np.float32)
        for t in msg.tensors:
            assert t.kind == "grad" and t.ref == 5 and t.array.dtype == np.float32
            assert not t.array.flags.owndata  # a view of the received frame, not a copy
            got[t.offset : t.offset + t.array.size] = t.array
        seen["chunks"] = len(msg.tensors)
        seen["equal"] = np.array_equal(got, data)
        # echo the chunks back, zero-copy, in reverse order
        return reply(msg, {}, [Tensor(t.array, "value", 5, t.offset) for t in msg.tensors[::-1]])

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            async with (
                zmq_server(ctx, handler) as server,
                zmq_client(ctx, server.endpoint, timeout=20.0) as client,
            ):
                chunks = [Tensor(data[o : o + step], "grad", 5, o) for o in range(0, n, step)]
                rep = await client.request("push", _push_body(), chunks)
                assert seen == {"chunks": 16, "equal": True}
                back = np.empty(n, dtype=np.float32)
                for t in rep.tensors:
                    back[t.offset : t.offset + t.array.size] = t.array
                assert len(rep.tensors) == 16 and np.array_equal(back, data)
                assert server.stats.bytes_in >= data.nbytes
                assert client.stats.bytes_in >= data.nbytes
        finally:
            ctx.term()

    run(main)


# --------------------------------------------------------------------------- identities


@pytest.mark.parametrize("first_still_open", [False, True], ids=["closed", "open"])
def test_router_handover_serves_a_restarted_peer_with_the_same_identity(
    first_still_open: bool,
) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            async with zmq_server(ctx, ping_handler) as server:
                first = Client(ctx, server.endpoint, "worker:0", options=OPTS, timeout=3)
                try:
                    assert (await first.request("ping")).op == "ok"
                    if not first_still_open:
                        await first.close()
                    async with zmq_client(ctx, server.endpoint, "worker:0", timeout=3) as second:
                        assert (await second.request("ping")).op == "ok"
                        assert (await second.request("ping")).op == "ok"
                finally:
                    await first.close()
                assert server.stats.requests == 3
        finally:
            ctx.term()

    run(main)


def test_a_client_taking_another_clients_name_as_its_routing_id_takes_nothing_over() -> None:
    """ROUTER_HANDOVER gives a connection to whoever connects with its routing id. A
    client that connected once as ``chief:0`` (the chief's name toward every PS) and
    left cut the chief off that PS for good: every request of the chief's timed out.
    A client's routing id is its name and 8 random bytes, so the name alone takes
    nothing over."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            async with (
                zmq_server(ctx, ping_handler) as server,
                zmq_client(ctx, server.endpoint, "chief:0", timeout=3) as chief,
            ):
                assert (await chief.request("ping")).op == "ok"
                own = chief._sock.getsockopt(zmq.ROUTING_ID)
                assert own.startswith(b"chief:0/") and len(own) == len(b"chief:0/") + 16
                for name in (b"chief:0", own.split(b"/")[0]):
                    thief = ctx.socket(zmq.DEALER)
                    thief.setsockopt(zmq.LINGER, 0)
                    thief.setsockopt(zmq.ROUTING_ID, name)
                    thief.connect(server.endpoint)
                    await thief.send_multipart([b"", b"x"])
                    await asyncio.sleep(0.2)
                    thief.close()
                for _ in range(3):
                    assert (await chief.request("ping")).op == "ok"
        finally:
            ctx.term()

    run(main)


def test_reply_to_a_gone_peer_is_dropped_and_counted() -> None:
    async def slow(msg: Message) -> Message:
        if msg.op == "status":
            await asyncio.sleep(0.3)
        return reply(msg)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            async with zmq_server(ctx, slow) as server:
                async with zmq_client(ctx, server.endpoint, "leaver") as leaver:
                    assert (await leaver.request("ping")).op == "ok"
                    asyncio.ensure_future(leaver.request("status")).add_done_callback(
                        lambda f: f.exception()
                    )
                    await asyncio.sleep(0.05)
                # the leaver is gone before its reply is ready
                await wait_until(lambda: server.stats.unroutable == 1)
                async with zmq_client(ctx, server.endpoint, "stayer") as stayer:
                    assert (await stayer.request("ping")).op == "ok"
        finally:
            ctx.term()

    run(main)


def test_long_polls_of_a_closed_connection_are_dropped_and_nothing_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer's long polls pin nothing once its connection closes: they are dropped
    and counted, while its other waits, a live peer's polls and the polls of a new
    connection (which may reuse the closed one's descriptor) are kept and answered.
    The monitor is read only when a poll arrives here (its periodic look is put off,
    its reader on events off),
    so the closed connection's disconnect is always still unread when the new
    connection's first poll comes."""
    import zmqps.transport.server as server_module

    monkeypatch.setattr(server_module, "_MONITOR_EVERY_S", 3600.0)
    monkeypatch.setattr(server_module, "_MONITOR_ON_EVENT", False)

    async def main() -> None:
        release = asyncio.Event()

        def waiting(msg: Message) -> Any:
            async def wait() -> Message:
                await release.wait()
                return reply(msg, {"step": 1})

            return wait()

        ctx = zmq.asyncio.Context()
        socks: list[zmq.asyncio.Socket] = []

        def dealer(identity: bytes, endpoint: str) -> zmq.asyncio.Socket:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.ROUTING_ID, identity)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            socks.append(s)
            return s

        async def send(s: zmq.asyncio.Socket, op: str, n: int, first: int) -> None:
            for i in range(n):
                await s.send_multipart(encode(request(op, {"wait": 60.0}, id=first + i)))

        try:
            async with zmq_server(ctx, waiting) as server:
                pending = lambda: server._dispatcher.pending  # noqa: E731
                leaver = dealer(b"leaver", server.endpoint)
                stayer = dealer(b"stayer", server.endpoint)
                await send(leaver, "get_placement", 50, 1)
                await send(leaver, "checkpoint", 5, 100)  # waits, not a long poll: kept
                await send(stayer, "get_placement", 20, 1)
                await wait_until(lambda: pending() == 75)
                leaver.close()
                await asyncio.sleep(0.3)  # its disconnect is in the monitor, unread
                assert server.stats.gone == 0 and pending() == 75
                newcomer = dealer(b"newcomer", server.endpoint)
                await send(newcomer, "get_placement", 10, 1)
                await wait_until(lambda: server.stats.gone == 50)
                await wait_until(lambda: pending() == 5 + 20 + 10)
                await asyncio.sleep(0.2)
                assert server.stats.gone == 50 and pending() == 35
                release.set()
                for s, n in ((stayer, 20), (newcomer, 10)):
                    got = []
                    for _ in range(n):
                        got.append(decode(await s.recv_multipart()))
                    assert sorted(m.id for m in got) == list(range(1, n + 1))
                    assert all(m.op == "ok" and m.body == {"step": 1} for m in got)
                await wait_until(lambda: pending() == 0)
        finally:
            for s in socks:
                s.close(linger=0)
            ctx.term()

    run(main)


def test_long_polls_of_connections_closed_at_once_give_every_place_back() -> None:
    """Thousands of connections, each sending one long poll and closing at once: a
    poll whose disconnect was read in the same turn it came (another connection's
    poll reads the monitor) was cancelled before its reply ran, and its place among
    the pending requests was never given back (771 of 20,000 on a PS; past 16,384 in
    all every long poll, the chief's and the workers' included, would be refused
    ``busy`` for ever), and a poll whose disconnect was read before the poll itself
    waited out its wait. Every poll is dropped with its connection, its place back."""

    async def main() -> None:
        began, ended = [0], [0]

        def waiting(msg: Message) -> Any:
            if msg.op == "ping":
                return reply(msg, {})

            async def wait() -> Message:
                began[0] += 1
                try:
                    await asyncio.sleep(msg.body["wait"])  # a poll ends with its wait
                finally:
                    ended[0] += 1
                return reply(msg, {"step": 1})

            return wait()

        ctx = zmq.asyncio.Context()
        try:
            async with zmq_server(ctx, waiting) as server:
                pending = lambda: server._dispatcher.pending  # noqa: E731
                for k in range(2000):
                    s = ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.LINGER, 0)
                    s.connect(server.endpoint)
                    await s.send_multipart(encode(request("get_placement", {"wait": 60.0}, id=k)))
                    await asyncio.sleep(0) if k % 50 else await asyncio.sleep(0.01)
                    s.close(linger=200)  # the poll leaves, then the connection closes
                await wait_until(lambda: server.stats.gone > 0, timeout=30.0)
                # each dropped with its connection (3 to 12 % of them, whose disconnect
                # was read before the poll was, waited out their 60 s)
                await wait_until(lambda: pending() == 0, timeout=20.0)
                # no wait left running for a gone peer: each cancelled wait ends (its
                # cancellation runs in a later turn than its place is given back; a wait
                # left running would end only after its 60 s)
                await wait_until(lambda: began[0] == ended[0], timeout=10.0)
                # the server still takes and answers a poll of a live peer
                live = ctx.socket(zmq.DEALER)
                live.connect(server.endpoint)
                await live.send_multipart(encode(request("ping", {}, id=1)))
                assert decode(await live.recv_multipart()).id == 1
                live.close(linger=0)
        finally:
            ctx.term()

    run(main)


# --------------------------------------------------------------------------- bad peers


def test_garbage_is_dropped_or_answered_and_the_server_keeps_serving() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            async with (
                zmq_server(ctx, ping_handler) as server,
                zmq_client(ctx, server.endpoint) as good,
            ):
                raw = ctx.socket(zmq.DEALER)
                raw.setsockopt(zmq.LINGER, 0)
                raw.connect(server.endpoint)
                try:
                    await raw.send_multipart([b"\xc1garbage"])  # undecodable: dropped
                    await raw.send_multipart([b""])  # empty header: dropped
                    await raw.send_multipart([b"\x00" * 100, b"x", b"y"])  # dropped
                    bad_version = encode(request("ping", id=11))
                    bad_version[0] = bad_version[0].replace(b"\xa1v\x01", b"\xa1v\x02")
                    await raw.send_multipart(bad_version)  # id readable: error reply
                    await raw.send_multipart(encode(reply(request("ping", id=12))))
                    await raw.send_multipart(encode(request("ping", id=13)))
                    assert (await good.request("ping")).op == "ok"
                    replies = [
                        decode(await asyncio.wait_for(raw.recv_multipart(), 5)) for _ in range(3)
                    ]
                    assert [(m.op, m.id) for m in replies] == [(ERROR, 11), (ERROR, 12), ("ok", 13)]
                    assert replies[0].body["code"] == "protocol"
                    assert "version" in replies[0].body["message"]
                    assert replies[1].body["code"] == "protocol"
                    assert await raw.poll(200) == 0
                    assert server.stats.bad_messages == 5
                    assert server.stats.requests == 2
                finally:
                    raw.close()
        finally:
            ctx.term()

    run(main)


def test_bad_reply_fails_only_its_own_request() -> None:
    """A malformed reply with a readable id fails that request with ProtocolError."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        try:
            async with zmq_client(ctx, f"127.0.0.1:{port}", timeout=3) as client:

                async def serve_badly() -> None:
                    for _ in range(2):
                        ident, *frames = await router.recv_multipart()
                        msg = decode(frames)
                        rep = encode(reply(msg, {"x": 1}, [Tensor(np.zeros(2, np.float32))]))
                        if msg.op == "status":
                            rep = rep[:1]  # announces a buffer it does not carry
                        await router.send_multipart([ident, *rep])

                server_task = asyncio.ensure_future(serve_badly())
                bad = asyncio.ensure_future(client.request("status"))
                good = asyncio.ensure_future(client.request("ping"))
                with pytest.raises(ProtocolError):
                    await bad
                assert (await good).body == {"x": 1}
                await server_task
                assert client.stats.bad_messages == 1
        finally:
            router.close()
            ctx.term()

    run(main)


def test_unencodable_reply_is_an_internal_error_and_the_server_keeps_serving() -> None:
    """A handler bug (a numpy scalar in a reply body) must not kill the receive loop."""

    def handler(msg: Message) -> Message:
        if msg.op == "status":
            return reply(msg, {"n": np.int64(3)})
        return reply(msg)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            async with (
                zmq_server(ctx, handler) as server,
                zmq_client(ctx, server.endpoint, timeout=3) as client,
            ):
                for _ in range(2):
                    with pytest.raises(RemoteError, match="internal"):
                        await client.request("status")
                    assert (await client.request("ping")).op == "ok"
                assert server.stats.errors == 2
        finally:
            ctx.term()

    run(main)


@pytest.mark.timeout(20)
def test_a_frame_over_maxmsgsize_is_refused_before_sending() -> None:
    """The peer would drop it and the connection silently: the sender gets a clear error
    at once (not a timeout), and the same client goes on working."""

    async def body() -> None:
        ctx = zmq.asyncio.Context()
        opts = SocketOptions(max_msg_size=1 << 16)
        server = Server(ctx, "tcp://127.0.0.1:0", lambda m: reply(m), name="t", options=opts)
        endpoint = server.bind()
        server.start()
        client = Client(ctx, endpoint, "c", options=opts, timeout=5.0)
        try:
            big = Tensor(np.zeros(1 << 15, np.float32), "grad", 0, 0)  # 128 KiB
            t0 = time.monotonic()
            with pytest.raises(InvalidArgument, match="over MAXMSGSIZE"):
                await client.request("push", {"x": 1}, [big])
            assert time.monotonic() - t0 < 1.0
            assert (await client.request("ping")).op == "ok"
        finally:
            await client.close()
            await server.stop()
            ctx.term()

    asyncio.run(body())


@pytest.mark.timeout(20)
def test_a_header_past_what_a_server_reads_is_refused_at_once_both_ways() -> None:
    """A request whose header is past the 1 MiB a server reads (a chief creating 5,000
    variables: 1.18 MB) was dropped unread, and its sender retried it until its startup
    timeout, 120 s, with "did not answer". The sender is told at once; a reply past what
    a client reads is an error reply instead, and both ends go on working."""

    def handler(msg: Message) -> Message:
        if msg.op == "status":
            return reply(msg, {"names": ["x" * 100] * 20_000})  # about 2 MB
        return reply(msg)

    async def body() -> None:
        ctx = zmq.asyncio.Context()
        server = Server(ctx, "tcp://127.0.0.1:0", handler, name="t")
        endpoint = server.bind()
        server.start()
        client = Client(ctx, endpoint, "c", timeout=5.0)
        try:
            t0 = time.monotonic()
            with pytest.raises(InvalidArgument, match=r"a header of 2,\d{3},\d{3} bytes, past"):
                await client.request("create_shards", {"names": ["y" * 100] * 20_000})
            with pytest.raises(InvalidArgument, match=r"the reply is a header of 2,\d{3},\d{3} b"):
                await client.request("status")
            assert time.monotonic() - t0 < 2.0
            assert (await client.request("ping")).op == "ok"
            assert server.stats.errors == 1
        finally:
            await client.close()
            await server.stop()
            ctx.term()

    asyncio.run(body())


def test_replies_dropped_at_a_full_pipe_are_counted_and_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer that sends and never reads fills its pipe: every reply beyond the HWM is
    dropped and counted, and the log says so once per interval, not once per reply."""
    payload = np.zeros(1 << 16, np.float32)  # 256 KiB replies: past the kernel's buffers

    def big(msg: Message) -> Message:
        return reply(msg, {}, [Tensor(payload)])

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        s = ctx.socket(zmq.DEALER)
        try:
            opts = SocketOptions(linger_ms=0, hwm=20)
            async with zmq_server(ctx, big, options=opts) as server:
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.RCVHWM, 1)
                s.connect(server.endpoint)
                ping = encode(request("ping", id=1, sender="mute"))
                for _ in range(1000):
                    await s.send_multipart(ping)
                await wait_until(lambda: server.stats.requests == 1000, 20)
                assert server.stats.unroutable > 800
                lines = [r for r in caplog.records if "peer not reading" in r.getMessage()]
                assert 1 <= len(lines) <= 2, len(lines)
        finally:
            s.close()
            ctx.term()

    run(main)


@pytest.mark.parametrize("nbytes", [2 << 20, 64 << 10, 8 << 10], ids=["2MiB", "64KiB", "8KiB"])
def test_a_peer_that_does_not_read_its_replies_pins_a_bounded_number_of_bytes(
    nbytes: int,
) -> None:
    """Replies with tensors are tracked until ZeroMQ hands them to the connection: a
    peer that sends requests and never reads has its requests refused ``busy`` once
    its unread bytes pass the bound (the handler never runs for them), while a peer
    that reads is served; once the mute peer reads, it is served again. Small replies
    too: untracked below 1 MiB, pulls of a small model that nobody read grew a PS by
    gigabytes (10,000 replies queued per connection)."""
    payload = np.ones(nbytes // 4, np.float32)
    handled: list[str] = []

    def big(msg: Message) -> Message:
        handled.append(msg.sender or "")
        return reply(msg, {}, [Tensor(payload)])

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        s = ctx.socket(zmq.DEALER)
        bound = min(16 << 20, 32 * nbytes)
        # what the kernel's socket buffers took, both ends of the loopback (a send
        # buffer grows to net.ipv4.tcp_wmem's largest, 4 MiB by default): bounded by
        # the kernel, not counted here
        wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[-1])
        slack = max(8 * nbytes, 4 * wmem)
        sends = bound // nbytes + slack // nbytes + 200
        try:
            unread = UnreadReplies(lambda: bound, lambda: 4 * bound)
            async with (
                zmq_server(ctx, big, unread=unread) as server,
                zmq_client(ctx, server.endpoint, "reader", timeout=10) as reader,
            ):
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.RCVHWM, 1)
                s.setsockopt(zmq.RCVBUF, 4096)
                s.connect(server.endpoint)
                for i in range(sends):
                    await s.send_multipart(encode(request("ping", id=i + 1, sender="mute")))
                await wait_until(lambda: server.stats.requests >= sends, 20)
                mute = handled.count("mute")
                # the bound, one reply past it, and what the kernel's buffers took
                assert mute * payload.nbytes <= bound + slack, mute
                assert server.stats.busy >= sends - mute > 0
                assert bound < unread.bytes <= bound + payload.nbytes + slack
                for _ in range(5):  # a peer that reads is served meanwhile
                    rep = await reader.request("ping")
                    assert rep.tensors[0].array.nbytes == payload.nbytes
                assert handled.count("reader") == 5
                # the mute peer reads everything: its next request is served
                while await s.poll(500):
                    await s.recv_multipart()
                await s.send_multipart(encode(request("ping", id=9999, sender="mute")))
                await wait_until(lambda: handled.count("mute") == mute + 1, 10)
        finally:
            s.close()
            ctx.term()

    run(main)


def test_a_status_query_to_a_gone_chief_never_blocks_the_event_loop() -> None:
    """``fetch_status`` to an address nobody serves fails with its timeout, and closing
    its client drops the unsent query: the caller's event loop (the launcher's, whose
    progress poll asks twice a second) is never held by ``ctx.term()`` waiting out the
    socket's linger (1 s)."""
    from zmqps.roles.status import fetch_status

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{s.getsockname()[1]}"
    assert SocketOptions().linger_ms >= 1000  # what would hold the loop

    async def main() -> tuple[float, type[BaseException]]:
        gaps: list[float] = []

        async def tick() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        try:
            with pytest.raises(ZmqpsError) as failed:
                await fetch_status(gone, timeout=0.3)
            await asyncio.sleep(0.05)
        finally:
            ticker.cancel()
        return max(gaps), failed.type

    longest, error = asyncio.run(main())
    assert issubclass(error, (DeadlineExceeded, ShutdownError)), error
    # the loop turned every few ms; with the linger it stood still for a whole second
    assert longest < 0.5, f"the event loop stood still for {longest:.2f} s"


def test_an_endpoint_libzmq_cannot_parse_is_an_invalid_argument() -> None:
    """A ``join`` or ``replica`` naming ``tcp://bad endpoint`` was answered ``internal``
    with a traceback in the PS's log: the endpoint is the sender's mistake."""
    ctx = zmq.asyncio.Context()
    try:
        for bad in ("tcp://bad endpoint", "tcp://127.0.0.1:notaport", "nope://x"):
            with pytest.raises(InvalidArgument, match="cannot connect to"):
                Client(ctx, bad, "chief:0", options=OPTS, timeout=1)
    finally:
        ctx.term()  # returns: no socket was left open


def test_a_submitted_request_cut_short_by_close_is_not_reported_as_never_retrieved() -> None:
    """A PS's link closed while entries it submitted were on their way printed
    "Task exception was never retrieved" with a ShutdownError traceback on the
    console of a run that went on fine."""
    reported: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reported.append(ctx))
        ctx = zmq.asyncio.Context()
        try:
            client = Client(ctx, f"tcp://127.0.0.1:{free_port()}", "c0", options=OPTS)
            futures = [client.submit("pull", {"shards": [k]}, timeout=30) for k in range(3)]
            await asyncio.sleep(0.05)
            await client.close()
            await asyncio.wait(futures, timeout=5)  # (reads none of their outcomes)
            assert all(f.done() for f in futures)
            del futures
            gc.collect()
            await asyncio.sleep(0)
        finally:
            ctx.term()

    run(main)
    assert not reported, reported


def test_a_client_tells_a_server_slow_to_answer_from_one_gone() -> None:
    """``Client.listening``: a process accepting connections at the address (slow to
    answer, or not) from none at all; the chief's end asks again while one listens."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            async with zmq_server(ctx, ping_handler) as server:
                up = Client(ctx, server.endpoint, "c0", options=OPTS)
                gone = Client(ctx, f"tcp://127.0.0.1:{free_port()}", "c1", options=OPTS)
                assert await up.listening() and not await gone.listening()
                await up.close()
                await gone.close()
                assert server.stats.auth_failures == 0 and server.stats.bad_messages == 0
        finally:
            ctx.term()

    run(main)
