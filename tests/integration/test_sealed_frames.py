"""Sealed bulk frames under CURVE over real TCP on 127.0.0.1 (``transport/seal.py``):
bulk requests and their replies go on the plaintext data connection, sealed; a peer
without a live session's credentials cannot open a connection to it (refused at the
handshake, counted, nothing of it reaches the server); what one holding them (an
observer of the wire) puts on that connection at the socket level (garbage, another
key, a replayed or a tampered message) is refused, counted and answered with a
notice, and the server goes on serving."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import zmq
import zmq.asyncio

from zmqps.metrics import Metrics
from zmqps.transport import Client, CurveKeys, Server, SocketOptions, keygen, load_keys
from zmqps.transport import client as client_module
from zmqps.transport.seal import NOTICE
from zmqps.wire import Message, Tensor, encode, reply, request

pytestmark = pytest.mark.timeout(60)


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())  # type: ignore[arg-type]


def _curve_keys(tmp_path: Path) -> Callable[[str], SocketOptions]:
    """Keys made in ``tmp_path``; the client options of a role's key."""
    keygen(tmp_path)

    def keys(role: str) -> SocketOptions:
        return SocketOptions(
            curve=load_keys(tmp_path, role, 0, serve=False, connect=True), linger_ms=0
        )

    return keys


def _curve_ps(ctx: Any, tmp_path: Path) -> tuple[Server, str]:
    """A PS (a new ``PSService``) serving on CURVE with the keys in ``tmp_path``,
    started: the server and its address."""
    from zmqps.roles.ps import PSService

    server_keys = load_keys(tmp_path, "ps", 0, serve=True, connect=False)
    options = SocketOptions(curve=server_keys, linger_ms=0)
    server = Server(ctx, "127.0.0.1:0", PSService(0), name="ps0", options=options)
    address = server.bind().removeprefix("tcp://")
    server.start()
    return server, address


def echo(msg: Message) -> Message:
    """Answers with the tensors it was sent, doubled."""
    return reply(
        msg,
        {"n": len(msg.tensors)},
        [dataclasses.replace(t, array=t.array * 2) for t in msg.tensors],
    )


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CurveKeys]:
    root = tmp_path_factory.mktemp("keys")
    keygen(root)
    return {
        "server": load_keys(root, "ps", 0, serve=True, connect=False),
        "worker": load_keys(root, "worker", 0, serve=False, connect=True),
    }


def refusals(m: Metrics, reason: str) -> float:
    v = m.registry.get_sample_value("zmqps_seal_refusals_total", {"reason": reason})
    return v or 0.0


def tensors(n: int, seed: int) -> list[Tensor]:
    rng = np.random.default_rng(seed)
    return [Tensor(rng.standard_normal(n).astype(np.float32), "value", i, 0) for i in range(3)]


async def sealed_round_trip(client: Client, seed: int) -> Message:
    """A request with tensors, sent until it goes sealed (the first bulk request
    agrees the session over CURVE and goes there itself); the reply checked."""
    for _ in range(500):
        ts = tensors(300_000, seed)
        before = client.stats.sealed
        rep = await client.request("ping", tensors=ts)
        for t, r in zip(ts, rep.tensors, strict=True):
            assert np.array_equal(r.array, t.array * 2)
        if client.stats.sealed > before:
            return rep
        await asyncio.sleep(0.01)
    raise AssertionError("no request went on the sealed data connection")


def echo_pair(
    ctx: zmq.asyncio.Context,
    keys: dict[str, CurveKeys],
    *,
    timeout: float,
    metrics: Metrics | None = None,
    seal: bool = True,
) -> tuple[Server, Client]:
    """A started CURVE echo server and a worker's client of it."""
    server = Server(
        ctx,
        "127.0.0.1:0",
        echo,
        name="ps0",
        options=SocketOptions(curve=keys["server"], linger_ms=0, seal=seal),
        observer=metrics,
    )
    server.start()
    client = Client(
        ctx,
        server.endpoint,
        "worker:0",
        options=SocketOptions(curve=keys["worker"], linger_ms=0),
        timeout=timeout,
    )
    return server, client


def test_bulk_requests_go_sealed_and_what_is_injected_is_refused_and_counted(
    keys: dict[str, CurveKeys], monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = Metrics()
    sent: list[list[bytes]] = []

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        server, client = echo_pair(ctx, keys, timeout=10.0, metrics=metrics)
        assert server.data_endpoint.startswith("tcp://127.0.0.1:")
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        try:
            # a request without tensors stays on CURVE and agrees nothing
            assert (await client.request("ping")).body == {"n": 0}
            assert client.stats.sealed == 0 and len(server.keyring) == 0
            original = client_module.send_now

            def spy(sock: Any, frames: list[Any], track: bool = False) -> Any:
                if sock is client._data_sock:
                    sent.append([bytes(memoryview(f).cast("B")) for f in frames])
                return original(sock, frames, track)

            monkeypatch.setattr(client_module, "send_now", spy)
            await sealed_round_trip(client, 1)
            assert server.stats.sealed >= 1 and len(server.keyring) == 1
            # what went on the wire is not the plaintext
            captured = sent[-1]
            plain = tensors(300_000, 1)[0].array.tobytes()
            assert plain[:64] not in captured[1]
            assert server.stats.seal_refusals == 0

            # now at the socket level, on the plaintext data connection, with the
            # session's credentials (they cross the wire in clear: an observer has them)
            assert client._sealer is not None
            key_id = client._sealer.key_id
            raw.setsockopt(zmq.PLAIN_USERNAME, key_id.hex().encode())
            raw.setsockopt(zmq.PLAIN_PASSWORD, server.keyring._sessions[key_id].password)
            raw.connect(server.data_endpoint)

            async def inject(frames: list[bytes], reason: str) -> None:
                n = server.stats.seal_refusals
                raw.send_multipart(frames)
                notice = await asyncio.wait_for(raw.recv_multipart(), 10.0)
                assert notice[0] == NOTICE and notice[-1] == reason.encode()
                assert server.stats.seal_refusals == n + 1
                assert refusals(metrics, reason) >= 1

            await inject([b"not sealed at all"], "malformed")
            await inject([b"\x01" * 8 + bytes(100)], "unknown_key")
            # unsealed frames of a real request: refused too (its first bytes name no key)
            frames = encode(request("ping", {}, tensors(10, 2), id=99, sender="x"))
            await inject([bytes(memoryview(f).cast("B")) for f in frames], "unknown_key")
            # the client's last sealed message, replayed
            await inject(captured, "replayed")
            # a message sealed with the session's key, one bit of it changed on the way
            forged = [
                bytearray(f)
                for f in client._sealer.seal(encode(request("ping", {}, tensors(10, 3), id=7)))
            ]
            forged[1][40] ^= 0x01
            await inject([bytes(f) for f in forged], "tampered")
            # frames of two messages put together
            a = [bytes(f) for f in client._sealer.seal(encode(request("ping", {}, (), id=8)))]
            b = [bytes(f) for f in client._sealer.seal(encode(request("ping", {}, (), id=9)))]
            await inject([a[0], b[0]], "tampered")
            assert server.stats.seal_refusals == 6
            assert refusals(metrics, "malformed") == 1 and refusals(metrics, "unknown_key") == 2
            assert refusals(metrics, "replayed") == 1 and refusals(metrics, "tampered") == 2

            # the server goes on serving, sealed, and on CURVE
            await sealed_round_trip(client, 4)
            assert (await client.request("ping")).body == {"n": 0}
            assert server.stats.seal_refusals == 6 and client.stats.seal_refusals == 0
        finally:
            raw.close(linger=0)
            await client.close(linger_ms=0)
            await server.stop()
            ctx.term()

    run(main)


def test_a_server_without_sealing_serves_everything_on_curve(keys: dict[str, CurveKeys]) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        server, client = echo_pair(ctx, keys, timeout=10.0, seal=False)
        assert server.data_endpoint == ""
        try:
            for i in range(5):
                ts = tensors(1000, i)
                rep = await client.request("ping", tensors=ts)
                assert np.array_equal(rep.tensors[0].array, ts[0].array * 2)
                await asyncio.sleep(0.01)
            assert client.stats.sealed == 0 and server.stats.sealed == 0
        finally:
            await client.close(linger_ms=0)
            await server.stop()
            ctx.term()

    run(main)


def test_a_new_session_after_the_server_forgets_the_key(keys: dict[str, CurveKeys]) -> None:
    """A server that no longer knows the client's key (evicted, or restarted) refuses
    its sealed requests with a notice: the client agrees a new session and sends the
    requests that may be sent again, sealed with the new key."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        server, client = echo_pair(ctx, keys, timeout=30.0)
        try:
            await sealed_round_trip(client, 1)
            assert client._sealer is not None
            old = client._sealer.key_id
            server.keyring.forget(old)
            # refused (unknown_key) and answered with a notice: the client agrees
            # again and sends it again, long before its 30 s deadline
            ts = tensors(1000, 5)
            rep = await client.request("ping", tensors=ts, attempts=2)
            assert np.array_equal(rep.tensors[0].array, ts[0].array * 2)
            assert client._sealer.key_id != old
            assert server.stats.seal_refusals == 1 and client.stats.resent >= 1
            assert client.stats.timeouts == 0
            await sealed_round_trip(client, 6)
        finally:
            await client.close(linger_ms=0)
            await server.stop()
            ctx.term()

    run(main)


def test_a_ps_serves_sealed_pulls_into_params_consistent_while_pushes_land(
    tmp_path: Path,
) -> None:
    """A PS under CURVE, pulls and pushes of a ParameterClient over TCP: they go
    sealed, a pull's chunks are opened straight into ``params``, and every pull is
    still one version of each shard while another worker's pushes land."""
    from zmqps.core.partition import Partitioner, plan
    from zmqps.core.variables import VariableDef
    from zmqps.roles.client import ParameterClient

    keys = _curve_keys(tmp_path)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        var = VariableDef("w", (4096, 1024), init={"name": "zeros"})  # 16 MiB
        placement = plan([var], 1, Partitioner(num_shards=3), optimizer={"name": "sgd", "lr": 1.0})
        server, address = _curve_ps(ctx, tmp_path)
        chief = Client(ctx, address, "chief:0", options=keys("chief"))
        clients = [Client(ctx, address, f"worker:{i}", options=keys("worker")) for i in range(2)]
        try:
            defs = [d.to_wire() for _, d in placement.shard_defs()]
            await chief.request("create_shards", {"shards": defs})
            reader, writer = (
                ParameterClient(
                    [c], placement, worker=f"worker:{i}", incarnation=1, shared_memory=False
                )
                for i, c in enumerate(clients)
            )
            ones = {"w": np.ones(var.shape, np.float32)}

            async def pulls() -> None:
                for _ in range(20):
                    w = (await reader.pull())["w"]
                    for s in placement.shards:
                        part = w[s.row_start : s.row_start + s.rows]
                        version = reader.versions[s.id]
                        assert part.min() == part.max() == -float(version), (s.id, version)

            async def pushes() -> None:
                for _ in range(20):
                    await writer.push(ones)
                    await asyncio.sleep(0.005)

            await asyncio.gather(pulls(), pushes())
            # the first bulk request of each went on CURVE, the rest sealed
            assert clients[0].stats.sealed >= 1 and clients[1].stats.sealed >= 1
            assert clients[0].stats.landed >= 1
            assert server.stats.seal_refusals == 0
            final = await reader.pull()
            assert np.all(final["w"] == -20.0)
        finally:
            for c in (chief, *clients):
                await c.close(linger_ms=0)
            await server.stop()
            ctx.term()

    run(main)


def test_a_workers_state_links_open_sealed_pulls_and_push_pulls_into_params(
    tmp_path: Path,
) -> None:
    """Through the state links a worker talks to its PS by (``Homes``), the values of a
    sealed pull's reply and of a sealed push_pull's reply are opened straight into
    ``params``: no chunk of either is copied there afterwards."""
    from zmqps.core.partition import Partitioner, plan
    from zmqps.core.variables import VariableDef
    from zmqps.roles.client import ParameterClient
    from zmqps.roles.homes import Homes

    keys = _curve_keys(tmp_path)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        var = VariableDef("w", (1024, 1024), init={"name": "zeros"})  # 4 MiB
        placement = plan([var], 1, Partitioner(num_shards=2), optimizer={"name": "sgd", "lr": 1.0})
        server, address = _curve_ps(ctx, tmp_path)
        chief = Client(ctx, address, "chief:0", options=keys("chief"))
        transport = Client(ctx, address, "worker:0", options=keys("worker"))
        try:
            defs = [d.to_wire() for _, d in placement.shard_defs()]
            await chief.request("create_shards", {"shards": defs})
            worker = ParameterClient(
                Homes([transport]).links(),
                placement,
                worker="worker:0",
                incarnation=1,
                shared_memory=False,
            )
            chunks = 2  # a reply tensor per shard (2 MiB each)
            ones = {"w": np.ones(var.shape, np.float32)}
            await worker.pull()  # the first bulk request agrees the session (on CURVE)
            await until(lambda: transport._data_up)
            params = worker.params["w"]
            before = transport.stats.landed
            w = (await worker.pull())["w"]
            assert w is params and np.all(w == 0.0)
            assert transport.stats.landed == before + chunks
            await worker.push_pull(ones)
            assert worker.params["w"] is params and np.all(params == -1.0)
            assert transport.stats.landed == before + 2 * chunks
            assert server.stats.seal_refusals == 0
        finally:
            for c in (chief, transport):
                await c.close(linger_ms=0)
            await server.stop()
            ctx.term()

    run(main)


def auth_failures(m: Metrics, reason: str) -> float:
    v = m.registry.get_sample_value("zmqps_auth_failures_total", {"reason": reason})
    return v or 0.0


async def until(condition: Callable[[], bool]) -> None:
    """Wait until ``condition`` holds (the test's timeout bounds the wait)."""
    while not condition():
        await asyncio.sleep(0.01)


def zmtp_greeting(mechanism: bytes) -> bytes:
    """A ZMTP 3.0 greeting, as a client (64 bytes)."""
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + bytes(32)


def test_a_peer_without_a_live_sessions_credentials_gets_nothing_through_the_data_port(
    keys: dict[str, CurveKeys],
) -> None:
    """The data port admits at its ZeroMQ handshake only a live session's credentials:
    a peer with none, or wrong or stale ones, is refused there (counted as an auth
    failure), and nothing it sends reaches the server: no seal refusal, no bad
    message, no notice back. A legitimate client's sealed requests go on, after a
    rekey (the old session and its credential retired) and after the server forgot
    its sessions (the client agrees anew, on a new connection)."""
    metrics = Metrics()

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        server, client = echo_pair(ctx, keys, timeout=30.0, metrics=metrics)
        raws: list[zmq.asyncio.Socket] = []

        def dealer(username: bytes | None = None, password: bytes = b"") -> zmq.asyncio.Socket:
            raw = ctx.socket(zmq.DEALER)
            raws.append(raw)
            raw.setsockopt(zmq.LINGER, 0)
            if username is not None:
                raw.setsockopt(zmq.PLAIN_USERNAME, username)
                raw.setsockopt(zmq.PLAIN_PASSWORD, password)
            raw.connect(server.data_endpoint)
            return raw

        def nothing_reached_the_server() -> None:
            assert server.stats.seal_refusals == 0 and server.stats.bad_messages == 0
            for reason in ("malformed", "unknown_key", "tampered", "replayed"):
                assert refusals(metrics, reason) == 0, reason
            for raw in raws:
                # no notice: no message of theirs was read
                assert not cast(int, raw.getsockopt(zmq.EVENTS)) & zmq.POLLIN

        try:
            await sealed_round_trip(client, 1)
            assert client._sealer is not None
            key_id = client._sealer.key_id
            user = key_id.hex().encode()
            password = server.keyring._sessions[key_id].password

            # (a) no credentials: the NULL mechanism meets PLAIN, refused at the greeting
            bare = dealer()
            await bare.send_multipart([b"not sealed at all"])
            await bare.send_multipart([key_id + bytes(100)])
            await until(lambda: auth_failures(metrics, "data_handshake") >= 1)
            # wrong credentials: the session's key id with another password, a made-up id
            wrong = bytes.fromhex(password.decode())[::-1].hex().encode()
            for username, pw in ((user, wrong), (b"00" * 8, password), (b"?", b"?")):
                n = auth_failures(metrics, "data_refused")
                raw = dealer(username, pw)
                await raw.send_multipart([key_id + bytes(100)])
                await until(lambda n=n: auth_failures(metrics, "data_refused") > n)

            # a peer speaking ZMTP itself: a greeting, then a multipart message without
            # end; the server closes the connection at the greeting, reads no frame
            n = auth_failures(metrics, "data_handshake")
            host, port = server.data_endpoint.removeprefix("tcp://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            received = b""
            try:
                writer.write(zmtp_greeting(b"NULL"))
                with contextlib.suppress(ConnectionError):
                    for _ in range(1000):
                        if writer.is_closing() or reader.at_eof():
                            break
                        writer.write(b"\x01\x00" * 64)  # empty frames, each with MORE set
                        await writer.drain()
                with contextlib.suppress(ConnectionError):
                    while chunk := await reader.read(65536):
                        received += chunk
            finally:
                writer.close()
            assert len(received) <= 64  # its greeting at most, nothing else
            await until(lambda: auth_failures(metrics, "data_handshake") > n)
            nothing_reached_the_server()
            assert server.stats.auth_failures >= 5

            # (b) the legitimate client goes on, sealed
            await sealed_round_trip(client, 2)
            nothing_reached_the_server()

            # a rekey: a new session on a new connection; the old one is retired
            client._sealer.next = client_module.REKEY_AFTER
            await client.request("ping", tensors=tensors(10, 3))
            await until(lambda: client._sealer is not None and client._sealer.key_id != key_id)
            await sealed_round_trip(client, 4)
            assert key_id not in server.keyring._sessions
            n = auth_failures(metrics, "data_refused")
            dealer(user, password)  # the old credentials, seen on the wire: no longer
            await until(lambda: auth_failures(metrics, "data_refused") > n)
            nothing_reached_the_server()

            # the server forgets every session while the data connection is up: its
            # next sealed request is refused (unknown_key), the client agrees anew
            for k in list(server.keyring._sessions):
                server.keyring.forget(k)
            current = client._sealer.key_id
            rep = await client.request("ping", tensors=tensors(10, 5), attempts=2)
            assert rep.body == {"n": 3}
            await until(lambda: client._sealer is not None and client._sealer.key_id != current)
            await sealed_round_trip(client, 6)

            # ... and while it is down: the connection comes back with credentials the
            # server knows no more, refused at the handshake; the client agrees anew
            current = client._sealer.key_id
            session = server.keyring._sessions[current]
            server.keyring.forget(current)
            client._close_data()
            client._open_data(server.data_endpoint, current.hex().encode(), session.password)
            await until(lambda: client._sealer is not None and client._sealer.key_id != current)
            await sealed_round_trip(client, 7)
            assert client.stats.timeouts == 0 and client.stats.seal_refusals == 0
        finally:
            for raw in raws:
                raw.close(linger=0)
            await client.close(linger_ms=0)
            await server.stop()
            ctx.term()

    run(main)
