"""Exports of a model with hash-keyed tables (the CTR model): the live rows round trip by
id under the weights' sha256, unknown ids read as the PS would serve them, and every
way the tables of an export can be wrong is one ExportError."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zmqps.core.hashtable import initial_rows
from zmqps.core.store import ShardStore
from zmqps.core.tableview import TableView
from zmqps.core.variables import ShardDef
from zmqps.export import SIGNATURE_FILE, WEIGHTS_FILE, ExportError, export_model, load_model
from zmqps.models.ctr import CTRModel, SparseBatch

pytestmark = pytest.mark.timeout(30)


def ctr(**table: Any) -> CTRModel:
    return CTRModel(3, 2, dim=4, hidden=5, buckets=64, seed=7, table=table)


def dense_params(model: CTRModel, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        v.name: rng.normal(size=v.shape).astype(v.dtype) for v in model.variables() if not v.hashed
    }


IDS = np.array([2**63 - 1, -1, 0, 42, -(2**63), 123456789, -77], np.int64)


def table_rows(model: CTRModel, seed: int = 1) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {
        model.WIDE: (IDS.copy(), rng.normal(size=(IDS.size, 1)).astype(np.float32)),
        model.EMB: (IDS[::-1].copy(), rng.normal(size=(IDS.size, 4)).astype(np.float32)),
    }


@pytest.fixture
def exported(tmp_path: Path) -> Path:
    model = ctr()
    return export_model(
        tmp_path / "ctr", model.signature(), dense_params(model), tables=table_rows(model)
    )


def test_round_trip_rows_by_id_and_unknown_ids_at_their_initial_value(exported: Path) -> None:
    model = ctr()
    loaded, params, sig = load_model(exported)
    assert isinstance(loaded, CTRModel) and loaded.config() == model.config()
    for name, value in dense_params(model).items():
        assert np.array_equal(params[name], value) and params[name].dtype == value.dtype
    assert [t["rows"] for t in sig["tables"]] == [IDS.size, IDS.size]
    for name, (ids, values) in table_rows(model).items():
        view = params[name]
        assert isinstance(view, TableView) and len(view) == IDS.size
        assert np.array_equal(view.ids, np.sort(ids))  # ascending in the file
        assert np.array_equal(view.rows(ids), values)  # each id keeps its own row
    unknown = np.array([5, -5, 10**15], np.int64)
    emb = next(v for v in model.variables() if v.name == model.EMB)
    want = initial_rows(emb.init, model.EMB, unknown, 4, "float32")
    assert np.array_equal(params[model.EMB].rows(unknown), want)
    assert np.array_equal(params[model.WIDE].rows(unknown), np.zeros((3, 1), np.float32))

    # predict() == the model's math on rows gathered by hand, for known and unknown ids
    rng = np.random.default_rng(2)
    ids = rng.choice(np.concatenate([IDS, unknown]), size=(11, 3))
    dense = rng.normal(size=(11, 2)).astype(np.float32)
    batch = SparseBatch.of(ids)
    rows = {n: params[n].rows(batch.unique) for n in model.tables}
    got = loaded.predict(params, ids, dense, piece=4)  # in pieces: the same probabilities
    assert np.array_equal(got, model.probabilities(params, rows, batch, dense))


def test_table_rows_are_plain_safetensors_under_the_sha256(exported: Path) -> None:
    data = (exported / WEIGHTS_FILE).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    assert header["table:ctr/emb:ids"]["dtype"] == "I64"
    assert header["table:ctr/emb:values"]["shape"] == [IDS.size, 4]
    assert header["table:ctr/wide:values"]["shape"] == [IDS.size, 1]
    assert "ctr/emb" not in header  # never the (buckets, dim) placeholder


def test_a_loaded_export_exports_again(exported: Path, tmp_path: Path) -> None:
    _, params, sig = load_model(exported)
    again = export_model(tmp_path / "again", sig, params)
    _, params2, _ = load_model(again)
    for name in ctr().tables:
        assert np.array_equal(params2[name].ids, params[name].ids)
        assert np.array_equal(params2[name].values, params[name].values)


@pytest.mark.parametrize("admit_after", [1, 3])
def test_a_table_view_reads_like_a_read_only_pull(admit_after: int) -> None:
    """An export's rows answer every id exactly as the PS that held them would."""
    d = ShardDef(
        id=0,
        var="ctr/emb",
        index=0,
        dtype="float32",
        full_shape=(64, 4),
        row_start=0,
        rows=64,
        init={"name": "normal", "stddev": 0.05, "seed": 7},
        optimizer={"name": "adagrad", "lr": 0.1},
        sparse=True,
        table={"admit_after": admit_after},
    )
    store = ShardStore()
    store.create([d])
    trained = np.arange(-20, 20, dtype=np.int64) * 7919
    for _ in range(admit_after):
        store.pull_rows(0, trained)
    store.apply_rows(0, trained, np.ones((trained.size, 4), np.float32), 0)
    ids, values, _, _ = store.get(0).state()  # type: ignore[attr-defined]
    view = TableView("ctr/emb", ids, values, d.init, d.table or {})
    query = np.concatenate([trained, np.arange(1000, 1040, dtype=np.int64), trained[:3]])
    assert np.array_equal(view.rows(query), store.pull_rows(0, query, create=False)[1])


def _edit_signature(exported: Path, edit: Any) -> None:
    path = exported / SIGNATURE_FILE
    sig = json.loads(path.read_text())
    edit(sig)
    path.write_text(json.dumps(sig))


def test_tampered_table_rows_are_detected(exported: Path) -> None:
    path = exported / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(ExportError, match="corrupted"):
        load_model(exported)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s["tables"][0].update(rows=3), "holds 7 rows, the signature says 3"),
        (lambda s: s["tables"][1]["init"].update(seed=8), "tables do not match a ctr model"),
        (lambda s: s["tables"][1].update(row_shape=[5]), "expected float32"),
        (lambda s: s["tables"].pop(), "variables not in the signature"),
        (lambda s: s["tables"].append(s["tables"][0]), "names a table twice"),
        (lambda s: s["tables"][0].pop("init"), "malformed table list"),
        (lambda s: s["config"].update(dim=5), "do not match a ctr model"),
        (lambda s: s["config"].update(fields=0), "cannot rebuild the ctr model"),
        (lambda s: s["config"].update(table={"row_budget": 0}), "cannot rebuild the ctr model"),
        (lambda s: s["config"].update(buckets="many"), "cannot rebuild the ctr model"),
        (lambda s: s["tables"][0].update(table={"x": 1}), "does not take x"),
        (lambda s: s.update(tables="none"), "malformed table list"),
    ],
    ids=[
        "rows",
        "seed",
        "row-shape",
        "table-dropped",
        "twice",
        "no-init",
        "dim",
        "config",
        "bad-policy",
        "buckets",
        "table-policy",
        "not-a-list",
    ],
)
def test_inconsistent_table_signatures(exported: Path, edit: Any, message: str) -> None:
    _edit_signature(exported, edit)
    with pytest.raises(ExportError, match=message):
        load_model(exported)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.pop("ctr/wide"), "tables .* given"),
        (lambda t: t.update({"ctr/wide": (IDS, np.zeros((7, 2), np.float32))}), "values"),
        (lambda t: t.update({"ctr/wide": (IDS, np.zeros((7, 1), np.float64))}), "values"),
        (lambda t: t.update({"ctr/wide": (IDS.astype(np.int32), t["ctr/wide"][1])}), "int64"),
        (
            lambda t: t.update({"ctr/wide": (np.zeros(7, np.int64), t["ctr/wide"][1])}),
            "unique",
        ),
    ],
    ids=["missing", "width", "dtype", "id-dtype", "duplicate-ids"],
)
def test_export_refuses_tables_unlike_the_signature(
    tmp_path: Path, change: Any, message: str
) -> None:
    model = ctr()
    tables = table_rows(model)
    change(tables)
    with pytest.raises(ExportError, match=message):
        export_model(tmp_path / "e", model.signature(), dense_params(model), tables=tables)
    assert list(tmp_path.iterdir()) == []  # nothing written


def _leaves(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in _leaves(v, (*path, k))] + [path]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in _leaves(v, (*path, i))] + [path]
    return [path]


def test_mutated_signatures_of_a_ctr_export_fail_cleanly(exported: Path) -> None:
    """Any value of signature.json replaced by junk: loaded, or one ExportError."""
    path = exported / SIGNATURE_FILE
    original = json.loads(path.read_text())
    junk: list[Any] = [None, -1, 0, 2**70, 1e308, "x", "", [], {}, [1, 2], {"name": 1}, True]
    rng = np.random.default_rng(0)
    leaves = [p for p in _leaves(original) if p]
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(400):
        doc = json.loads(json.dumps(original))
        where = leaves[rng.integers(len(leaves))]
        node = doc
        for k in where[:-1]:
            node = node[k]
        node[where[-1]] = junk[rng.integers(len(junk))]
        path.write_text(json.dumps(doc))
        try:
            load_model(exported)
            outcomes["loaded"] += 1
        except ExportError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100, outcomes
