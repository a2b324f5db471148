"""A wide-and-deep click-through-rate model over hash-keyed embedding tables, in numpy.

``logit = bias + dense @ dense_w + sum_f wide[id_f] + mlp([emb[id_1], ..., emb[id_F], dense])``
with a one-hidden-layer ReLU MLP; ``p = sigmoid(logit)``, the loss is the mean log loss.

Variables: ``ctr/wide`` (a hash table of 1-wide rows: the linear "wide" part, one
weight per id, FTRL-proximal by default), ``ctr/emb`` (a hash table of ``dim``-wide
rows, Adagrad), and the dense tower ``ctr/dense_w``, ``ctr/bias``, ``ctr/h/w``,
``ctr/h/b``, ``ctr/out/w``, ``ctr/out/b`` (the job's optimizer).

Rules of this module:

* Stateless math like :mod:`zmqps.models.base`: parameters come in, gradients go out.
  Table rows come in for the batch's UNIQUE ids (:class:`SparseBatch`: the worker
  pulls each row once); row gradients go out summed per unique id.
* Only array functions numpy and cupy share (``bincount`` for the scatter-add, no
  ``np.add.at``), so the same code runs on either array module (``xp``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from zmqps.core.hashtable import DEFAULT_BUCKETS
from zmqps.core.variables import VariableDef

__all__ = ["EVAL_PIECE", "CTRModel", "SparseBatch", "segment_sum"]

Array = Any  # numpy or cupy array

#: The tables' optimizers. A small initial accumulator keeps the adaptive step
#: ``lr * g / sqrt(sum g**2)`` nearly independent of the gradient's scale (the loss is a
#: batch mean, so one example's gradient of a row is small).
WIDE_OPTIMIZER = {"name": "ftrl", "lr": 0.1, "initial_accumulator": 1e-4, "l2": 1e-3}
EMB_OPTIMIZER = {"name": "adagrad", "lr": 0.05, "initial_accumulator": 1e-4}
#: Examples scored at a time in evaluation and prediction (the same pieces everywhere,
#: so an export scores the held-out set exactly as the cluster's evaluation did).
EVAL_PIECE = 8192


def segment_sum(values: Array, segments: Array, n: int, xp: Any = np) -> Array:
    """Sum the rows of ``values`` ``(m, k)`` by ``segments`` ``(m,)`` into ``(n, k)``."""
    cols = [
        xp.bincount(segments, weights=values[:, j], minlength=n) for j in range(values.shape[1])
    ]
    return xp.stack(cols, axis=1).astype(values.dtype)


@dataclass(frozen=True)
class SparseBatch:
    """The ids of one batch, deduplicated: ``unique`` ids and ``inverse`` positions
    (``ids.reshape(-1) == unique[inverse]``)."""

    unique: Array
    inverse: Array
    shape: tuple[int, int]

    @classmethod
    def of(cls, ids: Array, xp: Any = np) -> SparseBatch:
        unique, inverse = xp.unique(ids.reshape(-1), return_inverse=True)
        return cls(unique, inverse.reshape(-1), (int(ids.shape[0]), int(ids.shape[1])))

    def gather(self, rows: Array) -> Array:
        """Rows per (example, field): ``(n, fields, width)`` from unique rows ``(u, width)``."""
        return rows[self.inverse].reshape(*self.shape, rows.shape[1])

    def scatter(self, grads: Array, xp: Any = np) -> Array:
        """Per-(example, field) gradients ``(n, fields, width)`` summed per unique id."""
        flat = grads.reshape(-1, grads.shape[-1])
        return segment_sum(flat, self.inverse, int(self.unique.shape[0]), xp)


class CTRModel:
    """Wide & deep over ``fields`` categorical ids and ``num_dense`` dense features."""

    name = "ctr"
    WIDE = "ctr/wide"
    EMB = "ctr/emb"

    def __init__(
        self,
        fields: int,
        num_dense: int,
        *,
        dim: int = 8,
        hidden: int = 32,
        buckets: int = DEFAULT_BUCKETS,
        table: Mapping[str, Any] | None = None,
        wide_optimizer: Mapping[str, Any] | None = None,
        emb_optimizer: Mapping[str, Any] | None = None,
        seed: int = 0,
        xp: Any = np,
    ) -> None:
        if fields < 1 or num_dense < 0 or dim < 1 or hidden < 1:
            raise ValueError("ctr model: fields, dim, hidden >= 1 and num_dense >= 0")
        self.fields, self.num_dense, self.dim, self.hidden = fields, num_dense, dim, hidden
        self.buckets, self.seed, self.xp = buckets, seed, xp
        self.table = dict(table or {})
        self.wide_optimizer = dict(wide_optimizer or WIDE_OPTIMIZER)
        self.emb_optimizer = dict(emb_optimizer or EMB_OPTIMIZER)

    @property
    def tables(self) -> tuple[str, str]:
        return self.WIDE, self.EMB

    def variables(self) -> list[VariableDef]:
        n_in = self.fields * self.dim + self.num_dense
        s = self.seed
        return [
            VariableDef(
                self.WIDE,
                (self.buckets, 1),
                init={"name": "zeros"},
                optimizer=self.wide_optimizer,
                table=self.table,
            ),
            VariableDef(
                self.EMB,
                (self.buckets, self.dim),
                init={"name": "normal", "stddev": 0.05, "seed": s},
                optimizer=self.emb_optimizer,
                table=self.table,
            ),
            VariableDef("ctr/dense_w", (max(self.num_dense, 1), 1)),
            VariableDef("ctr/bias", (1,)),
            VariableDef("ctr/h/w", (n_in, self.hidden), init={"name": "he_normal", "seed": s + 1}),
            VariableDef("ctr/h/b", (self.hidden,)),
            VariableDef(
                "ctr/out/w", (self.hidden, 1), init={"name": "glorot_normal", "seed": s + 2}
            ),
            VariableDef("ctr/out/b", (1,)),
        ]

    def config(self) -> dict[str, Any]:
        return {
            "fields": self.fields,
            "num_dense": self.num_dense,
            "dim": self.dim,
            "hidden": self.hidden,
            "buckets": self.buckets,
            "seed": self.seed,
            "table": dict(self.table),
        }

    def signature(self) -> dict[str, Any]:
        """What an export needs (:mod:`zmqps.export`): kind, config, inputs, outputs, the
        dense variables and the hash-keyed tables (their rows travel by id, not whole)."""
        by_name = {v.name: v for v in self.variables()}
        return {
            "kind": self.name,
            "config": self.config(),
            "inputs": {
                "ids": {"shape": [None, self.fields], "dtype": "int64"},
                "dense": {"shape": [None, self.num_dense], "dtype": "float32"},
            },
            "outputs": {"probabilities": {"shape": [None], "dtype": "float64"}},
            "variables": [
                {"name": v.name, "shape": list(v.shape), "dtype": v.dtype}
                for v in by_name.values()
                if not v.hashed
            ],
            "tables": [
                {
                    "name": name,
                    "row_shape": list(by_name[name].shape[1:]),
                    "dtype": by_name[name].dtype,
                    "init": dict(by_name[name].init),
                    "table": dict(by_name[name].table or {}),
                }
                for name in self.tables
            ],
        }

    # -- math --------------------------------------------------------------------

    def _forward(
        self,
        params: Mapping[str, Array],
        rows: Mapping[str, Array],
        batch: SparseBatch,
        dense: Array,
    ) -> tuple[Array, dict[str, Array]]:
        xp = self.xp
        n = batch.shape[0]
        wide = batch.gather(rows[self.WIDE])[:, :, 0].sum(axis=1)  # (n,)
        emb = batch.gather(rows[self.EMB]).reshape(n, self.fields * self.dim)
        x = xp.concatenate([emb, dense], axis=1) if self.num_dense else emb
        pre = x @ params["ctr/h/w"] + params["ctr/h/b"]
        h = xp.maximum(pre, 0)
        logit = (
            wide + (h @ params["ctr/out/w"])[:, 0] + params["ctr/out/b"][0] + params["ctr/bias"][0]
        )
        if self.num_dense:
            logit = logit + (dense @ params["ctr/dense_w"])[:, 0]
        return logit, {"x": x, "pre": pre, "h": h}

    def probabilities(
        self,
        params: Mapping[str, Array],
        rows: Mapping[str, Array],
        batch: SparseBatch,
        dense: Array,
    ) -> Array:
        """Click probabilities (float64) of a batch: ``sigmoid(logit)``."""
        logit = self._forward(params, rows, batch, dense)[0]
        return 1.0 / (1.0 + self.xp.exp(-logit.astype(self.xp.float64)))

    def predict(
        self, params: Mapping[str, Any], ids: Array, dense: Array, piece: int = EVAL_PIECE
    ) -> Array:
        """Click probabilities of examples ``ids`` ``(n, fields)`` / ``dense`` ``(n, d)``.

        ``params`` holds the dense variables and, per table, anything with ``rows(ids)``
        (what :func:`zmqps.export.load_model` returns: a
        :class:`~zmqps.core.tableview.TableView`); ``piece`` examples at a time."""
        ids = np.asarray(ids, dtype=np.int64)
        dense = np.asarray(dense, dtype=np.float32)
        if ids.ndim != 2 or ids.shape[1] != self.fields:
            raise ValueError(f"ctr: ids must be (n, {self.fields}), got {ids.shape}")
        if dense.shape != (ids.shape[0], self.num_dense):
            raise ValueError(
                f"ctr: dense must be ({ids.shape[0]}, {self.num_dense}), got {dense.shape}"
            )
        out = np.empty(ids.shape[0], np.float64)
        for lo in range(0, ids.shape[0], piece):
            batch = SparseBatch.of(ids[lo : lo + piece])
            rows = {name: params[name].rows(batch.unique) for name in self.tables}
            out[lo : lo + piece] = self.probabilities(params, rows, batch, dense[lo : lo + piece])
        return out

    def loss_and_grads(
        self,
        params: Mapping[str, Array],
        rows: Mapping[str, Array],
        batch: SparseBatch,
        dense: Array,
        y: Array,
    ) -> tuple[float, dict[str, Array], dict[str, Array]]:
        """Mean log loss, dense gradients by name, and row gradients per table
        (``(len(batch.unique), width)``, summed per unique id)."""
        xp = self.xp
        n = batch.shape[0]
        logit, cache = self._forward(params, rows, batch, dense)
        # log(1 + e^z) - y z, stably
        loss = float(xp.mean(xp.logaddexp(0, logit) - y * logit))
        p = 1.0 / (1.0 + xp.exp(-logit))
        d = ((p - y) / n).astype(logit.dtype)  # dL/dlogit, (n,)
        grads: dict[str, Array] = {
            "ctr/bias": d.sum(keepdims=True).reshape(1),
            "ctr/out/b": d.sum(keepdims=True).reshape(1),
            "ctr/out/w": cache["h"].T @ d[:, None],
        }
        dh = d[:, None] * params["ctr/out/w"][:, 0][None, :]
        dpre = dh * (cache["pre"] > 0)
        grads["ctr/h/w"] = cache["x"].T @ dpre
        grads["ctr/h/b"] = dpre.sum(axis=0)
        dx = dpre @ params["ctr/h/w"].T
        if self.num_dense:
            grads["ctr/dense_w"] = dense.T @ d[:, None]
        else:
            grads["ctr/dense_w"] = xp.zeros((1, 1), logit.dtype)
        demb = dx[:, : self.fields * self.dim].reshape(n, self.fields, self.dim)
        dwide = xp.broadcast_to(d[:, None, None], (n, self.fields, 1))
        row_grads = {
            self.WIDE: batch.scatter(dwide, xp),
            self.EMB: batch.scatter(demb, xp),
        }
        dtype = params["ctr/h/w"].dtype
        grads = {k: xp.ascontiguousarray(v, dtype=dtype) for k, v in grads.items()}
        row_grads = {k: xp.ascontiguousarray(v, dtype=dtype) for k, v in row_grads.items()}
        return loss, grads, row_grads
