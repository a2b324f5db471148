"""A chief restarted under ``--replication``: it learns where each PS state is served
from the copies themselves (each process's roles and terms, the epoch it was told) and
adopts the cluster: no restore, the moved states reached at their new homes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import pytest
from fake_replicated import chief_on, replicated_config, serve_ps

from zmqps.core.variables import Placement, VariableDef
from zmqps.roles.chief import ChiefService
from zmqps.roles.chief.rereplication import Rereplicator
from zmqps.roles.client import ParameterClient
from zmqps.roles.homes import Homes
from zmqps.roles.ps.replica import Primary
from zmqps.roles.ps.slots import PSSlots
from zmqps.transport import FakeNetwork
from zmqps.wire import Message
from zmqps.wire import ops as o
from zmqps.wire.errors import DeadlineExceeded, NotPrimary

T = TypeVar("T")
CHIEF = "127.0.0.1:7000"
PS = ("127.0.0.1:7100", "127.0.0.1:7101", "127.0.0.1:7102")
SGD = {"name": "sgd", "lr": 0.1}
VARS = (VariableDef("w", (12, 4), init={"name": "glorot_uniform", "seed": 1}),)


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 30.0)

    return asyncio.run(bounded())


async def started(net: FakeNetwork) -> ChiefService:
    """Three PS with two copies of each state, a chief that made the variables."""
    for i in range(3):
        serve_ps(net, i, PS[i])
    chief = chief_on(net, replicated_config(CHIEF, PS, SGD))
    await chief.start()
    await chief.create_variables(VARS, dict(SGD))
    return chief


async def started_with_backup(net: FakeNetwork) -> tuple[ChiefService, Placement, int]:
    """:func:`started`, its placement, and the process holding ps 1's state's backup."""
    chief = await started(net)
    placement = chief.placement
    assert placement is not None
    return chief, placement, next(s.backups[0] for s in placement.shards if s.state == 1)


async def started_watched(
    net: FakeNetwork, replication: int = 2
) -> tuple[ChiefService, list[PSSlots], Rereplicator]:
    """Three PS (their handlers, to look at their roles), a chief with ``replication``
    copies of each state that made the variables, and its rereplicator."""
    slots = [serve_ps(net, i, PS[i]) for i in range(3)]
    chief = chief_on(net, replace(replicated_config(CHIEF, PS, SGD), replication=replication))
    await chief.start()
    await chief.create_variables(VARS, dict(SGD))
    rr = chief.recovery.rereplicator
    assert rr is not None and chief.placement is not None
    return chief, slots, rr


async def copied_again(rr: Rereplicator) -> None:
    """Let the watch make copies until no state is short of one (a few rounds)."""
    for _ in range(8):
        job = rr.next_copy()
        if job is not None:
            assert await rr.copy(*job)
        await rr.watch()
        if not rr.under_replicated() and rr.current is None:
            break


def test_a_chief_restarted_mid_hand_over_with_a_copy_on_every_process_adopts_the_copies() -> None:
    """The last chief was killed in a hand-over of state 2 after its copies were fenced
    at the new term and before one was promoted, with a copy on every process (the copy
    made before a promotion), and state 1 failed over before. Its copies had no
    primary and no process without one to name as the lost primary: the restarted
    chief fell back on the placement of the PS's first report (state 1 on ps 1, which
    holds a backup of it) and every copy onto ps 0 of state 1 was refused
    (``not_primary``), every look, to the run's end (fault schedule 821). Now the
    furthest copy of the highest term is named primary and promoted by the first
    watch; state 1 stays where its fail-over put it."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots, rr = await started_watched(net)
        net.remove(PS[1])
        await chief.recovery.fail_over([1])
        slots[1] = serve_ps(net, 1, PS[1])
        await copied_again(rr)
        rec = chief.recovery
        assert rec.homes is not None and chief.placement is not None
        home1 = rec.homes.of[1]
        assert home1 != 1
        s2 = next(s for s in chief.placement.shards if s.state == 2)
        third = next(q for q in range(3) if q not in s2.copies)
        assert await rr.copy(2, third)  # a copy of state 2 on every process
        term = rec.terms.get(2, 1) + 1
        epoch = chief.placement.epoch + 1
        fence = o.ReplicaSet(2, term, primary=False, epoch=epoch).to_wire()
        for q in range(3):
            await net.client(PS[q], "chief:9").request("replica", fence)
        net.remove(CHIEF)
        restarted = chief_on(net, chief.cfg)
        await restarted.start()
        r = restarted.recovery
        assert r.homes is not None and r.homes.of[1] == home1
        await r.rereplicator.watch()  # type: ignore[union-attr]
        after = restarted.placement
        assert after is not None
        home2 = r.homes.of[2]
        assert isinstance(slots[home2].role(2), Primary)
        wh = Homes([net.client(a, "worker:0:1") for a in PS])
        wh.update(after)
        w = ParameterClient(wh.links(), after, worker="worker:0", incarnation=1, timeout=2.0)
        before = (await w.pull())["w"].copy()
        await w.push({"w": np.ones((12, 4), np.float32)})
        np.testing.assert_array_equal((await w.pull())["w"], before - np.float32(0.1))

    run(body())


def test_a_restarted_chief_adopts_states_moved_by_a_fail_over() -> None:
    async def body() -> None:
        net = FakeNetwork()
        chief = await started(net)
        # ps 1 dies; a copy of its state takes over; the launcher restarts ps 1, empty
        net.remove(PS[1])
        await chief.recovery.fail_over([1])
        assert chief.recovery.homes is not None
        home = chief.recovery.homes.of[1]
        assert home != 1
        serve_ps(net, 1, PS[1])
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
        restarted = chief_on(net, chief.cfg)
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


def test_a_restarted_chief_fails_over_a_state_whose_primary_died_with_the_last_chief() -> None:
    """ps 1 and the chief are killed together, before any fail-over: ps 1 comes back
    empty and no copy is primary of its state. The restarted chief promotes the
    backup: no restore, every acknowledged push kept."""

    async def body() -> None:
        net = FakeNetwork()
        chief, placement, backup = await started_with_backup(net)
        wh = Homes([net.client(a, "worker:0:1") for a in PS])
        wh.update(placement)
        w = ParameterClient(wh.links(), placement, worker="worker:0", incarnation=1)
        await w.pull()
        for k in range(3):
            await w.push({"w": np.full((12, 4), k + 1, np.float32)})
        pulled = (await w.pull())["w"].copy()
        # the chief and ps 1 die together; ps 1 is restarted, empty
        net.remove(CHIEF)
        net.remove(PS[1])
        serve_ps(net, 1, PS[1])
        restarted = chief_on(net, chief.cfg)
        await restarted.start()
        st: dict[str, Any] = restarted.status()
        assert st["gen"] == 0 and not st["recoveries"], st  # no restore
        assert st["failover_count"] == 1 and st["promotions"] == 1, st
        after = restarted.placement
        assert after is not None and after.epoch > placement.epoch
        assert restarted.recovery.homes is not None
        assert restarted.recovery.homes.of[1] == backup
        assert {s.state: s.ps for s in after.shards if s.state != 1} == {
            s.state: s.ps for s in placement.shards if s.state != 1
        }
        # the worker follows the new placement; nothing acknowledged was lost
        wh.update(after)
        w.moved([1])
        assert (await w.pull())["w"].tolist() == pulled.tolist()
        await w.push({"w": np.ones((12, 4), np.float32)})
        assert not np.array_equal((await w.pull())["w"], pulled)

    run(body())


def test_a_restarted_process_given_a_copy_is_not_failed_over_again() -> None:
    """ps 1 dies and is restarted, empty; the chief fails it over. A copy made on the
    restarted process before the chief's process watch heard its new boot id must not
    make the watch take it for restarted once more (a second fail-over dropping the
    new copy): every copy is made once, one fail-over in all."""

    async def body() -> None:
        net = FakeNetwork()
        chief = await started(net)
        rr = chief.recovery.rereplicator
        assert rr is not None
        await rr.watch()  # the boot ids of the processes as they start
        net.remove(PS[1])
        await rr.watch()  # ps 1 is silent, not for long yet: nothing to do
        serve_ps(net, 1, PS[1])  # the launcher restarts it, empty
        await chief.recovery.fail_over([1])
        await copied_again(rr)
        assert not rr.under_replicated()
        assert chief.recovery.failover_count == 1
        assert rr.failures == 0 and rr.copies == 2  # ps 1 held a primary and a backup

    run(body())


def test_a_ps_that_cannot_hold_copies_fails_the_start_as_a_configuration_error() -> None:
    """A PS refuses to ship its state (it cannot reach the others: under CURVE, a keys
    folder without its client pair): the chief's start fails with a configuration
    error naming the cause, which no restart would mend, instead of running with
    fewer copies than asked for."""
    from zmqps.wire.errors import ConfigError, InvalidArgument

    async def main() -> None:
        net = FakeNetwork()
        for i in range(3):
            slots = serve_ps(net, i, PS[i])
            if i == 1:

                def refuse(ps: int, endpoint: str, slot: int) -> Any:
                    raise InvalidArgument("ps 1 cannot hold copies: no client key pair")

                slots._link = refuse
        chief = chief_on(net, replicated_config(CHIEF, PS, SGD))
        await chief.start()
        with pytest.raises(ConfigError, match=r"--replication 2: .*no client key pair"):
            await chief.create_variables(VARS, dict(SGD))

    run(main())


def test_a_restarted_chief_that_loses_the_last_copy_while_failing_over_restores_once() -> None:
    """The chief dies with ps 1; ps 1 comes back empty. While the restarted chief fails
    ps 1's state over to its one backup, that backup dies too: no copy is left. The
    fail-over restores every PS (a new generation, training restarted); the start
    ends there, running, and does not decide the start a second time on the restored
    PS (which took them for a running cluster to adopt, in phase running: a crash)."""
    from zmqps.core.recovery import Phase

    async def body() -> None:
        net = FakeNetwork()
        chief, _, backup = await started_with_backup(net)
        net.remove(CHIEF)
        net.remove(PS[1])
        serve_ps(net, 1, PS[1])
        restarted = chief_on(net, chief.cfg)
        adopt_gone = restarted.recovery.adopt_gone

        async def backup_dies_first(*args: Any) -> Any:
            net.remove(PS[backup])  # killed, and restarted empty by its launcher
            serve_ps(net, backup, PS[backup])
            return await adopt_gone(*args)

        restarted.recovery.adopt_gone = backup_dies_first  # type: ignore[method-assign]
        await restarted.start()
        assert restarted.recovery.phase is Phase.RUNNING
        st: dict[str, Any] = restarted.status()
        assert st["gen"] == 1 and len(st["recoveries"]) == 1, st  # one restore, no second
        after = restarted.placement
        assert after is not None
        wh = Homes([net.client(a, "worker:0:1") for a in PS])
        wh.update(after)
        w = ParameterClient(wh.links(), after, worker="worker:0", incarnation=1)
        w.gen = 1
        assert (await w.pull())["w"].shape == (12, 4)  # every state served again

    run(body())


def test_the_chief_says_which_ps_processes_its_probes_do_not_hear() -> None:
    """A PS stopped for good (SIGSTOP) under --replication 2: its states fail over and
    the run goes on with one copy. The chief's status names the silent process (so a
    launcher kills and restarts it, and copies are made again), also once the run
    ends, when the probes stop; and its shutdown then asks it once."""

    async def body() -> None:
        net = FakeNetwork()
        chief = await started(net)
        rr = chief.recovery.rereplicator
        assert rr is not None
        now = [1000.0]
        rr.clock = lambda: now[0]
        rr.heard = dict.fromkeys(rr.heard, now[0])
        await rr.watch()
        assert rr.silent() == [] and chief.recovery.silent_ps() == set()
        net.remove(PS[1])
        for _ in range(3):
            now[0] += rr.timeout / 2 + 0.1
            await rr.watch()
        assert rr.silent() == [1]
        assert chief.status()["replication"]["silent"] == [1]
        chief.recovery.ps_shutting_down = True  # the run's end: the probes stop
        now[0] += 100.0
        assert rr.silent() == [1] and chief.recovery.silent_ps() == {1}

    run(body())


def test_a_primary_left_shipping_to_a_copy_given_up_is_told_its_backups_again() -> None:
    """A copy the chief gave up (its process stopped as it caught up) is dropped by
    telling the primary its backups; when that word is lost (the primary was stopped
    then), the primary keeps the copy among its in-sync backups, and once the copy's
    process dies every commit of the state, and so every sync step, waits for it for
    ever while every process answers (a sync run stood at step 0 with every state at
    step 1). The chief's watch finds such a backup and tells the primary again: the
    push it held is then acknowledged."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots, rr = await started_watched(net)
        assert chief.placement is not None
        first = next(s for s in chief.placement.shards if s.state == 0)
        t = next(q for q in range(3) if q not in first.copies)
        term = chief.recovery.terms.get(0, 1)
        homes = chief.recovery.homes
        assert homes is not None
        # a copy of state 0 on t, as the rereplicator makes one, that then goes unnamed
        await homes.processes[t].request(
            "replica", o.ReplicaSet(0, term, primary=False, make=True).to_wire()
        )
        await homes.processes[first.ps].request("join", o.Join(0, term, t, PS[t], None).to_wire())
        primary = slots[first.ps].role(0)
        assert isinstance(primary, Primary)
        for _ in range(200):
            if str(t) in primary.log.in_sync():
                break
            await asyncio.sleep(0.01)
        assert str(t) in primary.log.in_sync()
        net.remove(PS[t])  # its process dies; the placement never named it
        # the chief fails over the states t served and backed up: not state 0's copy
        await chief.recovery.fail_over([t])
        assert str(t) in primary.log.in_sync()
        assert chief.placement is not None
        wh = Homes([net.client(a, "worker:0:1", timeout=0.5) for a in PS])
        wh.update(chief.placement)
        w = ParameterClient(wh.links(), chief.placement, worker="worker:0", incarnation=1)
        held = asyncio.ensure_future(w.push({"w": np.ones((12, 4), np.float32)}))
        await asyncio.sleep(0.3)
        assert not held.done()  # state 0's commit waits for t
        states = [None if q == t else await rr.probe(q) for q in range(3)]
        assert await rr.reconcile(states) == [0]
        assert str(t) not in primary.log.in_sync()
        await asyncio.wait_for(held, 10)
        # a primary shipping to the placement's backups only is left alone
        states = [None if q == t else await rr.probe(q) for q in range(3)]
        assert await rr.reconcile(states) == []

    run(body())


def test_a_backup_its_primary_dropped_leaves_the_placement_and_is_made_again() -> None:
    """Three copies of each state. A primary that no longer ships to a backup the
    placement names (dropped when promoted past the entries it kept) leaves that copy
    without what is acknowledged from then on: a fail-over must never promote it. The
    watch takes it out of the placement (a new epoch), and a new copy is made."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots, rr = await started_watched(net, replication=3)
        assert chief.placement is not None
        first = next(s for s in chief.placement.shards if s.state == 0)
        assert len(first.backups) == 2
        gone = first.backups[-1]
        primary = slots[first.ps].role(0)
        assert isinstance(primary, Primary)
        primary.drop(gone)  # as a promotion drops a backup further behind than it kept
        epoch = chief.placement.epoch
        assert await rr.watch() == []  # the watch reconciles: nobody dead
        after = chief.placement
        assert after is not None
        assert after.epoch == epoch + 1
        assert all(gone not in s.backups for s in after.shards if s.state == 0)
        assert 0 in rr.under_replicated()
        assert rr.next_copy() == (0, gone)  # made again: the process holding fewest
        assert await rr.copy(0, gone)
        assert str(gone) in primary.log.in_sync() and not rr.under_replicated()
        states = [await rr.probe(q) for q in range(3)]
        assert await rr.reconcile(states) == []  # the two agree again

    run(body())


def test_a_backup_restarted_before_a_new_chief_first_heard_it_is_made_again() -> None:
    """ps 1 dies and its state moves to its backup; copies are made on the restarted
    ps 1 (it serves no state then, and backs up others). A chief restarts, and ps 1 is
    killed and restarted again before the new chief's first probe: no boot id of the
    lost process is known to compare, so nothing says it restarted, while it refuses
    every entry of the states it should back up and their primaries wait for it (a
    sync run stood 108 s at one step). The watch finds the named copies it does not
    hold, drops them from the placement, and makes them again; the held push is
    acknowledged."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots, rr = await started_watched(net)
        await rr.watch()
        net.remove(PS[1])
        slots[1] = serve_ps(net, 1, PS[1])  # restarted, empty
        await chief.recovery.fail_over([1])
        await copied_again(rr)
        assert chief.placement is not None and not rr.under_replicated()
        assert chief.recovery.homes is not None and 1 not in chief.recovery.homes.of
        backed = sorted(s.state for s in chief.placement.shards if 1 in s.backups)
        assert backed  # ps 1 holds copies, serves none
        # a new chief knows no boot id yet; ps 1 restarts again meanwhile
        rr.boots.clear()
        slots[1] = serve_ps(net, 1, PS[1])
        wh = Homes([net.client(a, "worker:0:1", timeout=0.5) for a in PS])
        wh.update(chief.placement)
        w = ParameterClient(wh.links(), chief.placement, worker="worker:0", incarnation=1)
        held = asyncio.ensure_future(w.push({"w": np.ones((12, 4), np.float32)}))
        await asyncio.sleep(0.3)
        assert not held.done()  # the states ps 1 backs up wait for it
        epoch = chief.placement.epoch
        assert await rr.watch() == []  # no process taken for dead
        after = chief.placement
        assert after is not None and after.epoch == epoch + 1
        assert all(1 not in s.backups for s in after.shards)
        assert sorted(rr.under_replicated()) == backed
        await asyncio.wait_for(held, 10)
        for _ in range(8):  # made again, on the restarted process among others
            job = rr.next_copy()
            if job is None:
                break
            assert await rr.copy(*job)
        assert not rr.under_replicated()
        states = [await rr.probe(q) for q in range(3)]
        assert await rr.reconcile(states) == []  # the two agree again
        await w.push({"w": np.ones((12, 4), np.float32)})

    run(body())


def test_a_lost_promotion_is_sent_again_by_the_watch() -> None:
    """A fail-over fences the surviving copy of a dead PS's state at a new term, then
    promotes it; when the promotion is lost (the process stopped then, the request
    timed out) the placement serves the state from a copy that still is a backup:
    every request for it is refused (``not_primary``) while the process answers all
    else, and no fail-over comes. The watch promotes it again; training goes on."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots, rr = await started_watched(net)
        assert chief.placement is not None
        b = next(s.backups[0] for s in chief.placement.shards if s.state == 1)
        lost: list[int] = []

        def drops_a_promotion(msg: Message) -> Any:
            promotes = msg.op == "replica" and msg.body.get("primary")
            if promotes and msg.body.get("slot") == 1 and not lost:
                lost.append(msg.body["slot"])
                raise DeadlineExceeded("replica: no reply within 2s")
            return slots[b](msg)

        net.serve(PS[b], drops_a_promotion, name=f"ps{b}")
        net.remove(PS[1])
        await chief.recovery.fail_over([1])
        assert lost == [1] and chief.recovery.homes is not None
        assert chief.recovery.homes.of[1] == b
        assert not isinstance(slots[b].role(1), Primary)  # still a backup there
        wh = Homes([net.client(a, "worker:0:1", timeout=0.5) for a in PS])
        assert chief.placement is not None
        wh.update(chief.placement)
        w = ParameterClient(wh.links(), chief.placement, worker="worker:0", incarnation=1)
        with pytest.raises(NotPrimary):
            await chief.ps[1].request("wait_step", o.WaitStep(0).to_wire())
        assert await rr.watch() == []
        assert isinstance(slots[b].role(1), Primary)
        await w.push({"w": np.ones((12, 4), np.float32)})  # every state takes it
        assert await rr.watch() == []  # nothing more to change
        assert isinstance(slots[b].role(1), Primary)

    run(body())


def test_a_copy_promoted_by_a_fail_over_then_slow_to_answer_is_not_taken_for_restarted() -> None:
    """The fail-over's promotion is answered, then the promoted copy's process is slow
    (a loaded machine). The chief asked its boot id in a second request; late, the
    health watch kept the dead primary's and took the copy's next probe answer for a
    restart: a second fail-over of a live copy. The promotion's answer names it now."""

    async def body() -> None:
        net = FakeNetwork()
        chief, slots, _ = await started_watched(net)
        placement = chief.placement
        assert placement is not None
        backup = next(s.backups[0] for s in placement.shards if s.state == 1)
        late: list[str] = []

        def slow(msg: Message) -> Any:
            if msg.op == "ps_state" and msg.slot == 1:
                late.append(msg.op)
                raise DeadlineExceeded("ps_state: no answer within 2s")
            return slots[backup](msg)

        net.serve(PS[backup], slow)
        net.remove(PS[1])
        await chief.recovery.fail_over([1])
        rec = chief.recovery
        assert rec.homes is not None and rec.homes.of[1] == backup
        boot = slots[backup].service(1).boot
        assert rec.boots[1] == boot
        assert rec.health.answered(1, boot, rec.gen, rec.clock()) == "ok"
        assert not late

    run(body())
