"""Datasets: digits split, IDX round-trips and MNIST loading, sharding, batching."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from zmqps.data import (
    DATASETS,
    Dataset,
    batches,
    load_dataset,
    load_digits,
    load_mnist,
    read_idx,
    shard,
    steps_per_epoch,
    write_idx,
)


def _rows(x: np.ndarray) -> set[bytes]:
    return {row.tobytes() for row in x}


def _rows_list(x: np.ndarray) -> list[bytes]:
    return [row.tobytes() for row in np.asarray(x, dtype=np.float32)]


def _toy(n: int = 23, classes: int = 3) -> Dataset:
    x = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    return Dataset(x, np.arange(n) % classes, classes, "toy")


# --- Dataset -------------------------------------------------------------------------


def test_dataset_coerces_layout() -> None:
    x = np.asfortranarray(np.ones((4, 3), dtype=np.float64))
    ds = Dataset(x, np.array([0, 1, 0, 1], dtype=np.int32), 2, "t")
    assert ds.x.dtype == np.float32 and ds.x.flags.c_contiguous
    assert ds.y.dtype == np.int64
    assert len(ds) == 4 and ds.num_features == 3


@pytest.mark.parametrize(
    ("x", "y", "classes"),
    [
        (np.zeros(3), [0, 0, 0], 2),  # x not 2-D
        (np.zeros((3, 2)), [0, 0], 2),  # length mismatch
        (np.zeros((3, 2)), [0, 1, 2], 2),  # label out of range
        (np.zeros((3, 2)), [0, -1, 0], 2),
    ],
)
def test_dataset_rejects_bad_inputs(x: np.ndarray, y: list[int], classes: int) -> None:
    with pytest.raises(ValueError):
        Dataset(x, np.asarray(y), classes, "bad")


# --- digits --------------------------------------------------------------------------


def test_digits_shapes_and_range() -> None:
    train, test = load_digits("train"), load_digits("test")
    assert len(train) + len(test) == 1797
    assert len(test) == pytest.approx(0.2 * 1797, abs=10)
    for ds in (train, test):
        assert ds.x.shape[1] == 64 and ds.num_classes == 10 and ds.name == "digits"
        assert ds.x.dtype == np.float32 and ds.x.flags.c_contiguous
        assert ds.y.dtype == np.int64
        assert ds.x.min() >= 0.0 and ds.x.max() == 1.0
        # Stratified: every class present in both parts.
        assert set(np.unique(ds.y)) == set(range(10))


def test_digits_split_disjoint_and_deterministic() -> None:
    train, test = load_digits("train"), load_digits("test")
    # Digits has a few duplicate images, so compare (image, label) counts, not sets.
    all_x, all_y = np.concatenate([train.x, test.x]), np.concatenate([train.y, test.y])
    from sklearn.datasets import load_digits as sk_load_digits

    sk = sk_load_digits()
    expected = sorted(zip(_rows_list(sk.data / 16.0), sk.target.tolist(), strict=True))
    got = sorted(zip(_rows_list(all_x), all_y.tolist(), strict=True))
    assert got == expected

    again = load_digits("train")
    np.testing.assert_array_equal(again.x, train.x)
    np.testing.assert_array_equal(again.y, train.y)
    other = load_digits("train", seed=1)
    assert not np.array_equal(other.y, train.y)


def test_digits_returns_private_copies() -> None:
    a = load_digits("train")
    a.x[0, 0] = 123.0
    assert load_digits("train").x[0, 0] != 123.0


def test_digits_bad_arguments() -> None:
    with pytest.raises(ValueError, match="split"):
        load_digits("validation")
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits("train", test_fraction=1.0)


def test_load_dataset_dispatch(tmp_path: Path) -> None:
    assert DATASETS == ("digits", "mnist")
    assert load_dataset("digits", "test").name == "digits"
    _write_mnist(tmp_path, "test", 5)
    assert len(load_dataset("mnist", "test", data_dir=str(tmp_path))) == 5
    with pytest.raises(ValueError, match="data_dir"):
        load_dataset("mnist", "train")
    with pytest.raises(ValueError, match="digits, mnist"):
        load_dataset("cifar", "train")


# --- IDX / MNIST ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "int32", "float32", "float64"])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip(tmp_path: Path, dtype: str, suffix: str) -> None:
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal((3, 4, 5)) * 100).astype(dtype)
    path = tmp_path / f"a.idx{suffix}"
    write_idx(path, arr)
    if suffix:
        assert path.read_bytes()[:2] == b"\x1f\x8b"
    back = read_idx(path)
    assert back.dtype == np.dtype(dtype) and back.dtype.isnative
    assert back.flags.writeable
    np.testing.assert_array_equal(back, arr)


def test_idx_header_layout(tmp_path: Path) -> None:
    path = tmp_path / "labels"
    write_idx(path, np.array([7, 2, 1], dtype=np.uint8))
    assert path.read_bytes() == bytes([0, 0, 0x08, 1, 0, 0, 0, 3, 7, 2, 1])
    write_idx(path, np.array([[1]], dtype=">i4"))
    assert path.read_bytes() == bytes([0, 0, 0x0C, 2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1])


def test_idx_gzip_detected_by_content(tmp_path: Path) -> None:
    path = tmp_path / "no-suffix"
    path.write_bytes(gzip.compress(bytes([0, 0, 0x08, 1, 0, 0, 0, 2, 5, 6])))
    np.testing.assert_array_equal(read_idx(path), [5, 6])


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "magic"),
        (bytes([1, 0, 0x08, 1]), "magic"),
        (bytes([0, 0, 0x07, 1]), "magic"),  # unknown dtype code
        (bytes([0, 0, 0x08, 0]), "0 dims"),
        (bytes([0, 0, 0x08, 2, 0, 0, 0, 1]), "truncated"),  # header cut short
        (bytes([0, 0, 0x08, 1, 0, 0, 0, 3, 1, 2]), "truncated"),  # data cut short
        (bytes([0, 0, 0x0B, 1, 0, 0, 0, 1, 1]), "truncated"),  # half an int16
        (bytes([0, 0, 0x08, 1, 0, 0, 0, 1, 1, 2]), "trailing"),
    ],
)
def test_idx_rejects_bad_files(tmp_path: Path, data: bytes, match: str) -> None:
    path = tmp_path / "bad"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=match):
        read_idx(path)
    gz = tmp_path / "bad.gz"
    gz.write_bytes(gzip.compress(data))
    with pytest.raises(ValueError, match=match):
        read_idx(gz)


def test_idx_rejects_corrupt_gzip(tmp_path: Path) -> None:
    path = tmp_path / "bad.gz"
    path.write_bytes(gzip.compress(bytes([0, 0, 0x08, 1, 0, 0, 0, 1, 1]))[:-6])
    with pytest.raises(ValueError, match="gzip"):
        read_idx(path)


def test_write_idx_rejects_unsupported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="IDX code"):
        write_idx(tmp_path / "x", np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match="dims"):
        write_idx(tmp_path / "x", np.zeros((), dtype=np.uint8))


def _write_mnist(
    root: Path, split: str, n: int, gz: bool = False, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    prefix = "train" if split == "train" else "t10k"
    suffix = ".gz" if gz else ""
    write_idx(root / f"{prefix}-images-idx3-ubyte{suffix}", images)
    write_idx(root / f"{prefix}-labels-idx1-ubyte{suffix}", labels)
    return images, labels


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("split", ["train", "test"])
def test_load_mnist(tmp_path: Path, split: str, gz: bool) -> None:
    images, labels = _write_mnist(tmp_path, split, 20, gz=gz)
    ds = load_mnist(tmp_path, split)
    assert ds.name == "mnist" and ds.num_classes == 10
    assert ds.x.shape == (20, 784) and ds.x.dtype == np.float32 and ds.x.flags.c_contiguous
    assert ds.x.min() >= 0.0 and ds.x.max() <= 1.0
    np.testing.assert_allclose(ds.x, images.reshape(20, 784) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.y, labels)
    assert ds.y.dtype == np.int64


def test_load_mnist_missing_files_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte") as info:
        load_mnist(tmp_path, "train")
    assert "train-labels-idx1-ubyte" in str(info.value)
    _write_mnist(tmp_path, "train", 3)
    (tmp_path / "train-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match="train-labels-idx1-ubyte"):
        load_mnist(tmp_path, "train")
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
        load_mnist(tmp_path, "test")


def test_load_mnist_inconsistent_files(tmp_path: Path) -> None:
    _write_mnist(tmp_path, "train", 4)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(3, dtype=np.uint8))
    with pytest.raises(ValueError, match="labels"):
        load_mnist(tmp_path, "train")
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.full(4, 10, dtype=np.uint8))
    with pytest.raises(ValueError, match="labels"):
        load_mnist(tmp_path, "train")
    with pytest.raises(ValueError, match="split"):
        load_mnist(tmp_path, "valid")


# --- shard ---------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 3, 7, 23])
def test_shards_disjoint_and_covering(count: int) -> None:
    ds = _toy(23)
    parts = [shard(ds, i, count) for i in range(count)]
    sizes = [len(p) for p in parts]
    assert sum(sizes) == len(ds) and max(sizes) - min(sizes) <= 1
    seen = [row for p in parts for row in _rows(p.x)]
    assert len(seen) == len(set(seen)) and set(seen) == _rows(ds.x)
    for p in parts:
        assert p.x.flags.c_contiguous and p.num_classes == ds.num_classes
        # Labels stay attached to their examples.
        np.testing.assert_array_equal(p.y, (p.x[:, 0] // 2).astype(np.int64) % 3)


def test_shard_bad_arguments() -> None:
    ds = _toy(5)
    for index, count in [(-1, 2), (2, 2), (0, 0), (0, 6)]:
        with pytest.raises(ValueError):
            shard(ds, index, count)


# --- batches -------------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_cover_epoch(shuffle: bool, drop_last: bool) -> None:
    ds = _toy(23)
    out = list(batches(ds, 5, epoch=0, seed=1, shuffle=shuffle, drop_last=drop_last))
    assert len(out) == steps_per_epoch(23, 5, drop_last)
    sizes = [len(y) for _, y in out]
    assert sizes == ([5] * 4 if drop_last else [5] * 4 + [3])
    for x, y in out:
        assert x.dtype == np.float32 and x.flags.c_contiguous and y.dtype == np.int64
        np.testing.assert_array_equal(y, (x[:, 0] // 2).astype(np.int64) % 3)
    rows = [r for x, _ in out for r in _rows(x)]
    assert len(rows) == len(set(rows))
    if not drop_last:
        assert set(rows) == _rows(ds.x)
    if not shuffle:
        np.testing.assert_array_equal(np.concatenate([x for x, _ in out]), ds.x[: sum(sizes)])


def test_batches_deterministic_per_seed_and_epoch() -> None:
    ds = _toy(50)

    def order(epoch: int, seed: int) -> np.ndarray:
        return np.concatenate([x[:, 0] for x, _ in batches(ds, 8, epoch, seed)])

    np.testing.assert_array_equal(order(0, 3), order(0, 3))
    np.testing.assert_array_equal(order(4, 3), order(4, 3))
    assert not np.array_equal(order(0, 3), order(1, 3))
    assert not np.array_equal(order(0, 3), order(0, 4))
    assert not np.array_equal(order(0, 3), ds.x[:, 0])


def test_batches_validate_eagerly() -> None:
    ds = _toy(5)
    with pytest.raises(ValueError):
        batches(ds, 0, 0, 0)
    with pytest.raises(ValueError):
        batches(ds, 2, -1, 0)


def test_steps_per_epoch() -> None:
    assert steps_per_epoch(10, 3) == 4
    assert steps_per_epoch(10, 3, drop_last=True) == 3
    assert steps_per_epoch(9, 3) == steps_per_epoch(9, 3, True) == 3
    assert steps_per_epoch(0, 3) == 0
    with pytest.raises(ValueError):
        steps_per_epoch(10, 0)


@pytest.mark.parametrize(("n", "batch"), [(719, 32), (64, 32), (5, 8), (1, 1), (33, 4)])
def test_examples_in_the_first_batches_are_those_stream_yields(n: int, batch: int) -> None:
    """The examples of a worker's first c batches are its data's (each epoch's last
    batch is the rest): a resumed or rewound worker counts them exactly, where the
    run's mean batch size was 24 examples off over 20 epochs of 719."""
    from zmqps.data import examples_in, stream

    ds = Dataset(np.zeros((n, 2), np.float32), np.zeros(n, np.int64), 2, "t")
    seen = [0]
    for x, _ in stream(ds, batch, 3, seed=1):
        seen.append(seen[-1] + len(x))
    assert [examples_in(n, batch, c) for c in range(len(seen))] == seen
    with pytest.raises(ValueError):
        examples_in(n, batch, -1)
