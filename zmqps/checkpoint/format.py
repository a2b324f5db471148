"""The checkpoint file format: one safetensors file per shard, and the JSON manifest.

Rules of this module:

* A shard file is ``shard-{id:06d}.safetensors`` holding the tensor ``values``
  (the shard's rows, shaped ``ShardDef.shape``) and one ``slot.<name>`` tensor per
  optimizer slot (same shape), plus string metadata naming the variable, shard id,
  row range and version. It is written through :mod:`safetensors.numpy` (no
  pickle anywhere, nothing is ever evaluated on load) to a temp file in the same
  directory, fsynced, then renamed: a reader never sees half a shard file.
* The sha256 of a shard file is computed by streaming the written file: a big shard
  is never held twice in memory.
* The manifest is plain JSON (``"format": "zmqps-checkpoint"``, format version 1).
  :meth:`Manifest.from_json` validates every field and the shards' coverage of each
  variable before anything is trusted; anything malformed or foreign raises
  :class:`CheckpointError` with one clear line.
* Every failure on purpose is a :class:`CheckpointError` (a ``ZmqpsError`` with code
  ``"checkpoint"``); ``OSError`` (ENOSPC, EIO...) from writing is translated here,
  and the partial file removed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from zmqps.core.variables import FLOAT_DTYPES, ShardDef, VariableDef
from zmqps.wire.errors import InvalidArgument, ZmqpsError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MODES",
    "CheckpointError",
    "Manifest",
    "ShardContents",
    "ShardRecord",
    "fsync_dir",
    "nesting_depth",
    "read_shard_file",
    "sha256_file",
    "shard_file_name",
    "write_file_atomic",
    "write_shard",
]

Array = npt.NDArray[Any]

#: The manifest's ``format`` marker and version this module writes and reads.
FORMAT = "zmqps-checkpoint"
FORMAT_VERSION = 1
#: The ``format`` marker in every shard file's safetensors metadata.
SHARD_FORMAT = "zmqps-shard"
#: Training modes a manifest may record.
MODES = ("async", "sync", "ssp")

#: Shard file names: bare names only, never paths.
_SHARD_FILE = re.compile(r"shard-[0-9]{6,}\.safetensors")
#: Slot names (optimizer slot names are short identifiers).
_SLOT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: safetensors dtype codes of the float dtypes a shard may hold.
_ST_DTYPES = {"F16": "float16", "F32": "float32", "F64": "float64"}
#: A manifest larger than this is refused before parsing.
MAX_MANIFEST_BYTES = 64 << 20
#: A manifest nesting deeper than this is refused right after parsing (validation and
#: error messages recurse into values; a JSON document can nest ~1000 deep).
MAX_MANIFEST_DEPTH = 64
_HASH_CHUNK = 1 << 20


class CheckpointError(ZmqpsError):
    """A checkpoint could not be written, or what is on disk is missing, malformed,
    truncated or corrupted. The message says which file and what is wrong."""

    code = "checkpoint"


def shard_file_name(shard_id: int) -> str:
    """The bare file name of shard ``shard_id``'s file in a checkpoint directory."""
    return f"shard-{shard_id:06d}.safetensors"


# -- small IO helpers ---------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """fsync a directory, so renames and creations inside it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(final: str) -> str:
    return f".tmp-{final}-{secrets.token_hex(4)}"


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same directory (fsync +
    rename + fsync of the directory). Raises ``OSError``; the temp file is removed."""
    tmp = path.with_name(_tmp_name(path.name))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def sha256_file(path: str | os.PathLike[str], chunk_size: int = _HASH_CHUNK) -> str:
    """The hex sha256 of a file's bytes, read in chunks of ``chunk_size`` (one buffer)."""
    h = hashlib.sha256()
    buf = bytearray(chunk_size)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def _describe(exc: BaseException) -> str:
    """One line for an IO failure, naming ENOSPC plainly."""
    if isinstance(exc, OSError):
        if exc.errno == errno.ENOSPC:
            return "no space left on device"
        return exc.strerror or str(exc)
    text = str(exc)
    if "os error 28" in text or "No space left" in text:
        return "no space left on device"
    return text


# -- shard records ------------------------------------------------------------


def _field(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise CheckpointError(f"{where}: missing {key!r}")
    value = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise CheckpointError(f"{where}: {key!r} must be {_kind_name(kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise CheckpointError(
            f"{where}: {key!r} must be {_kind_name(kinds)}, got {type(value).__name__}"
        )
    return value


def _kind_name(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def _nonneg(d: Mapping[str, Any], key: str, where: str, minimum: int = 0) -> int:
    value: int = _field(d, key, int, where)
    if value < minimum:
        raise CheckpointError(f"{where}: {key!r} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class ShardRecord:
    """What the manifest says about one shard file (the PS returns it after writing).

    ``file`` is a bare name in the checkpoint directory; ``nbytes`` and ``sha256`` are
    of the whole file; ``slots`` are the optimizer slot names it holds (sorted).
    """

    file: str
    shard_id: int
    var: str
    row_start: int
    rows: int
    dtype: str
    version: int
    sha256: str
    nbytes: int
    slots: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "slots", tuple(self.slots))
        where = f"shard record {self.file!r}"
        if not isinstance(self.file, str) or not _SHARD_FILE.fullmatch(self.file):
            raise CheckpointError(f"{where}: not a shard file name (shard-NNNNNN.safetensors)")
        for key in ("shard_id", "row_start", "version", "nbytes"):
            _nonneg(self.__dict__, key, where)
        _nonneg(self.__dict__, "rows", where, minimum=1)
        if self.file != shard_file_name(self.shard_id):
            raise CheckpointError(f"{where}: does not match shard id {self.shard_id}")
        if not isinstance(self.var, str) or not 1 <= len(self.var) <= 256:
            raise CheckpointError(f"{where}: bad variable name {self.var!r}")
        if self.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{where}: dtype {self.dtype!r} not in {FLOAT_DTYPES}")
        if not isinstance(self.sha256, str) or not _SHA256.fullmatch(self.sha256):
            raise CheckpointError(f"{where}: sha256 must be 64 lowercase hex digits")
        for s in self.slots:
            if not isinstance(s, str) or not _SLOT_NAME.fullmatch(s):
                raise CheckpointError(f"{where}: bad slot name {s!r}")
        if len(set(self.slots)) != len(self.slots):
            raise CheckpointError(f"{where}: duplicate slot names {self.slots}")

    @property
    def row_end(self) -> int:
        return self.row_start + self.rows

    def to_json(self) -> dict[str, Any]:
        """A JSON- (and msgpack-) able dict."""
        return {
            "file": self.file,
            "shard_id": self.shard_id,
            "var": self.var,
            "row_start": self.row_start,
            "rows": self.rows,
            "dtype": self.dtype,
            "version": self.version,
            "sha256": self.sha256,
            "nbytes": self.nbytes,
            "slots": list(self.slots),
        }

    @classmethod
    def from_json(cls, d: Any) -> ShardRecord:
        """Validate and build from :meth:`to_json`'s dict; :class:`CheckpointError` if bad."""
        if not isinstance(d, Mapping):
            raise CheckpointError(f"shard record must be an object, got {type(d).__name__}")
        where = f"shard record {d.get('file')!r}"
        slots = _field(d, "slots", (list, tuple), where)
        return cls(
            file=_field(d, "file", str, where),
            shard_id=_field(d, "shard_id", int, where),
            var=_field(d, "var", str, where),
            row_start=_field(d, "row_start", int, where),
            rows=_field(d, "rows", int, where),
            dtype=_field(d, "dtype", str, where),
            version=_field(d, "version", int, where),
            sha256=_field(d, "sha256", str, where),
            nbytes=_field(d, "nbytes", int, where),
            slots=tuple(slots),
        )


# -- writing and reading shard files -----------------------------------------


def _check_array(what: str, a: Any, shape: tuple[int, ...], dtype: str | None) -> Array:
    if not isinstance(a, np.ndarray):
        raise CheckpointError(f"{what} must be a numpy array, got {type(a).__name__}")
    if a.dtype.name not in FLOAT_DTYPES or not a.dtype.isnative:
        raise CheckpointError(f"{what}: dtype {a.dtype.str} is not a native float16/32/64")
    if dtype is not None and a.dtype != np.dtype(dtype):
        raise CheckpointError(f"{what}: dtype {a.dtype.name}, expected {dtype}")
    if a.shape != shape:
        raise CheckpointError(f"{what}: shape {a.shape}, expected {shape}")
    return np.ascontiguousarray(a)


def write_shard(
    directory: Path,
    shard: ShardDef,
    values: Array,
    slots: Mapping[str, Array],
    version: int,
) -> ShardRecord:
    """Write one shard's values and slots to ``directory/shard-{id:06d}.safetensors``.

    ``values`` has ``shard.shape`` and ``shard.dtype``; every slot has ``shard.shape``
    and a float dtype. Written to a temp file in the same directory, fsynced, renamed;
    the sha256 is streamed from the written file. Raises :class:`CheckpointError` on
    bad arguments and on any IO failure (ENOSPC...), leaving no partial file.
    """
    directory = Path(directory)
    where = f"shard {shard.id} ({shard.var})"
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise CheckpointError(f"{where}: version must be a non-negative integer, got {version!r}")
    tensors = {"values": _check_array(f"{where} values", values, shard.shape, shard.dtype)}
    for name in sorted(slots):
        if not isinstance(name, str) or not _SLOT_NAME.fullmatch(name):
            raise CheckpointError(f"{where}: bad slot name {name!r}")
        tensors[f"slot.{name}"] = _check_array(
            f"{where} slot {name}", slots[name], shard.shape, None
        )
    return write_shard_file(directory, shard, tensors, version, sorted(slots), where)


def write_shard_file(
    directory: Path,
    shard: ShardDef,
    tensors: Mapping[str, Any],
    version: int,
    slots: Sequence[str],
    where: str,
    extra: Mapping[str, str] | None = None,
) -> ShardRecord:
    """Write checked ``tensors`` of one shard as its safetensors file, atomically: a
    temp file in ``directory``, fsynced, hashed, renamed, the directory fsynced. The
    metadata names the shard (``extra`` adds keys). Raises :class:`CheckpointError` on
    any IO failure, leaving no partial file."""
    metadata = {
        "format": SHARD_FORMAT,
        "format_version": str(FORMAT_VERSION),
        "var": shard.var,
        "shard": str(shard.id),
        "row_start": str(shard.row_start),
        "rows": str(shard.rows),
        "full_shape": json.dumps(list(shard.full_shape)),
        "dtype": shard.dtype,
        "version": str(version),
        **(extra or {}),
    }
    final = directory / shard_file_name(shard.id)
    tmp = directory / _tmp_name(final.name)
    renamed = False
    try:
        save_file(dict(tensors), tmp, metadata=metadata)
        os.chmod(tmp, 0o644)  # safetensors creates 0600; other readers (evaluator, inspect)
        _fsync_file(tmp)
        digest = sha256_file(tmp)
        nbytes = tmp.stat().st_size
        os.replace(tmp, final)
        renamed = True
        fsync_dir(directory)
    except (OSError, SafetensorError) as exc:
        for p in (tmp, final) if renamed else (tmp,):
            with contextlib.suppress(OSError):
                p.unlink()
        raise CheckpointError(f"cannot write {where} to {final}: {_describe(exc)}") from exc
    return ShardRecord(
        file=final.name,
        shard_id=shard.id,
        var=shard.var,
        row_start=shard.row_start,
        rows=shard.rows,
        dtype=shard.dtype,
        version=version,
        sha256=digest,
        nbytes=nbytes,
        slots=tuple(sorted(slots)),
    )


class ShardContents(NamedTuple):
    """A whole shard file: values, slots by name, and its safetensors metadata."""

    values: Array
    slots: dict[str, Array]
    metadata: dict[str, str]


@contextlib.contextmanager
def open_shard(path: Path) -> Iterator[Any]:
    """``safe_open`` a shard file (numpy); header errors become :class:`CheckpointError`."""
    try:
        f = safe_open(path, framework="numpy")
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"{path}: cannot open shard file: {_describe(exc)}") from exc
    with f:
        yield f


def st_dtype(code: str, where: str) -> str:
    """The numpy dtype name of a safetensors dtype code, if a float we store."""
    try:
        return _ST_DTYPES[code]
    except KeyError:
        raise CheckpointError(f"{where}: tensor dtype {code} is not float16/32/64") from None


def read_shard_file(path: str | os.PathLike[str]) -> ShardContents:
    """Read a whole shard file (values, slots, metadata); arrays are fresh copies."""
    p = Path(path)
    with open_shard(p) as f:
        try:
            meta = dict(f.metadata() or {})
            keys = list(f.keys())
            if "values" not in keys:
                raise CheckpointError(f"{p}: no 'values' tensor (not a zmqps shard file)")
            for k in keys:  # numpy cannot hold every safetensors dtype (e.g. BF16)
                if k == "values" or k.startswith("slot."):
                    st_dtype(f.get_slice(k).get_dtype(), f"{p} {k}")
            values = np.array(f.get_tensor("values"))
            slots = {
                k[len("slot.") :]: np.array(f.get_tensor(k))
                for k in sorted(keys)
                if k.startswith("slot.")
            }
        except SafetensorError as exc:
            raise CheckpointError(f"{p}: {exc}") from exc
    return ShardContents(values, slots, meta)


# -- the manifest -------------------------------------------------------------


def _json_safe(what: str, value: Any) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"manifest: {what} is not JSON-serializable: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a committed checkpoint holds: written last, as ``manifest.json``.

    ``variables`` are :meth:`VariableDef.to_wire` dicts (a variable without its own
    optimizer uses ``optimizer``, the job default); ``shards`` must tile every
    variable's rows exactly. ``extra`` is free-form JSON (the chief stores worker
    steps and the like there). Construction validates everything
    (:class:`CheckpointError`).
    """

    format_version: int = FORMAT_VERSION
    step: int
    generation: int = 0
    mode: str = "async"
    created: float = field(default_factory=time.time)
    variables: Sequence[Mapping[str, Any]]
    optimizer: Mapping[str, Any]
    num_ps: int
    shards: Sequence[ShardRecord]
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "variables", tuple(dict(v) for v in self.variables))
        object.__setattr__(self, "shards", tuple(self.shards))
        object.__setattr__(self, "optimizer", dict(self.optimizer))
        object.__setattr__(self, "extra", dict(self.extra))
        if self.format_version != FORMAT_VERSION:
            raise CheckpointError(
                f"manifest: unsupported format version {self.format_version!r}"
                f" (this zmqps reads {FORMAT_VERSION})"
            )
        for key in ("step", "generation"):
            _nonneg(self.__dict__, key, "manifest")
        _nonneg(self.__dict__, "num_ps", "manifest", minimum=1)
        if self.mode not in MODES:
            raise CheckpointError(f"manifest: mode {self.mode!r} not in {MODES}")
        created = self.created
        if isinstance(created, bool) or not isinstance(created, (int, float)):
            raise CheckpointError(f"manifest: 'created' must be a number, got {created!r}")
        if not -1e300 < created < 1e300:  # math.isfinite overflows on a huge int
            raise CheckpointError("manifest: 'created' must be finite")
        object.__setattr__(self, "created", float(created))
        _json_safe("optimizer", self.optimizer)
        _json_safe("extra", self.extra)
        _json_safe("variables", self.variables)
        if not all(isinstance(s, ShardRecord) for s in self.shards):
            raise CheckpointError("manifest: shards must be ShardRecord objects")
        self._check_coverage(self.variable_defs())

    def variable_defs(self) -> list[VariableDef]:
        """The variables, as :class:`VariableDef` (in manifest order)."""
        out = []
        for i, d in enumerate(self.variables):
            if not isinstance(d.get("name"), str):
                raise CheckpointError(f"manifest: variable {i}: the name must be a string")
            try:
                out.append(VariableDef.from_wire(d))
            except (
                InvalidArgument,
                KeyError,
                TypeError,
                ValueError,
                AttributeError,  # init / optimizer that are not maps
                OverflowError,  # a dim of 1e400 (a float that overflows to inf)
            ) as exc:
                raise CheckpointError(f"manifest: variable {i}: {exc!r}") from None
        return out

    def _check_coverage(self, defs: list[VariableDef]) -> None:
        by_name: dict[str, VariableDef] = {}
        for v in defs:
            if v.name in by_name:
                raise CheckpointError(f"manifest: variable {v.name!r} listed twice")
            by_name[v.name] = v
        ids: set[int] = set()
        per_var: dict[str, list[ShardRecord]] = {name: [] for name in by_name}
        for s in self.shards:
            if s.shard_id in ids:
                raise CheckpointError(f"manifest: shard id {s.shard_id} listed twice")
            ids.add(s.shard_id)
            owner = by_name.get(s.var)
            if owner is None:
                raise CheckpointError(f"manifest: shard {s.shard_id} of unknown variable {s.var!r}")
            if s.dtype != owner.dtype:
                raise CheckpointError(
                    f"manifest: shard {s.shard_id} is {s.dtype},"
                    f" variable {owner.name} is {owner.dtype}"
                )
            per_var[s.var].append(s)
        for name, shards in per_var.items():
            rows = by_name[name].shape[0]
            at = 0
            for s in sorted(shards, key=lambda s: s.row_start):
                if s.row_start != at:
                    what = "overlap" if s.row_start < at else "gap"
                    raise CheckpointError(
                        f"manifest: shards of {name!r} do not tile its rows ({what} at row {at})"
                    )
                at = s.row_end
            if at != rows:
                raise CheckpointError(
                    f"manifest: shards of {name!r} cover rows [0, {at}) of {rows}"
                )

    @property
    def nbytes(self) -> int:
        """Bytes of every shard file together."""
        return sum(s.nbytes for s in self.shards)

    def shards_of(self, var: str) -> list[ShardRecord]:
        """The shard records of ``var``, in row order."""
        return sorted((s for s in self.shards if s.var == var), key=lambda s: s.row_start)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (see :meth:`dumps` for the text written to disk)."""
        return {
            "format": FORMAT,
            "format_version": self.format_version,
            "step": self.step,
            "generation": self.generation,
            "mode": self.mode,
            "created": self.created,
            "num_ps": self.num_ps,
            "optimizer": dict(self.optimizer),
            "variables": [dict(v) for v in self.variables],
            "shards": [s.to_json() for s in self.shards],
            "extra": dict(self.extra),
        }

    def dumps(self) -> str:
        """The manifest as JSON text."""
        return json.dumps(self.to_json(), indent=1, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str | bytes) -> Manifest:
        """Validate and build from a dict (:meth:`to_json`) or JSON text (:meth:`dumps`)."""
        if isinstance(data, (str, bytes, bytearray)):
            if len(data) > MAX_MANIFEST_BYTES:
                raise CheckpointError(f"manifest: larger than {MAX_MANIFEST_BYTES} bytes")
            try:
                data = json.loads(data, parse_constant=_refuse_constant)
            except (ValueError, RecursionError) as exc:
                raise CheckpointError(f"manifest: not valid JSON ({exc})") from None
        if nesting_depth(data, MAX_MANIFEST_DEPTH) > MAX_MANIFEST_DEPTH:
            raise CheckpointError(f"manifest: nested deeper than {MAX_MANIFEST_DEPTH} levels")
        if not isinstance(data, Mapping):
            raise CheckpointError(
                f"manifest: expected a JSON object, got {type(data).__name__}"
                " (not a zmqps checkpoint manifest)"
            )
        if data.get("format") != FORMAT:
            raise CheckpointError(
                f"manifest: format is {data.get('format')!r}, expected {FORMAT!r}"
                " (not a zmqps checkpoint manifest)"
            )
        w = "manifest"
        variables = _field(data, "variables", list, w)
        if not all(isinstance(v, Mapping) for v in variables):
            raise CheckpointError("manifest: every variable must be an object")
        shards = _field(data, "shards", list, w)
        return cls(
            format_version=_field(data, "format_version", int, w),
            step=_field(data, "step", int, w),
            generation=_field(data, "generation", int, w),
            mode=_field(data, "mode", str, w),
            created=_field(data, "created", (int, float), w),
            variables=variables,
            optimizer=_field(data, "optimizer", dict, w),
            num_ps=_field(data, "num_ps", int, w),
            shards=[ShardRecord.from_json(s) for s in shards],
            extra=_field(data, "extra", dict, w),
        )

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Manifest:
        """Read and validate a ``manifest.json`` file."""
        p = Path(path)
        try:
            with open(p, "rb") as f:
                data = f.read(MAX_MANIFEST_BYTES + 1)
        except OSError as exc:
            raise CheckpointError(f"{p}: cannot read manifest: {_describe(exc)}") from exc
        try:
            return cls.from_json(data)
        except CheckpointError as exc:
            raise CheckpointError(f"{p}: {exc}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def nesting_depth(value: Any, limit: int) -> int:
    """How deep lists and maps nest in ``value``, counted up to just past ``limit``
    (iteratively: a hostile document cannot exhaust the stack)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, Mapping):
            items: Any = v.values()
        elif isinstance(v, (list, tuple)):
            items = v
        else:
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            break
        stack.extend((x, depth + 1) for x in items)
    return deepest
