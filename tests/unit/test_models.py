"""Models: gradients against finite differences, training progress, API shapes."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from zmqps.core.variables import VariableDef
from zmqps.models import (
    MLP,
    MODELS,
    Model,
    SoftmaxRegression,
    build_model,
    log_softmax,
    softmax_cross_entropy,
)

CASES = [
    ("softmax", {}),
    ("mlp", {}),
    ("mlp", {"hidden": (7, 5)}),
    ("mlp", {"hidden": (6,), "l2": 0.3}),
    ("mlp", {"hidden": ()}),
]


def _init(model: Model, seed: int = 0, dtype: type = np.float32) -> dict[str, np.ndarray]:
    """Test-local init (initializers live elsewhere): scaled normals, small random biases."""
    rng = np.random.default_rng(seed)
    params: dict[str, np.ndarray] = {}
    for v in model.variables():
        scale = 1.0 / np.sqrt(v.shape[0]) if len(v.shape) == 2 else 0.1
        params[v.name] = (rng.standard_normal(v.shape) * scale).astype(dtype)
    return params


def _batch(n: int, dim: int, classes: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, dim)).astype(np.float32), rng.integers(0, classes, n)


def _numeric_grads(
    model: Model, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, eps: float = 1e-6
) -> dict[str, np.ndarray]:
    out = {}
    for name, p in params.items():
        g = np.zeros_like(p)
        for i in np.ndindex(p.shape):
            old = p[i]
            p[i] = old + eps
            plus, _ = model.loss_and_grads(params, x, y)
            p[i] = old - eps
            minus, _ = model.loss_and_grads(params, x, y)
            p[i] = old
            g[i] = (plus - minus) / (2 * eps)
        out[name] = g
    return out


@pytest.mark.parametrize(("name", "options"), CASES)
def test_gradients_match_finite_differences(name: str, options: dict[str, object]) -> None:
    model = build_model(name, 6, 4, **options)
    params = _init(model, dtype=np.float64)
    x, y = _batch(5, 6, 4)
    _, grads = model.loss_and_grads(params, x, y)
    numeric = _numeric_grads(model, params, x, y)
    assert grads.keys() == numeric.keys()
    for k, g in grads.items():
        assert g.dtype == np.float64
        err = np.abs(g - numeric[k]).max() / max(np.abs(numeric[k]).max(), 1e-8)
        assert err < 1e-4, (k, err)


@pytest.mark.parametrize(("name", "options"), CASES)
def test_grads_float32_contiguous_and_shaped(name: str, options: dict[str, object]) -> None:
    model = build_model(name, 10, 3, **options)
    params = _init(model)
    x, y = _batch(8, 10, 3)
    loss, grads = model.loss_and_grads(params, x, y)
    assert isinstance(loss, float) and np.isfinite(loss)
    assert list(grads) == [v.name for v in model.variables()]
    for v in model.variables():
        g = grads[v.name]
        assert g.shape == v.shape and g.dtype == np.float32 and g.flags.c_contiguous
    # Inputs are left untouched.
    np.testing.assert_array_equal(x, _batch(8, 10, 3)[0])


def _sgd_losses(model: Model, params: dict[str, np.ndarray], steps: int, lr: float) -> list[float]:
    x, y = _batch(64, 12, 3, seed=2)
    # A learnable rule, so the loss has somewhere to go.
    y = (x[:, :3].argmax(axis=1)).astype(np.int64)
    losses = []
    for _ in range(steps):
        loss, grads = model.loss_and_grads(params, x, y)
        losses.append(loss)
        for k in params:
            params[k] -= lr * grads[k]
    return losses


@pytest.mark.parametrize(("name", "options"), CASES)
def test_sgd_decreases_loss(name: str, options: dict[str, object]) -> None:
    model = build_model(name, 12, 3, **options)
    losses = _sgd_losses(model, _init(model), steps=30, lr=0.5)
    assert losses[-1] < 0.7 * losses[0]
    assert all(np.isfinite(losses))


def test_mlp_l2_adds_penalty() -> None:
    plain = MLP(4, 3, hidden=(5,))
    reg = MLP(4, 3, hidden=(5,), l2=0.1)
    params = _init(plain, dtype=np.float64)
    x, y = _batch(6, 4, 3)
    loss0, g0 = plain.loss_and_grads(params, x, y)
    loss1, g1 = reg.loss_and_grads(params, x, y)
    weights = ("mlp/dense_0/w", "mlp/out/w")
    penalty = 0.05 * sum(float((params[w] ** 2).sum()) for w in weights)
    assert loss1 == pytest.approx(loss0 + penalty)
    for k in g0:
        expected = g0[k] + 0.1 * params[k] if k in weights else g0[k]
        np.testing.assert_allclose(g1[k], expected)
    # evaluate reports the data loss only.
    assert reg.evaluate(params, x, y)["loss"] == pytest.approx(loss0)


def test_loss_is_stable_for_huge_logits() -> None:
    logits = np.array([[1e4, 0.0, -1e4], [0.0, 1e4, 1e4]], dtype=np.float32)
    loss, grad = softmax_cross_entropy(logits, np.array([0, 2]))
    assert np.isfinite(loss) and loss == pytest.approx(np.log(2) / 2, rel=1e-5)
    assert np.all(np.isfinite(grad))
    logp = log_softmax(logits)
    assert np.all(np.isfinite(logp)) and logp.dtype == np.float32
    np.testing.assert_allclose(np.exp(logp).sum(axis=1), 1.0, rtol=1e-6)


@pytest.mark.parametrize(("name", "options"), CASES)
def test_predict_and_evaluate(name: str, options: dict[str, object]) -> None:
    model = build_model(name, 10, 3, **options)
    params = _init(model)
    x, y = _batch(9, 10, 3)
    proba = model.predict_proba(params, x)
    assert proba.shape == (9, 3) and proba.dtype == np.float32
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-5)
    pred = model.predict(params, x)
    assert pred.shape == (9,) and pred.dtype == np.int64
    np.testing.assert_array_equal(pred, proba.argmax(axis=1))
    metrics = model.evaluate(params, x, y)
    assert set(metrics) == {"accuracy", "loss"}
    assert metrics["accuracy"] == pytest.approx(float(np.mean(pred == y)))
    assert metrics["loss"] == pytest.approx(-np.log(proba[np.arange(9), y]).mean(), rel=1e-5)


def test_variables_declared_with_seeded_inits() -> None:
    model = MLP(64, 10, hidden=(32, 16), seed=5)
    vs = model.variables()
    assert all(isinstance(v, VariableDef) and v.dtype == "float32" for v in vs)
    assert [(v.name, v.shape) for v in vs] == [
        ("mlp/dense_0/w", (64, 32)),
        ("mlp/dense_0/b", (32,)),
        ("mlp/dense_1/w", (32, 16)),
        ("mlp/dense_1/b", (16,)),
        ("mlp/out/w", (16, 10)),
        ("mlp/out/b", (10,)),
    ]
    weights = [v.init for v in vs if v.name.endswith("/w")]
    assert [w["seed"] for w in weights] == [5, 6, 7]
    assert weights[0]["name"].startswith("he_") and weights[-1]["name"] == "glorot_uniform"
    assert all(v.init == {"name": "zeros"} for v in vs if v.name.endswith("/b"))
    assert model.variables() == vs  # reproducible declarations

    soft = SoftmaxRegression(64, 10, seed=2).variables()
    assert [(v.name, v.shape) for v in soft] == [("softmax/w", (64, 10)), ("softmax/b", (10,))]
    assert soft[0].init == {"name": "glorot_uniform", "seed": 2}


def test_registry() -> None:
    assert MODELS == ("softmax", "mlp")
    assert isinstance(build_model("softmax", 4, 3), SoftmaxRegression)
    mlp = build_model("mlp", 4, 3, hidden=[8, 8], l2=0.01)
    assert isinstance(mlp, MLP) and mlp.hidden == (8, 8)
    with pytest.raises(ValueError, match="softmax, mlp"):
        build_model("cnn", 4, 3)
    with pytest.raises(ValueError, match="unknown options"):
        build_model("softmax", 4, 3, hidden=(3,))
    for bad in ({"hidden": (0,)}, {"l2": -1.0}):
        with pytest.raises(ValueError):
            build_model("mlp", 4, 3, **bad)
    with pytest.raises(ValueError):
        build_model("mlp", 4, 1)


@pytest.mark.parametrize(("name", "options"), CASES)
def test_signature_rebuilds_model(name: str, options: dict[str, object]) -> None:
    model = build_model(name, 10, 3, **options)
    sig = model.signature()
    assert sig["kind"] == name
    assert sig["inputs"]["x"] == {"shape": [None, 10], "dtype": "float32"}
    assert sig["outputs"]["probabilities"]["shape"] == [None, 3]
    assert [v["name"] for v in sig["variables"]] == [v.name for v in model.variables()]
    config = dict(sig["config"])
    rebuilt = build_model(sig["kind"], config.pop("input_dim"), config.pop("num_classes"), **config)
    assert rebuilt.signature() == sig


def test_bad_params_are_reported() -> None:
    model = SoftmaxRegression(4, 3)
    params: Mapping[str, np.ndarray] = _init(model)
    x, y = _batch(2, 4, 3)
    with pytest.raises(KeyError, match="softmax/b"):
        model.loss_and_grads({"softmax/w": params["softmax/w"]}, x, y)
    with pytest.raises(ValueError, match="shape"):
        model.loss_and_grads({**params, "softmax/w": np.zeros((3, 4), np.float32)}, x, y)
