"""The row path's own pieces: the one-pass sum of repeated ids (core/segments.sum_rows),
the PS's dedup of a push's keys (core/store.summed_rows), and the client's per-batch
plan (one sort per step, each shard's ids as one ascending slice), each against a
plain numpy reference: duplicates, empty batches, ids at shard edges, hash tables."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_ps_client import ALL, EMB, Recorder, initial, make_cluster, recorders, run
from test_ps_recovery import created_cluster

from zmqps.core import segments
from zmqps.core.hashtable import bucket_of, initial_rows
from zmqps.core.partition import Partitioner, plan
from zmqps.core.segments import load_kernels, sum_rows
from zmqps.core.store import ShardStore, summed_rows
from zmqps.core.variables import ShardDef, VariableDef
from zmqps.roles.ps.service import split_index
from zmqps.wire import Message
from zmqps.wire.codec import is_bfloat16, wire_dtype
from zmqps.wire.errors import InvalidArgument


def reference_sum(values: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct ids ascending, their rows summed first to last): a Python loop."""
    uniq = np.unique(ids)
    out = []
    for u in uniq:
        rows = [values[i] for i in range(ids.size) if ids[i] == u]
        acc = rows[0].copy()
        for r in rows[1:]:
            acc += r
        out.append(acc)
    return uniq, np.stack(out) if out else np.empty((0, *values.shape[1:]), values.dtype)


# ---------------------------------------------------------------- sum_rows


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("row_shape", [(1,), (3,), (2, 4)])
@pytest.mark.parametrize("seed", range(4))
def test_sum_rows_adds_each_ids_rows_in_batch_order(
    dtype: type, row_shape: tuple[int, ...], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 12, 40)
    values = rng.standard_normal((ids.size, *row_shape)).astype(dtype)
    before = values.copy()
    uniq, inverse = np.unique(ids, return_inverse=True)
    want_ids, want = reference_sum(values, ids)
    for load in (True, False):
        got = sum_rows(values, inverse, uniq.size, load=load)
        assert got.dtype == values.dtype and got.shape == (uniq.size, *row_shape)
        np.testing.assert_array_equal(got, want)  # the same additions, the same order
        # into a given array (a region's rows): every row written, nothing else
        room = np.full(uniq.size * int(np.prod(row_shape)) + 5, np.nan, dtype)
        out = room[: uniq.size * int(np.prod(row_shape))].reshape(uniq.size, *row_shape)
        assert sum_rows(values, inverse, uniq.size, load=load, out=out) is out
        np.testing.assert_array_equal(out, want)
        assert np.isnan(room[-5:]).all()
    np.testing.assert_array_equal(values, before)  # the input is left alone
    assert np.array_equal(want_ids, uniq)


def test_sum_rows_refuses_an_out_of_another_shape_or_dtype() -> None:
    values = np.ones((4, 3), np.float32)
    inverse = np.array([0, 1, 0, 2])
    for out in (
        np.empty((2, 3), np.float32),
        np.empty((3, 3), np.float64),
        np.empty((3, 6), np.float32)[:, ::2],  # not contiguous
    ):
        with pytest.raises(ValueError, match="out"):
            sum_rows(values, inverse, 3, out=out)


def test_sum_rows_without_duplicates_is_a_permutation() -> None:
    ids = np.array([9, 2, 7, 0])
    values = np.arange(8, dtype=np.float32).reshape(4, 2)
    uniq, inverse = np.unique(ids, return_inverse=True)
    got = sum_rows(values, inverse, uniq.size)
    np.testing.assert_array_equal(got, values[np.argsort(ids)])


def test_sum_rows_empty_and_other_dtypes() -> None:
    empty = sum_rows(np.empty((0, 3), np.float32), np.empty(0, np.int64), 0)
    assert empty.shape == (0, 3) and empty.dtype == np.float32
    # float16 has no kernel: the sorted-runs path, the same sums
    ids = np.array([3, 1, 3, 3, 1])
    values = np.arange(10, dtype=np.float16).reshape(5, 2)
    uniq, inverse = np.unique(ids, return_inverse=True)
    _, want = reference_sum(values, ids)
    got = sum_rows(values, inverse, uniq.size)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="inverse"):
        sum_rows(values, inverse[:-1], uniq.size)


def test_sum_rows_not_contiguous_input() -> None:
    rng = np.random.default_rng(3)
    wide = rng.standard_normal((30, 6)).astype(np.float32)
    values = wide[:, ::2]  # a strided view
    ids = rng.integers(0, 5, 30)
    uniq, inverse = np.unique(ids, return_inverse=True)
    np.testing.assert_array_equal(
        sum_rows(values, inverse, uniq.size), reference_sum(values, ids)[1]
    )


def test_load_kernels_once() -> None:
    load_kernels()
    load_kernels()
    assert segments._loaded


# ---------------------------------------------------------------- the PS's dedup


def test_summed_rows_keeps_strictly_increasing_keys_as_they_are() -> None:
    keys = np.array([0, 4, 9], np.int64)
    grads = np.ones((3, 2), np.float32)
    k, g = summed_rows(keys, grads)
    assert k is keys and g is grads  # no sort, no copy: what clients send
    k, g = summed_rows(keys[:0], grads[:0])
    assert k.size == 0 and g.shape == (0, 2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_summed_rows_unsorted_and_repeated_keys(dtype: type) -> None:
    keys = np.array([5, 1, 5, 0, 1, 5], np.int64)
    grads = np.random.default_rng(1).standard_normal((6, 3)).astype(dtype)
    k, g = summed_rows(keys, grads)
    assert k.tolist() == [0, 1, 5]
    want = np.zeros((3, 3), np.promote_types(dtype, np.float32))
    np.add.at(want, np.searchsorted(k, keys), grads)
    assert g.dtype == want.dtype
    np.testing.assert_allclose(g, want, rtol=1e-6)
    # an unsorted batch without repeats: the same rows, sorted
    k2, g2 = summed_rows(np.array([7, 2], np.int64), np.array([[1.0], [2.0]], np.float32))
    assert k2.tolist() == [2, 7] and g2.ravel().tolist() == [2.0, 1.0]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_shards_row_update_matches_numpy_at_its_edges(optimizer: str) -> None:
    """Rows at both ends of a shard, repeated and unsorted, through ShardStore.apply_rows,
    against the same rows updated with their gradients summed by np.add.at."""
    opt: dict[str, Any] = {"name": optimizer, "lr": 0.1}
    d = ShardDef(0, "e", 1, "float32", (40, 3), 10, 20, {"name": "ones"}, opt, sparse=True)
    store, ref = ShardStore(), ShardStore()
    store.create([d])
    ref.create([d])
    ids = np.array([29, 10, 29, 15, 10, 29], np.int64)  # the first and last row of [10, 30)
    grads = np.random.default_rng(2).standard_normal((ids.size, 3)).astype(np.float32)
    store.apply_rows(0, ids, grads, 0)
    uniq = np.unique(ids)
    summed = np.zeros((uniq.size, 3), np.float32)
    np.add.at(summed, np.searchsorted(uniq, ids), grads)
    ref.apply_rows(0, uniq, summed, 0)  # strictly increasing: no dedup on this side
    np.testing.assert_array_equal(store.get(0).values, ref.get(0).values)
    for name, slot in store.get(0).slots.items():
        np.testing.assert_array_equal(slot, ref.get(0).slots[name])
    untouched = np.setdiff1d(np.arange(20), uniq - 10)
    np.testing.assert_array_equal(store.get(0).values[untouched], 1.0)
    # an empty push moves the version only
    assert store.apply_rows(0, np.empty(0, np.int64), np.empty((0, 3), np.float32), 1)[0] == 2
    with pytest.raises(InvalidArgument):  # one past the shard's last row
        store.apply_rows(0, np.array([30]), np.ones((1, 3), np.float32), 0)


# ---------------------------------------------------------------- the client's plan


def test_a_steps_push_reuses_its_pulls_plan_and_sends_ascending_slices() -> None:
    async def body() -> None:
        c = await make_cluster(ALL, 2, 3)
        client = c.client(wrap=Recorder)
        starts = sorted(s.row_start for s in c.placement.shards_of("emb"))
        # every shard's first and last row, repeated, unsorted
        edges = [s - 1 for s in starts[1:]] + starts + [22]
        ids = np.array(edges + edges[::-1] + [edges[0]], np.int64)
        rows = await client.pull_rows("emb", ids)
        np.testing.assert_array_equal(rows, initial(EMB)[ids])
        made = client._row_plans["emb"]
        g = np.random.default_rng(4).standard_normal((ids.size, 3)).astype(np.float32)
        assert await client.push_rows("emb", ids, g)
        assert client._row_plans["emb"] is made  # the same batch: the same plan
        summed = np.zeros((23, 3), np.float32)
        np.add.at(summed, ids, g)
        want = initial(EMB)
        touched = np.unique(ids)
        want[touched] -= np.float32(0.1) * summed[touched]
        np.testing.assert_allclose(await client.pull_rows("emb", np.arange(23)), want, rtol=1e-6)
        joined = 0
        for r in recorders(client):
            for op, sent_body, ts in r.sent:
                if "counts" in sent_body:  # every shard's ids in one: as the PS splits them
                    joined += 1
                    ts = list(split_index(Message(op, body=sent_body, tensors=tuple(ts))).tensors)
                for t in ts:
                    if t.kind == "index":  # ascending, distinct: the PS sorts nothing
                        assert bool((np.diff(t.array) > 0).all())
                        s = next(x for x in c.placement.shards if x.id == t.ref)
                        assert s.row_start <= t.array.min() and t.array.max() < s.row_start + s.rows
        assert joined  # once a PS said it takes them joined

    run(body())


def test_a_batch_refilled_in_place_gets_a_plan_of_its_own() -> None:
    async def body() -> None:
        c = await make_cluster(ALL, 1, 2)
        client = c.client()
        ids = np.array([1, 2, 2], np.int64)
        await client.pull_rows("emb", ids)
        ids[:] = [20, 21, 21]  # the caller's array, refilled
        g = np.ones((3, 3), np.float32)
        await client.push_rows("emb", ids, g)
        got = await client.pull_rows("emb", np.array([1, 2, 20, 21]))
        want = initial(EMB)[[1, 2, 20, 21]]
        want[2] -= np.float32(0.1)
        want[3] -= np.float32(0.2)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        # an empty batch: nothing sent, an empty answer
        assert (await client.pull_rows("emb", [])).shape == (0, 3)
        assert await client.push_rows("emb", [], np.empty((0, 3), np.float32))

    run(body())


def test_rows_push_holds_nothing_of_the_callers_arrays() -> None:
    async def body() -> None:
        c = await make_cluster(ALL, 2, 3)
        client = c.client()
        ids = np.array([3, 3, 8], np.int64)
        g = np.ones((3, 3), np.float32)
        ready = client.rows_push("emb", ids, g)
        ids[:] = 0
        g[:] = 100.0  # refilled before the push is sent
        assert await client.send_rows(ready)
        got = await client.pull_rows("emb", np.array([3, 8]))
        np.testing.assert_allclose(
            got, initial(EMB)[[3, 8]] - np.float32(0.1) * np.array([[2.0], [1.0]], np.float32)
        )
        with pytest.raises(InvalidArgument, match="shape"):
            client.rows_push("emb", ids, g[:2])

    run(body())


def test_hash_table_rows_grouped_by_shard_and_summed() -> None:
    emb = VariableDef("h", (64, 2), optimizer={"name": "sgd", "lr": 0.5}, table={})
    placement = plan([emb], 3, Partitioner(), optimizer={"name": "sgd", "lr": 0.1})

    async def body() -> None:
        c = await created_cluster(placement, 3, None)
        client = c.client("w0")
        ids = np.array([7, -1, 2**62, 7, 0, -(2**63), 99, -1, 7], np.int64)
        rows = await client.pull_rows("h", ids)
        want = initial_rows(emb.init, "h", ids, 2, "float32")
        np.testing.assert_array_equal(rows, want)
        made = client._row_plans["h"]
        buckets = bucket_of(made.uniq, 64)
        shards = sorted(placement.shards_of("h"), key=lambda s: s.row_start)
        for parts in made.parts.values():
            for s, lo, hi in parts:
                run_ = made.uniq[lo:hi]
                assert bool((run_[1:] > run_[:-1]).all())  # (np.diff would overflow)
                k = shards.index(s)
                assert (
                    (buckets[lo:hi] >= s.row_start) & (buckets[lo:hi] < s.row_start + s.rows)
                ).all(), k
        np.testing.assert_array_equal(made.uniq[made.inverse], ids)
        g = np.arange(ids.size * 2, dtype=np.float32).reshape(ids.size, 2)
        assert await client.push_rows("h", ids, g)
        after = await client.pull_rows("h", ids)
        _, summed = reference_sum(g, ids)
        by_id = dict(zip(np.unique(ids).tolist(), summed, strict=True))
        for k, i in enumerate(ids.tolist()):
            np.testing.assert_allclose(after[k], want[k] - 0.5 * by_id[i], rtol=1e-6)

    run(body())


# ---------------------------------------------------------------- the codec's dtype names


def test_wire_names_and_bfloat16_test() -> None:
    assert wire_dtype(np.dtype(np.float32)) == "float32" == wire_dtype(np.dtype(np.float32))
    assert wire_dtype(np.dtype(np.int64)) == "int64"
    assert not is_bfloat16(np.dtype(np.float32)) and not is_bfloat16("float32")
    assert is_bfloat16("bfloat16")
    from zmqps.wire.codec import bfloat16

    assert is_bfloat16(bfloat16()) and wire_dtype(bfloat16()) == "bfloat16"
    with pytest.raises(Exception, match="not allowed"):
        wire_dtype(np.dtype(">f4"))
    with pytest.raises(Exception, match="not allowed"):  # refused every time, never kept
        wire_dtype(np.dtype(">f4"))
