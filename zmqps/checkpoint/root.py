"""A checkpoint root: committed checkpoint directories, temp directories, ``LATEST``.

Layout (TensorFlow style: every PS writes its own shard files, the chief commits)::

    ROOT/
      LATEST                              "ckpt-000000001200\\n"
      ckpt-000000001200/                  committed: has manifest.json
        manifest.json
        shard-000000.safetensors ...
      .tmp-ckpt-000000001300-1a2b3c4d/    being written (no manifest yet)

Rules of this module:

* Names are bare names, never paths: :func:`is_valid_name` accepts only
  ``ckpt-{step:012d}`` and ``.tmp-ckpt-{step:012d}-{8 hex}``; a PS refuses anything else.
* A checkpoint is committed by one rename: ``manifest.json`` is written LAST into
  the temp directory (temp file + fsync + rename), the directory is fsynced, then
  renamed to ``ckpt-{step:012d}`` and the root fsynced. A directory named
  ``ckpt-*`` without a manifest is never the result of a crash; one that has a
  manifest has all its files. ``LATEST`` is written after the commit (temp + fsync +
  rename); it is a hint for people and tools: :meth:`CheckpointRoot.latest` scans.
* "Newest" means the highest ``(generation, step)``: after a restore to an older
  checkpoint the cluster's later checkpoints win over the abandoned higher steps.
* Anything a killed writer leaves behind is named ``.tmp-*`` (temp directories and
  files), ``.del-ckpt-*`` (a pruned checkpoint being removed) or ``.old-ckpt-*``
  (a checkpoint being replaced by a re-commit of the same step);
  :meth:`CheckpointRoot.clean_orphans` removes them, putting back an ``.old-ckpt``
  whose replacement never landed.
* Reading never trusts the disk: manifests are validated
  (:meth:`Manifest.from_json`), file sizes and sha256 checked by
  :meth:`Checkpoint.verify`, safetensors headers parsed by safetensors (no pickle).
  :meth:`Checkpoint.read_rows` reads only the rows asked for.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError

from zmqps.checkpoint.format import (
    FORMAT_VERSION,
    SHARD_FORMAT,
    CheckpointError,
    Manifest,
    ShardRecord,
    fsync_dir,
    open_shard,
    sha256_file,
    st_dtype,
    write_file_atomic,
)
from zmqps.core.variables import VariableDef

__all__ = [
    "LATEST",
    "MANIFEST",
    "Checkpoint",
    "CheckpointError",
    "CheckpointRoot",
    "committed_name",
    "is_valid_name",
    "step_of",
]

log = logging.getLogger("zmqps.checkpoint")

Array = npt.NDArray[Any]

MANIFEST = "manifest.json"
LATEST = "LATEST"
#: Longest name accepted (the wire's CKPT_NAME limit).
MAX_NAME = 96
#: Shard files :meth:`Checkpoint.verify` hashes at once.
VERIFY_THREADS = 4

_COMMITTED = re.compile(r"ckpt-([0-9]{12,})")
_TEMP = re.compile(r"\.tmp-ckpt-([0-9]{12,})-[0-9a-f]{8}")
_OLD = re.compile(r"\.old-(ckpt-[0-9]{12,})-[0-9a-f]{8}")


def committed_name(step: int) -> str:
    """The directory name of the committed checkpoint of ``step``."""
    return f"ckpt-{step:012d}"


def is_valid_name(name: object) -> bool:
    """Is ``name`` a bare checkpoint directory name (committed or temp), never a path?"""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        return False
    if "/" in name or "\\" in name or "\x00" in name or ".." in name:
        return False
    return bool(_COMMITTED.fullmatch(name) or _TEMP.fullmatch(name))


def is_temp_name(name: str) -> bool:
    return is_valid_name(name) and bool(_TEMP.fullmatch(name))


def step_of(name: str) -> int:
    """The step a checkpoint directory name (committed or temp) carries."""
    m = _COMMITTED.fullmatch(name) or _TEMP.fullmatch(name)
    if m is None or not is_valid_name(name):
        raise CheckpointError(f"{name!r} is not a checkpoint directory name")
    return int(m.group(1))


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative integer, got {step!r}")
    return step


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


# -- one checkpoint -----------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory with a valid manifest (see :meth:`verify` for its files)."""

    path: Path
    manifest: Manifest

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def generation(self) -> int:
        return self.manifest.generation

    @property
    def nbytes(self) -> int:
        return self.manifest.nbytes

    @property
    def final(self) -> bool:
        """The run's last checkpoint: every worker had done its work (``extra["final"]``)."""
        return self.manifest.extra.get("final") is True

    @property
    def cursors(self) -> dict[str, int] | None:
        """Per worker, the batches (cursor) whose gradients this checkpoint holds
        (``extra["cursors"]``); None when it does not say (an older writer, or a value
        that is not a map of names to counts)."""
        raw = self.manifest.extra.get("cursors")
        if not isinstance(raw, dict):
            return None
        out = {}
        for name, c in raw.items():
            if not isinstance(name, str) or isinstance(c, bool) or not isinstance(c, int) or c < 0:
                return None
            out[name] = c
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Load a checkpoint directory's manifest (validated); files are not checked."""
        p = Path(path)
        if not (p / MANIFEST).is_file():
            raise CheckpointError(f"{p}: no {MANIFEST} (not a committed checkpoint)")
        return cls(p, Manifest.read(p / MANIFEST))

    def variable_defs(self) -> list[VariableDef]:
        return self.manifest.variable_defs()

    def variable(self, name: str) -> VariableDef:
        for v in self.variable_defs():
            if v.name == name:
                return v
        raise CheckpointError(f"checkpoint {self.name}: no variable {name!r}")

    def optimizer_of(self, name: str) -> dict[str, Any]:
        """The optimizer config ``name`` was trained with (its own, or the job default)."""
        v = self.variable(name)
        return dict(v.optimizer if v.optimizer is not None else self.manifest.optimizer)

    # -- verification ----------------------------------------------------------

    def verify(self) -> list[str]:
        """Problems with this checkpoint's files (empty: it is intact).

        Checks the directory name against the step, then for every shard: the file
        exists, has the recorded size and sha256, its safetensors header parses and
        agrees with the manifest (variable, rows, version, dtype, shape, slots).
        """
        problems: list[str] = []
        m = _COMMITTED.fullmatch(self.name)
        if m is not None and int(m.group(1)) != self.step:
            problems.append(f"directory name says step {int(m.group(1))}, manifest {self.step}")
        defs = {v.name: v for v in self.variable_defs()}
        shards = self.manifest.shards
        # hashlib releases the GIL on large buffers: hash a few files at once
        workers = max(1, min(VERIFY_THREADS, len(shards)))
        with ThreadPoolExecutor(workers, thread_name_prefix="zmqps-verify") as pool:
            found = pool.map(lambda rec: self._verify_shard(rec, defs[rec.var]), shards)
            for rec, problem in zip(shards, found, strict=True):
                if problem:
                    problems.append(f"{rec.file}: {problem}")
        return problems

    def _verify_shard(self, rec: ShardRecord, var: VariableDef) -> str | None:
        p = self.path / rec.file
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            return "missing"
        except OSError as exc:
            return f"cannot stat: {exc.strerror}"
        if size != rec.nbytes:
            return f"size {size} bytes, manifest says {rec.nbytes} (truncated or replaced)"
        try:
            digest = sha256_file(p)
        except OSError as exc:
            return f"cannot read: {exc.strerror}"
        if digest != rec.sha256:
            return "sha256 mismatch (corrupted)"
        try:
            with open_shard(p) as f:
                return _check_header(f, rec, var)
        except CheckpointError as exc:
            return str(exc)
        except SafetensorError as exc:
            return f"bad safetensors file: {exc}"

    # -- reading ---------------------------------------------------------------

    def read_rows(
        self, var: str, row_start: int, rows: int, *, slots: bool = True
    ) -> tuple[Array, dict[str, Array], int]:
        """Values, slots and version of rows ``[row_start, row_start + rows)`` of ``var``.

        Assembled from every shard file overlapping the range, whatever sharding wrote
        them (the resharding primitive): only the rows needed are read. The version is
        the highest of the source shards'. ``slots=False`` skips the slots.
        Raises :class:`CheckpointError` if the range is outside the variable, not
        covered exactly, or a file disagrees with the manifest.
        """
        v = self.variable(var)
        if v.hashed:
            raise CheckpointError(
                f"checkpoint {self.name}: {var!r} is a hash-keyed table (rows by id:"
                " zmqps.checkpoint.read_table)"
            )
        n = v.shape[0]
        for what, x in (("row_start", row_start), ("rows", rows)):
            if isinstance(x, bool) or not isinstance(x, int):
                raise CheckpointError(f"read_rows: {what} must be an integer, got {x!r}")
        if rows < 1 or row_start < 0 or row_start + rows > n:
            raise CheckpointError(
                f"read_rows: rows [{row_start}, {row_start + rows}) outside {var!r} of {n} rows"
            )
        end = row_start + rows
        row_shape = v.shape[1:]
        try:  # the manifest's shape is checked against the files only below
            values = np.empty((rows, *row_shape), dtype=v.dtype)
        except (ValueError, MemoryError) as exc:
            raise CheckpointError(
                f"checkpoint {self.name}: cannot hold rows [{row_start}, {end}) of {var!r}"
                f" {v.shape}: {exc}"
            ) from None
        slot_out: dict[str, Array] = {}
        slot_names: tuple[str, ...] | None = None
        version = 0
        at = row_start
        for rec in self.manifest.shards_of(var):
            lo, hi = max(rec.row_start, row_start), min(rec.row_end, end)
            if lo >= hi:
                continue
            if lo != at:
                raise CheckpointError(
                    f"checkpoint {self.name}: rows of {var!r} not covered at {at}"
                )
            if slot_names is None:
                slot_names = rec.slots
            elif rec.slots != slot_names:
                raise CheckpointError(
                    f"checkpoint {self.name}: shards of {var!r} hold different slots"
                    f" ({slot_names} vs {rec.slots})"
                )
            src = slice(lo - rec.row_start, hi - rec.row_start)
            dst = slice(lo - row_start, hi - row_start)
            p = self.path / rec.file
            try:
                with open_shard(p) as f:
                    _check_meta(f, rec)
                    values[dst] = _tensor_slice(f, "values", rec, v, src, v.dtype)
                    for name in rec.slots if slots else ():
                        part = _tensor_slice(f, f"slot.{name}", rec, v, src, None)
                        out = slot_out.get(name)
                        if out is None:
                            out = slot_out[name] = np.empty((rows, *row_shape), dtype=part.dtype)
                        elif out.dtype != part.dtype:
                            raise CheckpointError(f"{p}: slot {name} dtype differs between shards")
                        out[dst] = part
            except SafetensorError as exc:
                raise CheckpointError(f"{p}: {exc}") from exc
            except OSError as exc:
                raise CheckpointError(f"{p}: {exc.strerror or exc}") from exc
            version = max(version, rec.version)
            at = hi
        if at != end:
            raise CheckpointError(f"checkpoint {self.name}: rows of {var!r} not covered at {at}")
        return values, slot_out, version

    def read_variable(self, var: str) -> Array:
        """The whole values of ``var`` (no slots)."""
        return self.read_rows(var, 0, self.variable(var).shape[0], slots=False)[0]

    def variables(self) -> dict[str, Array]:
        """Every variable's whole values, by name (for export and evaluation); hash-keyed
        tables have no whole values and are left out (``read_table`` reads them)."""
        return {v.name: self.read_variable(v.name) for v in self.variable_defs() if not v.hashed}


def _check_meta(f: Any, rec: ShardRecord) -> None:
    meta = f.metadata() or {}
    want = {
        "format": SHARD_FORMAT,
        "format_version": str(FORMAT_VERSION),
        "var": rec.var,
        "shard": str(rec.shard_id),
        "row_start": str(rec.row_start),
        "rows": str(rec.rows),
        "version": str(rec.version),
    }
    for k, value in want.items():
        if meta.get(k) != value:
            raise CheckpointError(
                f"{rec.file}: metadata {k}={meta.get(k)!r}, manifest says {value!r}"
            )


def _tensor_slice(
    f: Any, key: str, rec: ShardRecord, var: VariableDef, rows: slice, dtype: str | None
) -> Array:
    try:
        sl = f.get_slice(key)
    except SafetensorError:
        raise CheckpointError(f"{rec.file}: no tensor {key!r}") from None
    shape = tuple(sl.get_shape())
    want = (rec.rows, *var.shape[1:])
    if shape != want:
        raise CheckpointError(f"{rec.file}: {key} has shape {shape}, expected {want}")
    got = st_dtype(sl.get_dtype(), f"{rec.file} {key}")
    if dtype is not None and got != dtype:
        raise CheckpointError(f"{rec.file}: {key} is {got}, expected {dtype}")
    out: Array = sl[rows]
    return out


def _check_header(f: Any, rec: ShardRecord, var: VariableDef) -> str | None:
    """Does the open shard file agree with its record? (``None``: yes)."""
    _check_meta(f, rec)
    if var.hashed:
        from zmqps.checkpoint.tables import check_table_header

        return check_table_header(f, rec, var)
    keys = set(f.keys())
    want = {"values", *(f"slot.{s}" for s in rec.slots)}
    if keys != want:
        return f"tensors {sorted(keys)}, manifest says {sorted(want)}"
    for key in sorted(want):
        sl = f.get_slice(key)
        shape = tuple(sl.get_shape())
        if shape != (rec.rows, *var.shape[1:]):
            return f"{key} has shape {shape}, expected {(rec.rows, *var.shape[1:])}"
        dtype = st_dtype(sl.get_dtype(), f"{rec.file} {key}")
        if key == "values" and dtype != rec.dtype:
            return f"values are {dtype}, manifest says {rec.dtype}"
    return None


# -- the root -----------------------------------------------------------------


class CheckpointRoot:
    """The directory every PS writes shard files into and the chief commits in.

    ``keep`` committed checkpoints are kept (``0``: all). After :meth:`latest`,
    ``skipped`` lists ``(name, problem)`` of the checkpoints it passed over.
    """

    def __init__(self, path: str | os.PathLike[str], keep: int = 5) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise CheckpointError(f"keep must be a non-negative integer, got {keep!r}")
        self.path = Path(path)
        self.keep = keep
        self.skipped: list[tuple[str, str]] = []

    def __repr__(self) -> str:
        return f"CheckpointRoot({str(self.path)!r}, keep={self.keep})"

    # -- names -----------------------------------------------------------------

    def resolve(self, name: str) -> Path:
        """``ROOT/name`` for a valid bare name (:func:`is_valid_name`); refuses paths."""
        if not is_valid_name(name):
            raise CheckpointError(f"{name!r} is not a checkpoint directory name")
        return self.path / name

    # -- writing ---------------------------------------------------------------

    def new_temp(self, step: int) -> Path:
        """Create and return a fresh temp directory ``.tmp-ckpt-{step:012d}-{8 hex}``."""
        _check_step(step)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            while True:
                temp = self.path / f".tmp-ckpt-{step:012d}-{secrets.token_hex(4)}"
                try:
                    temp.mkdir(mode=0o755)
                except FileExistsError:
                    continue
                return temp
        except OSError as exc:
            raise CheckpointError(f"cannot create a temp directory in {self.path}: {exc}") from exc

    def abort(self, temp: str | os.PathLike[str]) -> None:
        """Remove a temp directory (a failed or abandoned checkpoint); no error if gone."""
        temp = Path(temp)
        self._check_temp(temp)
        # A PS may still be writing into it (an abandoned checkpoint): files can appear
        # while it is removed; try again a few times, then leave what remains to
        # clean_orphans (the next start removes every temp directory).
        for _ in range(3):
            try:
                shutil.rmtree(temp)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                error = exc
        raise CheckpointError(f"cannot remove {temp}: {error}") from error

    def _check_temp(self, temp: Path) -> None:
        if not is_temp_name(temp.name) or temp.parent.resolve() != self.path.resolve():
            raise CheckpointError(f"{temp} is not a temp directory of {self.path}")

    def commit(self, temp: str | os.PathLike[str], manifest: Manifest) -> Checkpoint:
        """Commit a temp directory holding every shard file of ``manifest``.

        Checks the files are there with the recorded sizes, writes ``manifest.json``
        last, renames the directory to ``ckpt-{step:012d}`` (replacing an existing
        one of the same step), updates ``LATEST`` and prunes beyond ``keep``. Raises
        :class:`CheckpointError` (nothing committed; the temp directory is left for
        :meth:`abort`). Failing to write ``LATEST`` or to prune after the rename is
        logged, not raised: the checkpoint is committed and found by scanning.
        """
        temp = Path(temp)
        self._check_temp(temp)
        if step_of(temp.name) != manifest.step:
            raise CheckpointError(f"{temp.name} is not for step {manifest.step}")
        for rec in manifest.shards:
            try:
                size = (temp / rec.file).stat().st_size
            except FileNotFoundError:
                raise CheckpointError(
                    f"cannot commit step {manifest.step}: {rec.file} ({rec.var}) missing"
                ) from None
            if size != rec.nbytes:
                raise CheckpointError(
                    f"cannot commit step {manifest.step}: {rec.file} is {size} bytes,"
                    f" expected {rec.nbytes}"
                )
        final = self.path / committed_name(manifest.step)
        old: Path | None = None
        try:
            write_file_atomic(temp / MANIFEST, manifest.dumps().encode())
            fsync_dir(temp)
            if final.exists():
                old = self.path / f".old-{final.name}-{secrets.token_hex(4)}"
                os.rename(final, old)
            try:
                os.rename(temp, final)
            except OSError:
                if old is not None:
                    os.rename(old, final)
                    old = None
                raise
            fsync_dir(self.path)
        except OSError as exc:
            raise CheckpointError(
                f"cannot commit checkpoint step {manifest.step} in {self.path}: {exc}"
            ) from exc
        ckpt = Checkpoint(final, manifest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        try:
            write_file_atomic(self.path / LATEST, (final.name + "\n").encode())
        except OSError as exc:
            log.warning("checkpoint %s committed, but LATEST not updated: %s", final.name, exc)
        try:
            self._prune(protect={final.name})
        except OSError as exc:
            log.warning("pruning old checkpoints in %s failed: %s", self.path, exc)
        return ckpt

    def _prune(self, protect: set[str]) -> list[str]:
        if not self.keep:
            return []
        named = self.latest_name()
        if named:
            protect = {*protect, named}
        ckpts, broken = self.scan()
        kept = ckpts[-self.keep :]
        drop = [c.name for c in ckpts[: -self.keep] if c.name not in protect]
        oldest_kept = min((c.step for c in kept), default=0)
        drop += [name for name, _ in broken if step_of(name) < oldest_kept and name not in protect]
        for name in drop:
            # Out of sight first (one rename), so a crash mid-removal leaves no
            # half-deleted directory that looks committed.
            gone = self.path / f".del-{name}-{secrets.token_hex(4)}"
            os.rename(self.path / name, gone)
            shutil.rmtree(gone, ignore_errors=True)
            log.info("pruned checkpoint %s", name)
        return drop

    def clean_orphans(self, min_age: float = 0.0) -> list[str]:
        """Remove what killed writers left (``.tmp-*``, ``.del-ckpt-*``, ``.old-ckpt-*``);
        returns the names removed (``ckpt-X/.tmp-y`` for stray files inside checkpoints).

        Call it at start, before any checkpoint is in progress: a temp directory being
        written now would be removed. ``min_age`` (seconds) spares younger entries.
        An ``.old-ckpt-N`` whose replacement ``ckpt-N`` never landed is put back
        (listed as ``restored ckpt-N``).
        """
        try:
            entries = sorted(os.scandir(self.path), key=lambda e: e.name)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CheckpointError(f"cannot list {self.path}: {exc}") from exc
        now = time.time()
        out: list[str] = []

        def young(path: Path) -> bool:
            if min_age <= 0:
                return False
            try:
                return now - path.lstat().st_mtime < min_age
            except FileNotFoundError:
                return True

        for e in entries:
            p = Path(e.path)
            name = e.name
            try:
                if _COMMITTED.fullmatch(name) and e.is_dir(follow_symlinks=False):
                    for inner in sorted(p.iterdir()):
                        if inner.name.startswith(".tmp-") and not young(inner):
                            _remove(inner)
                            out.append(f"{name}/{inner.name}")
                    continue
                if not name.startswith((".tmp-", ".del-ckpt-", ".old-ckpt-")) or young(p):
                    continue
                m = _OLD.fullmatch(name)
                if m is not None and (p / MANIFEST).is_file():
                    target = self.path / m.group(1)
                    if not target.exists():
                        os.rename(p, target)
                        fsync_dir(self.path)
                        out.append(f"restored {target.name}")
                        continue
                _remove(p)
                out.append(name)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise CheckpointError(f"cannot clean {p}: {exc}") from exc
        if out:
            log.info("removed checkpoint leftovers in %s: %s", self.path, ", ".join(out))
        return out

    # -- reading ---------------------------------------------------------------

    def scan(self) -> tuple[list[Checkpoint], list[tuple[str, str]]]:
        """Committed checkpoints (oldest first) and ``(name, problem)`` of ``ckpt-*``
        directories whose manifest is missing or does not load."""
        try:
            names = sorted(
                e.name
                for e in os.scandir(self.path)
                if _COMMITTED.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
            )
        except (FileNotFoundError, NotADirectoryError):
            return [], []
        except OSError as exc:
            raise CheckpointError(f"cannot list {self.path}: {exc}") from exc
        ckpts: list[Checkpoint] = []
        broken: list[tuple[str, str]] = []
        for name in names:
            try:
                ckpts.append(Checkpoint.load(self.path / name))
            except CheckpointError as exc:
                broken.append((name, str(exc)))
        return _oldest_first(ckpts), broken

    def checkpoints(self) -> list[Checkpoint]:
        """Committed checkpoints whose manifest loads, oldest first: ascending
        ``(generation, step)`` (ascending step within a generation)."""
        return self.scan()[0]

    def get(self, name: str) -> Checkpoint:
        """The committed checkpoint ``name`` (manifest loaded, files not verified)."""
        if not _COMMITTED.fullmatch(name) or not is_valid_name(name):
            raise CheckpointError(f"{name!r} is not a committed checkpoint name")
        return Checkpoint.load(self.path / name)

    def latest_name(self) -> str | None:
        """The name ``LATEST`` holds, if it holds a valid committed name (else ``None``)."""
        try:
            with open(self.path / LATEST, "rb") as f:
                raw = f.read(MAX_NAME + 2)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            log.warning("cannot read %s: %s", self.path / LATEST, exc)
            return None
        try:
            name = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            name = ""
        if not _COMMITTED.fullmatch(name) or not is_valid_name(name):
            log.warning("%s holds garbage %r; scanning instead", self.path / LATEST, raw[:40])
            return None
        return name

    def latest(self, verify: bool = True) -> Checkpoint | None:
        """The newest committed checkpoint that loads and, with ``verify``, whose every
        file matches its size and sha256; ``None`` if there is none.

        Broken or corrupted newer ones are passed over with a warning each, and listed
        in ``self.skipped`` as ``(name, problem)``.
        """
        self.skipped = []
        ckpts, broken = self.scan()
        named = self.latest_name()
        found: Checkpoint | None = None
        for c in reversed(ckpts):
            problems = c.verify() if verify else []
            if not problems:
                found = c
                break
            problem = "; ".join(problems)
            log.warning("checkpoint %s is unusable (%s); trying an older one", c.name, problem)
            self.skipped.append((c.name, problem))
        for name, problem in broken:
            if found is None or step_of(name) > found.step:
                log.warning("checkpoint %s is unusable (%s)", name, problem)
                self.skipped.append((name, problem))
        if found is not None and named is not None and named != found.name:
            log.warning("%s names %s; using %s", self.path / LATEST, named, found.name)
        return found


def _oldest_first(ckpts: Iterable[Checkpoint]) -> list[Checkpoint]:
    return sorted(ckpts, key=lambda c: (c.generation, c.step))
