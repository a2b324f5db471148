"""Elastic PS (``roles/chief/moves.py``): PS states move between processes while a
worker pushes, on the in-memory network. Nothing acknowledged is lost or applied
twice: the values after the moves are those of every acknowledged push applied once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from fake_replicated import chief_on, replicated_config, serve_ps

from zmqps.core.recovery import decide_start
from zmqps.core.variables import VariableDef
from zmqps.metrics import Metrics
from zmqps.roles.channels import RECOVERABLE, Delivery
from zmqps.roles.chief import ChiefService, moves
from zmqps.roles.chief.finish import summarize
from zmqps.roles.chief.recovery import RecoveryController
from zmqps.roles.chief.rereplication import Rereplicator
from zmqps.roles.client import ParameterClient
from zmqps.roles.configs import CheckpointPolicy
from zmqps.roles.homes import Homes
from zmqps.roles.ps import PSService
from zmqps.roles.ps.replica import Backup, Primary
from zmqps.roles.ps.slots import PSSlots
from zmqps.transport import FakeNetwork
from zmqps.wire import ops as o
from zmqps.wire.errors import DeadlineExceeded, InvalidArgument, NotPrimary, RolledBack

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


async def answer_of(process: PSSlots, msg: Any) -> Any:
    """What ``process`` answers ``msg`` (for a handler put in front of it)."""
    answer = process(msg)
    if asyncio.iscoroutine(answer) or isinstance(answer, asyncio.Future):
        answer = await answer
    return answer


async def ps1_and_a_target(net: FakeNetwork) -> tuple[ChiefService, list[PSSlots], int, int]:
    """A cluster without replication and a heartbeat timeout of 1 s; the process
    serving ps 1's state, and one holding none of it (a move's target)."""
    chief, slots = await cluster(net, 1, heartbeat_timeout=1.0)
    assert chief.placement is not None
    source = chief.placement.shards[1].ps
    target = next(q for q in range(3) if q not in chief.placement.shards_of("w")[1].copies)
    return chief, slots, source, target


def copiers(rec: RecoveryController) -> tuple[moves.Mover, Rereplicator]:
    """The chief's mover and re-replication (a chief with PS homes has both)."""
    assert rec.mover is not None and rec.rereplicator is not None
    return rec.mover, rec.rereplicator


async def settle(mover: moves.Mover, rr: Rereplicator, looks: int = 8) -> None:
    """``looks`` looks of the mover, each followed by one of the re-replication (a copy
    made where one is short), as the chief's two loops take turns."""
    for _ in range(looks):
        await mover.step()
        await rr.watch()
        job = rr.next_copy()
        if job is not None:
            await rr.copy(*job)


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
        # the target holds a copy; with replication, the furthest copy serves (the
        # backup, when an entry reached it and not the target before the fence)
        copies = set(after.shards[1].copies)
        assert target in copies and 1 not in copies and len(copies) == replication
        home = mover.done[-1].get("home", target)
        assert {s.ps for s in after.shards if s.state == 1} == {home}
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


def test_a_ps_restarted_while_it_leaves_leaves_and_one_started_after_its_drain_joins() -> None:
    """A PS asked to leave that crashes and is restarted before it was drained (a
    supervisor's restart) does not undo the scale-down: it is drained too. Once drained
    (it exited 0), a start of it is deliberate: it joins."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 1)
        mover = chief.recovery.mover
        assert mover is not None
        await mover.step()  # the boot ids heard
        mover.ask([0, 1])
        assert await mover.step() is not None  # ps 2's state moved off it
        assert 2 not in chief.recovery.homes.of
        assert not slots[2].own.shutdown_requested.is_set()
        # killed and restarted before it was told to shut down
        net.remove(PS[2])
        slots[2] = serve_ps(net, 2, PS[2])
        for _ in range(3):
            await mover.step()
        assert mover.wanted == [0, 1]
        assert slots[2].own.shutdown_requested.is_set()  # drained, this incarnation too
        assert mover.status()["drained"] == [2]
        assert 2 not in chief.recovery.homes.of
        # it exits 0; started again by hand afterwards: it joins and gets a state
        net.remove(PS[2])
        slots[2] = serve_ps(net, 2, PS[2])
        for _ in range(3):
            await mover.step()
        assert mover.wanted == [0, 1, 2]
        assert sorted(chief.recovery.homes.of) == [0, 1, 2]
        assert mover.status()["drained"] == []

    run(body())


def test_a_probe_across_new_placement_epochs_that_left_its_state_in_place_is_heard() -> None:
    """Moves and copies back to back (a scale just after a chief restart) change the
    placement epoch every probe interval. A probe answered by the process that still
    serves its state is heard whatever the epoch did meanwhile; only one routed to a
    process the state has since left is set aside (fault schedule 712: every probe of
    a state that never moved was set aside for 2.5 s, and its process failed over)."""

    async def body() -> None:
        net = FakeNetwork()
        chief, _ = await cluster(net, 2)
        rec = chief.recovery
        assert rec.homes is not None and chief.placement is not None
        loop = asyncio.get_running_loop()
        rep = await rec.ps[0].request("ps_state", timeout=1.0)
        st = o.PsStateReply.parse(rep.body)

        def answered(home: int) -> dict[int, asyncio.Future[Any]]:
            done: asyncio.Future[Any] = loop.create_future()
            done.set_result((rec.gen, home, st))
            return {0: done}

        # a new epoch (a copy added elsewhere), state 0 still on process 0
        rec.homes.update(replace(chief.placement, epoch=chief.placement.epoch + 3))
        later = rec.clock() + 10 * rec.cfg.heartbeat_timeout
        rec.clock = lambda: later  # type: ignore[method-assign]
        failing: list[int] = []
        assert rec._hear(answered(0), failing) == []  # type: ignore[arg-type]
        assert 0 not in failing  # (the states not probed here are silent, long since)
        # one routed to a process state 0 has left, long after: not an answer (silent)
        rec.clock = lambda: later + 10 * rec.cfg.heartbeat_timeout  # type: ignore[method-assign]
        failing.clear()
        assert rec._hear(answered(1), failing) == []  # type: ignore[arg-type]
        assert 0 in failing

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


def test_the_same_scale_asked_again_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """500 ``scale`` requests of a hostile client were 500 log lines of the chief."""

    async def body() -> None:
        net = FakeNetwork()
        chief, _ = await cluster(net, 1)
        mover = chief.recovery.mover
        assert mover is not None
        with caplog.at_level(logging.WARNING, logger="zmqps"):
            for _ in range(50):
                assert mover.scale(2) == [0, 1]
            mover.scale(3)
        lines = [r.getMessage() for r in caplog.records if "scaling to" in r.getMessage()]
        assert lines == [
            "scaling to 2 PS: ps 0, 1 serve the states",
            "scaling to 3 PS: ps 0, 1, 2 serve the states",
        ]

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


def test_a_copy_left_by_a_move_given_up_is_not_taken_for_a_later_moves_copy() -> None:
    """A move copies state 1 onto ps 0 and is given up (its source killed: fault
    schedule seed 15); ps 1 comes back empty and every state is restored, in a new
    generation, at the same term. The next move of state 1 to ps 0 sends a copy as of
    the same (term, entry) as the one left there: it is installed, not answered as the
    old copy's last part sent again (ps 0 served the state from before the restore, of
    the old generation, and the chief took that for a restart and restored again)."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 1)
        rec = chief.recovery
        mover, rr = copiers(rec)
        pusher = Pusher(net, chief)
        task = asyncio.ensure_future(pusher.run())
        await asyncio.sleep(0.2)
        pusher.stop = True
        await task
        assert pusher.acked > 0
        async with rec.placement_lock:
            await mover._primary_here(1, 1)
        # one push logged: the copy is as of entry 1, as the restored state's will be
        await pusher.client.push({"w": np.ones((12, 4), np.float32)})
        why, _ = await rr.join(1, 0, mover.rate, {}, lambda: True, lambda q: True, 0.01)
        assert why == ""
        await rr.drop_joiner(1)  # given up: the copy stays on ps 0
        assert len(slots[0].service(1).store)
        # ps 1 restarted empty: every state restored (no checkpoint: initial values)
        net.remove(PS[1])
        slots[1] = serve_ps(net, 1, PS[1])
        async with rec.placement_lock:
            await rec.restore_lost([1], rec.clock(), "ps 1 restarted")
        assert rec.gen == 1
        assert await mover.move(1, 0)
        moved = slots[0].service(1)
        assert moved.gen == rec.gen
        values = [sh.values for sh in moved.store]
        assert values and all(not np.any(v) for v in values)
        await pusher.client.close()

    run(body())


def _slow_move(mover: object, state: int, target: int) -> asyncio.Future[bool]:
    """A move whose copy takes ~20 s (10 bytes a second)."""
    mover.rate = 10.0  # type: ignore[attr-defined]
    return asyncio.ensure_future(mover.move(state, target))  # type: ignore[attr-defined]


def test_a_move_whose_destination_restarted_is_given_up_at_once() -> None:
    """The destination is killed mid-copy and restarted (fault schedule seeds 19, 20):
    the new process holds no copy and refuses every part. The move is given up within
    a few heartbeats, not at its deadline a minute later (no other move, and no drain,
    can begin meanwhile), and the next one makes a fresh copy."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 1)
        mover = chief.recovery.mover
        assert mover is not None
        await mover.step()  # the boot ids heard
        move = _slow_move(mover, 1, 2)
        await asyncio.sleep(0.3)
        assert mover.current is not None and not move.done()
        net.remove(PS[2])
        slots[2] = serve_ps(net, 2, PS[2])
        assert not await asyncio.wait_for(move, 5.0)
        assert "restarted" in mover.done[-1]["failed"]
        mover.rate = 1 << 20
        assert await mover.move(1, 2)

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


def test_a_move_under_way_at_a_restore_is_given_up() -> None:
    """Every state is restored (another PS restarted empty) while a state is copied:
    the copy is of the generation before, and the move is given up at once."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 1)
        rec = chief.recovery
        mover = rec.mover
        assert mover is not None
        await mover.step()
        move = _slow_move(mover, 1, 0)
        await asyncio.sleep(0.3)
        net.remove(PS[2])
        slots[2] = serve_ps(net, 2, PS[2])
        async with rec.placement_lock:
            await rec.restore_lost([2], rec.clock(), "ps 2 restarted")
        assert rec.gen == 1
        assert not await asyncio.wait_for(move, 5.0)
        assert "restore" in mover.done[-1]["failed"]

    run(body())


def test_with_two_copies_a_scale_down_promotes_copies_and_moves_the_backups_first() -> None:
    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 2)
        mover, rr = copiers(chief.recovery)
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
            # never fewer than two copies of a state: a promotion that drops the
            # source's copy makes one more first (fault schedule 809: a kill in that
            # window lost the state's only copy)
            now = chief.placement
            assert now is not None
            assert all(len(x.copies) >= 2 for x in now.shards), now.shards
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
        # its summary says where the states are, though it moved none itself
        summary = await summarize(restarted)
        assert set(summary["elastic"]["serving"]) <= set(stay), summary

    run(body())


def test_a_move_that_only_swaps_primaries_between_processes_with_every_copy_is_not_made() -> None:
    """Replicated, scaled to 2 PS: each state has a copy on both. A plan balancing the
    loads moved a state's primary onto its backup on the other process, which drops
    the source's copy: one copy left until the re-replication made another, and a kill
    then (the chief, then that process: fault schedule 809, draw g10) lost it. The
    move is not made: the state keeps both copies."""

    async def body() -> None:
        net = FakeNetwork()
        chief, _ = await cluster(net, 2)
        mover, rr = copiers(chief.recovery)
        await rr.watch()
        before = chief.placement
        assert before is not None
        stay = sorted({0, 1, 2} - {next(q for s in before.shards for q in s.backups)})
        mover.ask(stay)
        await settle(mover, rr)
        settled = chief.placement
        assert settled is not None and mover.next_move() is None
        assert all(set(s.copies) == set(stay) for s in settled.shards)
        # two states' primaries on one process, much larger than the third: balanced by
        # bytes, one of them would go to the other process, where its backup is
        homes = mover.homes.of
        crowded = next(q for q in stay if homes.count(q) == 2)
        mover.measured = {st: 1000 if homes[st] == crowded else 1 for st in range(3)}
        assert mover.next_move() is None and mover.planned == 0
        await mover.step()
        after = chief.placement
        assert after is not None and after.epoch == settled.epoch
        assert all(len(s.copies) == 2 for s in after.shards)

    run(body())


def test_a_chief_restarted_after_states_swapped_processes_says_where_they_are() -> None:
    """Scaled down and back up, every process serves a state again, but not its own:
    a chief restarted then (fault schedule 729, draw g11) wrote a summary saying
    nothing of the moves, as if the states were where the spec put them."""

    async def body() -> None:
        net = FakeNetwork()
        chief, _ = await cluster(net, 2)
        mover = chief.recovery.mover
        assert mover is not None
        assert await mover.move(0, 1) and await mover.move(1, 0)
        assert mover.homes.of == [1, 0, 2] and mover.serving() == [0, 1, 2]
        net.remove(CHIEF)
        restarted = chief_on(net, chief.cfg)
        await asyncio.wait_for(restarted.start(), 30.0)
        summary = await summarize(restarted)
        assert summary["elastic"]["serving"] == [0, 1, 2], summary
        assert summary["elastic"]["moves"] == 0  # its own: none

    run(body())


def test_a_run_that_ends_before_its_last_scale_is_done_says_so() -> None:
    """Moves stop when training ends. A run whose last scale was not done (its move's
    destination killed two seconds before the end: fault schedule 845, draw g13) wrote
    a summary with where the states are, but not what was asked: nothing said the
    scale was left undone."""

    async def body() -> None:
        net = FakeNetwork()
        chief, _ = await cluster(net, 2)
        mover = chief.recovery.mover
        assert mover is not None
        mover.ask([0, 1])
        summary = await summarize(chief)
        el = summary["elastic"]
        assert el["serving"] == [0, 1, 2] and el["asked"] == [0, 1], el
        assert el["unmet"] == (
            "ps 2's state on ps 2, not on the PS asked for (ps 0, 1): moves stop when training ends"
        )
        assert await mover.move(2, 0)
        el = (await summarize(chief))["elastic"]
        assert el["asked"] == [0, 1] and "unmet" not in el, el

    run(body())


def test_a_promotion_whose_copy_first_fails_goes_on_without_it() -> None:
    """A chief killed during a hand-over leaves the source stepped down while the
    placement still names it primary: the copy made before a promotion is refused
    (``not_primary``), and only the hand-over makes a primary again. The move goes on
    without the copy (before, it tried the copy every look, and the state had no
    primary for 34 s: fault schedule 702)."""

    async def body() -> None:
        net = FakeNetwork()
        chief, _ = await cluster(net, 2)
        mover, rr = copiers(chief.recovery)
        assert chief.placement is not None
        await rr.watch()
        s = next(x for x in chief.placement.shards if x.state == 2)
        # the source steps down, as a hand-over's first steps make it
        term = chief.recovery.terms.get(2, 1) + 1
        fence = o.ReplicaSet(2, term, primary=False, epoch=chief.placement.epoch + 1)
        await net.client(PS[s.ps], "chief:9").request("replica", fence.to_wire())
        mover.ask([q for q in range(3) if q != s.ps])
        for _ in range(3):
            await mover.step()
        assert chief.recovery.homes is not None
        assert chief.recovery.homes.of[2] != s.ps
        pusher = Pusher(net, chief)
        await pusher.client.push({"w": np.ones((12, 4), np.float32)})  # served again
        await pusher.client.close()

    run(body())


@pytest.mark.parametrize("lost", ["boot", "promotion"])
def test_a_hand_over_whose_new_primary_dies_at_once_is_recorded(lost: str) -> None:
    """The new primary is promoted, then killed before it says its boot id (fault
    schedule 704: the move's destination killed as the move ended), or killed as it is
    promoted, the promotion never answered (schedule 831). The placement names it all
    the same, so the fail-over that follows starts from where the state is; before,
    the chief kept the old placement, its next move (704), or telling the stepped-down
    source its backups (831), made that source a primary again at the same term: sync
    waited on its old step for ever, or it counted its entries from 0 and a backup
    took them for ones it had (acknowledged pushes lost)."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 2)
        mover = chief.recovery.mover
        assert mover is not None and chief.placement is not None
        await mover.step()  # the boot ids heard
        s = next(x for x in chief.placement.shards if x.state == 1)
        target = s.backups[0]
        link = mover.homes.processes[target]
        asked = link.request
        rec = chief.recovery
        now = [rec.clock()]
        mover.clock = rec.clock = lambda: now[0]  # type: ignore[method-assign]

        async def dies_after_the_promotion(op: str, *args: Any, **kw: Any) -> Any:
            if op == "ps_state" and kw.get("slot") == 1:
                now[0] += rec.cfg.heartbeat_timeout + 0.5  # waited for, in vain
                raise DeadlineExceeded("no reply (killed)")
            if lost == "promotion" and op == "replica" and args and args[0].get("primary"):
                await asked(op, *args, **kw)  # promoted, and killed before it answered
                raise DeadlineExceeded("no reply (killed)")
            return await asked(op, *args, **kw)

        link.request = dies_after_the_promotion  # type: ignore[method-assign]
        assert await mover.move(1, target)
        assert chief.placement.epoch > 0
        moved = next(x for x in chief.placement.shards if x.state == 1)
        assert moved.ps == target
        assert chief.recovery.homes is not None and chief.recovery.homes.of[1] == target
        # the source's copy, whole, is kept and named: the fail-over may promote it
        # (fault schedule 823: dropped, the state had no copy left)
        assert s.ps in moved.backups
        assert slots[s.ps].role(1) is not None
        # a word meant for a primary never promotes the stepped-down source
        rr = chief.recovery.rereplicator
        assert rr is not None
        links = ((target, PS[target]),)
        word = o.ReplicaSet(1, chief.recovery.terms[1], True, links).to_wire()
        with pytest.raises(InvalidArgument, match="a promotion names how far"):
            await net.client(PS[s.ps], "chief:9").request("replica", word)
        assert isinstance(slots[s.ps].role(1), Backup)
        # silent since it was asked, a heartbeat timeout ago: the watch's next look
        # finds it down (and fails it over), not a heartbeat timeout later
        assert rec.health.silent(1, now[0])

    run(body())


def test_one_copy_at_a_time_a_move_and_the_re_replication_wait_for_each_other() -> None:
    """A state one copy short (a fail-over) while the chief moves states (a scale
    down): the re-replication's copy waits until the move's copies are done, and a
    move waits for a copy under way. Before, both joined copies at once (fault
    schedule 716): the one given up dropped the other's joiner, its primary
    committed without it, and the move then promoted a copy a sync step behind."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 2)
        rec = chief.recovery
        mover, rr = copiers(rec)
        assert chief.placement is not None
        await rr.watch()
        pusher = Pusher(net, chief)
        task = asyncio.ensure_future(pusher.run())
        # ps 2 leaves: its state's backup is promoted, one more copy made first
        mover.ask([0, 1])
        s2 = next(x for x in chief.placement.shards if x.state == 2)
        # state 0 one copy short, as a fail-over leaves it
        placement = chief.placement
        shards = tuple(replace(x, backups=()) if x.state == 0 else x for x in placement.shards)
        short = replace(placement, shards=shards, epoch=placement.epoch + 1)
        rec.variables.use(short)
        mover.homes.update(short)
        await rr.drop_joiner(0)
        assert rr.next_copy() is not None
        mover.rate = rr.rate = 400.0  # each copy takes about a second
        stepping = asyncio.ensure_future(mover.step())
        while rec.moving is None:
            await asyncio.sleep(0.01)
        made = rr.copies
        assert await rr.copy_next() is None  # the next look
        assert rr.copies == made and rr.current is not None
        assert rr.current["state"] == 2  # the move's own copy, the one under way
        assert (await stepping) is not None
        assert mover.homes.of[2] != 2 and s2.ps == 2
        # now the re-replication's copy; a move meanwhile waits for the next look
        copying = asyncio.ensure_future(rr.copy_next())
        while rr.current is None:
            await asyncio.sleep(0.01)
        epoch = chief.placement.epoch
        assert await mover.step() is None
        assert chief.placement.epoch == epoch
        assert await copying
        for _ in range(6):
            await mover.step()
            await rr.watch()
            await rr.copy_next()
        pusher.stop = True
        await task
        np.testing.assert_array_equal(
            await pusher.values(), np.full((12, 4), -0.5 * pusher.acked, np.float32)
        )
        final = chief.placement
        assert final is not None
        assert all(len(x.copies) == 2 and 2 not in x.copies for x in final.shards)
        for st in range(3):
            x = next(x for x in final.shards if x.state == st)
            values = [[sh.values.tobytes() for sh in slots[q].service(st).store] for q in x.copies]
            assert values[0] == values[1], st
        await pusher.client.close()

    run(body())


def test_a_move_whose_copy_stopped_counting_in_commits_is_not_handed_over() -> None:
    """The target's copy got in sync, then its primary stopped shipping to it (its
    joiner dropped: fault schedule 716, by a copy given up) and committed a push
    without it. The hand-over refuses to promote that copy: it lacks the push."""

    async def body() -> None:
        net = FakeNetwork()
        chief, _ = await cluster(net, 1)
        rec = chief.recovery
        mover, rr = copiers(rec)
        pusher = Pusher(net, chief)
        join = rr.join

        async def then_dropped(state: int, target: int, *args: Any) -> tuple[str, Any]:
            why, info = await join(state, target, *args)
            await rr.drop_joiner(state)
            await pusher.client.push({"w": np.ones((12, 4), np.float32)})
            pusher.acked += 1
            return why, info

        rr.join = then_dropped  # type: ignore[method-assign]
        assert not await mover.move(1, 2)
        assert "fell out of sync" in mover.done[-1]["failed"]
        assert rec.homes is not None and rec.homes.of == [0, 1, 2]
        np.testing.assert_array_equal(
            await pusher.values(), np.full((12, 4), -0.5 * pusher.acked, np.float32)
        )
        rr.join = join  # type: ignore[method-assign]
        assert await mover.move(1, 2)  # a fresh copy
        np.testing.assert_array_equal(
            await pusher.values(), np.full((12, 4), -0.5 * pusher.acked, np.float32)
        )
        await pusher.client.close()

    run(body())


def test_a_move_onto_a_process_restarted_since_its_copy_was_made_is_given_up() -> None:
    """Fault schedule 831, replayed on its fix: ps 1's state was moved off ps 1, a copy
    of it made on ps 1 again, and ps 1 killed and restarted; its primary, shipping
    nothing meanwhile, still counted that copy in sync. A move back onto ps 1 fenced
    the restarted process's own (empty) state, which took the fence as an empty backup
    and was promoted: the state's shards were lost, and workers waited on it for ever.
    Now the fence is refused (the process holds no copy) and the move given up."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 2)
        rec = chief.recovery
        mover, rr = copiers(rec)
        assert chief.placement is not None and rec.homes is not None
        b = next(s for s in chief.placement.shards if s.state == 1).backups[0]
        pusher = Pusher(net, chief)
        await pusher.client.push({"w": np.ones((12, 4), np.float32)})
        pusher.acked += 1
        assert await mover.move(1, b)  # served by its backup; ps 1's copy emptied
        await rr.watch()  # the re-replication knows every process
        assert await rr.copy(1, 1)  # a copy on ps 1 again, in sync
        before = await pusher.values()
        net.remove(PS[1])  # killed and restarted, empty
        slots[1] = serve_ps(net, 1, PS[1])
        assert not await mover.move(1, 1)
        assert "the target did not take the hand-over" in mover.done[-1]["failed"]
        assert rec.homes.of[1] == b and not isinstance(slots[1].role(1), Primary)
        np.testing.assert_array_equal(await pusher.values(), before)
        np.testing.assert_array_equal(before, np.full((12, 4), -0.5, np.float32))
        await pusher.client.close()

    run(body())


def test_a_move_planned_before_its_source_failed_over_is_given_up() -> None:
    """The source of a move is killed, restarted empty and failed over while the move
    waits for the placement's lock (fault schedule 716, replayed on the fix above).
    The move is given up; before, it made the empty process the state's primary (a
    state with no backup left looked unreplicated), and every later copy onto it was
    refused ("it cannot become its backup")."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 2)
        rec = chief.recovery
        mover = rec.mover
        assert mover is not None and chief.placement is not None
        s1 = next(x for x in chief.placement.shards if x.state == 1)
        target = ({0, 1, 2} - set(s1.copies)).pop()
        async with rec.placement_lock:
            net.remove(PS[1])
            slots[1] = serve_ps(net, 1, PS[1])
            failing = asyncio.ensure_future(rec.fail_over([1]))
            await asyncio.sleep(0.01)
            moving = asyncio.ensure_future(mover.move(1, target))
            await asyncio.sleep(0.01)
        await failing
        assert not await moving
        assert "no longer served by ps 1" in mover.done[-1]["failed"]
        assert rec.homes is not None and rec.homes.of[1] == s1.backups[0]
        assert not isinstance(slots[1].role(1), Primary)
        # the state's copy goes onto the restarted process again
        mover.rate = 1 << 20
        assert await mover.move(1, 1)
        assert rec.homes.of[1] == 1

    run(body())


def test_a_copy_behind_the_one_promoted_takes_the_entry_it_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replicated hand-over fences every copy at a new term and promotes the furthest.
    An entry of the old primary that reached its backup but not the target makes the
    backup the furthest; the new primary then sends the target that entry, at its
    old term, which the target (fenced at the new one) refused as a replaced
    primary's: the new primary took itself for replaced and refused every push
    (not_primary) for good. The move test above hung so, one run in six."""
    from zmqps.transport.fake import FakeClient

    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 2)
        rec = chief.recovery
        mover, rr = copiers(rec)
        assert chief.placement is not None
        s1 = next(s for s in chief.placement.shards if s.state == 1)
        source, backup = s1.ps, s1.backups[0]
        target = next(q for q in range(3) if q not in s1.copies)
        pusher = Pusher(net, chief)
        await pusher.client.push({"w": np.ones((12, 4), np.float32)})
        why, _ = await rr.join(1, target, mover.rate, {}, lambda: True, lambda q: True, 0.01)
        assert why == ""
        # the source's entries stop reaching the target (held, as on a slow link)
        held = asyncio.Event()
        real = FakeClient.request

        async def request(self: FakeClient, op: str, *a: object, **kw: object) -> object:
            if (
                op == "replicate"
                and self.identity.startswith(f"ps{source}:")
                and (self.endpoint == PS[target])
            ):
                await held.wait()
            return await real(self, op, *a, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(FakeClient, "request", request)
        pending = asyncio.ensure_future(pusher.client.push({"w": np.ones((12, 4), np.float32)}))
        for _ in range(100):  # the backup applies the entry; the target does not
            await asyncio.sleep(0.01)
            if slots[backup].role(1).log.applied > slots[target].role(1).log.applied:  # type: ignore[union-attr]
                break
        assert slots[backup].role(1).log.applied > slots[target].role(1).log.applied  # type: ignore[union-attr]
        assert await mover._hand_over(1, source, target) == ""
        held.set()
        with contextlib.suppress(*RECOVERABLE):
            await pending  # answered not_primary: sent again below
        # the copy promoted serves, and every copy takes what it pushes
        pusher.follow()
        await asyncio.wait_for(pusher.client.push({"w": np.ones((12, 4), np.float32)}), 5.0)
        await pusher.client.close()

    run(body())


def test_a_chief_restarted_while_the_process_holding_moved_states_restarts_restores() -> None:
    """Scaled down to 1 PS (every state on ps 0, the others drained and gone); the
    chief restarts, learns the moved placement from ps 0, and ps 0 restarts empty
    before the chief asks it for each state (fault schedule seed 51). The states
    there are lost: the chief restores them onto ps 0 (no checkpoint: the initial
    values). It exited 1 on ps 0's not_primary ("holds no copy of ps 1's state"),
    and its next start, knowing nothing of the moves, waited for the drained PS."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 1)
        mover = chief.recovery.mover
        assert mover is not None
        mover.scale(1)
        for _ in range(4):
            await mover.step()
        assert mover.status()["drained"] == [1, 2]
        for q in (1, 2):
            net.remove(PS[q])
        net.remove(CHIEF)
        restarted = chief_on(net, chief.cfg)
        rec = restarted.recovery
        learned = rec._moved_homes

        async def then_ps0_restarts() -> object:
            placement = await learned()
            net.remove(PS[0])
            slots[0] = serve_ps(net, 0, PS[0])
            return placement

        rec._moved_homes = then_ps0_restarts  # type: ignore[method-assign]
        await asyncio.wait_for(restarted.start(), 30.0)
        # started (no checkpoint: afresh), the drained processes not waited for; the
        # states go back onto ps 0
        assert rec.homes is not None and rec.homes.of == [0, 0, 0]
        assert rec.restore_homes() == {0: 0, 1: 0, 2: 0}

    run(body())


def test_a_state_moves_onto_a_process_that_holds_a_backup_of_it_already() -> None:
    """Replicated: the target of a move already holds an in-sync copy (a chief killed
    while the copy was made finds it in the copies the primary names, and adopts it
    as a backup: fault schedule seed 11). The move hands over to it at once; it
    asked the primary for a join, which refused ("a backup already"), and the plan
    asked again every look, for ever."""

    async def body() -> None:
        net = FakeNetwork()
        chief, _ = await cluster(net, 2)
        mover = chief.recovery.mover
        assert mover is not None and chief.placement is not None
        s1 = next(s for s in chief.placement.shards if s.state == 1)
        backup = s1.backups[0]
        pusher = Pusher(net, chief)
        task = asyncio.ensure_future(pusher.run())
        await asyncio.sleep(0.2)
        assert await mover.move(1, backup)
        pusher.stop = True
        await task
        after = chief.placement
        assert after is not None
        assert {s.ps for s in after.shards if s.state == 1} == {backup}
        assert 1 not in after.shards_of("w")[1].copies
        np.testing.assert_array_equal(
            await pusher.values(), np.full((12, 4), -0.5 * pusher.acked, np.float32)
        )
        await pusher.client.close()

    run(body())


def serve_checkpointing_ps(net: FakeNetwork, i: int, folder: Path) -> PSSlots:
    """PS ``i`` on the in-memory network, restoring from checkpoints in ``folder``."""
    slots = PSSlots(
        PSService(i, checkpoint_dir=str(folder)),
        make_copy=lambda s: PSService(s, checkpoint_dir=str(folder)),
        link=lambda q, endpoint, slot: net.client(endpoint, f"ps{i}:ship{slot}", slot=slot),
    )
    net.serve(PS[i], slots, name=f"ps{i}")
    return slots


async def checkpointed_cluster(
    net: FakeNetwork, folder: Path, replication: int
) -> tuple[ChiefService, list[PSSlots]]:
    """:func:`cluster` with checkpoints in ``folder``."""
    slots = [serve_checkpointing_ps(net, i, folder) for i in range(3)]
    cfg = replace(
        replicated_config(CHIEF, PS, SGD),
        replication=replication,
        checkpoint=CheckpointPolicy(str(folder)),
    )
    chief = chief_on(net, cfg)
    await chief.start()
    await chief.create_variables(VARS, dict(SGD))
    return chief, slots


async def scaled_to_ps0_and_checkpointed(
    net: FakeNetwork, folder: Path
) -> tuple[ChiefService, list[PSSlots], Pusher]:
    """Unreplicated, checkpoints in ``folder``: one push of ones, every state moved
    onto ps 0 (ps 1 and 2 drained), a checkpoint committed."""
    chief, slots = await checkpointed_cluster(net, folder, 1)
    mover = chief.recovery.mover
    assert mover is not None
    pusher = Pusher(net, chief)
    await pusher.client.push({"w": np.ones((12, 4), np.float32)})
    mover.scale(1)
    for _ in range(4):
        await mover.step()
    assert mover.status()["drained"] == [1, 2]
    assert await chief.checkpoints.now(10.0)
    return chief, slots, pusher


def assert_restored_onto_ps0(chief: ChiefService, slots: list[PSSlots]) -> None:
    """Every state on ps 0 with the checkpoint's values (one push of ones)."""
    assert chief.recovery.gen >= 1 and chief.placement is not None
    assert all(s.ps == 0 for s in chief.placement.shards)
    for st in range(3):
        for sh in slots[0].service(st).store:
            assert np.all(sh.values == -0.5)


def test_a_chief_restarted_after_every_moved_copy_was_lost_restores_from_a_checkpoint(
    tmp_path: Path,
) -> None:
    """As above, with a checkpoint: every copy is lost (ps 0, holding every state,
    restarted), so the chief resumes from the checkpoint onto the process left. The
    restore was sent by the moved homes and found no copy of ps 1's state on ps 0:
    the chief exited 1 (fault schedule seed 51 again, after the fix above)."""
    net = FakeNetwork()

    def ps(i: int) -> PSSlots:
        return serve_checkpointing_ps(net, i, tmp_path)

    async def body() -> None:
        chief, slots, pusher = await scaled_to_ps0_and_checkpointed(net, tmp_path)
        cfg = chief.cfg
        for q in (1, 2):
            net.remove(PS[q])
        net.remove(CHIEF)
        restarted = chief_on(net, cfg)
        rec = restarted.recovery
        learned = rec._moved_homes

        async def then_ps0_restarts() -> object:
            placement = await learned()
            net.remove(PS[0])
            slots[0] = ps(0)
            return placement

        rec._moved_homes = then_ps0_restarts  # type: ignore[method-assign]
        await asyncio.wait_for(restarted.start(), 30.0)
        assert_restored_onto_ps0(restarted, slots)
        await pusher.client.close()

    run(body())


def test_a_chief_restarted_after_every_process_that_heard_the_moves_restarted_starts(
    tmp_path: Path,
) -> None:
    """Unreplicated: scaled to 1 PS (ps 1 and 2 drained, gone), a checkpoint, then ps 0
    restarted, and the chief with it: no running process heard where the states were.
    The checkpoint says which processes served the run: the start waits for the others
    a few heartbeats and restores every state onto ps 0. Before, it waited its whole
    start-up timeout for ps 1 and 2, failed, and a launcher started it again for ever."""
    net = FakeNetwork()

    async def body() -> None:
        chief, slots, pusher = await scaled_to_ps0_and_checkpointed(net, tmp_path)
        cfg = replace(chief.cfg, startup_timeout=120.0)
        for q in (0, 1, 2):
            net.remove(PS[q])
        net.remove(CHIEF)
        slots[0] = serve_checkpointing_ps(net, 0, tmp_path)
        restarted = chief_on(net, cfg)
        await asyncio.wait_for(restarted.start(), 30.0)
        assert restarted.recovery.left_at_start == [1, 2]
        assert_restored_onto_ps0(restarted, slots)
        await pusher.client.close()

    run(body())


def test_a_chief_restarted_after_a_restore_onto_the_ps_left_adopts_it(tmp_path: Path) -> None:
    """Unreplicated, scaled to 1 PS (ps 1 and 2 drained, gone): ps 0, holding every
    state, restarted and the chief restored them all onto it; then the chief was
    killed. The restore now publishes where the states are, so the next chief adopts
    ps 0 as it is. Before (fault schedule 730), no process had heard it: the next chief
    found the PS in disagreement (the drained ones counted as of generation 0),
    restored every state again, onto their own processes, and waited for the drained
    ones, which the restore then found restarted: a third restore."""
    net = FakeNetwork()

    async def body() -> None:
        chief, slots, pusher = await scaled_to_ps0_and_checkpointed(net, tmp_path)
        rec = chief.recovery
        for q in (0, 1, 2):
            net.remove(PS[q])
        slots[0] = serve_checkpointing_ps(net, 0, tmp_path)
        async with rec.placement_lock:
            await rec.restore_lost([0], rec.clock(), "ps 0 restarted")
        assert rec.gen == 1
        assert_restored_onto_ps0(chief, slots)
        net.remove(CHIEF)
        restarted = chief_on(net, replace(chief.cfg, startup_timeout=120.0))
        await asyncio.wait_for(restarted.start(), 30.0)
        r = restarted.recovery
        assert r.gen == 1 and r.restore_count == 0, r.recoveries  # adopted
        assert_restored_onto_ps0(restarted, slots)
        await pusher.client.close()

    run(body())


def test_a_replicated_chief_restarted_after_a_scale_down_restores_onto_the_ps_that_stay(
    tmp_path: Path,
) -> None:
    """With two copies: ps 2 drained by a scale to 2 PS (it exited), then the chief
    restarted while ps 0 and ps 1 both restarted, every copy lost. The restore puts
    each state on a process that stays, and the start does not wait for ps 2 (the
    newest placement names no copy there): before, it gave ps 2's state back to ps 2
    and waited the start-up timeout for it (fault schedule 809)."""
    net = FakeNetwork()

    def ps(i: int) -> PSSlots:
        return serve_checkpointing_ps(net, i, tmp_path)

    async def body() -> None:
        chief, slots = await checkpointed_cluster(net, tmp_path, 2)
        cfg = chief.cfg
        mover, rr = copiers(chief.recovery)
        await rr.watch()
        pusher = Pusher(net, chief)
        await pusher.client.push({"w": np.ones((12, 4), np.float32)})
        mover.ask([0, 1])
        await settle(mover, rr)
        assert mover.status()["drained"] == [2]
        assert chief.placement is not None
        assert all(set(s.copies) == {0, 1} for s in chief.placement.shards)
        assert await chief.checkpoints.now(10.0)
        net.remove(PS[2])
        net.remove(CHIEF)
        restarted = chief_on(net, cfg)
        rec = restarted.recovery
        learned = rec._moved_homes

        async def then_both_restart() -> object:
            out = await learned()
            for q in (0, 1):
                net.remove(PS[q])
                slots[q] = ps(q)
            return out

        rec._moved_homes = then_both_restart  # type: ignore[method-assign]
        await asyncio.wait_for(restarted.start(), 30.0)  # the start-up timeout is 120 s
        assert rec.gen >= 1 and restarted.placement is not None
        assert {s.ps for s in restarted.placement.shards} <= {0, 1}
        for s in restarted.placement.shards:
            for sh in slots[s.ps].service(s.state).store:
                assert np.all(sh.values == -0.5)  # the checkpoint's: one push of ones
        await pusher.client.close()

    run(body())


def test_a_version_ahead_of_a_moved_state_counts_as_current() -> None:
    """A worker read an update the move's source had applied and not committed (its
    push answered not_primary, to be sent again to the new home); its next push says
    a version one ahead of the new home's. The new home took it for a hostile one
    (invalid_argument: "pulled version 1237 outside [0, 1236]") and the worker exited
    1 (fault schedules 211, 214, 228, 236, ssp). A copy serving in a replication role
    takes it as the current version; a plain PS still refuses it (as values that are
    gone: pull again)."""

    async def body() -> None:
        net = FakeNetwork()
        chief, _ = await cluster(net, 1)
        mover = chief.recovery.mover
        assert mover is not None and chief.placement is not None
        pusher = Pusher(net, chief)
        await pusher.client.pull()
        async with chief.recovery.placement_lock:
            await mover._primary_here(1, 1)  # state 1 a primary, as moves make it
        ahead = {s.id: s.state for s in chief.placement.shards}
        for sid, state in ahead.items():
            if state == 1:
                pusher.client.versions[sid] += 1
        await pusher.client.push({"w": np.ones((12, 4), np.float32)})
        for sid, state in ahead.items():
            if state == 0:
                pusher.client.versions[sid] += 5
        with pytest.raises(RolledBack, match="ahead of this PS's"):
            await pusher.client.push({"w": np.ones((12, 4), np.float32)})
        await pusher.client.close()

    run(body())


def test_a_ps_that_left_counts_for_no_generation_at_start() -> None:
    """At start, a process that left the run (drained, not answering: ``ps_states``
    reads it as holding nothing, ``left``) says nothing of the generation: with it
    counted as generation 0, PS restored since (generation 1) looked in disagreement,
    and a chief restored every state again (fault schedule 730)."""
    wire = {
        "variables": [{"name": "w", "shape": [8, 4], "dtype": "float32", "sparse": False}],
        "shards": [[0, "w", 0, 0, 4, 0], [1, "w", 0, 4, 4, 0]],
        "optimizer": {"name": "sgd", "lr": 0.5},
    }
    held = {"gen": 1, "step": 0, "shards": [[0, 1], [1, 1]], "placement": wire}
    gone = {"boot": "", "gen": 0, "shards": [], "roles": [], "left": True}
    plan = decide_start([held, gone], sync=False)
    assert plan.kind == "adopt" and plan.gen == 1, plan
    assert decide_start([held, {**gone, "left": False}], sync=False).kind == "restore"


def test_a_restore_goes_past_every_generation_a_chief_of_the_run_restored_to(
    tmp_path: Path,
) -> None:
    """A chief restored every PS (generation 1), then it and every PS were killed
    before a checkpoint of that generation: the next chief restores the same
    checkpoint. Workers heard generation 1 with other values, so it takes 2 (fault
    schedule 723: both restores were of generation 1, and the step went back within
    it). The highest generation is kept beside the checkpoints."""
    net = FakeNetwork()

    async def body() -> None:
        chief, slots = await checkpointed_cluster(net, tmp_path, 1)
        rec = chief.recovery
        assert await chief.checkpoints.now(10.0)
        for q in (0, 1, 2):
            net.remove(PS[q])
            slots[q] = serve_checkpointing_ps(net, q, tmp_path)
        async with rec.placement_lock:
            await rec.restore_lost([0, 1, 2], rec.clock(), "every PS restarted")
        assert rec.gen == 1
        for q in (0, 1, 2):
            net.remove(PS[q])
            slots[q] = serve_checkpointing_ps(net, q, tmp_path)
        net.remove(CHIEF)
        restarted = chief_on(net, chief.cfg)
        await asyncio.wait_for(restarted.start(), 30.0)
        assert restarted.recovery.gen == 2
        assert all(slots[q].service(q).gen == 2 for q in range(3))

    run(body())


def test_a_scale_up_left_undone_at_the_end_says_so() -> None:
    """A scale up whose PS came too late (the launcher starts it when asked; the run
    ended first) left every state where it was. The summary named nothing undone:
    every state was on a PS asked for, though the plan for them still moved some."""

    async def body() -> None:
        net = FakeNetwork()
        chief, _ = await cluster(net, 2)
        mover = chief.recovery.mover
        assert mover is not None
        mover.ask([0])
        assert await mover.move(1, 0) and await mover.move(2, 0)
        assert "unmet" not in (await summarize(chief))["elastic"]
        mover.ask([0, 1, 2])
        el = (await summarize(chief))["elastic"]
        assert el["serving"] == [0] and el["asked"] == [0, 1, 2], el
        assert el["unmet"].endswith(
            "not moved, to balance the PS asked for (ps 0, 1, 2): moves stop when training ends"
        ), el["unmet"]
        assert "from ps 0 to ps 1" in el["unmet"] or "from ps 0 to ps 2" in el["unmet"]
        assert await mover.move(1, 1) and await mover.move(2, 2)
        el = (await summarize(chief))["elastic"]
        assert el["serving"] == [0, 1, 2] and "unmet" not in el, el

    run(body())


@pytest.mark.parametrize("late", ["state", "promotion"])
def test_a_move_onto_a_process_slow_to_answer_after_its_promotion_keeps_it_alive(
    late: str,
) -> None:
    """The hand-over's promotion is answered, then the new home is slow (a loaded
    machine: three clusters on two cores) to answer the ps_state after it (``state``),
    or the promotion's own answer is lost and the ps_state says it was promoted
    (``promotion``). The chief asked with 2 s: late, it expected boot id "" and took
    the copy's next probe answer for a restart (a live PS failed over, or restored
    from a checkpoint: a ps schedule of 2, 3, 1 PS), and kept the source's copy named
    as a backup its primary never fed (a run without replication could never move the
    state off its new home again). Now the promotion's answer names the boot id, and
    the ps_state is waited for up to the heartbeat timeout before anything is
    published: the move ends as any other."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 1)
        mover, rec = chief.recovery.mover, chief.recovery
        assert mover is not None and chief.placement is not None
        source = chief.placement.shards[1].ps
        target = next(q for q in range(3) if q not in chief.placement.shards_of("w")[1].copies)
        asked: list[str] = []

        async def slow(msg: Any) -> Any:
            if msg.op == "ps_state" and msg.slot == 1:
                asked.append(msg.op)
                await asyncio.sleep(2.2)  # past the 2 s the chief waited before
            answer = await answer_of(slots[target], msg)
            if late == "promotion" and msg.op == "replica" and msg.body.get("primary"):
                raise DeadlineExceeded("no reply")  # promoted, its answer lost
            return answer

        net.serve(PS[target], slow)
        assert await mover.move(1, target)
        assert asked
        moved = chief.placement.shards[1]
        assert (moved.ps, moved.backups) == (target, ())  # the source's copy not named
        assert len(slots[source].service(1).store) == 0  # and dropped, as after any move
        boot = slots[target].service(1).boot
        assert rec.boots[1] == boot
        # the copy's next probe answer is its own, as expected: no restart, nothing to fail over
        assert rec.health.answered(1, boot, rec.gen, rec.clock()) == "ok"

    run(body())


def test_a_move_onto_a_process_stalled_past_its_promotion_restores_nothing() -> None:
    """The new home stalls as it is promoted (12 s on a loaded machine, past the
    heartbeat timeout): the promotion is dropped unapplied (its deadline passed) and
    the look after it is not answered either. The chief expected boot id "": the
    copy's first answer after the stall was taken for a restart, its process failed
    over whole, and its own state, with no copy in a run without replication, restored
    from the checkpoint (the by-hand scale test, twice in the suite at three tests at
    once). Now the copy's boot id as its fence said is expected, the mover's next look
    finds the copy still a backup at the hand-over's term and promotes it again, and
    the source's kept copy goes: nothing failed over, nothing restored."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots, source, target = await ps1_and_a_target(net)
        mover, rec = chief.recovery.mover, chief.recovery
        assert mover is not None and chief.placement is not None
        stalled = {"until": 0.0}
        dropped: list[int] = []

        async def stalls(msg: Any) -> Any:
            if msg.op == "replica" and msg.body.get("primary") and not dropped:
                # the promotion: dropped, unapplied, its deadline past once the stall ends
                dropped.append(msg.body["term"])
                stalled["until"] = time.monotonic() + 2.6  # past every wait of the chief
                await asyncio.sleep(2.6)
                raise DeadlineExceeded("dropped: its deadline passed while stalled")
            wait = stalled["until"] - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            return await answer_of(slots[target], msg)

        net.serve(PS[target], stalls)
        assert await mover.move(1, target)
        assert dropped  # the promotion was never applied
        copy = slots[target].service(1)
        assert rec.health.expected(1) == copy.boot  # not "": a restart would say another
        assert 1 in mover.unsettled
        kept = chief.placement.shards[1]
        assert (kept.ps, kept.backups) == (target, (source,))  # kept for a fail-over
        # its answers after the stall are its own, as expected: no restart to fail over
        assert rec.health.answered(1, copy.boot, rec.gen, rec.clock()) == "ok"
        await mover.step()  # the copy is still a backup: promoted again, the kept one goes
        assert mover.unsettled == {} and mover.kept == {}
        after = chief.placement.shards[1]
        assert (after.ps, after.backups) == (target, ())
        assert len(slots[source].service(1).store) == 0
        pusher = Pusher(net, chief)
        await pusher.client.pull()
        await pusher.client.push({"w": np.ones((12, 4), np.float32)})  # served there
        assert (rec.restore_count, rec.failover_count) == (0, 0)
        await pusher.client.close()

    run(body())


def test_a_fail_over_of_a_kept_copy_restores_no_state_without_copies() -> None:
    """A run without replication: a move kept the source's copy (its new home did not
    answer in time), then the new home stays silent past the heartbeat timeout and
    the state fails over to the kept copy. That process's own state has no copy: as
    for any silent PS of such a run, it is waited for, not restored from the
    checkpoint (restored if its process comes back without it)."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots, source, target = await ps1_and_a_target(net)
        mover, rec = chief.recovery.mover, chief.recovery
        assert mover is not None and chief.placement is not None
        silent = [False]

        async def late(msg: Any) -> Any:
            if silent[0] or (msg.op == "ps_state" and msg.slot == 1):
                await asyncio.sleep(2.3)  # past the 2 s (at least) the chief waits
            return await answer_of(slots[target], msg)

        net.serve(PS[target], late)
        assert await mover.move(1, target)
        assert chief.placement.shards[1].backups == (source,)  # kept for a fail-over
        own = [s for s in chief.placement.shards if s.state == target]
        silent[0] = True
        await rec.fail_over([1])
        assert chief.placement.shards[1].ps == source  # back on the kept copy
        assert [s for s in chief.placement.shards if s.state == target] == own  # waited for
        assert (rec.failover_count, rec.restore_count) == (1, 0)

    run(body())


def test_a_copy_kept_for_a_new_primary_that_answered_too_late_goes_once_it_answers() -> None:
    """The new primary answers its promotion, then nothing for longer than the chief
    waits (a heartbeat timeout): the source's copy is kept, named, for a fail-over. A
    primary that lives on never feeds it: named, a later fail-over would promote a copy
    behind the state. The mover's next look hears the primary and drops the kept copy."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 1, heartbeat_timeout=1.0)
        mover = chief.recovery.mover
        assert mover is not None and chief.placement is not None
        source = chief.placement.shards[1].ps
        target = next(q for q in range(3) if q not in chief.placement.shards_of("w")[1].copies)
        first = [True]

        async def late_once(msg: Any) -> Any:
            if msg.op == "ps_state" and msg.slot == 1 and first[0]:
                first[0] = False
                await asyncio.sleep(2.3)  # past the 2 s (at least) the chief waits
            return await answer_of(slots[target], msg)

        net.serve(PS[target], late_once)
        assert await mover.move(1, target)
        kept = chief.placement.shards[1]
        assert (kept.ps, kept.backups) == (target, (source,))  # kept for a fail-over
        assert len(slots[source].service(1).store) > 0
        await mover.step()
        after = chief.placement.shards[1]
        assert (after.ps, after.backups) == (target, ())
        assert chief.placement.epoch > 0 and mover.kept == {}
        assert len(slots[source].service(1).store) == 0  # dropped, as after any move

    run(body())


def test_a_move_from_a_process_restarted_before_the_watch_heard_it_is_given_up() -> None:
    """The state's process was restarted (empty) a moment before a move of its state,
    before the health watch's next look: the move made it the state's primary, copied
    nothing to the target and served the state from there, a generation behind; a
    chief started after that found the PS in disagreement and could not finish (fault
    schedule 9982). The move is given up now; the watch restores the state."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 1)
        mover = chief.recovery.mover
        assert mover is not None and chief.placement is not None
        before = chief.placement
        target = next(q for q in range(3) if q not in before.shards_of("w")[1].copies)
        slots[1] = serve_ps(net, 1, PS[1])  # killed and started again: empty
        assert not await mover.move(1, target)
        assert chief.placement is before  # nothing moved, nothing published
        assert "restarted since the chief last heard it" in mover.done[-1]["failed"]

    run(body())


@pytest.mark.parametrize("handed_over", [False, True], ids=["joined", "handed-over"])
def test_a_chief_restarted_in_the_middle_of_a_move_gives_it_up_or_adopts_it(
    handed_over: bool,
) -> None:
    """An operator's trial: a scale back up moved a state onto a process a scale down
    had drained; the chief was killed with -9 in the middle. The chief started again
    took the newest placement it heard (the state on its source), drained the target
    as serving nothing, while the source still counted the target's copy in every
    commit: the run stood until --stall-timeout. Now a move the copies say was joined
    is given up at its source (which counts no other copy then), and one handed over
    is served where it went; either way training goes on, nothing acknowledged lost.
    (A primary of a higher term than the placement heard, a hand-over the last chief
    did not publish, is the state's home: ``recovery._moves_the_copies_say``.)"""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots = await cluster(net, 1)
        mover, _ = copiers(chief.recovery)
        pusher = Pusher(net, chief)
        task = asyncio.ensure_future(pusher.run())
        mover.scale(2)  # ps 2's state moves off it, and it is drained
        for _ in range(4):
            await mover.step()
        assert mover.status()["drained"] == [2]
        net.remove(PS[2])
        slots[2] = serve_ps(net, 2, PS[2])  # started again, empty (a launcher's restart)
        assert chief.recovery.homes is not None
        source = chief.recovery.homes.of[2]
        assert source != 2
        pusher.stop = True  # (a quiet state: its copy gets in sync at once)
        await asyncio.wait_for(task, 10.0)
        mover.boots[2] = None  # (its new incarnation, learned by the move's watch)
        mover.rate = 64.0  # the copy takes a second
        moving = asyncio.ensure_future(mover.move(2, 2))
        for _ in range(1500):  # until the target's copy counts in the source's commits
            role = slots[source].role(2)
            if isinstance(role, Primary) and role.log.in_sync():
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the target's copy never got in sync")
        if handed_over:
            await mover._hand_over(2, source, 2)  # the hand-over, then the chief dies
        moving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await moving
        net.remove(CHIEF)  # killed before it published the placement that says so
        restarted = chief_on(net, chief.cfg)
        pusher.chief = restarted
        await asyncio.wait_for(restarted.start(), 30.0)
        assert restarted.recovery.homes is not None
        home = restarted.recovery.homes.of[2]
        assert home == (2 if handed_over else source)
        role = slots[home].role(2)
        assert isinstance(role, Primary) and not role.log.in_sync()  # commits wait for none
        pusher.stop = False
        task = asyncio.ensure_future(pusher.run())
        restarted.recovery.mover.wanted = [0, 1]  # type: ignore[union-attr]
        for _ in range(3):  # the restarted chief's drain: the state's home stays
            await restarted.recovery.mover.step()  # type: ignore[union-attr]
        before = pusher.acked
        await asyncio.sleep(0.5)
        assert pusher.acked > before  # pushes to ps 2's state are answered
        pusher.stop = True
        await asyncio.wait_for(task, 10.0)
        np.testing.assert_array_equal(
            await pusher.values(), np.full((12, 4), -0.5 * pusher.acked, np.float32)
        )
        await pusher.client.close()

    run(body())
