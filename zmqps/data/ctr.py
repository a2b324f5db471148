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
* :func:`read_ctr_text` reads that layout with any widths: ``num_dense`` dense then
  ``fields`` hex categorical fields, the label first and optional (a line one field
  shorter has none; every line of a file the same). Dense fields are Criteo integers
  (``"log1p"``, as above) or decimal numbers taken as they are (``"raw"``, the
  synthetic data's features); categorical values map to ids as above, so
  :func:`write_ctr_text` writes synthetic examples (``raw`` holds each categorical
  value before hashing: the Zipf rank) that read back into the same ids and features.
* Metrics: :func:`auc` (Mann-Whitney, ties counted half) and :func:`logloss`.
"""

from __future__ import annotations

import math
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
    "read_ctr_text",
    "synthetic_ctr",
    "write_criteo",
    "write_ctr_text",
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
    #: the categorical values before hashing (uint64 ``(n, fields)``), where known
    raw: Array | None = None

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
        raw = None if self.raw is None else self.raw[index]
        return CTRDataset(self.dense[index], self.ids[index], self.y[index], self.name, p, raw)

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
    return CTRDataset(dense, ids, y, f"synthetic-ctr-{split}", p, ranks.astype(np.uint64))


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


#: dense encodings of :func:`read_ctr_text`
DENSE_ENCODINGS = ("log1p", "raw")


def read_ctr_text(
    path: str | os.PathLike[str],
    *,
    fields: int = CRITEO_CATEGORICAL,
    num_dense: int = CRITEO_INTEGER,
    dense: str = "log1p",
    label: bool | None = None,
    limit: int | None = None,
) -> tuple[Array, Array, Array | None, Array]:
    """Read ``path`` in the Criteo layout with these widths (see the module rules):
    ``(ids, dense, labels, raw)``, labels float32 or None. ``label``: True, the label
    column is required; False, refused; None, a line's width says (every line alike)."""
    if dense not in DENSE_ENCODINGS:
        raise ValueError(f"dense encoding {dense!r}: expected one of {DENSE_ENCODINGS}")
    width = num_dense + fields
    dense_rows: list[list[float]] = []
    raw_rows: list[list[int]] = []
    labels: list[float] = []
    with open(path, encoding="ascii", errors="strict") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(raw_rows) >= limit:
                break
            line = line.rstrip("\n").rstrip("\r")
            if not line:
                continue
            parts = line.split("\t")
            if label is None and len(parts) in (width, width + 1):
                label = len(parts) == width + 1
            want = width + 1 if label else width
            if len(parts) != want:
                hint = f" ({width + 1} with a label)" if label is None else ""
                raise ValueError(f"{path}:{lineno}: {len(parts)} fields, expected {want}{hint}")
            if label:
                try:
                    y = int(parts[0])
                except ValueError as e:
                    raise ValueError(f"{path}:{lineno}: {e}") from None
                if y not in (0, 1):
                    raise ValueError(f"{path}:{lineno}: label {y} is not 0 or 1")
                labels.append(float(y))
                parts = parts[1:]
            try:
                if dense == "log1p":
                    nums = [float(max(int(v), 0)) if v else 0.0 for v in parts[:num_dense]]
                else:
                    nums = [float(v) if v else 0.0 for v in parts[:num_dense]]
                cats = [int(v, 16) & _MISSING if v else _MISSING for v in parts[num_dense:]]
            except (ValueError, OverflowError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            if dense == "raw" and not all(map(math.isfinite, nums)):
                raise ValueError(f"{path}:{lineno}: a dense value is not finite")
            dense_rows.append(nums)
            raw_rows.append(cats)
    if not raw_rows:
        raise ValueError(f"{path}: no examples")
    values = np.array(dense_rows, np.float64).reshape(len(raw_rows), num_dense)
    if dense == "log1p":
        values = np.log1p(values)
    raw = np.array(raw_rows, dtype=np.uint64).reshape(len(raw_rows), fields)
    ids = np.stack([field_ids(f, raw[:, f]) for f in range(fields)], axis=1)
    y_out = np.array(labels, np.float32) if label else None
    return ids.reshape(len(raw), fields), values.astype(np.float32), y_out, raw


def read_criteo(path: str | os.PathLike[str], limit: int | None = None) -> CTRDataset:
    """Read a Criteo text file (see the module rules); ``limit`` caps the examples."""
    ids, dense, y, _ = read_ctr_text(path, label=True, limit=limit)
    assert y is not None
    # no raw values: a Criteo file is text already, and they would double the ids' memory
    return CTRDataset(dense, ids, y, Path(path).name)


def write_criteo(path: str | os.PathLike[str], labels: Array, ints: Array, cats: Array) -> None:
    """Write examples in the Criteo text format (negative ints and cats: missing)."""
    with open(path, "w", encoding="ascii") as f:
        for y, row_i, row_c in zip(labels, ints, cats, strict=True):
            iv = ["" if v < 0 else str(int(v)) for v in row_i]
            cv = ["" if v < 0 else format(int(v), "08x") for v in row_c]
            f.write("\t".join([str(int(y)), *iv, *cv]) + "\n")


def write_ctr_text(path: str | os.PathLike[str], data: CTRDataset, labels: bool = True) -> None:
    """Write ``data`` in the Criteo layout with its widths, dense values as decimal numbers
    (read back with ``dense="raw"``: the same float32 features and ids). Needs
    ``data.raw`` (synthetic sets have it; a Criteo file is text already)."""
    if data.raw is None:
        raise ValueError(f"dataset {data.name}: the categorical values before hashing are unknown")
    with open(path, "w", encoding="ascii") as f:
        for k in range(len(data)):
            dv = [format(float(v), ".9g") for v in data.dense[k]]  # exact for float32
            cv = ["" if v == _MISSING else format(int(v), "x") for v in data.raw[k]]
            head = [str(int(data.y[k]))] if labels else []
            f.write("\t".join([*head, *dv, *cv]) + "\n")


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
