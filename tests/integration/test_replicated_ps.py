"""Replicated PS states over real ZeroMQ sockets on loopback, in one event loop: three
PS servers wired as ``zmqps-server --role ps`` wires them (``ps_slots``), the chief's
``Variables`` creating every copy, workers pushing over TCP and over shared memory
(whose gradients the primaries ship to their backups as tensors).

After every answer, each backup's state is bit-identical to its primary's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
import zmq
import zmq.asyncio

from zmqps.config import ClusterSpec
from zmqps.core.partition import Partitioner
from zmqps.core.variables import VariableDef
from zmqps.roles.chief.variables import Variables
from zmqps.roles.client import ParameterClient
from zmqps.roles.configs import ChiefConfig
from zmqps.roles.ps import PSConfig, PSService, ps_slots
from zmqps.roles.ps.replica import Primary
from zmqps.roles.ps.slots import PSSlots
from zmqps.transport import Client, Server, SocketOptions
from zmqps.transport.shm import sweep

OPTS = SocketOptions(linger_ms=0)
W = VariableDef("w", (300, 40), init={"name": "glorot_uniform", "seed": 1})
B = VariableDef("b", (17,), init={"name": "normal", "seed": 2})
E = VariableDef("e", (64, 8), init={"name": "uniform", "seed": 3}, sparse=True)
ADAM = {"name": "adam", "lr": 0.01}


def run(main: Callable[[], Awaitable[None]], timeout: float = 60.0) -> None:
    asyncio.run(asyncio.wait_for(main(), timeout))


def digest(svc: PSService) -> list[tuple[int, int, bytes, dict[str, bytes]]]:
    return sorted(
        (
            sh.definition.id,
            sh.version,
            sh.values.tobytes(),
            {k: v.tobytes() for k, v in sorted(sh.slots.items())},
        )
        for sh in svc.store
    )


@pytest.mark.parametrize("shared_memory", [False, True])
def test_backups_equal_their_primaries_over_zeromq(shared_memory: bool) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        servers: list[Server] = []
        slots: list[PSSlots] = []
        clients: list[Client] = []
        workers: list[ParameterClient] = []
        try:
            for i in range(3):
                cfg = PSConfig(index=i, bind="127.0.0.1:0")
                s = ps_slots(cfg, ctx, PSService(i), OPTS)
                server = Server(ctx, cfg.bind, s, name=f"ps{i}", options=OPTS)
                servers.append(server)
                slots.append(s)
            endpoints = [srv.bind().removeprefix("tcp://") for srv in servers]
            for srv in servers:
                srv.start()
            spec = ClusterSpec("127.0.0.1:1", tuple(endpoints), ("127.0.0.1:2", "127.0.0.1:3"))
            chief_cfg = ChiefConfig(
                bind="tcp://127.0.0.1:1",
                cluster=spec,
                partitioner=Partitioner(num_shards=4),
                replication=2,
            )
            chief = [Client(ctx, e, "chief:0", options=OPTS) for e in endpoints]
            clients += chief
            placement = await Variables(chief_cfg, chief).create((W, B, E), ADAM)
            assert placement.replication == 2
            for name in ("worker:0", "worker:1"):
                reqs = [Client(ctx, e, f"{name}:0", options=OPTS) for e in endpoints]
                clients += reqs
                workers.append(
                    ParameterClient(
                        reqs, placement, worker=name, incarnation=0, shared_memory=shared_memory
                    )
                )

            def check() -> None:
                for p in range(3):
                    backups = {s.backups[0] for s in placement.shards if s.ps == p}
                    assert len(backups) == 1
                    (q,) = backups
                    assert digest(slots[q]._slots[p]) == digest(slots[p].own), (p, q)

            rng = np.random.default_rng(7)
            for step in range(12):
                w = workers[step % 2]
                await w.pull()
                grads = {v.name: rng.standard_normal(v.shape).astype(np.float32) for v in (W, B)}
                await w.push(grads, pull=step % 3 == 0)
                check()
                ids = rng.integers(0, 64, size=10)
                await w.pull_rows("e", ids)
                await w.push_rows("e", ids, rng.standard_normal((10, 8)).astype(np.float32))
                check()
            # the fast path was taken (or not) as asked; copies never attach regions
            assert all(bool(len(s.own.regions)) == shared_memory for s in slots)
            assert not any(
                len(svc.regions) for s in slots for svc in s.services() if svc is not s.own
            )
            for p in range(3):
                role = slots[p].role(p)
                assert isinstance(role, Primary)
                assert role.log.committed == role.log.head >= 24
                st = slots[p].own.status()["replica"]
                assert st["role"] == "primary" and st["waiting"] == 0
        finally:
            for w in workers:
                await w.close()
            for c in clients:
                await c.close()
            for s in slots:
                await s.close()
            for srv in servers:
                await srv.stop()
            for s in slots:
                for svc in s.services():
                    svc.regions.close()
                    svc.check_threads.close()
            ctx.term()
            sweep()

    run(main)
