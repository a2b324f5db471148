"""core/segments.sum_runs: each run's rows added first to last, whatever the runs."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqps.core.segments import MAX_PASSES, sum_runs


def sequential(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The reference: a Python loop adding each run's rows in order."""
    ends = [*starts[1:].tolist(), values.shape[0]]
    out = []
    for lo, hi in zip(starts, ends, strict=True):
        acc = values[lo].copy()
        for r in range(lo + 1, hi):
            acc += values[r]
        out.append(acc)
    return np.stack(out)


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, MAX_PASSES + 8), min_size=1, max_size=60),
    width=st.integers(1, 5),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_runs_are_summed_in_order(lengths: list[int], width: int, dtype: type, seed: int) -> None:
    n = sum(lengths)
    values = np.random.default_rng(seed).standard_normal((n, width)).astype(dtype)
    starts = np.cumsum([0, *lengths[:-1]])
    got = sum_runs(values, starts)
    want = sequential(values, starts)
    assert got.shape == (len(lengths), width) and got.dtype == values.dtype
    if max(lengths) <= MAX_PASSES:
        np.testing.assert_array_equal(got, want)  # the same additions in the same order
    else:  # reduceat: the same sums, rounded its own way
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rows_of_any_shape_and_the_input_left_alone() -> None:
    values = np.arange(24, dtype=np.float32).reshape(6, 2, 2)
    before = values.copy()
    got = sum_runs(values, np.array([0, 1, 4]))
    np.testing.assert_array_equal(got[0], values[0])
    np.testing.assert_array_equal(got[1], values[1] + values[2] + values[3])
    np.testing.assert_array_equal(got[2], values[4] + values[5])
    np.testing.assert_array_equal(values, before)
    single = sum_runs(values, np.arange(6))  # no repeats: a copy of the rows
    np.testing.assert_array_equal(single, values)
    assert not np.shares_memory(single, values)
