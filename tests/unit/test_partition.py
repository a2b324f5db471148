"""Partitioning and placement (zmqps.core.partition): sizes, tiling, policies, plans."""

from __future__ import annotations

import itertools

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqps.core.partition import (
    DEFAULT_OPTIMIZER,
    PLACEMENTS,
    Partitioner,
    check_replication,
    even_split,
    greedy_by_bytes,
    place_backups,
    plan,
    round_robin,
)
from zmqps.core.variables import Placement, ShardInfo, VariableDef
from zmqps.wire.errors import InvalidArgument
from zmqps.wire.schema import MAX_SHARDS, PLACEMENT

KiB = 1024
MiB = 1024 * 1024


def var(shape, dtype="float32", name="v", **kw):
    return VariableDef(name, shape, dtype, **kw)


def counts(splits):
    return [rows for _, rows in splits]


# --- even split ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "n", "expected"),
    [
        (10, 1, [(0, 10)]),
        (10, 3, [(0, 4), (4, 3), (7, 3)]),
        (10, 4, [(0, 3), (3, 3), (6, 2), (8, 2)]),
        (5, 5, [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)]),
        (7, 2, [(0, 4), (4, 3)]),
    ],
)
def test_even_split_first_shards_get_the_extra_row(rows, n, expected):
    assert even_split(rows, n) == expected


@pytest.mark.parametrize(("rows", "n"), [(0, 1), (3, 0), (3, 4), (-1, 1)])
def test_even_split_rejects_impossible_splits(rows, n):
    with pytest.raises(InvalidArgument):
        even_split(rows, n)


# --- number of shards ------------------------------------------------------------


@pytest.mark.parametrize(
    ("partitioner", "shape", "dtype", "num_ps", "expected"),
    [
        # small variables stay whole
        (Partitioner(), (10, 10), "float32", 4, [10]),
        (Partitioner(), (1,), "float32", 4, [1]),
        # exactly 1 MiB = 4 x 256 KiB, capped by the number of PS
        (Partitioner(), (1024, 256), "float32", 2, [512, 512]),
        (Partitioner(), (1024, 256), "float32", 8, [256] * 4),
        # just under 2 x min: floor gives 1 shard
        (Partitioner(), (511, 256), "float32", 8, [511]),
        # float64 doubles the bytes, hence the shards
        (Partitioner(), (1024, 256), "float64", 8, [128] * 8),
        # max_shards replaces num_ps as the cap
        (Partitioner(max_shards=3), (1024, 256), "float32", 8, [342, 341, 341]),
        (Partitioner(max_shards=16), (1024, 256), "float32", 2, [256] * 4),
        # min_shard_bytes tunes the count
        (Partitioner(min_shard_bytes=MiB // 2), (1024, 256), "float32", 8, [512, 512]),
        # max_shard_bytes wins over the cap (num_ps=1 would give 1 shard)
        (Partitioner(max_shard_bytes=300 * KiB), (1024, 256), "float32", 1, [256] * 4),
        (Partitioner(max_shard_bytes=MiB - 1), (1024, 256), "float32", 1, [512, 512]),
        (Partitioner(max_shard_bytes=MiB), (1024, 256), "float32", 1, [1024]),
        # ... and over max_shards
        (Partitioner(max_shards=1, max_shard_bytes=MiB // 2), (1024, 256), "float32", 4, [512] * 2),
        # a row larger than max_shard_bytes: one row per shard, no further
        (Partitioner(max_shard_bytes=KiB), (3, 1000), "float32", 1, [1, 1, 1]),
        # min size cannot ask for more shards than rows
        (Partitioner(min_shard_bytes=1), (3, 1000), "float32", 100, [1, 1, 1]),
        # fixed number of shards, capped at rows; byte limits not consulted
        (Partitioner(num_shards=4), (10,), "float32", 1, [3, 3, 2, 2]),
        (Partitioner(num_shards=10), (3, 4), "float32", 2, [1, 1, 1]),
        (Partitioner(num_shards=2, max_shard_bytes=1), (1024, 256), "float32", 8, [512, 512]),
        (Partitioner(num_shards=1), (1 << 20, 64), "float32", 8, [1 << 20]),
    ],
)
def test_split_counts(partitioner, shape, dtype, num_ps, expected):
    splits = partitioner.split(var(shape, dtype), num_ps)
    assert counts(splits) == expected
    assert partitioner.num_shards_for(var(shape, dtype), num_ps) == len(expected)


def test_embedding_table_is_split_across_ps():
    table = var((1 << 20, 64), sparse=True)  # 256 MiB
    splits = Partitioner().split(table, 4)
    assert counts(splits) == [1 << 18] * 4  # 64 MiB each, exactly the default max
    splits = Partitioner().split(var(((1 << 20) + 1, 64), sparse=True), 4)
    assert len(splits) == 5  # one row more: the max raises the count past num_ps
    assert all(rows * 64 * 4 <= 64 << 20 for rows in counts(splits))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_shards": 0},
        {"num_shards": -1},
        {"num_shards": 1.5},
        {"num_shards": True},
        {"min_shard_bytes": 0},
        {"max_shard_bytes": 0},
        {"max_shards": 0},
    ],
)
def test_partitioner_rejects_bad_arguments(kwargs):
    with pytest.raises(InvalidArgument):
        Partitioner(**kwargs)


@pytest.mark.parametrize("num_ps", [0, -1])
def test_split_rejects_bad_num_ps(num_ps):
    with pytest.raises(InvalidArgument, match="num_ps"):
        Partitioner().split(var((10,)), num_ps)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 5000),
    rest=st.lists(st.integers(1, 64), max_size=3),
    dtype=st.sampled_from(["float16", "float32", "float64"]),
    num_shards=st.none() | st.integers(1, 50),
    min_shard_bytes=st.integers(1, 1 << 20),
    max_shard_bytes=st.integers(1, 4 << 20),
    max_shards=st.none() | st.integers(1, 50),
    num_ps=st.integers(1, 16),
)
def test_shards_tile_each_variable_exactly(
    rows, rest, dtype, num_shards, min_shard_bytes, max_shard_bytes, max_shards, num_ps
):
    v = var((rows, *rest), dtype)
    p = Partitioner(num_shards, min_shard_bytes, max_shard_bytes, max_shards)
    splits = p.split(v, num_ps)
    sizes = counts(splits)
    # contiguous, non-empty, covering [0, rows)
    assert splits[0][0] == 0
    assert all(r > 0 for r in sizes)
    for (start, r), (nxt, _) in itertools.pairwise(splits):
        assert start + r == nxt
    assert splits[-1][0] + splits[-1][1] == rows
    # even, first shards larger
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    row_bytes = v.row_size * v.itemsize
    if num_shards is not None:
        assert len(splits) == min(num_shards, rows)
    else:
        # no shard over the max unless a single row is already over it
        assert max(sizes) * row_bytes <= max_shard_bytes or max(sizes) == 1
        cap = max_shards if max_shards is not None else num_ps
        by_min = max(1, v.nbytes // min_shard_bytes)
        assert len(splits) >= min(rows, min(by_min, cap))
        assert len(splits) <= min(
            rows, max(min(by_min, cap), -(-rows // (max_shard_bytes // row_bytes or 1)))
        )


# --- placement policies ----------------------------------------------------------


def test_round_robin_follows_global_shard_order():
    assert round_robin([5] * 7, 3) == [0, 1, 2, 0, 1, 2, 0]
    assert round_robin([1, 100, 1], 1) == [0, 0, 0]
    assert round_robin([], 4) == []


def test_greedy_places_largest_first_on_least_loaded():
    # by size: 10->0, 8->1, 3->1 (8 < 10), 1 (index 1)->0 (10 < 11), 1 (index 2)->0 (11 = 11:
    # the lowest PS wins the tie)
    assert greedy_by_bytes([10, 1, 1, 8, 3], 2) == [0, 0, 0, 1, 1]
    assert greedy_by_bytes([4, 4, 4, 4, 4, 4], 3) == [0, 1, 2, 0, 1, 2]  # ties: lowest index
    assert greedy_by_bytes([1, 2, 3], 5) == [2, 1, 0]
    assert greedy_by_bytes([], 2) == []


@pytest.mark.parametrize("policy", [round_robin, greedy_by_bytes])
def test_policies_validate_arguments(policy):
    with pytest.raises(InvalidArgument):
        policy([1, 2], 0)
    with pytest.raises(InvalidArgument):
        policy([1, -2], 2)


def test_placement_registry():
    assert PLACEMENTS["round_robin"] is round_robin
    assert PLACEMENTS["greedy"] is greedy_by_bytes
    assert set(PLACEMENTS) == {"round_robin", "greedy"}


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 10_000), max_size=60), num_ps=st.integers(1, 12))
def test_greedy_balances_and_is_deterministic(sizes, num_ps):
    out = greedy_by_bytes(sizes, num_ps)
    assert out == greedy_by_bytes(list(sizes), num_ps)
    assert len(out) == len(sizes)
    assert all(0 <= p < num_ps for p in out)
    loads = [0] * num_ps
    for s, p in zip(sizes, out, strict=True):
        loads[p] += s
    assert max(loads) - min(loads) <= max(sizes, default=0)


# --- backups (--replication) -----------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 10_000), max_size=40),
    num_ps=st.integers(1, 9),
    replication=st.integers(1, 4),
    host_count=st.integers(1, 5),
    data=st.data(),
)
def test_backups_never_share_a_ps_nor_a_host_they_can_avoid(
    sizes, num_ps, replication, host_count, data
):
    replication = min(replication, num_ps)
    primaries = greedy_by_bytes(sizes, num_ps)
    hosts = [f"h{data.draw(st.integers(0, host_count - 1))}" for _ in range(num_ps)]
    out = place_backups(sizes, primaries, num_ps, replication, hosts)
    assert out == place_backups(list(sizes), list(primaries), num_ps, replication, list(hosts))
    assert len(out) == len(sizes)
    distinct_hosts = len(set(hosts))
    for p, bs in zip(primaries, out, strict=True):
        copies = (p, *bs)
        assert len(copies) == replication
        assert len(set(copies)) == replication and all(0 <= c < num_ps for c in copies)
        on = [hosts[c] for c in copies]
        # as many hosts as can be: copies share one only when there are too few
        assert len(set(on)) == min(replication, distinct_hosts)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 10_000), max_size=60), num_ps=st.integers(2, 9))
def test_backups_follow_their_primary_and_keep_the_ps_balanced(sizes, num_ps):
    """Every shard of one PS has the same backups; with the primaries balanced
    (greedy), primaries and backups together stay within twice the largest PS's
    primary bytes of each other."""
    primaries = greedy_by_bytes(sizes, num_ps)
    out = place_backups(sizes, primaries, num_ps, 2)
    assert len({(p, bs) for p, bs in zip(primaries, out, strict=True)}) == len(set(primaries))
    loads = [0] * num_ps
    group = [0] * num_ps
    for size, p, (b,) in zip(sizes, primaries, out, strict=True):
        loads[p] += size
        loads[b] += size
        group[p] += size
    assert sum(loads) == 2 * sum(sizes)
    assert max(loads) - min(loads) <= 2 * max(group)


def test_backups_go_to_another_host_first():
    # 4 PS on 2 hosts: the backup of a shard whose primary is on host a is on host b
    hosts = ["a", "a", "b", "b"]
    out = place_backups([10] * 8, [0, 1, 2, 3] * 2, 4, 2, hosts)
    for p, (b,) in zip([0, 1, 2, 3] * 2, out, strict=True):
        assert hosts[b] != hosts[p]
    # 3 copies on 2 hosts: two share one, never two on one PS
    out = place_backups([10] * 4, [0, 1, 2, 3], 4, 3, hosts)
    assert all(
        len({hosts[c] for c in (p, *bs)}) == 2 for p, bs in zip([0, 1, 2, 3], out, strict=True)
    )


@pytest.mark.parametrize(
    ("replication", "num_ps", "match"),
    [
        (0, 3, "replication must be a positive integer"),
        (
            4,
            3,
            "replication 4 needs at least 4 PS tasks, one per copy of a shard; the cluster has 3",
        ),
        (17, 20, "at most 16 copies"),
    ],
)
def test_replication_beyond_the_ps_is_refused(replication, num_ps, match):
    with pytest.raises(InvalidArgument, match=match):
        check_replication(replication, num_ps)
    with pytest.raises(InvalidArgument, match=match):
        plan(model(), num_ps, Partitioner(), replication=replication)


def test_a_replicated_plan_round_trips_the_wire_and_its_schema():
    p = plan(model(), 3, Partitioner(), "greedy", replication=2, hosts=["a", "b", "b"])
    assert p.replication == 2
    for s in p.shards:
        assert len(s.copies) == 2 and s.copies[0] == s.ps
        assert "a" in {["a", "b", "b"][c] for c in s.copies}
    wire = msgpack.unpackb(msgpack.packb(p.to_wire()))
    PLACEMENT.check(wire, "placement")
    assert Placement.from_wire(wire) == p
    # a placement of one copy reads and writes as before replication existed
    one = plan(model(), 3, Partitioner())
    assert one.replication == 1 and "backups" not in one.to_wire()
    PLACEMENT.check(msgpack.unpackb(msgpack.packb(one.to_wire())), "placement")


def test_a_shard_with_two_copies_on_one_ps_is_refused():
    with pytest.raises(InvalidArgument, match="two copies on one PS"):
        ShardInfo(0, "v", 0, 0, 4, 1, (2, 1))
    wire = plan(model(), 3, Partitioner(), replication=2).to_wire()
    wire["backups"] = wire["backups"][:-1]
    with pytest.raises(InvalidArgument, match="backup lists for"):
        Placement.from_wire(wire)


# --- plan ------------------------------------------------------------------------


def model() -> list[VariableDef]:
    return [
        var(
            (1_000_000, 16), name="emb/user", sparse=True, optimizer={"name": "adagrad", "lr": 0.1}
        ),
        var((256, 128), name="dense/kernel", init={"name": "normal", "stddev": 0.1, "seed": 1}),
        var((128,), name="dense/bias"),
        var((300_000, 8), "float64", name="emb/item", sparse=True),
    ]


def test_plan_ids_order_and_tiling():
    p = plan(model(), 3, Partitioner())
    assert [s.id for s in p.shards] == list(range(len(p.shards)))
    # variable order, then shard order
    names = [s.var for s in p.shards]
    assert names == sorted(names, key=[v.name for v in model()].index)
    for v in model():
        shards = p.shards_of(v.name)
        assert [s.index for s in shards] == list(range(len(shards)))
        assert sum(s.rows for s in shards) == v.shape[0]
        assert [(s.row_start, s.rows) for s in shards] == Partitioner().split(v, 3)
    assert [s.ps for s in p.shards] == [i % 3 for i in range(len(p.shards))]
    assert len(p.shards_of("emb/user")) == 3  # 64 MB: 3 shards, capped by num_ps
    assert len(p.shards_of("dense/bias")) == 1


def test_plan_keeps_variables_and_sets_job_optimizer():
    p = plan(model(), 2, Partitioner(), optimizer={"name": "adam", "lr": 1e-3})
    assert p.variables == tuple(model())
    assert p.variable("dense/kernel").optimizer is None  # job default, resolved by the PS
    assert p.optimizer == {"lr": 1e-3, "name": "adam"}
    defs = dict((d.var, d) for _, d in p.shard_defs())
    assert defs["dense/kernel"].optimizer == {"name": "adam", "lr": 1e-3}
    assert defs["emb/user"].optimizer == {"name": "adagrad", "lr": 0.1}
    assert plan(model(), 2, Partitioner()).optimizer == dict(DEFAULT_OPTIMIZER)


def test_plan_greedy_balances_bytes():
    p = plan(model(), 4, Partitioner(), placement="greedy")
    sizes = {s.id: d.nbytes for s, (_, d) in zip(p.shards, p.shard_defs(), strict=True)}
    loads = [0] * 4
    for s in p.shards:
        loads[s.ps] += sizes[s.id]
    assert max(loads) - min(loads) <= max(sizes.values())


def test_plan_accepts_a_policy_callable():
    p = plan(model(), 2, Partitioner(), placement=lambda sizes, n: [n - 1] * len(sizes))
    assert {s.ps for s in p.shards} == {1}


def test_plan_is_deterministic_and_round_trips_the_wire():
    for placement in PLACEMENTS:
        a = plan(model(), 3, Partitioner(max_shard_bytes=8 << 20), placement)
        b = plan(list(model()), 3, Partitioner(max_shard_bytes=8 << 20), placement)
        assert a == b
        wire = msgpack.unpackb(msgpack.packb(a.to_wire()))
        assert Placement.from_wire(wire) == a
        assert Placement.from_wire(wire).to_wire() == a.to_wire()


def test_plan_with_no_variables_is_empty():
    p = plan([], 2, Partitioner())
    assert p.shards == () and p.variables == ()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"variables": [var((2,), name="a"), var((3,), name="a")]}, "duplicate variable name 'a'"),
        ({"num_ps": 0}, "num_ps"),
        ({"placement": "random"}, "unknown placement 'random'"),
        ({"placement": lambda sizes, n: [n] * len(sizes)}, "invalid assignment"),
        ({"placement": lambda sizes, n: []}, "invalid assignment"),
    ],
)
def test_plan_rejects(args, match):
    kwargs = {"variables": model(), "num_ps": 2, "partitioner": Partitioner(), **args}
    with pytest.raises(InvalidArgument, match=match):
        plan(**kwargs)


def test_a_plan_of_more_shards_than_the_wire_carries_is_refused_before_any_is_made() -> None:
    """One ``create_vars`` of a [2**40, 256] variable made the chief build 2**24 shards
    (gigabytes, no reply) before anything said no."""
    huge = VariableDef("huge", (2**40, 256))
    with pytest.raises(InvalidArgument, match="need 16,777,216 shards, at most 65,536"):
        plan([huge], 2, Partitioner())
    with pytest.raises(InvalidArgument, match="at most 65,536"):  # many small ones too
        plan([VariableDef(f"v{i}", (30_000,)) for i in range(3)], 1, Partitioner(num_shards=30_000))
    plan([VariableDef("ok", (MAX_SHARDS, 1))], 1, Partitioner(num_shards=MAX_SHARDS))
