"""The fused optimizer kernels compute what the numpy reference path computes."""

from __future__ import annotations

import numpy as np
import pytest

from zmqps.core import _kernels, optimizers
from zmqps.core.optimizers import make_optimizer

CONFIGS = [
    {"name": "sgd", "lr": 0.1},
    {"name": "sgd", "lr": 0.1, "weight_decay": 0.01},
    {"name": "momentum", "lr": 0.05, "momentum": 0.9},
    {"name": "momentum", "lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.001},
    {"name": "adagrad", "lr": 0.1, "initial_accumulator": 0.1},
    {"name": "adam", "lr": 1e-3},
    {"name": "adam", "lr": 1e-2, "beta1": 0.8, "beta2": 0.99, "weight_decay": 0.01},
]


def test_numba_kernels_are_available() -> None:
    assert _kernels.available()


def _run(config, dtype, grad_dtype, use_kernels, monkeypatch):
    monkeypatch.setattr(optimizers, "USE_KERNELS", use_kernels)
    rng = np.random.default_rng(7)
    n = 10_001
    opt = make_optimizer(config)
    p = rng.normal(size=n).astype(dtype)
    slots = {k: v.reshape(-1) for k, v in opt.init_slots((n,), dtype).items()}
    scratch = np.empty(opt.scratch_factor * n, dtype=dtype)
    for step in range(1, 6):
        g = rng.normal(size=n).astype(grad_dtype)
        g.setflags(write=False)
        opt.apply_dense(p, g, slots, step, scratch, scale=0.5 if step % 2 else 1.0)
    return p, slots


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: str(sorted(c.items())))
@pytest.mark.parametrize(
    ("dtype", "grad_dtype", "rtol"),
    [
        (np.float32, np.float32, 2e-5),
        (np.float64, np.float64, 1e-12),
        (np.float32, np.float64, 2e-5),
    ],
)
def test_fused_matches_reference(config, dtype, grad_dtype, rtol, monkeypatch) -> None:
    p_ref, s_ref = _run(config, dtype, grad_dtype, False, monkeypatch)
    p_fast, s_fast = _run(config, dtype, grad_dtype, True, monkeypatch)
    np.testing.assert_allclose(p_fast, p_ref, rtol=rtol, atol=rtol)
    for k in s_ref:
        np.testing.assert_allclose(s_fast[k], s_ref[k], rtol=rtol, atol=rtol)


def test_float16_uses_the_reference_path() -> None:
    assert _kernels.kernel("adam", np.zeros(4, np.float16)) is None
    assert _kernels.kernel("adam", np.zeros(4, np.float32)) is not None


def _run_rows(config, dtype, use_kernels, monkeypatch):
    monkeypatch.setattr(optimizers, "USE_KERNELS", use_kernels)
    rng = np.random.default_rng(11)
    n_rows, width = 300, 8
    opt = make_optimizer(config)
    p = rng.normal(size=(n_rows, width)).astype(dtype)
    slots = opt.init_slots((n_rows, width), dtype)
    for step in range(1, 5):
        rows = np.sort(rng.choice(n_rows, size=40, replace=False)).astype(np.int64)
        g = rng.normal(size=(rows.size, width)).astype(dtype)
        opt.apply_rows(p, rows, g, slots, step, scale=2.0 if step % 2 else 1.0)
    return p, slots


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: str(sorted(c.items())))
@pytest.mark.parametrize(("dtype", "rtol"), [(np.float32, 2e-5), (np.float64, 1e-12)])
def test_fused_rows_match_reference(config, dtype, rtol, monkeypatch) -> None:
    p_ref, s_ref = _run_rows(config, dtype, False, monkeypatch)
    p_fast, s_fast = _run_rows(config, dtype, True, monkeypatch)
    np.testing.assert_allclose(p_fast, p_ref, rtol=rtol, atol=rtol)
    for k in s_ref:
        np.testing.assert_allclose(s_fast[k], s_ref[k], rtol=rtol, atol=rtol)


def _rows_by_dense_kernel(name, rows, p, g, *rest):
    """What the row kernels computed when they called the dense kernel on each row."""
    from zmqps.core import _jit

    dense = _jit.KERNELS[name]
    n_slots = {"sgd": 0, "momentum": 1, "adagrad": 1, "adam": 2}[name]
    slots, scalars = rest[:n_slots], rest[n_slots:]
    for k, r in enumerate(rows):
        dense(p[r], g[k], None, *(s[r] for s in slots), *scalars)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: str(sorted(c.items())))
@pytest.mark.parametrize(
    ("dtype", "grad_dtype"),
    [(np.float32, np.float32), (np.float64, np.float64), (np.float32, np.float64)],
)
def test_row_kernels_give_the_dense_kernels_bits(config, dtype, grad_dtype) -> None:
    """Each row kernel is one loop nest; its every element is the dense kernel's, bit
    for bit (the same expression in the same dtypes), on rows spread over the table."""
    opt = make_optimizer(config)
    fused = _kernels.kernel(f"{opt.name}_rows", np.zeros(1, dtype))
    assert fused is not None
    rng = np.random.default_rng(5)
    n_rows, width = 1000, 33
    p = rng.normal(size=(n_rows, width)).astype(dtype)
    slots = {k: np.abs(v) + 0.1 for k, v in opt.init_slots((n_rows, width), dtype).items()}
    p_ref, s_ref = p.copy(), {k: v.copy() for k, v in slots.items()}
    for step in range(1, 6):
        rows = np.sort(rng.choice(n_rows, size=200, replace=False)).astype(np.int64)
        g = rng.normal(size=(rows.size, width)).astype(grad_dtype)
        scalars = opt._kernel_args(step, 0.5 if step % 2 else 1.0, p.dtype.type)
        fused(rows, p, g, *(slots[n] for n in opt.slot_names), *scalars)
        _rows_by_dense_kernel(
            opt.name, rows, p_ref, g, *(s_ref[n] for n in opt.slot_names), *scalars
        )
    assert p.tobytes() == p_ref.tobytes()
    for k in slots:
        assert slots[k].tobytes() == s_ref[k].tobytes()
