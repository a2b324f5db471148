"""Replicated PS states over the in-memory transport (real codec): the chief's
``Variables`` creates every copy, primaries ship what they apply, backups apply it.

The property: whatever a seeded mix of workers sends (dense pushes and push_pulls,
row pushes and pulls of row-sparse and hash-keyed variables, resent pushes,
non-finite gradients, pushes of fenced incarnations, a switch to sync mode), every
backup holds a state bit-identical to its primary's (values, optimizer slots,
versions, hash-table rows, dedup window, push ledger, sync step) at the moment each
request is answered: nothing a PS acknowledged is missing from any copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
from test_ps_client import DoublePush, run

import zmqps.roles.ps.ring as ring_module
from zmqps.config import ClusterSpec
from zmqps.core.partition import Partitioner
from zmqps.core.replication import fail_over
from zmqps.core.variables import Placement, ShardInfo, VariableDef
from zmqps.roles.chief.variables import Variables
from zmqps.roles.client import Delivery, ParameterClient
from zmqps.roles.configs import ChiefConfig
from zmqps.roles.homes import Homes
from zmqps.roles.ps import PSService
from zmqps.roles.ps.replica import Backup, Primary
from zmqps.roles.ps.slots import MAX_COPIES, PSSlots
from zmqps.transport.base import Requester
from zmqps.transport.fake import FakeNetwork
from zmqps.wire import Message, Tensor, request
from zmqps.wire import ops as o
from zmqps.wire.errors import (
    ConfigError,
    DeadlineExceeded,
    FencedError,
    InvalidArgument,
    NonFiniteGradient,
    NotFound,
    NotPrimary,
    ProtocolError,
    Superseded,
)

W = VariableDef("w", (12, 4), init={"name": "glorot_uniform", "seed": 1})
B = VariableDef("b", (7,), init={"name": "normal", "stddev": 0.5, "seed": 2})
ROWS = VariableDef("e", (30, 3), init={"name": "uniform", "seed": 3}, sparse=True)
TABLE = VariableDef("t", (1 << 20, 2), init={"name": "normal", "seed": 4}, table={"row_budget": 64})
VARIABLES = (W, B, ROWS, TABLE)
ADAM = {"name": "adam", "lr": 0.01}


@pytest.fixture(params=[False, True], ids=["beside", "ring"])
def ring(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Entries' tensors beside their message, or (``ring``) in a ring of shared memory
    from the first entry on (the processes here share a host), in rings small enough
    to fill, wrap and grow."""
    on = bool(request.param)
    if on:
        monkeypatch.setattr(ring_module, "RING_MIN_BYTES", 0)
    return on


def ring_entries(c: Cluster) -> int:
    """Entries the primaries sent through rings."""
    roles = [c.slots[i].role(i) for i in range(len(c.slots))]
    return sum(r.sent for p in roles if isinstance(p, Primary) for r in p.rings.values())


class Cluster:
    """``n`` PS processes (their slots) and a chief's ``Variables`` on one network."""

    def __init__(self, n: int, replication: int, *, lossy: float = 0.0, seed: int = 0) -> None:
        self.net = FakeNetwork()
        self.rng = np.random.default_rng(seed)
        self.lossy = lossy
        #: entries the primaries put on the wire, by op: (count, tensor bytes)
        self.shipped: dict[str, list[int]] = {}
        self.slots: list[PSSlots] = []
        for i in range(n):
            self.slots.append(
                PSSlots(
                    PSService(i),
                    make_copy=lambda p: PSService(p),
                    link=lambda ps, endpoint, slot, i=i: self._link(i, endpoint, slot),
                )
            )
            self.net.serve(f"ps{i}", self.slots[i], name=f"ps{i}")
        cluster = ClusterSpec(
            "127.0.0.1:1", tuple(f"127.0.0.1:{10 + i}" for i in range(n)), ("127.0.0.1:2",)
        )
        cfg = ChiefConfig(
            bind="tcp://127.0.0.1:1",
            cluster=cluster,
            partitioner=Partitioner(num_shards=3),
            replication=replication,
        )
        self.chief = [self.net.client(f"ps{i}", "chief:0") for i in range(n)]
        self.variables = Variables(cfg, self.chief)
        self.placement: Placement | None = None

    def _link(self, own: int, endpoint: str, slot: int) -> Requester:
        link = self.net.client(endpoint, f"ps{own}:ship{slot}", slot=slot, timeout=0.5)
        return Lossy(link, self.rng, self.lossy, self.shipped)

    async def create(self) -> Placement:
        self.placement = await self.variables.create(VARIABLES, ADAM)
        return self.placement

    def worker(self, name: str, inc: int = 0, *, twice: bool = False) -> ParameterClient:
        """A worker's client (``twice``: every push sent twice, as after a lost reply)."""
        assert self.placement is not None
        reqs: list[Requester] = [
            self.net.client(f"ps{i}", f"{name}:{inc}") for i in range(len(self.slots))
        ]
        if twice:
            reqs = [DoublePush(r) for r in reqs]
        return ParameterClient(reqs, self.placement, worker=name, incarnation=inc)

    def copy(self, ps: int, slot: int) -> PSService:
        return self.slots[ps]._slots[slot]

    async def settle(self) -> None:
        """Wait until every request in flight was answered (a push refused by one PS
        raises while the client's pushes to the others are still under way)."""
        for _ in range(500):
            roles = [self.slots[i].role(i) for i in range(len(self.slots))]
            if all(r is None or r.log.committed == r.log.head for r in roles):  # type: ignore[union-attr]
                await asyncio.sleep(0.01)  # their answers reach the client
                return
            await asyncio.sleep(0.01)
        raise AssertionError("requests still in flight after 5 s")

    def check_copies(self) -> int:
        """Every backup's state equals its primary's; returns the copies compared."""
        assert self.placement is not None
        n = 0
        for s in {s.ps: s for s in self.placement.shards}.values():
            primary = state(self.copy(s.ps, s.ps))
            for q in s.backups:
                assert state(self.copy(q, s.ps)) == primary, (s.ps, q)
                n += 1
        return n


def _push_of_w(placement: Placement, seq: int = 1) -> tuple[dict[str, Any], list[Tensor]]:
    """A raw push of ones to ps 0's shards of ``w`` (body and tensors), as worker 0."""
    shards = [s for s in placement.shards if s.ps == 0 and s.var == "w"]
    body = {
        "shards": [s.id for s in shards],
        "versions": [0] * len(shards),
        "worker": "worker:0",
        "inc": 0,
        "seq": seq,
    }
    return body, [Tensor(np.ones(s.rows * 4, np.float32), "grad", s.id) for s in shards]


class Lossy:
    """A primary's link to a backup that loses a share of its requests (the primary
    must send again), and counts the entries sent, by op: ``[count, tensor bytes]``."""

    def __init__(
        self,
        inner: Requester,
        rng: np.random.Generator,
        share: float,
        counts: dict[str, list[int]] | None = None,
    ) -> None:
        self.inner, self.rng, self.share = inner, rng, share
        self.counts = {} if counts is None else counts
        self.endpoint = inner.endpoint

    async def request(
        self,
        op: str,
        body: Mapping[str, Any] | None = None,
        tensors: Sequence[Tensor] = (),
        *,
        timeout: float | None = None,
        attempts: int = 1,
        slot: int | None = None,
    ) -> Message:
        if self.share and self.rng.random() < self.share:
            raise DeadlineExceeded("lost")
        if op == "replicate" and body is not None:
            count = self.counts.setdefault(str(body["op"]), [0, 0])
            count[0] += 1
            count[1] += sum(t.array.nbytes for t in tensors)
        return await self.inner.request(op, body, tensors, timeout=timeout, attempts=attempts)

    async def close(self) -> None:
        await self.inner.close()


def state(svc: PSService) -> Any:
    """Everything a push changes in a PS state, as comparable values."""
    shards = []
    for sh in svc.store:
        sid = sh.definition.id
        if hasattr(sh, "table"):
            ids, values, slots, touched = sh.state()
            shards.append(
                (
                    sid,
                    sh.version,
                    ids.tobytes(),
                    values.tobytes(),
                    touched.tobytes(),
                    {k: v.tobytes() for k, v in sorted(slots.items())},
                )
            )
        else:
            shards.append(
                (
                    sid,
                    sh.version,
                    sh.values.tobytes(),
                    {k: v.tobytes() for k, v in sorted(sh.slots.items())},
                )
            )
    return (
        sorted(shards, key=lambda t: t[0]),
        svc.dedup.snapshot(),
        svc.pushes.snapshot(),
        svc.sync_step,
        svc.mode.name,
        sorted(svc.mode.contributors(every_shard=False)),
    )


async def _workload(c: Cluster, steps: int, seed: int) -> dict[str, int]:
    """Seeded pushes and pulls of three workers; the copies are compared after every
    answer. Returns what happened, by kind."""
    rng = np.random.default_rng(seed)
    workers = {f"worker:{i}": c.worker(f"worker:{i}") for i in range(3)}
    again = c.worker("worker:3", twice=True)
    seen: dict[str, int] = {}
    for cursor in range(1, steps + 1):
        name = list(workers)[int(rng.integers(len(workers)))]
        w = workers[name]
        kind = str(rng.choice(["push", "push_pull", "rows", "table", "nan", "again", "pull"]))
        seen[kind] = seen.get(kind, 0) + 1
        if kind in ("push", "push_pull", "nan"):
            await w.pull()
            grads = {v.name: rng.standard_normal(v.shape).astype(np.float32) for v in (W, B)}
            if kind == "nan":
                grads["w"][int(rng.integers(12)), 0] = np.nan
                with pytest.raises(NonFiniteGradient):
                    await w.push(grads, cursor=cursor)
                await c.settle()
            else:
                await w.push(grads, pull=kind == "push_pull", cursor=cursor)
        elif kind == "rows":
            ids = rng.integers(0, 30, size=5)
            await w.pull_rows("e", ids)
            await w.push_rows("e", ids, rng.standard_normal((5, 3)).astype(np.float32))
        elif kind == "table":
            ids = rng.integers(-(2**40), 2**40, size=int(rng.integers(1, 9)))
            await w.pull_rows("t", ids)
            await w.push_rows("t", ids, rng.standard_normal((ids.size, 2)).astype(np.float32))
        elif kind == "again":  # a push whose reply was lost, sent again: applied once
            await again.pull()
            assert not await again.push({"b": rng.standard_normal(7).astype(np.float32)})
        else:
            await w.pull_rows("t", rng.integers(0, 1000, size=3), create=False)
        assert c.check_copies() > 0
    return seen


@pytest.mark.parametrize("num_ps,replication,seed", [(2, 2, 1), (3, 2, 2), (3, 3, 3), (4, 3, 4)])
def test_every_copy_is_its_primarys_after_every_answer(
    num_ps: int, replication: int, seed: int, ring: bool
) -> None:
    async def body() -> None:
        c = Cluster(num_ps, replication)
        placement = await c.create()
        assert placement.replication == replication
        for s in placement.shards:
            assert len(set(s.copies)) == replication
        assert c.check_copies() == num_ps * (replication - 1)
        seen = await _workload(c, 60, seed)
        assert seen.get("push", 0) and seen.get("table", 0)
        for i in range(num_ps):
            role = c.slots[i].role(i)
            assert isinstance(role, Primary)
            assert role.log.committed == role.log.head > 0
        assert (ring_entries(c) > 0) == ring

    run(body(), 30.0)


def test_copies_follow_sync_mode_and_fences() -> None:
    async def body() -> None:
        c = Cluster(3, 2)
        await c.create()
        for ch in c.chief:
            await ch.request("sync_config", {"mode": "sync", "required": 2})
        a, b = c.worker("worker:0"), c.worker("worker:1")
        for step in range(3):
            for w in (a, b):
                await w.pull()
                g = {"w": np.full((12, 4), step + 1.0, np.float32), "b": np.ones(7, np.float32)}
                await w.push(g, step=step)
                ids = np.array([step, 2 * step + 1], np.int64)
                for var, width in (("e", 3), ("t", 2)):
                    await w.push_rows(var, ids, np.ones((2, width), np.float32), step=step)
                c.check_copies()
        held = [(q, p) for p in range(3) for q in range(3) if p in c.slots[q].slots()]
        assert len(held) == 6
        assert {c.copy(q, p).sync_step for q, p in held} == {3}
        # worker 0 restarts: its old incarnation is fenced on every copy
        for ch in c.chief:
            await ch.request("fence", {"worker": "worker:0", "inc": 1})
        c.check_copies()
        with pytest.raises(FencedError):
            await a.push({"w": np.ones((12, 4), np.float32)}, step=3)
        c.check_copies()

    run(body(), 30.0)


def test_sync_steps_ship_once_after_aggregation_not_every_gradient() -> None:
    """Sync, N = 3 workers pushing at once: a primary ships each step's pushes in one
    entry with the sum the step applied, not every worker's gradient (the bytes its
    backups receive are a third of the gradients pushed), answers each push once its
    step is on the backup, and every copy ends equal, at the same step."""

    async def body() -> None:
        c = Cluster(2, 2)
        placement = await c.create()
        for ch in c.chief:
            await ch.request("sync_config", {"mode": "sync", "required": 3})
        workers = [c.worker(f"worker:{i}") for i in range(3)]
        rng = np.random.default_rng(7)
        steps = 4

        async def step(w: ParameterClient, k: int) -> None:
            await w.pull()
            grads = {v.name: rng.standard_normal(v.shape).astype(np.float32) for v in (W, B)}
            assert await w.push(grads, step=k)

        for k in range(steps):
            await asyncio.gather(*(step(w, k) for w in workers))
            c.check_copies()
        await c.settle()
        assert "push" not in c.shipped, c.shipped
        entries, nbytes = c.shipped["sync_step"]
        pushed = steps * len(workers) * 4 * (12 * 4 + 7)  # every gradient, every PS
        assert nbytes * 3 == pushed, (nbytes, pushed)  # one sum a step, not three
        assert entries == steps * len({s.ps for s in placement.shards})
        for s in placement.shards:  # the shards pushed made every step, on both copies
            if s.var in ("w", "b"):
                for q in (s.ps, *s.backups):
                    assert c.copy(q, s.ps).mode.shards.step_of(s.id) == steps  # type: ignore[attr-defined]

    run(body(), 30.0)


def test_lost_entries_are_sent_again(ring: bool) -> None:
    """A link that loses a third of the entries and their answers: the primary sends
    again (gaps, timeouts) and every answer still waits for the backup."""

    async def body() -> None:
        c = Cluster(3, 2, lossy=0.3, seed=5)
        await c.create()
        seen = await _workload(c, 30, 6)
        assert sum(seen.values()) == 30
        assert sum(c.slots[i].role(i).resent for i in range(3)) > 0  # type: ignore[union-attr]
        assert (ring_entries(c) > 0) == ring

    run(body(), 60.0)


def test_only_pulls_of_hash_keyed_rows_are_shipped_to_the_backups() -> None:
    """A pull of a fixed-size row-sparse variable changes nothing (its rows exist and
    carry no stamps): it is answered like a dense pull, with no entry and no wait for
    the backups. A pull of a hash-keyed table creates, sights and stamps rows: it is
    shipped, and the copies stay equal."""

    async def body() -> None:
        c = Cluster(3, 2)
        await c.create()
        w = c.worker("worker:0")
        heads = [c.slots[i].role(i).log.head for i in range(3)]  # type: ignore[union-attr]
        for k in range(5):
            await w.pull_rows("e", np.arange(k, 30, 4))
        assert "pull_rows" not in c.shipped, c.shipped
        assert [c.slots[i].role(i).log.head for i in range(3)] == heads  # type: ignore[union-attr]
        await w.pull_rows("t", np.array([7, -(2**40), 11]))
        assert c.shipped["pull_rows"][0] >= 1
        await c.settle()
        c.check_copies()

    run(body(), 30.0)


def test_a_pushs_values_are_read_once_for_every_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The finite check reads a push's gradients once, on the primary, before it ships:
    its backups apply it without reading them again. A push with a NaN is read by
    every copy, and every copy refuses it alike (the copies stay equal)."""
    import zmqps.roles.ps.service as service_module

    reads: list[int] = []
    real = service_module.first_bad_of

    def counted(arrays: Any, parts: Any = None) -> Any:
        reads.append(len(arrays))
        return real(arrays, parts)

    monkeypatch.setattr(service_module, "first_bad_of", counted)

    async def body() -> None:
        c = Cluster(2, 2)
        placement = await c.create()
        w = c.worker("worker:0")
        await w.pull()
        reads.clear()
        g = {"w": np.ones((12, 4), np.float32), "b": np.ones(7, np.float32)}
        assert await w.push(g)
        await c.settle()
        states = {s.state for s in placement.shards if s.var in ("w", "b")}
        assert len(reads) == len(states), reads  # one read per state pushed to, not two
        c.check_copies()
        reads.clear()
        g["w"][3, 1] = np.nan
        with pytest.raises(NonFiniteGradient):
            await w.push(g)
        await c.settle()
        # the state holding w[3] read it on the primary, found it bad, then read it on
        # the primary's apply and on its backup: each refused it
        assert len(reads) >= 3, reads
        c.check_copies()

    run(body(), 30.0)


def test_a_backup_refuses_what_only_its_primary_may_serve() -> None:
    async def body() -> None:
        c = Cluster(2, 2)
        placement = await c.create()
        s = placement.shards[0]
        backup = s.backups[0]
        to_copy = c.net.client(f"ps{backup}", "worker:0:0", slot=s.ps)
        with pytest.raises(NotPrimary, match="not its primary"):
            await to_copy.request("pull", {"shards": [s.id]})
        fence = {"term": 1, "index": 99, "op": "fence", "body": {"worker": "w", "inc": 0}}
        # an entry for a state this process is the primary of: refused
        with pytest.raises(NotPrimary):
            await c.net.client(f"ps{s.ps}", "x", slot=s.ps).request("replicate", fence)
        # an entry of an op that changes nothing, or with a bad inner body: refused
        with pytest.raises(ProtocolError, match="not an op"):
            await to_copy.request("replicate", {**fence, "op": "status", "body": {}})
        with pytest.raises(ProtocolError, match=r"replicate.body.body: missing field 'shards'"):
            await to_copy.request("replicate", {**fence, "op": "push"})
        # a sync step entry is checked whole: each push it carries is a push
        step = {**fence, "op": "sync_step", "body": {"pushes": [["fence", {}, False]], "data": []}}
        with pytest.raises(ProtocolError, match=r"pushes\[0\]: 'fence' is not a push"):
            await to_copy.request("replicate", step)
        step["body"] = {"pushes": [["push", {"worker": "w"}, False]], "data": []}
        with pytest.raises(ProtocolError, match=r"pushes\[0\]\.body: missing field"):
            await to_copy.request("replicate", step)
        with pytest.raises(ProtocolError):  # never a request of its own
            await to_copy.request("sync_step", {"pushes": [], "data": []})
        # an entry of an older term (a replaced primary): refused
        await c.chief[backup].request("replica", {"slot": s.ps, "term": 5, "primary": False})
        with pytest.raises(FencedError, match="term 1"):
            await to_copy.request("replicate", fence)
        c.check_copies()

    run(body())


def test_a_silent_backup_holds_pushes_until_the_chief_drops_it() -> None:
    async def body() -> None:
        c = Cluster(2, 2)
        placement = await c.create()
        backup_of_0 = next(s.backups[0] for s in placement.shards if s.ps == 0)
        c.net.remove(f"ps{backup_of_0}")  # the backup is gone: nothing answers
        body, grads = _push_of_w(placement)
        to_ps0 = c.net.client("ps0", "worker:0:0", timeout=10.0)
        push = asyncio.ensure_future(to_ps0.request("push", body, grads))
        await asyncio.sleep(0.3)
        assert not push.done()
        role = c.slots[0].role(0)
        assert isinstance(role, Primary) and role.log.head > role.log.committed
        # the chief drops the backup: the push is answered at once
        await c.chief[0].request("replica", {"slot": 0, "term": 1, "primary": True})
        c.net.serve(f"ps{backup_of_0}", c.slots[backup_of_0])
        await asyncio.wait_for(push, 5.0)
        assert role.log.committed == role.log.head and role.backups() == []

    run(body(), 20.0)


def test_replication_needs_a_ps_per_copy() -> None:
    cluster = ClusterSpec("127.0.0.1:1", ("127.0.0.1:10", "127.0.0.1:11"), ("127.0.0.1:2",))
    with pytest.raises(ConfigError, match="replication 3 needs at least 3 PS"):
        ChiefConfig(bind="tcp://127.0.0.1:1", cluster=cluster, replication=3)


def test_a_promoted_copy_goes_on_from_its_head_and_loses_nothing_acknowledged(
    ring: bool,
) -> None:
    """Three copies of each state; the process serving state 0 dies with every push
    answered. Its copies are fenced at term 2, the furthest is promoted with the other
    as its backup, the workers' links follow the new placement: training goes on, and
    the surviving copies hold every push that was acknowledged, then stay equal."""

    async def body() -> None:
        c = Cluster(3, 3)
        placement = await c.create()
        await _workload(c, 25, 11)
        acknowledged = state(c.copy(0, 0))
        c.net.remove("ps0")  # process 0 dies (every request was answered)
        survivors = [q for q in placement.shards_of("w")[0].backups]
        heads = {}
        for q in survivors:
            rep = await c.chief[q].request("replica", {"slot": 0, "term": 2, "primary": False})
            heads[q] = rep.body["applied"]
            assert state(c.copy(q, 0)) == acknowledged
        out = fail_over(placement, {0}, {s.id: heads for s in placement.shards if s.ps == 0})
        new = out.placement
        (primary,) = {s.ps for s in new.shards if s.state == 0}
        (other,) = set(survivors) - {primary}
        await c.chief[primary].request(
            "replica",
            {
                "slot": 0,
                "term": 2,
                "primary": True,
                "backups": [[other, f"ps{other}"]],
                "applied": [heads[other]],
            },
        )
        for p in (1, 2):  # the primaries it backed up stop waiting for it
            primary_of = {s.state: s for s in placement.shards}[p]
            keep = [[q, f"ps{q}"] for q in primary_of.backups if q != 0]
            await c.chief[p].request(
                "replica", {"slot": p, "term": 1, "primary": True, "backups": keep}
            )
        # a worker whose links follow the placement's homes
        homes = Homes([c.net.client(f"ps{i}", "worker:9:0") for i in range(3)])
        homes.update(new)
        w = ParameterClient(homes.links(), placement, worker="worker:9", incarnation=0)
        rng = np.random.default_rng(3)
        for _ in range(5):
            await w.pull()
            await w.push({"w": rng.standard_normal((12, 4)).astype(np.float32)})
            ids = rng.integers(-(2**40), 2**40, size=4)
            await w.push_rows("t", ids, rng.standard_normal((4, 2)).astype(np.float32))
            assert state(c.copy(primary, 0)) == state(c.copy(other, 0))
        role = c.slots[primary].role(0)
        assert isinstance(role, Primary) and role.term == 2 and role.backups() == [other]
        # the replaced primary's entries (term 1) are refused by the copies
        stale = {"term": 1, "index": 10**6, "op": "fence", "body": {"worker": "w", "inc": 0}}
        with pytest.raises(NotPrimary):  # the promoted one serves, it takes no entries
            await c.net.client(f"ps{primary}", "x", slot=0).request("replicate", stale)
        with pytest.raises(FencedError):
            await c.net.client(f"ps{other}", "x", slot=0).request("replicate", stale)

    run(body(), 30.0)


def test_a_replaced_primary_acknowledges_nothing_more() -> None:
    """The chief promoted a copy while the old primary was cut off: the first entry the
    old primary ships is refused (an older term); what waited is answered
    ``not_primary`` (not acknowledged: sent again to the new primary), and so is
    every later request that would change the state."""

    async def body() -> None:
        c = Cluster(2, 2)
        placement = await c.create()
        backup = next(s.backups[0] for s in placement.shards if s.ps == 0)
        await c.chief[backup].request("replica", {"slot": 0, "term": 2, "primary": False})
        body, grads = _push_of_w(placement)
        to_ps0 = c.net.client("ps0", "worker:0:0", timeout=10.0)
        with pytest.raises(NotPrimary, match="newer primary"):
            await to_ps0.request("push", body, grads)
        role = c.slots[0].role(0)
        assert isinstance(role, Primary) and role.fenced and role.log.committed == 0
        with pytest.raises(NotPrimary, match="newer primary"):
            await to_ps0.request("push", {**body, "seq": 2}, grads)
        assert role.log.head == 1  # the second was refused before it was applied

    run(body(), 20.0)


def test_a_primary_replaced_by_its_own_backup_stops_at_once() -> None:
    """The old primary was stopped past the heartbeat timeout, and its backup promoted
    (term 2, no backups of its own): the old primary's next entry reaches a primary of
    a newer term, which refuses it as ``superseded``. The old primary stops there and
    answers ``not_primary`` at once, instead of sending the entry again until the
    push's deadline (seen: a stopped PS held pushes for a minute after SIGCONT)."""

    async def body() -> None:
        c = Cluster(2, 2)
        placement = await c.create()
        backup = next(s.backups[0] for s in placement.shards if s.ps == 0)
        await c.chief[backup].request("replica", {"slot": 0, "term": 2, "primary": False})
        await c.chief[backup].request(
            "replica", {"slot": 0, "term": 2, "primary": True, "backups": [], "applied": []}
        )
        push, grads = _push_of_w(placement)
        to_ps0 = c.net.client("ps0", "worker:0:0", timeout=10.0)
        started = asyncio.get_running_loop().time()
        with pytest.raises(NotPrimary, match="newer primary"):
            await to_ps0.request("push", push, grads)
        assert asyncio.get_running_loop().time() - started < 5.0  # not the push's deadline
        role = c.slots[0].role(0)
        assert isinstance(role, Primary) and role.fenced and role.log.committed == 0
        # the promoted copy took nothing from the old primary
        promoted = c.slots[backup].role(0)
        assert isinstance(promoted, Primary) and promoted.log.head == 0
        stale = {"term": 1, "index": 1, "op": "fence", "body": {"worker": "w", "inc": 0}}
        with pytest.raises(Superseded, match="a primary since replaced"):
            await c.net.client(f"ps{backup}", "x", slot=0).request("replicate", stale)

    run(body(), 20.0)


def test_a_fenced_primary_told_to_stand_alone_at_a_newer_term_serves_again() -> None:
    """Every process was taken for dead at once (a heartbeat timeout too low for the
    load): the fail-over fenced the copies at term 2, found none left, and takes the
    copies down for a restore. A primary fenced meanwhile is told it is the only copy
    at term 2: it serves again (the restore's requests reach it; they crashed the chief
    with ``not_primary``), from the same entry on. Named backups at a newer term are
    still refused: a backup joins with a copy."""

    async def body() -> None:
        c = Cluster(2, 2)
        placement = await c.create()
        await _workload(c, 6, 3)
        backup = next(s.backups[0] for s in placement.shards if s.ps == 0)
        await c.chief[backup].request("replica", {"slot": 0, "term": 2, "primary": False})
        old = c.slots[0].role(0)
        assert isinstance(old, Primary)
        w = c.worker("worker:7")
        await w.pull()
        with pytest.raises(NotPrimary):  # its entry refused at term 2: it is fenced
            await w.push({"w": np.ones((12, 4), np.float32)})
        assert old.fenced
        again = {"slot": 0, "term": 2, "primary": True}
        with pytest.raises(InvalidArgument, match="replicated already"):
            await c.chief[0].request("replica", {**again, "backups": [[backup, f"ps{backup}"]]})
        await c.chief[0].request("replica", again)
        role = c.slots[0].role(0)
        assert isinstance(role, Primary) and role is not old and not role.fenced
        assert role.term == 2 and role.log.head == old.log.head and role.backups() == []
        await w.push({"w": np.ones((12, 4), np.float32)})
        assert role.log.head == old.log.head + 1 == role.log.committed

    run(body(), 20.0)


def test_replica_requests_cannot_make_copies_without_end() -> None:
    async def body() -> None:
        c = Cluster(2, 2)
        await c.create()
        assert c.slots[0].slots() == [0, 1]  # its own state and a copy of ps 1's
        make = {"term": 1, "primary": False, "make": True}
        # a fence (no ``make``) of a state the process holds no copy of makes none
        with pytest.raises(NotFound, match="holds no copy of ps 2's state"):
            await c.chief[0].request("replica", {"slot": 2, "term": 1, "primary": False})
        assert c.slots[0].slots() == [0, 1]
        for slot in range(2, 1 + MAX_COPIES):
            await c.chief[0].request("replica", {"slot": slot, **make})
        with pytest.raises(InvalidArgument, match="copies of other PS's states already"):
            await c.chief[0].request("replica", {"slot": 10_000, **make})
        assert len(c.slots[0].slots()) == MAX_COPIES + 1

    run(body(), 30.0)


def test_a_stray_replica_request_cannot_demote_the_only_copy_of_a_state() -> None:
    """Without replication a PS's own state is the only copy: a ``replica`` request
    making it a backup of itself (a stray or hostile one) is refused, and pulls and
    pushes go on being served; a restarted, empty PS may still be made a backup."""

    async def body() -> None:
        c = Cluster(2, 1)
        placement = await c.create()
        before = state(c.copy(0, 0))
        with pytest.raises(InvalidArgument, match="cannot become a backup"):
            await c.chief[0].request("replica", {"slot": 0, "term": 1, "primary": False})
        assert c.slots[0].role(0) is None and state(c.copy(0, 0)) == before
        await c.worker("worker:0").pull()
        body, grads = _push_of_w(placement)
        out = await c.net.client("ps0", "worker:0:0").request("push", body, grads)
        assert out.body["applied"]
        fresh = PSSlots(PSService(0))  # a restarted PS, restored from nothing yet
        fresh._op_replica(
            request("replica", {"slot": 0, "term": 2, "primary": False, "make": True})
        )
        assert fresh.role(0) is not None

    run(body(), 30.0)


async def _join(c: Cluster, slot: int, target: int, rate: float | None = None) -> dict[str, Any]:
    """The chief's part of bringing ``target`` in as a backup of state ``slot``: an
    empty copy there, then the primary's ``join``; returns the join's final state."""
    term = c.slots[slot].role(slot).term  # type: ignore[union-attr]
    await c.chief[target].request(
        "replica", {"slot": slot, "term": term, "primary": False, "make": True}
    )
    body = {"slot": slot, "term": term, "ps": target, "endpoint": f"ps{target}"}
    if rate is not None:
        body["rate"] = rate
    rep = await c.chief[slot].request("join", body)
    assert rep.body["at"] >= 0
    for _ in range(1000):
        st = await c.chief[slot].request("status", slot=slot)
        join = st.body["replica"]["joins"][str(target)]
        if join["state"] == "in sync" or join["state"].startswith("failed"):
            return dict(join)
        await asyncio.sleep(0.01)
    raise AssertionError(f"join still {join}")


@pytest.mark.parametrize("sync", [False, True])
def test_a_joining_copy_catches_up_while_training_goes_on_and_ends_equal(
    sync: bool, ring: bool
) -> None:
    """Re-replication: state 0 gets a third copy on a PS that held none, in small
    throttled parts, while seeded pushes go on (dense, rows, hash-table rows, sync
    accumulation half way through a step). Once it is in sync the new copy is
    bit-identical to the primary (values, slots, versions, table layout, ledgers,
    accumulators), commits wait for it, and it stays equal."""

    async def body() -> None:
        c = Cluster(4, 2)
        placement = await c.create()
        if sync:
            for ch in c.chief:
                await ch.request("sync_config", {"mode": "sync", "required": 3})
        target = next(q for q in range(4) if q not in placement.shards_of("w")[0].copies)
        assert {s.state for s in placement.shards if s.ps == 0} == {0}
        workers = [c.worker(f"worker:{i}") for i in range(3)]
        rng = np.random.default_rng(5)

        async def pushes(n: int, who: int = 0, step: int | None = None) -> None:
            w = workers[who]
            for k in range(n):
                await w.pull()
                g = {v.name: rng.standard_normal(v.shape).astype(np.float32) for v in (W, B)}
                await w.push(g, cursor=k + 1, step=step)
                ids = rng.integers(-(2**40), 2**40, size=6)
                await w.pull_rows("t", ids)
                rows = rng.standard_normal((6, 2)).astype(np.float32)
                await w.push_rows("t", ids, rows, step=step)

        import zmqps.roles.ps.image as image

        image.PART_BYTES, before = 256, image.PART_BYTES  # many parts
        try:
            if sync:  # two of three gradients of step 0 wait in the accumulators
                await pushes(1, 0, 0)
                training = asyncio.ensure_future(pushes(1, 1, 0))
            else:
                await pushes(5)
                training = asyncio.ensure_future(pushes(15))
            join = await _join(c, 0, target, rate=20_000.0)
            await training
        finally:
            image.PART_BYTES = before
        assert join["state"] == "in sync", join
        assert join["parts"] > 1 and join["sent"] == join["parts"]
        await c.settle()
        assert state(c.copy(target, 0)) == state(c.copy(0, 0))
        role = c.slots[0].role(0)
        assert isinstance(role, Primary) and target in role.backups()
        assert str(target) in role.log.in_sync()
        await pushes(1, 2, 0 if sync else None)  # sync: the third gradient makes the step
        await c.settle()
        assert state(c.copy(target, 0)) == state(c.copy(0, 0))
        if sync:  # the step of the shards pushed was applied, on both copies alike
            assert c.copy(target, 0).mode.status()["steps_applied"] > 0

    run(body(), 30.0)


def test_a_backup_that_lost_its_ring_gets_the_entries_beside_and_a_new_ring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backup whose ring is gone (a new process there, or one that never took it)
    refuses an entry sent in it; the primary sends it again beside its message, offers
    a new ring, and nothing is lost: the copies stay equal. An entry naming another
    ring than the one the backup maps is refused the same way (a ring replaced while
    entries were in flight is never read for another)."""
    monkeypatch.setattr(ring_module, "RING_MIN_BYTES", 0)

    async def body() -> None:
        c = Cluster(2, 2)
        await c.create()
        await _workload(c, 6, 31)
        await c.settle()
        primary = c.slots[0].role(0)
        backup = c.slots[1].role(0)
        assert isinstance(primary, Primary) and isinstance(backup, Backup)
        assert primary.rings[1].region is not None and backup.ring is not None
        first = backup.ring.name
        backup.close()  # the mapping is gone
        await _workload(c, 10, 32)
        await c.settle()
        c.check_copies()
        assert primary.resent > 0
        assert backup.ring is not None and backup.ring.name != first
        assert primary.rings[1].attempts == 2 and primary.rings[1].off is None

    run(body(), 30.0)


def test_a_ring_too_small_for_an_entry_is_replaced_once_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first ring is sized for the entry that made it; a larger entry goes beside
    its message and a larger ring is offered once no entry sent in the first is
    unanswered. The copies stay equal throughout."""
    monkeypatch.setattr(ring_module, "RING_MIN_BYTES", 0)
    monkeypatch.setattr(ring_module, "RING_ENTRIES", 1)

    async def body() -> None:
        c = Cluster(2, 2)
        placement = await c.create()
        state_of = next(s.state for s in placement.shards if s.var == "e" and s.row_start == 0)
        w = c.worker("worker:0")
        one = np.ones((1, 3), np.float32)
        await w.push_rows("e", np.array([0]), one)  # a small entry makes a small ring
        await c.settle()
        await w.push_rows("e", np.array([1]), one)
        await c.settle()
        primary = c.slots[state_of].role(state_of)
        assert isinstance(primary, Primary)
        ((_b, link),) = primary.rings.items()
        assert link.region is not None
        small = link.region.size
        for k in range(4):
            await w.push_rows("e", np.arange(10), np.full((10, 3), k, np.float32))
            await c.settle()
        assert link.region is not None and link.region.size > small
        assert link.attempts == 2 and link.sent >= 3
        c.check_copies()

    run(body(), 30.0)


def test_hostile_ring_entries_are_refused_and_change_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Entries whose ring specs do not fit (outside the ring, misaligned, a dtype or
    kind not allowed, a shape past the ring, another ring's name, tensors both in the
    ring and beside) and rings that cannot be mapped (a name of the wrong form, a size
    past the bound, no such region) are refused with a clear error; the backup's copy
    stays as it was and goes on following its primary."""
    monkeypatch.setattr(ring_module, "RING_MIN_BYTES", 0)

    async def body() -> None:
        c = Cluster(2, 2)
        placement = await c.create()
        await _workload(c, 6, 41)
        await c.settle()
        backup = c.slots[1].role(0)
        primary = c.slots[0].role(0)
        assert isinstance(backup, Backup) and isinstance(primary, Primary)
        assert backup.ring is not None
        ring = backup.ring
        before = state(c.copy(1, 0))
        link = c.net.client("ps1", "attacker", slot=0)
        s = next(s for s in placement.shards if s.state == 0 and s.var == "b")
        push = {"shards": [s.id], "versions": [0], "worker": "worker:7", "inc": 0, "seq": 1}
        entry = {"term": primary.term, "index": backup.log.applied + 1, "op": "push", "body": push}
        good = ["float32", [s.rows], "grad", s.id, 0, 0]
        cases: list[tuple[dict[str, Any], list[Tensor], type[Exception]]] = [
            (
                {**entry, "ring_name": ring.name, "ring": [[*good[:5], ring.size]]},
                [],
                InvalidArgument,
            ),
            ({**entry, "ring_name": ring.name, "ring": [[*good[:5], 2]]}, [], InvalidArgument),
            ({**entry, "ring_name": ring.name, "ring": [["object", *good[1:]]]}, [], ProtocolError),
            (
                {**entry, "ring_name": ring.name, "ring": [[*good[:2], "weird", *good[3:]]]},
                [],
                ProtocolError,
            ),
            (
                {**entry, "ring_name": ring.name, "ring": [[good[0], [1 << 40], *good[2:]]]},
                [],
                ProtocolError,
            ),
            ({**entry, "ring_name": "zmqps-" + "f" * 32, "ring": [good]}, [], NotFound),
            (
                {**entry, "ring_name": ring.name, "ring": [good]},
                [Tensor(np.ones(s.rows, np.float32), "grad", s.id)],
                InvalidArgument,
            ),
        ]
        for i, (req, tensors, error) in enumerate(cases):
            with pytest.raises(error):
                await link.request("replicate", req, tensors)
            assert state(c.copy(1, 0)) == before, i
            assert backup.log.applied == entry["index"] - 1, i
        for req in (
            {"term": primary.term, "name": "../etc/passwd", "size": 1 << 20},
            {"term": primary.term, "name": ring.name, "size": 1 << 40},
            {"term": primary.term, "name": "zmqps-" + "e" * 32, "size": 1 << 20},
        ):
            with pytest.raises((InvalidArgument, NotFound)):
                await link.request("replica_ring", req)
            assert backup.ring is ring
        with pytest.raises(FencedError):  # a ring of an older term
            await link.request("replica_ring", {"term": 0, "name": ring.name, "size": ring.size})
        await _workload(c, 4, 42)  # the copy goes on following its primary
        await c.settle()
        assert c.check_copies() > 0

    run(body(), 30.0)


def test_hostile_install_parts_are_refused_and_change_nothing() -> None:
    """Parts of a copy that do not fit (an unknown shard, a chunk out of place, a shape
    past the machine's memory, a part out of order, a last part without ledgers) are
    refused with a clear error; the backup's copy stays as it was, and it goes on
    taking its primary's entries."""

    async def body() -> None:
        c = Cluster(3, 2)
        placement = await c.create()
        await _workload(c, 8, 21)
        s = next(s for s in placement.shards if s.state == 0)
        q = s.backups[0]
        before = state(c.copy(q, 0))
        d = c.copy(0, 0).store.get(s.id).definition
        link = c.net.client(f"ps{q}", "attacker", slot=0)
        term = c.slots[0].role(0).term  # type: ignore[union-attr]
        first = {"term": term, "index": 1, "part": 0, "last": False, "defs": [d.to_wire()]}
        good = [s.id, "values", 0, "float32", list(d.shape)]
        cases = [
            ({**first, "items": [[99999, "values", 0, "float32", [2]]]}, [np.zeros(2, np.float32)]),
            ({**first, "items": [[*good[:2], 10**9, *good[3:]]]}, [np.zeros(2, np.float32)]),
            ({**first, "items": [[*good[:4], [1 << 40, 1 << 20]]]}, [np.zeros(2, np.float32)]),
            ({**first, "part": 3, "items": []}, []),
            ({**first, "last": True, "items": []}, []),
        ]
        for i, (req, arrays) in enumerate(cases):
            tensors = [Tensor(a, "value", s.id, 0) for a in arrays]
            with pytest.raises(InvalidArgument):
                await link.request("install", req, tensors)
            assert state(c.copy(q, 0)) == before, i
        await _workload(c, 4, 22)  # the copy goes on following its primary
        await c.settle()
        assert c.check_copies() > 0

    run(body(), 30.0)


def test_a_step_is_told_only_once_every_backup_has_it() -> None:
    """Sync, one gradient a step, state 0's backup silent: the pushes that complete step
    0 are applied on the primary but not committed. ``wait_step`` and ``ps_state`` still
    say step 0 (the chief must not go on to a step a fail-over would undo); once the
    backup has them, step 1 is told, and a waiter for it is woken."""

    async def body() -> None:
        c = Cluster(2, 2)
        placement = await c.create()
        for ch in c.chief:
            await ch.request("sync_config", {"mode": "sync", "required": 1})
        w = c.worker("worker:0")
        await w.pull()
        backup_of_0 = next(s.backups[0] for s in placement.shards if s.ps == 0)
        c.net.remove(f"ps{backup_of_0}")
        ids = np.arange(3)
        rows = np.ones((3, 2), np.float32)
        grads = {v.name: np.ones(v.shape, np.float32) for v in (W, B)}
        pushes = asyncio.gather(
            w.push(grads, step=0),
            w.push_rows("e", ids, np.ones((3, 3), np.float32), step=0),
            w.push_rows("t", ids, rows, step=0),
        )
        svc = c.copy(0, 0)
        for _ in range(100):
            if svc.mode.step == 1:
                break
            await asyncio.sleep(0.01)
        assert svc.mode.step == 1 and svc.visible_step == 0
        assert not pushes.done()
        # the metrics' view: the oldest update waits, the silent backup lags behind
        lag = c.slots[0].replication_stats()[0]
        assert lag["primary"] and lag["lag_seconds"] > 0 and lag["lag_entries"][backup_of_0] > 0
        rep = await c.chief[0].request("wait_step", {"step": 1, "wait": 0.0})
        assert rep.body["step"] == 0
        assert (await c.chief[0].request("ps_state")).body["step"] == 0
        waiter = asyncio.ensure_future(c.chief[0].request("wait_step", {"step": 1, "wait": 5.0}))
        c.net.serve(f"ps{backup_of_0}", c.slots[backup_of_0])  # the backup answers again
        # the primary sends the entries again (its ship timeout): step 1 is told
        assert (await asyncio.wait_for(waiter, 8.0)).body["step"] == 1
        assert svc.visible_step == 1
        assert c.slots[0].replication_stats()[0]["lag_seconds"] == 0.0
        role = c.slots[0].role(0)
        assert isinstance(role, Primary) and role.log.committed == role.log.head
        pushes.cancel()
        with contextlib.suppress(BaseException):
            await pushes

    run(body(), 20.0)


def test_a_push_whose_state_moved_is_sent_again_and_applied_once() -> None:
    """Sync: the process serving state 1 dies before it answers a push. The push is
    sent again once the state's copy is promoted: the same messages with the same
    sequence numbers, and only to the state that did not answer. Every state applies
    the worker's gradient of the step once; a message
    whose reply was lost, sent again, is answered as a duplicate and changes nothing."""

    async def body() -> None:
        c = Cluster(3, 2)
        placement = await c.create()
        for ch in c.chief:
            await ch.request("sync_config", {"mode": "sync", "required": 1})
        homes = Homes([c.net.client(f"ps{i}", "worker:9:0", timeout=1.0) for i in range(3)])
        w = ParameterClient(homes.links(), placement, worker="worker:9", incarnation=0, timeout=1.0)
        await w.pull()
        grads = {v.name: np.ones(v.shape, np.float32) for v in (W, B)}
        states = sorted({s.state for s in placement.shards if s.var in ("w", "b")})
        assert 1 in states and len(states) > 1
        # process 1 dies; the primaries it backed up stop waiting for it (the chief)
        c.net.remove("ps1")
        home = {s.state: s for s in placement.shards}
        for p in (0, 2):
            keep = [[q, f"ps{q}"] for q in home[p].backups if q != 1]
            await c.chief[p].request(
                "replica", {"slot": p, "term": 1, "primary": True, "backups": keep}
            )
        delivery = Delivery()
        with pytest.raises(DeadlineExceeded):
            await w.push(grads, step=0, delivery=delivery)
        assert {ps for ps, _ in delivery.answered} == set(states) - {1}
        seqs = dict(delivery.seqs)
        # the chief promotes state 1's copy; the worker hears of the new placement
        (q,) = home[1].backups
        rep = await c.chief[q].request("replica", {"slot": 1, "term": 2, "primary": False})
        await c.chief[q].request(
            "replica", {"slot": 1, "term": 2, "primary": True, "backups": [], "applied": []}
        )
        heads = {s.id: {q: rep.body["applied"]} for s in placement.shards if s.ps == 1}
        homes.update(fail_over(placement, {1}, heads).placement)
        w.moved([1])
        assert await w.push(grads, step=0, delivery=delivery) is True
        assert delivery.seqs == seqs  # nothing numbered anew
        for p in states:
            svc = c.copy(homes.of[p], p)
            assert svc.pushes.snapshot()["worker:9"]["applied"] == 1, p
        # the reply from state 0 was lost: sent again, a duplicate, nothing applied
        lost = next(k for k in delivery.answered if k[0] == states[0])
        del delivery.answered[lost]
        first = c.copy(homes.of[states[0]], states[0])
        before = state(first)[:2]  # values, optimizer slots, versions; dedup window
        assert await w.push(grads, step=0, delivery=delivery) is False
        assert state(first)[:2] == before
        assert first.pushes.snapshot()["worker:9"]["dropped"] == {"duplicate": 1}
        assert delivery.seqs == seqs

    run(body(), 30.0)


class Answering:
    """A link to a backup that has every entry it is sent: sent before ``submit``
    returns, as by the ZeroMQ client (``fail_first``: its first send fails, as on a
    closed socket)."""

    def __init__(self, events: list[tuple[str, int]], fail_first: bool = False) -> None:
        self.events = events
        self.fail_first = fail_first

    def submit(
        self,
        op: str,
        body: Mapping[str, Any] | None = None,
        tensors: Sequence[Tensor] = (),
        **_: Any,
    ) -> asyncio.Future[Message]:
        if self.fail_first:
            self.fail_first = False
            raise RuntimeError("socket closed")
        assert op == "replicate" and body is not None
        entry = o.Replicate.from_wire(body)
        self.events.append(("shipped", entry.index))
        answer: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        answer.set_result(Message(op, 0, "backup", o.Replicated(entry.index).to_wire(), ()))
        return answer

    async def request(self, *_: Any, **__: Any) -> Message:
        raise AssertionError("entries go out with submit")

    async def close(self) -> None:
        pass


def test_a_primary_ships_each_entry_before_it_applies_it() -> None:
    """The backups apply a request while the primary does: it is on the wire before
    the primary's handler runs, for back-to-back requests too. A refusal that changes
    nothing is answered at once (the backup refuses it as well)."""

    async def main() -> None:
        events: list[tuple[str, int]] = []
        primary = Primary(0, 1, {1: Answering(events)})  # type: ignore[dict-item]

        def handler(msg: Message) -> Message:
            events.append(("applied", msg.id))
            if msg.body["bad"]:
                raise InvalidArgument("refused, nothing changed")
            return msg

        async def committed(index: int) -> None:
            for _ in range(100):
                if primary.log.committed >= index:
                    return
                await asyncio.sleep(0)
            raise AssertionError(f"entry {index} not committed")

        for i in (1, 2, 3, 4):
            msg = Message("push", i, "w", {"bad": i == 3}, ())
            if i == 3:
                with pytest.raises(InvalidArgument):
                    await primary.run(msg, handler)
                await committed(3)  # its answer was not waited for
            else:
                assert await primary.run(msg, handler) is msg
        assert events == [(what, i) for i in (1, 2, 3, 4) for what in ("shipped", "applied")]
        assert primary.log.committed == primary.log.head == 4
        await primary.close()

    run(main())


def test_an_entry_whose_send_fails_is_applied_and_sent_again() -> None:
    """A send that fails does not keep the primary from applying the request (its
    backups would otherwise hold an update it lacks): the entry goes again."""

    async def main() -> None:
        events: list[tuple[str, int]] = []
        primary = Primary(0, 1, {1: Answering(events, fail_first=True)})  # type: ignore[dict-item]

        def handler(msg: Message) -> Message:
            events.append(("applied", msg.id))
            return msg

        msg = Message("push", 1, "w", {}, ())
        assert await primary.run(msg, handler) is msg
        assert events == [("applied", 1), ("shipped", 1)]
        assert primary.log.committed == 1 and primary.resent == 1
        await primary.close()

    run(main())


@pytest.mark.parametrize("copies", [2, 3])
def test_a_backup_keeps_only_the_entries_another_copy_may_lack(copies: int, ring: bool) -> None:
    """A backup keeps the entries a promotion may have to send to the other backups:
    those after the last one every in-sync backup applied (the primary says which,
    with each entry). With two copies there is no other backup, so it keeps none of
    the gradients it applied (they held a whole log's worth of memory, 1 GiB); with
    three it keeps at most the batch in flight."""

    async def body() -> None:
        c = Cluster(3, copies)
        await c.create()
        w = c.worker("worker:0")
        rng = np.random.default_rng(3)
        for k in range(20):
            await w.pull()
            grads = {v.name: rng.standard_normal(v.shape).astype(np.float32) for v in (W, B)}
            assert await w.push(grads, step=k)
        await c.settle()
        kept = {}
        for ps in range(3):
            for slot in range(3):
                role = c.slots[ps].role(slot)
                if isinstance(role, Backup):
                    assert role.log.applied >= 20
                    kept[ps, slot] = [e.index for e in role.log.kept]
        assert len(kept) == 3 * (copies - 1)
        # each entry says what was committed before it: the last one or two are kept
        # (the pushes came one at a time), not the 20 applied
        assert all(len(k) <= 2 for k in kept.values()), kept
        c.check_copies()

    run(body(), 30.0)


def test_a_ps_keeps_the_newest_placement_the_chief_published() -> None:
    """``placement``: the newest one a process heard is kept (an older one sent late
    changes nothing) and reported in ``ps_state``, roles or none; a body that is not
    a placement is refused and changes nothing."""
    slots = PSSlots(PSService(0))
    w = VariableDef("w", (4, 2))

    def placement(epoch: int, backups: tuple[int, ...]) -> dict[str, Any]:
        shards = (ShardInfo(0, "w", 0, 0, 4, 1, backups=backups),)
        return Placement((w,), shards, epoch=epoch).to_wire()

    def tell(p: Mapping[str, Any]) -> Any:
        return slots(request("placement", o.PlacementNote(p).to_wire(), id=1))

    def newest() -> Any:
        rep = slots(request("ps_state", {}, id=2))
        assert isinstance(rep, Message)
        return rep.body.get("newest")

    assert newest() is None
    tell(placement(5, (2,)))
    assert newest()["epoch"] == 5 and newest()["backups"] == [[2]]
    tell(placement(3, (0,)))  # older: late
    assert newest()["epoch"] == 5 and newest()["backups"] == [[2]]
    tell(placement(6, ()))  # the backup dropped
    assert newest()["epoch"] == 6 and "backups" not in newest()
    assert slots.epoch == 6
    bad = placement(9, (2,))
    bad["backups"] = [[2], [1]]  # two backup lists for one shard
    with pytest.raises(InvalidArgument):
        tell(bad)
    assert newest()["epoch"] == 6


class Refusing(Answering):
    """A link to a process that refuses every entry (it holds no copy of the state)."""

    def submit(
        self,
        op: str,
        body: Mapping[str, Any] | None = None,
        tensors: Sequence[Tensor] = (),
        **_: Any,
    ) -> asyncio.Future[Message]:
        self.events.append(("refused", o.Replicate.from_wire(body or {}).index))
        answer: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        answer.set_exception(NotPrimary("ps 1 holds no copy of ps 0's state"))
        return answer


def test_a_backup_that_takes_no_entry_is_said_in_the_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A backup whose entries keep failing holds every commit of the state: its
    primary sends them again, and says so in its log (it was at debug level only,
    and a sync run stood still with nothing said)."""
    import zmqps.roles.ps.replica as replica

    monkeypatch.setattr(replica, "FAILING_REPORT_S", 0.1)

    async def main() -> None:
        events: list[tuple[str, int]] = []
        primary = Primary(0, 1, {1: Refusing(events)})  # type: ignore[dict-item]
        held = asyncio.ensure_future(primary.run(Message("push", 1, "w", {}, ()), lambda m: m))
        await asyncio.sleep(0.4)
        assert not held.done() and primary.log.committed == 0
        assert len([e for e in events if e[0] == "refused"]) > 2  # sent again and again
        primary.drop(1)  # the chief drops it: the push is acknowledged
        await asyncio.wait_for(held, 2.0)
        await primary.close()

    with caplog.at_level(logging.WARNING, logger="zmqps.ps"):
        run(main())
    said = [r.getMessage() for r in caplog.records if "has taken no entry" in r.getMessage()]
    assert said and "backup ps 1" in said[0] and "holds no copy" in said[0], said
    assert len(said) <= 4  # every FAILING_REPORT_S, not every attempt
