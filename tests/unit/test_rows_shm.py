"""Rows through shared memory on one host: the rows of a row push and of a row pull's
reply travel in the regions a worker attached, the ids in the message.

Against a client that sends them by TCP, byte for byte (fixed-size and hash-keyed
tables, repeated ids, several shards on several PS): the rows read, every shard's
values, slots and version. A request whose rows do not fit the region's room goes by
TCP; a hostile message naming places outside its region, misaligned, overlapping, or
in another worker's region is refused and changes nothing; a replicated state's
backups get a region push's rows."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from test_ps_client import ALL, Recorder, make_cluster, recorders, run
from test_ps_recovery import created_cluster
from test_push_pull_rows import (
    batches,
    one_request,
    replicated_rows,
    shard_state,
    two_requests,
)

from zmqps.core.partition import Partitioner, plan
from zmqps.core.variables import VariableDef
from zmqps.roles.client import ParameterClient
from zmqps.roles.ps.service import PSService
from zmqps.transport import shm
from zmqps.wire import Tensor, request
from zmqps.wire.errors import InvalidArgument, NotFound

ADAM = {"name": "adam", "lr": 0.05}
SGD = {"name": "sgd", "lr": 0.1}
ROW_OPS = ("pull_rows", "push_rows", "push_pull_rows")


def shm_client(c: Any, *, room: int | None = None) -> ParameterClient:
    client = c.client("w0", wrap=Recorder, shared_memory=True)
    if room is not None:
        client.row_region_bytes = room
    return client


def row_frames(client: ParameterClient) -> tuple[int, int]:
    """Row requests sent so far, and those of them (or of their replies) that carried rows."""
    sent = with_rows = 0
    for r in recorders(client):
        for (op, _, tensors), rep in zip(r.sent, r.replies, strict=False):
            if op in ROW_OPS:
                sent += 1
                with_rows += any(t.kind == "rows" for t in tensors) or bool(rep.tensors)
    return sent, with_rows


async def warm(client: ParameterClient, name: str, ids: np.ndarray) -> None:
    """Two pulls (the first reply says the PS takes rows in shared memory, the next
    request sets the regions up in the background), then what was recorded forgotten."""
    await client.pull_rows(name, ids)
    await client.pull_rows(name, ids)
    for _ in range(100):
        if not client._attaching:
            break
        await asyncio.sleep(0.01)
    for r in client.ps:
        if isinstance(r, Recorder):
            r.sent.clear()
            r.replies.clear()


def hashed_batches(rng: np.random.Generator, size: int, repeated: int) -> list[np.ndarray]:
    """Ten batches of any int64 ids for a hash-keyed table: id 7 ``repeated`` times in
    each, and ids new to the table."""
    seq = []
    for k in range(10):
        ids = rng.integers(-(2**62), 2**62, size)
        ids[:repeated] = 7
        ids[repeated] = k
        seq.append(ids.astype(np.int64))
    return seq


@pytest.mark.parametrize("num_ps,num_shards", [(1, 1), (2, 3), (3, 7)])
@pytest.mark.parametrize("optimizer", [SGD, ADAM], ids=["sgd", "adam"])
@pytest.mark.parametrize("one", [False, True], ids=["two", "one"])
def test_rows_through_the_region_equal_rows_over_tcp(
    num_ps: int, num_shards: int, optimizer: Any, one: bool
) -> None:
    async def body() -> None:
        rng = np.random.default_rng(num_ps + num_shards)
        seq = batches(rng, 23, 12, 10)
        grads = [rng.standard_normal((ids.size, 3)).astype(np.float32) for ids in seq]
        a = await make_cluster(ALL, num_ps, num_shards, optimizer=optimizer)
        b = await make_cluster(ALL, num_ps, num_shards, optimizer=optimizer)
        tcp, fast = a.client(), shm_client(b)
        await warm(fast, "emb", seq[0])
        await warm(tcp, "emb", seq[0])
        steps = one_request if one else two_requests
        want = await steps(tcp, "emb", seq, grads)
        got = await steps(fast, "emb", seq, grads)
        for w, g in zip(want, got, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w)
        assert shard_state(b.services) == shard_state(a.services)
        assert fast.versions == tcp.versions
        sent, with_rows = row_frames(fast)
        assert sent >= 8 and with_rows == 0
        await fast.close()

    run(body(), 20.0)


@pytest.mark.parametrize("budget", [None, 6])
def test_a_hash_keyed_table_through_the_region(budget: int | None) -> None:
    table: dict[str, Any] = {} if budget is None else {"row_budget": budget}
    emb = VariableDef("h", (64, 2), optimizer=ADAM, table=table)
    placement = plan([emb], 3, Partitioner(num_shards=5), optimizer=SGD)

    async def body() -> None:
        rng = np.random.default_rng(5)
        seq = hashed_batches(rng, 7, 2)
        grads = [rng.standard_normal((ids.size, 2)).astype(np.float32) for ids in seq]
        a = await created_cluster(placement, 3, None)
        b = await created_cluster(placement, 3, None)
        tcp = a.client("w0")
        fast = shm_client(b)
        await warm(fast, "h", seq[0])
        await warm(tcp, "h", seq[0])
        want = await one_request(tcp, "h", seq, grads)
        got = await one_request(fast, "h", seq, grads)
        want += await two_requests(tcp, "h", seq, grads)
        got += await two_requests(fast, "h", seq, grads)
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(g, w)
        assert shard_state(b.services) == shard_state(a.services)
        assert fast.rows_shm == {0, 1, 2}
        sent, with_rows = row_frames(fast)
        assert sent >= 8 and with_rows == 0
        await fast.close()

    run(body(), 20.0)


def test_rows_that_do_not_fit_the_room_go_by_tcp() -> None:
    async def body() -> None:
        rng = np.random.default_rng(3)
        seq = batches(rng, 23, 12, 6)
        grads = [rng.standard_normal((ids.size, 3)).astype(np.float32) for ids in seq]
        a = await make_cluster(ALL, 1, 2)
        b = await make_cluster(ALL, 1, 2)
        tcp, small = a.client(), shm_client(b, room=64)  # 64 bytes: at most 5 rows of 3
        await warm(small, "emb", seq[0])
        await warm(tcp, "emb", seq[0])
        assert small._channels[0] is not None and small.transport_of(0) == "shm"
        want = await one_request(tcp, "emb", seq, grads)
        got = await one_request(small, "emb", seq, grads)
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(g, w)
        assert shard_state(b.services) == shard_state(a.services)
        sent, with_rows = row_frames(small)
        assert 0 < with_rows < sent  # the large ones by TCP
        await small.close()

    run(body(), 20.0)


@pytest.mark.parametrize("num_ps,num_shards", [(1, 1), (1, 4), (2, 3)])
@pytest.mark.parametrize("room", [None, 64], ids=["room", "small"])
def test_rows_summed_as_they_are_sent_equal_rows_summed_first(
    num_ps: int, num_shards: int, room: int | None
) -> None:
    """A push made ``later`` (what ``Worker.push_pull_rows`` sends: its caller waits) is
    summed into the push region as it is sent, and the pulled rows gathered straight
    from the pull region when one PS holds them all: byte for byte what a push summed
    first and rows copied out of the region give, over TCP too (a small room)."""

    async def body() -> None:
        rng = np.random.default_rng(num_ps * 10 + num_shards)
        seq = batches(rng, 23, 12, 10)
        grads = [rng.standard_normal((ids.size, 3)).astype(np.float32) for ids in seq]
        a = await make_cluster(ALL, num_ps, num_shards, optimizer=ADAM)
        b = await make_cluster(ALL, num_ps, num_shards, optimizer=ADAM)
        first, later = shm_client(a, room=room), shm_client(b, room=room)
        await warm(first, "emb", seq[0])
        await warm(later, "emb", seq[0])
        want = await one_request(first, "emb", seq, grads)
        got = [await later.pull_rows("emb", seq[0])]
        in_region = 0
        for k in range(1, len(seq)):
            g = grads[k - 1].copy()
            rows = later.rows_push("emb", seq[k - 1], g, later=True)
            assert rows.summed_rows is None and rows.grads is g  # not summed, not copied
            applied, pulled = await later.send_pull_rows(rows, seq[k])
            assert applied
            in_region += rows.summed_rows is None  # summed in the region, never apart
            got.append(pulled)
        for w, x in zip(want, got, strict=True):
            assert x.dtype == w.dtype and x.shape == w.shape
            np.testing.assert_array_equal(x, w)
        assert shard_state(b.services) == shard_state(a.services)
        assert later.versions == first.versions
        if room is None and num_ps == num_shards == 1:  # one part: the rows back to back
            assert in_region == len(seq) - 1  # (an empty batch's: nothing to sum)
        await first.close()
        await later.close()

    run(body(), 20.0)


@pytest.mark.parametrize("budget", [None, 6])
def test_a_hash_keyed_tables_rows_summed_as_they_are_sent(budget: int | None) -> None:
    """The same for a hash-keyed table, one PS, three shards: rows of 16 float32 (64
    bytes, the room's alignment) lie back to back, so every push is summed into the
    region and every pull gathered out of it, ids new to the table and evicted too."""
    table: dict[str, Any] = {} if budget is None else {"row_budget": budget}
    emb = VariableDef("h", (64, 16), optimizer=ADAM, table=table)
    placement = plan([emb], 1, Partitioner(num_shards=3), optimizer=SGD)

    async def body() -> None:
        rng = np.random.default_rng(9)
        seq = hashed_batches(rng, 9, 3)
        grads = [rng.standard_normal((ids.size, 16)).astype(np.float32) for ids in seq]
        a = await created_cluster(placement, 1, None)
        b = await created_cluster(placement, 1, None)
        first, later = shm_client(a), shm_client(b)
        await warm(first, "h", seq[0])
        await warm(later, "h", seq[0])
        want = await one_request(first, "h", seq, grads)
        got = [await later.pull_rows("h", seq[0])]
        copied: list[bool] = []  # how each reply's rows were taken
        take = later._take_rows

        def spy(*args: Any, copy: bool = True, **kwargs: Any) -> None:
            copied.append(copy)
            take(*args, copy=copy, **kwargs)

        later._take_rows = spy  # type: ignore[method-assign]
        in_region = 0
        for k in range(1, len(seq)):
            rows = later.rows_push("h", seq[k - 1], grads[k - 1], later=True)
            applied, pulled = await later.send_pull_rows(rows, seq[k])
            assert applied
            in_region += rows.summed_rows is None
            got.append(pulled)
        for w, x in zip(want, got, strict=True):
            np.testing.assert_array_equal(x, w)
        assert shard_state(b.services) == shard_state(a.services)
        assert in_region == len(seq) - 1
        assert copied == [False] * (len(seq) - 1)  # gathered out of the region
        sent, with_rows = row_frames(later)
        assert sent >= 9 and with_rows == 0
        await first.close()
        await later.close()

    run(body(), 20.0)


def _attach(svc: Any, worker: str, data_bytes: int = 1024) -> tuple[int, shm.Region]:
    region = shm.create_region(data_bytes)
    try:
        body = {"name": region.name, "size": region.size, "worker": worker, "inc": 0}
        rid = svc(request("shm_attach", body)).body["region"]
    finally:
        shm.unlink_region(region)
    return rid, region


def test_hostile_row_places_are_refused_and_change_nothing() -> None:
    async def body() -> None:
        c = await make_cluster(ALL, 1, 2)
        svc = c.services[0]
        rid, region = _attach(svc, "w")
        other, _ = _attach(svc, "intruder")
        shards = [s for s in c.placement.shards if s.var == "emb"]
        ids = [np.array([0, 1], np.int64), np.array([22], np.int64)]
        ids[0] += shards[0].row_start
        ids[1] = np.array([shards[1].row_start], np.int64)
        sids = [s.id for s in shards]
        region.view(0, np.dtype(np.float32), 256)[...] = 1.0
        index = [Tensor(i, "index", sid) for sid, i in zip(sids, ids, strict=True)]

        def push(ref: dict[str, Any], op: str = "push_rows", **more: Any) -> Any:
            body = {
                "shards": sids,
                "versions": [0, 0],
                "worker": "w",
                "inc": 0,
                "seq": 1,
                "shm": ref,
                **more,
            }
            tensors = list(index) + (list(index) if op == "push_pull_rows" else [])
            return svc(request(op, body, tensors))

        before = shard_state([svc])
        bad = [
            {"region": rid, "offsets": [0, 1024 - 8]},  # runs past the end
            {"region": rid, "offsets": [0, 2**40]},  # far outside
            {"region": rid, "offsets": [2, 64]},  # misaligned
            {"region": rid, "offsets": [0, 12]},  # overlapping
            {"region": rid, "offsets": [0]},  # one offset short
            {"region": rid + 9, "offsets": [0, 64]},  # not attached
            {"region": other, "offsets": [0, 64]},  # another worker's region
        ]
        for ref in bad:
            with pytest.raises((InvalidArgument, NotFound)):
                push(ref)
            with pytest.raises((InvalidArgument, NotFound)):
                push(ref, "push_pull_rows", pull=sids)
            # a pull's places: the push is refused with it
            good = {"region": rid, "offsets": [0, 64]}
            with pytest.raises((InvalidArgument, NotFound)):
                push(good, "push_pull_rows", pull=sids, shm_out=ref)
            if ref["region"] != other:  # a pull names no worker
                with pytest.raises((InvalidArgument, NotFound)):
                    svc(request("pull_rows", {"shards": sids, "shm_out": ref}, index))
            assert shard_state([svc]) == before
        with pytest.raises(InvalidArgument, match="overlap"):
            push({"region": rid, "offsets": [0, 12]})
        with pytest.raises(InvalidArgument, match="outside"):
            push({"region": rid, "offsets": [0, 1024 - 8]})
        with pytest.raises(InvalidArgument, match="push_pull_rows"):  # a pull region alone
            push({"region": rid, "offsets": [0, 64]}, shm_out={"region": rid, "offsets": [0, 64]})
        assert shard_state([svc]) == before
        # non-finite rows in the region: refused, nothing applied
        region.view(64, np.dtype(np.float32), 3)[1] = np.nan
        with pytest.raises(Exception, match="gradient element"):
            push({"region": rid, "offsets": [0, 64]})
        assert [svc.store.get(s).version for s in sids] == [0, 0]
        region.view(64, np.dtype(np.float32), 3)[1] = 1.0
        # the same message with good places is read
        rep = push({"region": rid, "offsets": [0, 64]}, seq=2)
        assert rep.body["applied"]
        want = c.services[0].store.get(sids[1]).values[0]
        got = svc(
            request(
                "pull_rows",
                {"shards": sids, "shm_out": {"region": rid, "offsets": [128, 256]}},
                index,
            )
        )
        assert not got.tensors
        np.testing.assert_array_equal(region.view(256, np.dtype(np.float32), 3), want)

    run(body())


def test_a_replicated_states_backups_get_rows_pushed_through_the_region(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pushes and pulls through the regions of a replicated state's primary: its
    backups apply the same entries (a hash table's pulls that create rows too) and stay
    equal to it, and never touch a region (the region ids a backup's process knows are
    other regions: an entry naming the worker's would write its rows into them)."""
    touched: list[Any] = []
    rows_out = PSService._rows_out

    def recorded(self: PSService, msg: Any, sids: Any, ids: Any, ref: Any, *a: Any) -> Any:
        if ref is not None:
            touched.append(self)
        return rows_out(self, msg, sids, ids, ref, *a)

    monkeypatch.setattr(PSService, "_rows_out", recorded)

    async def body() -> None:
        c, w, rng, ids, width = await replicated_rows(4)
        for name in ids:
            await warm(w, name, ids[name])
        for k in range(6):
            for name in ids:
                g = rng.standard_normal((ids[name].size, width[name])).astype(np.float32)
                if k % 2:
                    assert await w.push_rows(name, ids[name], g)
                else:
                    # the hash table's next ids are new: the pull creates their rows on
                    # every copy (an entry, whose reply is not in the worker's region)
                    after = ids[name] if name == "e" else ids[name] + k + 1
                    applied, _ = await w.push_pull_rows(name, ids[name], g, after)
                    assert applied
                    ids[name] = after
                assert c.check_copies() > 0
            fresh = rng.integers(-(2**40), 2**40, 4)  # a pull alone that creates rows
            await w.pull_rows("t", fresh)
            assert c.check_copies() > 0
        assert w.rows_shm
        pushed = [
            (op, b)
            for r in w.ps
            for op, b, _ in r.sent  # type: ignore[attr-defined]
            if op in ("push_rows", "push_pull_rows")
        ]
        assert sum("shm" in b for _, b in pushed) >= len(pushed) // 2
        assert c.shipped["push_rows"][1] > 0  # the rows shipped as tensors
        assert c.shipped["pull_rows"][0] > 0  # the hash table's pulls are entries
        primaries = [c.copy(i, i) for i in range(3)]
        assert touched and all(any(t is p for p in primaries) for t in touched)
        await w.close()

    run(body(), 30.0)
