"""Hash-keyed tables: the documented hash, per-id initial values, admission, eviction,
a row budget that holds under a stream of ever-new ids, and refusals that change nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqps.core.hashtable import IdIndex, bucket_of, initial_rows, mix64
from zmqps.core.partition import Partitioner, plan
from zmqps.core.store import ShardStore
from zmqps.core.variables import ShardDef, VariableDef
from zmqps.wire.errors import InvalidArgument

MASK = (1 << 64) - 1


def splitmix64_finalizer(x: int) -> int:
    """The documented hash, written out in plain Python integers."""
    z = x & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def table_def(
    table: dict[str, Any] | None = None,
    *,
    buckets: int = 64,
    start: int = 0,
    rows: int | None = None,
    sid: int = 0,
    init: dict[str, Any] | None = None,
    optimizer: dict[str, Any] | None = None,
) -> ShardDef:
    return ShardDef(
        id=sid,
        var="emb",
        index=sid,
        dtype="float32",
        full_shape=(buckets, 4),
        row_start=start,
        rows=buckets - start if rows is None else rows,
        init=init or {"name": "normal", "stddev": 0.1, "seed": 3},
        optimizer=optimizer or {"name": "sgd", "lr": 0.5},
        sparse=True,
        table=table or {},
    )


def store_of(*defs: ShardDef) -> ShardStore:
    s = ShardStore()
    s.create(list(defs))
    return s


def test_the_hash_is_the_documented_splitmix64_finalizer() -> None:
    ids = [0, 1, -1, 42, 2**63 - 1, -(2**63), 123456789012345]
    got = mix64(np.array(ids, np.int64))
    assert [int(v) for v in got] == [splitmix64_finalizer(i) for i in ids]
    assert [int(b) for b in bucket_of(np.array(ids, np.int64), 1000)] == [
        splitmix64_finalizer(i) % 1000 for i in ids
    ]


def test_initial_rows_depend_on_id_variable_and_seed_only() -> None:
    init = {"name": "normal", "stddev": 0.1, "seed": 3}
    ids = np.array([5, -9, 2**50], np.int64)
    a = initial_rows(init, "emb", ids, 4, "float32")
    b = initial_rows(init, "emb", ids[::-1], 4, "float32")[::-1]
    assert np.array_equal(a, b)  # not a function of position or batch
    assert not np.array_equal(a, initial_rows({**init, "seed": 4}, "emb", ids, 4, "float32"))
    assert not np.array_equal(a, initial_rows(init, "other", ids, 4, "float32"))
    many = initial_rows(init, "emb", np.arange(20_000), 4, "float64")
    assert abs(many.mean()) < 0.005 and abs(many.std() - 0.1) < 0.005
    trunc = initial_rows({"name": "truncated_normal", "stddev": 1.0}, "e", np.arange(5000), 4, "f8")
    assert np.abs(trunc).max() <= 2.0
    uni = initial_rows({"name": "uniform", "low": -1, "high": 3}, "e", np.arange(5000), 2, "f8")
    assert uni.min() >= -1 and uni.max() <= 3 and abs(uni.mean() - 1.0) < 0.05


def test_rows_are_the_same_whatever_the_sharding() -> None:
    ids = np.arange(-500, 500, 7, dtype=np.int64)
    whole = store_of(table_def())
    _, want = whole.pull_rows(0, ids)
    parts = store_of(table_def(rows=20, sid=0), table_def(start=20, sid=1))
    b = bucket_of(ids, 64)
    got = np.empty_like(want)
    for sid, sel in ((0, b < 20), (1, b >= 20)):
        got[sel] = parts.pull_rows(sid, ids[sel])[1]
    assert np.array_equal(got, want)


def test_ids_of_another_shard_are_refused_and_change_nothing() -> None:
    store = store_of(table_def(rows=20))
    ids = np.arange(200, dtype=np.int64)
    outside = ids[bucket_of(ids, 64) >= 20][:1]
    inside = ids[bucket_of(ids, 64) < 20][:3]
    with pytest.raises(InvalidArgument, match="hashes outside"):
        store.pull_rows(0, np.concatenate([inside, outside]))
    with pytest.raises(InvalidArgument, match="hashes outside"):
        store.apply_rows(0, outside, np.ones((1, 4), np.float32), 0)
    with pytest.raises(InvalidArgument, match="integer"):
        store.pull_rows(0, inside.astype(np.float64))
    with pytest.raises(InvalidArgument, match="row gradients"):
        store.apply_rows(0, inside, np.ones((2, 4), np.float32), 0)
    shard: Any = store.get(0)
    assert shard.rows == 0 and shard.version == 0 and shard.counters.created == 0


def test_dense_access_to_a_table_is_refused() -> None:
    store = store_of(table_def())
    with pytest.raises(InvalidArgument, match="hash-keyed"):
        store.snapshot(0)
    with pytest.raises(InvalidArgument, match="hash-keyed"):
        store.apply_dense(0, [(0, np.zeros(4, np.float32))], 0)
    with pytest.raises(InvalidArgument, match="hash-keyed"):
        store.get(0).lend()


def test_admission_after_k_sightings() -> None:
    store = store_of(table_def({"admit_after": 3}))
    ids = np.array([11, 12], np.int64)
    for _ in range(2):
        _, rows = store.pull_rows(0, ids)
        assert np.array_equal(rows, np.zeros((2, 4), np.float32))  # not admitted: zeros
    store.apply_rows(0, ids, np.ones((2, 4), np.float32), 0)  # dropped, counted
    shard: Any = store.get(0)
    assert (shard.rows, shard.counters.not_admitted, shard.counters.admitted) == (0, 2, 0)
    _, rows = store.pull_rows(0, ids)  # the third sighting admits them
    want = initial_rows(table_def().init, "emb", ids, 4, "float32")
    assert np.array_equal(rows, want)
    assert (shard.rows, shard.counters.admitted, shard.counters.created) == (2, 2, 2)


def test_rows_idle_too_long_are_evicted_and_come_back_at_their_initial_value() -> None:
    store = store_of(table_def({"evict_after": 8}))
    hot, cold = np.array([1], np.int64), np.array([2], np.int64)
    _, cold0 = store.pull_rows(0, cold)
    store.apply_rows(0, cold, np.ones((1, 4), np.float32), 0)
    for _ in range(20):
        store.apply_rows(0, hot, np.ones((1, 4), np.float32), store.get(0).version)
    shard: Any = store.get(0)
    assert shard.rows == 1 and shard.counters.evicted_idle == 1
    _, again = store.pull_rows(0, cold)
    assert np.array_equal(again, cold0)  # recreated from the id: its initial value


@pytest.mark.parametrize("admit_after", [1, 2])
def test_a_stream_of_ever_new_ids_never_exceeds_the_row_budget(admit_after: int) -> None:
    budget, pending_limit = 500, 2000
    store = store_of(
        table_def(
            {"row_budget": budget, "admit_after": admit_after, "pending_limit": pending_limit}
        )
    )
    shard: Any = store.get(0)
    rng = np.random.default_rng(1)
    nbytes = []
    for step in range(300):
        fresh = np.arange(step * 100, step * 100 + 100, dtype=np.int64)
        recent = rng.integers(max(0, step - 3) * 100, step * 100 + 100, 20)
        ids = np.unique(np.concatenate([fresh, fresh if admit_after > 1 else [], recent]))
        ids = ids.astype(np.int64)
        store.pull_rows(0, ids)
        store.pull_rows(0, ids)
        store.apply_rows(0, ids, np.ones((ids.size, 4), np.float32), shard.version)
        assert shard.rows <= budget and shard.table.capacity <= budget
        assert len(shard.pending) <= pending_limit
        nbytes.append(store.nbytes())
    c = shard.counters
    assert c.created > 20 * budget  # the stream went far past the budget...
    assert c.created - c.evicted_budget == shard.rows  # ...and every row left is counted
    assert max(nbytes) == nbytes[-1] == nbytes[len(nbytes) // 2]  # memory flat
    # the most recent ids survived; long-gone ones were evicted
    table = shard.table
    assert table.lookup(np.array([299 * 100 + 5]))[0] >= 0
    assert table.lookup(np.array([5]))[0] < 0


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=6),
    budget=st.one_of(st.none(), st.integers(5000, 9000)),
)
def test_requests_of_any_size_get_every_row_and_lose_no_free_row(
    sizes: list[int], budget: int | None
) -> None:
    """Requests of new ids bigger than the capacity (several times over, at once)
    all get their rows; rows in use plus free rows always make up the capacity."""
    store = store_of(table_def({} if budget is None else {"row_budget": budget}))
    shard: Any = store.get(0)
    start, seen = 0, 0
    for n in sizes:
        ids = np.arange(start, start + n, dtype=np.int64) * 7919
        start += n
        _, rows = store.pull_rows(0, ids)
        expect = initial_rows(shard.definition.init, "emb", ids, 4, "float32")
        assert np.array_equal(rows, expect)
        seen += n
        table = shard.table
        if budget is None:
            assert len(table) == seen
        else:  # older rows make room; this request's rows are all there
            assert n <= len(table) <= table.capacity <= budget
        assert len(table) + table.nfree == table.capacity
        _, used = table.index.items()
        free = table.free[: table.nfree]
        assert np.unique(np.concatenate([used, free])).size == table.capacity  # none twice
        assert (table.lookup(ids) >= 0).all()


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "remove"]),
            st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-50, 50), max_size=300),
        ),
        max_size=25,
    )
)
def test_the_id_index_answers_like_a_dict(ops: list[tuple[str, list[int]]]) -> None:
    """Batches of inserts and removals (any int64, extremes and small ids, repeats
    across batches) leave the index answering every lookup as a dict would."""
    index, model, next_row = IdIndex(), {}, 0
    for op, batch in ops:
        ids = np.array(sorted(set(batch)), np.int64)
        if op == "insert":
            ids = np.array([i for i in ids.tolist() if i not in model], np.int64)
            rows = np.arange(next_row, next_row + ids.size, dtype=np.int64)
            next_row += ids.size
            index.insert(ids, rows)
            model.update(zip(ids.tolist(), rows.tolist(), strict=True))
        else:
            index.remove(ids)
            for i in ids.tolist():
                model.pop(i, None)
        assert len(index) == len(model)
        asked = np.array(list(model) + batch + [0, -1, 2**63 - 1], np.int64)
        want = np.array([model.get(i, -1) for i in asked.tolist()], np.int64)
        assert np.array_equal(index.lookup(asked), want)
        keys, rows = index.items()
        assert dict(zip(keys.tolist(), rows.tolist(), strict=True)) == model
        assert 2 * (index.live + index.gone) <= index.rows.size  # never over half full


def test_the_id_index_stays_fast_for_ids_of_one_bucket_range() -> None:
    """Ids of one shard share their bucket's hash bits; the index hashes them again,
    so probe runs stay short (counted, not timed)."""
    ids = np.arange(2_000_000, dtype=np.int64)
    ids = ids[bucket_of(ids, 4096) < 16][:20_000]  # one shard of 16 buckets out of 4096
    index = IdIndex()
    index.insert(ids, np.arange(ids.size))
    home = index._home(ids)
    slot = index._probe(ids)[1]
    distance = (slot - home) & index._mask
    assert distance.mean() < 1.5 and distance.max() < 64, (distance.mean(), distance.max())


@pytest.mark.parametrize("order", ["sorted", "shuffled", "repeated"])
def test_row_gradients_land_on_their_ids_in_any_order(order: str) -> None:
    """A push names ids in any order, repeats included: each gradient reaches its
    own id's row (the reference: one sorted push of the summed gradients)."""
    ids = np.array([9, -4, 2**62, 17, 3], np.int64)
    grads = np.arange(20, dtype=np.float32).reshape(5, 4)
    ref = store_of(table_def())
    ref.pull_rows(0, np.sort(ids))
    order_ = np.argsort(ids)
    ref.apply_rows(0, ids[order_], grads[order_], 0)
    got = store_of(table_def())
    got.pull_rows(0, np.sort(ids))
    if order == "sorted":
        got.apply_rows(0, ids[order_], grads[order_], 0)
    elif order == "shuffled":
        got.apply_rows(0, ids, grads, 0)
    else:  # each gradient split in two halves, pushed under the same id twice
        twice = np.concatenate([ids, ids[::-1]])
        got.apply_rows(0, twice, np.concatenate([grads / 2, grads[::-1] / 2]), 0)
    for i in ids:
        one = np.array([i], np.int64)
        np.testing.assert_allclose(got.pull_rows(0, one)[1], ref.pull_rows(0, one)[1], rtol=1e-6)


def test_one_request_beyond_the_budget_is_refused() -> None:
    store = store_of(table_def({"row_budget": 10}))
    with pytest.raises(InvalidArgument, match="row budget"):
        store.pull_rows(0, np.arange(11, dtype=np.int64))
    assert store.get(0).rows == 0  # type: ignore[attr-defined]


def test_bad_table_configs_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="row_budget"):
        VariableDef("t", (16, 4), table={"row_budget": 0})
    with pytest.raises(InvalidArgument, match="does not take"):
        VariableDef("t", (16, 4), table={"budget": 10})
    with pytest.raises(InvalidArgument, match="cannot use initializer"):
        VariableDef("t", (16, 4), init={"name": "glorot_uniform"}, table={})
    v = VariableDef("t", (16, 4), table={"row_budget": 10})
    assert v.sparse and v.hashed and VariableDef.from_wire(v.to_wire()) == v


def test_a_table_gets_one_shard_per_ps() -> None:
    v = VariableDef("t", (4096, 8), table={})
    pl = plan([VariableDef("w", (3, 3)), v], 3, Partitioner())
    shards = pl.shards_of("t")
    assert sorted(s.ps for s in shards) == [0, 1, 2]
    assert [(s.row_start, s.rows) for s in shards] == [(0, 1366), (1366, 1365), (2731, 1365)]


def _frozen(shard: Any) -> tuple[Any, ...]:
    """Everything a pull could change in a hash shard (copies)."""
    ids, values, slots, touched = shard.state()
    return (
        ids,
        values,
        slots,
        touched,
        shard.counters.to_dict(),
        dict(shard.pending),
        shard.version,
        shard.table.capacity,
        shard.nbytes,
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, np.ndarray):
            if x.dtype != y.dtype or not np.array_equal(x, y):
                return False
        elif isinstance(x, dict) and x and isinstance(next(iter(x.values())), np.ndarray):
            if x.keys() != y.keys() or not all(np.array_equal(x[k], y[k]) for k in x):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize(
    "table",
    [{}, {"admit_after": 2}, {"row_budget": 8}, {"evict_after": 4}],
    ids=["plain", "admit_after", "row_budget", "evict_after"],
)
def test_a_read_only_pull_changes_nothing_and_reads_what_a_creating_pull_would(
    table: dict[str, Any],
) -> None:
    store = store_of(table_def(table, optimizer={"name": "adagrad", "lr": 0.1}))
    shard: Any = store.get(0)
    trained = np.array([5, -3, 2**62, 77], np.int64)
    for step in range(3):  # rows with values of their own, slots, stamps, sightings
        store.pull_rows(0, trained)
        grads = np.full((trained.size, 4), 0.5 + step, np.float32)
        store.apply_rows(0, trained, grads, shard.version)
    seen_once = np.array([900], np.int64)
    store.pull_rows(0, seen_once)  # admit_after 2: a sighting pending, no row
    fresh = np.array([123456789, -(2**63), 31337], np.int64)
    ids = np.concatenate([trained[:2], fresh, seen_once, trained[:1], fresh[:1]])
    before = _frozen(shard)

    _, read = store.pull_rows(0, ids, create=False)
    assert _same(_frozen(shard), before)  # no row, stamp, sighting, counter, eviction
    _, again = store.pull_rows(0, ids, create=False)
    assert np.array_equal(read, again)

    _, created = store.pull_rows(0, ids)  # what training would have read
    assert read.dtype == created.dtype
    if table.get("admit_after", 1) == 1:
        assert np.array_equal(read, created)
        want = initial_rows(shard.definition.init, "emb", fresh, 4, "float32")
        assert np.array_equal(read[2:5], want)  # the initial values, computed, not stored
    else:
        # ids not admitted read as zeros, as training reads them; the creating pull was
        # the second sighting of 900 and admitted it, the read-only pull admitted nothing
        not_900 = np.flatnonzero(ids != 900)
        assert np.array_equal(read[not_900], created[not_900])
        assert np.array_equal(read[2:6], np.zeros((4, 4), np.float32))
        want = initial_rows(shard.definition.init, "emb", seen_once, 4, "float32")
        assert np.array_equal(created[5:6], want)


def test_a_read_only_pull_is_not_bounded_by_the_row_budget() -> None:
    store = store_of(table_def({"row_budget": 10}))
    ids = np.arange(50, dtype=np.int64)
    _, rows = store.pull_rows(0, ids, create=False)
    assert np.array_equal(rows, initial_rows(table_def().init, "emb", ids, 4, "float32"))
    assert store.get(0).rows == 0  # type: ignore[attr-defined]


def test_a_read_only_pull_still_refuses_ids_of_another_shard() -> None:
    d = table_def(buckets=64, start=0, rows=32)
    store = store_of(d)
    ids = np.arange(200, dtype=np.int64)
    foreign = ids[bucket_of(ids, 64) >= 32][:3]
    with pytest.raises(InvalidArgument, match="hashes outside"):
        store.pull_rows(0, foreign, create=False)
    with pytest.raises(InvalidArgument, match="ids must be"):
        store.pull_rows(0, np.zeros(3, np.float32), create=False)


def test_pages_of_a_table_tile_its_rows_and_follow_a_change_of_its_ids() -> None:
    store = store_of(table_def())
    ids = np.arange(-30, 30, dtype=np.int64) * 1_000_003
    store.pull_rows(0, ids)
    pages = [store.table_page(0, start, 7) for start in range(0, 60, 7)]
    assert [p[3] for p in pages] == [60] * 9
    assert np.array_equal(np.concatenate([p[1] for p in pages]), np.sort(ids))
    _, rows = store.pull_rows(0, np.sort(ids), create=False)
    assert np.array_equal(np.concatenate([p[2] for p in pages]), rows)
    assert store.get(0)._order is None  # type: ignore[attr-defined]  # listing over: dropped

    store.table_page(0, 0, 7)
    store.pull_rows(0, np.array([5], np.int64))  # a new row between two pages
    _, page_ids, _, total = store.table_page(0, 7, 7)
    assert total == 61 and np.array_equal(page_ids, np.sort(np.append(ids, 5))[7:14])
    with pytest.raises(InvalidArgument, match="bad range"):
        store.table_page(0, -1, 7)


def test_an_unbounded_table_grows_only_while_its_rows_fit_in_memory() -> None:
    """Without a row_budget, a table's growth is refused (typed, nothing changed) once
    its new rows would take more than half the memory available; with room they come."""
    available = [10 * 1024 * 1024]  # 10 MiB "available"
    store = ShardStore(memory=lambda: (available[0], 1 << 34))
    store.create([table_def()])
    shard: Any = store.get(0)
    store.pull_rows(0, np.arange(1000, dtype=np.int64))  # grows while it fits
    held, values = shard.rows, shard.table.values.copy()
    huge = np.arange(10_000, 10_000 + 200_000, dtype=np.int64)  # 200k new rows: ~13 MiB
    with pytest.raises(InvalidArgument, match=r"hash table full.*row_budget"):
        store.pull_rows(0, huge)
    with pytest.raises(InvalidArgument, match="hash table full"):
        store.apply_rows(0, huge, np.ones((huge.size, 4), np.float32), 0)
    assert shard.rows == held and shard.version == 0
    assert np.array_equal(shard.table.values[: values.shape[0]], values)
    # ids it holds already need no room: read and pushed whatever the memory
    available[0] = 0
    store.pull_rows(0, np.arange(1000, dtype=np.int64))
    store.apply_rows(0, np.arange(10, dtype=np.int64), np.ones((10, 4), np.float32), 0)
    available[0] = 1 << 30
    store.pull_rows(0, huge)
    assert shard.rows == held + huge.size
