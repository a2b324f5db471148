"""Framework-free numpy models that a worker trains against the parameter server.

Layer map (depends on :mod:`zmqps.core` and :func:`zmqps.device.array_module` only)::

    base     Model (the contract), log_softmax, softmax_cross_entropy
    softmax  SoftmaxRegression  ("softmax")
    mlp      MLP                ("mlp")
    (here)   build_model, MODELS (the registry by name)
"""

from __future__ import annotations

from typing import Any

from zmqps.models.base import Model, log_softmax, softmax_cross_entropy
from zmqps.models.mlp import MLP
from zmqps.models.softmax import SoftmaxRegression

__all__ = [
    "MLP",
    "MODELS",
    "Model",
    "SoftmaxRegression",
    "build_model",
    "log_softmax",
    "softmax_cross_entropy",
]

_REGISTRY: dict[str, type[Model]] = {
    SoftmaxRegression.name: SoftmaxRegression,
    MLP.name: MLP,
}

#: names :func:`build_model` accepts.
MODELS = tuple(_REGISTRY)


def build_model(name: str, input_dim: int, num_classes: int, **options: Any) -> Model:
    """The model called ``name`` ("softmax" or "mlp") with its ``options``.

    Options per model: softmax ``seed``; mlp ``hidden``, ``l2``, ``seed``.
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    unknown = sorted(set(options) - set(cls.OPTIONS))
    if unknown:
        raise ValueError(
            f"model {name}: unknown options {', '.join(unknown)}; allowed: {', '.join(cls.OPTIONS)}"
        )
    return cls(input_dim, num_classes, **options)
