"""The in-memory :class:`Dataset`, per-worker sharding and deterministic mini-batches.

Rules of this module:

* A :class:`Dataset` holds ``x`` as C-contiguous float32 ``(n, features)`` and ``y`` as
  int64 ``(n,)`` labels in ``[0, num_classes)``; the constructor coerces (copying only
  when needed) and validates, so every consumer can rely on that layout.
* :func:`shard` is strided: example ``i`` belongs to shard ``i % count``. Every example is
  in exactly one shard, shard sizes differ by at most one, and class mixes stay close
  to the whole set's even when the set is ordered by class.
* :func:`batches` depends only on ``(dataset, batch_size, epoch, seed, shuffle,
  drop_last)``: the same arguments give the same batches in every process.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["Dataset", "batches", "examples_in", "shard", "steps_per_epoch"]


@dataclass(frozen=True, eq=False)
class Dataset:
    """Examples ``x`` (float32, ``(n, features)``) with int64 labels ``y`` (``(n,)``)."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        x = np.ascontiguousarray(self.x, dtype=np.float32)
        y = np.ascontiguousarray(self.y, dtype=np.int64)
        if x.ndim != 2:
            raise ValueError(f"dataset {self.name}: x must be 2-D (n, features), got {x.shape}")
        if y.shape != (x.shape[0],):
            raise ValueError(
                f"dataset {self.name}: y shape {y.shape} does not match x rows {x.shape[0]}"
            )
        if self.num_classes < 1:
            raise ValueError(f"dataset {self.name}: num_classes must be >= 1")
        if y.size and (y.min() < 0 or y.max() >= self.num_classes):
            raise ValueError(f"dataset {self.name}: labels must lie in [0, {self.num_classes})")
        object.__setattr__(self, "x", x)
        object.__setattr__(self, "y", y)
        object.__setattr__(self, "num_classes", int(self.num_classes))

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def num_features(self) -> int:
        return int(self.x.shape[1])

    def __repr__(self) -> str:
        return (
            f"Dataset(name={self.name!r}, n={len(self)}, features={self.num_features},"
            f" num_classes={self.num_classes})"
        )


def shard(ds: Dataset, index: int, count: int) -> Dataset:
    """Worker ``index``'s share of ``ds`` out of ``count``: examples ``index, index+count, ...``.

    The shards of ``0..count-1`` are disjoint and together hold every example once.
    """
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard index {index} out of range for count {count}")
    if count > len(ds):
        raise ValueError(f"cannot split {len(ds)} examples of {ds.name} into {count} shards")
    if count == 1:
        return ds
    return Dataset(ds.x[index::count], ds.y[index::count], ds.num_classes, ds.name)


def steps_per_epoch(n: int, batch_size: int, drop_last: bool = False) -> int:
    """Number of batches :func:`batches` yields for ``n`` examples."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return n // batch_size if drop_last else -(-n // batch_size)


def examples_in(n: int, batch_size: int, count: int) -> int:
    """The examples of the first ``count`` batches :func:`stream` yields for ``n``
    examples in batches of ``batch_size`` (each epoch's last batch is the rest, smaller
    when ``batch_size`` does not divide ``n``): exact, whatever the epoch they end in."""
    per_epoch = steps_per_epoch(n, batch_size)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not per_epoch:
        return 0
    epochs, rest = divmod(count, per_epoch)
    return epochs * n + min(rest * batch_size, n)


def batches(
    ds: Dataset,
    batch_size: int,
    epoch: int,
    seed: int,
    shuffle: bool = True,
    drop_last: bool = False,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(x, y)`` mini-batches of one epoch: C-contiguous float32 ``x``, int64 ``y``.

    With ``shuffle`` the order is a permutation seeded by ``(seed, epoch)`` (both >= 0),
    so every epoch differs and every process agrees. Without it, batches are row slices
    (views) of ``ds`` in order; treat them as read-only.
    """
    steps = steps_per_epoch(len(ds), batch_size, drop_last)
    if shuffle and (seed < 0 or epoch < 0):
        raise ValueError(f"seed ({seed}) and epoch ({epoch}) must be >= 0")
    # Validate eagerly (above), iterate lazily (below).
    return _iterate(ds, batch_size, steps, (seed, epoch) if shuffle else None)


def stream(
    ds: Dataset, batch_size: int, epochs: int, seed: int, start: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The batches of ``epochs`` shuffled epochs (as :func:`batches` yields them, one
    epoch after the other) from the ``start``-th on: where a worker's data resumes."""
    per_epoch = steps_per_epoch(len(ds), batch_size)
    if start < 0 or seed < 0:
        raise ValueError(f"start ({start}) and seed ({seed}) must be >= 0")
    first, skip = divmod(start, per_epoch) if per_epoch else (epochs, 0)
    for epoch in range(first, epochs):
        yield from _iterate(ds, batch_size, per_epoch, (seed, epoch), skip if epoch == first else 0)


def _iterate(
    ds: Dataset, batch_size: int, steps: int, seed: tuple[int, int] | None, start: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    if seed is None:
        for i in range(start, steps):
            lo = i * batch_size
            yield ds.x[lo : lo + batch_size], ds.y[lo : lo + batch_size]
        return
    order = np.random.default_rng(list(seed)).permutation(len(ds))
    for i in range(start, steps):
        idx = order[i * batch_size : (i + 1) * batch_size]
        # Fancy indexing copies into fresh C-contiguous arrays.
        yield ds.x[idx], ds.y[idx]
