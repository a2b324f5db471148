"""bfloat16 on the wire (zmqps.core.lowp): conversions with the bits of ml_dtypes, the
value check on bfloat16 bits, and updates from a bfloat16 gradient equal to updates
from the same gradient widened to float32, bit for bit."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from zmqps.core import _kernels, lowp, optimizers
from zmqps.core.finite import first_bad, first_bad_of
from zmqps.core.optimizers import make_optimizer
from zmqps.roles.threads import CheckThreads

SPECIALS = np.array(
    [0.0, -0.0, 1.0, -1.5, 1e-40, -1e-45, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan, -np.nan,
     1.00390625, 1.01171875, 2.0**32, -(2.0**32), 2.0**32 * 0.999],
    np.float32,
)  # fmt: skip


def _values(n: int = 100_003) -> np.ndarray:
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([SPECIALS, bits.view(np.float32), rng.standard_normal(n, np.float32)])


@pytest.mark.parametrize("kernels", [True, False], ids=["numba", "numpy"])
def test_narrowing_rounds_as_ml_dtypes_does_and_widening_is_exact(kernels, monkeypatch) -> None:
    if not kernels:
        monkeypatch.setattr(_kernels, "bits_kernel", lambda name: None)
    x = _values()
    with np.errstate(invalid="ignore"):
        want = x.astype(ml_dtypes.bfloat16)
    got = lowp.narrow(x)
    assert got.dtype == lowp.bfloat16()
    nan = np.isnan(x)
    assert np.array_equal(lowp.bits(got)[~nan], want.view(np.uint16)[~nan])
    assert np.isnan(got.astype(np.float32)[nan]).all()  # a NaN stays a NaN
    back = np.empty(x.shape, np.float32)
    lowp.widen_into(back, got)
    exact = want.astype(np.float32)
    assert np.array_equal(back[~nan].view(np.uint32), exact[~nan].view(np.uint32))
    assert np.isnan(back[nan]).all()
    again = lowp.narrow(back)  # widening is exact: rounding again changes nothing
    assert np.array_equal(lowp.bits(again)[~nan], lowp.bits(got)[~nan])


@pytest.mark.parametrize("kernels", [True, False], ids=["numba", "numpy"])
def test_the_value_check_of_bfloat16_finds_the_first_bad_element(kernels, monkeypatch) -> None:
    if not kernels:
        monkeypatch.setattr(_kernels, "bits_kernel", lambda name: None)
    g = lowp.narrow(np.random.default_rng(0).standard_normal(50_000).astype(np.float32))
    assert first_bad(g) is None
    for bad in (np.nan, np.inf, -np.inf, 2.0**32, -(2.0**40)):
        for at in (0, 17, 49_999):
            h = g.copy()
            h[at] = bad
            assert first_bad(h) == at, (bad, at)
    h = g.copy()
    h[7] = 2.0**31  # under the limit
    assert first_bad(h) is None
    for start in range(4):  # views at every alignment: head, words, tail
        for at in (0, 1, 2, 3, 4, 1000, 49_990 - start, 49_995 - start):
            h = g.copy()
            h[start + at] = np.nan
            assert first_bad(h[start:49_996]) == at, (start, at)
        assert first_bad(g[start:49_996]) is None


def test_a_large_bfloat16_push_is_checked_by_several_threads_alike() -> None:
    threads = CheckThreads(2)
    try:
        big = [lowp.narrow(np.ones(3 << 20, np.float32)) for _ in range(2)]
        assert first_bad_of(big, threads) is None
        big[1][123_456] = np.nan
        assert first_bad_of(big, threads) == (1, 123_456)
        mixed = [np.ones(3 << 20, np.float32), big[1]]
        assert first_bad_of(mixed, threads) == (1, 123_456)
    finally:
        threads.close()


CONFIGS = [
    {"name": "sgd", "lr": 0.1},
    {"name": "sgd", "lr": 0.1, "weight_decay": 0.01},
    {"name": "momentum", "lr": 0.05, "momentum": 0.9, "nesterov": True},
    {"name": "adagrad", "lr": 0.1},
    {"name": "adam", "lr": 1e-3, "weight_decay": 0.01},
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: str(sorted(c.items())))
@pytest.mark.parametrize("kernels", [True, False], ids=["numba", "numpy"])
def test_an_update_from_bfloat16_equals_the_update_from_it_widened(config, kernels, monkeypatch):
    monkeypatch.setattr(optimizers, "USE_KERNELS", kernels)
    rng = np.random.default_rng(1)
    n = 20_011
    opt = make_optimizer(config)
    p0 = rng.normal(size=n).astype(np.float32)
    runs = []
    for narrow in (True, False):
        p = p0.copy()
        slots = {k: v.reshape(-1) for k, v in opt.init_slots((n,), np.float32).items()}
        scratch = np.empty(opt.scratch_factor * n, np.float32)
        g_rng = np.random.default_rng(2)
        for step in range(1, 5):
            g = lowp.narrow(g_rng.normal(size=n).astype(np.float32))
            if not narrow:
                g = g.astype(np.float32)
            g.setflags(write=False)
            opt.apply_dense(p, g, slots, step, scratch, scale=0.5)
        runs.append((p, slots))
    (p_a, s_a), (p_b, s_b) = runs
    assert np.array_equal(p_a, p_b)
    for k in s_a:
        assert np.array_equal(s_a[k], s_b[k])


def test_a_running_sum_takes_bfloat16_gradients_exactly() -> None:
    g = lowp.narrow(np.random.default_rng(4).standard_normal(1000).astype(np.float32))
    acc = np.full(1000, 0.5, np.float32)
    lowp.add_into(acc, g)
    assert np.array_equal(acc, np.float32(0.5) + g.astype(np.float32))
    acc64 = np.zeros(1000, np.float64)
    lowp.add_into(acc64, g)
    assert np.array_equal(acc64, g.astype(np.float64))
