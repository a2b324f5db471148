"""The same-host fast path: dense tensors through shared memory, same results as TCP."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from test_ps_client import (  # the in-memory cluster of the protocol tests
    ALL,
    DENSE,
    LAYOUTS,
    LR,
    DoublePush,
    Recorder,
    grads_for,
    initial,
    make_cluster,
    run,
)

from zmqps.roles.client import ParameterClient
from zmqps.roles.ps import PSService
from zmqps.transport import shm
from zmqps.wire import request
from zmqps.wire.errors import InvalidArgument, NotFound


def shm_files() -> set[str]:
    """This process's regions in /dev/shm (named after the pid that made them): tests
    in other processes of the run (pytest -n) make and unlink theirs meanwhile."""
    mine = f"zmqps-{os.getpid() & 0xFFFFFFFF:08x}"
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(mine)}


@pytest.mark.parametrize(("num_ps", "num_shards"), LAYOUTS)
def test_fast_path_gives_the_same_results_as_tcp(num_ps: int, num_shards: int) -> None:
    async def body() -> None:
        fast_c = await make_cluster(ALL, num_ps, num_shards)
        tcp_c = await make_cluster(ALL, num_ps, num_shards)
        fast = fast_c.client(shared_memory=True)
        tcp = tcp_c.client(shared_memory=False)
        for client in (fast, tcp):
            params = await client.pull()
            for v in DENSE:
                np.testing.assert_array_equal(params[v.name], initial(v))
        assert {fast.transport_of(i) for i in range(num_ps)} == {"shm"}
        assert {tcp.transport_of(i) for i in range(num_ps)} == {"tcp"}
        for step in range(3):
            g = grads_for(DENSE, seed=step)
            await fast.push(g, pull=step % 2 == 0)
            await tcp.push(g, pull=step % 2 == 0)
            assert fast.versions == tcp.versions
            for v in DENSE:
                np.testing.assert_array_equal(fast.params[v.name], tcp.params[v.name])
        await fast.pull()
        await tcp.pull()
        for v in DENSE:
            np.testing.assert_array_equal(fast.params[v.name], tcp.params[v.name])
            np.testing.assert_array_equal(fast_c.shard_values(v.name), tcp_c.shard_values(v.name))
        await fast.close()

    run(body())


def test_fast_path_moves_no_tensor_frames_and_leaves_no_files() -> None:
    async def body() -> None:
        before = shm_files()
        c = await make_cluster(ALL, 2, 3)
        client = c.client(shared_memory=True, wrap=Recorder)
        await client.pull()
        g = grads_for(DENSE, seed=1)
        await client.push(g, pull=True)
        dense_ops = [
            (op, len(tensors))
            for rec in client.ps
            for op, _body, tensors in getattr(rec, "sent", [])
            if op in ("pull", "push", "push_pull")
        ]
        assert dense_ops and all(n == 0 for _, n in dense_ops)  # control messages only
        replies = [rep for rec in client.ps for rep in getattr(rec, "replies", [])]
        assert all(not rep.tensors for rep in replies)
        for v in DENSE:
            np.testing.assert_array_equal(
                client.params[v.name], initial(v) - np.float32(LR) * g[v.name].astype(v.dtype)
            )
        assert shm_files() == before  # names are unlinked once both sides map them
        await client.close()
        assert all(not svc.regions for svc in c.services)

    run(body())


def _resent(client: ParameterClient, fp: Any, sids: list[int], *, pull: bool) -> dict[str, Any]:
    """The body of worker w0's last shared-memory push to PS 0, as a resend carries it."""
    body = {
        "shards": sids,
        "versions": [0] * len(sids),
        "worker": "w0",
        "inc": 0,
        "seq": client._seq[0],
        "shm": fp.ref(False, sids).to_wire(),
    }
    if pull:
        body["shm_out"] = fp.ref(True, sids).to_wire()
    return body


def test_retried_push_through_shared_memory_is_applied_once() -> None:
    async def body() -> None:
        c = await make_cluster(DENSE, 1, 2)
        client = c.client(shared_memory=True)
        await client.pull()
        fp = await client._fast_path(0)
        assert fp is not None
        g = grads_for(DENSE, seed=3)
        await client.push(g)
        # resend the very same push message (same worker, incarnation, seq) to the PS
        sids = sorted(fp.offsets)
        rep = c.services[0](request("push", _resent(client, fp, sids, pull=False), id=99))
        assert rep.body["applied"] is False
        assert all(c.services[0].store.get(s).version == 1 for s in sids)

    run(body())


def test_a_resent_push_pull_leaves_the_region_the_worker_computes_on_alone() -> None:
    """The worker got the first reply and computes on the pull region (its params are
    views of it); the resend of the same push_pull reaches the PS later, after another
    worker moved the values: the region is not rewritten, the values come in the reply."""

    async def body() -> None:
        c = await make_cluster(DENSE, 1, 1)  # every variable whole: params are region views
        client = c.client(shared_memory=True)
        other = c.client("w1", shared_memory=False)
        await client.pull()
        await other.pull()
        fp = await client._fast_path(0)
        assert fp is not None
        g = grads_for(DENSE, seed=4)
        await client.push(g, pull=True)
        held = {v.name: client.params[v.name].copy() for v in DENSE}
        await other.push(grads_for(DENSE, seed=5))  # the PS moves on
        sids = sorted(fp.offsets)
        rep = c.services[0](request("push_pull", _resent(client, fp, sids, pull=True), id=99))
        assert rep.body["applied"] is False and rep.body["duplicate"] is True
        for v in DENSE:  # the worker's values did not move under it
            np.testing.assert_array_equal(client.params[v.name], held[v.name])
        got = {t.ref: t.array.reshape(-1) for t in rep.tensors}
        assert sorted(got) == sids and rep.body["versions"] == [2] * len(sids)
        for sid in sids:
            np.testing.assert_array_equal(got[sid], c.services[0].store.get(sid).values.reshape(-1))

    run(body())


def test_a_resent_shared_memory_pull_leaves_the_region_alone() -> None:
    """A pull sent again with its id (its connection came back after the PS was stopped
    past the heartbeat timeout): the worker may already compute on the region the first
    copy filled, so the copy's values come in the reply and the region stays."""

    async def body() -> None:
        c = await make_cluster(DENSE, 1, 1)  # every variable whole: params are region views
        client = c.client(shared_memory=True)
        other = c.client("w1", shared_memory=False)
        await client.pull()
        await other.pull()
        fp = await client._fast_path(0)
        assert fp is not None
        sids = sorted(fp.offsets)
        pull = {"shards": sids, "shm_out": fp.ref(True, sids).to_wire(), "gen": 0}
        first = c.services[0](request("pull", pull, id=41, sender="w0"))
        assert first.tensors == ()  # into the region
        held = {v.name: client.params[v.name].copy() for v in DENSE}
        await other.push(grads_for(DENSE, seed=5))  # the PS moves on
        again = c.services[0](request("pull", pull, id=41, sender="w0"))
        for v in DENSE:  # the worker's values did not move under it
            np.testing.assert_array_equal(client.params[v.name], held[v.name])
        got = {t.ref: t.array.reshape(-1) for t in again.tensors}
        assert sorted(got) == sids
        for sid in sids:
            np.testing.assert_array_equal(got[sid], c.services[0].store.get(sid).values.reshape(-1))
        # another request id: into the region again
        assert c.services[0](request("pull", pull, id=42, sender="w0")).tensors == ()

    run(body())


def test_a_worker_whose_first_push_pull_reply_was_lost_takes_the_resend_values() -> None:
    """Every push_pull sent twice, the second reply kept: the first (lost) reply wrote
    the region, the second carries the values; the worker ends where TCP ends."""

    async def body() -> None:
        fast_c = await make_cluster(DENSE, 2, 2)
        tcp_c = await make_cluster(DENSE, 2, 2)
        fast = fast_c.client(shared_memory=True, wrap=DoublePush)
        tcp = tcp_c.client(shared_memory=False)
        await fast.pull()
        await tcp.pull()
        for step in range(3):
            g = grads_for(DENSE, seed=10 + step)
            assert await fast.push(g, pull=True) is False  # the duplicate says so
            await tcp.push(g, pull=True)
            assert fast.versions == tcp.versions
            for v in DENSE:
                np.testing.assert_array_equal(fast.params[v.name], tcp.params[v.name])
        replies = [r for rec in fast.ps for r in getattr(rec, "replies", [])]
        assert any(r.tensors for r in replies)  # the resends' values came by TCP
        await fast.close()

    run(body())


def test_falls_back_to_tcp_when_the_ps_cannot_map_the_region() -> None:
    class RemotePS(PSService):
        def _op_shm_attach(self, msg: Any, req: Any) -> Any:
            raise NotFound("shm region not visible here")

    async def body() -> None:
        c = await make_cluster(DENSE, 1, 2)
        c.net.serve("ps0", RemotePS(0), name="ps0")  # a PS on "another host"
        svc = c.net._dispatcher("ps0").handler
        for _ps, d in c.placement.shard_defs():
            svc.store.create([d])
        client = c.client(shared_memory=True)
        params = await client.pull()
        assert client.transport_of(0) == "tcp"
        for v in DENSE:
            np.testing.assert_array_equal(params[v.name], initial(v))

    run(body())


def test_a_ps_that_no_longer_knows_the_workers_regions_is_sent_to_again_and_reattached() -> None:
    """The process serving a PS state forgot this worker's shared memory (it restarted
    and the state came back to it, or moved away and back, between two requests): the
    request is refused before anything changes, sent again by TCP, applied once, and
    the next one attaches shared memory afresh."""

    async def body() -> None:
        c = await make_cluster(DENSE, 1, 2)
        client = c.client(shared_memory=True)
        await client.pull()
        assert client.transport_of(0) == "shm"
        svc = c.services[0]
        svc.regions.close()  # as a new process would be: no region attached
        g = grads_for(DENSE, seed=3)
        await client.push(g)
        assert all(svc.store.get(s).version == 1 for s in svc.store.ids())  # once
        params = await client.pull()
        assert client.transport_of(0) == "shm"  # attached again
        for v in DENSE:
            want = initial(v) - np.float32(LR) * g[v.name]
            np.testing.assert_allclose(params[v.name], want, rtol=1e-6)

    run(body())


def _attach_body(region: shm.Region, **over: Any) -> dict[str, Any]:
    return {"name": region.name, "size": region.size, "worker": "w", "inc": 0, **over}


def _shm_push(shard: int, worker: str, rid: int, offset: int) -> dict[str, Any]:
    """A first push of ``shard`` by ``worker`` through region ``rid`` at ``offset``."""
    return {
        "shards": [shard],
        "versions": [0],
        "worker": worker,
        "inc": 0,
        "seq": 1,
        "shm": {"region": rid, "offsets": [offset]},
    }


def test_ps_refuses_bad_regions_and_bad_offsets() -> None:
    async def body() -> None:
        c = await make_cluster(DENSE, 1, 1)
        svc = c.services[0]
        region = shm.create_region(1024)
        try:
            with pytest.raises(InvalidArgument):
                svc(request("shm_attach", _attach_body(region, name="../etc/passwd")))
            with pytest.raises(InvalidArgument):
                svc(request("shm_attach", _attach_body(region, size=region.size + 4096)))
            with pytest.raises(NotFound):
                svc(request("shm_attach", _attach_body(region, name="zmqps-" + "0" * 32)))
            rep = svc(request("shm_attach", _attach_body(region)))
            assert rep.body["token"] == region.token.hex()
            rid = rep.body["region"]
        finally:
            shm.unlink_region(region)
        w = next(s for s in c.placement.shards if s.var == "w")
        nbytes = 10 * 4 * 4
        bad = [
            {"region": rid, "offsets": [1024 - 8]},  # runs past the end
            {"region": rid, "offsets": [2]},  # misaligned
            {"region": rid + 7, "offsets": [0]},  # not attached
        ]
        for ref in bad:
            with pytest.raises((InvalidArgument, NotFound)):
                svc(request("pull", {"shards": [w.id], "shm_out": ref}))
        b = next(s for s in c.placement.shards if s.var == "b")
        overlapping = {"region": rid, "offsets": [0, nbytes - 4]}
        with pytest.raises(InvalidArgument, match="overlap"):
            svc(request("pull", {"shards": [w.id, b.id], "shm_out": overlapping}))
        before = svc.store.get(w.id).values.copy()
        with pytest.raises(InvalidArgument):
            svc(request("push", _shm_push(w.id, "w", rid, 1024 - 8)))
        np.testing.assert_array_equal(svc.store.get(w.id).values, before)
        assert svc.store.get(w.id).version == 0

    run(body())


def test_a_push_reads_only_a_region_its_own_worker_attached() -> None:
    """Region ids are small integers, one sequence per PS state: an id kept from
    another process, or sent by another worker, may name someone else's region here.
    A push through a region its worker did not attach is refused and changes nothing."""

    async def body() -> None:
        c = await make_cluster(DENSE, 1, 1)
        svc = c.services[0]
        region = shm.create_region(1024)
        try:
            rid = svc(request("shm_attach", _attach_body(region))).body["region"]
        finally:
            shm.unlink_region(region)
        w = next(s for s in c.placement.shards if s.var == "w")
        before = svc.store.get(w.id).values.copy()
        with pytest.raises(NotFound, match="not attached"):
            svc(request("push", _shm_push(w.id, "intruder", rid, 0)))
        np.testing.assert_array_equal(svc.store.get(w.id).values, before)
        assert svc.store.get(w.id).version == 0
        svc(request("push", _shm_push(w.id, "w", rid, 0)))  # its own worker's push is read
        assert svc.store.get(w.id).version == 1

    run(body())


def test_regions_per_worker_are_bounded() -> None:
    async def body() -> None:
        c = await make_cluster(DENSE, 1, 1)
        svc = c.services[0]
        for _ in range(PSService.MAX_REGIONS_PER_WORKER + 3):
            region = shm.create_region(64)
            try:
                svc(request("shm_attach", _attach_body(region)))
            finally:
                shm.unlink_region(region)
                region.close()
        assert len(svc.regions) == PSService.MAX_REGIONS_PER_WORKER

    run(body())


def test_regions_in_all_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from zmqps.roles.ps import regions as regions_module

    monkeypatch.setattr(regions_module, "MAX_REGIONS", 3)

    async def body() -> None:
        c = await make_cluster(DENSE, 1, 1)
        svc = c.services[0]
        for i in range(5):  # a client inventing worker names
            region = shm.create_region(64)
            try:
                if i < 3:
                    svc(request("shm_attach", _attach_body(region, worker=f"w{i}")))
                else:
                    with pytest.raises(InvalidArgument, match="the bound"):
                        svc(request("shm_attach", _attach_body(region, worker=f"w{i}")))
                    # a worker that has regions still renews one
                    svc(request("shm_attach", _attach_body(region, worker="w0")))
            finally:
                shm.unlink_region(region)
                region.close()
        assert len(svc.regions) == 3

    run(body())


def test_a_detach_of_an_id_from_an_earlier_ps_process_leaves_the_new_region() -> None:
    # a worker closes its channel to a PS that restarted meanwhile: the new PS process
    # numbers its regions afresh, and the old id is the worker's new region there
    async def body() -> None:
        c = await make_cluster(DENSE, 1, 1)
        old, new = shm.create_region(64), shm.create_region(64)
        try:
            first = c.services[0](request("shm_attach", _attach_body(old))).body["region"]
            restarted = PSService(0)
            rid = restarted(request("shm_attach", _attach_body(new))).body["region"]
            assert rid == first
            restarted(request("shm_detach", {"region": rid, "name": old.name}))
            assert rid in restarted.regions  # not that region: left alone
            restarted(request("shm_detach", {"region": rid, "name": new.name}))
            assert rid not in restarted.regions
            c.services[0](request("shm_detach", {"region": first}))  # no name: as before
            assert first not in c.services[0].regions
        finally:
            for r in (old, new):
                shm.unlink_region(r)
                r.close()

    run(body())


def test_attaching_again_is_idempotent() -> None:
    """shm_attach is sent again when its connection comes back (the first copy may have
    arrived): the same worker attaching the same region again gets the same id, and
    maps nothing more."""

    async def body() -> None:
        c = await make_cluster(DENSE, 1, 1)
        svc = c.services[0]
        region = shm.create_region(1024)
        try:
            first = svc(request("shm_attach", _attach_body(region))).body
            again = svc(request("shm_attach", _attach_body(region))).body
            assert again == first
            assert len(svc.regions) == 1
            other = svc(request("shm_attach", _attach_body(region, worker="w2"))).body
            assert other["region"] != first["region"]
            assert len(svc.regions) == 2
            svc(request("shm_detach", {"region": first["region"]}))
            renewed = svc(request("shm_attach", _attach_body(region))).body
            assert renewed["region"] not in (first["region"], other["region"])
        finally:
            shm.unlink_region(region)
            region.close()

    run(body())


def test_client_without_dense_shards_on_a_ps_uses_no_region() -> None:
    async def body() -> None:
        c = await make_cluster(ALL, 2, 1)
        client = ParameterClient(
            [c.net.client(f"ps{i}", "w:0") for i in range(2)],
            c.placement,
            worker="w",
            incarnation=0,
        )
        await client.pull()
        for ps in range(2):
            has_dense = any(s.ps == ps and s.var != "emb" for s in c.placement.shards)
            assert client.transport_of(ps) == ("shm" if has_dense else "tcp")

    run(body())


def test_params_of_variables_held_whole_are_views_of_the_pull_region() -> None:
    async def body() -> None:
        c = await make_cluster(ALL, 2, 2)  # each variable split in 2 shards, round robin on 2 PS
        one_ps = await make_cluster(ALL, 1, 3)  # every variable whole on PS 0
        for cluster, whole in ((c, False), (one_ps, True)):
            client = cluster.client(shared_memory=True)
            await client.pull()
            fp = await client._fast_path(0)
            assert fp is not None
            region = np.frombuffer(fp.regions.pull._mmap, np.uint8)
            for v in DENSE:
                assert np.shares_memory(client.params[v.name], region) is whole
                np.testing.assert_array_equal(client.params[v.name], initial(v))
            g = grads_for(DENSE, seed=5)
            await client.push(g, pull=True)
            for v in DENSE:
                np.testing.assert_array_equal(
                    client.params[v.name], initial(v) - np.float32(LR) * g[v.name].astype(v.dtype)
                )

    run(body())


def test_sweep_removes_the_regions_of_dead_processes_only(tmp_path: Any) -> None:
    """A worker killed between creating its regions and unlinking them leaves names
    behind; the next worker (or zmqps launch) removes those, never a live one's."""
    import os

    dead = 0x7FFFFF00  # above any pid_max: no such process
    mine = tmp_path / f"zmqps-{os.getpid():08x}{'a' * 24}"
    gone = tmp_path / f"zmqps-{dead:08x}{'b' * 24}"
    other = tmp_path / "zmqps-not-a-region"
    for path in (mine, gone, other):
        path.write_bytes(b"x")
    assert shm.sweep(str(tmp_path)) == [gone.name]
    assert mine.exists() and other.exists() and not gone.exists()
