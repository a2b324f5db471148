"""Datasets for training: loading, per-worker sharding and deterministic mini-batches.

Layer map (this package depends on numpy and :mod:`zmqps.core` only; scikit-learn is
imported lazily)::

    batches  Dataset, shard, batches, stream, steps_per_epoch, examples_in
    digits   load_digits   (scikit-learn's bundled 8x8 digits)
    mnist    load_mnist, read_idx, write_idx   (IDX files, plain or .gz)
    preprocessing  PREPROCESSING, preprocessing, prepare   (raw values -> features;
                   an export records it, zmqps predict applies it)
    (here)   load_dataset  (by name)

Nothing here downloads data.
"""

from __future__ import annotations

import os

from zmqps.data.batches import Dataset, batches, examples_in, shard, steps_per_epoch, stream
from zmqps.data.digits import load_digits
from zmqps.data.mnist import load_mnist, read_idx, write_idx

__all__ = [
    "CLASSES",
    "DATASETS",
    "FEATURES",
    "Dataset",
    "batches",
    "examples_in",
    "load_dataset",
    "load_digits",
    "load_mnist",
    "read_idx",
    "shard",
    "steps_per_epoch",
    "stream",
    "write_idx",
]

#: names :func:`load_dataset` accepts.
DATASETS = ("digits", "mnist")
#: each data set's features an example (8x8 and 28x28 pixels) and its classes
FEATURES = {"digits": 64, "mnist": 784}
CLASSES = 10


def load_dataset(name: str, split: str, data_dir: str | os.PathLike[str] | None = None) -> Dataset:
    """Load dataset ``name`` ("digits" or "mnist"); MNIST needs ``data_dir``."""
    if name == "digits":
        return load_digits(split)
    if name == "mnist":
        if data_dir is None:
            raise ValueError("dataset mnist needs data_dir (a folder holding the IDX files)")
        return load_mnist(data_dir, split)
    raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
