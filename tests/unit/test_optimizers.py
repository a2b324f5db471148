"""Optimizers against float64 reference formulas; lazy rows; no allocation per dense call."""

from __future__ import annotations

import math
import tracemalloc
from typing import Any

import numpy as np
import pytest

from zmqps.core.optimizers import (
    BLOCK_ELEMS,
    OPTIMIZERS,
    Adagrad,
    Adam,
    Momentum,
    Optimizer,
    make_optimizer,
)
from zmqps.wire.errors import InvalidArgument

CONFIGS: list[dict[str, Any]] = [
    {"name": "sgd", "lr": 0.1},
    {"name": "sgd", "lr": 0.1, "weight_decay": 0.01},
    {"name": "momentum", "lr": 0.05, "momentum": 0.9},
    {"name": "momentum", "lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 0.02},
    {"name": "adagrad", "lr": 0.1},
    {"name": "adagrad", "lr": 0.1, "initial_accumulator": 0.5, "eps": 1e-3, "weight_decay": 0.1},
    {"name": "adam", "lr": 1e-2},
    {"name": "adam", "lr": 1e-2, "beta1": 0.5, "beta2": 0.9, "eps": 1e-4, "weight_decay": 0.05},
]
IDS = [f"{c['name']}-{i}" for i, c in enumerate(CONFIGS)]


def reference(
    cfg: dict[str, Any],
    p: np.ndarray,
    g: np.ndarray,
    slots: dict[str, np.ndarray],
    t: int,
    scale: float,
) -> None:
    """One step, float64, straight from the textbook formulas (mutates p and slots)."""
    lr, wd = cfg["lr"], cfg.get("weight_decay", 0.0)
    g = scale * g + wd * p
    name = cfg["name"]
    if name == "sgd":
        p -= lr * g
    elif name == "momentum":
        mu = cfg.get("momentum", 0.9)
        slots["momentum"][:] = mu * slots["momentum"] + g
        m = slots["momentum"]
        p -= lr * (g + mu * m) if cfg.get("nesterov") else lr * m
    elif name == "adagrad":
        slots["accumulator"] += g * g
        p -= lr * g / (np.sqrt(slots["accumulator"]) + cfg.get("eps", 1e-7))
    elif name == "adam":
        b1, b2, eps = cfg.get("beta1", 0.9), cfg.get("beta2", 0.999), cfg.get("eps", 1e-8)
        slots["m"][:] = b1 * slots["m"] + (1 - b1) * g
        slots["v"][:] = b2 * slots["v"] + (1 - b2) * g * g
        lr_t = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        p -= lr_t * slots["m"] / (np.sqrt(slots["v"]) + eps)
    else:  # pragma: no cover
        raise AssertionError(name)


def ref_slots(cfg: dict[str, Any], n: int) -> dict[str, np.ndarray]:
    opt = make_optimizer(cfg)
    return {k: v.astype(np.float64) for k, v in opt.init_slots((n,), "float64").items()}


def scratch_for(opt: Optimizer, n: int, dtype: Any) -> np.ndarray:
    return np.empty(opt.scratch_factor * n, dtype=dtype)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize(
    ("dtype", "grad_dtype", "rtol"),
    [("float64", "float64", 1e-11), ("float32", "float32", 2e-5), ("float32", "float64", 2e-5)],
)
def test_dense_matches_reference(
    cfg: dict[str, Any], dtype: str, grad_dtype: str, rtol: float
) -> None:
    rng = np.random.default_rng(0)
    n = BLOCK_ELEMS + 1234  # two blocks, the second short
    opt = make_optimizer(cfg)
    p = rng.standard_normal(n).astype(dtype)
    slots = {k: v.reshape(-1) for k, v in opt.init_slots((n,), dtype).items()}
    ref_p, ref_s = p.astype(np.float64), ref_slots(cfg, n)
    scratch = scratch_for(opt, n, dtype)
    for t, scale in enumerate([1.0, 0.5, 0.25, 2.0, 1.0], start=1):
        g = rng.standard_normal(n).astype(grad_dtype)
        g.flags.writeable = False
        opt.apply_dense(p, g, slots, t, scratch, scale)
        reference(cfg, ref_p, g.astype(np.float64), ref_s, t, scale)
    np.testing.assert_allclose(p, ref_p, rtol=rtol, atol=rtol)
    for k in opt.slot_names:
        np.testing.assert_allclose(slots[k], ref_s[k], rtol=rtol, atol=rtol)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_float16_param_with_float32_grad(cfg: dict[str, Any]) -> None:
    rng = np.random.default_rng(1)
    n = 1000
    opt = make_optimizer(cfg)
    p = rng.standard_normal(n).astype(np.float16)
    slots = {k: v.reshape(-1) for k, v in opt.init_slots((n,), "float16").items()}
    ref_p, ref_s = p.astype(np.float64), ref_slots(cfg, n)
    assert all(v.dtype == np.float32 for v in slots.values())  # float16 updates in float32
    scratch = scratch_for(opt, n, np.float32)
    for t in (1, 2, 3):
        g = rng.standard_normal(n).astype(np.float32) * 1e-3  # small: adam's v underflows in f16
        opt.apply_dense(p, g, slots, t, scratch, 0.5)
        reference(cfg, ref_p, g.astype(np.float64), ref_s, t, 0.5)
    assert np.isfinite(p).all()
    np.testing.assert_allclose(p, ref_p, rtol=2e-3, atol=2e-3)
    for k in opt.slot_names:
        np.testing.assert_allclose(slots[k], ref_s[k], rtol=5e-3, atol=1e-5)  # f16 p in wd


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_apply_rows_is_lazy_dense_on_touched_rows(cfg: dict[str, Any]) -> None:
    rng = np.random.default_rng(2)
    nrows, width = 50, 7
    opt = make_optimizer(cfg)
    param = rng.standard_normal((nrows, width))
    slots = opt.init_slots((nrows, width), "float64")
    for k in slots:  # non-trivial slot contents
        slots[k] += rng.random((nrows, width))
    before_p, before_s = param.copy(), {k: v.copy() for k, v in slots.items()}
    ref_p, ref_s = param.copy(), {k: v.copy() for k, v in slots.items()}
    rows = np.array([3, 41, 0, 17, 49], dtype=np.int64)
    for t in (1, 2, 3):
        grad = rng.standard_normal((rows.size, width)).astype(np.float32)
        opt.apply_rows(param, rows, grad, slots, t, scale=0.5)
        # reference: dense formula applied to the touched rows only
        sub_p = ref_p[rows]
        sub_s = {k: v[rows] for k, v in ref_s.items()}
        reference(cfg, sub_p, grad.astype(np.float64), sub_s, t, 0.5)
        ref_p[rows] = sub_p
        for k in ref_s:
            ref_s[k][rows] = sub_s[k]
    np.testing.assert_allclose(param, ref_p, rtol=1e-6, atol=1e-6)
    for k in slots:
        np.testing.assert_allclose(slots[k], ref_s[k], rtol=1e-6, atol=1e-6)
    untouched = np.setdiff1d(np.arange(nrows), rows)
    assert np.array_equal(param[untouched], before_p[untouched])
    for k in slots:
        assert np.array_equal(slots[k][untouched], before_s[k][untouched])


def test_apply_rows_empty_and_bad() -> None:
    opt = make_optimizer({"name": "adam", "lr": 0.1})
    param = np.ones((4, 2))
    slots = opt.init_slots((4, 2), "float64")
    opt.apply_rows(param, np.zeros(0, np.int64), np.zeros((0, 2)), slots, 1)
    assert (param == 1).all()
    with pytest.raises(InvalidArgument):
        opt.apply_rows(param, np.array([4]), np.zeros((1, 2)), slots, 1)
    with pytest.raises(InvalidArgument):
        opt.apply_rows(param, np.array([-1]), np.zeros((1, 2)), slots, 1)
    with pytest.raises(InvalidArgument):
        opt.apply_rows(param, np.array([1]), np.zeros((1, 3)), slots, 1)
    assert (param == 1).all()


def test_slots_and_factors() -> None:
    assert make_optimizer({"name": "sgd", "lr": 1}).slot_names == ()
    assert make_optimizer({"name": "momentum", "lr": 1}).slot_names == ("momentum",)
    assert make_optimizer({"name": "adam", "lr": 1}).slot_names == ("m", "v")
    ada = make_optimizer({"name": "adagrad", "lr": 1, "initial_accumulator": 0.3})
    acc = ada.init_slots((3, 2), "float32")["accumulator"]
    assert acc.shape == (3, 2) and acc.dtype == np.float32 and np.allclose(acc, 0.3)
    for cls in OPTIMIZERS.values():
        assert cls.scratch_factor in (1, 2)


def test_config_roundtrip_and_types() -> None:
    opt = make_optimizer({"name": "momentum", "lr": 1, "nesterov": True})
    assert isinstance(opt, Momentum) and opt.nesterov and opt.momentum == 0.9
    assert make_optimizer(opt.config()).config() == opt.config()
    assert isinstance(make_optimizer({"name": "adagrad", "lr": 0.1}), Adagrad)
    adam = make_optimizer({"name": "adam", "lr": 0.1})
    assert isinstance(adam, Adam)
    assert adam.lr_t(1) == pytest.approx(0.1 * math.sqrt(1 - 0.999) / (1 - 0.9))


@pytest.mark.parametrize(
    "cfg",
    [
        {"name": "rmsprop", "lr": 0.1},
        {"lr": 0.1},
        {"name": "sgd"},
        {"name": "sgd", "lr": -0.1},
        {"name": "sgd", "lr": float("inf")},
        {"name": "sgd", "lr": True},
        {"name": "sgd", "lr": "0.1"},
        {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        {"name": "sgd", "lr": 0.1, "weight_decay": -1.0},
        {"name": "momentum", "lr": 0.1, "momentum": 1.5},
        {"name": "momentum", "lr": 0.1, "nesterov": 1},
        {"name": "adam", "lr": 0.1, "beta1": 1.0},
        {"name": "adam", "lr": 0.1, "beta2": 1.0},
        {"name": "adam", "lr": 0.1, "eps": 0.0},
        {"name": "adagrad", "lr": 0.1, "initial_accumulator": 0.0, "eps": 0.0},
        {"name": "adam", "lr": 0.1, "nesterov": True},
        # finite, but one update of a gradient the PS takes would not be: parameters
        # became infinite (lr) or NaN (weight decay)
        {"name": "sgd", "lr": 1e300},
        {"name": "sgd", "lr": 0.1, "weight_decay": 1e300},
        {"name": "adam", "lr": 1e7},
        # each update scaled the parameters by 1 - 1e6: infinite in seven pushes of 0.001
        {"name": "sgd", "lr": 1.0, "weight_decay": 1e6},
        {"name": "momentum", "lr": 0.5, "weight_decay": 2.5},
        {"name": "adam", "lr": 1e-3, "weight_decay": 1e4},
    ],
)
def test_make_optimizer_refuses(cfg: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        make_optimizer(cfg)


def test_apply_dense_checks_arguments() -> None:
    opt = make_optimizer({"name": "adam", "lr": 0.1})
    p = np.zeros(10, np.float32)
    slots = opt.init_slots((10,), "float32")
    ok = np.empty(20, np.float32)
    bad_calls: list[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], int, np.ndarray]] = [
        (p, np.zeros(9, np.float32), slots, 1, ok),
        (p, np.zeros(10, np.int32), slots, 1, ok),
        (p, np.zeros(10, np.float32), {"m": slots["m"]}, 1, ok),
        (p, np.zeros(10, np.float32), slots, 0, ok),
        (p, np.zeros(10, np.float32), slots, 1, np.empty(19, np.float32)),
        (p, np.zeros(10, np.float32), slots, 1, np.empty(20, np.float64)),
    ]
    for args in bad_calls:
        with pytest.raises(InvalidArgument):
            opt.apply_dense(*args)
    assert not p.any() and not slots["m"].any()


@pytest.mark.parametrize(
    "cfg",
    [
        {"name": "sgd", "lr": 0.1},
        {"name": "sgd", "lr": 0.1, "weight_decay": 0.1},
        {"name": "momentum", "lr": 0.1, "nesterov": True},
        {"name": "adagrad", "lr": 0.1},
        {"name": "adam", "lr": 0.1},
        {"name": "adam", "lr": 0.1, "weight_decay": 0.1},
    ],
    ids=lambda c: "-".join(str(v) for v in c.values()),
)
def test_dense_allocates_nothing(cfg: dict[str, Any]) -> None:
    n = 1 << 20
    opt = make_optimizer(cfg)
    p = np.ones(n, np.float32)
    g = np.full(n, 0.01, np.float32)
    slots = {k: v.reshape(-1) for k, v in opt.init_slots((n,), "float32").items()}
    scratch = scratch_for(opt, n, np.float32)
    opt.apply_dense(p, g, slots, 1, scratch, 0.5)  # warm-up
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for t in range(2, 102):
            opt.apply_dense(p, g, slots, t, scratch, 0.5)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak


#: the largest float32 gradient a PS takes (README, "A NaN or an infinity": 2^32 refused)
_BELOW_LIMIT = float(np.nextafter(np.float32(2.0**32), np.float32(0)))


def _random_config(rng: np.random.Generator) -> dict[str, Any]:
    """An optimizer config, drawn over each hyperparameter's whole range (lr and weight
    decay log-uniform up to their bound, 1e6)."""
    name = str(rng.choice(["sgd", "momentum", "adagrad", "adam", "ftrl"]))
    cfg: dict[str, Any] = {"name": name, "lr": float(10.0 ** rng.uniform(-6, 6))}
    if rng.random() < 0.7:
        cfg["weight_decay"] = float(10.0 ** rng.uniform(-6, 6))
    if name == "momentum":
        cfg["momentum"] = float(rng.choice([0.0, 0.5, 0.9, 0.99, 1.0]))
        cfg["nesterov"] = bool(rng.random() < 0.5)
    if name == "adam":
        cfg["beta1"] = float(rng.choice([0.0, 0.5, 0.9]))
        cfg["beta2"] = float(rng.choice([0.0, 0.9, 0.999]))
    if name in ("adam", "adagrad"):
        cfg["eps"] = _tiny_to_large(rng)
    if name in ("adagrad", "ftrl"):
        cfg["initial_accumulator"] = _tiny_to_large(rng)
    if name == "ftrl":
        cfg["l1"] = float(rng.choice([0.0, 1.0]))
        cfg["l2"] = float(rng.choice([0.0, _tiny_to_large(rng)]))
        cfg["beta"] = float(rng.choice([0.0, _tiny_to_large(rng)]))
    return cfg


def _tiny_to_large(rng: np.random.Generator) -> float:
    """A positive value log-uniform from 1e-300 (0 in float32: an eps of 1e-300 made
    0 / 0 of a zero gradient) to 1."""
    return float(10.0 ** rng.uniform(-300, 0))


@pytest.mark.parametrize("seed", range(60))
def test_no_accepted_config_and_gradients_make_a_parameter_infinite(seed: int) -> None:
    """Whatever config is accepted and whatever gradients pass the PS's check (finite,
    below the limit), 300 updates leave every parameter and slot finite: weight decay
    times lr past 1 scaled the parameters by a factor past -1 each update, and pushes
    of 0.001 made them infinite with every push accepted; an eps or accumulator of
    1e-300, 0 in float32, made the update of a zero gradient 0 / 0."""
    rng = np.random.default_rng(seed)
    while True:  # the first config drawn that is accepted
        cfg = _random_config(rng)
        try:
            opt = make_optimizer(cfg)
            break
        except InvalidArgument as e:  # out of range, the only reasons allowed here
            why = str(e)
            assert (
                "lr x weight_decay must be at most 1" in why
                or "or at least" in why
                or ("ftrl needs" in why)
            ), (cfg, e)
    n = 64
    p = rng.standard_normal(n).astype(np.float32) * np.float32(10.0 ** rng.uniform(0, 6))
    slots = {k: v.reshape(-1) for k, v in opt.init_slots((n,), "float32").items()}
    scratch = scratch_for(opt, n, np.float32)
    for step in range(1, 301):
        size = 10.0 ** rng.uniform(-3, math.log10(_BELOW_LIMIT))
        g = (rng.standard_normal(n) * size).clip(-_BELOW_LIMIT, _BELOW_LIMIT)
        g[rng.random(n) < 0.3] = 0.0  # a zero gradient's elements: 0 / 0 with eps 0
        opt.apply_dense(p, g.astype(np.float32), slots, step, scratch)
        assert np.isfinite(p).all(), (cfg, step)
        for name, slot in slots.items():
            assert np.isfinite(slot).all(), (cfg, step, name)
