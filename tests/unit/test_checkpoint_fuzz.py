"""Fuzzing the checkpoint and export loaders with corrupted and hostile files.

Every example copies a pristine root (two committed checkpoints) or export,
damages it (byte flips, truncations, extensions, header-length lies in the
safetensors files, hostile manifest / signature JSON, shard files swapped between
checkpoints), optionally rewrites the manifest's sizes and digests so the damage
gets past the sha256 check to the parsers behind it, and then runs every reader.

The contract: each reader either raises a :class:`ZmqpsError` subclass
(``CheckpointError`` / ``ExportError``) or succeeds, and a success is never
partial: ``read_rows`` returns complete arrays of the asked shape and the
manifest's dtype, and whatever ``verify`` passes (and ``CheckpointRoot.latest``
returns) reads back exactly the committed data.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from zmqps.checkpoint import (
    LATEST,
    MANIFEST,
    Checkpoint,
    CheckpointError,
    CheckpointRoot,
    Manifest,
    read_shard_file,
    sha256_file,
    write_shard,
)
from zmqps.core.optimizers import make_optimizer
from zmqps.core.partition import Partitioner, plan
from zmqps.core.variables import Placement, VariableDef
from zmqps.export import SIGNATURE_FILE, WEIGHTS_FILE, ExportError, export_model, load_model
from zmqps.models import build_model
from zmqps.wire.errors import ZmqpsError

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same examples every run: a failure reproduces
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
)
STEPS = (10, 20)

# -- the pristine root ----------------------------------------------------------


def _variables() -> list[VariableDef]:
    return [
        VariableDef("w", (12, 3), "float32", optimizer={"name": "adam", "lr": 0.01}),
        VariableDef("emb", (9, 2), "float16", optimizer={"name": "adagrad", "lr": 0.1}),
        VariableDef("b", (5,), "float64"),
    ]


Committed = dict[str, tuple[np.ndarray, dict[str, np.ndarray], int]]


def _write_root(path: Path) -> tuple[Placement, dict[int, Committed]]:
    variables = _variables()
    pl = plan(variables, 2, Partitioner(num_shards=2))
    root = CheckpointRoot(path, keep=0)
    committed: dict[int, Committed] = {}
    for step in STEPS:
        rng = np.random.default_rng(step)
        full = {v.name: rng.standard_normal(v.shape).astype(v.dtype) for v in variables}
        slots: dict[str, dict[str, np.ndarray]] = {}
        for v in variables:
            opt = make_optimizer(v.optimizer or pl.optimizer)
            slots[v.name] = opt.init_slots(v.shape, v.dtype)
            for a in slots[v.name].values():
                a[...] = rng.standard_normal(a.shape)
        temp = root.new_temp(step)
        records = []
        versions: dict[str, int] = {}
        for _, sd in pl.shard_defs():
            rows = slice(sd.row_start, sd.row_start + sd.rows)
            version = step * 100 + sd.id
            versions[sd.var] = max(versions.get(sd.var, 0), version)
            records.append(
                write_shard(
                    temp,
                    sd,
                    full[sd.var][rows],
                    {k: a[rows] for k, a in slots[sd.var].items()},
                    version,
                )
            )
        manifest = Manifest(
            step=step,
            mode="sync",
            variables=[v.to_wire() for v in pl.variables],
            optimizer=pl.optimizer,
            num_ps=2,
            shards=records,
            extra={"worker_steps": {"0": step}},
        )
        root.commit(temp, manifest)
        committed[step] = {
            v.name: (full[v.name], slots[v.name], versions[v.name]) for v in variables
        }
    return pl, committed


class Quiet(tuple):  # type: ignore[type-arg]
    """A fixture value that hypothesis reports briefly (not every array)."""

    def __repr__(self) -> str:
        return f"<{self[0]}>"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Committed]]:
    path = tmp_path_factory.mktemp("pristine") / "root"
    _, committed = _write_root(path)
    return Quiet((path, committed))


_counter = [0]


def fresh_copy(src: Path, base: Path) -> Path:
    _counter[0] += 1
    dst = base / f"ex{_counter[0]}"
    shutil.copytree(src, dst, symlinks=True)
    return dst


# -- mutations ----------------------------------------------------------------

HOSTILE_VALUES: list[Any] = [
    None,
    True,
    -1,
    0,
    2**63,
    10**400,  # written as a 401-digit integer
    "1e400",  # replaced by the bare token 1e400 (a float overflowing to inf)
    "NaN",  # replaced by the bare token NaN
    "-Infinity",
    1.5,
    "",
    "x" * 5000,
    "../../etc/passwd",
    "/etc/passwd",
    "shard-000000.safetensors/../../x",
    "shard-000000.safetensors\u0000",
    [],
    {},
    [[[[[]]]]],
    {"a": {"b": {"c": None}}},
    "DEEP",  # replaced by nesting 5000 deep (past the JSON parser's recursion limit)
    "DEEP900",  # nesting 900 deep (parses, but deep for anything that recurses after)
    "DEEP990",  # just below the parser's limit: json.dumps / repr of it overflow
]
BARE = {"1e400": "1e400", "NaN": "NaN", "-Infinity": "-Infinity"}


def _render(value: Any) -> str:
    if isinstance(value, str) and value in BARE:
        return BARE[value]
    if value == "DEEP":
        return "[" * 5000 + "]" * 5000
    if isinstance(value, str) and value.startswith("DEEP"):
        n = int(value[4:])
        return "[" * n + "]" * n
    return json.dumps(value)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys / indices) into a JSON document."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


_SENTINEL = "__ZMQPS_FUZZ_SENTINEL__"


def mutate_json(text: str | bytes, draw: Callable[[Any], Any]) -> str:
    """One structural mutation of a JSON document: a value replaced by a hostile one,
    a key dropped, a key added, or a list emptied / doubled."""
    doc = json.loads(text)
    paths = _paths(doc)
    path = draw(st.sampled_from(paths))
    kind = draw(st.sampled_from(["replace", "replace", "replace", "drop", "add", "double"]))
    if not path:
        kind = "replace"
    parent: Any = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1] if path else None
    value = draw(st.sampled_from(HOSTILE_VALUES))
    if kind == "replace":
        if key is None:
            return _render(value)
        parent[key] = _SENTINEL
    elif kind == "drop":
        del parent[key]
    elif kind == "add":
        target = parent[key]
        if isinstance(target, dict):
            target[draw(st.sampled_from(["evil", "file", "rows", "", "shape"]))] = _SENTINEL
        elif isinstance(target, list):
            target.append(_SENTINEL)
        else:
            parent[key] = _SENTINEL
    else:
        target = parent[key]
        if isinstance(target, list):
            target.extend(list(target))
        else:
            parent[key] = [target, target]
    return json.dumps(doc, indent=1).replace(json.dumps(_SENTINEL), _render(value))


def every_mutation(text: str) -> list[tuple[str, str]]:
    """Every value of a JSON document replaced by every hostile value, and every key
    dropped: ``(label, text)``."""
    doc = json.loads(text)
    out = []
    for path in _paths(doc):
        label = "/".join(map(str, path))
        for value in HOSTILE_VALUES:
            copy = json.loads(text)
            parent: Any = copy
            for k in path[:-1]:
                parent = parent[k]
            if path:
                parent[path[-1]] = _SENTINEL
                rendered = json.dumps(copy).replace(json.dumps(_SENTINEL), _render(value))
            else:
                rendered = _render(value)
            out.append((f"{label} = {str(value)[:20]}", rendered))
        if path:
            copy = json.loads(text)
            parent = copy
            for k in path[:-1]:
                parent = parent[k]
            del parent[path[-1]]
            out.append((f"drop {label}", json.dumps(copy)))
    return out


def safetensors_lie(data: bytes, draw: Callable[[Any], Any]) -> bytes:
    """A safetensors file whose header lies: a wrong header length, or a header whose
    dtype / shape / offsets / metadata are rewritten (length kept consistent)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    kind = draw(st.sampled_from(["length", "dtype", "shape", "offsets", "metadata", "drop", "add"]))
    if kind == "length":
        lie = draw(
            st.sampled_from([0, 1, n - 1, n + 1, len(data), len(data) - 8, 2**31, 2**63, 2**64 - 1])
        )
        return struct.pack("<Q", max(0, lie)) + data[8:]
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    if kind == "dtype":
        header[name]["dtype"] = draw(
            st.sampled_from(
                ["F64", "F32", "F16", "BF16", "I8", "U8", "BOOL", "C64", "F8_E4M3", "X"]
            )
        )
    elif kind == "shape":
        header[name]["shape"] = draw(
            st.sampled_from([[], [0], [1], [2**40, 2**40], [-1, 3], [3, 2**62]])
        )
    elif kind == "offsets":
        a, b = header[name]["data_offsets"]
        header[name]["data_offsets"] = draw(
            st.sampled_from([[b, a], [a, a], [0, len(body)], [a, 2**63], [a + 1, b + 1]])
        )
    elif kind == "metadata":
        meta = header.setdefault("__metadata__", {})
        key = draw(st.sampled_from(["var", "shard", "rows", "row_start", "version", "format"]))
        meta[key] = draw(st.sampled_from(["", "w", "0", "99", "-1", "1e400", "x" * 300]))
    elif kind == "drop":
        del header[name]
    else:
        header["slot.evil"] = dict(header[name])
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _flip(data: bytes, draw: Callable[[Any], Any]) -> bytes:
    if not data:
        return b"\x00"
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(buf) - 1))
        buf[i] ^= draw(st.integers(1, 255))
    return bytes(buf)


def damage_file(path: Path, draw: Callable[[Any], Any]) -> str:
    """Damage one file in place; returns a label."""
    data = path.read_bytes()
    kinds = ["flip", "truncate", "extend", "empty", "delete", "directory"]
    if path.suffix == ".safetensors":
        kinds += ["lie", "lie", "lie"]
    if path.suffix == ".json":
        kinds += ["json", "json", "json", "json"]
    kind = draw(st.sampled_from(kinds))
    if kind == "flip":
        path.write_bytes(_flip(data, draw))
    elif kind == "truncate":
        path.write_bytes(data[: draw(st.integers(0, max(0, len(data) - 1)))])
    elif kind == "extend":
        path.write_bytes(data + draw(st.binary(min_size=1, max_size=64)))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "delete":
        path.unlink()
    elif kind == "directory":
        path.unlink()
        path.mkdir()
    else:
        try:  # the file may already be damaged past parsing: then flip bytes instead
            out = safetensors_lie(data, draw) if kind == "lie" else mutate_json(data, draw).encode()
        except (ValueError, KeyError, TypeError, struct.error, RecursionError):
            out = _flip(data, draw)
        path.write_bytes(out)
    return f"{kind} {path.parent.name}/{path.name}"


def rehash(ckpt_dir: Path) -> None:
    """Rewrite the manifest's sizes and digests to match the files now there (if it
    still parses), so the damage reaches the readers behind the sha256 check."""
    try:
        doc = json.loads((ckpt_dir / MANIFEST).read_text())
        for rec in doc["shards"]:
            p = ckpt_dir / rec["file"]
            rec["sha256"] = sha256_file(p)
            rec["nbytes"] = p.stat().st_size
    except Exception:
        return
    (ckpt_dir / MANIFEST).write_text(json.dumps(doc))


# -- the readers and the oracle ------------------------------------------------

ALLOWED: tuple[type[BaseException], ...] = (CheckpointError,)


def expect_clean(fn: Callable[[], Any], what: str, allowed: tuple[type, ...] = ALLOWED) -> Any:
    """``fn()``; an error must be one of ``allowed`` (and a ZmqpsError) with a message."""
    try:
        return fn()
    except allowed as exc:
        assert isinstance(exc, ZmqpsError)
        assert str(exc), f"{what}: {type(exc).__name__} without a message"
        return exc
    except Exception as exc:
        raise AssertionError(f"{what}: raised {type(exc).__name__}: {exc!r}"[:2000]) from exc


def check_equal(got: tuple[Any, ...], want: tuple[Any, ...], what: str) -> None:
    values, slots, version = got
    wv, ws, wver = want
    assert values.dtype == wv.dtype and np.array_equal(values, wv), f"{what}: values differ"
    assert set(slots) == set(ws), f"{what}: slots {sorted(slots)} vs {sorted(ws)}"
    for k in ws:
        assert slots[k].dtype == ws[k].dtype and np.array_equal(slots[k], ws[k]), what
    assert version == wver, f"{what}: version {version} vs {wver}"


def exercise_checkpoint(path: Path, committed: Committed | None, known: bool = True) -> bool:
    """Run every reader on one checkpoint directory; returns whether it verified clean
    (and then its data equals ``committed``, when ``known``: see :func:`rewritten`)."""
    ckpt = expect_clean(lambda: Checkpoint.load(path), f"load {path.name}")
    if isinstance(ckpt, CheckpointError):
        return False
    problems = expect_clean(ckpt.verify, f"verify {path.name}")
    intact = isinstance(problems, list) and not problems
    names = expect_clean(lambda: [v.name for v in ckpt.variable_defs()], "variable_defs")
    if isinstance(names, CheckpointError):
        assert not intact
        return False
    if intact:
        assert committed is not None and sorted(names) == sorted(committed)
    for name in names:
        var = expect_clean(lambda n=name: ckpt.variable(n), "variable")
        if isinstance(var, CheckpointError):
            assert not intact
            continue
        n = var.shape[0]
        ranges = {(0, n), (n // 3, max(1, n - n // 3 - n // 4))}
        for start, rows in ranges:
            got = expect_clean(
                lambda nm=name, s=start, r=rows: ckpt.read_rows(nm, s, r), f"read_rows {name}"
            )
            if isinstance(got, CheckpointError):
                assert not intact, f"an intact checkpoint failed read_rows: {got}"
                continue
            values, slots, _ = got
            # complete arrays, never a partial load
            assert values.shape == (rows, *var.shape[1:]) and values.dtype == np.dtype(var.dtype)
            for a in slots.values():
                assert a.shape == values.shape
            if intact and known:
                assert committed is not None
                full_v, full_s, version = committed[name]
                rs = slice(start, start + rows)
                check_equal(
                    got,
                    (full_v[rs], {k: a[rs] for k, a in full_s.items()}, version),
                    f"{path.name} {name}[{start}:{start + rows}]",
                )
    if isinstance(problems, list):
        for rec in ckpt.manifest.shards:
            expect_clean(lambda r=rec: read_shard_file(path / r.file), f"read_shard_file {rec}")
    return intact


def exercise_root(
    path: Path,
    committed: dict[int, Committed],
    touched: set[int],
    unknown: Collection[int] = (),
) -> None:
    """Every reader on every checkpoint of the root, and ``latest``; ``unknown``: steps
    whose data no reader can know (see :func:`rewritten`)."""
    intact = {}
    for step in STEPS:
        d = path / f"ckpt-{step:012d}"
        intact[step] = exercise_checkpoint(
            d, committed[step] if d.is_dir() else None, step not in unknown
        )
    root = CheckpointRoot(path)
    found = expect_clean(root.latest, "latest")
    assert not isinstance(found, CheckpointError)
    # the newest (generation, step) of the checkpoints that verify, else None
    newest = max(
        ((Checkpoint.load(path / f"ckpt-{s:012d}").generation, s) for s in STEPS if intact[s]),
        default=None,
    )
    if found is None:
        assert newest is None
        assert set(STEPS) <= touched  # an untouched checkpoint is always found
        return
    assert found.verify() == []
    step = int(found.name.split("-")[1])
    assert (found.generation, step) == newest
    if step in unknown:
        return
    for name, (values, slots, version) in committed[step].items():
        check_equal(found.read_rows(name, 0, values.shape[0]), (values, slots, version), name)


def _content(path: Path) -> tuple[dict[str, str], dict[str, Any]] | None:
    """A shard file's metadata and tensors as safetensors reads them, None if it
    does not."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            return dict(f.metadata() or {}), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception:
        return None


def rewritten(damaged: Path, pristine: Path) -> bool:
    """Whether a shard file of the checkpoint directory ``damaged`` now holds other
    metadata or tensors than in ``pristine`` and still parses. With its digests
    rewritten to match, such a checkpoint verifies, and no reader can tell what it
    holds from what was committed (whoever can rewrite the digests can rewrite the
    data): its readers must still return complete, well-formed arrays or refuse."""
    for p in sorted(pristine.glob("shard-*.safetensors")):
        d = damaged / p.name
        if not d.is_file() or d.read_bytes() == p.read_bytes():
            continue
        now, was = _content(d), _content(p)
        if now is None:
            continue  # unreadable: every reader refuses it
        assert was is not None
        if now[0] != was[0] or set(now[1]) != set(was[1]):
            return True
        for k, a in was[1].items():
            b = now[1][k]
            if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
                return True
    return False


def checkpoint_files(root: Path, step: int) -> list[str]:
    d = root / f"ckpt-{step:012d}"
    return sorted(p.name for p in d.iterdir())


# -- the checkpoint fuzz tests -----------------------------------------------------


@FUZZ
@given(data=st.data(), repair_digests=st.booleans())
def test_damaged_files_end_in_checkpoint_error_or_the_committed_data(
    pristine: tuple[Path, dict[int, Committed]],
    tmp_path_factory: pytest.TempPathFactory,
    data: st.DataObject,
    repair_digests: bool,
) -> None:
    src, committed = pristine
    path = fresh_copy(src, tmp_path_factory.getbasetemp())
    try:
        touched: set[int] = set()
        unknown: set[int] = set()
        for _ in range(data.draw(st.integers(1, 3), "damages")):
            step = data.draw(st.sampled_from(STEPS), "checkpoint")
            d = path / f"ckpt-{step:012d}"
            files = sorted(p.name for p in d.iterdir())
            if not files:
                continue
            name = data.draw(st.sampled_from(files), "file")
            if (d / name).is_dir():
                continue
            data.draw(st.just(damage_file(d / name, data.draw)), "damage")
            touched.add(step)
            if repair_digests and name != MANIFEST:
                rehash(d)
                if rewritten(d, src / d.name):
                    unknown.add(step)
        exercise_root(path, committed, touched, unknown)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@FUZZ
@given(data=st.data())
def test_hostile_manifests(
    pristine: tuple[Path, dict[int, Committed]],
    tmp_path_factory: pytest.TempPathFactory,
    data: st.DataObject,
) -> None:
    src, committed = pristine
    path = fresh_copy(src, tmp_path_factory.getbasetemp())
    try:
        step = data.draw(st.sampled_from(STEPS), "checkpoint")
        manifest = path / f"ckpt-{step:012d}" / MANIFEST
        text = manifest.read_text()
        for _ in range(data.draw(st.integers(1, 3), "mutations")):
            try:
                text = mutate_json(text, data.draw)
            except (ValueError, RecursionError):
                break  # no longer JSON: that is the damage
        manifest.write_text(text)
        for other in STEPS:
            if other != step:
                exercise_checkpoint(path / f"ckpt-{other:012d}", committed[other])
        exercise_root(path, committed, {step})
        # the text straight into the parser, too
        expect_clean(lambda: Manifest.from_json(text), "Manifest.from_json")
    finally:
        shutil.rmtree(path, ignore_errors=True)


@FUZZ
@given(data=st.data(), repair_digests=st.booleans())
def test_shard_files_swapped_between_checkpoints(
    pristine: tuple[Path, dict[int, Committed]],
    tmp_path_factory: pytest.TempPathFactory,
    data: st.DataObject,
    repair_digests: bool,
) -> None:
    src, committed = pristine
    path = fresh_copy(src, tmp_path_factory.getbasetemp())
    try:
        old, new = (path / f"ckpt-{s:012d}" for s in STEPS)
        shards = [n for n in checkpoint_files(path, STEPS[0]) if n.endswith(".safetensors")]
        picked = data.draw(st.lists(st.sampled_from(shards), min_size=1, unique=True), "files")
        how = data.draw(st.sampled_from(["swap", "old into new", "new into old", "rename"]))
        for name in picked:
            a, b = old / name, new / name
            if how == "swap":
                tmp = a.with_name("x")
                os.replace(a, tmp)
                os.replace(b, a)
                os.replace(tmp, b)
            elif how == "old into new":
                shutil.copyfile(a, b)
            elif how == "new into old":
                shutil.copyfile(b, a)
            else:  # two shard files of one checkpoint trade names
                other = data.draw(st.sampled_from(shards), "other")
                if other != name:
                    tmp = b.with_name("x")
                    os.replace(b, tmp)
                    os.replace(new / other, b)
                    os.replace(tmp, new / other)
        if repair_digests:
            rehash(old)
            rehash(new)
        exercise_root(path, committed, set(STEPS))
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_every_manifest_field_with_every_hostile_value(
    pristine: tuple[Path, dict[int, Committed]],
) -> None:
    """Exhaustive: each field of a real manifest replaced by each hostile value (or
    dropped). Parsing ends in CheckpointError or a manifest; the ones that load are
    checked against the real files (read only) like any checkpoint."""
    src, committed = pristine
    step = max(STEPS)
    d = src / f"ckpt-{step:012d}"
    cases = every_mutation((d / MANIFEST).read_text())
    loaded = 0
    for label, text in cases:
        m = expect_clean(lambda t=text: Manifest.from_json(t), f"from_json({label})")
        if isinstance(m, CheckpointError):
            continue
        loaded += 1
        ckpt = Checkpoint(d, m)
        problems = expect_clean(ckpt.verify, f"verify({label})")
        intact = problems == []
        for v in ckpt.variable_defs():
            got = expect_clean(
                lambda n=v.name, c=ckpt: c.read_rows(n, 0, c.variable(n).shape[0]),
                f"read_rows({label})",
            )
            if intact:
                check_equal(got, committed[step][v.name], label)
            elif not isinstance(got, CheckpointError):
                assert got[0].shape == v.shape
    assert len(cases) > 2000 and loaded > 0
    print(f"\n{len(cases)} manifest mutations, {loaded} still loaded")


def test_every_signature_field_with_every_hostile_value(
    exported: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    src, params = exported
    path = fresh_copy(src, tmp_path)
    cases = every_mutation((src / SIGNATURE_FILE).read_text())
    loaded = 0
    for label, text in cases:
        (path / SIGNATURE_FILE).write_text(text)
        out = expect_clean(lambda: load_model(path), f"load_model({label})", (ExportError,))
        if isinstance(out, ExportError):
            continue
        loaded += 1
        for k, a in params.items():
            assert np.array_equal(out[1][k], a), label
    assert len(cases) > 500 and loaded > 0
    print(f"\n{len(cases)} signature mutations, {loaded} still loaded")


@pytest.mark.parametrize(
    "content",
    [b"", b"\xff\xfe", b"ckpt-000000000020/../../x\n", b"ckpt-" + b"9" * 200, b"../LATEST"],
)
def test_garbage_latest_still_finds_the_newest(
    pristine: tuple[Path, dict[int, Committed]], tmp_path: Path, content: bytes
) -> None:
    src = pristine[0]
    path = fresh_copy(src, tmp_path)
    (path / LATEST).write_bytes(content)
    found = CheckpointRoot(path).latest()
    assert found is not None and found.step == max(STEPS)


# -- the export loader -----------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    model = build_model("mlp", 6, 3, hidden=(4,), seed=2)
    rng = np.random.default_rng(0)
    params = {v.name: rng.normal(size=v.shape).astype(v.dtype) for v in model.variables()}
    path = tmp_path_factory.mktemp("export") / "model"
    export_model(path, model.signature(), params, metrics={"test_accuracy": 0.5})
    return Quiet((path, params))


def _repair_weights_digest(path: Path) -> None:
    try:
        doc = json.loads((path / SIGNATURE_FILE).read_text())
        doc["weights"]["sha256"] = hashlib.sha256((path / WEIGHTS_FILE).read_bytes()).hexdigest()
    except Exception:
        return
    (path / SIGNATURE_FILE).write_text(json.dumps(doc))


@FUZZ
@given(data=st.data(), repair_digest=st.booleans())
def test_damaged_exports_end_in_export_error_or_the_exported_params(
    exported: tuple[Path, dict[str, np.ndarray]],
    tmp_path_factory: pytest.TempPathFactory,
    data: st.DataObject,
    repair_digest: bool,
) -> None:
    src, params = exported
    path = fresh_copy(src, tmp_path_factory.getbasetemp())
    try:
        for _ in range(data.draw(st.integers(1, 2), "damages")):
            name = data.draw(st.sampled_from([WEIGHTS_FILE, SIGNATURE_FILE]), "file")
            if not (path / name).is_file():
                continue
            damage_file(path / name, data.draw)
        if repair_digest:
            _repair_weights_digest(path)
        weights_intact = (path / WEIGHTS_FILE).is_file() and (
            (path / WEIGHTS_FILE).read_bytes() == (src / WEIGHTS_FILE).read_bytes()
        )
        out = expect_clean(lambda: load_model(path), "load_model", (ExportError,))
        if isinstance(out, ExportError):
            return
        model, loaded, _ = out
        # a success is whole: every variable of the rebuilt model, with its shape and dtype
        assert [v.name for v in model.variables()] == list(loaded)
        for v in model.variables():
            assert loaded[v.name].shape == v.shape and loaded[v.name].dtype == np.dtype(v.dtype)
        if weights_intact:
            assert set(loaded) == set(params)
            for k, a in params.items():
                assert np.array_equal(loaded[k], a)
    finally:
        shutil.rmtree(path, ignore_errors=True)
