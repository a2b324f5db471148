"""The /metrics exporter over real HTTP on 127.0.0.1, and a live PS (real ZeroMQ)
whose requests show up there. Every test binds port 0 or a free port, and closes
what it opens.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
import zmq
import zmq.asyncio
from helpers import serving_ps
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from zmqps.cli.launch import free_ports
from zmqps.core.partition import Partitioner, plan
from zmqps.core.variables import VariableDef
from zmqps.metrics import Metrics, MetricsServer, start_metrics_server
from zmqps.roles.client import ParameterClient
from zmqps.roles.ps import PSConfig, PSService, serve_ps
from zmqps.transport import Client, Server, SocketOptions
from zmqps.wire.errors import NotReady

pytestmark = pytest.mark.timeout(30)

OPTS = SocketOptions(linger_ms=0)
VARS = (VariableDef("w", (16, 4), init={"name": "glorot_uniform", "seed": 1}),)


def get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=5.0) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())  # type: ignore[arg-type]


def test_exporter_binds_loopback_port_zero_and_serves_metrics() -> None:
    m = Metrics()
    m.updates_applied.inc(3)
    server = MetricsServer(m, "127.0.0.1", 0)
    try:
        assert server.host == "127.0.0.1" and server.port > 0
        status, ctype, text = get(server.url)
        assert status == 200
        assert ctype.startswith("text/plain")
        assert samples(text)[("zmqps_updates_applied_total", ())] == 3
        assert "# TYPE zmqps_requests_total counter" in text
    finally:
        server.close()
    with pytest.raises(urllib.error.URLError):
        get(server.url)


def test_start_metrics_server_returns_the_bound_address() -> None:
    host, port = start_metrics_server(Metrics(), "127.0.0.1", 0)
    assert host == "127.0.0.1" and port > 0
    status, _, text = get(f"http://{host}:{port}/metrics")
    assert status == 200 and "zmqps_bytes_sent_total" in text


def test_live_ps_requests_show_up_on_metrics() -> None:
    async def main() -> None:
        m = Metrics()
        svc = PSService(0, metrics=m)
        ctx = zmq.asyncio.Context()
        server = Server(ctx, "127.0.0.1:0", svc, name="ps0", options=OPTS, observer=m)
        endpoint = server.bind()
        server.start()
        exporter = MetricsServer(m, "127.0.0.1", 0)
        chief = Client(ctx, endpoint.removeprefix("tcp://"), "chief:0", options=OPTS)
        worker = Client(ctx, endpoint.removeprefix("tcp://"), "w0:0", options=OPTS)
        try:
            placement = plan(
                VARS, 1, Partitioner(num_shards=2), optimizer={"name": "sgd", "lr": 0.1}
            )
            defs = [d.to_wire() for _, d in placement.shard_defs()]
            await chief.request("create_shards", {"shards": defs}, timeout=5.0)
            client = ParameterClient(
                [worker], placement, worker="w0", incarnation=0, shared_memory=False
            )
            await client.pull()
            await client.push({"w": np.ones((16, 4), np.float32)})
            text = await asyncio.to_thread(lambda: get(exporter.url)[2])
        finally:
            exporter.close()
            await chief.close()
            await worker.close()
            await server.stop()
            ctx.term()
        s = samples(text)
        assert s[("zmqps_requests_total", (("op", "pull"), ("status", "ok")))] == 1
        assert s[("zmqps_requests_total", (("op", "push"), ("status", "ok")))] == 1
        assert s[("zmqps_updates_applied_total", ())] == 2
        assert s[("zmqps_gradient_staleness_count", (("variable", "w"),))] == 2
        assert s[("zmqps_bytes_received_total", ())] > 16 * 4 * 4
        assert s[("zmqps_bytes_sent_total", ())] > 16 * 4 * 4
        assert s[("zmqps_shard_bytes", ())] >= 16 * 4 * 4

    run(main)


def test_requests_made_by_a_client_show_up_on_its_metrics() -> None:
    """A worker's /metrics counts the requests it makes (op, outcome, latency, bytes)."""

    async def main() -> None:
        served, made = Metrics(), Metrics()
        ctx = zmq.asyncio.Context()
        server = Server(ctx, "127.0.0.1:0", PSService(0), name="ps0", options=OPTS, observer=served)
        endpoint = server.bind().removeprefix("tcp://")
        server.start()
        client = Client(ctx, endpoint, "w0:0", options=OPTS, observer=made, timeout=5.0)
        try:
            await client.request("ping")
            with pytest.raises(NotReady):  # a PS without shards
                await client.request("pull", {"shards": [7]})
        finally:
            await client.close()
            await server.stop()
            ctx.term()
        s = samples(generate_latest(made.registry).decode())
        assert s[("zmqps_requests_total", (("op", "ping"), ("status", "ok")))] == 1
        assert s[("zmqps_request_duration_seconds_count", (("op", "ping"),))] == 1
        failed = [k for k in s if k[0] == "zmqps_requests_total" and ("op", "pull") in k[1]]
        assert failed and all(dict(k[1])["status"] != "ok" for k in failed), failed
        assert s[("zmqps_bytes_sent_total", ())] > 0
        assert s[("zmqps_bytes_received_total", ())] > 0

    run(main)


def test_serve_ps_with_metrics_port() -> None:
    """The configured path (PSConfig.metrics_port, as --metrics-port sets it)."""

    async def main() -> None:
        ps_port, metrics_port = free_ports(2)
        cfg = PSConfig(index=0, bind=f"127.0.0.1:{ps_port}", metrics_port=metrics_port)
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        async with serving_ps(cfg, OPTS):
            text = await asyncio.to_thread(lambda: get(url)[2])
            assert 'zmqps_requests_total{op="ping",status="ok"}' in text
            assert 'role="ps"' in text
        with pytest.raises(urllib.error.URLError):
            get(url)

    run(main)


def test_serve_ps_metrics_port_in_use_fails_cleanly() -> None:
    """A taken metrics port is an OSError before any ZeroMQ socket exists (ctx.term
    does not hang)."""
    taken = MetricsServer(Metrics(), "127.0.0.1", 0)

    async def main() -> None:
        (ps_port,) = free_ports(1)
        cfg = PSConfig(index=0, bind=f"127.0.0.1:{ps_port}", metrics_port=taken.port)
        ctx = zmq.asyncio.Context()
        try:
            with pytest.raises(OSError):
                await asyncio.wait_for(serve_ps(cfg, ctx, OPTS), 5.0)
        finally:
            ctx.term()

    try:
        run(main)
    finally:
        taken.close()
