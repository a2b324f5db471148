"""Sparse optimizers on hash-table rows against float64 reference formulas.

Lazy Adam, Adagrad, FTRL-proximal and SGD touch only the rows a push names (and
their slots); duplicate ids in one push are summed first. The references below are
written independently of zmqps.core.optimizers (FTRL in McMahan et al.'s sigma form).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from zmqps.core import optimizers
from zmqps.core.store import ShardStore
from zmqps.core.variables import ShardDef

CONFIGS: list[dict[str, Any]] = [
    {"name": "sgd", "lr": 0.1},
    {"name": "adagrad", "lr": 0.1, "initial_accumulator": 0.1, "eps": 1e-7},
    {"name": "adam", "lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
    {"name": "ftrl", "lr": 0.5, "initial_accumulator": 0.1, "l1": 0.0, "l2": 0.0, "beta": 0.0},
    {"name": "ftrl", "lr": 0.5, "initial_accumulator": 0.1, "l1": 0.02, "l2": 0.1, "beta": 1.0},
]
IDS = [f"{c['name']}-{i}" for i, c in enumerate(CONFIGS)]
DIM = 3


def _ref_slots(cfg: dict[str, Any], p0: np.ndarray) -> dict[str, np.ndarray]:
    if cfg["name"] == "adagrad":
        return {"accumulator": np.full_like(p0, cfg["initial_accumulator"])}
    if cfg["name"] == "adam":
        return {"m": np.zeros_like(p0), "v": np.zeros_like(p0)}
    if cfg["name"] == "ftrl":
        return {"accumulator": np.full_like(p0, cfg["initial_accumulator"]), "linear": 0 * p0}
    return {}


def _ref_step(cfg: dict[str, Any], p: np.ndarray, g: np.ndarray, s: dict[str, np.ndarray], t: int):
    """One update of rows ``p`` (float64, in place) by ``g``; ``t`` is the 1-based step."""
    lr = cfg["lr"]
    if cfg["name"] == "sgd":
        p -= lr * g
    elif cfg["name"] == "adagrad":
        s["accumulator"] += g * g
        p -= lr * g / (np.sqrt(s["accumulator"]) + cfg["eps"])
    elif cfg["name"] == "adam":
        b1, b2 = cfg["beta1"], cfg["beta2"]
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        lr_t = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        p -= lr_t * s["m"] / (np.sqrt(s["v"]) + cfg["eps"])
    else:  # FTRL-proximal, McMahan et al. 2013, Algorithm 1 (+ TF's beta and 2*l2)
        n, z = s["accumulator"], s["linear"]
        sigma = (np.sqrt(n + g * g) - np.sqrt(n)) / lr
        z += g - sigma * p
        n += g * g
        for idx in np.ndindex(p.shape):
            if abs(z[idx]) <= cfg["l1"]:
                p[idx] = 0.0
            else:
                denom = (cfg["beta"] + math.sqrt(n[idx])) / lr + 2 * cfg["l2"]
                p[idx] = -(z[idx] - math.copysign(cfg["l1"], z[idx])) / denom


def _table(cfg: dict[str, Any]) -> ShardStore:
    d = ShardDef(
        id=0,
        var="emb",
        index=0,
        dtype="float64",
        full_shape=(8, DIM),
        row_start=0,
        rows=8,
        init={"name": "normal", "stddev": 0.5, "seed": 7},
        optimizer=cfg,
        sparse=True,
        table={},
    )
    store = ShardStore()
    store.create([d])
    return store


@pytest.fixture(params=[True, False], ids=["kernels", "numpy"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(optimizers, "USE_KERNELS", request.param)
    return bool(request.param)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_touched_rows_follow_the_reference(cfg: dict[str, Any], kernels: bool) -> None:
    store = _table(cfg)
    ids = np.array([-5, 2**40 + 3, 17, 99, -(2**62)], np.int64)
    _, p0 = store.pull_rows(0, ids)  # creates every row with its initial value
    ref = p0.astype(np.float64).copy()
    slots = {k: v.copy() for k, v in _ref_slots(cfg, ref).items()}
    rng = np.random.default_rng(0)
    untouched = 3  # ids[3] is never pushed: its row and slots must not move
    for t in range(1, 5):
        # ids[0] twice: its gradients are summed before the update
        push = np.array([ids[0], ids[1], ids[0], ids[2], ids[4]], np.int64)
        grads = rng.normal(size=(push.size, DIM))
        store.apply_rows(0, push, grads, pulled_version=store.get(0).version)
        summed = {i: np.zeros(DIM) for i in set(push.tolist())}
        for i, g in zip(push.tolist(), grads, strict=True):
            summed[i] += g
        rows = [k for k in range(ids.size) if ids[k] in summed]
        g = np.stack([summed[int(ids[k])] for k in rows])
        p_rows = ref[rows]
        s_rows = {k: v[rows] for k, v in slots.items()}
        _ref_step(cfg, p_rows, g, s_rows, t)
        ref[rows] = p_rows
        for k in slots:
            slots[k][rows] = s_rows[k]
        _, got = store.pull_rows(0, ids)
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
        assert np.array_equal(got[untouched], p0[untouched])
    shard: Any = store.get(0)
    st = shard.state()  # (ids, values, slots, touched) of live rows in id order
    order = np.argsort(ids)
    for name, ref_slot in slots.items():
        np.testing.assert_allclose(st[2][name], ref_slot[order], rtol=1e-10, atol=1e-12)


def test_ftrl_l1_makes_rows_exactly_zero() -> None:
    cfg = {"name": "ftrl", "lr": 0.1, "initial_accumulator": 0.1, "l1": 10.0}
    store = _table(cfg)
    ids = np.array([1, 2], np.int64)
    store.pull_rows(0, ids)
    store.apply_rows(0, ids, np.full((2, DIM), 0.5), 0)
    _, rows = store.pull_rows(0, ids)
    assert np.array_equal(rows, np.zeros((2, DIM)))


def test_ftrl_rejects_unusable_configs() -> None:
    from zmqps.wire.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="ftrl"):
        optimizers.make_optimizer({"name": "ftrl", "lr": 0.0})
    with pytest.raises(InvalidArgument, match="initial_accumulator"):
        optimizers.make_optimizer({"name": "ftrl", "lr": 0.1, "initial_accumulator": 0.0})
    with pytest.raises(InvalidArgument, match="does not take"):
        optimizers.make_optimizer({"name": "ftrl", "lr": 0.1, "momentum": 0.9})
