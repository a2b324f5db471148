"""Exported models: a directory with the trained variables and what rebuilds the model.

An export is a directory holding two files:

* ``model.safetensors``: every variable of the model, whole (gathered from its
  shards), in the safetensors format (raw little-endian buffers and a JSON
  header; nothing is pickled).
* ``signature.json``: the model's :meth:`~zmqps.models.Model.signature` (kind,
  config, inputs, outputs, variables) plus ``format_version``, ``created``,
  ``zmqps_version``, ``weights`` (file name and sha256) and the training
  ``metrics`` (e.g. ``test_accuracy``, ``global_step``), and, when known, the
  ``preprocessing`` of its inputs (below).

Rules of this module:

* Writing is atomic: both files are written into a temporary directory next to
  the target, flushed to disk (fsync), and the directory is renamed into place.
  A reader sees the old export or the new one, never half of one; an existing
  export is replaced (it is moved aside first, so there is an instant where the
  target name is absent, never one where it is incomplete).
* What is written is checked against the signature first (names, shapes,
  dtypes): an export that would not load is never written.
* Loading trusts nothing: the sha256 of the weights, the variables' names,
  shapes and dtypes are checked against the signature, and the model is rebuilt
  from the signature with :func:`zmqps.models.build_model`; every problem is one
  :class:`ExportError` with a one-line message.
* Hash-keyed tables (the CTR model's): the signature's optional ``tables`` list
  names each table with its ``row_shape``, ``dtype``, ``init`` (initializer and seed),
  ``table`` (row policy) and ``rows`` (how many it holds). Its live rows travel in the
  same safetensors file as ``table:NAME:ids`` (int64 ``(rows,)``, ascending) and
  ``table:NAME:values`` (``(rows, *row_shape)``), under the same sha256: the ids the
  PS held at the end, never the bucket-shaped placeholder. :func:`load_model` returns
  each table as a :class:`~zmqps.core.tableview.TableView` in ``params``, which reads
  a known id's row and gives an unknown id its initial value, as the PS would.
* Input preprocessing: the optional ``preprocessing`` says what training did to raw
  values before the model saw them, per input, as
  :mod:`zmqps.data.preprocessing` defines it: ``{"dataset": NAME, "inputs": {INPUT:
  STEP}}``, e.g. the digits' ``{"dataset": "digits", "inputs": {"x": {"op": "divide",
  "by": 16.0, "raw_range": [0.0, 16.0]}}}`` (the model takes raw / 16, values in
  [0, 1]); a CTR model's ``{"dense": {"op": "log1p"}, "ids": {"op": "field_hash"}}``
  (Criteo) or ``{"dense": {"op": "identity"}, ...}`` (synthetic). ``zmqps predict``
  applies it to raw inputs. It is checked on reading and writing (an input the model
  lacks, an unknown op, a bad ``by`` or ``raw_range``: :class:`ExportError`); an export
  without it (older ones, or a model trained on data of one's own) still loads, and
  its inputs are taken as they are. Re-exporting a loaded signature keeps it.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from zmqps.checkpoint.format import fsync_dir, nesting_depth
from zmqps.core.tableview import TableView
from zmqps.data.preprocessing import validate as validate_preprocessing
from zmqps.models import Model, build_model
from zmqps.models.ctr import CTRModel
from zmqps.version import __version__
from zmqps.wire.errors import ZmqpsError

__all__ = [
    "FORMAT_VERSION",
    "SIGNATURE_FILE",
    "WEIGHTS_FILE",
    "ExportError",
    "export_model",
    "load_model",
    "read_signature",
]

Array = npt.NDArray[Any]

#: The version of the export layout this module writes and reads.
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
SIGNATURE_FILE = "signature.json"

_REQUIRED_KEYS = ("kind", "config", "inputs", "outputs", "variables")
#: signature.json nesting deeper than this is refused (checks and messages recurse).
MAX_SIGNATURE_DEPTH = 64
#: keys of signature.json this module writes itself (around the model's signature).
_OWN_KEYS = ("format_version", "created", "zmqps_version", "weights", "metrics", "extra")


class ExportError(ZmqpsError):
    """An export cannot be written or read: missing, corrupted, or inconsistent."""

    code = "export"


def _json_safe(value: Any, what: str) -> Any:
    """``value`` with numpy scalars and arrays turned into plain JSON values."""
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v, what) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v, what) for v in value]
    if isinstance(value, np.ndarray):
        return _json_safe(value.tolist(), what)
    if isinstance(value, np.generic):
        return _json_safe(value.item(), what)
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN / inf
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise ExportError(f"{what}: {type(value).__name__} is not JSON data")


def _variables(signature: Mapping[str, Any], where: str) -> list[tuple[str, tuple[int, ...], str]]:
    """The signature's variables as (name, shape, dtype), checked for form."""
    missing = [k for k in _REQUIRED_KEYS if k not in signature]
    if missing:
        raise ExportError(f"{where}: signature lacks {', '.join(missing)}")
    out = []
    try:
        for v in signature["variables"]:
            name, shape, dtype = str(v["name"]), tuple(int(d) for d in v["shape"]), str(v["dtype"])
            np.dtype(dtype)
            out.append((name, shape, dtype))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ExportError(f"{where}: malformed variable list in the signature ({exc})") from None
    names = [n for n, _, _ in out]
    if len(set(names)) != len(names):
        raise ExportError(f"{where}: the signature names a variable twice")
    return out


def _check_params(
    params: Mapping[str, Array],
    wanted: list[tuple[str, tuple[int, ...], str]],
    where: str,
) -> None:
    """``params`` holds exactly the ``wanted`` variables with their shapes and dtypes."""
    names = {n for n, _, _ in wanted}
    extra = sorted(set(params) - names)
    if extra:
        raise ExportError(f"{where}: variables not in the signature: {', '.join(extra)}")
    for name, shape, dtype in wanted:
        if name not in params:
            raise ExportError(f"{where}: variable {name!r} is missing")
        a = params[name]
        if tuple(a.shape) != shape:
            raise ExportError(
                f"{where}: variable {name!r} has shape {tuple(a.shape)}, signature says {shape}"
            )
        if a.dtype != np.dtype(dtype):
            raise ExportError(
                f"{where}: variable {name!r} has dtype {a.dtype}, signature says {dtype}"
            )


#: keys of a table's tensors in the weights file
def _table_keys(name: str) -> tuple[str, str]:
    return f"table:{name}:ids", f"table:{name}:values"


_TABLE_KEYS = ("name", "row_shape", "dtype", "init", "table")


def _table_specs(signature: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """The signature's ``tables`` (none: ``[]``), checked for form."""
    specs = signature.get("tables", [])
    out = []
    try:
        if not isinstance(specs, list):
            raise TypeError("not a list")
        for t in specs:
            spec = {k: t[k] for k in _TABLE_KEYS}
            spec["name"] = str(spec["name"])
            spec["row_shape"] = [int(d) for d in spec["row_shape"]]
            np.dtype(str(spec["dtype"]))
            if not isinstance(spec["init"], dict) or not isinstance(spec["table"], dict):
                raise TypeError("init and table must be maps")
            if "rows" in t:
                spec["rows"] = int(t["rows"])
            out.append(spec)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ExportError(f"{where}: malformed table list in the signature ({exc})") from None
    names = [t["name"] for t in out]
    if len(set(names)) != len(names):
        raise ExportError(f"{where}: the signature names a table twice")
    return out


def _table_view(spec: Mapping[str, Any], ids: Array, values: Array, where: str) -> TableView:
    """A table's rows checked against its spec, as a :class:`TableView`."""
    name = spec["name"]
    shape = (ids.shape[0] if ids.ndim == 1 else -1, *spec["row_shape"])
    if ids.dtype != np.int64 or ids.ndim != 1:
        raise ExportError(f"{where}: table {name!r}: ids must be int64 of shape (rows,)")
    if values.shape != shape or values.dtype != np.dtype(spec["dtype"]):
        raise ExportError(
            f"{where}: table {name!r}: values {values.dtype}{tuple(values.shape)},"
            f" expected {spec['dtype']}{shape}"
        )
    if "rows" in spec and spec["rows"] != ids.shape[0]:
        raise ExportError(
            f"{where}: table {name!r} holds {ids.shape[0]} rows, the signature says {spec['rows']}"
        )
    try:
        return TableView(name, ids, values, spec["init"], spec["table"])
    except ValueError as exc:
        raise ExportError(f"{where}: {exc}") from None


def _preprocessing(signature: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    """The signature's ``preprocessing`` (None when absent), checked for form."""
    if signature.get("preprocessing") is None:
        return None
    inputs = signature["inputs"]
    try:
        return validate_preprocessing(
            signature["preprocessing"], inputs if isinstance(inputs, Mapping) else ()
        )
    except ValueError as exc:
        raise ExportError(f"{where}: {exc}") from None


def _write(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def export_model(
    directory: str | os.PathLike[str],
    signature: Mapping[str, Any],
    params: Mapping[str, Any],
    *,
    tables: Mapping[str, tuple[Array, Array]] | None = None,
    metrics: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    preprocessing: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``params`` and ``signature`` as an export in ``directory`` (atomically).

    ``signature`` is a model's :meth:`~zmqps.models.Model.signature`; ``params``
    must hold exactly its variables, whole, with their shapes and dtypes; ``tables``
    exactly its hash-keyed tables (the signature's ``tables``) as ``(ids, values)``
    of their live rows (any order, each id once), or as the
    :class:`~zmqps.core.tableview.TableView` in ``params`` that :func:`load_model`
    returned.
    ``metrics`` (e.g. the chief's summary: ``test_accuracy``, ``global_step``) and
    ``extra`` (anything else worth keeping) go into ``signature.json``, and so does
    ``preprocessing`` (what training did to raw inputs: see the module rules; None
    keeps the signature's own, if any). Returns the export's path.
    """
    target = Path(directory)
    where = f"export {target}"
    wanted = _variables(signature, where)
    if preprocessing is not None:
        signature = {**signature, "preprocessing": preprocessing}
    steps = _preprocessing(signature, where)
    given = dict(tables or {})
    params = dict(params)
    for name in [n for n, p in params.items() if isinstance(p, TableView)]:
        view = params.pop(name)
        given.setdefault(name, (view.ids, view.values))
    _check_params(params, wanted, where)
    tensors = {name: np.ascontiguousarray(params[name]) for name, _, _ in wanted}
    specs = _table_specs(signature, where)
    if sorted(given) != sorted(t["name"] for t in specs):
        raise ExportError(
            f"{where}: tables {sorted(given)} given, the signature has"
            f" {sorted(t['name'] for t in specs)}"
        )
    for spec in specs:
        ids, values = (np.asarray(a) for a in given[spec["name"]])
        order = np.argsort(ids, kind="stable")
        view = _table_view({**spec, "rows": ids.shape[0]}, ids[order], values[order], where)
        spec["rows"] = len(view)
        for key, a in zip(_table_keys(view.name), (view.ids, view.values), strict=True):
            if key in tensors:
                raise ExportError(f"{where}: a variable is named like table tensor {key!r}")
            tensors[key] = np.ascontiguousarray(a)
    weights = st_save(tensors, metadata={"format": "zmqps", "kind": str(signature["kind"])})
    model_part = _json_safe(dict(signature), "signature")
    for key in _OWN_KEYS:  # a signature read back from an export carries these: renew them
        model_part.pop(key, None)
    if specs:
        model_part["tables"] = _json_safe(specs, "tables")
    model_part.pop("preprocessing", None)
    if steps is not None:
        model_part["preprocessing"] = steps
    doc: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "zmqps_version": __version__,
        **model_part,
        "weights": {"file": WEIGHTS_FILE, "sha256": hashlib.sha256(weights).hexdigest()},
        "metrics": _json_safe(dict(metrics or {}), "metrics"),
    }
    if extra:
        doc["extra"] = _json_safe(dict(extra), "extra")

    parent = target.parent
    tag = uuid.uuid4().hex[:12]
    tmp = parent / f".{target.name}.tmp-{tag}"
    old = parent / f".{target.name}.old-{tag}"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:  # a full disk, a read-only one: said with the path
        raise ExportError(f"{where}: cannot write it ({exc.strerror or exc})") from None
    try:
        _write(tmp / WEIGHTS_FILE, weights)
        _write(tmp / SIGNATURE_FILE, (json.dumps(doc, indent=2) + "\n").encode())
        fsync_dir(tmp)
        if target.exists():
            target.rename(old)
        tmp.rename(target)
        fsync_dir(parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not target.exists():
            with contextlib.suppress(OSError):
                old.rename(target)  # put the previous export back
        if isinstance(exc, OSError):
            raise ExportError(f"{where}: cannot write it ({exc.strerror or exc})") from None
        raise
    shutil.rmtree(old, ignore_errors=True)
    return target


def read_signature(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``signature.json`` of the export in ``directory`` (its form checked, not the weights)."""
    path = Path(directory) / SIGNATURE_FILE
    where = f"export {Path(directory)}"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        if not Path(directory).is_dir():
            raise ExportError(f"{where}: no such directory") from None
        raise ExportError(f"{where}: no {SIGNATURE_FILE} (not a zmqps export?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{where}: cannot read {SIGNATURE_FILE}: {exc}") from None
    except RecursionError:
        raise ExportError(f"{where}: {SIGNATURE_FILE} nests too deeply") from None
    if nesting_depth(doc, MAX_SIGNATURE_DEPTH) > MAX_SIGNATURE_DEPTH:
        raise ExportError(f"{where}: {SIGNATURE_FILE} nests deeper than {MAX_SIGNATURE_DEPTH}")
    if not isinstance(doc, dict):
        raise ExportError(f"{where}: {SIGNATURE_FILE} is not a JSON object")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise ExportError(
            f"{where}: format_version {version!r} is not supported (expected {FORMAT_VERSION})"
        )
    _variables(doc, where)
    _preprocessing(doc, where)
    weights = doc.get("weights")
    if not isinstance(weights, dict) or not isinstance(weights.get("sha256"), str):
        raise ExportError(f"{where}: {SIGNATURE_FILE} lacks the weights' sha256")
    return doc


def _rebuild(signature: Mapping[str, Any], where: str) -> Model | CTRModel:
    config = signature["config"]
    if signature["kind"] == CTRModel.name:
        try:
            options = dict(config)
            for key in ("fields", "num_dense", "dim", "hidden", "buckets", "seed"):
                if key in options and type(options[key]) is not int:
                    raise TypeError(f"{key} must be an integer, got {options[key]!r}")
            ctr = CTRModel(**options)
            ctr.variables()  # a config whose variables are invalid fails here, not later
            return ctr
        except (TypeError, ValueError, OverflowError, ZmqpsError) as exc:
            raise ExportError(f"{where}: cannot rebuild the ctr model: {exc}") from None
    inputs = signature["inputs"]
    outputs = signature["outputs"]
    try:
        options = dict(config)
        input_dim = int(options.pop("input_dim", inputs["x"]["shape"][1]))
        num_classes = int(
            options.pop("num_classes", outputs["probabilities"]["shape"][1]),
        )
        return build_model(str(signature["kind"]), input_dim, num_classes, **options)
    except (KeyError, IndexError, TypeError, ValueError, OverflowError) as exc:
        raise ExportError(f"{where}: cannot rebuild the model from the signature: {exc}") from None


def load_model(
    directory: str | os.PathLike[str],
) -> tuple[Model | CTRModel, dict[str, Any], dict[str, Any]]:
    """Load the export in ``directory``: ``(model, params, signature)``.

    ``params`` maps each variable to its array and each hash-keyed table to a
    :class:`~zmqps.core.tableview.TableView` (a CTR export:
    ``model.predict(params, ids, dense)``). Raises :class:`ExportError` when the
    export is missing, corrupted (the sha256 of the weights differs), or
    inconsistent (variables or tables that differ from the signature, or a signature
    that does not rebuild into the same model).
    """
    where = f"export {Path(directory)}"
    signature = read_signature(directory)
    weights_name = str(signature["weights"].get("file", WEIGHTS_FILE))
    if Path(weights_name).name != weights_name or "\x00" in weights_name:
        raise ExportError(f"{where}: weights file {weights_name!r} is not a plain file name")
    try:
        data = (Path(directory) / weights_name).read_bytes()
    except OSError as exc:
        raise ExportError(f"{where}: cannot read {weights_name}: {exc.strerror}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != signature["weights"]["sha256"]:
        raise ExportError(
            f"{where}: {weights_name} is corrupted (sha256 {digest[:16]}..., the signature"
            f" says {signature['weights']['sha256'][:16]}...)"
        )
    try:
        params: dict[str, Array] = st_load(data)
    except KeyError as exc:  # a dtype numpy cannot hold (BF16, F8_*...)
        raise ExportError(f"{where}: {weights_name} holds a tensor of dtype {exc}") from None
    except (SafetensorError, ValueError) as exc:
        raise ExportError(
            f"{where}: {weights_name} is not a valid safetensors file: {exc}"
        ) from None
    wanted = _variables(signature, where)
    specs = _table_specs(signature, where)
    views: dict[str, TableView] = {}
    for spec in specs:
        keys = _table_keys(spec["name"])
        if not all(k in params for k in keys):
            raise ExportError(f"{where}: the rows of table {spec['name']!r} are missing")
        ids, values = (params.pop(k) for k in keys)
        views[spec["name"]] = _table_view(spec, ids, values, where)
    _check_params(params, wanted, where)
    out: dict[str, Any] = {name: params[name] for name, _, _ in wanted}  # the signature's order
    model = _rebuild(signature, where)
    built = [(v.name, v.shape, v.dtype) for v in model.variables() if not v.hashed]
    if built != wanted:
        raise ExportError(
            f"{where}: the signature's variables do not match a {signature['kind']} model"
            f" built from its config"
        )
    built_tables = [
        {
            "name": v.name,
            "row_shape": list(v.shape[1:]),
            "dtype": v.dtype,
            "init": dict(v.init),
            "table": dict(v.table),
        }
        for v in model.variables()
        if v.table is not None
    ]
    if built_tables != [{k: t[k] for k in _TABLE_KEYS} for t in specs]:
        raise ExportError(
            f"{where}: the signature's tables do not match a {signature['kind']} model"
            f" built from its config"
        )
    out.update(views)
    return model, out, signature
