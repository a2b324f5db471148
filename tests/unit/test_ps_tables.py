"""Hash-keyed tables through PSService and ParameterClient (in-memory transport, real
codec): routing of any int64 id, duplicates summed on the worker, sync accumulation,
checkpoint_save / restore onto another number of PS with identical lookups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_ps_client import run
from test_ps_recovery import bare_cluster, chief, created_cluster, defs_by_ps

from zmqps.checkpoint import CheckpointRoot, Manifest, ShardRecord
from zmqps.core.hashtable import bucket_of, initial_rows
from zmqps.core.partition import Partitioner, plan
from zmqps.core.variables import Placement, VariableDef
from zmqps.wire.errors import ZmqpsError

EMB = VariableDef(
    "emb",
    (256, 3),
    init={"name": "normal", "stddev": 0.1, "seed": 5},
    optimizer={"name": "sgd", "lr": 0.5},
    table={},
)
WIDE = VariableDef(
    "wide", (256, 1), optimizer={"name": "ftrl", "lr": 0.1, "l2": 0.01}, table={"row_budget": 1000}
)
W = VariableDef("w", (4, 2), init={"name": "ones"})


def placement(num_ps: int) -> Placement:
    return plan([W, EMB, WIDE], num_ps, Partitioner(), optimizer={"name": "sgd", "lr": 0.1})


IDS = np.array([-1, 7, 2**63 - 1, -(2**63), 7, 123456789, 0, 42, -99], np.int64)


def test_rows_by_any_int64_id_and_duplicates_summed(tmp_path: Path) -> None:
    async def body() -> None:
        c = await created_cluster(placement(3), 3, None)
        w = c.client("w0")
        rows = await w.pull_rows("emb", IDS)
        want = initial_rows(EMB.init, "emb", IDS, 3, "float32")
        assert np.array_equal(rows, want)
        grads = np.arange(IDS.size * 3, dtype=np.float32).reshape(IDS.size, 3)
        assert await w.push_rows("emb", IDS, grads)
        summed = {int(i): np.zeros(3) for i in IDS}
        for i, g in zip(IDS.tolist(), grads, strict=True):
            summed[i] += g
        after = await w.pull_rows("emb", IDS)
        for k, i in enumerate(IDS.tolist()):
            np.testing.assert_allclose(after[k], want[k] - 0.5 * summed[i], rtol=1e-6)
        held = [
            svc.store.stats().get("tables", {}).get("emb", [{}])[0].get("rows", 0)
            for svc in c.services
        ]
        assert sum(held) == np.unique(IDS).size and max(held) < np.unique(IDS).size

    run(body())


def test_sync_accumulates_row_gradients_of_every_replica() -> None:
    async def body() -> None:
        c = await created_cluster(placement(2), 2, None)
        for i in (0, 1):
            await chief(c, i).request("sync_config", {"mode": "sync", "required": 2})
        w0, w1 = c.client("worker:0"), c.client("worker:1")
        ids = np.array([3, 4], np.int64)
        before = await w0.pull_rows("emb", ids)
        await w0.push_rows("emb", ids, np.ones((2, 3), np.float32), step=0)
        assert np.array_equal(await w0.pull_rows("emb", ids), before)  # 1 of 2: not yet
        await w1.push_rows("emb", ids[:1], np.full((1, 3), 3.0, np.float32), step=0)
        after = await w0.pull_rows("emb", ids)
        # the mean of the two replicas' (summed) gradients: (1 + 3) / 2 and (1 + 0) / 2
        np.testing.assert_allclose(after[0], before[0] - 0.5 * 2.0, rtol=1e-6)
        np.testing.assert_allclose(after[1], before[1] - 0.5 * 0.5, rtol=1e-6)

    run(body())


def test_a_sync_step_in_which_no_id_fell_in_a_table_shard() -> None:
    """Every replica's push to a table shard is empty: the step still applies (a shard
    with no rows to update), it does not fail inside the update."""

    async def body() -> None:
        c = await created_cluster(placement(2), 2, None)
        for i in (0, 1):
            await chief(c, i).request("sync_config", {"mode": "sync", "required": 2})
        w0, w1 = c.client("worker:0"), c.client("worker:1")
        none = np.zeros(0, np.int64)
        for w in (w0, w1):
            assert await w.push_rows("emb", none, np.zeros((0, 3), np.float32), step=0)
        shards = c.placement.shards_of("emb")
        assert len(shards) == 2
        assert {c.services[s.ps].store.get(s.id).version for s in shards} == {1}

    run(body())


async def _save(c: Any, root: CheckpointRoot, step: int) -> Any:
    temp = root.new_temp(step)
    records: list[ShardRecord] = []
    for i in range(len(c.services)):
        await chief(c, i).request("checkpoint_save", {"name": temp.name, "id": 1})
    for i in range(len(c.services)):
        rep = await chief(c, i).request("checkpoint_done", {"id": 1, "wait": 5.0})
        records += [ShardRecord.from_json(r) for r in rep.body["shards"]]
    manifest = Manifest(
        step=step,
        variables=[v.to_wire() for v in c.placement.variables],
        optimizer=dict(c.placement.optimizer),
        num_ps=len(c.services),
        shards=records,
    )
    return root.commit(temp, manifest)


def test_checkpoint_and_restore_onto_another_ps_count(tmp_path: Path) -> None:
    async def body() -> None:
        root = CheckpointRoot(tmp_path / "ckpt")
        c = await created_cluster(placement(2), 2, root.path)
        w = c.client("w0")
        rng = np.random.default_rng(3)
        pool = rng.integers(-(2**63), 2**63 - 1, 200, dtype=np.int64)
        for _ in range(8):
            ids = rng.choice(pool, 40)
            for t, width in (("emb", 3), ("wide", 1)):
                await w.pull_rows(t, ids)
                await w.push_rows(t, ids, rng.normal(size=(40, width)).astype(np.float32))
        want = {t: await w.pull_rows(t, pool) for t in ("emb", "wide")}
        ckpt = await _save(c, root, 8)
        assert ckpt.verify() == []

        for num_ps in (1, 3):
            pl = placement(num_ps)
            c2 = bare_cluster(pl, num_ps, root.path)
            body = {"gen": 1, "step": 8, "placement": pl.to_wire(), "name": ckpt.name}
            by_ps = defs_by_ps(pl)
            for ps in range(num_ps):
                await chief(c2, ps).request("restore", {**body, "shards": by_ps[ps]})
            w2 = c2.client("w0")
            w2.gen = 1
            for t in ("emb", "wide"):
                assert np.array_equal(await w2.pull_rows(t, pool), want[t]), (num_ps, t)

    run(body(), timeout=30)


def test_table_metrics_on_a_ps() -> None:
    from test_metrics import value
    from test_ps_client import Cluster

    from zmqps.metrics import Metrics
    from zmqps.roles.ps import PSService
    from zmqps.transport.fake import FakeNetwork

    async def body() -> None:
        pl = plan(
            [VariableDef("t", (16, 2), table={"row_budget": 8, "admit_after": 2})],
            1,
            Partitioner(),
            optimizer={"name": "sgd", "lr": 0.1},
        )
        m = Metrics()
        net = FakeNetwork()
        svc = PSService(0, metrics=m)
        net.serve("ps0", svc, name="ps0")
        c = Cluster(net, [svc], pl)
        await chief(c, 0).request(
            "create_shards", {"shards": [d.to_wire() for _, d in pl.shard_defs()]}
        )
        w = c.client("w0")
        ids = np.arange(6, dtype=np.int64)
        await w.pull_rows("t", ids)  # first sighting: nothing created
        await w.push_rows("t", ids, np.ones((6, 2), np.float32))  # dropped: not admitted
        await w.pull_rows("t", ids)  # admitted, created
        await w.pull_rows("t", ids + 100)
        await w.pull_rows("t", ids + 100)  # 6 more: over the budget of 8
        assert value(m, "zmqps_sparse_rows_total", variable="t", op="pull") == 24
        assert value(m, "zmqps_sparse_rows_total", variable="t", op="push") == 6
        assert value(m, "zmqps_table_gradients_not_admitted_total", variable="t") == 6
        assert value(m, "zmqps_table_rows_created_total", variable="t") == 12
        assert value(m, "zmqps_table_rows_admitted_total", variable="t") == 12
        evicted = value(m, "zmqps_table_rows_evicted_total", variable="t", reason="budget")
        rows = value(m, "zmqps_table_rows", variable="t")
        assert rows <= 8 and evicted == 12 - rows and evicted >= 4
        assert value(m, "zmqps_table_rows_evicted_total", variable="t", reason="idle") == 0

    run(body())


def test_a_read_only_pull_leaves_tables_counters_and_checkpoints_unchanged(
    tmp_path: Path,
) -> None:
    from zmqps.checkpoint.tables import read_table
    from zmqps.wire.messages import Tensor

    async def body() -> None:
        root = CheckpointRoot(tmp_path / "ckpt")
        c = await created_cluster(placement(2), 2, root.path)
        w = c.client("w0")
        rng = np.random.default_rng(4)
        trained = rng.integers(-(2**63), 2**63 - 1, 60, dtype=np.int64)
        for _ in range(4):
            for t, width in (("emb", 3), ("wide", 1)):
                await w.pull_rows(t, trained)
                await w.push_rows(t, trained, rng.normal(size=(60, width)).astype(np.float32))
        versions = dict(w.versions)
        stats = [svc.store.table_stats() for svc in c.services]
        first = await _save(c, root, 4)

        fresh = rng.integers(-(2**63), 2**63 - 1, 500, dtype=np.int64)
        ids = np.concatenate([trained, fresh, trained[:5]])
        read = {t: await w.pull_rows(t, ids, create=False) for t in ("emb", "wide")}
        assert [svc.store.table_stats() for svc in c.services] == stats
        assert w.versions == versions  # a read-only pull is not a training read
        second = await _save(c, root, 5)
        for t in ("emb", "wide"):
            a, b = read_table(first, t, 0, 256), read_table(second, t, 0, 256)
            for x, y in zip((*a[:2], a[3]), (*b[:2], b[3]), strict=True):
                assert np.array_equal(x, y), t
            assert a[2].keys() == b[2].keys() and all(
                np.array_equal(a[2][k], b[2][k]) for k in a[2]
            )

        # exactly what creating pulls return: trained rows, initial values of fresh ids
        want_fresh = initial_rows(EMB.init, "emb", fresh, 3, "float32")
        assert np.array_equal(read["emb"][60:560], want_fresh)
        assert np.array_equal(read["wide"][60:560], np.zeros((500, 1), np.float32))
        for t in ("emb", "wide"):
            assert np.array_equal(read[t], await w.pull_rows(t, ids)), t

        # a request without the flag (as older clients send) creates rows, as before
        first_shard = c.placement.shards_of("emb")[0]
        sid, ps = first_shard.id, first_shard.ps
        d = c.services[ps].store.get(sid).definition
        candidates = np.arange(-5000, 0, dtype=np.int64)
        b = bucket_of(candidates, 256)
        owned = candidates[(b >= d.row_start) & (b < d.row_start + d.rows)][:8]
        new_ids, other_ids = owned[:4], owned[4:]
        raw = c.net.client(f"ps{ps}", "old:0")
        before = c.services[ps].store.table_stats()["emb"]["rows"]
        await raw.request("pull_rows", {"shards": [sid]}, [Tensor(new_ids, "index", sid)])
        assert c.services[ps].store.table_stats()["emb"]["rows"] == before + 4
        # a malformed flag is refused and changes nothing
        stats = c.services[ps].store.table_stats()
        with pytest.raises(ZmqpsError, match="create"):
            await raw.request(
                "pull_rows", {"shards": [sid], "create": 0}, [Tensor(other_ids, "index", sid)]
            )
        assert c.services[ps].store.table_stats() == stats

    run(body(), timeout=30)


def test_table_rows_lists_every_live_row_in_pages_and_changes_nothing() -> None:
    async def body() -> None:
        c = await created_cluster(placement(3), 3, None)
        w = c.client("w0", chunk_bytes=200)  # a few rows per page: many pages per shard
        rng = np.random.default_rng(5)
        ids = np.unique(rng.integers(-(2**63), 2**63 - 1, 300, dtype=np.int64))
        await w.pull_rows("emb", ids)
        await w.push_rows("emb", ids, rng.normal(size=(ids.size, 3)).astype(np.float32))
        stats = [svc.store.table_stats() for svc in c.services]
        got_ids, got_values = await w.table_rows("emb")
        assert np.array_equal(got_ids, ids)  # every live row, ascending
        assert np.array_equal(got_values, await w.pull_rows("emb", ids, create=False))
        assert [svc.store.table_stats() for svc in c.services] == stats
        empty_ids, empty_values = await w.table_rows("wide")  # no rows yet
        assert empty_ids.shape == (0,) and empty_values.shape == (0, 1)
        with pytest.raises(ZmqpsError, match="not a hash-keyed table"):
            await w.table_rows("w")
        raw = chief(c, 0)
        sid = c.placement.shards_of("w")[0].id
        with pytest.raises(ZmqpsError, match="not a hash-keyed table"):
            await raw.request("table_rows", {"shard": sid, "start": 0, "limit": 4})
        with pytest.raises(ZmqpsError, match="limit"):
            await raw.request("table_rows", {"shard": sid, "start": 0, "limit": 0})

    run(body(), timeout=30)


def test_a_ps_bounds_the_bytes_of_a_table_page(monkeypatch: pytest.MonkeyPatch) -> None:
    import zmqps.core.store

    monkeypatch.setattr(zmqps.core.store, "TABLE_PAGE_BYTES", 100)  # 8 rows of 3 float32

    async def body() -> None:
        c = await created_cluster(placement(1), 1, None)
        w = c.client("w0")  # asks for pages of 4 MiB
        ids = np.arange(-50, 50, dtype=np.int64) * 7
        await w.pull_rows("emb", ids)
        sid = c.placement.shards_of("emb")[0].id
        rep = await chief(c, 0).request("table_rows", {"shard": sid, "start": 0, "limit": 1000})
        assert rep.body["rows"] == 100 and rep.tensors[0].array.shape == (8,)
        got_ids, got_values = await w.table_rows("emb")  # 13 pages, each one smaller
        assert np.array_equal(got_ids, np.sort(ids))
        assert np.array_equal(got_values, await w.pull_rows("emb", got_ids, create=False))

    run(body(), timeout=30)
