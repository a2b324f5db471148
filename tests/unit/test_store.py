"""ShardStore: creation, snapshots, dense and row updates, validation, staleness, no-alloc."""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from itertools import pairwise
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqps.core.initializers import initialize
from zmqps.core.store import HISTOGRAM_EXACT, ShardStore, StalenessStats
from zmqps.core.variables import ShardDef
from zmqps.wire.errors import InvalidArgument, NotFound, RolledBack

ADAM = {"name": "adam", "lr": 0.01}


def sdef(
    sid: int = 0,
    *,
    var: str = "w",
    full_shape: tuple[int, ...] = (10, 4),
    row_start: int = 0,
    rows: int | None = None,
    dtype: str = "float32",
    init: dict[str, Any] | None = None,
    optimizer: dict[str, Any] | None = None,
    sparse: bool = False,
) -> ShardDef:
    return ShardDef(
        id=sid,
        var=var,
        index=sid,
        dtype=dtype,
        full_shape=full_shape,
        row_start=row_start,
        rows=full_shape[0] - row_start if rows is None else rows,
        init=init or {"name": "normal", "seed": 1},
        optimizer=optimizer or {"name": "sgd", "lr": 0.1},
        sparse=sparse,
    )


def checksum(store: ShardStore) -> str:
    h = hashlib.sha256()
    for s in store:
        h.update(s.values.tobytes())
        for k in sorted(s.slots):
            h.update(s.slots[k].tobytes())
        h.update(str(s.version).encode())
    return h.hexdigest()


# -- creation -----------------------------------------------------------------


def test_create_get_and_sizes() -> None:
    store = ShardStore()
    store.create([sdef(0, optimizer=ADAM), sdef(1, var="b", full_shape=(3,))])
    assert store.ids() == [0, 1] and 0 in store and 2 not in store and len(store) == 2
    s = store.get(0)
    assert s.values.shape == (10, 4) and s.version == 0
    assert set(s.slots) == {"m", "v"} and s.slots["m"].shape == (10, 4)
    assert store.nbytes() == 3 * 40 * 4 + 3 * 4
    with pytest.raises(NotFound):
        store.get(7)


def test_create_idempotent_and_conflicts() -> None:
    store = ShardStore()
    store.create([sdef(0)])
    store.apply_dense(0, [(0, np.ones(40, np.float32))], 0)
    before = checksum(store)
    store.create([sdef(0), sdef(0)])  # identical: no-op, values kept
    assert checksum(store) == before
    with pytest.raises(InvalidArgument):
        store.create([sdef(0, rows=5)])
    with pytest.raises(InvalidArgument):  # conflicting pair in one call: nothing created
        store.create([sdef(1), sdef(1, var="other")])
    assert store.ids() == [0] and checksum(store) == before


@pytest.mark.parametrize(
    "bad",
    [
        sdef(5, optimizer={"name": "nope", "lr": 1.0}),
        sdef(5, optimizer={"name": "sgd"}),
        sdef(5, init={"name": "nope"}),
        sdef(5, init={"name": "normal", "stddev": -1.0}),
        sdef(5, dtype="float16", init={"name": "constant", "value": 1e9}),
    ],
)
def test_create_all_or_nothing(bad: ShardDef) -> None:
    store = ShardStore()
    with pytest.raises(InvalidArgument):
        store.create([sdef(0), bad])
    assert len(store) == 0


def test_init_equal_across_shardings() -> None:
    full = (33, 5, 3)
    init = {"name": "glorot_uniform", "seed": 9}
    one, three = ShardStore(), ShardStore()
    one.create([sdef(0, full_shape=full, init=init)])
    cuts = [0, 11, 12, 33]
    three.create(
        [
            sdef(i, full_shape=full, init=init, row_start=a, rows=b - a)
            for i, (a, b) in enumerate(pairwise(cuts))
        ]
    )
    joined = np.concatenate([three.snapshot(i)[1] for i in range(3)])
    assert np.array_equal(joined, one.snapshot(0)[1])


# -- dense ------------------------------------------------------------------


def test_snapshot_is_a_copy() -> None:
    store = ShardStore()
    store.create([sdef(0)])
    version, snap = store.snapshot(0)
    store.apply_dense(0, [(0, np.ones(40, np.float32))], 0)
    assert version == 0 and not np.array_equal(snap, store.get(0).values)
    out = np.empty((10, 4), np.float32)
    assert store.snapshot_into(0, out) == 1 and np.array_equal(out, store.get(0).values)
    with pytest.raises(InvalidArgument):
        store.snapshot_into(0, np.empty((10, 4), np.float64))


@settings(max_examples=30, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 299), max_size=6, unique=True),
    chunk_elems=st.integers(1, 400),
    seed=st.integers(0, 2**16),
)
def test_apply_dense_any_chunking_matches_one_chunk(
    cuts: list[int], chunk_elems: int, seed: int
) -> None:
    d = sdef(0, full_shape=(30, 10), optimizer=ADAM, dtype="float64")
    ref, store = ShardStore(), ShardStore(chunk_elems=chunk_elems)
    ref.create([d])
    store.create([d])
    rng = np.random.default_rng(seed)
    bounds = [0, *sorted(cuts), 300]
    for _ in range(2):
        grad = rng.standard_normal(300)
        chunks = [(a, grad[a:b]) for a, b in pairwise(bounds)]
        rng.shuffle(chunks)
        store.apply_dense(0, chunks, 0, scale=0.5)
        ref.apply_dense(0, [(0, grad)], 0, scale=0.5)
    np.testing.assert_allclose(store.get(0).values, ref.get(0).values, rtol=1e-13)
    for k in ("m", "v"):
        np.testing.assert_allclose(store.get(0).slots[k], ref.get(0).slots[k], rtol=1e-13)


def test_apply_dense_matches_reference_sgd_and_adam() -> None:
    store = ShardStore(chunk_elems=7)
    store.create(
        [
            sdef(0, optimizer={"name": "sgd", "lr": 0.1, "weight_decay": 0.1}, dtype="float64"),
            sdef(1, optimizer=ADAM, dtype="float64", row_start=4),
        ]
    )
    p0, p1 = store.snapshot(0)[1].reshape(-1), store.snapshot(1)[1].reshape(-1)
    m, v = np.zeros_like(p1), np.zeros_like(p1)
    rng = np.random.default_rng(3)
    for t in (1, 2, 3):
        g0, g1 = rng.standard_normal(40), rng.standard_normal(24).astype(np.float32)
        assert store.apply_dense(0, [(20, g0[20:]), (0, g0[:20])], t - 1, scale=0.5) == (t, 0)
        assert store.apply_dense(1, [(0, g1)], 0) == (t, t - 1)
        p0 -= 0.1 * (0.5 * g0 + 0.1 * p0)
        g = g1.astype(np.float64)
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        p1 -= 0.01 * np.sqrt(1 - 0.999**t) / (1 - 0.9**t) * m / (np.sqrt(v) + 1e-8)
    np.testing.assert_allclose(store.get(0).values.reshape(-1), p0, rtol=1e-12)
    np.testing.assert_allclose(store.get(1).values.reshape(-1), p1, rtol=1e-12)


def bad_chunkings() -> list[tuple[str, Any]]:
    g = np.ones(40, np.float32)
    return [
        ("gap", [(0, g[:10]), (11, g[11:])]),
        ("overlap", [(0, g[:20]), (19, g[19:])]),
        ("short", [(0, g[:39])]),
        ("long", [(0, np.ones(41, np.float32))]),
        ("past end", [(0, g[:20]), (20, g[:20]), (40, g[:1])]),
        ("negative offset", [(-1, g[:1]), (0, g)]),
        ("int dtype", [(0, np.ones(40, np.int32))]),
        ("2-D", [(0, g.reshape(4, 10))]),
        ("empty chunk", [(0, g), (40, g[:0])]),
        ("float offset", [(0.0, g)]),
        ("list", [(0, list(g))]),
        ("none", []),
    ]


@pytest.mark.parametrize(("what", "chunks"), bad_chunkings(), ids=[w for w, _ in bad_chunkings()])
def test_apply_dense_rejects_bad_chunks_without_change(what: str, chunks: Any) -> None:
    store = ShardStore(observer=lambda d, s: pytest.fail("observer called"))
    store.create([sdef(0, optimizer=ADAM)])
    before = checksum(store)
    with pytest.raises(InvalidArgument):
        store.apply_dense(0, chunks, 0)
    assert checksum(store) == before
    assert store.stats()["updates_applied"] == 0


def test_apply_dense_rejects_bad_version_scale_and_shard() -> None:
    store = ShardStore()
    store.create([sdef(0)])
    g = [(0, np.ones(40, np.float32))]
    before = checksum(store)
    for version in (-1, True, 0.0):
        with pytest.raises(InvalidArgument):
            store.apply_dense(0, g, version)  # type: ignore[arg-type]
    with pytest.raises(RolledBack, match="ahead"):  # values it never had: pull again
        store.apply_dense(0, g, 1)
    with pytest.raises(InvalidArgument):
        store.apply_dense(0, g, 0, scale=float("nan"))
    with pytest.raises(NotFound):
        store.apply_dense(1, g, 0)
    assert checksum(store) == before


def test_staleness_and_observer() -> None:
    seen: list[tuple[int, int]] = []
    store = ShardStore(observer=lambda d, s: seen.append((d.id, s)))
    store.create([sdef(0), sdef(1)])
    g = [(0, np.zeros(40, np.float32))]
    assert store.apply_dense(0, g, 0) == (1, 0)
    assert store.apply_dense(0, g, 0) == (2, 1)
    assert store.apply_dense(0, g, 0) == (3, 2)
    assert store.apply_dense(0, g, 3) == (4, 0)
    assert store.apply_rows(1, np.array([2]), np.zeros((1, 4), np.float32), 0) == (1, 0)
    assert seen == [(0, 0), (0, 1), (0, 2), (0, 0), (1, 0)]
    stats = json.loads(json.dumps(store.stats()))
    assert stats["shards"] == 2 and stats["updates_applied"] == 5
    assert stats["bytes"] == store.nbytes()
    st_ = stats["staleness"]
    assert st_["count"] == 5 and st_["max"] == 2 and st_["mean"] == pytest.approx(3 / 5)
    assert st_["histogram"] == {"0": 3, "1": 1, "2": 1}
    assert store.versions() == {0: 4, 1: 1}


def test_staleness_histogram_overflow() -> None:
    s = StalenessStats()
    for v in (0, 63, 64, 1000):
        s.add(v)
    assert s.histogram[63] == 1 and s.histogram[HISTOGRAM_EXACT] == 2
    assert s.to_dict()["histogram"] == {"0": 1, "63": 1, "64+": 2}
    assert StalenessStats().mean == 0.0


# -- rows -------------------------------------------------------------------


def test_pull_rows_global_ids() -> None:
    store = ShardStore()
    store.create([sdef(3, full_shape=(20, 2, 3), row_start=8, rows=6)])
    full = initialize({"name": "normal", "seed": 1}, "w", (20, 2, 3), "float32", 0, 20)
    version, rows = store.pull_rows(3, np.array([13, 8, 8, 10], dtype=np.int64))
    assert version == 0 and rows.shape == (4, 2, 3)
    assert np.array_equal(rows, full[[13, 8, 8, 10]])
    rows[:] = 0  # a copy
    assert np.array_equal(store.pull_rows(3, np.array([13]))[1], full[[13]])
    assert store.pull_rows(3, np.zeros(0, np.int64))[1].shape == (0, 2, 3)
    for bad in (np.array([7]), np.array([14]), np.array([[8]]), np.array([8.0]), [8]):
        with pytest.raises(InvalidArgument):
            store.pull_rows(3, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("opt", [{"name": "sgd", "lr": 0.5}, ADAM, {"name": "adagrad", "lr": 0.1}])
def test_apply_rows_sums_duplicates_and_is_lazy(opt: dict[str, Any]) -> None:
    store, ref = ShardStore(), ShardStore()
    d = sdef(0, full_shape=(20, 3), row_start=10, rows=10, optimizer=opt, dtype="float64")
    store.create([d])
    ref.create([d])
    ids = np.array([12, 15, 12, 19, 12], dtype=np.int64)
    grad = np.arange(15, dtype=np.float32).reshape(5, 3)
    assert store.apply_rows(0, ids, grad, 0, scale=0.5) == (1, 0)
    # reference: dense update with the summed gradient, then only touched rows kept
    dense = np.zeros((10, 3))
    np.add.at(dense, ids - 10, grad.astype(np.float64))
    ref.apply_dense(0, [(0, dense.reshape(-1))], 0, scale=0.5)
    touched = [2, 5, 9]
    untouched = [i for i in range(10) if i not in touched]
    s, r = store.get(0), ref.get(0)
    np.testing.assert_allclose(s.values[touched], r.values[touched], rtol=1e-12)
    original = initialize(d.init, "w", (20, 3), "float64", 10, 10)
    assert np.array_equal(s.values[untouched], original[untouched])
    for k in s.slots:
        np.testing.assert_allclose(s.slots[k][touched], r.slots[k][touched], rtol=1e-12)
        fresh = s.optimizer.init_slots((10, 3), "float64")[k]
        assert np.array_equal(s.slots[k][untouched], fresh[untouched])


def test_apply_rows_of_1d_variable_and_empty_push() -> None:
    store = ShardStore()
    store.create([sdef(0, full_shape=(8,), init={"name": "zeros"})])
    assert store.apply_rows(0, np.zeros(0, np.int64), np.zeros(0, np.float32), 0) == (1, 0)
    assert store.apply_rows(0, np.array([3, 5, 3]), np.ones(3, np.float32), 1) == (2, 0)
    expected = np.array([0, 0, 0, -0.2, 0, -0.1, 0, 0], np.float32)  # lr 0.1, row 3 twice
    np.testing.assert_allclose(store.get(0).values, expected, rtol=1e-6)
    assert store.pull_rows(0, np.array([3]))[1].shape == (1,)


def test_apply_rows_rejects_without_change() -> None:
    store = ShardStore()
    store.create([sdef(0, full_shape=(20, 3), row_start=10, rows=10, optimizer=ADAM)])
    before = checksum(store)
    g1 = np.ones((1, 3), np.float32)
    bad_calls: list[tuple[np.ndarray, np.ndarray, int]] = [
        (np.array([9]), g1, 0),
        (np.array([20]), g1, 0),
        (np.array([10]), np.ones((1, 4), np.float32), 0),
        (np.array([10, 11]), g1, 0),
        (np.array([10]), np.ones((1, 3), np.int64), 0),
        (np.array([10.0]), g1, 0),
    ]
    for ids, g, v in bad_calls:
        with pytest.raises(InvalidArgument):
            store.apply_rows(0, ids, g, v)
    with pytest.raises(RolledBack, match="ahead"):
        store.apply_rows(0, np.array([10]), g1, 1)
    assert checksum(store) == before


# -- no allocation ----------------------------------------------------------


@pytest.mark.parametrize("opt", [{"name": "sgd", "lr": 0.1}, ADAM])
def test_apply_dense_through_store_allocates_nothing(opt: dict[str, Any]) -> None:
    n = 1 << 20
    store = ShardStore(chunk_elems=1 << 18)
    store.create([sdef(0, full_shape=(1024, 1024), optimizer=opt, init={"name": "zeros"})])
    grad = np.full(n, 0.01, np.float32)
    q = n // 4
    chunks = [
        (3 * q, grad[3 * q :]),
        (0, grad[:q]),
        (q, grad[q : 2 * q]),
        (2 * q, grad[2 * q : 3 * q]),
    ]
    store.apply_dense(0, chunks, 0)  # warm-up: grows the scratch buffer
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for v in range(1, 101):
            store.apply_dense(0, chunks, v)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
    assert store.get(0).version == 101
