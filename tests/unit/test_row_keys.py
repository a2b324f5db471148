"""The compiled paths of a fixed-size shard's row ids (``local_rows``: range check and
local keys in one pass; ``increasing``: whether a push's keys need summing) give what
the numpy paths give, and refuse what they refuse."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from zmqps.core import _kernels, optimizers
from zmqps.core.optimizers import make_optimizer
from zmqps.core.store import ShardStore, summed_rows
from zmqps.core.variables import ShardDef
from zmqps.wire.errors import InvalidArgument


def _shard(row_start: int = 100, rows: int = 50) -> Any:
    store = ShardStore()
    d = ShardDef(
        id=2,
        var="emb",
        index=2,
        dtype="float32",
        full_shape=(1000, 4),
        row_start=row_start,
        rows=rows,
        init={"name": "normal", "seed": 3},
        optimizer={"name": "sgd", "lr": 0.1},
        sparse=True,
    )
    store.create([d])
    return store.get(2)


def _numpy_keys(shard: Any, ids: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as m:
        m.setattr(_kernels, "index_kernel", lambda name, ids: None)
        try:
            return shard.row_keys(ids)
        except InvalidArgument as e:
            return str(e)


def test_the_kernels_are_there() -> None:
    ids = np.zeros(3, np.int64)
    assert _kernels.index_kernel("local_rows", ids) is not None
    assert _kernels.index_kernel("increasing", ids) is not None
    assert _kernels.index_kernel("local_rows", ids.astype(np.int32)) is None


def test_row_keys_match_the_numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    shard = _shard()
    rng = np.random.default_rng(4)
    cases = [
        np.zeros(0, np.int64),
        np.array([100], np.int64),
        np.array([149], np.int64),
        np.array([149, 100, 100, 120], np.int64),
        np.array([99], np.int64),
        np.array([150], np.int64),
        np.array([100, 120, 150], np.int64),
        np.array([-1, 100], np.int64),
        np.array([np.iinfo(np.int64).min, 100], np.int64),
        np.array([np.iinfo(np.int64).max], np.int64),
    ]
    cases += [rng.integers(90, 160, int(rng.integers(1, 40))) for _ in range(200)]
    for ids in cases:
        want = _numpy_keys(shard, ids, monkeypatch)
        try:
            got = shard.row_keys(ids)
        except InvalidArgument as e:
            got = str(e)
        if isinstance(want, str):
            assert got == want, ids
        else:
            assert isinstance(got, np.ndarray) and got.dtype == np.int64
            assert np.array_equal(got, want), ids
            assert np.array_equal(got, ids - 100)


@pytest.mark.parametrize("dtype", [np.int32, np.uint64, np.int16])
def test_other_id_dtypes_keep_the_numpy_path(dtype: Any) -> None:
    shard = _shard()
    ids = np.array([100, 149, 120], dtype)
    assert np.array_equal(shard.row_keys(ids), [0, 49, 20])
    with pytest.raises(InvalidArgument, match="outside"):
        shard.row_keys(np.array([150], dtype))


def test_summed_rows_matches_the_numpy_check(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(9)
    for n in (0, 1, 2, 3, 17, 200):
        for kind in ("increasing", "repeated", "shuffled"):
            keys = np.sort(rng.choice(1000, n, replace=False)).astype(np.int64)
            if kind == "repeated" and n > 1:
                keys[n // 2] = keys[n // 2 - 1]
            elif kind == "shuffled":
                rng.shuffle(keys)
            grads = rng.normal(size=(n, 5)).astype(np.float32)
            k1, g1 = summed_rows(keys, grads)
            with monkeypatch.context() as m:
                m.setattr(_kernels, "index_kernel", lambda name, ids: None)
                k2, g2 = summed_rows(keys, grads)
            assert np.array_equal(k1, k2) and g1.tobytes() == g2.tobytes()
            strictly = n < 2 or bool((keys[1:] > keys[:-1]).all())
            assert (k1 is keys and g1 is grads) == strictly


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad", "adam"])
def test_checked_apply_rows_gives_the_same_bits(name: str) -> None:
    opt = make_optimizer({"name": name, "lr": 0.05})
    rng = np.random.default_rng(1)
    p1 = rng.normal(size=(300, 6)).astype(np.float32)
    p2 = p1.copy()
    s1 = opt.init_slots(p1.shape, "float32")
    s2 = {k: v.copy() for k, v in s1.items()}
    for step in range(1, 4):
        rows = np.sort(rng.choice(300, 40, replace=False)).astype(np.int64)
        g = rng.normal(size=(40, 6)).astype(np.float32)
        opt.apply_rows(p1, rows, g, s1, step)
        opt.apply_rows(p2, rows, g, s2, step, checked=True)
    assert p1.tobytes() == p2.tobytes()
    assert all(s1[k].tobytes() == s2[k].tobytes() for k in s1)
    with pytest.raises(InvalidArgument):  # unchecked: the range is still read
        opt.apply_rows(p1, np.array([300]), np.ones((1, 6), np.float32), s1, 4)
    assert optimizers.USE_KERNELS


def _np_unique(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    uniq, inverse = np.unique(ids, return_inverse=True)
    return uniq, inverse.reshape(-1)


def test_unique_inverse_is_numpys() -> None:
    from zmqps.core.segments import load_kernels, unique_inverse

    load_kernels()
    rng = np.random.default_rng(12)
    big = np.int64(1) << np.int64(50)
    cases = [np.zeros(0, np.int64), np.array([7], np.int64), np.array([3, 3], np.int64)]
    cases += [np.array([5, -2, 5, 0, -2, 9], np.int64), np.array([big, -big, 0, big], np.int64)]
    cases += [rng.integers(0, 1_000_000, 4096) for _ in range(20)]
    cases += [rng.integers(0, 30, int(rng.integers(2, 3000))) for _ in range(20)]
    cases += [rng.integers(-(10**12), 10**12, 5000) for _ in range(5)]
    # too large to pack with a position: numpy's path, the same answer
    cases += [rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 1000)]
    cases += [np.array([np.iinfo(np.int64).max, 3, np.iinfo(np.int64).min, 3], np.int64)]
    for ids in cases:
        want_u, want_i = _np_unique(ids)
        for load in (True, False):
            u, i = unique_inverse(ids, load=load)
            assert u.dtype == want_u.dtype and i.dtype == want_i.dtype
            assert np.array_equal(u, want_u) and np.array_equal(i, want_i), ids
            assert np.array_equal(u[i], ids)


def test_unique_inverse_of_other_arrays_is_numpys() -> None:
    from zmqps.core.segments import unique_inverse

    ids = np.random.default_rng(2).integers(0, 100, 400)
    strided, readonly = ids[::2], ids.copy()
    readonly.setflags(write=False)
    for a in (strided, readonly, ids.astype(np.int32), ids.astype(np.uint64)):
        assert _kernels.index_kernel("pack_positions", a) is None
        u, i = unique_inverse(a)
        want_u, want_i = _np_unique(a)
        assert np.array_equal(u, want_u) and np.array_equal(i, want_i)


def test_same_ids_is_array_equal() -> None:
    from zmqps.core.segments import load_kernels, same_ids

    load_kernels()
    rng = np.random.default_rng(3)
    a = rng.integers(0, 1000, 500)
    cases = [a.copy(), a[:-1].copy(), np.zeros(0, np.int64), a[::-1].copy()]
    for k in (0, 250, 499):
        b = a.copy()
        b[k] += 1
        cases.append(b)
    readonly = a.copy()
    readonly.setflags(write=False)
    cases += [readonly, a.astype(np.int32), np.concatenate([a, a])[::2]]
    for b in cases:
        for load in (True, False):
            assert same_ids(a, b, load=load) == np.array_equal(a, b)
            assert same_ids(b, a, load=load) == np.array_equal(a, b)
    assert same_ids(np.zeros(0, np.int64), np.zeros(0, np.int64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_sum_in_sorted_order_gives_the_same_bits(dtype: Any) -> None:
    """sum_rows following the sorted ids (each distinct id's row written once) adds a
    repeated id's rows in the batch's order, as the inverse path does: the same bits."""
    from zmqps.core.segments import load_kernels, sum_rows, unique_sorted

    load_kernels()
    rng = np.random.default_rng(8)
    for n, high in [(1, 5), (2, 1), (7, 3), (500, 50), (4096, 1_000_000), (3000, 40)]:
        ids = rng.integers(0, high, n)
        grads = rng.standard_normal((n, 9)).astype(dtype) * 1e3
        uniq, inverse, order = unique_sorted(ids)
        assert (order is None) == (n == 1)  # one id: nothing to sort
        want = sum_rows(grads, inverse, uniq.shape[0])
        got = sum_rows(grads, inverse, uniq.shape[0], order=order)
        assert got.tobytes() == want.tobytes()
        out = np.full_like(want, np.nan)
        assert sum_rows(grads, inverse, uniq.shape[0], out=out, order=order) is out
        assert out.tobytes() == want.tobytes()
        # the reference: each id's rows added one after the other, in the batch's order
        ref = np.zeros_like(want)
        for i in range(n):
            ref[inverse[i]] += grads[i]
        np.testing.assert_allclose(got, ref, rtol=1e-6)
    # ids too large to pack: no order, the inverse path
    assert unique_sorted(np.array([2**62, 1], np.int64))[2] is None
