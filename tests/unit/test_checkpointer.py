"""The chief's checkpointer against real PS services on the in-memory transport."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zmqps.checkpoint import CheckpointRoot
from zmqps.core.partition import Partitioner, plan
from zmqps.core.variables import VariableDef
from zmqps.roles.checkpointer import Checkpointer
from zmqps.roles.configs import CheckpointPolicy
from zmqps.roles.ps import PSService
from zmqps.transport.fake import FakeClient, FakeNetwork
from zmqps.wire import request
from zmqps.wire.errors import Busy, NotReady

VARIABLES = (VariableDef("w", (40, 8)), VariableDef("b", (8,)))
PLACEMENT = plan(VARIABLES, 2, Partitioner(num_shards=2), optimizer={"name": "sgd", "lr": 0.1})


async def _two_ps(tmp_path: Path) -> tuple[FakeNetwork, list[FakeClient]]:
    """Two PS services holding PLACEMENT's shards, and the chief's clients to them."""
    net = FakeNetwork()
    for i in range(2):
        net.serve(f"ps{i}", PSService(i, checkpoint_dir=tmp_path), name=f"ps{i}")
    chief = [net.client(f"ps{i}", "chief:0") for i in range(2)]
    by_ps: dict[int, list[dict[str, object]]] = {}
    for ps, d in PLACEMENT.shard_defs():
        by_ps.setdefault(ps, []).append(d.to_wire())
    for ps, defs in by_ps.items():
        await chief[ps].request("create_shards", {"shards": defs})
    return net, chief


def test_checkpoints_taken_together_commit_one_after_the_other(tmp_path: Path) -> None:
    """Two ``take`` calls at once (the policy's trigger and a ``checkpoint`` request,
    both at the same step, as the coordinator's epoch ends do) both commit: they used
    to snapshot and commit side by side, and the second rename failed with
    "Directory not empty" (found by fault schedule 86)."""
    placement = PLACEMENT

    async def body() -> None:
        _, chief = await _two_ps(tmp_path)
        ck = Checkpointer(CheckpointPolicy(str(tmp_path), keep=10), chief)
        commit, inside, most = ck.root.commit, [0], [0]

        def slow_commit(*args: Any) -> Any:  # widens the window two commits race in
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            try:
                time.sleep(0.05)
                return commit(*args)
            finally:
                inside[0] -= 1

        ck.root.commit = slow_commit  # type: ignore[method-assign, assignment]
        for step in (7, 7, 7, 9):
            got = await asyncio.gather(
                *(ck.take(step, placement, "async", 0, {}) for _ in range(3))
            )
            assert all(c is not None and c.step == step for c in got), ck.last_error
        assert ck.failed == 0 and ck.committed == 12
        assert most[0] == 1  # one commit at a time
        latest = ck.latest()
        assert latest is not None and latest.step == 9
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers

    asyncio.run(asyncio.wait_for(body(), 20.0))


def test_a_restarted_ps_fails_the_checkpoint_as_a_passing_state(tmp_path: Path) -> None:
    """A PS that restarted holds no shards and refuses ``checkpoint_save`` (the manifest
    used to fail with "shards cover rows [0, 0)", and the coordinator's epoch-end
    checkpoint request ended the run: fault schedule 162). The failure is marked
    transient, so a ``checkpoint`` request is answered NotReady (ask again once the
    cluster has recovered)."""
    placement = PLACEMENT

    async def body() -> None:
        net, chief = await _two_ps(tmp_path)
        ck = Checkpointer(CheckpointPolicy(str(tmp_path)), chief)
        assert await ck.take(3, placement, "async", 0, {}) is not None
        net.serve("ps1", PSService(1, checkpoint_dir=tmp_path), name="ps1")  # restarted
        assert await ck.take(4, placement, "async", 0, {}) is None
        assert ck.last_transient and "holds no shards" in ck.last_error
        latest = ck.latest()
        assert latest is not None and latest.step == 3

    asyncio.run(asyncio.wait_for(body(), 20.0))


def test_an_empty_ps_refuses_checkpoint_save(tmp_path: Path) -> None:
    """A restarted PS, not restored yet, would write an empty part of the checkpoint."""
    svc = PSService(0, checkpoint_dir=tmp_path)
    with pytest.raises(NotReady, match="holds no shards"):
        svc(request("checkpoint_save", {"name": ".tmp-ckpt-000000000001-ab", "id": 1}))


def test_a_checkpoint_save_sent_again_is_answered_from_the_first(tmp_path: Path) -> None:
    """``checkpoint_save`` is sent again when a cut-off connection comes back (it used
    to wait out its 30 s deadline after the partition healed, and the run's final
    checkpoint failed: fault schedule 87). The same save id answers the first
    snapshot's versions, even if the shards changed since, and writes once."""

    async def body() -> None:
        svc = PSService(0, checkpoint_dir=tmp_path)
        defs = [d.to_wire() for ps, d in PLACEMENT.shard_defs() if ps == 0]
        svc(request("create_shards", {"shards": defs}))
        temp = CheckpointRoot(tmp_path).new_temp(5)
        save = request("checkpoint_save", {"name": temp.name, "id": 7})
        first = svc(save).body  # type: ignore[union-attr]
        shard = next(iter(svc.store))
        svc.store.apply_dense(
            shard.definition.id, [(0, np.ones(shard.definition.size, np.float32))], 0
        )
        again = svc(save).body  # type: ignore[union-attr]
        assert again["versions"] == first["versions"]
        assert len(await svc.checkpoints.done(7, 5.0)) == len(defs)

    asyncio.run(asyncio.wait_for(body(), 10.0))


def test_snapshots_being_written_are_bounded(tmp_path: Path) -> None:
    """Each save holds a copy of every shard until written: past ``MAX_WRITING`` at
    once, one more is refused (busy, nothing copied), and taken once a write ends.
    (A client sending saves of new ids grew a PS by 1.9 GiB in 30 saves.)"""
    from zmqps.roles.ps.checkpoints import MAX_WRITING

    async def body() -> None:
        svc = PSService(0, checkpoint_dir=tmp_path)
        defs = [d.to_wire() for ps, d in PLACEMENT.shard_defs() if ps == 0]
        svc(request("create_shards", {"shards": defs}))
        root = CheckpointRoot(tmp_path)
        names = [root.new_temp(i).name for i in range(1, MAX_WRITING + 2)]
        for i, name in enumerate(names[:MAX_WRITING]):
            svc(request("checkpoint_save", {"name": name, "id": i}))
        with pytest.raises(Busy, match="still being written"):
            svc(request("checkpoint_save", {"name": names[-1], "id": 99}))
        assert 99 not in svc.checkpoints._saves  # nothing copied
        for i in range(MAX_WRITING):
            await svc.checkpoints.done(i, 5.0)
        await asyncio.sleep(0)  # the writes' done callbacks
        svc(request("checkpoint_save", {"name": names[-1], "id": 99}))
        assert len(await svc.checkpoints.done(99, 5.0)) == len(defs)

    asyncio.run(asyncio.wait_for(body(), 10.0))
