"""A pull is a consistent snapshot at one version, even while pushes land during its send.

Over TCP the PS lends the live shard to the transport without copying; an update
arriving while the frames are still in flight must copy first (copy-on-write).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import zmq.asyncio

from zmqps.core.partition import Partitioner, plan
from zmqps.core.store import ShardStore
from zmqps.core.variables import ShardDef, VariableDef
from zmqps.roles.client import ParameterClient
from zmqps.roles.ps import PSService
from zmqps.transport import Client, Server


def test_update_of_a_lent_shard_copies_first() -> None:
    store = ShardStore()
    d = ShardDef(
        0, "w", 0, "float32", (1000, 8), 0, 1000, {"name": "zeros"}, {"name": "sgd", "lr": 1.0}
    )
    store.create([d])
    shard = store.get(0)
    in_flight = shard.lend()[100:200]  # a frame still being sent holds a view
    g = np.ones(8000, np.float32)
    store.apply_dense(0, [(0, g)], 0)
    assert store.copies_on_write == 1
    assert np.all(in_flight == 0.0)  # what was lent did not change
    assert np.all(store.get(0).values == -1.0)
    del in_flight
    store.apply_dense(0, [(0, g)], 1)
    assert store.copies_on_write == 1  # nothing lent any more: updated in place
    assert np.all(store.get(0).values == -2.0)


@pytest.mark.timeout(60)
def test_pulls_stay_consistent_while_pushes_land() -> None:
    async def body() -> None:
        ctx = zmq.asyncio.Context()
        var = VariableDef("w", (8192, 1024), init={"name": "zeros"})  # 32 MiB
        placement = plan([var], 1, Partitioner(num_shards=2), optimizer={"name": "sgd", "lr": 1.0})
        service = PSService(0)
        server = Server(ctx, "127.0.0.1:0", service, name="ps0")
        address = server.bind().removeprefix("tcp://")
        server.start()
        clients = [Client(ctx, address, f"worker:{i}") for i in range(2)]
        defs = [d.to_wire() for _, d in placement.shard_defs()]
        await clients[0].request("create_shards", {"shards": defs})
        reader = ParameterClient(
            [clients[0]], placement, worker="worker:0", incarnation=1, shared_memory=False
        )
        writer = ParameterClient(
            [clients[1]], placement, worker="worker:1", incarnation=1, shared_memory=False
        )
        ones = {"w": np.ones(var.shape, np.float32)}
        checked = 0

        async def pulls() -> None:
            nonlocal checked
            for _ in range(25):
                params = await reader.pull()
                w = params["w"]
                for s in placement.shards:
                    part = w[s.row_start : s.row_start + s.rows]
                    version = reader.versions[s.id]
                    # SGD with lr 1 on gradients of ones: every value is -version
                    assert part.min() == part.max() == -float(version), (s.id, version)
                    checked += 1

        async def pushes() -> None:
            for _ in range(25):
                await writer.push(ones)

        await asyncio.gather(pulls(), pushes())
        assert checked == 50
        assert service.store.updates_applied == 50
        for c in clients:
            await c.close()
        await server.stop()
        ctx.term()
        print("copies on write:", service.store.copies_on_write)

    asyncio.run(body())
