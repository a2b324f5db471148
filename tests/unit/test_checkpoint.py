"""Checkpoint format and root: round trips, manifests, resharding, commit protocol,
pruning, orphans, corruption and fallback."""

from __future__ import annotations

import json
import os
import tracemalloc
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from zmqps.checkpoint import (
    LATEST,
    MANIFEST,
    Checkpoint,
    CheckpointError,
    CheckpointRoot,
    Manifest,
    ShardRecord,
    committed_name,
    is_valid_name,
    read_shard_file,
    sha256_file,
    shard_file_name,
    step_of,
    write_shard,
)
from zmqps.core.optimizers import make_optimizer
from zmqps.core.partition import Partitioner, plan
from zmqps.core.variables import Placement, ShardDef, ShardInfo, VariableDef
from zmqps.wire.errors import ZmqpsError

pytestmark = pytest.mark.timeout(60)

OPTIMIZERS = {
    "sgd": {"name": "sgd", "lr": 0.1},
    "momentum": {"name": "momentum", "lr": 0.1, "momentum": 0.9},
    "adagrad": {"name": "adagrad", "lr": 0.1},
    "adam": {"name": "adam", "lr": 0.01},
}
SLOT_NAMES = {"sgd": (), "momentum": ("momentum",), "adagrad": ("accumulator",), "adam": ("m", "v")}


# -- helpers ------------------------------------------------------------------


def random_slots(sd: ShardDef, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The optimizer's slots for ``sd`` (names and dtypes as the store makes them),
    filled with random values."""
    slots = make_optimizer(sd.optimizer).init_slots(sd.shape, sd.dtype)
    for a in slots.values():
        a[...] = rng.standard_normal(a.shape)
    return slots


class Model:
    """Full values and slots of some variables, written as one checkpoint by a plan."""

    def __init__(self, variables: list[VariableDef], seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.variables = variables
        self.values = {v.name: rng.standard_normal(v.shape).astype(v.dtype) for v in variables}
        self.slots: dict[str, dict[str, np.ndarray]] = {}
        for v in variables:
            opt = make_optimizer(v.optimizer or OPTIMIZERS["sgd"])
            self.slots[v.name] = opt.init_slots(v.shape, v.dtype)
            for a in self.slots[v.name].values():
                a[...] = rng.standard_normal(a.shape)

    def write(
        self,
        root: CheckpointRoot,
        pl: Placement,
        step: int,
        *,
        generation: int = 0,
        scale: float = 1.0,
        num_ps: int = 2,
        version_of: Callable[[ShardDef], int] | None = None,
    ) -> Checkpoint:
        temp = root.new_temp(step)
        records = []
        for _, sd in pl.shard_defs():
            rows = slice(sd.row_start, sd.row_start + sd.rows)
            values = (self.values[sd.var][rows] * scale).astype(sd.dtype)
            slots = {k: a[rows] for k, a in self.slots[sd.var].items()}
            version = version_of(sd) if version_of else step * 100 + sd.id
            records.append(write_shard(temp, sd, values, slots, version=version))
        manifest = Manifest(
            step=step,
            generation=generation,
            mode="sync",
            variables=[v.to_wire() for v in pl.variables],
            optimizer=pl.optimizer,
            num_ps=num_ps,
            shards=records,
            extra={"worker_steps": {"0": step}},
        )
        return root.commit(temp, manifest)


def small_model() -> tuple[Model, Placement]:
    variables = [
        VariableDef("w", (10, 4), "float32", optimizer=OPTIMIZERS["adam"]),
        VariableDef("emb", (7, 3), "float16", optimizer=OPTIMIZERS["adagrad"], sparse=True),
    ]
    return Model(variables), plan(variables, 2, Partitioner(num_shards=3))


def entries(path: Path) -> list[str]:
    return sorted(os.listdir(path))


# -- names --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("ckpt-000000000000", 0),
        ("ckpt-000000001234", 1234),
        ("ckpt-1234567890123", 1234567890123),
        (".tmp-ckpt-000000000007-0a1b2c3d", 7),
    ],
)
def test_valid_names(name: str, step: int) -> None:
    assert is_valid_name(name)
    assert step_of(name) == step


@pytest.mark.parametrize(
    "name",
    [
        "",
        "ckpt-1",
        "ckpt-00000000001",
        "../ckpt-000000000001",
        "ckpt-000000000001/..",
        "a/ckpt-000000000001",
        "/ckpt-000000000001",
        "ckpt-000000000001/",
        "ckpt-000000000001\x00",
        ".tmp-ckpt-000000000001-0A1B2C3D",
        ".tmp-ckpt-000000000001-0a1b2c3",
        ".tmp-ckpt-000000000001",
        "..",
        "LATEST",
        "ckpt-" + "\u0660" * 11 + "\u0661",  # Arabic-Indic digits
        "ckpt-" + "0" * 200,
        None,
        12,
    ],
)
def test_invalid_names(name: Any) -> None:
    assert not is_valid_name(name)


def test_committed_name() -> None:
    assert committed_name(42) == "ckpt-000000000042"
    assert shard_file_name(7) == "shard-000007.safetensors"


def test_resolve_refuses_paths(tmp_path: Path) -> None:
    root = CheckpointRoot(tmp_path)
    assert root.resolve("ckpt-000000000001") == tmp_path / "ckpt-000000000001"
    for bad in ("../x", "ckpt-000000000001/../../etc", "/etc/passwd"):
        with pytest.raises(CheckpointError):
            root.resolve(bad)


def test_error_is_a_zmqps_error() -> None:
    assert issubclass(CheckpointError, ZmqpsError)
    assert CheckpointError.code == "checkpoint"


# -- shard files --------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_shard_round_trip(tmp_path: Path, opt: str, dtype: str) -> None:
    rng = np.random.default_rng(1)
    sd = ShardDef(3, "w", 1, dtype, (20, 3, 2), 5, 9, {"name": "zeros"}, OPTIMIZERS[opt])
    values = rng.standard_normal(sd.shape).astype(dtype)
    slots = random_slots(sd, rng)
    assert tuple(sorted(slots)) == tuple(sorted(SLOT_NAMES[opt]))
    rec = write_shard(tmp_path, sd, values, slots, version=17)

    assert rec.file == "shard-000003.safetensors"
    assert (rec.shard_id, rec.var, rec.row_start, rec.rows) == (3, "w", 5, 9)
    assert (rec.dtype, rec.version, rec.slots) == (dtype, 17, tuple(sorted(SLOT_NAMES[opt])))
    path = tmp_path / rec.file
    assert rec.nbytes == path.stat().st_size
    assert rec.sha256 == sha256_file(path)
    assert entries(tmp_path) == [rec.file]  # no temp file left
    assert path.stat().st_mode & 0o777 == 0o644

    got = read_shard_file(path)
    assert got.values.dtype == np.dtype(dtype)
    assert got.values.tobytes() == values.tobytes()
    assert sorted(got.slots) == sorted(slots)
    for k, a in slots.items():
        assert got.slots[k].dtype == a.dtype
        assert got.slots[k].tobytes() == a.tobytes()
    assert got.metadata["var"] == "w"
    assert got.metadata["shard"] == "3"
    assert got.metadata["row_start"] == "5"
    assert got.metadata["rows"] == "9"
    assert got.metadata["version"] == "17"


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_checkpoint_round_trip(tmp_path: Path, opt: str, dtype: str) -> None:
    var = VariableDef("v", (11, 3), dtype, optimizer=OPTIMIZERS[opt])
    model = Model([var], seed=2)
    pl = plan([var], 2, Partitioner(num_shards=3))
    ckpt = model.write(CheckpointRoot(tmp_path / "root"), pl, step=5)
    assert ckpt.verify() == []
    values, slots, version = ckpt.read_rows("v", 0, 11)
    assert values.dtype == np.dtype(dtype)
    assert values.tobytes() == model.values["v"].tobytes()
    assert sorted(slots) == sorted(SLOT_NAMES[opt])
    for k, a in model.slots["v"].items():
        assert slots[k].dtype == a.dtype
        assert slots[k].tobytes() == a.tobytes()
    assert version == 5 * 100 + 2  # the highest shard version
    assert ckpt.read_variable("v").tobytes() == model.values["v"].tobytes()
    assert set(ckpt.variables()) == {"v"}
    assert ckpt.variable_defs() == [var]
    assert ckpt.optimizer_of("v") == OPTIMIZERS[opt]


def sdef(dtype: str = "float32") -> ShardDef:
    return ShardDef(0, "w", 0, dtype, (4, 2), 0, 4, {"name": "zeros"}, OPTIMIZERS["sgd"])


@pytest.mark.parametrize(
    ("values", "slots", "version", "match"),
    [
        (np.zeros((4, 3), np.float32), {}, 0, "shape"),
        (np.zeros((4, 2), np.float64), {}, 0, "dtype"),
        (np.zeros((4, 2), ">f4"), {}, 0, "native"),
        (np.zeros((4, 2), np.int32), {}, 0, "native float"),
        ([[0.0] * 2] * 4, {}, 0, "numpy array"),
        (np.zeros((4, 2), np.float32), {"m": np.zeros((4, 3), np.float32)}, 0, "shape"),
        (np.zeros((4, 2), np.float32), {"../m": np.zeros((4, 2), np.float32)}, 0, "slot name"),
        (np.zeros((4, 2), np.float32), {}, -1, "version"),
        (np.zeros((4, 2), np.float32), {}, True, "version"),
    ],
)
def test_write_shard_refuses_bad_arguments(
    tmp_path: Path, values: Any, slots: Any, version: Any, match: str
) -> None:
    with pytest.raises(CheckpointError, match=match):
        write_shard(tmp_path, sdef(), values, slots, version)
    assert entries(tmp_path) == []


def test_write_shard_accepts_non_contiguous(tmp_path: Path) -> None:
    big = np.arange(32, dtype=np.float32).reshape(4, 8)
    view = big[:, ::4]  # (4, 2), not contiguous
    rec = write_shard(tmp_path, sdef(), view, {}, 0)
    assert np.array_equal(read_shard_file(tmp_path / rec.file).values, view)


def test_write_shard_os_error_becomes_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot write shard 0"):
        write_shard(tmp_path / "missing-dir", sdef(), np.zeros((4, 2), np.float32), {}, 0)


def test_read_shard_file_refuses_foreign_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError):
        read_shard_file(junk)
    (tmp_path / "pickle.safetensors").write_bytes(b"\x80\x04\x95" + b"\x00" * 50)
    with pytest.raises(CheckpointError):
        read_shard_file(tmp_path / "pickle.safetensors")
    other = tmp_path / "other.safetensors"
    save_file({"weight": np.zeros(3, np.float32)}, other)
    with pytest.raises(CheckpointError, match="no 'values'"):
        read_shard_file(other)
    with pytest.raises(CheckpointError):
        read_shard_file(tmp_path / "absent.safetensors")


def test_read_rows_reads_only_the_rows_asked(tmp_path: Path) -> None:
    var = VariableDef("big", (16384, 256), "float32")  # one 16 MiB shard
    root = CheckpointRoot(tmp_path)
    sd = ShardDef.of(var, plan([var], 1, Partitioner(num_shards=1)).shards[0], OPTIMIZERS["sgd"])
    temp = root.new_temp(1)
    values = np.ones(var.shape, np.float32)
    rec = write_shard(temp, sd, values, {}, 1)
    del values
    ckpt = root.commit(
        temp,
        Manifest(step=1, variables=[var.to_wire()], optimizer={}, num_ps=1, shards=[rec]),
    )
    tracemalloc.start()
    try:
        got, _, _ = ckpt.read_rows("big", 9000, 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got.shape == (1, 256) and float(got.sum()) == 256.0
    assert peak < 1 << 20, f"a 1-row read allocated {peak} bytes"


# -- records and manifests -------------------------------------------------------


def test_record_json_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    sd = ShardDef(12, "layer/0:w", 2, "float16", (9, 2), 3, 4, {}, OPTIMIZERS["adam"])
    rec = write_shard(tmp_path, sd, np.ones(sd.shape, np.float16), random_slots(sd, rng), 8)
    assert ShardRecord.from_json(rec.to_json()) == rec
    assert ShardRecord.from_json(json.loads(json.dumps(rec.to_json()))) == rec


def manifest_dict() -> dict[str, Any]:
    model, pl = small_model()
    return dict(manifest_of(model, pl).to_json())


def manifest_of(model: Model, pl: Placement) -> Manifest:
    records = [
        ShardRecord(
            file=shard_file_name(s.id),
            shard_id=s.id,
            var=s.var,
            row_start=s.row_start,
            rows=s.rows,
            dtype=pl.variable(s.var).dtype,
            version=s.id,
            sha256="0" * 64,
            nbytes=100,
            slots=("m", "v") if s.var == "w" else ("accumulator",),
        )
        for s in pl.shards
    ]
    return Manifest(
        step=9,
        generation=2,
        mode="ssp",
        created=1.5e9,
        variables=[v.to_wire() for v in pl.variables],
        optimizer=pl.optimizer,
        num_ps=2,
        shards=records,
        extra={"worker_steps": {"0": 9, "1": 8}, "note": "x"},
    )


def test_manifest_json_round_trip(tmp_path: Path) -> None:
    model, pl = small_model()
    m = manifest_of(model, pl)
    assert Manifest.from_json(m.dumps()) == m
    assert Manifest.from_json(m.dumps().encode()) == m
    assert Manifest.from_json(m.to_json()) == m
    (tmp_path / MANIFEST).write_text(m.dumps())
    assert Manifest.read(tmp_path / MANIFEST) == m
    assert m.variable_defs() == list(pl.variables)
    assert m.nbytes == 100 * len(pl.shards)
    assert [s.row_start for s in m.shards_of("w")] == [0, 4, 7]
    assert json.loads(m.dumps())["format"] == "zmqps-checkpoint"


def test_manifest_defaults() -> None:
    model, pl = small_model()
    m = manifest_of(model, pl)
    bare = Manifest(step=1, variables=m.variables, optimizer={}, num_ps=1, shards=m.shards)
    assert (bare.format_version, bare.generation, bare.mode, bare.extra) == (1, 0, "async", {})
    assert bare.created > 1.7e9


def _set(path: str, value: Any) -> Any:
    def mutate(d: dict[str, Any]) -> dict[str, Any]:
        target: Any = d
        keys = path.split(".")
        for k in keys[:-1]:
            target = target[int(k)] if isinstance(target, list) else target[k]
        last = keys[-1]
        if value is _DELETE:
            del target[last]
        elif isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
        return d

    return mutate


_DELETE = object()


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (_set("format", _DELETE), "not a zmqps checkpoint manifest"),
        (_set("format", "tensorflow"), "not a zmqps checkpoint manifest"),
        (_set("format_version", 2), "unsupported format version"),
        (_set("format_version", "1"), "format_version"),
        (_set("step", -1), "step"),
        (_set("step", "9"), "step"),
        (_set("step", True), "step"),
        (_set("step", 9.0), "step"),
        (_set("generation", _DELETE), "generation"),
        (_set("mode", "turbo"), "mode"),
        (_set("num_ps", 0), "num_ps"),
        (_set("created", "yesterday"), "created"),
        (_set("optimizer", []), "optimizer"),
        (_set("extra", None), "extra"),
        (_set("variables", {}), "variables"),
        (_set("variables.0", "w"), "variable"),
        (_set("variables.0.dtype", "int8"), "dtype"),
        (_set("variables.0.shape", [0, 4]), "positive"),
        (_set("variables.1.name", "w"), "twice"),
        (_set("shards", None), "shards"),
        (_set("shards.0", 7), "shard record"),
        (_set("shards.0.file", "../../etc/passwd"), "shard file name"),
        (_set("shards.0.file", "shard-000001.safetensors"), "shard id"),
        (_set("shards.0.sha256", "abc"), "sha256"),
        (_set("shards.0.rows", 0), "rows"),
        (_set("shards.0.row_start", 1), "gap"),
        (_set("shards.1.row_start", 3), "overlap"),
        (_set("shards.2.rows", 2), "cover rows"),
        (_set("shards.0.var", "nope"), "unknown variable"),
        (_set("shards.0.dtype", "float64"), "float64"),
        (_set("shards.0.slots", ["m", "m"]), "duplicate"),
        (_set("shards.0.slots", ["../x"]), "slot name"),
        (_set("shards.1.shard_id", 0), "shard id"),
    ],
)
def test_malformed_manifest(mutate: Any, match: str) -> None:
    d = mutate(manifest_dict())
    with pytest.raises(CheckpointError, match=match):
        Manifest.from_json(d)
    with pytest.raises(CheckpointError, match=match):
        Manifest.from_json(json.dumps(d))


def test_missing_shards_of_a_variable_refused() -> None:
    d = manifest_dict()
    d["shards"] = [s for s in d["shards"] if s["var"] != "emb"]
    with pytest.raises(CheckpointError, match="emb"):
        Manifest.from_json(d)


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"not json",
        b"[1, 2]",
        b'"manifest"',
        b"\x80\x04\x95\x00",  # a pickle
        b'{"format": "zmqps-checkpoint", "step": NaN}',
        b"[" * 100_000,
        b'{"__class__": "os.system", "format": "zmqps-checkpoint"}',
    ],
)
def test_foreign_manifest_text(text: bytes) -> None:
    with pytest.raises(CheckpointError, match="manifest"):
        Manifest.from_json(text)


def test_foreign_manifest_file_in_a_checkpoint_dir(tmp_path: Path) -> None:
    d = tmp_path / "ckpt-000000000001"
    d.mkdir()
    (d / MANIFEST).write_text('{"model_checkpoint_path": "model.ckpt-1"}')
    with pytest.raises(CheckpointError, match=str(d / MANIFEST)):
        Checkpoint.load(d)
    root = CheckpointRoot(tmp_path)
    assert root.checkpoints() == []
    assert root.latest() is None
    assert [n for n, _ in root.skipped] == ["ckpt-000000000001"]


# -- resharding ---------------------------------------------------------------


RESHARD_VARS = [
    VariableDef("dense", (41, 6), "float32", optimizer=OPTIMIZERS["adam"]),
    VariableDef("emb", (97, 4), "float32", optimizer=OPTIMIZERS["adagrad"], sparse=True),
    VariableDef("half", (53, 5), "float16", optimizer=OPTIMIZERS["momentum"]),
    VariableDef("bias", (40,), "float64"),  # job default optimizer (sgd)
]


def check_reads(ckpt: Checkpoint, model: Model, pl: Placement) -> None:
    """Every shard of ``pl`` read from ``ckpt`` equals the model's rows exactly, and its
    version is the highest of the source shards that overlap it."""
    for _, sd in pl.shard_defs():
        values, slots, version = ckpt.read_rows(sd.var, sd.row_start, sd.rows)
        rows = slice(sd.row_start, sd.row_start + sd.rows)
        assert values.shape == sd.shape
        assert values.dtype == np.dtype(sd.dtype)
        assert values.tobytes() == model.values[sd.var][rows].tobytes()
        assert sorted(slots) == sorted(model.slots[sd.var])
        for k, a in model.slots[sd.var].items():
            assert slots[k].dtype == a.dtype
            assert slots[k].tobytes() == a[rows].tobytes()
        sources = [
            s.version
            for s in ckpt.manifest.shards_of(sd.var)
            if s.row_start < rows.stop and s.row_end > rows.start
        ]
        assert version == max(sources)


def test_reshard_2ps_to_3ps_and_1ps(tmp_path: Path) -> None:
    model = Model(RESHARD_VARS, seed=4)
    # Written by 2 PS with shards of at most 128 bytes: several shards per variable.
    write_plan = plan(RESHARD_VARS, 2, Partitioner(min_shard_bytes=64, max_shard_bytes=128))
    counts = {v.name: len(write_plan.shards_of(v.name)) for v in RESHARD_VARS}
    assert all(n >= 3 for n in counts.values()), counts
    ckpt = model.write(CheckpointRoot(tmp_path), write_plan, step=3)
    assert ckpt.verify() == []

    plan3 = plan(RESHARD_VARS, 3, Partitioner(min_shard_bytes=64))
    plan1 = plan(RESHARD_VARS, 1, Partitioner())
    for pl in (plan3, plan1, write_plan):
        check_reads(ckpt, model, pl)
    # the boundaries really differ
    starts = {v.name: {s.row_start for s in write_plan.shards_of(v.name)} for v in RESHARD_VARS}
    assert any(s.row_start not in starts[s.var] for s in plan3.shards), (
        "3-PS plan has the same boundaries"
    )
    assert len(plan1.shards) == len(RESHARD_VARS)


def test_reshard_from_1ps_to_many(tmp_path: Path) -> None:
    model = Model(RESHARD_VARS, seed=5)
    ckpt = model.write(CheckpointRoot(tmp_path), plan(RESHARD_VARS, 1, Partitioner()), step=1)
    check_reads(ckpt, model, plan(RESHARD_VARS, 4, Partitioner(min_shard_bytes=16)))
    check_reads(ckpt, model, plan(RESHARD_VARS, 2, Partitioner(num_shards=7)))


@st.composite
def splits(draw: st.DrawFn) -> tuple[int, list[int], int, int]:
    rows = draw(st.integers(1, 60))
    cuts = draw(st.sets(st.integers(1, rows - 1), max_size=8)) if rows > 1 else set()
    start = draw(st.integers(0, rows - 1))
    length = draw(st.integers(1, rows - start))
    return rows, sorted(cuts), start, length


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    case=splits(),
    row_shape=st.sampled_from([(), (3,), (2, 2)]),
    dtype=st.sampled_from(["float16", "float32", "float64"]),
)
def test_read_rows_any_split(
    tmp_path_factory: pytest.TempPathFactory,
    case: tuple[int, list[int], int, int],
    row_shape: tuple[int, ...],
    dtype: str,
) -> None:
    rows, cuts, start, length = case
    var = VariableDef("v", (rows, *row_shape), dtype, optimizer=OPTIMIZERS["adam"])
    model = Model([var], seed=rows)
    bounds = [0, *cuts, rows]
    shards = tuple(_info(i, "v", a, b - a) for i, (a, b) in enumerate(pairwise(bounds)))
    pl = Placement(variables=(var,), shards=shards, optimizer=OPTIMIZERS["sgd"])
    root = CheckpointRoot(tmp_path_factory.mktemp("split"))
    ckpt = model.write(root, pl, step=2, version_of=lambda sd: (sd.id * 7919) % 13)
    values, slots, version = ckpt.read_rows("v", start, length)
    sl = slice(start, start + length)
    assert values.tobytes() == model.values["v"][sl].tobytes()
    assert slots["m"].tobytes() == model.slots["v"]["m"][sl].tobytes()
    assert slots["v"].tobytes() == model.slots["v"]["v"][sl].tobytes()
    sources = [i for i, (a, b) in enumerate(pairwise(bounds)) if a < start + length and b > start]
    assert version == max((i * 7919) % 13 for i in sources)
    only_values, no_slots, _ = ckpt.read_rows("v", start, length, slots=False)
    assert no_slots == {} and only_values.tobytes() == values.tobytes()


def _info(sid: int, var: str, row_start: int, rows: int) -> ShardInfo:
    return ShardInfo(sid, var, sid, row_start, rows, sid % 2)


@pytest.mark.parametrize(
    ("var", "start", "rows", "match"),
    [
        ("w", -1, 2, "outside"),
        ("w", 0, 0, "outside"),
        ("w", 9, 2, "outside"),
        ("w", 0, 11, "outside"),
        ("w", 1.0, 2, "integer"),
        ("nope", 0, 1, "no variable"),
    ],
)
def test_read_rows_refuses_bad_ranges(
    tmp_path: Path, var: str, start: Any, rows: int, match: str
) -> None:
    model, pl = small_model()
    ckpt = model.write(CheckpointRoot(tmp_path), pl, step=1)
    with pytest.raises(CheckpointError, match=match):
        ckpt.read_rows(var, start, rows)


def test_read_rows_detects_a_file_that_disagrees(tmp_path: Path) -> None:
    model, pl = small_model()
    ckpt = model.write(CheckpointRoot(tmp_path), pl, step=1)
    # Swap two shard files of w: sizes differ, metadata names another shard.
    a, b = (ckpt.path / shard_file_name(i) for i in (0, 1))
    data = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data)
    with pytest.raises(CheckpointError, match="metadata"):
        ckpt.read_rows("w", 0, 2)
    assert any("sha256" in p or "size" in p for p in ckpt.verify())


# -- the root: commit, LATEST, pruning, orphans ------------------------------------


def test_commit_layout_and_latest(tmp_path: Path) -> None:
    model, pl = small_model()
    root = CheckpointRoot(tmp_path / "root")
    assert root.checkpoints() == [] and root.latest() is None and root.clean_orphans() == []
    ckpt = model.write(root, pl, step=7)
    assert ckpt.name == "ckpt-000000000007" and ckpt.step == 7
    assert entries(root.path) == [LATEST, "ckpt-000000000007"]
    assert (root.path / LATEST).read_text() == "ckpt-000000000007\n"
    assert entries(ckpt.path) == [MANIFEST, *(shard_file_name(s.id) for s in pl.shards)]
    assert root.latest_name() == "ckpt-000000000007"
    latest = root.latest()
    assert latest is not None and latest.name == ckpt.name and root.skipped == []
    assert latest.manifest == ckpt.manifest
    assert root.get("ckpt-000000000007").manifest == ckpt.manifest


def test_new_temp_names_and_mode(tmp_path: Path) -> None:
    root = CheckpointRoot(tmp_path / "a" / "b")
    t1, t2 = root.new_temp(3), root.new_temp(3)
    assert t1 != t2 and t1.parent == root.path
    assert is_valid_name(t1.name) and t1.name.startswith(".tmp-ckpt-000000000003-")
    assert t1.stat().st_mode & 0o777 == 0o755 & ~_umask()
    root.abort(t1)
    assert not t1.exists() and t2.exists()
    root.abort(t1)  # already gone: fine
    with pytest.raises(CheckpointError):
        root.new_temp(-1)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_abort_refuses_what_is_not_a_temp_dir(tmp_path: Path) -> None:
    model, pl = small_model()
    root = CheckpointRoot(tmp_path / "root")
    ckpt = model.write(root, pl, step=1)
    other = CheckpointRoot(tmp_path / "other").new_temp(1)
    for bad in (ckpt.path, other, root.path / "LATEST"):
        with pytest.raises(CheckpointError):
            root.abort(bad)
    assert ckpt.path.exists() and other.exists()


def test_keep_k_pruning(tmp_path: Path) -> None:
    model, pl = small_model()
    root = CheckpointRoot(tmp_path, keep=3)
    for step in range(1, 7):
        model.write(root, pl, step=step)
        assert (tmp_path / LATEST).read_text() == committed_name(step) + "\n"
    assert [c.step for c in root.checkpoints()] == [4, 5, 6]
    assert entries(tmp_path) == [LATEST, *(committed_name(s) for s in (4, 5, 6))]


def test_keep_zero_keeps_all(tmp_path: Path) -> None:
    model, pl = small_model()
    root = CheckpointRoot(tmp_path, keep=0)
    for step in range(1, 8):
        model.write(root, pl, step=step)
    assert [c.step for c in root.checkpoints()] == list(range(1, 8))
    with pytest.raises(CheckpointError):
        CheckpointRoot(tmp_path, keep=-1)


def test_pruning_spares_what_latest_names(tmp_path: Path) -> None:
    model, pl = small_model()
    root = CheckpointRoot(tmp_path, keep=1)
    model.write(root, pl, step=1)
    (tmp_path / LATEST).write_text("ckpt-000000000001\n")  # e.g. a tool pointed it back
    model.write(CheckpointRoot(tmp_path, keep=0), pl, step=2)
    (tmp_path / LATEST).write_text("ckpt-000000000001\n")
    model.write(CheckpointRoot(tmp_path, keep=0), pl, step=3)
    (tmp_path / LATEST).write_text("ckpt-000000000001\n")
    assert root._prune(protect=set()) == ["ckpt-000000000002"]
    assert [c.step for c in root.checkpoints()] == [1, 3]


def test_pruning_removes_old_broken_dirs(tmp_path: Path) -> None:
    model, pl = small_model()
    root = CheckpointRoot(tmp_path, keep=2)
    model.write(root, pl, step=1)
    (tmp_path / "ckpt-000000000001" / MANIFEST).unlink()  # broken
    for step in (2, 3, 4):
        model.write(root, pl, step=step)
    assert entries(tmp_path) == [LATEST, "ckpt-000000000003", "ckpt-000000000004"]


def test_recommit_same_step_replaces(tmp_path: Path) -> None:
    model, pl = small_model()
    root = CheckpointRoot(tmp_path)
    model.write(root, pl, step=5)
    model.write(root, pl, step=4)
    second = model.write(root, pl, step=5, scale=2.0)
    assert entries(tmp_path) == [LATEST, "ckpt-000000000004", "ckpt-000000000005"]
    assert (tmp_path / LATEST).read_text() == "ckpt-000000000005\n"
    latest = root.latest()
    assert latest is not None and latest.name == second.name and latest.verify() == []
    expect = (model.values["w"] * 2.0).astype(np.float32)
    assert latest.read_variable("w").tobytes() == expect.tobytes()


def test_commit_checks_files(tmp_path: Path) -> None:
    model, pl = small_model()
    root = CheckpointRoot(tmp_path)
    good = model.write(root, pl, step=1)
    m = good.manifest

    temp = root.new_temp(2)
    with pytest.raises(CheckpointError, match="not for step 1"):
        root.commit(temp, m)
    temp1 = root.new_temp(1)
    with pytest.raises(CheckpointError, match="missing"):
        root.commit(temp1, m)
    for rec in m.shards:
        (temp1 / rec.file).write_bytes(b"x" * rec.nbytes)
    (temp1 / m.shards[2].file).write_bytes(b"short")
    with pytest.raises(CheckpointError, match="5 bytes"):
        root.commit(temp1, m)
    assert not (temp1 / MANIFEST).exists()
    with pytest.raises(CheckpointError, match="not a temp directory"):
        root.commit(good.path, m)
    outside = CheckpointRoot(tmp_path / "elsewhere").new_temp(1)
    with pytest.raises(CheckpointError, match="not a temp directory"):
        root.commit(outside, m)
    # nothing of this touched the committed checkpoint
    root.abort(temp)
    root.abort(temp1)
    assert entries(tmp_path) == [LATEST, "ckpt-000000000001", "elsewhere"]
    latest = root.latest()
    assert latest is not None and latest.name == good.name


def test_newest_is_highest_generation_then_step(tmp_path: Path) -> None:
    model, pl = small_model()
    root = CheckpointRoot(tmp_path)
    model.write(root, pl, step=100)
    model.write(root, pl, step=200)
    # restored to step 100 (generation 1); training goes on and checkpoints step 150
    model.write(root, pl, step=150, generation=1)
    assert [(c.generation, c.step) for c in root.checkpoints()] == [(0, 100), (0, 200), (1, 150)]
    latest = root.latest()
    assert latest is not None and latest.step == 150


def test_clean_orphans(tmp_path: Path) -> None:
    model, pl = small_model()
    root = CheckpointRoot(tmp_path)
    ckpt = model.write(root, pl, step=3)
    ckpt4 = model.write(root, pl, step=4)
    # a killed writer's temp dir with a complete and a partial shard file
    temp = root.new_temp(5)
    write_shard(temp, pl.shard_defs()[0][1], model.values["w"][:4], {}, 1)
    (temp / ".tmp-shard-000001.safetensors-0a0b0c0d").write_bytes(b"partial")
    (tmp_path / ".tmp-LATEST-12345678").write_text("ckpt-0000")
    (ckpt4.path / ".tmp-manifest.json-deadbeef").write_text("{")
    # a pruned checkpoint half removed
    (tmp_path / ".del-ckpt-000000000001-00000000").mkdir()
    # a replaced checkpoint whose replacement landed (remove) / never landed (put back)
    (tmp_path / ".old-ckpt-000000000004-11111111").mkdir()
    os.rename(ckpt.path, tmp_path / ".old-ckpt-000000000003-22222222")
    (tmp_path / "notes.txt").write_text("mine")

    removed = root.clean_orphans()
    assert sorted(removed) == sorted(
        [
            temp.name,
            ".tmp-LATEST-12345678",
            ".del-ckpt-000000000001-00000000",
            ".old-ckpt-000000000004-11111111",
            "restored ckpt-000000000003",
            "ckpt-000000000004/.tmp-manifest.json-deadbeef",
        ]
    )
    assert entries(tmp_path) == [LATEST, "ckpt-000000000003", "ckpt-000000000004", "notes.txt"]
    assert root.get("ckpt-000000000003").verify() == []
    assert entries(ckpt4.path) == [MANIFEST, *(shard_file_name(s.id) for s in pl.shards)]
    assert root.clean_orphans() == []


def test_clean_orphans_spares_young_entries(tmp_path: Path) -> None:
    root = CheckpointRoot(tmp_path)
    young = root.new_temp(1)
    old = root.new_temp(2)
    os.utime(old, (1e9, 1e9))
    assert root.clean_orphans(min_age=3600) == [old.name]
    assert young.exists()


# -- corruption and fallback ---------------------------------------------------------


def three_checkpoints(tmp_path: Path) -> tuple[CheckpointRoot, list[Checkpoint]]:
    model, pl = small_model()
    root = CheckpointRoot(tmp_path)
    return root, [model.write(root, pl, step=s) for s in (1, 2, 3)]


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["data", "header"])
def test_flipped_byte_falls_back(tmp_path: Path, where: str, caplog: Any) -> None:
    root, ckpts = three_checkpoints(tmp_path)
    victim = ckpts[2].path / shard_file_name(1)
    flip_byte(victim, -3 if where == "data" else 20)
    problems = ckpts[2].verify()
    assert problems == [f"{shard_file_name(1)}: sha256 mismatch (corrupted)"]
    latest = root.latest()
    assert latest is not None and latest.name == ckpts[1].name
    assert root.skipped == [(ckpts[2].name, problems[0])]
    assert "ckpt-000000000003 is unusable" in caplog.text
    assert "sha256 mismatch" in caplog.text
    # without verify, the newest that loads
    unverified = root.latest(verify=False)
    assert unverified is not None and unverified.name == ckpts[2].name and root.skipped == []


def test_truncated_file_falls_back(tmp_path: Path) -> None:
    root, ckpts = three_checkpoints(tmp_path)
    victim = ckpts[2].path / shard_file_name(0)
    size = victim.stat().st_size
    os.truncate(victim, size - 10)
    problem = f"size {size - 10} bytes, manifest says {size} (truncated or replaced)"
    assert ckpts[2].verify() == [f"{shard_file_name(0)}: {problem}"]
    latest = root.latest()
    assert latest is not None and latest.name == ckpts[1].name
    with pytest.raises(CheckpointError):
        ckpts[2].read_rows("w", 0, 10)


def test_two_bad_checkpoints_fall_back_twice(tmp_path: Path) -> None:
    root, ckpts = three_checkpoints(tmp_path)
    (ckpts[2].path / shard_file_name(2)).unlink()
    flip_byte(ckpts[1].path / shard_file_name(4), -1)
    latest = root.latest()
    assert latest is not None and latest.name == ckpts[0].name
    assert [n for n, _ in root.skipped] == [ckpts[2].name, ckpts[1].name]
    assert "missing" in root.skipped[0][1]


def test_nothing_usable(tmp_path: Path) -> None:
    root, ckpts = three_checkpoints(tmp_path)
    for c in ckpts:
        (c.path / shard_file_name(0)).write_bytes(b"")
    assert root.latest() is None
    assert len(root.skipped) == 3


def test_deleted_manifest_not_listed(tmp_path: Path) -> None:
    root, ckpts = three_checkpoints(tmp_path)
    (ckpts[2].path / MANIFEST).unlink()
    assert [c.step for c in root.checkpoints()] == [1, 2]
    latest = root.latest()
    assert latest is not None and latest.name == ckpts[1].name
    assert [n for n, _ in root.skipped] == [ckpts[2].name]


def test_manifest_with_wrong_metadata_fails_verify(tmp_path: Path) -> None:
    root, ckpts = three_checkpoints(tmp_path)
    m = ckpts[2].manifest
    shards = list(m.shards)
    shards[0] = ShardRecord(**{**shards[0].__dict__, "version": 999})
    bad = Manifest(**{**m.__dict__, "shards": shards})
    (ckpts[2].path / MANIFEST).write_text(bad.dumps())
    problems = Checkpoint.load(ckpts[2].path).verify()
    assert len(problems) == 1 and "version" in problems[0]
    latest = root.latest()
    assert latest is not None and latest.name == ckpts[1].name


def test_directory_name_must_match_step(tmp_path: Path) -> None:
    root, ckpts = three_checkpoints(tmp_path)
    os.rename(ckpts[2].path, tmp_path / "ckpt-000000000009")
    moved = root.get("ckpt-000000000009")
    assert moved.verify() == ["directory name says step 9, manifest 3"]


@pytest.mark.parametrize(
    "content", [b"", b"garbage\n", b"../../etc\n", b"ckpt-000000000099\n", b"\xff\xfe" * 100]
)
def test_garbage_latest_falls_back_to_scanning(tmp_path: Path, content: bytes) -> None:
    root, ckpts = three_checkpoints(tmp_path)
    (tmp_path / LATEST).write_bytes(content)
    latest = root.latest()
    assert latest is not None and latest.name == ckpts[2].name
    assert root.skipped == []


def test_missing_latest_file_scans(tmp_path: Path) -> None:
    root, ckpts = three_checkpoints(tmp_path)
    (tmp_path / LATEST).unlink()
    assert root.latest_name() is None
    latest = root.latest()
    assert latest is not None and latest.name == ckpts[2].name


def test_root_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    root = CheckpointRoot(f)
    assert root.checkpoints() == [] and root.latest() is None
    with pytest.raises(CheckpointError):
        root.new_temp(1)
