"""Initializers: determinism, sharding independence, distributions, validation."""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqps.core.initializers import BLOCK_ELEMS, INITIALIZERS, fans, initialize, validate_init
from zmqps.wire.errors import InvalidArgument

RANDOM = [name for name, kind in INITIALIZERS.items() if kind.random]


def whole(
    init: dict[str, Any], shape: tuple[int, ...], dtype: str = "float32", var: str = "w"
) -> np.ndarray:
    return initialize(init, var, shape, dtype, 0, shape[0])


@pytest.mark.parametrize("name", sorted(INITIALIZERS))
def test_shape_dtype_contiguous(name: str) -> None:
    for dtype in ("float16", "float32", "float64"):
        out = initialize({"name": name, "seed": 1}, "v", (10, 3, 4), dtype, 2, 5)
        assert out.shape == (5, 3, 4)
        assert out.dtype == np.dtype(dtype)
        assert out.flags.c_contiguous
        assert np.isfinite(out).all()


@pytest.mark.parametrize("name", RANDOM)
def test_sharding_independent_bitwise(name: str) -> None:
    # rows of 1000 elements: blocks of BLOCK_ELEMS straddle row boundaries
    shape = (150, 1000)
    init = {"name": name, "seed": 7}
    full = whole(init, shape)
    cuts = [0, 1, 65, 66, 100, 149, 150]
    parts = [initialize(init, "w", shape, "float32", a, b - a) for a, b in pairwise(cuts)]
    assert np.array_equal(np.concatenate(parts), full)
    assert full.tobytes() == np.concatenate(parts).tobytes()


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 300),
    width=st.integers(1, 700),
    data=st.data(),
)
def test_random_splits_concatenate(rows: int, width: int, data: st.DataObject) -> None:
    init = {"name": "truncated_normal", "seed": 3, "stddev": 2.0}
    full = whole(init, (rows, width), "float64")
    cuts = sorted({*data.draw(st.lists(st.integers(0, rows), max_size=5)), 0, rows})
    parts = [initialize(init, "w", (rows, width), "float64", a, b - a) for a, b in pairwise(cuts)]
    assert np.array_equal(np.concatenate(parts), full)


def test_deterministic_and_keyed_by_seed_and_name() -> None:
    init = {"name": "normal", "seed": 5}
    a = whole(init, (64, 64))
    assert np.array_equal(a, whole(init, (64, 64)))
    assert not np.array_equal(a, whole({"name": "normal", "seed": 6}, (64, 64)))
    assert not np.array_equal(a, whole(init, (64, 64), var="other"))
    # blocks differ from each other
    big = whole(init, (2 * BLOCK_ELEMS // 8, 8)).reshape(-1)
    assert not np.array_equal(big[:BLOCK_ELEMS], big[BLOCK_ELEMS:])


def test_default_seed_is_zero_and_negative_seed_ok() -> None:
    assert np.array_equal(
        whole({"name": "uniform"}, (9,)), whole({"name": "uniform", "seed": 0}, (9,))
    )
    assert whole({"name": "uniform", "seed": -1}, (9,)).shape == (9,)


def test_dtypes_agree_up_to_rounding() -> None:
    init = {"name": "he_normal", "seed": 2}
    f64 = whole(init, (40, 30), "float64")
    assert np.array_equal(whole(init, (40, 30), "float32"), f64.astype(np.float32))
    assert np.array_equal(whole(init, (40, 30), "float16"), f64.astype(np.float16))


def test_constants() -> None:
    assert (whole({"name": "zeros"}, (3, 2)) == 0).all()
    assert (whole({"name": "ones"}, (3, 2)) == 1).all()
    assert (whole({"name": "constant", "value": -2.5}, (3, 2)) == -2.5).all()


def test_fans_like_keras() -> None:
    assert fans((7,)) == (7, 7)
    assert fans((3, 5)) == (3, 5)
    assert fans((3, 3, 16, 32)) == (9 * 16, 9 * 32)


def test_distribution_moments() -> None:
    shape = (500, 400)
    fan_in, fan_out = shape
    u = whole({"name": "uniform", "low": -1.0, "high": 3.0}, shape, "float64")
    assert u.min() >= -1 and u.max() < 3 and abs(u.mean() - 1) < 0.02
    n = whole({"name": "normal", "mean": 2.0, "stddev": 0.5}, shape, "float64")
    assert abs(n.mean() - 2) < 0.01 and abs(n.std() - 0.5) < 0.01
    t = whole({"name": "truncated_normal", "mean": 1.0, "stddev": 0.5}, shape, "float64")
    assert t.min() >= 0.0 and t.max() <= 2.0 and abs(t.std() - 0.5 * 0.8796) < 0.01
    gu = whole({"name": "glorot_uniform"}, shape, "float64")
    limit = math.sqrt(6 / (fan_in + fan_out))
    assert abs(gu).max() <= limit and abs(gu).max() > 0.99 * limit
    for name, var in [
        ("glorot_normal", 2 / (fan_in + fan_out)),
        ("he_normal", 2 / fan_in),
        ("lecun_normal", 1 / fan_in),
        ("he_uniform", 2 / fan_in),
        ("lecun_uniform", 1 / fan_in),
    ]:
        x = whole({"name": name, "seed": 11}, shape, "float64")
        assert abs(x.var() / var - 1) < 0.03, name
        if name.endswith("normal"):  # truncated at 2 of the underlying stddevs
            assert abs(x).max() <= 2 * math.sqrt(var) / 0.87962566103423978 + 1e-12


@pytest.mark.parametrize(
    "init",
    [
        {"name": "nope"},
        {},
        {"name": 3},
        {"name": "normal", "stddev": -1.0},
        {"name": "uniform", "low": 1.0, "high": 0.0},
        {"name": "uniform", "low": -1e308, "high": 1e308},  # was an internal error
        {"name": "zeros", "value": 1.0},
        {"name": "glorot_uniform", "stddev": 1.0},
        {"name": "normal", "mean": float("nan")},
        {"name": "normal", "mean": True},
        {"name": "normal", "seed": 1.5},
        {"name": "normal", "seed": 2**64},
    ],
)
def test_validate_refuses(init: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        validate_init(init)
    with pytest.raises(InvalidArgument):
        initialize(init, "w", (4,), "float32", 0, 4)


def test_validate_accepts_aliases_and_seed_everywhere() -> None:
    validate_init({"name": "random_normal", "seed": 3, "stddev": 1.0})
    validate_init({"name": "zeros", "seed": 3})


def test_bad_ranges_and_dtypes() -> None:
    with pytest.raises(InvalidArgument):
        initialize({"name": "zeros"}, "w", (4,), "int32", 0, 4)
    with pytest.raises(InvalidArgument):
        initialize({"name": "zeros"}, "w", (4,), "float32", 2, 3)
    with pytest.raises(InvalidArgument):  # overflows float16
        initialize({"name": "constant", "value": 1e6}, "w", (4,), "float16", 0, 4)
    with pytest.raises(InvalidArgument):
        initialize({"name": "uniform", "low": 1e5, "high": 2e5}, "w", (4,), "float16", 0, 4)
