"""What one request may cost a PS is bounded, whatever it names: row requests carry
at most MAX_ROWS ids and MAX_ROW_VALUES values (clients split larger pulls), a pull
names each shard once, a refused request changes nothing (a multi-shard pull_rows
creates no row when a later shard's ids are refused), and create_shards refuses what
cannot be allocated with a typed error, not an internal one."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
from test_ps_client import run
from test_ps_recovery import chief, created_cluster

import zmqps.roles.client as client_module
import zmqps.roles.ps.service as service_module
from zmqps.core.hashtable import bucket_of, initial_rows
from zmqps.core.partition import Partitioner, plan
from zmqps.core.variables import Placement, VariableDef
from zmqps.wire import Tensor
from zmqps.wire.errors import InvalidArgument, ZmqpsError

TABLE = VariableDef(
    "t", (64, 8), init={"name": "normal", "stddev": 0.1, "seed": 5}, table={"row_budget": 10_000}
)
ROWS = VariableDef("r", (40, 8), init={"name": "uniform", "seed": 2}, sparse=True)
DENSE = VariableDef("d", (6, 4), init={"name": "ones"})


def placement() -> Placement:
    return plan(
        [TABLE, ROWS, DENSE], 1, Partitioner(num_shards=2), optimizer={"name": "sgd", "lr": 0.5}
    )


def _shard(p: Placement, var: str, k: int = 0) -> Any:
    return p.shards_of(var)[k]


def _table_ids(p: Placement, shard: Any, n: int, start: int = 0) -> np.ndarray:
    """``n`` distinct ids that hash into ``shard``'s buckets."""
    ids = np.arange(start, start + 40 * n, dtype=np.int64)
    b = bucket_of(ids, TABLE.shape[0])
    mine = ids[(b >= shard.row_start) & (b < shard.row_start + shard.rows)]
    assert mine.size >= n
    return mine[:n]


def _rows_held(c: Any, var: str) -> int:
    return sum(s.rows for s in c.services[0].store.tables() if s.definition.var == var)


def test_row_requests_past_the_bounds_are_refused_and_change_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(service_module, "MAX_ROWS", 100)
    monkeypatch.setattr(service_module, "MAX_ROW_VALUES", 400)  # 50 rows of 8

    async def body() -> None:
        p = placement()
        c = await created_cluster(p, 1, None)
        req = chief(c, 0)
        t0, t1 = _shard(p, "t", 0), _shard(p, "t", 1)
        ok = _table_ids(p, t0, 30)
        await req.request("pull_rows", {"shards": [t0.id]}, [Tensor(ok, "index", t0.id)])
        held = _rows_held(c, "t")
        assert held == 30
        # 30 + 30 rows of 8 values over two shards: 480 values > 400
        more = _table_ids(p, t0, 30, start=10_000)
        other = _table_ids(p, t1, 30)
        for create in (None, False):
            body: dict[str, Any] = {"shards": [t0.id, t1.id]}
            if create is not None:
                body["create"] = create
            with pytest.raises(InvalidArgument, match="at most 100 ids and 400 values"):
                await req.request(
                    "pull_rows", body, [Tensor(more, "index", t0.id), Tensor(other, "index", t1.id)]
                )
        assert _rows_held(c, "t") == held
        # a fixed-size variable: duplicates make a small request a large reply
        r0 = _shard(p, "r")
        dup = np.full(51, r0.row_start, np.int64)
        with pytest.raises(InvalidArgument, match="51 row ids, 408 values"):
            await req.request("pull_rows", {"shards": [r0.id]}, [Tensor(dup, "index", r0.id)])
        # a push of too many rows is refused before anything changes, and counted
        before = c.services[0].store.get(r0.id).values.copy()
        grads = np.ones((51, 8), np.float32)
        body = {"shards": [r0.id], "versions": [0], "worker": "w0", "inc": 0, "seq": 1}
        with pytest.raises(InvalidArgument, match="push_rows: 51 row ids"):
            await c.net.client("ps0", "w0:0").request(
                "push_rows", body, [Tensor(dup, "index", r0.id), Tensor(grads, "rows", r0.id)]
            )
        assert np.array_equal(c.services[0].store.get(r0.id).values, before)
        assert c.services[0].status()["dropped"] == {"invalid": 1}

    run(body())


def test_a_refused_multi_shard_pull_rows_creates_no_row() -> None:
    async def body() -> None:
        p = placement()
        c = await created_cluster(p, 1, None)
        t0, t1 = _shard(p, "t", 0), _shard(p, "t", 1)
        mine = _table_ids(p, t0, 5)
        wrong = _table_ids(p, t0, 3, start=50_000)  # routed to the wrong shard
        with pytest.raises(InvalidArgument, match="hashes outside"):
            await chief(c, 0).request(
                "pull_rows",
                {"shards": [t0.id, t1.id]},
                [Tensor(mine, "index", t0.id), Tensor(wrong, "index", t1.id)],
            )
        assert _rows_held(c, "t") == 0
        stats = c.services[0].store.table_stats()
        assert stats.get("t", {}).get("created", 0) == 0

    run(body())


def test_a_pull_names_each_shard_once() -> None:
    async def body() -> None:
        p = placement()
        c = await created_cluster(p, 1, None)
        d = _shard(p, "d")
        with pytest.raises(InvalidArgument, match="appears twice"):
            await chief(c, 0).request("pull", {"shards": [d.id] * 3})

    run(body())


def test_a_client_splits_a_large_pull_and_refuses_a_large_push(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client's pull of more rows than a request may carry is several requests
    with the same answer; a push that large is refused before anything is sent."""
    for module in (service_module, client_module):
        monkeypatch.setattr(module, "MAX_ROW_VALUES", 8 * 16)  # 16 rows of 8

    async def body() -> None:
        p = placement()
        c = await created_cluster(p, 1, None)
        w = c.client("w0")
        ids = np.concatenate([_table_ids(p, s, 20) for s in p.shards_of("t")])
        ids = np.concatenate([ids, ids[:7]])  # duplicates too
        rows = await w.pull_rows("t", ids)
        assert np.array_equal(rows, initial_rows(TABLE.init, "t", ids, 8, "float32"))
        fixed = np.arange(40, dtype=np.int64)[::-1]
        got = await w.pull_rows("r", fixed, create=False)
        want = await c.client("w1").pull_rows("r", fixed[:10])
        assert got.shape == (40, 8) and np.array_equal(got[:10], want)
        sent = c.services[0].status()["pushes"]
        with pytest.raises(InvalidArgument, match="distinct rows for ps 0 in one push"):
            await w.push_rows("t", ids, np.ones((ids.size, 8), np.float32))
        assert c.services[0].status()["pushes"] == sent

    run(body())


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((2**48, 2**48), "float32"), ((2**40,), "float32"), ((2**36,), "float64")],
)
def test_shards_that_cannot_be_allocated_are_refused_typed(
    shape: tuple[int, ...], dtype: str
) -> None:
    big = VariableDef(
        "huge", shape, dtype, init={"name": "zeros"}, optimizer={"name": "adam", "lr": 0.1}
    )

    async def body() -> None:
        p = placement()
        c = await created_cluster(p, 1, None)
        huge = plan([big], 1, Partitioner(num_shards=1), optimizer={"name": "sgd", "lr": 0.1})
        defs = [d.to_wire() for _, d in huge.shard_defs()]
        for d in defs:
            d["id"] = 1000 + d["id"]
        with pytest.raises(InvalidArgument, match="create_shards"):
            await chief(c, 0).request("create_shards", {"shards": defs})
        assert 1000 not in c.services[0].store
        rows = await c.client("w0").pull_rows("r", np.array([1, 2], np.int64))
        assert rows.shape == (2, 8)  # still serving

    run(body())


def test_a_message_that_cannot_be_decoded_is_counted() -> None:
    """A refusal at the codec (a complex tensor, a bad header) is counted in the
    requests metric as op "unknown", status "protocol", like every other refusal."""
    from zmqps.metrics import Metrics
    from zmqps.transport.base import TransportStats
    from zmqps.transport.dispatch import Dispatcher
    from zmqps.wire import encode, request

    metrics = Metrics()
    stats = TransportStats()
    d = Dispatcher(lambda msg: None, name="ps0", stats=stats, observer=metrics)  # type: ignore[arg-type]
    frames = [bytes(f) for f in encode(request("ping", {}, id=7))]
    assert d.dispatch([b"\x00garbage"]) is None
    push = [bytes(f) for f in encode(request("push", {}, [Tensor(np.zeros(4), "grad", 0)], id=8))]
    assert b"\xa7float64" in push[0]
    complex_push = [push[0].replace(b"\xa7float64", b"\xa9complex64"), push[1]]  # same bytes
    for bad in ([b"\x00garbage"], [frames[0], b"\xc1"], complex_push):
        d.dispatch(bad)
    assert stats.bad_messages == 4
    got = metrics.registry.get_sample_value(
        "zmqps_requests_total", {"op": "unknown", "status": "protocol"}
    )
    assert got == 4


def test_a_request_past_its_deadline_is_dropped_counted_and_said_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """5,000 pushes whose deadline had passed (e.g. a worker whose clock is off) used to
    be dropped with no metric and no line: an operator saw nothing."""
    import time

    from zmqps.metrics import Metrics
    from zmqps.transport.base import TransportStats
    from zmqps.transport.dispatch import Dispatcher
    from zmqps.wire import encode, reply, request

    metrics = Metrics()
    stats = TransportStats()
    served: list[str] = []

    def handler(msg: Any) -> Any:
        served.append(msg.op)
        return reply(msg)

    d = Dispatcher(handler, name="ps0", stats=stats, observer=metrics)
    with caplog.at_level(logging.WARNING, "zmqps.transport"):
        for i in range(5000):
            body = {"shards": [0], "versions": [0], "worker": "w", "inc": 1, "seq": i + 1}
            grad = [Tensor(np.full(4, np.nan, np.float32), "grad", 0)]
            msg = request("push", body, grad, id=i, deadline=1.0)
            assert d.dispatch([bytes(memoryview(f)) for f in encode(msg)], peer=b"w") is None
        fresh = request("ping", {}, id=9, deadline=time.time() + 60)
        d.dispatch([bytes(memoryview(f)) for f in encode(fresh)], peer=b"w")
    assert served == ["ping"]  # the handler saw none of the pushes
    assert stats.expired == 5000
    got = metrics.registry.get_sample_value(
        "zmqps_requests_total", {"op": "push", "status": "expired"}
    )
    assert got == 5000
    lines = [r.getMessage() for r in caplog.records if "deadline passed" in r.getMessage()]
    assert len(lines) == 1 and "push from b'w'" in lines[0]


def test_shards_count_against_the_whole_memory_with_what_the_ps_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Zeros are allocated lazily, so what is free now is not enough: shards made
    earlier count against the machine's whole memory."""

    async def body() -> None:
        p = placement()
        c = await created_cluster(p, 1, None)
        held = c.services[0].store.nbytes()
        mib = 1 << 20
        monkeypatch.setattr(service_module, "available_memory", lambda: (64 * mib, held + mib))

        def defs(sid: int, rows: int) -> list[dict[str, Any]]:
            var = VariableDef(f"z{sid}", (rows, 1024), init={"name": "zeros"})
            made = plan([var], 1, Partitioner(num_shards=1), optimizer={"name": "sgd", "lr": 1.0})
            out = [d.to_wire() for _, d in made.shard_defs()]
            out[0]["id"] = sid
            return out

        with pytest.raises(InvalidArgument, match="held by this PS"):
            await chief(c, 0).request("create_shards", {"shards": defs(500, 512)})  # 2 MiB
        await chief(c, 0).request("create_shards", {"shards": defs(501, 128)})  # 0.5 MiB
        assert 501 in c.services[0].store and 500 not in c.services[0].store

    run(body())


def test_a_flood_of_invented_worker_names_is_bounded_and_the_ps_state_stays_readable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client fencing ever-new worker names (the longest the wire takes) is refused,
    typed, at the deduper's bounds; what the PS keeps per name stays bounded, and its
    ``ps_state`` (what a chief reads, keyed by those names) and ``status`` still decode
    through the real codec, so no healthy PS is declared down for it."""
    from test_bad_values import PS, run

    from zmqps.core.dedup import MAX_NAME_CHARS, MAX_WORKERS
    from zmqps.roles.ps.service import STATUS_WORKERS

    async def body() -> None:
        ps = PS(placement())
        await ps.create()
        await ps.net.client("ps0", "chief:0").request("fence", {"worker": "w0", "inc": 0})
        mallory = ps.net.client("ps0", "mallory:0")
        refused = 0
        for i in range(MAX_NAME_CHARS // 60 + 50):  # past the characters' bound
            name = f"{i:08d}".ljust(64, "x")
            try:
                await mallory.request("fence", {"worker": name, "inc": 1, "left": True})
            except InvalidArgument as e:
                assert "characters" in str(e)
                refused += 1
        assert refused > 0 and ps.svc.dedup._chars <= MAX_NAME_CHARS
        for i in range(MAX_WORKERS):  # short names: past the count's bound
            try:
                await mallory.request("fence", {"worker": f"s{i}", "inc": 1, "left": True})
            except InvalidArgument:
                refused += 1
        assert len(ps.svc.dedup) <= MAX_WORKERS and len(ps.svc.pushes) <= len(ps.svc.dedup)
        state = await ps.net.client("ps0", "chief:0").request("ps_state", {})
        assert len(state.body["done"]) == len(ps.svc.pushes)
        status = ps.svc.status()
        assert len(status["pushes"]) == STATUS_WORKERS
        assert status["pushes_cut"]["workers"] == len(ps.svc.pushes)
        # a worker the PS knew before the flood still pushes and is counted
        dense = [s.id for s in ps.placement.shards_of("d")]
        grads = [
            Tensor(np.ones(ps.svc.store.get(s).values.size, np.float32), "grad", s) for s in dense
        ]
        body = {"shards": dense, "versions": [0] * len(dense), "worker": "w0", "inc": 0}
        out = await ps.client.request("push", {**body, "seq": 0}, grads)
        assert out.body["applied"] and ps.svc.pushes.get("w0").applied == 1
        for _ in range(100):  # requests any peer may repeat log a line per interval
            await mallory.request("create_shards", {"shards": []})
            await mallory.request("sync_config", {"mode": "async", "required": 1})

    caplog.set_level(logging.INFO, "zmqps.ps")
    run(body())
    lines = [r.getMessage() for r in caplog.records if r.name == "zmqps.ps"]
    assert len(lines) < 10, lines[:20]


def test_pushes_of_invented_names_refused_before_they_count_leave_no_trace_per_name() -> None:
    """A sync push of a name the PS never kept, for a step ahead of the PS's, is refused
    (rolled back) before it counts: counted by reason, never kept per name, so such
    pushes cannot grow what the PS keeps per worker name."""
    from test_bad_values import PS, run

    async def body() -> None:
        ps = PS(placement())
        await ps.create()
        await ps.net.client("ps0", "chief:0").request(
            "sync_config", {"mode": "sync", "required": 1}
        )
        dense = [s.id for s in ps.placement.shards_of("d")]
        grads = [
            Tensor(np.ones(ps.svc.store.get(s).values.size, np.float32), "grad", s) for s in dense
        ]
        refused = 0
        for i in range(50):
            body = {"shards": dense, "versions": [0] * len(dense), "worker": f"m{i}", "inc": 0}
            try:
                await ps.client.request("push", {**body, "seq": 0, "step": 1000 + i}, grads)
            except ZmqpsError:  # any typed refusal: what matters is what it kept
                refused += 1
        assert refused == 50
        assert len(ps.svc.pushes) == 0 and len(ps.svc.dedup) == 0
        assert sum(ps.svc.dropped.values()) >= 50

    run(body())


def test_a_push_cut_into_many_tiny_chunks_is_refused_before_any_work() -> None:
    """A dense push of 65,536 values in 32,768 chunks of two held the PS's event loop
    1.4 s (the same bytes in one chunk: 2 ms). A shard takes at most one chunk per
    MIN_CHUNK_BYTES of its gradient (or FREE_CHUNKS of any size); within that, any cut
    is taken."""
    from test_bad_values import PS, run

    from zmqps.wire.schema import FREE_CHUNKS, MIN_CHUNK_BYTES

    big = VariableDef("big", (256, 256), init={"name": "ones"})
    p = plan([big], 1, Partitioner(num_shards=1), optimizer={"name": "sgd", "lr": 0.5})

    async def body() -> None:
        ps = PS(p)
        await ps.create()
        (sid,) = [s.id for s in p.shards]
        before = ps.state()
        g = np.full(256 * 256, 0.5, np.float32)
        base = {"shards": [sid], "versions": [0], "worker": "w0", "inc": 0}
        tiny = [Tensor(g[o : o + 2], "grad", sid, o) for o in range(0, g.size, 2)]
        with pytest.raises(InvalidArgument, match="32768 chunks, at most 64"):
            await ps.client.request("push", {**base, "seq": 0}, tiny)
        assert ps.state() == before
        step = g.size // FREE_CHUNKS  # as many chunks as any size may come in: taken
        ok = [Tensor(g[o : o + step], "grad", sid, o) for o in range(0, g.size, step)]
        out = await ps.client.request("push", {**base, "seq": 1}, ok)
        assert out.body["applied"]
        assert np.all(ps.svc.store.get(sid).values == 0.75)
        over = g.size // (FREE_CHUNKS + 1) + 1  # one chunk past it: refused
        bad = [Tensor(g[o : o + over], "grad", sid, o) for o in range(0, g.size, over)]
        assert len(bad) == FREE_CHUNKS + 1 and g.nbytes // MIN_CHUNK_BYTES < FREE_CHUNKS + 1
        with pytest.raises(InvalidArgument, match=f"{FREE_CHUNKS + 1} chunks"):
            await ps.client.request("push", {**base, "seq": 2}, bad)
        assert np.all(ps.svc.store.get(sid).values == 0.75)

    run(body())
