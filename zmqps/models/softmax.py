"""Multinomial logistic regression: ``softmax(x @ w + b)``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from zmqps.core.variables import VariableDef
from zmqps.models.base import GradsReady, Model, softmax_cross_entropy

__all__ = ["SoftmaxRegression"]


class SoftmaxRegression(Model):
    """Variables ``softmax/w`` ``(input_dim, num_classes)`` and ``softmax/b`` ``(num_classes,)``."""

    name = "softmax"
    OPTIONS = ("seed",)

    def __init__(self, input_dim: int, num_classes: int, seed: int = 0) -> None:
        super().__init__(input_dim, num_classes)
        self.seed = int(seed)
        self._w = ("softmax/w", (self.input_dim, self.num_classes))
        self._b = ("softmax/b", (self.num_classes,))

    def config(self) -> dict[str, Any]:
        return {"input_dim": self.input_dim, "num_classes": self.num_classes, "seed": self.seed}

    def variables(self) -> list[VariableDef]:
        return [
            VariableDef(*self._w, init={"name": "glorot_uniform", "seed": self.seed}),
            VariableDef(*self._b, init={"name": "zeros"}),
        ]

    def _wb(self, params: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return self._param(params, *self._w), self._param(params, *self._b)

    def logits(self, params: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        w, b = self._wb(params)
        z: np.ndarray = self._inputs(params, x, w.dtype) @ w
        z += b
        return z

    def loss_and_grads(
        self,
        params: Mapping[str, np.ndarray],
        x: np.ndarray,
        y: np.ndarray,
        *,
        on_ready: GradsReady | None = None,
    ) -> tuple[float, dict[str, np.ndarray]]:
        w, b = self._wb(params)
        x = self._inputs(params, x, w.dtype)
        z = x @ w
        z += b
        loss, dz = softmax_cross_entropy(z, y)
        grads = {self._w[0]: x.T @ dz, self._b[0]: dz.sum(axis=0)}
        if on_ready is not None:
            on_ready(dict(grads))
        return loss, grads
