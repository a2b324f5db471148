"""Packs: a PS state's small dense shards moved and updated as one buffer, with every
shard's optimizer state, version and staleness what it would be shard by shard."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ps_client import Cluster, Recorder, grads_for, make_cluster, run

from zmqps.core.optimizers import make_optimizer
from zmqps.core.packs import PACK_BYTES, PACK_SHARD_BYTES, packable, plan_packs, split, units
from zmqps.core.partition import Partitioner, plan
from zmqps.core.store import PackUpdate, Shard, ShardStore
from zmqps.core.variables import ShardDef, VariableDef
from zmqps.roles.ps import PSService
from zmqps.transport.fake import FakeNetwork
from zmqps.wire import Tensor, request
from zmqps.wire.errors import InvalidArgument, NonFiniteGradient, RolledBack

OPTIMIZERS = [
    {"name": "sgd", "lr": 0.1},
    {"name": "sgd", "lr": 0.1, "weight_decay": 0.01},
    {"name": "momentum", "lr": 0.05, "momentum": 0.9},
    {"name": "adagrad", "lr": 0.1},
    {"name": "adam", "lr": 0.01},
    {"name": "ftrl", "lr": 0.1, "l1": 0.001, "l2": 0.001},
]


def small_vars(n: int = 12, seed: int = 0) -> list[VariableDef]:
    shapes = [(3,), (4, 5), (16,), (2, 2, 2), (7, 3), (1,)]
    return [
        VariableDef(f"v{i:02d}", shapes[i % len(shapes)], init={"name": "normal", "seed": seed + i})
        for i in range(n)
    ]


def defs_of(variables: Sequence[VariableDef], optimizer: Mapping[str, Any]) -> list[ShardDef]:
    placement = plan(variables, 1, Partitioner(), optimizer=optimizer)
    return [d for _, d in placement.shard_defs()]


# ---------------------------------------------------------------- planning


def _def(sid: int, shape: tuple[int, ...], **kw: Any) -> ShardDef:
    opt = kw.pop("optimizer", {"name": "sgd", "lr": 0.1})
    dtype = kw.pop("dtype", "float32")
    return ShardDef(sid, f"v{sid}", 0, dtype, shape, 0, shape[0], {"name": "zeros"}, opt, **kw)


def test_what_is_packed_and_with_what() -> None:
    adam = {"name": "adam", "lr": 0.01}
    big_rows = PACK_SHARD_BYTES // 4 + 1
    defs = [
        _def(0, (4,)),
        _def(1, (8,), optimizer=adam),
        _def(2, (5, 2)),
        _def(3, (big_rows,)),  # larger than a packed shard
        _def(4, (6,), dtype="float64"),  # another dtype
        _def(5, (6,), wire="bfloat16"),  # travels narrower
        _def(6, (9, 2), sparse=True),  # rows
        _def(7, (3,), optimizer=adam),
        _def(8, (2,)),
    ]
    assert packable(defs[0]) and not any(packable(defs[i]) for i in (3, 4, 5, 6))
    # one pack per optimizer configuration, ids ascending; the same in any order
    assert plan_packs(defs) == [(0, 2, 8), (1, 7)]
    assert plan_packs(reversed(defs)) == plan_packs(defs)
    # the same configuration written in another key order is the same configuration
    same = [_def(10, (4,)), _def(11, (4,), optimizer={"lr": 0.1, "name": "sgd"})]
    assert plan_packs(same) == [(10, 11)]
    # a shard alone is no pack
    assert plan_packs([_def(0, (4,)), _def(1, (4,), optimizer=adam)]) == []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, PACK_SHARD_BYTES // 4 + 64),
            st.sampled_from(["sgd", "adam"]),
            st.sampled_from(["float32", "float32", "float16"]),
        ),
        max_size=80,
    )
)
def test_packs_keep_their_bounds(shards: list[tuple[int, str, str]]) -> None:
    defs = [
        _def(i, (n,), optimizer={"name": opt, "lr": 0.1}, dtype=dt)
        for i, (n, opt, dt) in enumerate(shards)
    ]
    packs = plan_packs(defs)
    seen: set[int] = set()
    for ids in packs:
        members = [defs[i] for i in ids]
        assert len(ids) >= 2 and list(ids) == sorted(ids)
        assert all(packable(d) for d in members)
        assert len({d.optimizer["name"] for d in members}) == 1
        assert sum(d.nbytes for d in members) <= PACK_BYTES
        assert not seen & set(ids)
        seen |= set(ids)


def test_split_and_units() -> None:
    flat = np.arange(10, dtype=np.float32)
    parts = split(flat, [3, 0, 7], "push")
    assert [p.tolist() for p in parts] == [[0, 1, 2], [], list(range(3, 10))]
    assert all(np.shares_memory(p, flat) for p in parts if p.size)
    with pytest.raises(InvalidArgument, match="9 elements for shards of 10"):
        split(flat[:9], [3, 7], "push")
    assert units([5, 6, 7, 8, 9], [2, 2]) == ([[5, 6], [7, 8]], [9])
    with pytest.raises(InvalidArgument, match="packs of 6 shards in a message of 5"):
        units([5, 6, 7, 8, 9], [2, 4])


# ---------------------------------------------------------------- the store


def _stores(optimizer: Mapping[str, Any]) -> tuple[ShardStore, ShardStore, list[ShardDef]]:
    defs = defs_of(small_vars(), optimizer)
    packed = ShardStore()
    packed.create(defs)
    alone = ShardStore()
    for d in defs:  # created one at a time: no pack
        alone.create([d])
    assert len(packed.packs()) == 1 and not alone.packs()
    return packed, alone, defs


def _same(a: ShardStore, b: ShardStore) -> None:
    assert a.versions() == b.versions()
    for sa in a:
        sb = b.get(sa.definition.id)
        np.testing.assert_array_equal(sa.values, sb.values)
        assert set(sa.slots) == set(sb.slots)
        for k in sa.slots:
            np.testing.assert_array_equal(sa.slots[k], sb.slots[k])


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: "-".join(map(str, o.values())))
def test_a_pack_updated_whole_is_bit_identical_to_its_shards_one_by_one(
    optimizer: Mapping[str, Any],
) -> None:
    packed, alone, _ = _stores(optimizer)
    (pack,) = packed.packs()
    rng = np.random.default_rng(7)
    for step in range(6):
        grad = rng.standard_normal(pack.size).astype(np.float32)
        if step == 2:  # a push of some members only: the versions part
            some = pack.ids[::3]
            for store in (packed, alone):
                for sid in some:
                    k = pack.ids.index(sid)
                    g = grad[pack.bounds[k] : pack.bounds[k + 1]]
                    store.apply(store.plan_dense(sid, [(0, g)], store.get(sid).version))
            _same(packed, alone)
            continue
        versions = pack.versions()
        update = packed.plan_pack(pack, grad, versions)
        assert isinstance(update, PackUpdate) and update.staleness == [0] * len(versions)
        results = packed.apply_all([update])
        expected = []
        for k, sid in enumerate(pack.ids):
            g = grad[pack.bounds[k] : pack.bounds[k + 1]]
            expected.append(alone.apply(alone.plan_dense(sid, [(0, g)], versions[k])))
        assert results == expected
        _same(packed, alone)
    # each member is a view of the pack's buffers, slots included
    for m in pack.members:
        assert np.shares_memory(m.values, pack.buf)
        for k, slot in m.slots.items():
            assert np.shares_memory(slot, pack.slots[k])
    assert packed.updates_applied == alone.updates_applied


def test_stale_versions_are_counted_per_member_and_refused_past_the_current() -> None:
    packed, _, _ = _stores({"name": "sgd", "lr": 0.1})
    (pack,) = packed.packs()
    zero = np.zeros(pack.size, np.float32)
    packed.apply_all([packed.plan_pack(pack, zero, pack.versions())])
    pulled = [0 if k % 2 else 1 for k in range(len(pack.ids))]
    update = packed.plan_pack(pack, zero, pulled)
    assert update.staleness == [1 - v for v in pulled]
    with pytest.raises(RolledBack, match="ahead of this PS's 1"):
        packed.plan_pack(pack, zero, [2] * len(pack.ids))
    with pytest.raises(InvalidArgument, match="elements, expected"):
        packed.plan_pack(pack, zero[1:], pack.versions())
    with pytest.raises(InvalidArgument, match="float64"):
        packed.plan_pack(pack, zero.astype(np.float64), pack.versions())


def test_a_lent_pack_is_copied_before_an_update_and_the_copy_reused() -> None:
    store, _, _ = _stores({"name": "sgd", "lr": 1.0})
    (pack,) = store.packs()
    before = pack.buf.copy()
    lent = pack.lend()  # a reply's frame holds it
    ones = np.ones(pack.size, np.float32)
    store.apply_all([store.plan_pack(pack, ones, pack.versions())])
    np.testing.assert_array_equal(lent, before)  # the frame's bytes did not change
    np.testing.assert_array_equal(pack.buf, before - 1)
    assert store.copies_on_write == 1 and not np.shares_memory(lent, pack.buf)
    member = pack.members[3]
    assert np.shares_memory(member.values, pack.buf)
    # a member updated alone while the pack is lent copies the pack too
    view = member.lend()
    store.apply(store.plan_dense(member.definition.id, [(0, ones[: member.definition.size])], 1))
    assert store.copies_on_write == 2
    assert np.shares_memory(member.values, pack.buf) and not np.shares_memory(view, pack.buf)
    del lent, view
    assert not pack.is_lent()
    buf, refs = id(pack.buf), sys.getrefcount(pack.buf)
    store.apply_all([store.plan_pack(pack, ones, pack.versions())])
    after = sys.getrefcount(pack.buf)
    assert store.copies_on_write == 2 and id(pack.buf) == buf and after == refs


def test_a_restore_and_an_install_pack_again() -> None:
    store, _, defs = _stores({"name": "adam", "lr": 0.01})
    states = [
        (s.definition, s.values + 1, {k: v + 2 for k, v in s.slots.items()}, 3) for s in store
    ]
    store.replace(states)
    (pack,) = store.packs()
    assert pack.versions() == [3] * len(defs)
    for d, values, slots, _ in states:
        np.testing.assert_array_equal(store.get(d.id).values, values)
        np.testing.assert_array_equal(store.get(d.id).slots["m"], slots["m"])
    other = ShardStore()
    other.install(
        [
            Shard(
                s.definition,
                s.values.copy(),
                {k: v.copy() for k, v in s.slots.items()},
                make_optimizer(s.definition.optimizer),
                s.version,
            )
            for s in store
        ]
    )
    assert [p.ids for p in other.packs()] == [pack.ids]


# ---------------------------------------------------------------- the wire


async def unpacked_cluster(
    variables: Sequence[VariableDef],
    num_ps: int,
    optimizer: Mapping[str, Any] = MappingProxyType({"name": "sgd", "lr": 0.1}),
) -> Cluster:
    """A cluster whose PS hold no pack (each shard created alone)."""
    placement = plan(variables, num_ps, Partitioner(num_shards=1), optimizer=optimizer)
    net = FakeNetwork()
    services = [PSService(i) for i in range(num_ps)]
    for i, svc in enumerate(services):
        net.serve(f"ps{i}", svc, name=f"ps{i}")
    for ps, d in placement.shard_defs():
        chief = net.client(f"ps{ps}", "chief:0")
        await chief.request("create_shards", {"shards": [d.to_wire()]})
    assert not any(svc.store.packs() for svc in services)
    return Cluster(net, services, placement)


def _frames(client: Any, op: str) -> list[int]:
    return [len(t) for rec in client.ps for o, _, t in rec.sent if o == op]


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_packed_messages_give_what_shard_by_shard_gives(shm: bool) -> None:
    variables = small_vars(40)

    async def body() -> None:
        packed_c = await make_cluster(variables, 2, 1, optimizer={"name": "sgd", "lr": 0.1})
        plain_c = await unpacked_cluster(variables, 2)
        packed = packed_c.client(shared_memory=shm, wrap=Recorder)
        plain = plain_c.client(shared_memory=shm, wrap=Recorder)
        assert packed.pack_of and not any(
            svc.store.packs() for svc in plain_c.services
        )  # the same client packs; the second cluster's PS take it shard by shard
        for client in (packed, plain):
            await client.pull()
        for step in range(4):
            g = grads_for(variables, seed=step)
            for client in (packed, plain):
                await client.push(g, pull=step % 2 == 1)
            assert packed.versions == plain.versions
            for v in variables:
                np.testing.assert_array_equal(packed.params[v.name], plain.params[v.name])
        for client in (packed, plain):
            await client.pull()
        for v in variables:
            np.testing.assert_array_equal(packed.params[v.name], plain.params[v.name])
            np.testing.assert_array_equal(
                packed_c.shard_values(v.name), plain_c.shard_values(v.name)
            )
        if not shm:  # one frame per pack each way
            assert set(_frames(packed, "push") + _frames(packed, "push_pull")) == {1}
            replies = [r for rec in packed.ps for r in rec.replies if r.body.get("packed")]
            assert replies and all(len(r.tensors) == 1 for r in replies)
            assert not [r for rec in plain.ps for r in rec.replies if r.body.get("packed")]
        await packed.close()
        await plain.close()

    run(body())


def test_a_bad_packed_push_is_refused_whole_and_changes_nothing() -> None:
    variables = small_vars(10)

    async def body() -> None:
        c = await make_cluster(variables, 1, 1, optimizer={"name": "sgd", "lr": 0.1})
        svc = c.services[0]
        (pack,) = svc.store.packs()
        before = pack.buf.copy()
        ids, n = list(pack.ids), len(pack.ids)
        w = c.net.client("ps0", "w:0")
        good = np.ones(pack.size, np.float32)

        async def push(
            tensors: list[Tensor], packs: list[int] | None = None, seq: int = 1
        ) -> Exception | None:
            body = {
                "shards": ids,
                "versions": [0] * n,
                "worker": "w",
                "inc": 0,
                "seq": seq,
                "packs": [n] if packs is None else packs,
            }
            try:
                await w.request("push", body, tensors)
            except Exception as e:  # the error is the test's subject
                return e
            return None

        bad_value = good.copy()
        k = 4
        bad_value[pack.bounds[k] + 1] = np.nan
        cases = [
            ([Tensor(good[1:], "grad", ids[0], 0)], None, "elements, expected"),
            ([Tensor(good, "grad", ids[0], 8)], None, "in one tensor"),
            (
                [Tensor(good[:5], "grad", ids[0], 0), Tensor(good[5:], "grad", ids[0], 5)],
                None,
                "in one tensor",
            ),
            ([Tensor(good, "grad", ids[1], 0)], None, "not named"),
            ([Tensor(good, "grad", ids[0], 0)], [n + 1], "packs of"),
            ([Tensor(good.astype(np.float64), "grad", ids[0], 0)], None, "float64"),
            (
                [Tensor(bad_value, "grad", ids[0], 0)],
                None,
                f"shard {ids[k]}: gradient element 1 is nan",
            ),
        ]
        for seq, (tensors, packs, match) in enumerate(cases, start=1):
            err = await push(tensors, packs, seq)
            assert isinstance(err, (InvalidArgument, NonFiniteGradient)), (match, err)
            assert match in str(err), (match, str(err))
            np.testing.assert_array_equal(pack.buf, before)
            assert pack.versions() == [0] * n
        assert await push([Tensor(good, "grad", ids[0], 0)], seq=len(cases) + 1) is None
        np.testing.assert_array_equal(pack.buf, before - np.float32(0.1))
        assert pack.versions() == [1] * n

    run(body())


def test_a_packed_pull_of_shards_the_ps_does_not_hold_as_one_pack_comes_shard_by_shard() -> None:
    variables = small_vars(6)

    async def body() -> None:
        c = await unpacked_cluster(variables, 1)
        w = c.net.client("ps0", "w:0")
        sids = [s.id for s in c.placement.shards]
        rep = await w.request("pull", {"shards": sids, "packs": [len(sids)]})
        assert not rep.body.get("packed") and len(rep.tensors) == len(sids)
        assert [t.ref for t in rep.tensors] == sids

    run(body())


def test_sync_mode_takes_a_pack_shard_by_shard() -> None:
    variables = small_vars(8)

    async def body() -> None:
        c = await make_cluster(variables, 1, 1, optimizer={"name": "sgd", "lr": 1.0})
        chief = c.net.client("ps0", "chief:0")
        await chief.request("sync_config", {"mode": "sync", "required": 2})
        (pack,) = c.services[0].store.packs()
        start = pack.buf.copy()
        clients = [c.client(f"w{i}") for i in range(2)]
        for cl in clients:
            await cl.pull()
        g = [grads_for(variables, seed=i) for i in range(2)]
        for cl, grads in zip(clients, g, strict=True):
            await cl.push(grads, step=0)
        mean = np.concatenate([((g[0][v.name] + g[1][v.name]) / 2).reshape(-1) for v in variables])
        np.testing.assert_allclose(pack.buf, start - mean, rtol=1e-6, atol=1e-6)
        assert pack.versions() == [1] * len(pack.ids)

    run(body())


def test_requests_without_packs_are_read_as_before() -> None:
    msg = request("push", {"shards": [1], "versions": [0], "worker": "w", "inc": 0, "seq": 1})
    assert "packs" not in msg.body


@pytest.mark.parametrize("num_shards", [1, 3])
def test_a_packed_pull_lands_in_params_with_one_copy(num_shards: int) -> None:
    variables = small_vars(9)

    async def body() -> None:
        c = await make_cluster(variables, 1, num_shards, optimizer={"name": "sgd", "lr": 0.1})
        client = c.client()
        ((buf, views),) = client._pack_bufs.values()
        assert [name for name, _ in views] == [v.name for v in variables]
        await client.pull()
        g = grads_for(variables, seed=3)
        await client.push(g, pull=True)
        for v in variables:
            assert np.shares_memory(client.params[v.name], buf)
            np.testing.assert_array_equal(client.params[v.name], c.shard_values(v.name))
        # arrays of the caller's: the values are copied in shard by shard
        out = {v.name: np.empty(v.shape, np.float32) for v in variables}
        await client.pull(out=out)
        for v in variables:
            np.testing.assert_array_equal(out[v.name], c.shard_values(v.name))

    run(body())


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_match_a_cluster_without_packs(seed: int) -> None:
    """Seeded random sequences of pulls, pushes, push_pulls and pushes of some variables
    only, by two workers, TCP or shared memory, any optimizer: the PS holding packs end
    bit-identical to PS holding none, with the same versions."""
    rng = np.random.default_rng(seed)
    variables = small_vars(int(rng.integers(2, 30)), seed=seed)
    optimizer = OPTIMIZERS[seed % len(OPTIMIZERS)]
    num_ps = int(rng.integers(1, 3))

    async def body() -> None:
        packed_c = await make_cluster(variables, num_ps, 1, optimizer=optimizer)
        plain_c = await unpacked_cluster(variables, num_ps, optimizer)
        pairs = []
        for w in range(2):
            shm = bool(rng.integers(0, 2))
            pairs.append(
                (
                    packed_c.client(f"w{w}", shared_memory=shm),
                    plain_c.client(f"w{w}", shared_memory=shm),
                )
            )
        for a, b in pairs:
            await a.pull()
            await b.pull()
        for step in range(12):
            a, b = pairs[int(rng.integers(0, 2))]
            op = str(rng.choice(["pull", "push", "push_pull", "some"]))
            g = grads_for(variables, seed=seed * 100 + step)
            if op == "pull":
                await a.pull()
                await b.pull()
            elif op == "some":
                names = [v.name for v in variables if rng.random() < 0.5] or [variables[0].name]
                some = {n: g[n] for n in names}
                await a.push(some)
                await b.push(some)
            else:
                await a.push(g, pull=op == "push_pull")
                await b.push(g, pull=op == "push_pull")
            assert a.versions == b.versions, (step, op)
            for v in variables:
                np.testing.assert_array_equal(a.params[v.name], b.params[v.name])
        assert packed_c.versions() == plain_c.versions()
        for v in variables:
            np.testing.assert_array_equal(
                packed_c.shard_values(v.name), plain_c.shard_values(v.name)
            )
        for a, b in pairs:
            await a.close()
            await b.close()

    run(body(), timeout=20.0)


def test_a_packs_staleness_counts_as_its_members_one_by_one() -> None:
    from zmqps.core.store import StalenessStats

    rng = np.random.default_rng(3)
    for values in ([0] * 7, [int(v) for v in rng.integers(0, 90, 50)], []):
        one, many = StalenessStats(), StalenessStats()
        for v in values:
            one.add(v)
        many.add_all(values)
        assert one.to_dict() == many.to_dict()


def test_a_version_that_is_not_an_int_is_refused_naming_the_member() -> None:
    store, _, _ = _stores({"name": "sgd", "lr": 0.1})
    (pack,) = store.packs()
    zero = np.zeros(pack.size, np.float32)
    versions: list[Any] = pack.versions()
    versions[2] = True
    with pytest.raises(InvalidArgument, match="pulled version must be an int"):
        store.plan_pack(pack, zero, versions)
    versions[2] = -1
    with pytest.raises(InvalidArgument, match=f"shard {pack.ids[2]}: pulled version -1"):
        store.plan_pack(pack, zero, versions)
