"""Seeded random fault schedules against the chief's recovery, on the in-memory
network: PS stopped and continued, killed and restarted empty, the chief killed and
restarted, the run's end and a shutdown, a worker pushing, in any order and at any
moment. Whatever the schedule:

* the chief never ends of an error once started (an event its phase does not take, a
  restore a PS missed: its PS watch died, and the run went on unwatched); a start that
  fails on what a PS answered (one restarted between two of its requests) is started
  again, as the launcher's restart policy does;
* once every PS answers again, the cluster is back within a bound: training, no PS
  down, every variable pulls from wherever its state is served;
* a run never restored holds every acknowledged push exactly once.

``ZMQPS_SCHEDULES=FIRST:COUNT`` runs other seeds; ``ZMQPS_SCHEDULES_TRACE=1`` prints
the chief's error with its traceback.
"""

from __future__ import annotations

import asyncio
import os
import random
import traceback
from typing import Any

import numpy as np
import pytest
from fake_replicated import serve_ps

from zmqps.config import ClusterSpec
from zmqps.core.partition import Partitioner
from zmqps.core.recovery import Event, Phase
from zmqps.core.variables import VariableDef
from zmqps.roles.channels import Delivery
from zmqps.roles.chief import ChiefConfig, ChiefService
from zmqps.roles.client import ParameterClient
from zmqps.roles.homes import Homes
from zmqps.transport import FakeNetwork
from zmqps.transport.dispatch import Dispatcher
from zmqps.wire.errors import ZmqpsError

CHIEF = "127.0.0.1:7000"
PS = ("127.0.0.1:7100", "127.0.0.1:7101", "127.0.0.1:7102")
SGD = {"name": "sgd", "lr": 0.1}
VARS = (
    VariableDef("w", (12, 4), init={"name": "glorot_uniform", "seed": 1}),
    VariableDef("b", (6,), init={"name": "zeros"}),
)
_FIRST, _COUNT = map(int, os.environ.get("ZMQPS_SCHEDULES", "0:16").split(":"))
SEEDS = range(_FIRST, _FIRST + _COUNT)
HEAL_S = 15.0  # once every PS answers, the cluster is back within this (real time)


def config(replication: int) -> ChiefConfig:
    return ChiefConfig(
        bind=f"tcp://{CHIEF}",
        cluster=ClusterSpec(chief=CHIEF, ps=PS, worker=("127.0.0.1:7200",)),
        optimizer=dict(SGD),
        partitioner=Partitioner(num_shards=len(PS)),
        replication=replication,
        heartbeat_interval=0.05,
        heartbeat_timeout=0.3,
        startup_timeout=3.0,  # a restore waits this long for every PS, a start too
    )


class ChiefProcess:
    """A chief as its process runs it: start (adopt, restore or fresh), then watch the
    PS until killed. Its task ends only by an error (or when killed: cancelled)."""

    def __init__(self, net: FakeNetwork, cfg: ChiefConfig, *, first: bool) -> None:
        homes = Homes([net.client(a, "chief:0", timeout=0.5) for a in PS])
        self.chief = ChiefService(cfg, homes.links(), homes=homes)
        net.serve(CHIEF, self.chief, name="chief")
        self.ready = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(first))

    async def _run(self, first: bool) -> None:
        rec = self.chief.recovery
        await self.chief.start()
        if first:
            await self.chief.create_variables(VARS, dict(SGD))
        self.ready.set()
        watchers = [rec.watch_ps()]
        if rec.rereplicator is not None:
            watchers.append(rec.rereplicator.run())
        await asyncio.gather(*watchers)

    def kill(self) -> None:
        self.task.cancel()
        self.chief.recovery.stop_training()


class Worker:
    """One worker pushing ones to every variable, each push sent again (the same
    messages: applied at most once) until every PS acknowledged it."""

    def __init__(self, net: FakeNetwork, cluster: Cluster) -> None:
        self.cluster = cluster
        placement = cluster.proc.chief.placement
        assert placement is not None
        self.homes = Homes([net.client(a, "worker:0:1", timeout=0.5) for a in PS])
        self.homes.update(placement)
        self.client = ParameterClient(
            self.homes.links(), placement, worker="worker:0", incarnation=1, timeout=0.5
        )
        self.pending: Delivery | None = None
        self.acked = 0
        self.stale = False

    def follow(self) -> None:
        """The chief's placement and generation (a real worker hears them in its
        heartbeats' replies)."""
        chief = self.cluster.proc.chief
        if not self.cluster.proc.ready.is_set() or chief.placement is None:
            return
        self.client.moved(self.homes.update(chief.placement))
        if chief.recovery.gen != self.client.gen:
            self.client.restored(chief.recovery.gen)
            self.client.gen = chief.recovery.gen
            self.pending = None  # taken back by the restore: the batch is trained again
            self.stale = True  # its values are of before the restore: pulled again first

    async def push(self) -> bool:
        self.follow()
        if self.pending is None:
            self.pending = Delivery()
        grads = {v.name: np.ones(v.shape, np.float32) for v in VARS}
        try:
            if self.stale:
                await self.client.pull()
                self.stale = False
            await self.client.push(grads, delivery=self.pending)
        except ZmqpsError as exc:
            self.cluster.why = f"push: {exc!r}"
            return False  # sent again later
        self.pending = None
        self.acked += 1
        return True


class Cluster:
    def __init__(self, rng: random.Random, replication: int) -> None:
        self.rng = rng
        self.net = FakeNetwork()
        self.cfg = config(replication)
        for i in range(len(PS)):
            serve_ps(self.net, i, PS[i])
        self.proc = ChiefProcess(self.net, self.cfg, first=True)
        self.stopped: dict[int, Dispatcher] = {}  # SIGSTOP: the process, not answering
        self.log: list[str] = []
        self.why = ""  # why the last push or pull failed

    def stop(self, i: int) -> None:
        if i not in self.stopped:
            self.stopped[i] = self.net._servers.pop(PS[i])
            self.log.append(f"stop {i}")

    def cont(self, i: int) -> None:
        if i in self.stopped:
            self.net._servers[PS[i]] = self.stopped.pop(i)
            self.log.append(f"cont {i}")

    def restart(self, i: int) -> None:
        self.stopped.pop(i, None)
        self.net.remove(PS[i])
        serve_ps(self.net, i, PS[i])  # its launcher started it again: empty
        self.log.append(f"restart {i}")

    def restart_chief(self) -> None:
        self.proc.kill()
        self.net.remove(CHIEF)
        self.proc = ChiefProcess(self.net, self.cfg, first=False)
        self.log.append("chief")

    def heal(self) -> None:
        for i in list(self.stopped):
            self.cont(i)

    def check_alive(self, seed: int) -> None:
        t = self.proc.task
        if t.done() and not self.proc.ready.is_set() and isinstance(t.exception(), ZmqpsError):
            # its start failed on what a PS answered (one restarted between two of the
            # start's requests): the chief exits 1 and its restart policy starts it again
            self.restart_chief()
            self.log.append("(start failed)")
            return
        if t.done():
            exc = t.exception()
            if exc is not None and os.environ.get("ZMQPS_SCHEDULES_TRACE"):
                traceback.print_exception(exc)
            raise AssertionError(f"seed {seed}: the chief ended: {exc!r} after {self.log}")


async def schedule(seed: int) -> None:
    rng = random.Random(seed)
    c = Cluster(rng, 2 if seed % 2 else 1)
    await asyncio.wait_for(c.proc.ready.wait(), 10.0)
    worker = Worker(c.net, c)
    initial = {k: v.copy() for k, v in (await worker.client.pull()).items()}
    try:
        for _ in range(rng.randint(3, 12)):
            i = rng.randrange(len(PS))
            action = rng.choices(
                ["stop", "cont", "restart", "chief", "end", "shutdown", "push", "wait"],
                [4, 3, 3, 2, 1, 1, 6, 3],
            )[0]
            await act(c, worker, action, i)
            await asyncio.sleep(rng.uniform(0.0, 0.4))
            c.check_alive(seed)
        await settle(c, worker, initial, seed)
    finally:
        c.proc.kill()


async def act(c: Cluster, worker: Worker, action: str, i: int) -> None:
    """One fault or worker action of a schedule."""
    rec = c.proc.chief.recovery
    if action == "stop":
        c.stop(i)
    elif action == "cont":
        c.cont(i)
    elif action == "restart":
        c.restart(i)
    elif action == "chief":
        c.restart_chief()
    elif action == "push":
        if await worker.push():
            c.log.append("push")
    elif action == "end" and c.proc.ready.is_set() and rec.lifecycle.can(Event.ALL_DONE):
        rec.handle(Event.ALL_DONE)  # as the chief's end of the run does
        c.log.append("end")
    elif action == "shutdown" and c.proc.ready.is_set() and rec.lifecycle.can(Event.SHUTDOWN):
        rec.handle(Event.SHUTDOWN)
        rec.stop_training()
        c.log.append("shutdown")


async def settle(
    c: Cluster, worker: Worker, initial: dict[str, np.ndarray], seed: int | str
) -> None:
    """Every PS answers again: the cluster is back within ``HEAL_S`` and, never
    restored, holds every acknowledged push exactly once."""
    c.heal()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HEAL_S
    while True:
        c.check_alive(seed)
        assert loop.time() < deadline, (
            f"seed {seed}: not back {HEAL_S:g}s after every PS answers again: phase "
            f"{c.proc.chief.recovery.phase.value}, down {c.proc.chief.recovery.health.down}"
            f" after {c.log}; {c.why}"
        )
        rec = c.proc.chief.recovery
        if c.proc.ready.is_set() and rec.phase is Phase.STOPPING:
            return  # the run stops: nothing to come back to
        back = c.proc.ready.is_set() and not rec.health.down and not rec.recovering
        if back and rec.phase in (Phase.RUNNING, Phase.FINISHING):
            if worker.pending is not None and not await worker.push():
                await asyncio.sleep(0.05)
                continue
            worker.follow()
            try:
                pulled = await worker.client.pull()
            except ZmqpsError as exc:  # a restart not yet heard of: the watch will
                c.why = f"pull: {exc!r}"
                await asyncio.sleep(0.05)
                continue
            assert {k: v.shape for k, v in pulled.items()} == {"w": (12, 4), "b": (6,)}
            if rec.gen == 0:  # never restored: every acknowledged push, once each
                for name, values in pulled.items():
                    want = initial[name] - np.float32(0.1) * worker.acked
                    assert np.allclose(values, want, atol=1e-4), (
                        f"seed {seed}: {name} is not the initial values after"
                        f" {worker.acked} acknowledged pushes, each applied once"
                        f" (off by {np.max(np.abs(values - want)) / 0.1:.2f} pushes)"
                        f" after {c.log}"
                    )
            return
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("seed", SEEDS)
def test_any_fault_schedule_leaves_the_chief_watching_and_the_cluster_back(seed: int) -> None:
    async def bounded() -> Any:
        return await asyncio.wait_for(schedule(seed), 60.0)

    asyncio.run(bounded())


def test_a_backup_dropped_while_stopped_is_not_promoted_by_a_restarted_chief() -> None:
    """A backup stopped past the heartbeat timeout is dropped: its primary goes on
    acknowledging without it. The chief is then restarted, the primary dies, the
    stopped backup comes back, still sure it is one. The new chief must not promote
    it (it misses an acknowledged push): the newest placement the last chief
    published to the live processes leaves it out. (Found by schedule seed 29 under
    load: one acknowledged push lost.)"""

    async def body() -> None:
        c = Cluster(random.Random(0), 2)
        await asyncio.wait_for(c.proc.ready.wait(), 10.0)
        worker = Worker(c.net, c)
        initial = {k: v.copy() for k, v in (await worker.client.pull()).items()}
        try:
            placement = c.proc.chief.placement
            assert placement is not None
            state = 2
            primary = next(s.ps for s in placement.shards if s.state == state)
            (backup,) = next(s.backups for s in placement.shards if s.state == state)
            assert await worker.push()
            c.stop(backup)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10.0
            while True:  # the chief drops it (and fails its own state over)
                p = c.proc.chief.placement
                assert p is not None and loop.time() < deadline, "the backup was not dropped"
                if all(backup not in s.copies for s in p.shards if s.state == state):
                    break
                await asyncio.sleep(0.02)
            while not await worker.push():  # acknowledged without the stopped backup
                assert loop.time() < deadline, c.why
                await asyncio.sleep(0.05)
            c.proc.kill()  # the chief dies, then the primary
            c.net.remove(CHIEF)
            c.log.append("chief killed")
            c.restart(primary)
            c.cont(backup)
            c.proc = ChiefProcess(c.net, c.cfg, first=False)
            c.log.append("chief started")
            await settle(c, worker, initial, "scripted")
        finally:
            c.proc.kill()

    asyncio.run(asyncio.wait_for(body(), 60.0))
