"""``push_pull_rows``: a step's row push and the next batch's pull in one message.

Against two requests (``push_rows``, then ``pull_rows``) under seeded random sequences
(ids repeated within a batch, ids new to a hash-keyed table, several shards on several
PS, optimizers with slots), byte for byte: the rows read, every shard's values, slots
and version, the client's versions. A hostile message is refused whole and changes
nothing; one sent twice is applied once; a PS that does not say it takes the op gets
the two requests; a replicated state's backups end equal to its primary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
from test_ps_client import ALL, EMB, DoublePush, Recorder, make_cluster, recorders, run
from test_ps_recovery import created_cluster
from test_ps_replication import Cluster as ReplicatedCluster

from zmqps.core.partition import Partitioner, plan
from zmqps.core.replication import fail_over
from zmqps.core.variables import VariableDef
from zmqps.roles.channels import Delivery
from zmqps.roles.client import ParameterClient
from zmqps.roles.homes import Homes
from zmqps.roles.ps import PSService
from zmqps.wire import Message, Tensor
from zmqps.wire.errors import InvalidArgument, NonFiniteGradient, NotFound, ProtocolError

ADAM = {"name": "adam", "lr": 0.05}
SGD = {"name": "sgd", "lr": 0.1}


def shard_state(services: Sequence[PSService]) -> tuple[list[Any], list[Any]]:
    """Every shard's version, values and slots (a hash table's ids and rows too), and
    every PS's push ledger: what a push or a pull may change."""
    shards: list[Any] = []
    for svc in services:
        for sh in svc.store:
            if hasattr(sh, "table"):
                ids, values, slots, touched = sh.state()
                rows: tuple[bytes, ...] = (ids.tobytes(), values.tobytes(), touched.tobytes())
            else:
                rows, slots = (sh.values.tobytes(),), sh.slots
            kept = {k: v.tobytes() for k, v in sorted(slots.items())}
            shards.append((svc.index, sh.definition.id, sh.version, rows, kept))
    return shards, [svc.pushes.snapshot() for svc in services]


def batches(rng: np.random.Generator, rows: int, size: int, steps: int) -> list[np.ndarray]:
    """Seeded batches: repeated ids, a batch of one id, an empty one, the last row."""
    out = []
    for k in range(steps):
        n = 0 if k == 5 else 1 if k == 3 else int(rng.integers(1, size + 1))
        ids = rng.integers(0, rows, n)
        if n > 2:
            ids[: n // 3] = ids[0]  # a run of one id
            ids[-1] = rows - 1
        out.append(ids.astype(np.int64))
    return out


async def two_requests(
    client: ParameterClient, name: str, seq: Sequence[np.ndarray], grads: Sequence[np.ndarray]
) -> list[np.ndarray]:
    """The reference: each step a push_rows of the last batch, then a pull_rows."""
    got = [await client.pull_rows(name, seq[0])]
    for k in range(1, len(seq)):
        assert await client.push_rows(name, seq[k - 1], grads[k - 1])
        got.append(await client.pull_rows(name, seq[k]))
    return got


async def one_request(
    client: ParameterClient, name: str, seq: Sequence[np.ndarray], grads: Sequence[np.ndarray]
) -> list[np.ndarray]:
    got = [await client.pull_rows(name, seq[0])]
    for k in range(1, len(seq)):
        applied, rows = await client.push_pull_rows(name, seq[k - 1], grads[k - 1], seq[k])
        assert applied
        got.append(rows)
    return got


def sent_ops(client: ParameterClient) -> list[str]:
    return [op for r in recorders(client) for op, _, _ in r.sent]


@pytest.mark.parametrize("num_ps,num_shards", [(1, 1), (1, 4), (2, 3), (3, 7)])
@pytest.mark.parametrize("optimizer", [SGD, ADAM], ids=["sgd", "adam"])
@pytest.mark.parametrize("seed", [0, 1])
def test_push_pull_rows_is_push_rows_then_pull_rows(
    num_ps: int, num_shards: int, optimizer: Mapping[str, Any], seed: int
) -> None:
    async def body() -> None:
        rng = np.random.default_rng(seed)
        seq = batches(rng, EMB.shape[0], 12, 10)
        grads = [rng.standard_normal((ids.size, 3)).astype(np.float32) for ids in seq]
        a = await make_cluster(ALL, num_ps, num_shards, optimizer=optimizer)
        b = await make_cluster(ALL, num_ps, num_shards, optimizer=optimizer)
        ca, cb = a.client(), b.client(wrap=Recorder)
        want = await two_requests(ca, "emb", seq, grads)
        got = await one_request(cb, "emb", seq, grads)
        for w, g in zip(want, got, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w)
        assert shard_state(b.services) == shard_state(a.services)
        assert cb.versions == ca.versions and cb.version_gens == ca.version_gens
        ops = sent_ops(cb)
        # one message a step to each PS (a push_rows to one with nothing to pull)
        assert ops.count("push_pull_rows") >= len(seq) - 3

    run(body(), 20.0)


@pytest.mark.parametrize("budget", [None, 6])
@pytest.mark.parametrize("seed", [0, 3])
def test_a_hash_keyed_table_on_several_ps(budget: int | None, seed: int) -> None:
    """Ids new to the table every step (created by the pull after the push), a row
    budget small enough to evict: the same table as with two requests."""
    table: dict[str, Any] = {} if budget is None else {"row_budget": budget}
    emb = VariableDef("h", (64, 2), optimizer=ADAM, table=table)
    placement = plan([emb], 3, Partitioner(num_shards=5), optimizer=SGD)

    async def body() -> None:
        rng = np.random.default_rng(seed)
        seq = []
        for k in range(10):
            ids = rng.integers(-(2**62), 2**62, 7)
            ids[:2] = [7, 7]  # a repeated id seen every step
            ids[2] = k  # and one new every step
            seq.append(ids.astype(np.int64))
        grads = [rng.standard_normal((ids.size, 2)).astype(np.float32) for ids in seq]
        a = await created_cluster(placement, 3, None)
        b = await created_cluster(placement, 3, None)
        ca, cb = a.client("w0"), b.client("w0")
        want = await two_requests(ca, "h", seq, grads)
        got = await one_request(cb, "h", seq, grads)
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(g, w)
        assert shard_state(b.services) == shard_state(a.services)
        assert cb.versions == ca.versions
        assert cb.rows_both == {0, 1, 2}

    run(body(), 20.0)


def test_a_push_sent_twice_is_applied_once_and_its_pull_still_answers() -> None:
    async def body() -> None:
        rng = np.random.default_rng(5)
        seq = batches(rng, EMB.shape[0], 9, 6)
        grads = [rng.standard_normal((ids.size, 3)).astype(np.float32) for ids in seq]
        a = await make_cluster(ALL, 2, 3)
        b = await make_cluster(ALL, 2, 3)
        ca, cb = a.client(), b.client(wrap=DoublePush)
        want = await two_requests(ca, "emb", seq, grads)
        got = [await cb.pull_rows("emb", seq[0])]
        for k in range(1, len(seq)):
            applied, rows = await cb.push_pull_rows("emb", seq[k - 1], grads[k - 1], seq[k])
            assert applied is False or seq[k - 1].size == 0  # the second: a duplicate
            got.append(rows)
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(g, w)
        assert shard_state(b.services)[0] == shard_state(a.services)[0]
        pushes = [op for op in sent_ops(cb) if op.startswith("push")]
        assert "push_pull_rows" in pushes  # (a push_rows where nothing was to pull)
        assert sum(svc.duplicates for svc in b.services) == len(pushes) // 2

    run(body(), 20.0)


def test_an_answered_message_is_not_sent_again_and_its_rows_stand() -> None:
    """A push_pull_rows to two PS whose second message failed is sent again with its
    Delivery: the answered one is skipped (its rows kept), the other applied once."""

    async def body() -> None:
        c = await make_cluster(ALL, 2, 4)
        client = c.client(wrap=Recorder)
        ids = np.arange(23, dtype=np.int64)
        await client.pull_rows("emb", ids)
        grads = np.ones((23, 3), np.float32)
        delivery = Delivery()
        applied, first = await client.push_pull_rows("emb", ids, grads, ids, delivery=delivery)
        assert applied
        before = shard_state(c.services)
        sent = len(sent_ops(client))
        # sent again whole: every message was answered, nothing goes out
        applied, again = await client.push_pull_rows("emb", ids, grads, ids, delivery=delivery)
        assert applied and len(sent_ops(client)) == sent
        np.testing.assert_array_equal(again, first)
        assert shard_state(c.services) == before
        # one answer lost: that message alone is sent again, a duplicate
        lost = next(iter(delivery.answered))
        del delivery.answered[lost]
        delivery.pulled[1].discard(lost[0])
        applied, third = await client.push_pull_rows("emb", ids, grads, ids, delivery=delivery)
        assert applied is False  # the PS had applied it: answered as a duplicate
        assert sent_ops(client)[sent:] == ["push_pull_rows"]
        np.testing.assert_array_equal(third, first)
        assert shard_state(c.services)[0] == before[0]
        assert sum(svc.duplicates for svc in c.services) == 1

    run(body(), 20.0)


class OlderPS(Recorder):
    """A PS of before ``push_pull_rows``: its replies say nothing of what it takes."""

    async def request(
        self,
        op: str,
        body: Mapping[str, Any] | None = None,
        tensors: Sequence[Tensor] = (),
        *,
        timeout: float | None = None,
        attempts: int = 1,
    ) -> Message:
        assert op != "push_pull_rows", "sent to a PS that did not say it takes it"
        rep = await super().request(op, body, tensors, timeout=timeout, attempts=attempts)
        kept = {k: v for k, v in rep.body.items() if k != "takes"}
        return Message(rep.op, rep.id, rep.sender, kept, rep.tensors)


def test_a_ps_that_does_not_say_it_takes_the_op_gets_two_requests() -> None:
    async def body() -> None:
        rng = np.random.default_rng(2)
        seq = batches(rng, EMB.shape[0], 10, 6)
        grads = [rng.standard_normal((ids.size, 3)).astype(np.float32) for ids in seq]
        a = await make_cluster(ALL, 2, 3)
        b = await make_cluster(ALL, 2, 3)
        ca, cb = a.client(), b.client(wrap=OlderPS)
        want = await two_requests(ca, "emb", seq, grads)
        got = await one_request(cb, "emb", seq, grads)
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(g, w)
        assert shard_state(b.services) == shard_state(a.services)
        assert not cb.rows_both
        # a client that has heard from no PS yet sends the two requests as well
        fresh = b.client("w1", wrap=Recorder)
        ids = np.array([1, 2], np.int64)
        await fresh.push_pull_rows("emb", ids, np.zeros((2, 3), np.float32), ids)
        assert "push_pull_rows" not in sent_ops(fresh)
        # and a PS that said so, then moved (a fail-over), must say it again
        await fresh.pull_rows("emb", ids)
        assert fresh.rows_both
        fresh.moved(list(fresh.rows_both))
        assert not fresh.rows_both

    run(body(), 20.0)


# ---------------------------------------------------------------- hostile messages


def _message(
    shard: Any,
    push_ids: Any,
    rows: Any,
    pull_ids: Any,
    *,
    seq: int = 1,
    pull_shard: int | None = None,
    **extra: Any,
) -> tuple[dict[str, Any], list[Tensor]]:
    sid = shard.id
    body = {
        "shards": [sid],
        "versions": [0],
        "worker": "rogue",
        "inc": 0,
        "seq": seq,
        "pull": [sid if pull_shard is None else pull_shard],
        **extra,
    }
    tensors = [
        Tensor(np.asarray(push_ids), "index", sid),
        Tensor(np.asarray(rows), "rows", sid),
        Tensor(np.asarray(pull_ids), "index", sid if pull_shard is None else pull_shard),
    ]
    return body, tensors


def test_hostile_messages_are_refused_whole_and_change_nothing() -> None:
    async def body() -> None:
        c = await make_cluster(ALL, 1, 2)
        shard = sorted(c.placement.shards_of("emb"), key=lambda s: s.row_start)[0]
        other = sorted(c.placement.shards_of("emb"), key=lambda s: s.row_start)[1]
        lo, hi = shard.row_start, shard.row_start + shard.rows
        ps = c.net.client("ps0", "rogue:0")
        ok_ids = np.array([lo, hi - 1], np.int64)
        ok_rows = np.ones((2, 3), np.float32)
        before = shard_state(c.services)
        bad: list[tuple[type[Exception], str, dict[str, Any], list[Tensor]]] = []

        def case(exc: type[Exception], match: str, b: dict[str, Any], t: list[Tensor]) -> None:
            bad.append((exc, match, b, t))

        case(InvalidArgument, "row index outside", *_message(shard, ok_ids, ok_rows, [hi]))
        case(InvalidArgument, "row index outside", *_message(shard, ok_ids, ok_rows, [-1]))
        case(InvalidArgument, "outside", *_message(shard, [hi], ok_rows[:1], ok_ids))
        case(
            NonFiniteGradient,
            "nothing was applied",
            *_message(shard, ok_ids, ok_rows * np.nan, ok_ids),
        )
        inf = ok_rows.copy()
        inf[1, 2] = np.inf
        case(NonFiniteGradient, "", *_message(shard, ok_ids, inf, ok_ids))
        case(
            InvalidArgument, "float64", *_message(shard, ok_ids, ok_rows.astype(np.float64), ok_ids)
        )
        case(InvalidArgument, "", *_message(shard, ok_ids, np.ones((2, 4), np.float32), ok_ids))
        case(InvalidArgument, "", *_message(shard, ok_ids, np.ones((3, 3), np.float32), ok_ids))
        case(InvalidArgument, "integer", *_message(shard, ok_ids, ok_rows, np.array([0.5])))
        case(NotFound, "", *_message(shard, ok_ids, ok_rows, ok_ids, pull_shard=999))
        b, t = _message(shard, ok_ids, ok_rows, ok_ids)
        case(InvalidArgument, "index tensor", b, [*t[:2], Tensor(t[2].array, "rows", shard.id)])
        case(InvalidArgument, "index tensor", b, [*t[:2], Tensor(t[2].array, "index", other.id)])
        case(InvalidArgument, "", b, t[:2])  # no pull tensor
        case(InvalidArgument, "", b, [*t, t[2]])  # one too many
        b2 = dict(b, pull=[shard.id, other.id])
        case(InvalidArgument, "", b2, t)  # a pulled shard without its ids
        case(ProtocolError, "", dict(b, stray=1), t)  # a field no PS knows
        for exc, match, b, t in bad:
            with pytest.raises(exc, match=match or None):
                await ps.request("push_pull_rows", b, t)
            assert shard_state(c.services)[0] == before[0], (exc, match)
        # the sequence number was consumed by none but the non-finite ones (their batch
        # is done, as for push_rows): a good message is applied, and reads its update
        b, t = _message(shard, ok_ids, ok_rows, ok_ids, seq=5)
        rep = await ps.request("push_pull_rows", b, t)
        assert rep.body["applied"] is True and rep.body["pulled"] == [1]
        assert rep.tensors[0].kind == "rows" and rep.tensors[0].ref == shard.id
        np.testing.assert_array_equal(
            rep.tensors[0].array, c.services[0].store.get(shard.id).values[[0, shard.rows - 1]]
        )

    run(body(), 20.0)


def test_a_pull_a_hash_table_would_refuse_refuses_the_push_too() -> None:
    """A pull naming more new ids than the row budget: refused before the push is
    applied (no row created, no version moved)."""
    emb = VariableDef("h", (64, 2), table={"row_budget": 4})
    placement = plan([emb], 1, Partitioner(num_shards=1), optimizer=SGD)

    async def body() -> None:
        c = await created_cluster(placement, 1, None)
        client = c.client("w0")
        await client.pull_rows("h", np.array([1, 2], np.int64))
        before = shard_state(c.services)
        with pytest.raises(InvalidArgument, match="row budget"):
            await client.push_pull_rows(
                "h",
                np.array([1, 2], np.int64),
                np.ones((2, 2), np.float32),
                np.arange(100, 110, dtype=np.int64),
            )
        assert shard_state(c.services)[0] == before[0]

    run(body(), 20.0)


# ---------------------------------------------------------------- replication


async def replicated_rows(
    seed: int,
) -> tuple[ReplicatedCluster, ParameterClient, np.random.Generator, dict[str, Any], dict[str, int]]:
    """A replicated cluster (3 PS, 2 copies) with a row-sparse table ``e`` and a
    hash-keyed table ``t``, a worker whose requests are recorded, a seeded generator,
    a batch of ids of each table and each table's row width."""
    c = ReplicatedCluster(3, 2)
    await c.create()
    w = c.worker("worker:0")
    w.ps = [Recorder(r) for r in w.ps]
    rng = np.random.default_rng(seed)
    ids = {"e": rng.integers(0, 30, 6), "t": rng.integers(-(2**40), 2**40, 5)}
    return c, w, rng, ids, {"e": 3, "t": 2}


def test_a_replicated_states_backups_get_the_same_update() -> None:
    """Through a replicated primary a push_pull_rows is its push_rows and its
    pull_rows entries: after every answer each backup equals its primary, and the
    rows are those of two requests on an unreplicated cluster."""

    async def body() -> None:
        c, w, rng, ids, width = await replicated_rows(9)
        for name in ids:
            await w.pull_rows(name, ids[name])
        for _ in range(6):
            for name in ids:
                nxt = ids[name].copy()
                nxt[: nxt.size // 2] = (
                    rng.integers(0, 30, nxt.size // 2)
                    if name == "e"
                    else rng.integers(-(2**40), 2**40, nxt.size // 2)
                )
                g = rng.standard_normal((ids[name].size, width[name])).astype(np.float32)
                applied, rows = await w.push_pull_rows(name, ids[name], g, nxt)
                assert applied and rows.shape == (nxt.size, width[name])
                ids[name] = nxt
                assert c.check_copies() > 0
        assert "push_pull_rows" in [op for r in w.ps for op, _, _ in r.sent]  # type: ignore[attr-defined]
        assert "push_pull_rows" not in c.shipped and c.shipped["push_rows"][0] > 0
        # a bad one: refused on every copy, nothing applied anywhere
        bad = np.full((ids["e"].size, 3), np.nan, np.float32)
        with pytest.raises(NonFiniteGradient):
            await w.push_pull_rows("e", ids["e"], bad, ids["e"])
        await c.settle()
        assert c.check_copies() > 0

    run(body(), 30.0)


def test_a_push_pull_rows_resent_after_a_fail_over_is_applied_once() -> None:
    """The process serving a state dies after its push_pull_rows was applied and
    shipped, before the worker read the answer. Sent again with its Delivery to the
    promoted copy (which has not said it takes the op: a push_rows then a pull_rows),
    the push is a duplicate there and the rows come; every state applied it once."""

    async def body() -> None:
        c = ReplicatedCluster(3, 2)
        placement = await c.create()
        homes = Homes([c.net.client(f"ps{i}", "worker:9:0", timeout=1.0) for i in range(3)])
        w = ParameterClient(homes.links(), placement, worker="worker:9", incarnation=0, timeout=1.0)
        ids = np.arange(30, dtype=np.int64)
        await w.pull_rows("e", ids)
        states = sorted({s.state for s in placement.shards_of("e")})
        assert 1 in states and w.rows_both == {0, 1, 2}
        g = np.ones((30, 3), np.float32)
        delivery = Delivery()
        applied, first = await w.push_pull_rows("e", ids, g, ids, delivery=delivery)
        assert applied
        await c.settle()
        seqs = dict(delivery.seqs)
        # process 1 dies; the primaries it backed up stop waiting for it (the chief)
        c.net.remove("ps1")
        home = {s.state: s for s in placement.shards}
        for p in (0, 2):
            keep = [[q, f"ps{q}"] for q in home[p].backups if q != 1]
            await c.chief[p].request(
                "replica", {"slot": p, "term": 1, "primary": True, "backups": keep}
            )
        (q,) = home[1].backups
        rep = await c.chief[q].request("replica", {"slot": 1, "term": 2, "primary": False})
        await c.chief[q].request(
            "replica", {"slot": 1, "term": 2, "primary": True, "backups": [], "applied": []}
        )
        heads = {s.id: {q: rep.body["applied"]} for s in placement.shards if s.ps == 1}
        homes.update(fail_over(placement, {1}, heads).placement)
        w.moved([1])
        # the answer of state 1 was lost: sent again, its rows read anew
        lost = next(k for k in delivery.answered if k[0] == 1)
        del delivery.answered[lost]
        delivery.pulled[1].discard(1)
        applied, again = await w.push_pull_rows("e", ids, g, ids, delivery=delivery)
        assert applied is False  # a duplicate where it was applied already
        assert delivery.seqs == seqs  # nothing numbered anew
        np.testing.assert_array_equal(again, first)
        promoted = c.copy(q, 1)
        assert promoted.pushes.snapshot()["worker:9"]["applied"] == 1
        assert promoted.pushes.snapshot()["worker:9"]["dropped"] == {"duplicate": 1}
        for p in (0, 2):
            assert c.copy(p, p).pushes.snapshot()["worker:9"]["applied"] == 1
        assert w.rows_both == {0, 1, 2}  # the promoted copy said it takes it

    run(body(), 30.0)
