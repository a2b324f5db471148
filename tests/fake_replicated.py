"""A replicated cluster on the in-memory network (``FakeNetwork``): PS processes that
hold copies of each other's states, and a chief with ``--replication 2``; shared by
the unit tests of fail-overs and of a restarted chief."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zmqps.config import ClusterSpec
from zmqps.core.partition import Partitioner
from zmqps.metrics import Metrics
from zmqps.roles.chief import ChiefConfig, ChiefService
from zmqps.roles.homes import Homes
from zmqps.roles.ps import PSService
from zmqps.roles.ps.slots import PSSlots
from zmqps.transport import FakeNetwork

__all__ = ["chief_on", "replicated_config", "serve_ps"]


def serve_ps(net: FakeNetwork, i: int, address: str) -> PSSlots:
    """PS process ``i`` at ``address`` (fresh: no copy of any state), shipping to its
    backups over ``net``."""
    slots = PSSlots(
        PSService(i),
        make_copy=PSService,
        link=lambda ps, endpoint, slot: net.client(
            endpoint, f"ps{i}:ship{slot}", slot=slot, timeout=0.5
        ),
    )
    net.serve(address, slots, name=f"ps{i}")
    return slots


def replicated_config(
    chief: str, ps: Sequence[str], optimizer: dict[str, Any], worker: str = "127.0.0.1:7200"
) -> ChiefConfig:
    """A chief's configuration: one state per PS, two copies of each."""
    return ChiefConfig(
        bind=f"tcp://{chief}",
        cluster=ClusterSpec(chief=chief, ps=tuple(ps), worker=(worker,)),
        optimizer=dict(optimizer),
        partitioner=Partitioner(num_shards=len(ps)),
        replication=2,
    )


def chief_on(net: FakeNetwork, cfg: ChiefConfig, metrics: Metrics | None = None) -> ChiefService:
    """A chief serving ``cfg`` on ``net`` (a restarted one knows only what the PS say)."""
    homes = Homes([net.client(a, "chief:0") for a in cfg.cluster.ps])
    chief = ChiefService(cfg, homes.links(), homes=homes, metrics=metrics)
    net.serve(cfg.cluster.chief, chief, name="chief")
    return chief
