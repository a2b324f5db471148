"""Checkpoints of hash-keyed tables: ids, rows, slots and stamps, digest-checked, restored
onto another number of PS with identical lookups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zmqps.checkpoint import CheckpointError, CheckpointRoot, Manifest, write_shard
from zmqps.checkpoint.tables import read_table, write_table_shard
from zmqps.core.hashtable import bucket_of
from zmqps.core.partition import Partitioner, plan
from zmqps.core.store import ShardStore
from zmqps.core.variables import Placement, VariableDef

TABLE = VariableDef(
    "emb",
    (64, 4),
    init={"name": "normal", "stddev": 0.1, "seed": 1},
    optimizer={"name": "adagrad", "lr": 0.1},
    table={},
)
DENSE = VariableDef("w", (5, 3), init={"name": "ones"})


def cluster(num_ps: int) -> tuple[Placement, list[ShardStore]]:
    pl = plan([DENSE, TABLE], num_ps, Partitioner(), optimizer={"name": "sgd", "lr": 0.1})
    stores = [ShardStore() for _ in range(num_ps)]
    for ps, d in pl.shard_defs():
        stores[ps].create([d])
    return pl, stores


def route(pl: Placement, ids: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """(ps, shard id, ids) of every table shard, as a client routes them."""
    b = bucket_of(ids, TABLE.shape[0])
    out = []
    for s in pl.shards_of("emb"):
        sel = ids[(b >= s.row_start) & (b < s.row_start + s.rows)]
        out.append((s.ps, s.id, sel))
    return out


def lookup(pl: Placement, stores: list[ShardStore], ids: np.ndarray) -> np.ndarray:
    out = np.empty((ids.size, 4), np.float32)
    b = bucket_of(ids, TABLE.shape[0])
    for s in pl.shards_of("emb"):
        sel = (b >= s.row_start) & (b < s.row_start + s.rows)
        out[sel] = stores[s.ps].pull_rows(s.id, ids[sel])[1]
    return out


def slots_of(pl: Placement, stores: list[ShardStore]) -> dict[int, np.ndarray]:
    acc: dict[int, np.ndarray] = {}
    for s in pl.shards_of("emb"):
        ids, _, slots, _ = stores[s.ps].get(s.id).state()  # type: ignore[attr-defined]
        acc.update(zip(ids.tolist(), slots["accumulator"], strict=True))
    return acc


def save(root: CheckpointRoot, pl: Placement, stores: list[ShardStore], step: int) -> Any:
    temp = root.new_temp(step)
    records = []
    for ps, d in pl.shard_defs():
        shard: Any = stores[ps].get(d.id)
        if d.table is None:
            records.append(write_shard(temp, d, shard.values, shard.slots, shard.version))
        else:
            ids, values, slots, touched = shard.state()
            records.append(write_table_shard(temp, d, ids, values, slots, touched, shard.version))
    manifest = Manifest(
        step=step,
        variables=[v.to_wire() for v in pl.variables],
        optimizer=pl.optimizer,
        num_ps=len(stores),
        shards=records,
    )
    return root.commit(temp, manifest)


def restore(ckpt: Any, num_ps: int) -> tuple[Placement, list[ShardStore]]:
    pl, stores = cluster(num_ps)
    for ps, store in enumerate(stores):
        defs = [d for p, d in pl.shard_defs() if p == ps]
        dense = []
        for d in defs:
            if d.table is None:
                values, slots, version = ckpt.read_rows(d.var, d.row_start, d.rows)
                dense.append((d, values.reshape(d.shape), slots, version))
        tables = [
            (d, *read_table(ckpt, d.var, d.row_start, d.rows)) for d in defs if d.table is not None
        ]
        store.replace(dense, tables)
    return pl, stores


@pytest.mark.parametrize("target_ps", [1, 3, 4])
def test_restore_onto_another_ps_count_gives_identical_lookups(
    tmp_path: Path, target_ps: int
) -> None:
    pl, stores = cluster(2)
    rng = np.random.default_rng(0)
    seen = np.unique(rng.integers(-(2**62), 2**62, 300)).astype(np.int64)
    for _ in range(10):
        batch = np.unique(rng.choice(seen, 60))
        for ps, sid, ids in route(pl, batch):
            stores[ps].pull_rows(sid, ids)
            grads = rng.normal(size=(ids.size, 4)).astype(np.float32)
            stores[ps].apply_rows(sid, ids, grads, stores[ps].get(sid).version)
    touched = np.unique(np.concatenate([ids for _, _, ids in route(pl, seen)]))
    live = np.array(sorted(slots_of(pl, stores)), np.int64)
    want = lookup(pl, stores, live)
    want_slots = slots_of(pl, stores)
    ckpt = save(CheckpointRoot(tmp_path / "ckpt"), pl, stores, 10)
    assert ckpt.verify() == []

    pl2, stores2 = restore(ckpt, target_ps)
    assert np.array_equal(lookup(pl2, stores2, live), want)
    got_slots = slots_of(pl2, stores2)
    assert set(got_slots) == set(want_slots)
    for i, acc in want_slots.items():
        assert np.array_equal(got_slots[i], acc)
    # ids never seen read their initial values on both
    fresh = np.arange(10**6, 10**6 + 50, dtype=np.int64)
    assert np.array_equal(lookup(pl2, stores2, fresh), lookup(pl, stores, fresh))
    assert touched.size >= live.size > 0
    # the dense variable came back as well
    dense_sid = pl2.shards_of("w")[0]
    assert np.array_equal(stores2[dense_sid.ps].snapshot(dense_sid.id)[1], np.ones((5, 3)))


def test_a_tampered_table_file_is_caught(tmp_path: Path) -> None:
    pl, stores = cluster(2)
    s = pl.shards_of("emb")[0]
    ids = np.arange(100, dtype=np.int64)
    ids = ids[(bucket_of(ids, 64) >= s.row_start) & (bucket_of(ids, 64) < s.row_start + s.rows)]
    stores[s.ps].pull_rows(s.id, ids)
    ckpt = save(CheckpointRoot(tmp_path / "ckpt"), pl, stores, 1)
    path = ckpt.path / f"shard-{s.id:06d}.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    assert any("sha256" in p for p in ckpt.verify())
    with pytest.raises(CheckpointError, match="hash-keyed table"):
        ckpt.read_rows("emb", 0, 64)
    assert "emb" not in ckpt.variables() and "w" in ckpt.variables()


def test_a_restore_beyond_the_budget_keeps_the_most_recent_rows(tmp_path: Path) -> None:
    pl, stores = cluster(2)
    all_ids = np.arange(400, dtype=np.int64)
    for k in range(0, 400, 40):  # ids touched in order: later ids are more recent
        for ps, sid, ids in route(pl, all_ids[k : k + 40]):
            stores[ps].apply_rows(sid, ids, np.ones((ids.size, 4), np.float32), 0)
    ckpt = save(CheckpointRoot(tmp_path / "ckpt"), pl, stores, 1)
    small = VariableDef(
        "emb", (64, 4), init=TABLE.init, optimizer=TABLE.optimizer, table={"row_budget": 100}
    )
    pl1 = plan([DENSE, small], 1, Partitioner(), optimizer={"name": "sgd", "lr": 0.1})
    d = next(d for _, d in pl1.shard_defs() if d.table is not None)
    store = ShardStore()
    store.replace([], [(d, *read_table(ckpt, "emb", 0, 64))])
    shard: Any = store.get(d.id)
    assert shard.rows == 100 and shard.counters.evicted_budget == 300
    kept = shard.state()[0]
    assert kept.min() >= 200  # the older ids went first
