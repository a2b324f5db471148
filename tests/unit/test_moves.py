"""Elastic PS (``roles/chief/moves.py``): PS states move between processes while a
worker pushes, on the in-memory network. Nothing acknowledged is lost or applied
twice: the values after the moves are those of every acknowledged push applied once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import pytest
from fake_replicated import chief_on, replicated_config, serve_ps

from zmqps.core.variables import VariableDef
from zmqps.metrics import Metrics
from zmqps.roles.channels import RECOVERABLE, Delivery
from zmqps.roles.chief import ChiefService, moves
from zmqps.roles.client import ParameterClient
from zmqps.roles.homes import Homes
from zmqps.roles.ps.replica import Backup
from zmqps.roles.ps.slots import PSSlots
from zmqps.transport import FakeNetwork
from zmqps.wire import ops as o
from zmqps.wire.errors import InvalidArgument, NotPrimary

T = TypeVar("T")
CHIEF = "127.0.0.1:7000"
PS = ("127.0.0.1:7100", "127.0.0.1:7101", "127.0.0.1:7102")
SGD = {"name": "sgd", "lr": 0.5}
VARS = (VariableDef("w", (12, 4), init={"name": "zeros"}),)


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 60.0)

    return asyncio.run(bounded())


async def cluster(
    net: FakeNetwork, replication: int, metrics: Metrics | None = None, **flags: Any
) -> tuple[ChiefService, list[PSSlots]]:
    slots = [serve_ps(net, i, PS[i]) for i in range(3)]
    cfg = replace(replicated_config(CHIEF, PS, SGD), replication=replication, **flags)
    chief = chief_on(net, cfg, metrics)
    await chief.start()
    await chief.create_variables(VARS, dict(SGD))
    return chief, slots


class Pusher:
    """A worker pushing gradients of 1, 2 or 3 by its step (sums stay exact in float32),
    and counting what was answered."""

    def __init__(self, net: FakeNetwork, chief: ChiefService) -> None:
        placement = chief.placement
        assert placement is not None
        self.homes = Homes([net.client(a, "worker:0:0", timeout=2.0) for a in PS])
        self.homes.update(placement)
        self.client = ParameterClient(
            self.homes.links(), placement, worker="worker:0", incarnation=0, timeout=1.0
        )
        self.chief = chief
        self.acked = 0.0
        self.stop = False

    def follow(self) -> None:
        """What a heartbeat does: a newer placement epoch, the links follow it."""
        placement = self.chief.placement
        if placement is None:
            return  # a restarted chief not started yet
        moved = self.homes.update(placement)
        if moved:
            self.client.moved(moved)

    async def run(self) -> None:
        step = 0
        while not self.stop:
            step += 1
            g = 1 + step % 3
            grad = np.full((12, 4), float(g), np.float32)
            delivery = Delivery()  # sent again, the same messages: applied at most once
            while True:
                try:
                    await self.client.push({"w": grad}, delivery=delivery)
                    break
                except RECOVERABLE:
                    # as a worker's session: sent again once the placement moved (a
                    # request the old home never answered times out)
                    await asyncio.sleep(0.01)
                    self.follow()
            self.acked += g
            await asyncio.sleep(0)

    async def values(self) -> np.ndarray:
        self.follow()
        return (await self.client.pull())["w"].copy()


@pytest.mark.parametrize("replication", [1, 2])
def test_a_state_moves_while_a_worker_pushes_and_nothing_is_lost_or_doubled(
    replication: int,
) -> None:
    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, replication)
        mover = chief.recovery.mover
        assert mover is not None and chief.placement is not None
        before = chief.placement.epoch
        pusher = Pusher(net, chief)
        task = asyncio.ensure_future(pusher.run())
        await asyncio.sleep(0.2)
        target = next(q for q in range(3) if q not in chief.placement.shards_of("w")[1].copies)
        assert await mover.move(1, target)
        await asyncio.sleep(0.2)
        pusher.stop = True
        await task
        after = chief.placement
        assert after.epoch > before
        # served by the target, or (two copies) by the other copy when that one had
        # applied more at the hand-over; the source holds none
        (copies,) = {s.copies for s in after.shards if s.state == 1}
        assert target in copies and 1 not in copies
        assert len(after.shards[1].copies) == replication
        # every acknowledged push applied once: w = -lr * sum of the steps answered
        np.testing.assert_array_equal(
            await pusher.values(), np.full((12, 4), -0.5 * pusher.acked, np.float32)
        )
        # the source holds no copy of state 1 that serves: a stale client is re-routed
        role = slots[1].role(1)
        assert isinstance(role, Backup)
        assert len(slots[1].service(1).store) == 0
        with pytest.raises(NotPrimary):
            await net.client(PS[1], "worker:9:0").request("pull", {"shards": [1]})
        assert mover.status()["moves_done"] == 1
        await pusher.client.close()

    run(body())


def test_scaling_down_drains_and_back_up_spreads_the_states_again() -> None:
    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 1)
        mover = chief.recovery.mover
        assert mover is not None
        pusher = Pusher(net, chief)
        task = asyncio.ensure_future(pusher.run())
        rep = await net.client(CHIEF, "ops:0").request("scale", o.Scale(1).to_wire())
        assert rep.body["asked"] == [0]
        for _ in range(4):
            await mover.step()
        assert set(chief.recovery.homes.of) == {0}
        # the drained processes were told to shut down (they exit 0)
        assert all(slots[q].own.shutdown_requested.is_set() for q in (1, 2))
        assert not slots[0].own.shutdown_requested.is_set()
        assert mover.status()["drained"] == [1, 2]
        # the drained processes exit; one started again (a new boot) joins by itself
        for q in (1, 2):
            net.remove(PS[q])
        slots[2] = serve_ps(net, 2, PS[2])
        for _ in range(4):
            await mover.step()
        assert mover.wanted == [0, 2]
        slots[1] = serve_ps(net, 1, PS[1])
        mover.scale(3)
        for _ in range(4):
            await mover.step()
        assert sorted(chief.recovery.homes.of) == [0, 1, 2]  # one state each
        pusher.stop = True
        await task
        np.testing.assert_array_equal(
            await pusher.values(), np.full((12, 4), -0.5 * pusher.acked, np.float32)
        )
        await pusher.client.close()

    run(body())


def test_the_chiefs_elastic_metrics_follow_the_moves() -> None:
    """Read at scrape time from the mover: the PS serving and asked for, the epoch, a move
    under way and its progress, the moves done and the bytes moved, the PS drained."""

    def metric(m: Metrics, name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, labels)

    async def body() -> None:
        net = FakeNetwork()
        m = Metrics()
        chief, _ = await cluster(net, 1, m)
        mover = chief.recovery.mover
        assert mover is not None and chief.recovery.homes is not None
        assert metric(m, "zmqps_ps_serving") == 3
        assert metric(m, "zmqps_ps_asked") == 3  # as started: those serving
        assert metric(m, "zmqps_ps_move_in_progress") == 0
        epoch = metric(m, "zmqps_placement_epoch")
        assert epoch == chief.recovery.homes.epoch
        seen: list[tuple[float | None, float | None]] = []

        async def scrape() -> None:
            while True:
                seen.append(
                    (
                        metric(m, "zmqps_ps_move_in_progress"),
                        metric(m, "zmqps_ps_move_progress_ratio"),
                    )
                )
                await asyncio.sleep(0.005)

        scraper = asyncio.ensure_future(scrape())
        mover.scale(1)
        assert metric(m, "zmqps_ps_asked") == 1
        for _ in range(4):
            await mover.step()
        scraper.cancel()
        assert (1.0, 1.0) in seen, seen  # a move under way, its copy sent
        assert all(p is not None and 0 <= p <= 1 for _, p in seen)
        assert metric(m, "zmqps_ps_serving") == 1
        assert metric(m, "zmqps_ps_move_in_progress") == 0
        assert metric(m, "zmqps_ps_move_progress_ratio") == 0
        assert metric(m, "zmqps_ps_moves_total", outcome="done") == 2
        assert metric(m, "zmqps_ps_moves_total", outcome="failed") == 0
        assert metric(m, "zmqps_ps_moved_bytes_total") == mover.bytes > 0
        assert metric(m, "zmqps_ps_drained") == 2
        assert metric(m, "zmqps_placement_epoch") == chief.recovery.homes.epoch == epoch + 2  # type: ignore[operator]

    run(body())


def test_a_scale_beyond_the_spec_is_refused() -> None:
    async def body() -> None:
        net = FakeNetwork()
        chief, _ = await cluster(net, 1)
        assert chief.recovery.mover is not None
        with pytest.raises(InvalidArgument, match="names 3"):
            chief.recovery.mover.scale(4)

    run(body())


def test_a_chief_restarted_after_a_scale_down_adopts_the_moved_states() -> None:
    async def body() -> None:
        net = FakeNetwork()
        chief, _ = await cluster(net, 1)
        mover = chief.recovery.mover
        assert mover is not None
        pusher = Pusher(net, chief)
        task = asyncio.ensure_future(pusher.run())
        mover.scale(1)
        for _ in range(4):
            await mover.step()
        assert mover.status()["drained"] == [1, 2]
        for q in (1, 2):  # the drained processes exited
            net.remove(PS[q])
        # the chief dies and is restarted: it learns the homes from the PS that answer
        net.remove(CHIEF)
        restarted = chief_on(net, chief.cfg)
        pusher.chief = restarted
        await asyncio.wait_for(restarted.start(), 30.0)
        st = restarted.status()
        assert st["gen"] == 0 and not st["recoveries"], st  # adopted: no restore
        assert restarted.recovery.homes is not None
        assert restarted.recovery.homes.of == [0, 0, 0]
        assert restarted.placement is not None
        assert restarted.placement.epoch > chief.placement.epoch  # type: ignore[union-attr]
        assert restarted.recovery.mover is not None
        assert restarted.recovery.mover.wanted == [0]
        # training goes on; nothing acknowledged lost
        await asyncio.sleep(0.2)
        pusher.stop = True
        await task
        np.testing.assert_array_equal(
            await pusher.values(), np.full((12, 4), -0.5 * pusher.acked, np.float32)
        )
        # a restore after it puts every state on the process left, not on a drained one
        assert restarted.recovery.restore_homes() == {0: 0, 1: 0, 2: 0}
        await pusher.client.close()

    run(body())


def test_a_ps_serving_more_than_the_limit_makes_the_chief_ask_for_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(moves, "GROW_WAIT_S", 0.0)

    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 1, add_ps_above=150)
        mover = chief.recovery.mover
        assert mover is not None
        one = slots[0].own.store.nbytes()  # a state's bytes (values and slots)
        await mover.step()
        assert mover.wanted is None  # each PS serves one state: under the limit
        mover.scale(1)
        for _ in range(3):
            await mover.step()
        assert chief.recovery.homes.of == [0, 0, 0]
        assert mover.status()["drained"] == [1, 2]
        # ps 0 serves three states, above the limit (a state's bytes x 3 > 150 >= x 2):
        # the chief asks for ps 1, which the launcher starts again, moves a state
        # there, and asks for no more
        assert 2 * one <= 150 < 3 * one, one
        await mover.step()
        assert mover.wanted == [0, 1]
        assert chief.recovery.homes.of == [0, 0, 0]  # not onto the ps 1 told to go
        net.remove(PS[1])
        serve_ps(net, 1, PS[1])
        for _ in range(6):
            await mover.step()
        assert mover.wanted == [0, 1]
        assert sorted(chief.recovery.homes.of) == [0, 0, 1]
        assert [s["ps"] for s in mover.scales] == [1, 2]

    run(body())


def test_a_target_killed_during_the_copy_gives_the_move_up_within_a_heartbeat_timeout() -> None:
    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 1, heartbeat_timeout=1.0)
        mover = chief.recovery.mover
        assert mover is not None and chief.placement is not None
        before = chief.placement.epoch
        mover.rate = 16.0  # 64 bytes at 16 B/s: the copy takes seconds
        moving = asyncio.ensure_future(mover.move(1, 2))
        await asyncio.sleep(0.3)
        assert mover.current is not None and mover.current["phase"] != "starting"
        net.remove(PS[2])  # kill -9 of the target (its own state is the watch's to restore)
        started = asyncio.get_running_loop().time()
        assert not await asyncio.wait_for(moving, 10.0)
        assert asyncio.get_running_loop().time() - started < 5.0  # not the 60 s deadline
        assert mover.status()["moves_failed"] == 1
        assert "silent" in mover.done[-1]["failed"]
        assert chief.placement.epoch == before  # the state never left ps 1
        assert chief.recovery.homes is not None and chief.recovery.homes.of == [0, 1, 2]
        role = slots[1].role(1)
        assert role is not None and not role.backups()  # the joiner was dropped
        # ps 1 still serves its state
        rep = await net.client(PS[1], "worker:9:0").request("ps_state")
        assert rep.body["shards"]

    run(body())


def test_a_hash_table_moved_to_another_process_is_read_whole_where_it_is() -> None:
    """The rows of a hash-keyed table in a moved state: pulled, pushed and listed (an
    export's ``table_rows``) through the state, wherever it is served."""

    async def body() -> None:
        net = FakeNetwork()
        slots = [serve_ps(net, i, PS[i]) for i in range(3)]
        chief = chief_on(net, replace(replicated_config(CHIEF, PS, SGD), replication=1))
        await chief.start()
        table = VariableDef("t", (64, 4), init={"name": "normal", "seed": 4}, table={})
        await chief.create_variables((table,), dict(SGD))
        mover = chief.recovery.mover
        assert mover is not None and chief.placement is not None
        homes = Homes([net.client(a, "worker:0:0", timeout=2.0) for a in PS])
        homes.update(chief.placement)
        client = ParameterClient(homes.links(), chief.placement, worker="worker:0", incarnation=0)
        ids = np.arange(0, 3000, 7, dtype=np.int64)
        before = (await client.pull_rows("t", ids)).copy()
        assert await mover.move(1, 0)
        assert homes.update(chief.placement) == [1]
        client.moved([1])
        np.testing.assert_array_equal(await client.pull_rows("t", ids), before)
        await client.push_rows("t", ids, np.ones((len(ids), 4), np.float32))
        # an export's client, made with the placement as it is now (the chief's at the
        # run's end)
        fresh = ParameterClient(homes.links(), chief.placement, worker="chief", incarnation=0)
        listed, values = await fresh.table_rows("t")
        assert set(listed.tolist()) == set(ids.tolist())
        order = np.searchsorted(listed, ids)
        np.testing.assert_allclose(values[order], before - 0.5, rtol=1e-6)
        assert not len(slots[1].own.store)  # its own state left: nothing served there
        await client.close()

    run(body())


def test_with_two_copies_a_scale_down_promotes_copies_and_moves_the_backups_first() -> None:
    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 2)
        mover, rr = chief.recovery.mover, chief.recovery.rereplicator
        assert mover is not None and rr is not None
        await rr.watch()  # the re-replication knows every process
        pusher = Pusher(net, chief)
        task = asyncio.ensure_future(pusher.run())
        with pytest.raises(InvalidArgument, match="2 copies"):
            mover.scale(1)
        before = chief.placement
        assert before is not None
        # the process that leaves holds its own state's primary and another's backup
        leaving = next(q for s in before.shards for q in s.backups)
        stay = sorted({0, 1, 2} - {leaving})
        mover.ask(stay)
        for _ in range(8):
            await mover.step()
            await rr.watch()
            job = rr.next_copy()
            if job is not None:
                await rr.copy(*job)
        placement = chief.placement
        assert placement is not None
        # every state on ps 0 and 1, two copies each, none on ps 2, which drained
        for s in placement.shards:
            assert set(s.copies) == set(stay), s
        assert slots[leaving].own.shutdown_requested.is_set()
        assert mover.status()["drained"] == [leaving]
        assert chief.recovery.restore_count == 0
        pusher.stop = True
        await task
        np.testing.assert_array_equal(
            await pusher.values(), np.full((12, 4), -0.5 * pusher.acked, np.float32)
        )
        # the copies agree with their primaries
        for st in range(3):
            s = next(x for x in placement.shards if x.state == st)
            primary = slots[s.ps].service(st)
            backup = slots[s.backups[0]].service(st)
            assert [sh.values.tobytes() for sh in primary.store] == [
                sh.values.tobytes() for sh in backup.store
            ]
        await pusher.client.close()
        # the drained process exits; the chief dies and is restarted: it adopts the
        # copies where they are, without waiting for the process that left
        net.remove(PS[leaving])
        net.remove(CHIEF)
        restarted = chief_on(net, chief.cfg)
        await asyncio.wait_for(restarted.start(), 30.0)
        st = restarted.status()
        assert st["gen"] == 0 and not st["recoveries"], st
        after = restarted.placement
        assert after is not None
        assert {x.state: set(x.copies) for x in after.shards} == {
            x.state: set(x.copies) for x in placement.shards
        }

    run(body())
