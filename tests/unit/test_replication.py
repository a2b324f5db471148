"""The replication log (zmqps.core.replication): commits, order, bounds, joining,
promotion; and a seeded simulation with lost, resent, reordered messages and
copies that die, in which nothing acknowledged is lost or applied twice."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest

from zmqps.core.partition import Partitioner, plan
from zmqps.core.replication import (
    Entry,
    Full,
    Offer,
    PrimaryLog,
    ReplicaLog,
    choose_primary,
    fail_over,
)
from zmqps.core.variables import Placement, VariableDef
from zmqps.wire.schema import PLACEMENT


def test_without_backups_an_entry_commits_at_once() -> None:
    log = PrimaryLog(term=1)
    e = log.append("a", 10)
    assert (e.index, e.term) == (1, 1) and log.committed == 1
    assert not log.entries  # nothing kept: no backup needs it


def test_an_entry_commits_when_every_in_sync_backup_has_it() -> None:
    log = PrimaryLog(term=1, backups=["b", "c"])
    e1, e2 = log.append("x", 1), log.append("y", 1)
    assert log.committed == 0
    assert log.to_send("b") == [e1, e2] and log.to_send("b") == []
    assert log.ack("b", 2) == []  # c has nothing yet
    assert log.ack("c", 1) == [e1] and log.committed == 1
    assert log.ack("c", 1) == []  # acknowledged again: nothing new
    assert log.ack("c", 2) == [e2] and log.committed == 2
    assert not log.entries  # every backup has everything


def test_a_dead_backup_is_not_waited_for() -> None:
    log = PrimaryLog(term=1, backups=["b", "c"])
    e = log.append("x")
    log.ack("b", 1)
    assert log.remove("c") == [e] and log.committed == 1


def test_the_log_is_bounded_and_a_full_one_refuses() -> None:
    log = PrimaryLog(term=1, backups=["b"], max_entries=3, max_bytes=100)
    for _ in range(3):
        log.append("x", 10)
    assert not log.room(1)
    with pytest.raises(Full):
        log.append("x", 10)
    log.ack("b", 1)
    assert log.room(10) and len(log.entries) == 2
    log.append("x", 10)
    log.ack("b", 4)
    assert log.room(1000)  # an empty log takes any one entry
    log2 = PrimaryLog(term=1, backups=["b"], max_entries=10, max_bytes=100)
    log2.append("x", 60)
    assert not log2.room(41) and log2.room(40)


def test_a_backup_applies_in_order_and_refuses_gaps_and_old_terms() -> None:
    r = ReplicaLog(term=1)
    assert r.offer(Entry(2, 1, "b")) is Offer.GAP
    assert r.offer(Entry(1, 1, "a")) is Offer.APPLY
    assert r.offer(Entry(1, 1, "a")) is Offer.DUPLICATE
    assert r.offer(Entry(2, 2, "b")) is Offer.APPLY and r.term == 2
    assert r.offer(Entry(3, 1, "c")) is Offer.STALE  # the replaced primary
    r.fence(5)
    assert r.offer(Entry(3, 4, "c")) is Offer.STALE
    assert r.applied == 2


def test_a_joining_backup_catches_up_then_counts() -> None:
    log = PrimaryLog(term=1, backups=["b"])
    for _ in range(3):
        log.append("x")
    log.join("c", 1)  # its copy is as of index 1 (b has acknowledged nothing: kept)
    assert [e.index for e in log.to_send("c")] == [2, 3]
    log.ack("b", 3)
    assert log.committed == 3  # c not in sync: not waited for
    log.append("y")
    log.ack("b", 4)
    assert log.committed == 4
    log.ack("c", 4)  # caught up: in sync
    assert set(log.in_sync()) == {"b", "c"}
    log.append("z")
    log.ack("b", 5)
    assert log.committed == 4  # now c is waited for
    with pytest.raises(ValueError):
        log.join("d", 0)  # entry 1 is no longer kept


def test_a_joining_backup_too_far_behind_is_dropped() -> None:
    log = PrimaryLog(term=1, backups=["b"], max_entries=4, join_entries=4)
    log.append("x")
    log.join("c", 0)  # a copy as of 0, the head is 1: joining
    log.ack("b", 1)
    for i in range(2, 7):
        log.append("x")
        log.ack("b", i)
    assert log.dropped == ["c"] and "c" not in log.backups
    assert len(log.entries) == 0


def test_choose_primary_takes_the_highest_head() -> None:
    assert choose_primary({"b": 3, "c": 5, "d": 5}) == "c"
    assert choose_primary({}) is None


# ---------------------------------------------------------------- simulation


@dataclass
class Copy:
    name: str
    state: list[str] = field(default_factory=list)  # pushes applied, in index order
    log: PrimaryLog | ReplicaLog | None = None
    alive: bool = True


def simulate(seed: int, copies: int = 3, steps: int = 1500, max_entries: int = 6) -> None:
    """One seeded run: workers push to the primary, messages are lost, resent,
    reordered and duplicated, the primary or a backup dies, a fresh copy joins.
    Checked at every step: every two in-sync copies' states are prefixes of one
    another; the log stays within its bound. At the end: every acknowledged push is
    on every in-sync copy exactly once, and they are identical."""
    rng = random.Random(seed)
    names = (f"c{i}" for i in itertools.count())
    nodes: dict[str, Copy] = {}
    first = Copy(next(names))
    backups = [Copy(next(names)) for _ in range(copies - 1)]
    first.log = PrimaryLog(
        1, backups=[b.name for b in backups], max_entries=max_entries, join_entries=max_entries
    )
    for b in backups:
        b.log = ReplicaLog(1, max_entries=max_entries)
    for c in (first, *backups):
        nodes[c.name] = c
    primary = first.name
    net: list[tuple[str, Any]] = []  # (destination, message)
    acked: set[str] = set()
    waiting: list[str] = []  # pushes sent and not acknowledged
    pushes = 0

    def plog() -> PrimaryLog:
        log = nodes[primary].log
        assert isinstance(log, PrimaryLog)
        return log

    def reply_committed() -> None:
        p = nodes[primary]
        for push in list(waiting):
            if push in p.state and p.state.index(push) + 1 <= plog().committed:
                waiting.remove(push)
                acked.add(push)

    def submit(push: str) -> None:
        p = nodes[primary]
        if push in p.state:  # a resend: answered once committed (dedup)
            return
        if not plog().room(1):
            return  # waits; sent again later
        p.state.append(push)
        plog().append(push, 1)

    def in_sync() -> list[Copy]:
        return [nodes[primary], *(nodes[n] for n in plog().in_sync())]

    for _ in range(steps):
        r = rng.random()
        if r < 0.25:
            pushes += 1
            waiting.append(f"p{pushes}")
            submit(waiting[-1])
        elif r < 0.30 and waiting:
            submit(rng.choice(waiting))  # a worker's resend
        elif r < 0.45:
            for b in list(plog().backups):
                net.extend((b, e) for e in plog().to_send(b))
        elif r < 0.50 and plog().backups:
            plog().resend(rng.choice(list(plog().backups)))  # a timeout
        elif r < 0.85 and net:
            dest, msg = net.pop(rng.randrange(len(net)))  # any order
            if rng.random() < 0.1:
                net.append((dest, msg))  # delivered twice
            if rng.random() < 0.1:
                continue  # lost
            kind, _, to = dest.rpartition(":")
            if kind:  # to a primary: only the current one listens
                if to != primary or msg[-1] != plog().term:
                    continue
                if kind == "ack":
                    plog().ack(msg[0], msg[1])
                elif msg[0] in plog().backups:
                    plog().resend(msg[0])
                continue
            node = nodes[dest]
            if not node.alive or not isinstance(msg, Entry):
                continue
            if isinstance(node.log, PrimaryLog):  # promoted since: the old primary's
                assert msg.term < node.log.term
                continue
            assert isinstance(node.log, ReplicaLog)
            offer = node.log.offer(msg)
            if offer is Offer.APPLY:
                node.state.append(msg.payload)
            if offer in (Offer.APPLY, Offer.DUPLICATE):
                net.append((f"ack:{primary}", (dest, node.log.applied, msg.term)))
            elif offer is Offer.GAP:
                net.append((f"gap:{primary}", (dest, msg.term)))
        elif r < 0.87 and len(in_sync()) > 1:  # the primary dies
            nodes[primary].alive = False
            survivors = {c.name: c for c in in_sync()[1:] if c.alive}
            heads = {}
            for n, c in survivors.items():
                assert isinstance(c.log, ReplicaLog)
                heads[n] = c.log.applied
            new = choose_primary(heads)
            assert new is not None
            term = plog().term + 1
            for c in survivors.values():  # the chief's fence reaches every survivor
                assert isinstance(c.log, ReplicaLog)
                c.log.fence(term)
            log = nodes[new].log
            assert isinstance(log, ReplicaLog)
            nodes[new].log = log.promote(term, {n: h for n, h in heads.items() if n != new})
            nodes[new].log.join_entries = max_entries
            primary = new
            for n, c in nodes.items():  # the rest (joining copies) start again later
                if n not in survivors and n != primary:
                    c.alive = False
        elif r < 0.89 and plog().backups:  # a backup dies
            dead = rng.choice(list(plog().backups))
            nodes[dead].alive = False
            plog().remove(dead)
        elif r < 0.91 and len(plog().backups) < copies - 1:  # a fresh copy joins
            # its copy is as of an index the log still holds: it catches up from there
            log = plog()
            at = rng.randint(log.entries[0].index - 1 if log.entries else log.head, log.head)
            c = Copy(next(names), list(nodes[primary].state[:at]))
            c.log = ReplicaLog(log.term, applied=at, max_entries=max_entries)
            nodes[c.name] = c
            log.join(c.name, at)
        for name in plog().dropped:
            nodes[name].alive = False
        plog().dropped.clear()
        reply_committed()
        # invariants at every step
        assert len(plog().entries) <= max_entries + 1
        states = [c.state for c in in_sync()]
        for a in states:
            for b in states:
                n = min(len(a), len(b))
                assert a[:n] == b[:n]

    # heal: no more faults; resend and deliver until nothing moves
    for _ in range(200):
        for w in list(waiting):
            submit(w)
        for b in list(plog().backups):
            plog().resend(b)
            for e in plog().to_send(b):
                node = nodes[b]
                assert isinstance(node.log, ReplicaLog)
                if node.log.offer(e) is Offer.APPLY:
                    node.state.append(e.payload)
                plog().ack(b, node.log.applied)
        reply_committed()
        if not waiting:
            break
    assert not waiting
    final = in_sync()
    for c in final:
        assert c.state == final[0].state
        assert len(set(c.state)) == len(c.state)  # nothing applied twice
        assert acked <= set(c.state)  # nothing acknowledged lost
    assert acked == {f"p{i}" for i in range(1, pushes + 1)}


@pytest.mark.parametrize("seed", range(60))
def test_simulated_faults_lose_nothing_acknowledged(seed: int) -> None:
    simulate(seed, copies=2 + seed % 2)


# ---------------------------------------------------------------- fail-over plan


def _placement(num_ps: int, replication: int) -> Placement:
    variables = [VariableDef(f"v{i}", (64, 4)) for i in range(5)]
    return plan(variables, num_ps, Partitioner(num_shards=2), "greedy", replication=replication)


@pytest.mark.parametrize("seed", range(40))
def test_fail_over_promotes_the_highest_in_sync_survivor_and_loses_no_live_copy(
    seed: int,
) -> None:
    rng = random.Random(seed)
    num_ps = rng.randint(2, 6)
    replication = rng.randint(2, min(3, num_ps))
    before = _placement(num_ps, replication)
    dead = set(rng.sample(range(num_ps), rng.randint(1, num_ps - 1)))
    heads = {
        s.id: {ps: rng.randint(0, 9) for ps in s.copies if ps not in dead and rng.random() < 0.9}
        for s in before.shards
    }
    out = fail_over(before, dead, heads)
    after = out.placement
    assert after.epoch == before.epoch + 1
    assert [s.id for s in after.shards] == [s.id for s in before.shards]
    for old, new in zip(before.shards, after.shards, strict=True):
        alive = heads[old.id]
        if old.id in out.lost:
            assert old.ps in dead and not alive
            continue
        assert not dead & set(new.copies)  # no copy on a dead PS
        assert set(new.copies) <= set(old.copies)  # nothing moved, only dropped
        assert new.state == old.state  # a shard never changes PS state
        if old.ps in dead:
            assert out.promoted[old.id] == new.ps
            assert alive[new.ps] == max(alive.values())  # the furthest survivor
            assert set(new.backups) == set(alive) - {new.ps}
        else:
            assert new.ps == old.ps and old.id not in out.promoted
            assert set(new.backups) == set(old.backups) - dead
        assert (old.id in out.under_replicated) == (len(new.copies) < replication)
    wire = msgpack.unpackb(msgpack.packb(after.to_wire()))
    PLACEMENT.check(wire, "placement")
    assert Placement.from_wire(wire) == after
    # a second fail-over keeps each shard in its first PS state
    again = fail_over(after, set(), {}).placement
    assert [s.state for s in again.shards] == [s.state for s in before.shards]


def test_a_shard_whose_every_copy_died_is_lost() -> None:
    before = _placement(2, 2)
    out = fail_over(before, {0, 1}, {})
    assert sorted(out.lost) == [s.id for s in before.shards]
    assert not out.promoted


def test_a_backup_keeps_only_what_another_backup_may_lack() -> None:
    r = ReplicaLog(term=1)
    for i in range(1, 6):
        assert r.offer(Entry(i, 1, "x", 10)) is Offer.APPLY
    r.forget(3)  # every in-sync backup has 1..3: only 4 and 5 may be needed
    assert [e.index for e in r.kept] == [4, 5] and r._kept_bytes == 20
    promoted = r.promote(2, {"c": 3})
    assert promoted.backups["c"].acked == 3 and not promoted.dropped
    assert [e.index for e in promoted.to_send("c")] == [4, 5]
    r2 = ReplicaLog(term=1)
    r2.offer(Entry(1, 1, "x", 10))
    r2.forget(1)  # two copies: the primary's only backup keeps nothing
    assert not r2.kept and r2._kept_bytes == 0
    assert not r2.promote(2, {}).entries
