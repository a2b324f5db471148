"""CurveZMQ over real TCP on 127.0.0.1 (RELIABILITY.md scenario 1): the access matrix,
a server that fails closed, key files and their modes, refusals counted.

In-process servers and clients for the matrix; daemons as processes (reaped by
``procs``) for the refusals to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from helpers import Reaper, addresses, zmqps_cmd

from zmqps.metrics import Metrics
from zmqps.transport import Client, CurveKeys, Server, SocketOptions, keygen, load_keys, security
from zmqps.transport.security import DOMAIN, AuthenticatorNotRunning, InsecureKeyFile
from zmqps.transport.server import _is_loopback
from zmqps.wire import Message, reply
from zmqps.wire.errors import ConfigError, DeadlineExceeded, ZmqpsError

pytestmark = pytest.mark.timeout(60)

LOCAL = "127.0.0.1:0"


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())  # type: ignore[arg-type]


def ping(msg: Message) -> Message:
    return reply(msg, {"pong": True})


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CurveKeys]:
    """The cluster's keys, and a stranger's (keys of another cluster)."""
    root = tmp_path_factory.mktemp("keys")
    keygen(root / "cluster")
    keygen(root / "other")
    server = load_keys(root / "cluster", "ps", 0, serve=True, connect=False)
    worker = load_keys(root / "cluster", "worker", 0, serve=False, connect=True)
    stranger = load_keys(root / "other", "worker", 0, serve=False, connect=True)
    return {
        "server": server,
        "allowed": worker,
        # a key pair the allow-list does not hold, aimed at the right server
        "unknown": dataclasses.replace(stranger, server_public=worker.server_public),
        # an allowed client pair, but another cluster's server key
        "wrong_server": dataclasses.replace(worker, server_public=stranger.server_public),
    }


async def _ask(
    ctx: zmq.asyncio.Context, endpoint: str, curve: CurveKeys | None, timeout: float = 1.0
) -> Any:
    client = Client(
        ctx,
        endpoint,
        f"c-{time.monotonic_ns()}",
        options=SocketOptions(linger_ms=0, curve=curve),
        timeout=timeout,
    )
    try:
        return (await client.request("ping")).body
    finally:
        await client.close()


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def _failures(m: Metrics, reason: str) -> float:
    v = m.registry.get_sample_value("zmqps_auth_failures_total", {"reason": reason})
    return 0.0 if v is None else v


@contextlib.asynccontextmanager
async def _curve_server(
    server_keys: CurveKeys, metrics: Metrics
) -> AsyncIterator[tuple[zmq.asyncio.Context, Server, str]]:
    """A started CURVE ping server on 127.0.0.1: (context, server, endpoint)."""
    ctx = zmq.asyncio.Context()
    server = Server(
        ctx,
        LOCAL,
        ping,
        name="ps0",
        options=SocketOptions(linger_ms=0, curve=server_keys),
        observer=metrics,
    )
    try:
        endpoint = server.bind()
        server.start()
        yield ctx, server, endpoint
    finally:
        await server.stop()
        ctx.term()


# --------------------------------------------------------------------------- the matrix


def test_access_matrix_only_the_allowed_client_is_served(keys: dict[str, CurveKeys]) -> None:
    metrics = Metrics()

    async def main() -> None:
        async with _curve_server(keys["server"], metrics) as (ctx, server, endpoint):
            assert await _ask(ctx, endpoint, keys["allowed"]) == {"pong": True}
            for curve in [keys["unknown"], keys["wrong_server"], None]:  # None: plaintext
                # never answered: no reply in time, or (a loaded machine) the request
                # never left, the handshake having failed first
                with pytest.raises(DeadlineExceeded, match=r"no reply within|send queue full"):
                    await _ask(ctx, endpoint, curve)
            # still serving the allowed client after the refusals
            assert await _ask(ctx, endpoint, keys["allowed"]) == {"pong": True}
            assert server.stats.replies == 2

    run(main)


def test_refusals_are_counted_and_logged_with_the_peer(
    keys: dict[str, CurveKeys], caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Metrics()

    async def main() -> None:
        async with _curve_server(keys["server"], metrics) as (ctx, server, endpoint):
            assert _failures(metrics, "refused") == 0 and _failures(metrics, "handshake") == 0
            with pytest.raises(DeadlineExceeded):
                await _ask(ctx, endpoint, keys["unknown"], timeout=0.5)
            await _until(lambda: _failures(metrics, "refused") >= 1)
            with pytest.raises(DeadlineExceeded):
                await _ask(ctx, endpoint, None, timeout=0.5)
            await _until(lambda: _failures(metrics, "handshake") >= 1)
            n = server.stats.auth_failures
            assert n >= 2
            # an allowed client is not counted
            await _ask(ctx, endpoint, keys["allowed"])
            await asyncio.sleep(0.1)
            assert server.stats.auth_failures == n

    with caplog.at_level("WARNING"):
        run(main)
    unknown = keys["unknown"].client_public
    assert unknown is not None
    refused = [r.getMessage() for r in caplog.records if "refused a CURVE client" in r.getMessage()]
    assert refused and "from 127.0.0.1" in refused[0] and unknown.decode() in refused[0]
    assert any("handshake failed" in r.getMessage() for r in caplog.records)


def test_router_fails_closed_domain_and_enforcement_set(keys: dict[str, CurveKeys]) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock = ctx.socket(zmq.ROUTER)
        SocketOptions(curve=keys["server"]).apply_router(sock)
        assert sock.getsockopt(zmq.CURVE_SERVER) == 1
        assert sock.getsockopt(zmq.ZAP_DOMAIN) == DOMAIN.encode()
        assert sock.getsockopt(zmq.ZAP_ENFORCE_DOMAIN) == 1
        sock.close(linger=0)
        plain = ctx.socket(zmq.ROUTER)
        SocketOptions().apply_router(plain)
        assert plain.getsockopt(zmq.CURVE_SERVER) == 0
        plain.close(linger=0)
    finally:
        ctx.term()


def test_server_refuses_to_bind_without_a_running_authenticator(
    keys: dict[str, CurveKeys], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(security, "start_authenticator", lambda ctx, allowed: None)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        server = Server(ctx, LOCAL, ping, options=SocketOptions(linger_ms=0, curve=keys["server"]))
        try:
            with pytest.raises(AuthenticatorNotRunning, match="not running; refusing to start"):
                server.bind()
            assert server.endpoint == ""
        finally:
            await server.stop()
            ctx.term()

    run(main)


def test_two_servers_of_one_context_share_one_authenticator(keys: dict[str, CurveKeys]) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        opts = SocketOptions(linger_ms=0, curve=keys["server"])
        a, b = Server(ctx, LOCAL, ping, options=opts), Server(ctx, LOCAL, ping, options=opts)
        try:
            for s in (a, b):
                s.bind()
                s.start()
            await a.stop()  # b's authenticator must outlive a
            assert await _ask(ctx, b.endpoint, keys["allowed"]) == {"pong": True}
            with pytest.raises(DeadlineExceeded):
                await _ask(ctx, b.endpoint, keys["unknown"], timeout=0.5)
        finally:
            await a.stop()
            await b.stop()
            ctx.term()  # hangs if a ZAP or monitor socket were left open

    run(main)


def test_plaintext_warning_only_off_loopback() -> None:
    assert _is_loopback("tcp://127.0.0.1:5555")
    assert _is_loopback("tcp://[::1]:5555")
    assert _is_loopback("tcp://localhost:5555")
    assert not _is_loopback("tcp://0.0.0.0:5555")
    assert not _is_loopback("tcp://*:5555")
    assert not _is_loopback("tcp://10.1.2.3:5555")
    assert not _is_loopback("tcp://ps-0.example:5555")


# --------------------------------------------------------------------------- key files


def test_keygen_writes_secret_keys_0600_whatever_the_umask(tmp_path: Path) -> None:
    out = subprocess.run(
        zmqps_cmd("keygen", str(tmp_path / "k"), "--workers", "2"),
        capture_output=True,
        text=True,
        umask=0,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    root = tmp_path / "k"
    names = ["server", "chief", "ps", "evaluator", "status", "worker0", "worker1"]
    for name in names:
        assert (root / f"{name}.key_secret").stat().st_mode & 0o777 == 0o600, name
        assert (root / f"{name}.key").stat().st_mode & 0o777 == 0o644, name
    allowed = sorted(p.name for p in (root / "allowed").iterdir())
    assert allowed == sorted(f"{n}.key" for n in names[1:])  # clients only, public only
    assert root.stat().st_mode & 0o777 == 0o700
    # a worker task finds its own pair; others the shared one of their role
    w1 = load_keys(root, "worker", 1, serve=False, connect=True)
    assert w1.client_public == (root / "allowed" / "worker1.key").read_text().split('"')[1].encode()
    assert w1.client_secret is not None and w1.client_secret.decode() not in repr(w1)


def test_keygen_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    root = tmp_path / "k"
    keygen(root)
    before = (root / "server.key_secret").read_bytes()
    out = subprocess.run(zmqps_cmd("keygen", str(root)), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--force" in out.stderr, out.stderr
    assert (root / "server.key_secret").read_bytes() == before
    out = subprocess.run(
        zmqps_cmd("keygen", str(root), "--force"), capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert (root / "server.key_secret").read_bytes() != before
    assert (root / "server.key_secret").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_loading_a_readable_secret_key_is_refused(tmp_path: Path, mode: int) -> None:
    keygen(tmp_path)
    os.chmod(tmp_path / "worker.key_secret", mode)
    with pytest.raises(InsecureKeyFile, match="chmod 600"):
        load_keys(tmp_path, "worker", 0, serve=False, connect=True)
    with pytest.raises(ConfigError, match="not found"):
        load_keys(tmp_path / "missing", "worker", 0, serve=False, connect=True)


# --------------------------------------------------------------------------- daemons


def _ps_argv(keys_dir: Path) -> list[str]:
    chief, ps = addresses(2)
    argv = ["server", "--chief-host", chief, "--ps-hosts", ps, "--role", "ps"]
    return zmqps_cmd(*argv, "--keys", str(keys_dir))


def test_daemon_refuses_to_start_with_a_readable_secret_key(procs: Reaper, tmp_path: Path) -> None:
    keygen(tmp_path / "k")
    os.chmod(tmp_path / "k" / "server.key_secret", 0o644)
    ps = procs.spawn(_ps_argv(tmp_path / "k"), name="ps")
    ps.expect_exit(2, timeout=30)
    lines = ps.stderr.strip().splitlines()
    assert len(lines) == 1, ps.stderr
    assert "server.key_secret is readable by group/others (mode 0644)" in lines[0]


def test_daemon_refuses_to_start_without_the_authenticator(procs: Reaper, tmp_path: Path) -> None:
    keygen(tmp_path / "k")
    hook = (
        "import sys; import zmqps.transport.security as s;"
        " s.start_authenticator = lambda ctx, allowed: None;"
        " from zmqps.cli.main import main; sys.exit(main(sys.argv[1:]))"
    )
    argv = [sys.executable, "-c", hook, *_ps_argv(tmp_path / "k")[3:]]
    ps = procs.spawn(argv, name="ps")
    ps.expect_exit(1, timeout=30)
    errors = [line for line in ps.stderr.splitlines() if "error" in line]
    assert errors == [
        "zmqps: error: CURVE: the ZAP authenticator is not running; refusing to start"
        " (clients would not be authenticated)"
    ], ps.stderr


def test_keys_from_the_environment(procs: Reaper, tmp_path: Path) -> None:
    """ZMQPS_KEYS stands for --keys: a readable secret key there is refused too."""
    keygen(tmp_path / "k")
    os.chmod(tmp_path / "k" / "server.key_secret", 0o640)
    argv = _ps_argv(tmp_path / "k")[:-2]
    ps = procs.spawn(argv, name="ps", env={"ZMQPS_KEYS": str(tmp_path / "k")})
    ps.expect_exit(2, timeout=30)
    assert "readable by group/others" in ps.stderr


def test_a_curve_server_names_each_client_by_its_allow_list_entry(tmp_path: Path) -> None:
    """The authenticated name of the sender (``Message.peer``) is the allow-list's
    name for its key, never something a client sends: the PS binds the replication
    ops to it. A worker's key sending ``replicate``, ``install``, ``join`` or
    ``replica`` (or a ``wait_step`` releasing tokens) is refused, naming the key; a
    PS's and the chief's pass that check."""
    from zmqps.roles.ps import PSService
    from zmqps.roles.ps.slots import PSSlots
    from zmqps.wire.errors import InvalidArgument, NotPrimary

    root = tmp_path / "keys"
    keygen(root)
    server_keys = load_keys(root, "ps", 0, serve=True, connect=False)

    def client_keys(role: str) -> CurveKeys:
        return load_keys(root, role, 0, serve=False, connect=True)

    seen: list[str] = []
    slots = PSSlots(PSService(0), make_copy=lambda slot: PSService(slot), link=None)

    def handler(msg: Message) -> Any:
        seen.append(msg.peer)
        if msg.op == "ping":
            return reply(msg, {"pong": True})
        return slots(msg)

    async def ask(
        ctx: zmq.asyncio.Context, endpoint: str, role: str, op: str, body: dict[str, Any]
    ) -> Any:
        client = Client(
            ctx,
            endpoint,
            f"{role}-{time.monotonic_ns()}",
            options=SocketOptions(linger_ms=0, curve=client_keys(role)),
            timeout=2.0,
            slot=0 if op in ("replicate", "install") else None,
        )
        try:
            return (await client.request(op, body)).body
        finally:
            await client.close()

    replicate = {
        "term": 1,
        "index": 1,
        "op": "sync_config",
        "body": {"mode": "async", "required": 1},
    }
    install = {"term": 1, "index": 1, "part": 0, "last": False, "items": []}

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        server = Server(
            ctx, LOCAL, handler, name="ps0", options=SocketOptions(linger_ms=0, curve=server_keys)
        )
        try:
            endpoint = server.bind()
            server.start()
            for role in ("worker", "ps", "chief", "evaluator"):
                assert await ask(ctx, endpoint, role, "ping", {}) == {"pong": True}
            assert seen == ["worker", "ps", "chief", "evaluator"]
            for role in ("worker", "evaluator", "status", "chief"):
                for op, body in (("replicate", replicate), ("install", install)):
                    with pytest.raises(
                        InvalidArgument, match=f"refused from the key named '{role}'"
                    ):
                        await ask(ctx, endpoint, role, op, body)
            join = {"slot": 0, "term": 1, "ps": 1, "endpoint": "127.0.0.1:1"}
            replica = {"slot": 0, "term": 1, "primary": False, "backups": []}
            newest = {
                "variables": [{"name": "w", "shape": [2], "dtype": "float32"}],
                "shards": [[0, "w", 0, 0, 2, 0]],
                "optimizer": {"name": "sgd", "lr": 0.1},
                "epoch": 3,
            }
            chief_ops = [
                ("join", join),
                ("replica", replica),
                ("shutdown", {"reason": "a worker's key"}),
                ("sync_config", {"mode": "sync", "required": 1}),
                ("create_shards", {"shards": []}),
                # a placement that leaves out a good copy (a restarted chief would not
                # promote it: a restore instead of a fail-over)
                ("placement", {"placement": newest}),
                # a release of tokens (a forged one would hand every worker asking
                # this PS a token of the sender's choosing)
                ("wait_step", {"step": 0, "wait": 0.0, "released": 7, "gen": 0}),
            ]
            for role in ("worker", "ps"):
                for op, body in chief_ops:
                    with pytest.raises(
                        InvalidArgument, match=f"refused from the key named '{role}'"
                    ):
                        await ask(ctx, endpoint, role, op, body)
            # the right keys pass the check (and meet the protocol's own: no backup here)
            with pytest.raises(NotPrimary, match="not a backup"):
                await ask(ctx, endpoint, "ps", "replicate", replicate)
            with pytest.raises(ZmqpsError) as other:
                await ask(ctx, endpoint, "chief", "join", join)
            assert "refused from the key" not in str(other.value), other.value
            assert await ask(ctx, endpoint, "chief", "placement", {"placement": newest}) == {}
            # a wait_step that releases nothing is anyone's; the chief's releases
            assert await ask(ctx, endpoint, "worker", "wait_step", {"step": 0}) == {"step": 0}
            released = {"step": 0, "wait": 0.0, "released": 7, "gen": 0}
            assert (await ask(ctx, endpoint, "chief", "wait_step", released))["granted_of"] == 7
        finally:
            await server.stop()
            ctx.term()

    run(main)


def test_a_ps_without_its_client_pair_refuses_copies_saying_why(tmp_path: Path) -> None:
    """A keys folder without ``ps.key_secret`` (made by an older zmqps): the PS still
    serves (its client pair is loaded only when present), and asked to copy its state
    to another PS it refuses with an error naming the file, never a configuration
    error (which made the chief exit)."""
    from zmqps.roles.configs import PSConfig
    from zmqps.roles.ps import PSService
    from zmqps.roles.ps.serve import ps_slots
    from zmqps.wire.errors import InvalidArgument

    root = tmp_path / "keys"
    keygen(root)
    for f in ("ps.key", "ps.key_secret", "allowed/ps.key"):
        (root / f).unlink()
    keys = load_keys(root, "ps", 0, serve=True, connect=False, connect_if_present=True)
    assert keys.serves and not keys.connects
    with_pair = tmp_path / "new"
    keygen(with_pair)
    assert load_keys(
        with_pair, "ps", 0, serve=True, connect=False, connect_if_present=True
    ).connects

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            cfg = PSConfig(0, "127.0.0.1:0")
            slots = ps_slots(cfg, ctx, PSService(0), SocketOptions(curve=keys))
            assert slots._link is not None
            with pytest.raises(
                InvalidArgument, match=r"no client key pair for a PS \(ps.key_secret\)"
            ):
                slots._link(1, "tcp://127.0.0.1:1", 0)
        finally:
            ctx.term()

    run(main)
