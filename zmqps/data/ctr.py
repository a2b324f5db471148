"""Click-through-rate data: a synthetic generator with a known optimum, and Criteo files.

Rules of this module:

* A :class:`CTRDataset` holds ``dense`` float32 ``(n, d)`` features, ``ids`` int64
  ``(n, fields)`` categorical ids (any int64 value: they key hash tables, never index
  arrays) and ``y`` float32 ``(n,)`` labels in {0, 1}; synthetic sets also carry the
  true click probability ``p_true`` of every example.
* :func:`synthetic_ctr` is deterministic in its arguments. Field ``f``'s values follow a
  Zipf (power-law) law over ``vocab`` values (rank ``r`` drawn with probability
  ``∝ 1 / r**zipf``); value ``r`` of field ``f`` has the id ``mix64(f << 40 | r)``
  (arbitrary-looking int64, negative ones included). The ground truth is a logistic
  model: ``logit = bias + dense @ v + sum_f w_f[r_f]`` with ``w ~ N(0, weight_std)``,
  ``v ~ N(0, 1/sqrt(d))``; ``y ~ Bernoulli(sigmoid(logit))``. The AUC of ``p_true``
  on a split is the best any model can expect there (``ground_truth_auc``).
* :func:`read_criteo` reads the Criteo display-advertising text format: one example per
  line, tab-separated: the label, 13 integer features, 26 categorical features as hex
  strings; empty fields are missing. Integers become ``log1p(max(x, 0))`` (missing: 0);
  a categorical value becomes the id ``mix64(field << 40 | int(hex, 16))`` (missing:
  its own id per field). Bad lines raise ValueError naming the line.
* Metrics: :func:`auc` (Mann-Whitney, ties counted half) and :func:`logloss`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.core.hashtable import mix64

__all__ = [
    "CRITEO_CATEGORICAL",
    "CRITEO_INTEGER",
    "CTRDataset",
    "auc",
    "field_ids",
    "logloss",
    "read_criteo",
    "synthetic_ctr",
    "write_criteo",
]

Array = npt.NDArray[Any]

CRITEO_INTEGER = 13
CRITEO_CATEGORICAL = 26

#: values above this in a field mean "missing" (Criteo); hex ids are at most 64 bits
_MISSING = (1 << 40) - 1


def field_ids(field: int, values: Array) -> Array:
    """The int64 id of categorical ``values`` (non-negative ints) of field ``field``."""
    v = np.asarray(values, dtype=np.uint64) & np.uint64((1 << 40) - 1)
    return mix64(v | np.uint64(field << 40)).view(np.int64)


@dataclass(frozen=True, eq=False)
class CTRDataset:
    dense: Array
    ids: Array
    y: Array
    name: str
    p_true: Array | None = None

    def __post_init__(self) -> None:
        dense = np.ascontiguousarray(self.dense, dtype=np.float32)
        ids = np.ascontiguousarray(self.ids, dtype=np.int64)
        y = np.ascontiguousarray(self.y, dtype=np.float32)
        n = y.shape[0]
        if y.ndim != 1 or dense.ndim != 2 or ids.ndim != 2:
            raise ValueError(f"dataset {self.name}: y 1-D, dense and ids 2-D expected")
        if dense.shape[0] != n or ids.shape[0] != n:
            raise ValueError(f"dataset {self.name}: dense, ids and y differ in length")
        if n and not np.isin(y, (0.0, 1.0)).all():
            raise ValueError(f"dataset {self.name}: labels must be 0 or 1")
        object.__setattr__(self, "dense", dense)
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "y", y)

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def num_dense(self) -> int:
        return int(self.dense.shape[1])

    @property
    def num_fields(self) -> int:
        return int(self.ids.shape[1])

    def take(self, index: Array | slice) -> CTRDataset:
        p = None if self.p_true is None else self.p_true[index]
        return CTRDataset(self.dense[index], self.ids[index], self.y[index], self.name, p)

    def shard(self, index: int, count: int) -> CTRDataset:
        """Examples ``index, index + count, ...`` (disjoint shards covering the set)."""
        if count < 1 or not 0 <= index < count or count > len(self):
            raise ValueError(f"cannot take shard {index} of {count} from {len(self)} examples")
        return self.take(slice(index, None, count))

    def batches(self, batch_size: int, epoch: int, seed: int) -> Iterator[CTRDataset]:
        """Shuffled mini-batches of one epoch, the order seeded by ``(seed, epoch)``."""
        order = np.random.default_rng((seed, epoch)).permutation(len(self))
        for lo in range(0, len(self), batch_size):
            yield self.take(order[lo : lo + batch_size])


def synthetic_ctr(
    n: int,
    *,
    fields: int = 8,
    vocab: int = 1000,
    zipf: float = 1.1,
    num_dense: int = 4,
    weight_std: float = 0.7,
    bias: float = -1.0,
    seed: int = 0,
    split: str = "train",
) -> CTRDataset:
    """``n`` examples of the synthetic CTR task (the model is shared by every split of
    one ``seed``; ``split`` only changes which examples are drawn)."""
    if n < 1 or fields < 1 or vocab < 1 or num_dense < 0 or zipf <= 0:
        raise ValueError("synthetic_ctr: n, fields, vocab >= 1, num_dense >= 0, zipf > 0")
    truth = np.random.default_rng((seed, 0xC7))
    w = truth.normal(0.0, weight_std, size=(fields, vocab))
    v = truth.normal(0.0, 1.0 / np.sqrt(max(num_dense, 1)), size=num_dense)
    salt = {"train": 1, "test": 2}.get(split, 3 + sum(split.encode()))
    rng = np.random.default_rng((seed, salt))
    probs = 1.0 / np.arange(1, vocab + 1) ** zipf
    cdf = np.cumsum(probs / probs.sum())
    ranks = np.minimum(np.searchsorted(cdf, rng.random((n, fields))), vocab - 1)
    dense = rng.normal(size=(n, num_dense)).astype(np.float32)
    logit = bias + dense.astype(np.float64) @ v + w[np.arange(fields), ranks].sum(axis=1)
    p = 1.0 / (1.0 + np.exp(-logit))
    y = (rng.random(n) < p).astype(np.float32)
    ids = np.stack([field_ids(f, ranks[:, f]) for f in range(fields)], axis=1)
    return CTRDataset(dense, ids, y, f"synthetic-ctr-{split}", p)


def auc(y: Array, score: Array) -> float:
    """Area under the ROC curve of ``score`` for binary labels ``y`` (ties count half)."""
    y = np.asarray(y).astype(bool)
    score = np.asarray(score, dtype=np.float64)
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        raise ValueError("auc needs both positive and negative labels")
    order = np.argsort(score, kind="mergesort")
    s = score[order]
    # average ranks over runs of equal scores
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], s.size]
    avg = (starts + ends + 1) / 2.0  # 1-based average rank of each run
    ranks = np.empty(s.size)
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def logloss(y: Array, p: Array, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities ``p`` against labels ``y``."""
    p = np.clip(np.asarray(p, dtype=np.float64), eps, 1.0 - eps)
    y = np.asarray(y, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def read_criteo(path: str | os.PathLike[str], limit: int | None = None) -> CTRDataset:
    """Read a Criteo text file (see the module rules); ``limit`` caps the examples."""
    dense_rows: list[list[float]] = []
    id_rows: list[list[int]] = []
    labels: list[float] = []
    fields = 1 + CRITEO_INTEGER + CRITEO_CATEGORICAL
    with open(path, encoding="ascii", errors="strict") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(labels) >= limit:
                break
            line = line.rstrip("\n").rstrip("\r")
            if not line:
                continue
            parts = line.split("\t")
            if len(parts) != fields:
                raise ValueError(f"{path}:{lineno}: {len(parts)} fields, expected {fields}")
            try:
                label = int(parts[0])
                ints = [int(v) if v else 0 for v in parts[1 : 1 + CRITEO_INTEGER]]
                cats = [int(v, 16) if v else _MISSING for v in parts[1 + CRITEO_INTEGER :]]
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            if label not in (0, 1):
                raise ValueError(f"{path}:{lineno}: label {label} is not 0 or 1")
            labels.append(float(label))
            dense_rows.append([float(np.log1p(max(v, 0))) for v in ints])
            id_rows.append([c & _MISSING for c in cats])
    if not labels:
        raise ValueError(f"{path}: no examples")
    raw = np.array(id_rows, dtype=np.uint64)
    ids = np.stack([field_ids(f, raw[:, f]) for f in range(CRITEO_CATEGORICAL)], axis=1)
    return CTRDataset(
        np.array(dense_rows, np.float32), ids, np.array(labels, np.float32), Path(path).name
    )


def write_criteo(path: str | os.PathLike[str], labels: Array, ints: Array, cats: Array) -> None:
    """Write examples in the Criteo text format (negative ints and cats: missing)."""
    with open(path, "w", encoding="ascii") as f:
        for y, row_i, row_c in zip(labels, ints, cats, strict=True):
            iv = ["" if v < 0 else str(int(v)) for v in row_i]
            cv = ["" if v < 0 else format(int(v), "08x") for v in row_c]
            f.write("\t".join([str(int(y)), *iv, *cv]) + "\n")


#: dataset names for the CTR job (``--dataset``)
CTR_DATASETS = ("synthetic-ctr", "criteo")


def load_ctr(
    name: str, split: str, examples: int, seed: int, data_dir: str | None = None
) -> CTRDataset:
    """The CTR job's data. ``synthetic-ctr``: ``examples`` training examples (test: a
    fifth as many, at least 2000) of :func:`synthetic_ctr`. ``criteo``: ``DATA_DIR/train.txt``
    in the Criteo format, its last tenth (by line) held out as the test split."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}")
    if name == "synthetic-ctr":
        n = examples if split == "train" else max(2000, examples // 5)
        return synthetic_ctr(n, fields=8, vocab=200, seed=seed, split=split)
    if name == "criteo":
        if data_dir is None:
            raise ValueError("dataset criteo needs data_dir (a folder holding train.txt)")
        data = read_criteo(Path(data_dir) / "train.txt")
        cut = len(data) - max(1, len(data) // 10)
        return data.take(slice(0, cut) if split == "train" else slice(cut, None))
    raise ValueError(f"unknown CTR dataset {name!r}; expected one of {', '.join(CTR_DATASETS)}")
