"""The :class:`Model` contract and the softmax cross-entropy shared by every model.

Rules of this module:

* A model is stateless math: it declares its variables (:meth:`Model.variables`) and
  computes on parameter maps it is handed; it never owns, initializes or updates them
  (initializers live in :mod:`zmqps.core.initializers`, optimizers on the PS).
* Computation runs in the float dtype of the parameters (float32 in training; float64
  for gradient checks); gradients come back in that dtype, C-contiguous, one per
  variable with the variable's shape.
* Losses are means over the batch, so gradients do not scale with batch size.
* One code path for every device: the array module (numpy or cupy) comes from the
  parameters (:func:`zmqps.device.array_module`); inputs are moved to it.
* ``loss_and_grads(..., on_ready=f)`` calls ``f(grads)`` with each layer's finished
  gradients as soon as backpropagation has produced them (output layer first), so a
  worker can send them while the remaining layers compute. Every gradient is handed
  over exactly once and never modified afterwards; the returned dict has them all.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from zmqps.core.variables import VariableDef
from zmqps.device import array_module

__all__ = ["GradsReady", "Model", "log_softmax", "softmax_cross_entropy"]

#: Called with finished gradients (name -> array) during backpropagation.
GradsReady = Callable[[dict[str, Any]], None]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of ``(n, classes)`` logits, stable for large magnitudes."""
    xp = array_module(logits)
    shifted: np.ndarray = logits - logits.max(axis=1, keepdims=True)
    shifted -= xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
    return shifted


def softmax_cross_entropy(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy of ``logits`` against int labels ``y`` and its gradient.

    The gradient w.r.t. the logits is ``(softmax(logits) - onehot(y)) / n``. ``logits``
    is not modified.
    """
    xp = array_module(logits)
    y = xp.asarray(y)
    n = logits.shape[0]
    rows = xp.arange(n)
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    total = exp.sum(axis=1)
    loss = float(xp.mean(xp.log(total) - shifted[rows, y]))
    exp /= total[:, None]
    exp[rows, y] -= 1
    exp /= n
    return loss, exp


class Model(abc.ABC):
    """A classifier of ``(n, input_dim)`` float32 inputs into ``num_classes`` classes."""

    #: the registry name, e.g. "mlp".
    name: str
    #: keyword options the constructor takes beyond ``input_dim`` and ``num_classes``.
    OPTIONS: tuple[str, ...] = ()

    def __init__(self, input_dim: int, num_classes: int) -> None:
        if input_dim < 1:
            raise ValueError(f"input_dim must be >= 1, got {input_dim}")
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self.input_dim = int(input_dim)
        self.num_classes = int(num_classes)

    @abc.abstractmethod
    def variables(self) -> list[VariableDef]:
        """The variables this model trains, with seeded initializer configs."""

    @abc.abstractmethod
    def logits(self, params: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        """Unnormalized class scores ``(n, num_classes)``."""

    @abc.abstractmethod
    def loss_and_grads(
        self,
        params: Mapping[str, np.ndarray],
        x: np.ndarray,
        y: np.ndarray,
        *,
        on_ready: GradsReady | None = None,
    ) -> tuple[float, dict[str, np.ndarray]]:
        """Mean training loss over the batch (regularizers included) and its gradients
        (handed to ``on_ready`` layer by layer as they are finished, if given)."""

    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """Options that rebuild this model via ``build_model(name, **config)``."""

    def predict_proba(self, params: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        """Class probabilities ``(n, num_classes)``."""
        logits = self.logits(params, x)
        probs: np.ndarray = array_module(logits).exp(log_softmax(logits))
        return probs

    def predict(self, params: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        """Most likely class per example, int64 ``(n,)``."""
        classes: np.ndarray = self.logits(params, x).argmax(axis=1).astype(np.int64)
        return classes

    def evaluate(
        self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray
    ) -> dict[str, float]:
        """``accuracy`` and mean cross-entropy ``loss`` (no regularizers) on ``(x, y)``."""
        if x.shape[0] == 0:
            raise ValueError("cannot evaluate on an empty batch")
        logits = self.logits(params, x)
        xp = array_module(logits)
        loss, _ = softmax_cross_entropy(logits, y)
        accuracy = float(xp.mean(logits.argmax(axis=1) == xp.asarray(y)))
        return {"accuracy": accuracy, "loss": loss}

    def signature(self) -> dict[str, Any]:
        """What an exporter needs: model kind, config, inputs, outputs and variables."""
        return {
            "kind": self.name,
            "config": self.config(),
            "inputs": {"x": {"shape": [None, self.input_dim], "dtype": "float32"}},
            "outputs": {
                "probabilities": {"shape": [None, self.num_classes], "dtype": "float32"},
                "classes": {"shape": [None], "dtype": "int64"},
            },
            "variables": [
                {"name": v.name, "shape": list(v.shape), "dtype": v.dtype} for v in self.variables()
            ],
        }

    @staticmethod
    def _inputs(params: Mapping[str, Any], x: Any, dtype: Any) -> Any:
        """``x`` as an array of ``dtype`` on the parameters' device."""
        xp = array_module(*params.values())
        return xp.asarray(x, dtype=dtype)

    def _param(
        self, params: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...]
    ) -> np.ndarray:
        """``params[name]``, checked against the declared ``shape``."""
        try:
            p = params[name]
        except KeyError:
            raise KeyError(f"{self.name}: missing parameter {name!r}") from None
        if p.shape != shape:
            raise ValueError(f"{self.name}: parameter {name} has shape {p.shape}, expected {shape}")
        return p

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({opts})"
