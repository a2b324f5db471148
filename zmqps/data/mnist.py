"""MNIST from the standard IDX files, plain or gzipped; no downloads.

IDX layout: 4 magic bytes ``0x00 0x00 <dtype code> <ndim>``, then ``ndim`` big-endian
uint32 dims, then the elements big-endian, row-major. The file size must match the
dims exactly; anything else is a :class:`ValueError` naming the file.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
from pathlib import Path

import numpy as np

from zmqps.data.batches import Dataset
from zmqps.data.preprocessing import PREPROCESSING, divide

__all__ = ["IDX_DTYPES", "find_mnist", "load_mnist", "mnist_file_names", "read_idx", "write_idx"]

#: IDX dtype code -> big-endian numpy dtype.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_CODES = {dt.newbyteorder("="): code for code, dt in IDX_DTYPES.items()}
_GZIP_MAGIC = b"\x1f\x8b"
_PREFIX = {"train": "train", "test": "t10k"}


def _read_bytes(path: str | os.PathLike[str]) -> bytes:
    with open(path, "rb") as f:
        raw = f.read()
    # Sniff rather than trust the suffix: renamed files still load.
    if str(path).endswith(".gz") and raw[:2] != _GZIP_MAGIC and raw[:2] != b"\x00\x00":
        raise ValueError(f"{path}: not gzip data (starts {raw[:4].hex() or 'empty'})")
    if raw[:2] == _GZIP_MAGIC:
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ValueError(f"{path}: corrupt gzip data ({e})") from e
    return raw


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """The array stored in IDX file ``path`` (gzip detected from its content), native byte order."""
    raw = _read_bytes(path)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic {raw[:4].hex() or 'empty'})")
    dtype, ndim = IDX_DTYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if ndim == 0:
        raise ValueError(f"{path}: IDX file declares 0 dims")
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({ndim} dims, {len(raw)} bytes)")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = header + math.prod(dims) * dtype.itemsize
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "has trailing bytes"
        raise ValueError(f"{path}: IDX file {what}: {len(raw)} bytes, dims {dims} need {expected}")
    data = np.frombuffer(raw, dtype=dtype, count=math.prod(dims), offset=header)
    # astype copies: a writable, native-endian array independent of ``raw``.
    return data.reshape(dims).astype(dtype.newbyteorder("="))


def write_idx(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """Write ``array`` as an IDX file; gzipped when ``path`` ends with ``.gz``."""
    arr = np.asarray(array)
    code = _CODES.get(arr.dtype.newbyteorder("="))
    if code is None:
        raise ValueError(f"dtype {arr.dtype} has no IDX code")
    if not 1 <= arr.ndim <= 255:
        raise ValueError(f"IDX needs 1..255 dims, got {arr.ndim}")
    if any(d >= 2**32 for d in arr.shape):
        raise ValueError(f"IDX dims must fit in uint32, got {arr.shape}")
    payload = b"".join(
        (
            bytes((0, 0, code, arr.ndim)),
            struct.pack(f">{arr.ndim}I", *arr.shape),
            np.ascontiguousarray(arr, dtype=IDX_DTYPES[code]).tobytes(),
        )
    )
    if str(path).endswith(".gz"):
        payload = gzip.compress(payload, mtime=0)
    with open(path, "wb") as f:
        f.write(payload)


def mnist_file_names(split: str) -> tuple[str, str]:
    """The (images, labels) file names of ``split`` ("train" or "test"), without ``.gz``."""
    if split not in _PREFIX:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(_PREFIX)}")
    prefix = _PREFIX[split]
    return f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"


def _find(data_dir: Path, names: tuple[str, ...]) -> list[Path]:
    """The path of each of ``names`` in ``data_dir``, plain preferred over ``.gz``."""
    found = {
        name: next((p for p in (data_dir / name, data_dir / f"{name}.gz") if p.is_file()), None)
        for name in names
    }
    missing = [name for name, p in found.items() if p is None]
    if missing:
        raise FileNotFoundError(
            f"MNIST files not found in {data_dir}: expected "
            + ", ".join(f"{n} or {n}.gz" for n in missing)
        )
    return [p for p in found.values() if p is not None]


def find_mnist(data_dir: str | os.PathLike[str], split: str = "train") -> list[Path]:
    """The (images, labels) paths of ``split`` in ``data_dir``; FileNotFoundError
    naming what is missing."""
    return _find(Path(data_dir), mnist_file_names(split))


def load_mnist(data_dir: str | os.PathLike[str], split: str = "train") -> Dataset:
    """MNIST ``split`` from ``data_dir``: images flattened to float32 in ``[0, 1]``."""
    images_name, labels_name = mnist_file_names(split)
    images_path, labels_path = find_mnist(data_dir, split)
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise ValueError(
            f"{images_name}: expected uint8 (n, rows, cols), got {images.dtype} {images.shape}"
        )
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise ValueError(f"{labels_name}: {labels.shape} labels for {images.shape[0]} images")
    if labels.dtype.kind not in "iu":
        raise ValueError(f"{labels_name}: labels of {labels.dtype}, expected integers 0-9")
    bad = labels[(labels < 0) | (labels > 9)]
    if bad.size:
        raise ValueError(f"{labels_name}: label {int(bad[0])} is not a digit 0-9")
    x = divide(images.reshape(images.shape[0], -1), PREPROCESSING["mnist"]["x"]["by"])
    return Dataset(x, labels.astype(np.int64), num_classes=10, name="mnist")
