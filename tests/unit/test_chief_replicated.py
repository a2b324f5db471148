"""A chief restarted under ``--replication``: it learns where each PS state is served
from the copies themselves (each process's roles and terms, the epoch it was told) and
adopts the cluster: no restore, the moved states reached at their new homes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import numpy as np

from zmqps.config import ClusterSpec
from zmqps.core.partition import Partitioner
from zmqps.core.variables import VariableDef
from zmqps.roles.chief import ChiefConfig, ChiefService
from zmqps.roles.client import ParameterClient
from zmqps.roles.homes import Homes
from zmqps.roles.ps import PSService
from zmqps.roles.ps.slots import PSSlots
from zmqps.transport import FakeNetwork

T = TypeVar("T")
CHIEF = "127.0.0.1:7000"
PS = ("127.0.0.1:7100", "127.0.0.1:7101", "127.0.0.1:7102")
SGD = {"name": "sgd", "lr": 0.1}
VARS = (VariableDef("w", (12, 4), init={"name": "glorot_uniform", "seed": 1}),)


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 30.0)

    return asyncio.run(bounded())


def serve_ps(net: FakeNetwork, i: int) -> PSSlots:
    slots = PSSlots(
        PSService(i),
        make_copy=PSService,
        link=lambda ps, endpoint, slot: net.client(
            endpoint, f"ps{i}:ship{slot}", slot=slot, timeout=0.5
        ),
    )
    net.serve(PS[i], slots, name=f"ps{i}")
    return slots


def chief_on(net: FakeNetwork, cfg: ChiefConfig) -> ChiefService:
    homes = Homes([net.client(a, "chief:0") for a in PS])
    chief = ChiefService(cfg, homes.links(), homes=homes)
    net.serve(CHIEF, chief, name="chief")
    return chief


def test_a_restarted_chief_adopts_states_moved_by_a_fail_over() -> None:
    async def body() -> None:
        net = FakeNetwork()
        for i in range(3):
            serve_ps(net, i)
        spec = ClusterSpec(chief=CHIEF, ps=PS, worker=("127.0.0.1:7200",))
        cfg = ChiefConfig(
            bind=f"tcp://{CHIEF}",
            cluster=spec,
            optimizer=dict(SGD),
            partitioner=Partitioner(num_shards=3),
            replication=2,
        )
        chief = chief_on(net, cfg)
        await chief.start()
        await chief.create_variables(VARS, dict(SGD))
        # ps 1 dies; a copy of its state takes over; the launcher restarts ps 1, empty
        net.remove(PS[1])
        await chief.recovery.fail_over([1])
        assert chief.recovery.homes is not None
        home = chief.recovery.homes.of[1]
        assert home != 1
        serve_ps(net, 1)
        placement = chief.placement
        assert placement is not None
        # training goes on through the new placement
        wh = Homes([net.client(a, "worker:0:1") for a in PS])
        wh.update(placement)
        w = ParameterClient(wh.links(), placement, worker="worker:0", incarnation=1)
        await w.pull()
        await w.push({"w": np.ones((12, 4), np.float32)})
        pulled = (await w.pull())["w"].copy()
        # the chief dies and is restarted: it knows nothing but what the PS say
        net.remove(CHIEF)
        restarted = chief_on(net, cfg)
        await restarted.start()
        st: dict[str, Any] = restarted.status()
        assert st["gen"] == 0 and not st["recoveries"], st  # adopted: no restore
        after = restarted.placement
        assert after is not None and after.epoch > placement.epoch
        assert {s.state: s.ps for s in after.shards} == {s.state: s.ps for s in placement.shards}
        assert restarted.recovery.terms[1] == 2
        assert restarted.recovery.homes is not None and restarted.recovery.homes.of[1] == home
        # its requests reach state 1 where it is served now
        rep = await restarted.ps[1].request("ps_state")
        assert {sid for sid, _ in rep.body["shards"]} == {
            s.id for s in after.shards if s.state == 1
        }
        assert (await w.pull())["w"].tolist() == pulled.tolist()  # nothing lost

    run(body())
