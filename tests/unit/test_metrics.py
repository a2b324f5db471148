"""The metric catalogue and the instrumented roles, on a fresh registry per test.

PS instrumentation is driven through the in-memory FakeNetwork (real codec and the
transport Dispatcher's observer), the chief's gauges through ChiefService directly.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_ps_client import DoublePush  # the protocol tests' retry wrapper

from zmqps.config import ClusterSpec
from zmqps.core.partition import Partitioner, plan
from zmqps.core.variables import VariableDef
from zmqps.metrics import DROP_REASONS, PHASES, STALENESS_BUCKETS, Metrics
from zmqps.roles.chief import ChiefConfig, ChiefService
from zmqps.roles.client import ParameterClient
from zmqps.roles.ps import PSService
from zmqps.roles.sync import SyncConfig
from zmqps.transport.fake import FakeNetwork
from zmqps.wire.errors import FencedError, InvalidArgument

T = TypeVar("T")

#: The metric catalogue: name (as exposed) -> (type, labels).
CATALOGUE: dict[str, tuple[str, tuple[str, ...]]] = {
    "zmqps_requests": ("counter", ("op", "status")),
    "zmqps_request_duration_seconds": ("histogram", ("op",)),
    "zmqps_bytes_sent": ("counter", ()),
    "zmqps_bytes_received": ("counter", ()),
    "zmqps_auth_failures": ("counter", ("reason",)),
    "zmqps_gradient_staleness": ("histogram", ("variable",)),
    "zmqps_gradients_dropped": ("counter", ("reason",)),
    "zmqps_updates_applied": ("counter", ()),
    "zmqps_global_step": ("gauge", ()),
    "zmqps_sync_tokens_available": ("gauge", ()),
    "zmqps_sync_token_wait_seconds": ("histogram", ()),
    "zmqps_workers_alive": ("gauge", ()),
    "zmqps_cluster_examples": ("gauge", ()),
    "zmqps_cluster_loss": ("gauge", ()),
    "zmqps_worker_examples": ("counter", ()),
    "zmqps_worker_step_seconds": ("histogram", ("phase",)),
    "zmqps_train_loss": ("gauge", ()),
    "zmqps_shard_bytes": ("gauge", ()),
    "zmqps_checkpoint_duration_seconds": ("histogram", ()),
    "zmqps_checkpoint_last_step": ("gauge", ()),
    "zmqps_checkpoints": ("counter", ("status",)),
    "zmqps_restores": ("counter", ("reason",)),
    "zmqps_recovery_seconds": ("histogram", ()),
    "zmqps_generation": ("gauge", ()),
    "zmqps_ps_down": ("gauge", ()),
    "zmqps_eval_accuracy": ("gauge", ()),
    "zmqps_eval_loss": ("gauge", ()),
    "zmqps_eval_auc": ("gauge", ()),
    "zmqps_eval_step": ("gauge", ()),
    "zmqps_evaluations": ("counter", ()),
    "zmqps_coordinator_scheduled": ("counter", ()),
    "zmqps_coordinator_functions": ("counter", ("outcome",)),
    "zmqps_coordinator_retries": ("counter", ()),
    "zmqps_coordinator_queue_depth": ("gauge", ()),
    "zmqps_coordinator_inflight": ("gauge", ()),
    "zmqps_coordinator_workers_available": ("gauge", ()),
    "zmqps_coordinator_dispatch_seconds": ("histogram", ()),
    "zmqps_worker_functions": ("counter", ("status",)),
    "zmqps_worker_function_seconds": ("histogram", ()),
    "zmqps_info": ("gauge", ("role", "index", "mode", "version")),
    "zmqps_sparse_rows": ("counter", ("variable", "op")),
    "zmqps_table_rows": ("gauge", ("variable",)),
    "zmqps_table_rows_created": ("counter", ("variable",)),
    "zmqps_table_rows_admitted": ("counter", ("variable",)),
    "zmqps_table_gradients_not_admitted": ("counter", ("variable",)),
    "zmqps_table_rows_evicted": ("counter", ("variable", "reason")),
    "zmqps_state_primary": ("gauge", ("state",)),
    "zmqps_replication_lag_seconds": ("gauge", ("state",)),
    "zmqps_replication_lag_updates": ("gauge", ("state", "backup")),
    "zmqps_replication_factor": ("gauge", ()),
    "zmqps_states_under_replicated": ("gauge", ()),
    "zmqps_failovers": ("counter", ()),
    "zmqps_promotions": ("counter", ()),
    "zmqps_failover_last_seconds": ("gauge", ()),
    "zmqps_state_copies": ("counter", ("outcome",)),
    "zmqps_state_copy_bytes": ("counter", ()),
    "zmqps_state_copy_progress_ratio": ("gauge", ()),
    "zmqps_placement_epoch": ("gauge", ()),
    "zmqps_ps_serving": ("gauge", ()),
    "zmqps_ps_asked": ("gauge", ()),
    "zmqps_ps_move_in_progress": ("gauge", ()),
    "zmqps_ps_move_progress_ratio": ("gauge", ()),
    "zmqps_ps_moves": ("counter", ("outcome",)),
    "zmqps_ps_moved_bytes": ("counter", ()),
    "zmqps_ps_drained": ("gauge", ()),
}

VARS = (
    VariableDef("w", (10, 4), init={"name": "glorot_uniform", "seed": 1}),
    VariableDef("b", (7,), init={"name": "zeros"}),
)


def run(coro: Awaitable[T], timeout: float = 5.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def value(m: Metrics, name: str, **labels: str) -> float:
    v = m.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


# ---------------------------------------------------------------- the catalogue


def test_fresh_registry_per_instance_never_the_default() -> None:
    before = set(REGISTRY._names_to_collectors)
    a, b = Metrics(), Metrics()
    assert a.registry is not b.registry
    assert set(REGISTRY._names_to_collectors) == before
    a.updates_applied.inc()
    assert value(a, "zmqps_updates_applied_total") == 1
    assert value(b, "zmqps_updates_applied_total") == 0


def test_an_injected_registry_is_used() -> None:
    reg = CollectorRegistry()
    m = Metrics(reg)
    assert m.registry is reg
    m.drop("stale")
    assert reg.get_sample_value("zmqps_gradients_dropped_total", {"reason": "stale"}) == 1


def test_catalogue_names_types_labels_and_help() -> None:
    m = Metrics()
    m.set_info("ps", 3, "sync")
    m.request_done("pull", "ok", 0.001)
    m.applied("w", 2)
    m.drop("duplicate")
    m.phase("pull", 0.01)
    m.token_wait.observe(0.1)
    m.checkpoint_duration.observe(0.5)
    m.restores.labels("ps").inc()
    m.function_done("ok", 0.01)
    m.rows("emb", "pull", 3)
    m.watch_tables(lambda: {"emb": {"rows": 2, "created": 3, "evicted": {"budget": 1}}})
    m.watch_states(lambda: {0: {"primary": True, "lag_seconds": 0.5, "lag_entries": {2: 3}}, 1: {}})
    text = generate_latest(m.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, (kind, labels) in CATALOGUE.items():
        assert name in families, name
        fam = families[name]
        assert fam.type == kind, name
        assert fam.documentation, name
        main = [s for s in fam.samples if not s.name.endswith(("_created", "_bucket"))]
        for s in main:
            assert set(s.labels) - {"le"} == set(labels), (name, s)
    assert 'zmqps_info{index="3",mode="sync",role="ps",version="' in text
    # Both statuses exist from the start: the CheckpointsFailing alert's increase()
    # sees the first failure.
    assert 'zmqps_checkpoints_total{status="failed"} 0.0' in text
    assert 'zmqps_checkpoints_total{status="committed"} 0.0' in text
    for name in families:
        assert name.startswith("zmqps"), name


def test_staleness_buckets_are_the_documented_steps() -> None:
    assert STALENESS_BUCKETS == (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
    m = Metrics()
    m.applied("w", 5)
    assert value(m, "zmqps_gradient_staleness_bucket", variable="w", le="4.0") == 0
    assert value(m, "zmqps_gradient_staleness_bucket", variable="w", le="6.0") == 1
    assert value(m, "zmqps_gradient_staleness_bucket", variable="w", le="+Inf") == 1


def test_bounded_label_sets() -> None:
    assert set(DROP_REASONS) == {
        "duplicate",
        "stale",
        "fenced",
        "invalid",
        "rolled_back",
        "nonfinite",
    }
    assert PHASES == ("pull", "h2d", "compute", "d2h", "push")


def test_worker_step_helpers() -> None:
    m = Metrics()
    m.step_done(0.75, 32)
    m.step_done(None, 32)
    m.phase("compute", 0.02)
    assert value(m, "zmqps_worker_examples_total") == 64
    assert value(m, "zmqps_train_loss") == 0.75
    assert value(m, "zmqps_worker_step_seconds_count", phase="compute") == 1


# ---------------------------------------------------------------- an instrumented PS


async def one_ps(m: Metrics) -> tuple[FakeNetwork, PSService, Any]:
    placement = plan(VARS, 1, Partitioner(num_shards=2), optimizer={"name": "sgd", "lr": 0.1})
    net = FakeNetwork()
    svc = PSService(0, metrics=m)
    net.serve("ps0", svc, name="ps0", observer=m)
    defs = [d.to_wire() for _, d in placement.shard_defs()]
    await net.client("ps0", "chief:0").request("create_shards", {"shards": defs})
    return net, svc, placement


def grads() -> dict[str, np.ndarray]:
    return {v.name: np.ones(v.shape, v.dtype) for v in VARS}


def test_ps_requests_bytes_updates_staleness_and_shard_bytes() -> None:
    async def body() -> None:
        m = Metrics()
        net, svc, placement = await one_ps(m)
        client = ParameterClient(
            [net.client("ps0", "w0:0")], placement, worker="w0", incarnation=0, shared_memory=False
        )
        await client.pull()
        await client.push(grads())
        await client.push(grads())
        assert value(m, "zmqps_requests_total", op="create_shards", status="ok") == 1
        assert value(m, "zmqps_requests_total", op="pull", status="ok") == 1
        assert value(m, "zmqps_requests_total", op="push", status="ok") == 2
        assert value(m, "zmqps_request_duration_seconds_count", op="push") == 2
        assert value(m, "zmqps_bytes_received_total") > 2 * sum(
            v.shape[0] * 4 * (v.shape[1] if len(v.shape) > 1 else 1) for v in VARS
        )
        assert value(m, "zmqps_bytes_sent_total") > 0
        shards = len(placement.shards)
        assert value(m, "zmqps_updates_applied_total") == 2 * shards
        # every shard of w: one update at staleness 0, the second at staleness 1
        w_shards = len(placement.shards_of("w"))
        assert value(m, "zmqps_gradient_staleness_count", variable="w") == 2 * w_shards
        assert value(m, "zmqps_gradient_staleness_bucket", variable="w", le="0.0") == w_shards
        assert value(m, "zmqps_shard_bytes") == svc.store.nbytes() > 0
        assert value(m, "zmqps_info", role="ps", index="0", mode="", version=_version()) == 1

    run(body())


def _version() -> str:
    from zmqps import __version__

    return __version__


def test_ps_counts_drops_by_reason() -> None:
    async def body() -> None:
        m = Metrics()
        net, _svc, placement = await one_ps(m)
        retrying = ParameterClient(
            [DoublePush(net.client("ps0", "w0:1"))],
            placement,
            worker="w0",
            incarnation=1,
            shared_memory=False,
        )
        await retrying.pull()
        await retrying.push(grads())
        assert value(m, "zmqps_gradients_dropped_total", reason="duplicate") == 1
        old = ParameterClient(
            [net.client("ps0", "w0:0")], placement, worker="w0", incarnation=0, shared_memory=False
        )
        await old.pull()
        with pytest.raises(FencedError):
            await old.push(grads())
        assert value(m, "zmqps_gradients_dropped_total", reason="fenced") == 1
        assert value(m, "zmqps_requests_total", op="push", status="fenced") == 1
        raw = net.client("ps0", "w1:0")
        with pytest.raises(InvalidArgument):
            await raw.request(
                "push",
                {"worker": "w1", "inc": 0, "seq": 1, "shards": [0, 0], "versions": [0, 0]},
            )
        assert value(m, "zmqps_gradients_dropped_total", reason="invalid") == 1
        assert value(m, "zmqps_requests_total", op="push", status="invalid_argument") == 1

    run(body())


def test_ps_without_metrics_still_serves() -> None:
    async def body() -> None:
        net = FakeNetwork()
        net.serve("ps0", PSService(0), name="ps0")
        rep = await net.client("ps0", "w0:0").request("ping")
        assert rep.body["role"] == "ps"

    run(body())


# ---------------------------------------------------------------- the chief's gauges


def test_chief_gauges_read_its_state() -> None:
    async def body() -> None:
        m = Metrics()
        cluster = ClusterSpec(
            chief="127.0.0.1:7000", ps=("127.0.0.1:7100",), worker=("127.0.0.1:7200",)
        )
        cfg = ChiefConfig(bind="127.0.0.1:7000", cluster=cluster, sync=SyncConfig(mode="sync"))
        chief = ChiefService(cfg, [], clock=lambda: 100.0, metrics=m)
        assert value(m, "zmqps_global_step") == 0
        assert value(m, "zmqps_workers_alive") == 0
        assert value(m, "zmqps_sync_tokens_available") == 0
        chief.members.register(0, 1, 100.0, 10)
        assert value(m, "zmqps_workers_alive") == 1
        # what the workers' heartbeats said: examples of the run, the mean last loss
        assert value(m, "zmqps_cluster_examples") == 0
        assert math.isnan(m.registry.get_sample_value("zmqps_cluster_loss", {}) or 0.0)
        chief.members.heartbeat(0, 1, 5, 100.0, loss=0.5, examples=160)
        assert value(m, "zmqps_cluster_examples") == 160
        assert value(m, "zmqps_cluster_loss") == 0.5
        chief.consistency.tokens.restart(0, extra=1)  # step 0: M = 1 token, 1 init token
        chief.consistency.started = True
        assert value(m, "zmqps_sync_tokens_available") == 2
        assert value(m, "zmqps_info", role="chief", index="0", mode="sync", version=_version()) == 1

    run(body())


# ---------------------------------------------------------------- CLI


def _metrics_of(child: Any) -> tuple[str, int | None]:
    """The metrics host and port a launcher child's task config gives it."""
    from zmqps.roles.configs import loads

    task = loads(Path(child.argv[child.argv.index("--config") + 1]).read_text())
    cfg = getattr(task, task.role)
    return cfg.metrics_host, cfg.metrics_port


def _launcher(tmp_path: Any, *flags: str) -> Any:
    import argparse

    from zmqps.cli.launch import Launcher, add_launch_args

    p = argparse.ArgumentParser()
    add_launch_args(p)
    return Launcher(p.parse_args(["--ps", "2", "--workers", "3", *flags]), tmp_path)


def test_launch_gives_every_task_a_metrics_port(tmp_path: Any) -> None:
    launcher = _launcher(tmp_path)
    assert len(launcher.cluster.ps) == 2 and len(launcher.cluster.worker) == 3
    names = ["chief", "ps0", "ps1", "worker0", "worker1", "worker2"]
    assert list(launcher.metrics_ports) == names
    task_ports = {int(a.rsplit(":", 1)[1]) for a in launcher.cluster.ps + launcher.cluster.worker}
    assert not task_ports & set(launcher.metrics_ports.values())
    urls = launcher.metrics_urls()
    assert len(urls) == 6 and all("http://127.0.0.1:" in u and u.endswith("/metrics") for u in urls)
    for child in launcher.children:
        port = launcher.metrics_ports[child.name]
        assert _metrics_of(child) == ("127.0.0.1", port)


def test_launch_gives_the_evaluator_a_metrics_port(tmp_path: Any) -> None:
    launcher = _launcher(tmp_path, "--evaluator")
    assert list(launcher.metrics_ports)[-1] == "evaluator"
    assert len(set(launcher.metrics_ports.values())) == 7
    task_ports = {int(a.rsplit(":", 1)[1]) for a in launcher.cluster.ps + launcher.cluster.worker}
    assert not task_ports & set(launcher.metrics_ports.values())
    (evaluator,) = [c for c in launcher.children if c.name == "evaluator"]
    port = launcher.metrics_ports["evaluator"]
    assert _metrics_of(evaluator) == ("127.0.0.1", port)
    assert f"evaluator http://127.0.0.1:{port}/metrics" in launcher.metrics_urls()
    groups = {g["labels"]["job"]: g["targets"] for g in launcher.file_sd()}
    assert groups["evaluator"] == [f"127.0.0.1:{port}"]
    assert set(groups) == {"chief", "ps", "worker", "evaluator"}
    assert len(groups["worker"]) == 3


def test_launch_no_metrics(tmp_path: Any) -> None:
    launcher = _launcher(tmp_path, "--no-metrics")
    assert launcher.metrics_urls() == []
    assert len(launcher.cluster.worker) == 3
    assert all(_metrics_of(c)[1] is None for c in launcher.children)


@pytest.mark.parametrize(
    ("given", "port"),
    [
        ([], None),
        (["--metrics-port", "-1"], None),
        (["--metrics-port", "0"], 0),
        (["--metrics-port", "9100"], 9100),
    ],
)
def test_metrics_port_flag(given: list[str], port: int | None) -> None:
    import argparse

    from zmqps.cli.args import add_metrics_args, metrics_port

    p = argparse.ArgumentParser()
    add_metrics_args(p)
    args = p.parse_args(given)
    assert metrics_port(args) == port
    assert args.metrics_host == "127.0.0.1"


def test_replication_metrics_read_the_chief_and_the_copies() -> None:
    """The chief's figures and a PS's states are read at scrape time; outside the chief
    the replication figures are zeros (every process exports the whole catalogue)."""
    plain = Metrics()
    assert value(plain, "zmqps_replication_factor") == 0.0
    chief = Metrics()
    chief.watch_replication(
        lambda: {
            "factor": 2,
            "under_replicated": 1,
            "failovers": 3,
            "promotions": 4,
            "last_failover_seconds": 0.02,
            "copies_made": 5,
            "copies_failed": 1,
            "copied_bytes": 4096,
            "copy_progress": 0.25,
        }
    )
    assert value(chief, "zmqps_replication_factor") == 2
    assert value(chief, "zmqps_states_under_replicated") == 1
    assert value(chief, "zmqps_failovers_total") == 3
    assert value(chief, "zmqps_promotions_total") == 4
    assert value(chief, "zmqps_state_copies_total", outcome="made") == 5
    assert value(chief, "zmqps_state_copies_total", outcome="failed") == 1
    assert value(chief, "zmqps_state_copy_bytes_total") == 4096
    assert value(chief, "zmqps_state_copy_progress_ratio") == 0.25
    assert value(chief, "zmqps_failover_last_seconds") == 0.02
    ps = Metrics()
    ps.watch_states(
        lambda: {
            0: {"primary": True, "lag_seconds": 1.5, "lag_entries": {1: 7, 2: 0}},
            2: {"primary": False},
        }
    )
    assert value(ps, "zmqps_state_primary", state="0") == 1
    assert value(ps, "zmqps_state_primary", state="2") == 0
    assert value(ps, "zmqps_replication_lag_seconds", state="0") == 1.5
    assert ps.registry.get_sample_value("zmqps_replication_lag_seconds", {"state": "2"}) is None
    assert value(ps, "zmqps_replication_lag_updates", state="0", backup="1") == 7


def test_elastic_metrics_read_the_chiefs_mover() -> None:
    """The chief's elastic PS figures are read at scrape time (each scrape reads them
    again); outside the chief they are zeros."""
    plain = Metrics()
    for name in ("zmqps_placement_epoch", "zmqps_ps_serving", "zmqps_ps_move_in_progress"):
        assert value(plain, name) == 0.0
    assert value(plain, "zmqps_ps_moves_total", outcome="done") == 0.0
    figures: dict[str, Any] = {
        "epoch": 7,
        "serving": 1,
        "asked": 2,
        "moving": 1,
        "move_progress": 0.5,
        "moves_done": 3,
        "moves_failed": 1,
        "moved_bytes": 8192,
        "drained": 1,
    }
    chief = Metrics()
    chief.watch_elastic(lambda: figures)
    assert value(chief, "zmqps_placement_epoch") == 7
    assert value(chief, "zmqps_ps_serving") == 1
    assert value(chief, "zmqps_ps_asked") == 2
    assert value(chief, "zmqps_ps_move_in_progress") == 1
    assert value(chief, "zmqps_ps_move_progress_ratio") == 0.5
    assert value(chief, "zmqps_ps_moves_total", outcome="done") == 3
    assert value(chief, "zmqps_ps_moves_total", outcome="failed") == 1
    assert value(chief, "zmqps_ps_moved_bytes_total") == 8192
    assert value(chief, "zmqps_ps_drained") == 1
    figures.update(moving=0, move_progress=0.0, serving=2, epoch=8, moves_done=4)
    assert value(chief, "zmqps_ps_move_in_progress") == 0
    assert value(chief, "zmqps_ps_serving") == 2
    assert value(chief, "zmqps_placement_epoch") == 8
    assert value(chief, "zmqps_ps_moves_total", outcome="done") == 4
