"""The simulator's exactness check on a shard's values: float32 rounding of the mean
passes, a step missed or applied twice, and a NaN, do not."""

from __future__ import annotations

import numpy as np
import pytest

from zmqps.bench.scale_sim import values_off


def _steps_of_mean(n: int, steps: int) -> np.ndarray:
    """What a PS holds after ``steps`` sync steps of SGD (lr 1) on the mean of ``n``
    gradients of ones, computed as it does: the sum times ``1 / n``, in float32."""
    value = np.zeros(4, np.float32)
    total = np.full(4, n, np.float32)
    for _ in range(steps):
        value -= total * (1.0 / n)
    return value


@pytest.mark.parametrize("n", [1, 3, 950, 1000, 4999])
def test_the_mean_of_n_ones_rounded_in_float32_passes(n: int) -> None:
    held = _steps_of_mean(n, 100)
    assert values_off(held, 100) is None


def test_950_ones_is_not_exactly_one_so_an_exact_check_would_fail() -> None:
    # why the check has a tolerance: 100 steps of it end off -100
    assert not np.array_equal(_steps_of_mean(950, 100), np.full(4, -100, np.float32))


@pytest.mark.parametrize("steps_applied", [99, 101])
def test_a_step_missed_or_applied_twice_is_reported(steps_applied: int) -> None:
    held = _steps_of_mean(950, steps_applied)
    assert "not -100" in (values_off(held, 100) or "")


def test_nan_is_reported() -> None:
    held = _steps_of_mean(950, 100)
    held[2] = np.nan
    assert values_off(held, 100) is not None
