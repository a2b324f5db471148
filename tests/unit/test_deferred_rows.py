"""A row update split around a pull's reply (``ShardStore.deferring``).

A ``push_pull_rows`` to a PS that applies pushes on arrival updates at once only the
rows its pull reads; the rest of the update runs once the reply is on its way
(``after_reply``). These tests hold the invariants: the rows read are the updated
ones; the rows left alone are untouched until the store settles; once settled, the
values and every slot are bit for bit those of the update made whole; float16
shards and hash-keyed tables are never split; a PS splits a push whose rows are in
the worker's region only when the worker said they stay there (``kept``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from test_ps_client import ALL, make_cluster, run
from test_push_pull_rows import batches, shard_state
from test_rows_shm import ADAM, row_frames, shm_client, warm
from test_store import sdef

from zmqps.core import _kernels, optimizers
from zmqps.core.optimizers import make_optimizer
from zmqps.core.store import ShardStore
from zmqps.roles.channels import ShmChannel, _Regions
from zmqps.roles.client import ParameterClient
from zmqps.roles.ps import service

OPTIMIZERS = [
    {"name": "sgd", "lr": 0.1},
    {"name": "momentum", "lr": 0.05, "momentum": 0.9},
    {"name": "adagrad", "lr": 0.1},
    {"name": "adam", "lr": 0.01},
]
ROWS = 400


def _store(optimizer: dict[str, Any], dtype: str = "float32") -> ShardStore:
    store = ShardStore()
    store.create([sdef(0, full_shape=(ROWS, 8), dtype=dtype, optimizer=optimizer, sparse=True)])
    return store


def _state(store: ShardStore) -> list[np.ndarray]:
    shard = store.get(0)
    return [shard.values.copy(), *(shard.slots[k].copy() for k in sorted(shard.slots))]


def _push(store: ShardStore, ids: np.ndarray, grads: np.ndarray) -> None:
    store.apply_all([store.plan_rows(0, ids, grads, store.get(0).version)])


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o["name"])
@pytest.mark.parametrize("order", ["sorted", "shuffled", "all", "none"])
def test_a_split_update_reads_like_a_whole_one_and_settles_to_it(
    optimizer: dict[str, Any], order: str
) -> None:
    rng = np.random.default_rng(len(order) + len(optimizer["name"]))
    whole, split = _store(optimizer), _store(optimizer)
    for step in range(6):
        ids = np.unique(rng.integers(0, ROWS, 60))
        grads = rng.standard_normal((ids.size, 8)).astype(np.float32)
        pulled = {
            "sorted": np.unique(rng.integers(0, ROWS, 50)),
            "shuffled": rng.permutation(np.unique(rng.integers(0, ROWS, 50))),
            "all": ids.copy(),
            "none": np.setdiff1d(np.arange(ROWS), ids)[:40],
        }[order]
        before = _state(split)
        _push(whole, ids, grads)
        with split.deferring({0: pulled}):
            _push(split, ids, grads)
        assert split.get(0).version == whole.get(0).version == step + 1
        # the rows the pull reads are the updated ones, at once
        read = split.get(0).read_rows(pulled, True)
        np.testing.assert_array_equal(read, whole.get(0).read_rows(pulled, True))
        # the others wait for the store to settle
        left = np.setdiff1d(ids, pulled)
        assert split.unsettled == bool(left.size)
        for now, then in zip(_state(split), before, strict=True):
            np.testing.assert_array_equal(now[left], then[left])
        split.settle()
        assert not split.unsettled
        for a, b in zip(_state(split), _state(whole), strict=True):
            np.testing.assert_array_equal(a, b)


def test_float16_shards_and_hash_tables_are_updated_whole() -> None:
    store = ShardStore()
    table = dataclasses.replace(
        sdef(1, var="t", full_shape=(64, 4), sparse=True), table={"row_budget": 64}
    )
    store.create([sdef(0, full_shape=(50, 4), dtype="float16", sparse=True), table])
    ids = np.array([1, 2, 3], np.int64)
    grads = np.ones((3, 4), np.float32)
    with store.deferring({0: np.array([1], np.int64), 1: np.array([1], np.int64)}):
        store.apply_all(
            [
                store.plan_rows(0, ids, grads.astype(np.float16), 0),
                store.plan_rows(1, ids, grads, 0),
            ]
        )
    assert not store.unsettled


def test_split_held_matches_a_set_intersection() -> None:
    assert _kernels.available()
    split = _kernels.index_kernel("split_held", np.zeros(1, np.int64))
    rng = np.random.default_rng(7)
    for trial in range(200):
        keys = np.unique(rng.integers(0, 300, rng.integers(0, 80)))
        hold = np.unique(rng.integers(0, 300, rng.integers(0, 80)))
        if trial % 2:
            hold = rng.permutation(hold)
        now, later = np.empty_like(keys), np.empty_like(keys)
        held = split(keys, hold, now, later)
        inside = np.isin(keys, hold)
        assert held == int(inside.sum())
        np.testing.assert_array_equal(now, np.where(inside, keys, -1))
        np.testing.assert_array_equal(later, np.where(inside, -1, keys))


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o["name"])
def test_masked_rows_are_skipped_by_the_kernels_and_by_numpy(
    optimizer: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(3)
    opt = make_optimizer(optimizer)
    rows = np.arange(0, 40, 3, dtype=np.int64)
    masked = np.where(rng.random(rows.size) < 0.5, rows, -1)
    grads = rng.standard_normal((rows.size, 5)).astype(np.float32)

    def run() -> list[np.ndarray]:
        p = np.linspace(-1, 1, 200, dtype=np.float32).reshape(40, 5)
        slots = {n: np.full_like(p, 0.1) for n in opt.slot_names}
        opt.apply_rows(p, masked, grads, slots, 3, masked=True)
        return [p, *(slots[n] for n in opt.slot_names)]

    fused = run()
    monkeypatch.setattr(optimizers, "USE_KERNELS", False)
    plain = run()
    for a, b in zip(fused, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    untouched = np.setdiff1d(np.arange(40), masked[masked >= 0])
    p0 = np.linspace(-1, 1, 200, dtype=np.float32).reshape(40, 5)
    np.testing.assert_array_equal(fused[0][untouched], p0[untouched])


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "not-kept"])
def test_a_ps_leaves_part_of_a_region_push_for_after_its_reply_only_when_kept(
    kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push whose rows are in the worker's push region is split around the reply
    only when the worker said they stay there (``kept``: a worker that alternates
    halves of the room); a worker that did not say so (an older one) gets it whole.
    Either way the rows read and the state reached are the TCP client's."""
    left: list[Any] = []
    monkeypatch.setattr(service, "after_reply", left.append)  # held: never run here
    if not kept:
        heard = ParameterClient.heard_takes

        def older(self: ParameterClient, ps: int, takes: Any) -> None:
            heard(self, ps, None if takes is None else [t for t in takes if t != "rows_kept"])

        monkeypatch.setattr(ParameterClient, "heard_takes", older)

    async def body() -> None:
        rng = np.random.default_rng(11)
        seq = batches(rng, 23, 12, 10)
        grads = [rng.standard_normal((ids.size, 3)).astype(np.float32) for ids in seq]
        a = await make_cluster(ALL, 2, 3, optimizer=ADAM)
        b = await make_cluster(ALL, 2, 3, optimizer=ADAM)
        tcp, fast = a.client(), shm_client(b)
        await warm(fast, "emb", seq[0])
        await warm(tcp, "emb", seq[0])
        want = [await tcp.pull_rows("emb", seq[0])]
        got = [await fast.pull_rows("emb", seq[0])]
        split = 0
        for k in range(1, len(seq)):
            for c, out in ((tcp, want), (fast, got)):
                applied, rows = await c.push_pull_rows("emb", seq[k - 1], grads[k - 1], seq[k])
                assert applied
                out.append(rows)
            split += any(s.store.unsettled for s in b.services)
            for s in (*a.services, *b.services):
                s.store.settle()  # what the transport runs after the reply
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(g, w)
        assert shard_state(b.services) == shard_state(a.services)
        assert fast.rows_kept == ({0, 1} if kept else set())
        assert (split > 0) == kept  # the TCP client's pushes are split in both runs
        sent, with_rows = row_frames(fast)
        assert sent >= len(seq) and with_rows == 0  # every push through the region
        await fast.close()

    run(body(), 20.0)


def test_pushes_to_a_ps_that_reads_them_late_alternate_halves_of_the_room() -> None:
    regions = _Regions(None, None, 1, 2, {}, rows_at=4096, rows_bytes=1024)  # type: ignore[arg-type]
    ch = ShmChannel(None, 0, regions)  # type: ignore[arg-type]
    assert ch.push_places([100, 200]) == [4096, 4096 + 128]
    assert ch.push_places([300]) == [4096 + 512]
    assert ch.push_places([10]) == [4096]
    assert ch.push_places([513]) is None  # more than half: by TCP
    assert ch.push_places([1]) == [4096 + 512]  # (a push that went by TCP took no turn)
    assert ch.row_places([1000]) == [4096]  # pulls and other pushes: the whole room
