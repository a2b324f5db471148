"""Multi-layer perceptron: ReLU hidden layers, a linear output layer, softmax loss.

Variables, in order: ``mlp/dense_{i}/w`` ``(fan_in, fan_out)`` and ``mlp/dense_{i}/b``
per hidden layer, then ``mlp/out/w`` and ``mlp/out/b``. Hidden weights use He init,
the output layer Glorot; weight ``i`` (output layer last) is seeded ``seed + i`` so
the whole model is reproducible from one seed. Biases start at zero.

``l2`` adds ``0.5 * l2 * sum(||w||^2)`` over the weight matrices (not biases) to the
training loss and ``l2 * w`` to their gradients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zmqps.core.variables import VariableDef
from zmqps.device import array_module
from zmqps.models.base import GradsReady, Model, softmax_cross_entropy

__all__ = ["MLP"]


class MLP(Model):
    """``input_dim -> hidden[0] -> ... -> hidden[-1] -> num_classes`` with ReLU between."""

    name = "mlp"
    OPTIONS = ("hidden", "l2", "seed")

    def __init__(
        self,
        input_dim: int,
        num_classes: int,
        hidden: Sequence[int] = (128,),
        l2: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__(input_dim, num_classes)
        self.hidden = tuple(int(h) for h in hidden)
        if any(h < 1 for h in self.hidden):
            raise ValueError(f"hidden layer sizes must be >= 1, got {self.hidden}")
        if not l2 >= 0.0:
            raise ValueError(f"l2 must be >= 0, got {l2}")
        self.l2 = float(l2)
        self.seed = int(seed)
        dims = (self.input_dim, *self.hidden, self.num_classes)
        prefixes = [f"mlp/dense_{i}" for i in range(len(self.hidden))] + ["mlp/out"]
        # (weight name, weight shape, bias name, bias shape) per layer, output last.
        self._layers = [
            (f"{p}/w", (fan_in, fan_out), f"{p}/b", (fan_out,))
            for p, fan_in, fan_out in zip(prefixes, dims[:-1], dims[1:], strict=True)
        ]
        self._names = [n for w, _, b, _ in self._layers for n in (w, b)]

    def config(self) -> dict[str, Any]:
        return {
            "input_dim": self.input_dim,
            "num_classes": self.num_classes,
            "hidden": list(self.hidden),
            "l2": self.l2,
            "seed": self.seed,
        }

    def variables(self) -> list[VariableDef]:
        out: list[VariableDef] = []
        last = len(self._layers) - 1
        for i, (w_name, w_shape, b_name, b_shape) in enumerate(self._layers):
            init = "glorot_uniform" if i == last else "he_normal"
            out.append(VariableDef(w_name, w_shape, init={"name": init, "seed": self.seed + i}))
            out.append(VariableDef(b_name, b_shape, init={"name": "zeros"}))
        return out

    def _weights(self, params: Mapping[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        return [
            (self._param(params, w_name, w_shape), self._param(params, b_name, b_shape))
            for w_name, w_shape, b_name, b_shape in self._layers
        ]

    @staticmethod
    def _forward(
        weights: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray
    ) -> tuple[list[np.ndarray], np.ndarray]:
        """Inputs of every layer (``x`` first) and the output logits."""
        xp = array_module(weights[0][0])
        acts = [xp.asarray(x, dtype=weights[0][0].dtype)]
        for w, b in weights[:-1]:
            h = acts[-1] @ w
            h += b
            xp.maximum(h, 0, out=h)
            acts.append(h)
        w, b = weights[-1]
        logits = acts[-1] @ w
        logits += b
        return acts, logits

    def logits(self, params: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        return self._forward(self._weights(params), x)[1]

    def loss_and_grads(
        self,
        params: Mapping[str, np.ndarray],
        x: np.ndarray,
        y: np.ndarray,
        *,
        on_ready: GradsReady | None = None,
    ) -> tuple[float, dict[str, np.ndarray]]:
        weights = self._weights(params)
        xp = array_module(weights[0][0])
        acts, logits = self._forward(weights, x)
        loss, delta = softmax_cross_entropy(logits, y)
        grads: dict[str, np.ndarray] = {}
        penalty = 0.0
        for i in reversed(range(len(weights))):
            w_name, _, b_name, _ = self._layers[i]
            w = weights[i][0]
            gw = acts[i].T @ delta
            if self.l2:
                penalty += float(xp.vdot(w, w))
                gw += self.l2 * w
            grads[w_name] = gw
            grads[b_name] = delta.sum(axis=0)
            if on_ready is not None:
                on_ready({w_name: gw, b_name: grads[b_name]})
            if i > 0:
                # Back through layer i, then through the ReLU that produced acts[i].
                delta = delta @ w.T
                xp.multiply(delta, acts[i] > 0, out=delta)
        loss += 0.5 * self.l2 * penalty
        return loss, {name: grads[name] for name in self._names}
