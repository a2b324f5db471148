"""Checkpoint files of hash-keyed tables, and reading them back onto any sharding.

Rules of this module:

* A hash shard's file has the shard-file name, metadata and manifest record of any
  shard (:mod:`zmqps.checkpoint.format`): ``row_start`` / ``rows`` are its bucket
  range, so the manifest's coverage check holds unchanged. Its tensors are ``ids``
  (int64 ``(n,)``, ascending), ``values`` ``(n, *row_shape)``, ``slot.<name>`` of the
  same shape and ``touched`` (int64 ``(n,)``: the shard version each row was last
  touched at); the metadata adds ``"table": "hash"`` and the row count ``n``.
* :func:`read_table` gathers the rows of a bucket range from every file whose range
  overlaps it and keeps those whose id hashes into the range: a table restores onto
  any number of PS, each id landing where :func:`~zmqps.core.hashtable.bucket_of`
  routes it.
* Files are checked against their records (metadata, tensor names, shapes, dtypes)
  before anything is used; every problem is a :class:`CheckpointError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError

from zmqps.checkpoint.format import (
    CheckpointError,
    ShardRecord,
    open_shard,
    st_dtype,
    write_shard_file,
)
from zmqps.core.hashtable import bucket_of
from zmqps.core.variables import ShardDef, VariableDef

if TYPE_CHECKING:
    from zmqps.checkpoint.root import Checkpoint

__all__ = ["TableRows", "check_table_header", "read_table", "write_table_shard"]

Array = npt.NDArray[Any]

TableRows = tuple[Array, Array, dict[str, Array], Array, int]


def write_table_shard(
    directory: Path,
    shard: ShardDef,
    ids: Array,
    values: Array,
    slots: Mapping[str, Array],
    touched: Array,
    version: int,
) -> ShardRecord:
    """Write one hash shard's live rows (see the module rules); like ``write_shard``."""
    directory = Path(directory)
    where = f"hash shard {shard.id} ({shard.var})"
    n = int(ids.shape[0])
    row_shape = tuple(shard.full_shape[1:])
    if ids.dtype != np.int64 or ids.ndim != 1 or touched.shape != (n,):
        raise CheckpointError(f"{where}: ids and touched must be int64 of one length")
    if values.shape != (n, *row_shape) or values.dtype != np.dtype(shard.dtype):
        raise CheckpointError(f"{where}: values {values.dtype}{values.shape} do not match")
    tensors = {
        "ids": np.ascontiguousarray(ids),
        "touched": np.ascontiguousarray(touched, dtype=np.int64),
        "values": np.ascontiguousarray(values),
    }
    for name in sorted(slots):
        if slots[name].shape[0] != n:
            raise CheckpointError(f"{where}: slot {name} has {slots[name].shape[0]} rows")
        tensors[f"slot.{name}"] = np.ascontiguousarray(slots[name]).reshape(n, *row_shape)
    extra = {"table": "hash", "table_rows": str(n)}
    return write_shard_file(directory, shard, tensors, version, sorted(slots), where, extra)


def check_table_header(f: Any, rec: ShardRecord, var: VariableDef) -> str | None:
    """Does an open hash shard file agree with its record? (``None``: yes)."""
    meta = f.metadata() or {}
    if meta.get("table") != "hash":
        return "not a hash-table shard file, but the variable is a hash-keyed table"
    try:
        n = int(meta.get("table_rows", ""))
    except ValueError:
        return f"bad table_rows {meta.get('table_rows')!r}"
    keys = set(f.keys())
    want = {"ids", "touched", "values", *(f"slot.{s}" for s in rec.slots)}
    if keys != want:
        return f"tensors {sorted(keys)}, manifest says {sorted(want)}"
    for key in sorted(want):
        sl = f.get_slice(key)
        shape = tuple(sl.get_shape())
        code = sl.get_dtype()
        if key in ("ids", "touched"):
            if shape != (n,) or code != "I64":
                return f"{key} is {code}{list(shape)}, expected I64[{n}]"
            continue
        if shape != (n, *var.shape[1:]):
            return f"{key} has shape {shape}, expected {(n, *var.shape[1:])}"
        dtype = st_dtype(code, f"{rec.file} {key}")
        if key == "values" and dtype != rec.dtype:
            return f"values are {dtype}, manifest says {rec.dtype}"
    return None


def read_table(ckpt: Checkpoint, var: str, bucket_start: int, buckets: int) -> TableRows:
    """``(ids, values, slots, touched, version)`` of every row of table ``var`` whose id
    hashes into buckets ``[bucket_start, bucket_start + buckets)``, ids ascending."""
    from zmqps.checkpoint.root import _check_meta

    v = ckpt.variable(var)
    if not v.hashed:
        raise CheckpointError(f"checkpoint {ckpt.name}: {var!r} is not a hash-keyed table")
    end = bucket_start + buckets
    if buckets < 1 or bucket_start < 0 or end > v.shape[0]:
        raise CheckpointError(f"read_table: buckets [{bucket_start}, {end}) outside {var!r}")
    parts: list[tuple[Array, Array, dict[str, Array], Array]] = []
    slot_names: tuple[str, ...] | None = None
    version = 0
    for rec in ckpt.manifest.shards_of(var):
        if min(rec.row_end, end) <= max(rec.row_start, bucket_start):
            continue
        if slot_names is None:
            slot_names = rec.slots
        elif rec.slots != slot_names:
            raise CheckpointError(f"checkpoint {ckpt.name}: shards of {var!r} differ in slots")
        p = ckpt.path / rec.file
        try:
            with open_shard(p) as f:
                _check_meta(f, rec)
                problem = check_table_header(f, rec, v)
                if problem:
                    raise CheckpointError(f"{p}: {problem}")
                ids = np.array(f.get_tensor("ids"))
                b = bucket_of(ids, v.shape[0])
                keep = np.flatnonzero((b >= bucket_start) & (b < end))
                if ids.size and (int(b.min()) < rec.row_start or int(b.max()) >= rec.row_end):
                    raise CheckpointError(f"{p}: holds ids outside its buckets")
                parts.append(
                    (
                        ids[keep],
                        np.array(f.get_tensor("values"))[keep],
                        {s: np.array(f.get_tensor(f"slot.{s}"))[keep] for s in rec.slots},
                        np.array(f.get_tensor("touched"))[keep],
                    )
                )
        except SafetensorError as exc:
            raise CheckpointError(f"{p}: {exc}") from exc
        except OSError as exc:
            raise CheckpointError(f"{p}: {exc.strerror or exc}") from exc
        version = max(version, rec.version)
    row_shape = v.shape[1:]
    ids = np.concatenate([q[0] for q in parts]) if parts else np.zeros(0, np.int64)
    order = np.argsort(ids, kind="stable")
    if ids.size > 1 and (np.diff(ids[order]) == 0).any():
        raise CheckpointError(f"checkpoint {ckpt.name}: an id of {var!r} is in two shards")
    values = np.concatenate([q[1] for q in parts]) if parts else np.zeros((0, *row_shape), v.dtype)
    slots = {s: np.concatenate([q[2][s] for q in parts])[order] for s in slot_names or ()}
    touched = np.concatenate([q[3] for q in parts]) if parts else np.zeros(0, np.int64)
    return ids[order], values[order], slots, touched[order], version
