"""The PS side of checkpoints and recovery, without sockets.

``PSService`` instances behind the in-memory transport (real codec), driven the way
the chief drives them: ``ps_state``, ``checkpoint_save`` / ``checkpoint_done`` into a
checkpoint root (committed here with :mod:`zmqps.checkpoint`, as the chief's
Checkpointer does), ``restore`` (from a checkpoint, resharded, or to the initial
values) and generation fencing of data requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_ps_client import EMB, SGD, Cluster, initial, run

from zmqps.checkpoint import (
    Checkpoint,
    CheckpointRoot,
    Manifest,
    ShardRecord,
    read_shard_file,
    shard_file_name,
)
from zmqps.core.partition import Partitioner, plan
from zmqps.core.variables import Placement, VariableDef
from zmqps.roles.ps import PSService
from zmqps.transport.fake import FakeNetwork
from zmqps.wire.errors import InvalidArgument, NotFound, NotReady, RolledBack, ZmqpsError

W = VariableDef("w", (9, 4), init={"name": "glorot_uniform", "seed": 1})
B = VariableDef("b", (7,), init={"name": "normal", "stddev": 0.5, "seed": 2})
DENSE = (W, B)
ADAM = {"name": "adam", "lr": 0.05}


def grads(seed: int, variables: Sequence[VariableDef] = DENSE) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {v.name: rng.standard_normal(v.shape).astype(np.float32) for v in variables}


def placement_for(
    num_ps: int,
    num_shards: int | None,
    variables: Sequence[VariableDef] = DENSE,
    optimizer: Mapping[str, Any] = ADAM,
) -> Placement:
    return plan(variables, num_ps, Partitioner(num_shards=num_shards), optimizer=optimizer)


def defs_by_ps(placement: Placement) -> dict[int, list[dict[str, Any]]]:
    by_ps: dict[int, list[dict[str, Any]]] = {}
    for ps, d in placement.shard_defs():
        by_ps.setdefault(ps, []).append(d.to_wire())
    return by_ps


def bare_cluster(placement: Placement, num_ps: int, root: Path | None) -> Cluster:
    """PS that hold nothing yet (as after a restart): serving, no shards."""
    net = FakeNetwork()
    services = [PSService(i, checkpoint_dir=root) for i in range(num_ps)]
    for i, svc in enumerate(services):
        net.serve(f"ps{i}", svc, name=f"ps{i}")
    return Cluster(net, services, placement)


async def created_cluster(placement: Placement, num_ps: int, root: Path | None) -> Cluster:
    """PS with their shards created, as the chief does at the start of a job."""
    c = bare_cluster(placement, num_ps, root)
    wire = placement.to_wire()
    for ps, defs in defs_by_ps(placement).items():
        rep = await chief(c, ps).request("create_shards", {"shards": defs, "placement": wire})
        assert rep.body["shards"] == [d["id"] for d in defs]
    return c


def chief(c: Cluster, ps: int) -> Any:
    return c.net.client(f"ps{ps}", "chief:0")


def slot_values(c: Cluster, name: str) -> dict[str, np.ndarray]:
    """Every optimizer slot of ``name``, gathered from the PS stores."""
    v = c.placement.variable(name)
    out: dict[str, np.ndarray] = {}
    for s in c.placement.shards_of(name):
        shard = c.services[s.ps].store.get(s.id)
        for k, arr in shard.slots.items():
            dst = out.setdefault(k, np.empty(v.shape, arr.dtype))
            dst[s.row_start : s.row_start + s.rows] = arr
    return out


def state_of(c: Cluster) -> dict[str, Any]:
    """Values and slots of every variable (copies)."""
    return {
        v.name: (c.shard_values(v.name).copy(), slot_values(c, v.name))
        for v in c.placement.variables
    }


async def save_checkpoint(
    c: Cluster, root: CheckpointRoot, step: int, save_id: int = 7
) -> tuple[Checkpoint, dict[str, Any]]:
    """What the chief's Checkpointer does: snapshot on every PS, wait for the files, commit.

    Returns the committed checkpoint and the state at the snapshot."""
    temp = root.new_temp(step)
    holders = sorted({s.ps for s in c.placement.shards})
    saved_versions: dict[int, int] = {}
    for i in holders:
        rep = await chief(c, i).request("checkpoint_save", {"name": temp.name, "id": save_id})
        assert rep.body["step"] == c.services[i].sync_step
        assert rep.body["snapshot_s"] >= 0
        saved_versions.update({int(sid): int(v) for sid, v in rep.body["versions"]})
    state = state_of(c)
    assert saved_versions == c.versions()
    # Training goes on at once: an update after the snapshot is not in the files.
    await c.client("w9", 0).push(grads(99))
    assert c.versions() != saved_versions
    records: list[ShardRecord] = []
    for i in holders:
        rep = await chief(c, i).request("checkpoint_done", {"id": save_id, "wait": 5.0})
        records += [ShardRecord.from_json(r) for r in rep.body["shards"]]
    assert sorted(r.shard_id for r in records) == sorted(s.id for s in c.placement.shards)
    assert {r.shard_id: r.version for r in records} == saved_versions
    manifest = Manifest(
        step=step,
        mode="async",
        variables=[v.to_wire() for v in c.placement.variables],
        optimizer=dict(c.placement.optimizer),
        num_ps=len(c.services),
        shards=records,
    )
    ckpt = root.commit(temp, manifest)
    return ckpt, {"state": state, "versions": saved_versions}


async def restore(
    c: Cluster, gen: int, step: int = 0, name: str | None = None
) -> dict[int, dict[str, Any]]:
    body: dict[str, Any] = {"gen": gen, "step": step, "placement": c.placement.to_wire()}
    if name is not None:
        body["name"] = name
    out = {}
    by_ps = defs_by_ps(c.placement)
    for ps in range(len(c.services)):  # every PS, as the chief does: some may hold nothing
        defs = by_ps.get(ps, [])
        rep = await chief(c, ps).request("restore", {**body, "shards": defs})
        out[ps] = dict(rep.body)
    return out


# ---------------------------------------------------------------- ps_state


def test_ps_state_tells_a_chief_what_the_ps_holds(tmp_path: Path) -> None:
    async def body() -> None:
        placement = placement_for(2, 3)
        c = bare_cluster(placement, 2, tmp_path)
        st = dict((await chief(c, 0).request("ps_state")).body)
        assert st == {
            "index": 0,
            "boot": c.services[0].boot,
            "gen": 0,
            "shards": [],
            "mode": "",
            "step": 0,
            "contributors": [],
            "checkpoints": True,  # it was given a checkpoint folder
        }
        assert len(st["boot"]) == 16 and int(st["boot"], 16) >= 0
        assert c.services[0].boot != c.services[1].boot  # one per process start

        c = await created_cluster(placement, 2, tmp_path)
        w0, w1 = c.client("worker:0"), c.client("worker:1")
        await w0.push(grads(1))
        for i in (0, 1):
            st = dict((await chief(c, i).request("ps_state")).body)
            mine = sorted(s.id for s in placement.shards if s.ps == i)
            assert sorted(sid for sid, _ in st["shards"]) == mine
            assert {ver for _, ver in st["shards"]} == {1}
            assert Placement.from_wire(st["placement"]) == placement
            assert (st["index"], st["gen"], st["mode"], st["step"]) == (i, 0, "", 0)

        # sync: the PS's step and who has given the current step a gradient
        for i in (0, 1):
            await chief(c, i).request("sync_config", {"mode": "sync", "required": 2})
        await w1.push(grads(2), step=0)
        st = dict((await chief(c, 0).request("ps_state")).body)
        assert (st["mode"], st["step"], st["contributors"]) == ("sync", 0, ["worker:1"])
        await w0.push(grads(3), step=0)
        st = dict((await chief(c, 1).request("ps_state")).body)
        assert (st["mode"], st["step"], st["contributors"]) == ("sync", 1, [])

    run(body())


# ---------------------------------------------------------------- checkpoint_save / done


def test_checkpoint_files_hold_values_and_slots_exactly(tmp_path: Path) -> None:
    """Adam (two slots), 2 PS x 3 shards per variable: the files hold the state at the
    snapshot (not the update that came after it), bit for bit, and verify."""

    async def body() -> None:
        root = CheckpointRoot(tmp_path / "ckpt")
        c = await created_cluster(placement_for(2, 3), 2, root.path)
        w = c.client("worker:0")
        for seed in range(3):
            await w.push(grads(seed))
        ckpt, saved = await save_checkpoint(c, root, step=3)
        assert ckpt.name == "ckpt-000000000003"
        assert (root.path / "LATEST").read_text().strip() == ckpt.name
        latest = root.latest()
        assert latest is not None and latest.name == ckpt.name and not root.skipped
        assert latest.verify() == []
        for v in DENSE:
            values, slots = saved["state"][v.name]
            assert set(slots) == {"m", "v"}
            got, got_slots, version = latest.read_rows(v.name, 0, v.shape[0])
            np.testing.assert_array_equal(got, values)
            assert set(got_slots) == set(slots)
            for k in slots:
                assert got_slots[k].dtype == slots[k].dtype
                np.testing.assert_array_equal(got_slots[k], slots[k])
            assert version == 3
            assert not np.array_equal(values, initial(v))  # it trained
        # each shard file on its own: its rows, its version, the same numbers
        for s in c.placement.shards:
            rec = next(r for r in latest.manifest.shards if r.shard_id == s.id)
            assert (rec.var, rec.row_start, rec.rows, rec.version) == (
                s.var,
                s.row_start,
                s.rows,
                3,
            )
            contents = read_shard_file(latest.path / rec.file)
            values, slots = saved["state"][s.var]
            np.testing.assert_array_equal(
                contents.values, values[s.row_start : s.row_start + s.rows]
            )
            for k, arr in contents.slots.items():
                np.testing.assert_array_equal(arr, slots[k][s.row_start : s.row_start + s.rows])

    run(body())


def test_checkpoint_save_and_done_refusals(tmp_path: Path) -> None:
    async def body() -> None:
        root = CheckpointRoot(tmp_path / "ckpt")
        c = await created_cluster(placement_for(1, 2), 1, root.path)
        ps = chief(c, 0)
        with pytest.raises(NotFound, match="no checkpoint save 5"):
            await ps.request("checkpoint_done", {"id": 5})
        # a valid name whose directory the chief did not make
        with pytest.raises(NotFound, match="no checkpoint directory"):
            await ps.request("checkpoint_save", {"name": "ckpt-000000000001", "id": 1})
        # a PS started without a checkpoint root
        plain = await created_cluster(placement_for(1, 2), 1, None)
        temp = root.new_temp(1)
        with pytest.raises(InvalidArgument, match="without --checkpoint-dir"):
            await chief(plain, 0).request("checkpoint_save", {"name": temp.name, "id": 1})
        assert list(temp.iterdir()) == []

    run(body())


def test_a_save_into_a_committed_checkpoint_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    """The chief saves into a checkpoint being written, then commits it: a save naming a
    committed one (stray or hostile) would overwrite files its digests cover."""

    async def body() -> None:
        root = CheckpointRoot(tmp_path / "ckpt")
        c = await created_cluster(placement_for(1, 2), 1, root.path)
        ckpt, _ = await save_checkpoint(c, root, step=1, save_id=1)
        before = {p.name: p.read_bytes() for p in ckpt.path.iterdir()}
        assert await c.client("worker:0").push(grads(0))  # the values move on
        with pytest.raises(InvalidArgument, match="never into a committed one"):
            await chief(c, 0).request("checkpoint_save", {"name": ckpt.path.name, "id": 2})
        assert {p.name: p.read_bytes() for p in ckpt.path.iterdir()} == before
        assert root.latest() == ckpt

    run(body())


def test_a_failed_write_is_reported_by_checkpoint_done(tmp_path: Path) -> None:
    """The write fails (a directory where a shard file must go): checkpoint_done says so
    with an error naming the file, the PS serves on, and the next checkpoint works."""

    async def body() -> None:
        root = CheckpointRoot(tmp_path / "ckpt")
        c = await created_cluster(placement_for(1, 2), 1, root.path)
        temp = root.new_temp(1)
        blocker = temp / shard_file_name(c.placement.shards[0].id)
        (blocker / "in-the-way").mkdir(parents=True)
        ps = chief(c, 0)
        await ps.request("checkpoint_save", {"name": temp.name, "id": 1})
        with pytest.raises(ZmqpsError, match=f"cannot write shard .*{blocker.name}"):
            await ps.request("checkpoint_done", {"id": 1, "wait": 5.0})
        assert await c.client("worker:0").push(grads(0))  # still serving
        ckpt, _ = await save_checkpoint(c, root, step=2, save_id=2)
        assert root.latest() == ckpt

    run(body())


@pytest.mark.parametrize(
    "name",
    [
        "../outside",
        "..",
        "a/b",
        "/etc",
        "ckpt-000000000001/../../outside",
        ".tmp-ckpt-000000000001-0123abcd/..",
        "..\\outside",
        "ckpt-000000000001/",
    ],
)
def test_checkpoint_save_refuses_paths(tmp_path: Path, name: str) -> None:
    """A name is a bare directory name in the root: never a path out of it (or into a
    subdirectory), whether or not the place exists."""

    async def body() -> None:
        root = CheckpointRoot(tmp_path / "root" / "ckpt")
        (tmp_path / "outside").mkdir()
        (tmp_path / "root" / "outside").mkdir(parents=True)
        temp = root.new_temp(1)
        (root.path / "ckpt-000000000001").mkdir()
        c = await created_cluster(placement_for(1, 2), 1, root.path)
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        with pytest.raises(InvalidArgument, match="not a checkpoint directory name"):
            await chief(c, 0).request("checkpoint_save", {"name": name, "id": 1})
        with pytest.raises(InvalidArgument, match="not a checkpoint directory name"):
            await restore(c, gen=1, name=name)
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
        assert c.services[0].gen == 0  # the refused restore changed nothing
        assert list(temp.iterdir()) == []

    run(body())


# ---------------------------------------------------------------- restore


@pytest.mark.parametrize(("num_ps", "num_shards"), [(3, 4), (3, None), (1, 1), (2, 3)])
def test_restore_reshards_values_slots_and_versions(
    tmp_path: Path, num_ps: int, num_shards: int | None
) -> None:
    """Written by 2 PS with 3 shards per variable, restored onto fresh PS with another
    sharding: the same values, slots and versions; the next update is the one the
    original PS made after the checkpoint."""

    async def body() -> None:
        root = CheckpointRoot(tmp_path / "ckpt")
        old = await created_cluster(placement_for(2, 3), 2, root.path)
        w = old.client("worker:0")
        for seed in range(4):
            await w.push(grads(seed))
        ckpt, saved = await save_checkpoint(old, root, step=4)
        after = state_of(old)  # the original, one update (grads(99)) past the checkpoint

        new = bare_cluster(placement_for(num_ps, num_shards), num_ps, root.path)
        assert new.placement != old.placement or (num_ps, num_shards) == (2, 3)
        replies = await restore(new, gen=1, step=0, name=ckpt.name)
        for ps, rep in replies.items():
            assert rep["gen"] == 1
            mine = sorted(s.id for s in new.placement.shards if s.ps == ps)
            assert sorted(sid for sid, _ in rep["versions"]) == mine
            assert {ver for _, ver in rep["versions"]} == ({4} if mine else set())
        assert set(new.versions().values()) == {4}
        for v in DENSE:
            values, slots = saved["state"][v.name]
            np.testing.assert_array_equal(new.shard_values(v.name), values)
            got_slots = slot_values(new, v.name)
            assert set(got_slots) == set(slots)
            for k in slots:
                np.testing.assert_array_equal(got_slots[k], slots[k])
        for i, svc in enumerate(new.services):
            st = dict((await chief(new, i).request("ps_state")).body)
            assert (st["gen"], st["boot"]) == (1, svc.boot)
            assert Placement.from_wire(st["placement"]) == new.placement

        # The same update continues the same run (Adam's step count is the version).
        client = new.client("w9", 0)
        client.gen = 1
        await client.pull()  # a gradient is of values pulled in the restored generation
        await client.push(grads(99))
        for v in DENSE:
            values, slots = after[v.name]
            np.testing.assert_allclose(new.shard_values(v.name), values, rtol=1e-6, atol=1e-7)
            for k, arr in slot_values(new, v.name).items():
                np.testing.assert_allclose(arr, slots[k], rtol=1e-6, atol=1e-7)

    run(body())


def test_restore_without_a_name_reinitializes(tmp_path: Path) -> None:
    async def body() -> None:
        c = await created_cluster(placement_for(2, 3), 2, tmp_path)
        w = c.client("worker:0")
        for seed in range(2):
            await w.push(grads(seed))
        assert not np.array_equal(c.shard_values("w"), initial(W))
        replies = await restore(c, gen=1)
        assert {r["gen"] for r in replies.values()} == {1}
        assert set(c.versions().values()) == {0}
        for v in DENSE:
            np.testing.assert_array_equal(c.shard_values(v.name), initial(v))
            for arr in slot_values(c, v.name).values():
                assert not arr.any()
        # also onto a new sharding, on PS that never held shards
        fresh = bare_cluster(placement_for(3, 4), 3, None)
        await restore(fresh, gen=2, step=0)
        for v in DENSE:
            np.testing.assert_array_equal(fresh.shard_values(v.name), initial(v))
        assert [svc.gen for svc in fresh.services] == [2, 2, 2]

    run(body())


def test_restore_never_goes_to_an_older_generation(tmp_path: Path) -> None:
    async def body() -> None:
        c = await created_cluster(placement_for(1, 2), 1, tmp_path)
        await restore(c, gen=3)
        with pytest.raises(InvalidArgument, match="generation 2 < 3"):
            await restore(c, gen=2)
        assert c.services[0].gen == 3
        await restore(c, gen=3)  # the same generation again: a retried restore
        assert c.services[0].gen == 3

    run(body())


# ---------------------------------------------------------------- generation fencing


def test_requests_of_another_generation_are_rolled_back(tmp_path: Path) -> None:
    variables = (*DENSE, EMB)

    async def body() -> None:
        c = await created_cluster(placement_for(2, 2, variables, SGD), 2, tmp_path)
        stale = c.client("worker:0")
        await stale.pull()
        await stale.push(grads(0))
        await restore(c, gen=1)
        before = state_of(c)
        versions = c.versions()
        # gen 0 (before the restore): every data request is refused, nothing changes
        with pytest.raises(RolledBack, match=r"generation 1.*generation 0"):
            await stale.push(grads(1))
        with pytest.raises(RolledBack):
            await stale.push(grads(1), pull=True)
        with pytest.raises(RolledBack):
            await stale.pull()
        with pytest.raises(RolledBack):
            await stale.pull_rows("emb", np.array([1, 2]))
        with pytest.raises(RolledBack):
            await stale.push_rows("emb", np.array([1]), np.ones((1, 3), np.float32))
        # a generation from the future (a confused client) is refused the same way
        future = c.client("worker:1")
        future.gen = 2
        with pytest.raises(RolledBack):
            await future.push(grads(2))
        # heard of the restore (generation 1) but still holding values of generation 0:
        # its push says generation 0 and is refused the same way (fault schedule 86: it
        # said 1 and was refused as invalid_argument, "pulled version 763 outside [0, 720]",
        # which failed a coordinator's functions instead of running them again)
        stale.gen = 1
        with pytest.raises(RolledBack, match=r"generation 1.*generation 0"):
            await stale.push(grads(1))
        with pytest.raises(RolledBack):
            await stale.push(grads(1), pull=True)
        assert c.versions() == versions
        for name, (values, slots) in before.items():
            np.testing.assert_array_equal(c.shard_values(name), values)
            for k, arr in slot_values(c, name).items():
                np.testing.assert_array_equal(arr, slots[k])
        assert [svc.duplicates for svc in c.services] == [0, 0]
        # resynced into generation 1, the same worker is served again
        stale.gen = 1
        await stale.pull()
        assert await stale.push(grads(3))
        dense = {s.id for s in c.placement.shards if s.var != "emb"}
        assert {ver for sid, ver in c.versions().items() if sid in dense} == {1}

    run(body())


def test_a_ps_without_shards_answers_data_requests_not_ready(tmp_path: Path) -> None:
    async def body() -> None:
        placement = placement_for(1, 2, (*DENSE, EMB), SGD)
        c = bare_cluster(placement, 1, tmp_path)
        client = c.client("worker:0")
        with pytest.raises(NotReady, match="holds no shards"):
            await client.pull()
        with pytest.raises(NotReady, match="holds no shards"):
            await client.push(grads(0))
        with pytest.raises(NotReady):
            await client.pull_rows("emb", np.array([0]))
        with pytest.raises(NotReady):
            await chief(c, 0).request("pull", {"shards": [0]})  # without a generation too
        # control requests are answered
        assert (await chief(c, 0).request("ping")).body["role"] == "ps"
        assert (await chief(c, 0).request("ps_state")).body["shards"] == []
        assert (await chief(c, 0).request("status")).body["gen"] == 0
        await restore(c, gen=1)
        client.gen = 1
        params = await client.pull()
        np.testing.assert_array_equal(params["w"], initial(W))

    run(body())


# ---------------------------------------------------------------- sync steps


async def sync_cluster(tmp_path: Path, required: int) -> Cluster:
    c = await created_cluster(placement_for(2, 2, DENSE, SGD), 2, tmp_path)
    for i in (0, 1):
        await chief(c, i).request("sync_config", {"mode": "sync", "required": required})
    return c


def accumulated(c: Cluster) -> list[int]:
    return sorted({n for svc in c.services for n in svc.status()["sync"]["accumulated"].values()})


def test_a_sync_push_ahead_of_the_shards_is_rolled_back(tmp_path: Path) -> None:
    """A token of a step the shards have not reached was issued before a restore rolled
    the cluster back: the push is refused whole (RolledBack) and nothing accumulates."""

    async def body() -> None:
        c = await sync_cluster(tmp_path, required=2)
        w0 = c.client("worker:0")
        with pytest.raises(RolledBack, match=r"step 1.*step 0"):
            await w0.push(grads(0), step=1)
        assert accumulated(c) in ([], [0])
        assert set(c.versions().values()) == {0}
        # restored to step 5: step 6 is ahead, 4 is stale, 5 counts
        await restore(c, gen=1, step=5)
        w0.gen = 1
        await w0.pull()  # values of the restored generation
        assert [svc.sync_step for svc in c.services] == [5, 5]
        with pytest.raises(RolledBack):
            await w0.push(grads(1), step=6)
        assert not await w0.push(grads(2), step=4)
        assert w0.dropped == {"stale": 2}
        assert await w0.push(grads(3), step=5)
        assert accumulated(c) == [1]
        w1 = c.client("worker:1")
        w1.gen = 1
        await w1.pull()
        assert await w1.push(grads(4), step=5)
        assert [svc.sync_step for svc in c.services] == [6, 6]
        assert set(c.versions().values()) == {1}

    run(body())


@pytest.mark.parametrize("how", ["same incarnation", "new incarnation"])
def test_a_second_gradient_for_the_same_step_is_not_counted(tmp_path: Path, how: str) -> None:
    """N = 2. Worker 0 gives step 1 a gradient, then another one for step 1 (a second
    token, e.g. from a restarted chief, or a restarted worker): dropped as a duplicate,
    not counted toward N; worker 1's gradient then completes the step with the mean of
    the two first gradients."""

    async def body() -> None:
        c = await sync_cluster(tmp_path, required=2)
        w0, w1 = c.client("worker:0"), c.client("worker:1")
        assert await w0.push(grads(0), step=0)
        assert await w1.push(grads(1), step=0)
        assert [svc.sync_step for svc in c.services] == [1, 1]
        start = {v.name: c.shard_values(v.name).copy() for v in DENSE}
        g_first, g_again, g_other = grads(10), grads(11), grads(12)
        assert await w0.push(g_first, step=1)
        again = w0 if how == "same incarnation" else c.client("worker:0", incarnation=1)
        assert not await again.push(g_again, step=1)
        assert again.dropped == {"duplicate": 2}  # one reply per PS
        assert accumulated(c) == [1]
        assert set(c.versions().values()) == {1}
        for i in (0, 1):
            st = c.services[i].status()["sync"]
            assert st["dropped"] == {"duplicate": 1}
            assert st["contributors"] == ["worker:0"]
        assert await w1.push(g_other, step=1)
        assert set(c.versions().values()) == {2}
        lr = SGD["lr"]
        for v in DENSE:
            expected = start[v.name] - lr * (g_first[v.name] + g_other[v.name]) / 2
            np.testing.assert_allclose(c.shard_values(v.name), expected, rtol=1e-6)

    run(body())


def test_step_zero_counts_every_gradient(tmp_path: Path) -> None:
    """The extra tokens of step 0 (--init-tokens) let one worker give step 0 several
    gradients: there each one counts."""

    async def body() -> None:
        c = await sync_cluster(tmp_path, required=2)
        w0 = c.client("worker:0")
        g0, g1 = grads(0), grads(1)
        assert await w0.push(g0, step=0)
        assert await w0.push(g1, step=0)
        assert [svc.sync_step for svc in c.services] == [1, 1]
        for v in DENSE:
            expected = initial(v) - SGD["lr"] * (g0[v.name] + g1[v.name]) / 2
            np.testing.assert_allclose(c.shard_values(v.name), expected, rtol=1e-6)

    run(body())
