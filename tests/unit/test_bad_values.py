"""Bad gradient values on the PS: NaN, infinities, values so large an update could
overflow, and dtypes other than the variable's, are refused before anything
changes, with a typed error, and counted.

The property: whatever mix of good and bad pushes a client sends (dense, push_pull,
rows), the PS ends bit-identical to one that received only the pushes it accepted.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmqps.core.finite import (
    BLOCK_ELEMS,
    LIMITS,
    PARALLEL_BYTES,
    SMALL_ELEMS,
    _split,
    first_bad,
    first_bad_of,
    limit,
)
from zmqps.core.partition import Partitioner, plan
from zmqps.core.variables import Placement, VariableDef
from zmqps.roles.ps import PSService
from zmqps.roles.threads import CheckThreads
from zmqps.transport.fake import FakeNetwork
from zmqps.wire import Tensor
from zmqps.wire.errors import InvalidArgument, NonFiniteGradient

T = TypeVar("T")

DENSE = VariableDef("w", (12, 5), init={"name": "glorot_uniform", "seed": 1})
HALF = VariableDef("h", (9,), "float16", init={"name": "normal", "seed": 2})
ROWS = VariableDef("e", (16, 3), init={"name": "uniform", "seed": 3}, sparse=True)
VARIABLES = (DENSE, HALF, ROWS)
ADAM = {"name": "adam", "lr": 0.01}

#: what a bad push holds, and the reason the PS counts it under
BAD = {
    "nan": "nonfinite",
    "inf": "nonfinite",
    "-inf": "nonfinite",
    "huge": "nonfinite",  # finite, at or past the dtype's limit
    "float64": "invalid",
    "float16": "invalid",
    "float32": "invalid",  # for the float16 variable
    "int32": "invalid",
    "bool": "invalid",
}


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 10.0))


class PS:
    """One PS service behind the in-memory transport."""

    def __init__(self, placement: Placement) -> None:
        self.net = FakeNetwork()
        self.svc = PSService(0)
        self.net.serve("ps0", self.svc, name="ps0")
        self.client = self.net.client("ps0", "w0:0")
        self.placement = placement

    async def create(self) -> None:
        defs = [d.to_wire() for _, d in self.placement.shard_defs()]
        await self.net.client("ps0", "chief:0").request("create_shards", {"shards": defs})

    def state(self) -> dict[int, tuple[int, bytes, dict[str, bytes]]]:
        out = {}
        for s in self.placement.shards:
            shard = self.svc.store.get(s.id)
            slots = {k: v.tobytes() for k, v in sorted(shard.slots.items())}
            out[s.id] = (shard.version, shard.values.tobytes(), slots)
        return out


def _grad(rng: np.random.Generator, n: int, dtype: str, kind: str) -> np.ndarray:
    """``n`` gradient values of the variable's ``dtype``, spoiled as ``kind`` says."""
    g = rng.standard_normal(n).astype(dtype)
    if kind in ("nan", "inf", "-inf"):
        g[int(rng.integers(n))] = float(kind)
    elif kind == "huge":
        big = min(float(np.finfo(dtype).max), limit(g.dtype) * (1 + 3 * rng.random()))
        g[int(rng.integers(n))] = big * rng.choice([-1.0, 1.0])
    elif kind in BAD:
        g = g.astype(kind) if kind != "bool" else g > 0
    return g


def _push(ps: PS, rng: np.random.Generator, var: VariableDef, kind: str, seq: int) -> Any:
    """One push of ``var``'s gradient (``kind`` "good" or one of BAD) by the raw wire."""
    shards = ps.placement.shards_of(var.name)
    sids = [s.id for s in shards]
    versions = [ps.svc.store.get(sid).version for sid in sids]
    body = {"shards": sids, "versions": versions, "worker": "w0", "inc": 0, "seq": seq}
    spoil = int(rng.integers(len(shards)))  # the one shard whose gradient is bad
    tensors = []
    if var.sparse:
        for i, s in enumerate(shards):
            ids = np.unique(rng.integers(s.row_start, s.row_start + s.rows, size=3))
            g = _grad(rng, ids.size * 3, var.dtype, kind if i == spoil else "good")
            tensors += [Tensor(ids, "index", s.id), Tensor(g.reshape(-1, 3), "rows", s.id)]
        return ps.client.request("push_rows", body, tensors)
    for i, s in enumerate(shards):
        n = s.rows * int(np.prod(var.shape[1:]))
        tensors.append(
            Tensor(_grad(rng, n, var.dtype, kind if i == spoil else "good"), "grad", s.id)
        )
    op = "push_pull" if rng.random() < 0.5 else "push"
    return ps.client.request(op, body, tensors)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    kinds=st.lists(st.sampled_from(["good", "good", *BAD]), min_size=1, max_size=30),
)
def test_refused_pushes_change_nothing(seed: int, kinds: list[str]) -> None:
    """A PS that received a mix is bit-identical (values, slots, versions) to one that
    received only the pushes it accepted; every refusal is typed and counted."""
    placement = plan(VARIABLES, 1, Partitioner(num_shards=2), optimizer=ADAM)

    async def body() -> None:
        mixed, clean = PS(placement), PS(placement)
        await mixed.create()
        await clean.create()
        rng = np.random.default_rng(seed)
        want: Counter[str] = Counter()
        for seq, kind in enumerate(kinds, start=1):
            var = VARIABLES[int(rng.integers(len(VARIABLES)))]
            if kind == var.dtype:  # the variable's own dtype is no bad push
                kind = "float64"
            state = rng.bit_generator.state
            if kind == "good":
                rep = await _push(mixed, rng, var, kind, seq)
                assert rep.body["applied"] is True
                rng.bit_generator.state = state  # the same push, to the clean PS
                await _push(clean, rng, var, kind, seq)
                continue
            want[BAD[kind]] += 1
            error = NonFiniteGradient if BAD[kind] == "nonfinite" else InvalidArgument
            with pytest.raises(error) as info:
                await _push(mixed, rng, var, kind, seq)
            if error is InvalidArgument:
                assert not isinstance(info.value, NonFiniteGradient)
                assert var.dtype in str(info.value)  # names both dtypes
            assert mixed.state() == clean.state()
        assert mixed.state() == clean.state()
        assert dict(mixed.svc.dropped) == dict(want)
        assert mixed.svc.status()["dropped"] == dict(want)

    run(body())


# ---------------------------------------------------------------- first_bad


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("n", [1, 7, SMALL_ELEMS, SMALL_ELEMS + 1, 3 * BLOCK_ELEMS + 5])
def test_first_bad_finds_the_first_bad_element(dtype: str, n: int) -> None:
    rng = np.random.default_rng(n)
    a = rng.standard_normal(n).astype(dtype)
    assert first_bad(a) is None
    places = sorted({int(i) for i in rng.integers(n, size=3)})
    big = min(float(np.finfo(dtype).max), limit(a.dtype))
    for bad in (np.nan, np.inf, -np.inf, big, -big, float(np.finfo(dtype).max)):
        b = a.copy()
        for i in places:
            b[i] = bad
        assert first_bad(b) == places[0], bad


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("n", [7, 3 * BLOCK_ELEMS + 5])  # the compiled loop and the sums
def test_the_limit_is_exact(dtype: str, n: int) -> None:
    """Values just below the limit pass, wherever they are; the limit itself does not
    (the vectorized sum and the loop agree to the last bit)."""
    dt = np.dtype(dtype)
    lim = dt.type(LIMITS[dt.name])
    below = np.nextafter(lim, dt.type(0))
    assert limit(dt) == LIMITS[dt.name] and np.isfinite(lim)
    a = np.full(n, below, dt)
    a[::2] = -below
    assert first_bad(a) is None
    for i in (0, n // 2, n - 1):
        for v in (lim, -lim):
            b = a.copy()
            b[i] = v
            assert first_bad(b) == i


def test_finite_values_whose_sum_overflows_are_good() -> None:
    """float16 is checked a block at a time by its minimum and maximum: no sum that
    could overflow."""
    below = np.nextafter(np.float16(LIMITS["float16"]), np.float16(0))
    a = np.full(2 * BLOCK_ELEMS + SMALL_ELEMS, below, np.float16)
    with np.errstate(over="ignore"):
        assert not np.isfinite(a.sum(dtype=np.float16))
    assert first_bad(a) is None
    a[-1] = np.nan
    assert first_bad(a) == a.size - 1


def test_strided_views_are_checked() -> None:
    a = np.zeros(40, np.float32)
    a[7] = np.nan
    assert first_bad(a[1::2]) == 3
    assert first_bad(a[::2]) is None


def _start(piece: np.ndarray[Any, Any], base: np.ndarray[Any, Any]) -> int:
    """The index in ``base`` of a slice's first element."""
    return int(piece.ctypes.data - base.ctypes.data) // base.itemsize


@pytest.mark.parametrize("k", [2, 3, 4])
def test_a_push_split_among_threads_covers_every_element_once(k: int) -> None:
    rng = np.random.default_rng(k)
    dtypes = ["float32", "float64"] * 3
    arrays = [np.zeros(int(n), dt) for n, dt in zip(rng.integers(1, 5000, 6), dtypes, strict=True)]
    parts = _split(arrays, k)
    assert 1 <= len(parts) <= k
    seen = [np.zeros(a.shape[0], int) for a in arrays]
    for part in parts:
        for j, piece in part:
            lo = _start(piece, arrays[j])
            seen[j][lo : lo + piece.shape[0]] += 1
    assert all((s == 1).all() for s in seen)
    shares = [sum(p.nbytes for _, p in part) for part in parts]
    assert max(shares) - min(shares) <= 2 * 8  # equal bytes, to an element or so


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_large_push_checked_by_threads_finds_the_first_bad_element(threads: int) -> None:
    """The parallel check gives the serial check's answer: the first bad element in
    push order, wherever the parts' boundaries fall."""
    rng = np.random.default_rng(threads)
    sizes = [PARALLEL_BYTES // 8 + 3, 5, PARALLEL_BYTES // 4 - 1, 1 << 15]
    dtypes = ["float32", "float64"] * 2
    arrays = [rng.standard_normal(n).astype(dt) for n, dt in zip(sizes, dtypes, strict=True)]
    assert sum(a.nbytes for a in arrays) >= PARALLEL_BYTES
    places = {(j, i) for j, a in enumerate(arrays) for i in (0, a.shape[0] - 1)}
    for part in _split(arrays, threads):  # where each part starts and ends, too
        for j, piece in part:
            lo = _start(piece, arrays[j])
            places |= {(j, lo), (j, lo + piece.shape[0] - 1)}
    parts = CheckThreads(threads)
    try:
        assert first_bad_of(arrays, parts) is None
        for j, i in sorted(places):
            for bad in (np.nan, np.inf, -np.inf, -LIMITS[arrays[j].dtype.name]):
                b = [a.copy() for a in arrays]
                b[j][i] = bad
                if (j, i) != (len(b) - 1, b[-1].shape[0] - 1):
                    b[-1][-1] = np.nan  # a later bad element does not hide it
                assert first_bad_of(b, parts) == (j, i)
    finally:
        parts.close()


def test_sync_a_refused_gradient_counts_toward_the_step_and_its_batch_is_done() -> None:
    """sync, N = 2: worker 0's gradient is refused (NaN); the step does not wait for
    it: worker 1's gradient alone makes it (its mean is of one), and worker 0's batch
    counts as done (a restarted worker 0 never trains it again)."""
    (var,) = VARIABLES[:1]
    placement = plan((var,), 1, Partitioner(num_shards=1), optimizer={"name": "sgd", "lr": 1.0})

    async def body() -> None:
        ps = PS(placement)
        await ps.create()
        await ps.net.client("ps0", "chief:0").request(
            "sync_config", {"mode": "sync", "required": 2}
        )
        (sid,) = [s.id for s in placement.shards]
        before = ps.svc.store.get(sid).values.copy()
        good = np.full(before.size, 0.5, np.float32)

        def push(worker: str, g: np.ndarray) -> Any:
            body = {"shards": [sid], "versions": [0], "worker": worker, "inc": 1, "seq": 1}
            body.update(step=0, cursor=1)
            client = ps.net.client("ps0", f"{worker}:1")
            return client.request("push", body, [Tensor(g, "grad", sid)])

        bad = good.copy()
        bad[3] = np.nan
        with pytest.raises(NonFiniteGradient):
            await push("worker:0", bad)
        assert ps.svc.mode.step == 0  # one of two: the step waits for worker 1
        rep = await push("worker:1", good)
        assert rep.body["applied"] is True
        assert ps.svc.mode.step == 1
        np.testing.assert_allclose(
            ps.svc.store.get(sid).values.reshape(-1), before.reshape(-1) - 0.5
        )
        pushes = ps.svc.status()["pushes"]
        assert pushes["worker:0"]["cursor"] == 1 and pushes["worker:0"]["applied"] == 0
        assert pushes["worker:0"]["dropped"] == {"nonfinite": 1}
        assert ps.svc.status()["dropped"] == {"nonfinite": 1}
        # the same refused push sent again is a duplicate: counted once toward its step
        with pytest.raises(NonFiniteGradient):
            await push("worker:0", bad)
        assert ps.svc.status()["sync"]["aggregated"] == {"1": 1}

    run(body())


OPTIMIZERS_AT_THE_LIMIT = [
    {"name": "sgd", "lr": 1.0, "weight_decay": 0.5},
    {"name": "momentum", "lr": 0.5, "momentum": 0.99},
    {"name": "momentum", "lr": 0.5, "momentum": 0.9, "nesterov": True},
    {"name": "adagrad", "lr": 1.0},
    {"name": "adam", "lr": 1.0},
    {"name": "ftrl", "lr": 1.0},
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS_AT_THE_LIMIT, ids=lambda o: str(o["name"]))
def test_pushes_just_inside_the_limit_keep_every_value_finite(optimizer: dict[str, Any]) -> None:
    """The largest values a PS accepts, pushed again and again (row ids repeated
    4,096 times in one push: the PS sums them), leave every parameter and slot
    finite: no optimizer can overflow from what it accepts."""
    table = VariableDef("t", (64, 4), init={"name": "normal", "seed": 4}, table={})
    wide = VariableDef("d64", (6, 5), "float64", init={"name": "normal", "seed": 5})
    variables = (DENSE, wide, ROWS, table)
    placement = plan(variables, 1, Partitioner(num_shards=1), optimizer=optimizer)

    async def body() -> None:
        ps = PS(placement)
        await ps.create()
        rng = np.random.default_rng(7)
        for seq in range(1, 41):
            var = variables[seq % len(variables)]
            (s,) = ps.placement.shards_of(var.name)
            version = ps.svc.store.get(s.id).version
            body = {"shards": [s.id], "versions": [version], "worker": "w0", "inc": 0, "seq": seq}
            dt = np.dtype(var.dtype)
            top = float(np.nextafter(dt.type(limit(dt)), dt.type(0)))
            if var.sparse or var.table is not None:
                ids = np.full(4096, s.row_start + int(rng.integers(s.rows)), np.int64)
                g = rng.choice([-top, top], size=(ids.size, var.shape[1])).astype(dt)
                rep = await ps.client.request(
                    "push_rows", body, [Tensor(ids, "index", s.id), Tensor(g, "rows", s.id)]
                )
            else:
                g = rng.choice([-top, top], size=s.rows * var.shape[1]).astype(dt)
                rep = await ps.client.request("push", body, [Tensor(g, "grad", s.id)])
            assert rep.body["applied"] is True
        for s in placement.shards:
            shard = ps.svc.store.get(s.id)
            assert shard.version > 0
            for name, a in {"values": shard.values, **shard.slots}.items():
                assert np.isfinite(a).all(), (s.var, name)

    run(body())


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_float16_update_past_its_largest_value_is_refused_and_changes_nothing(
    mode: str,
) -> None:
    """Values under the limit can still take a float16 parameter past 65504 (a row id
    repeated 64 times, a learning rate of 3): the whole push is undone and refused
    (async: typed, every shard of it as it was; sync: the step goes on, its values as
    they were), never an infinity; pushes that fit go on as before."""
    half_rows = VariableDef(
        "hr", (8, 4), "float16", init={"name": "normal", "seed": 6}, sparse=True
    )
    half_table = VariableDef("ht", (64, 4), "float16", init={"name": "normal", "seed": 7}, table={})
    variables = (HALF, half_rows, half_table)
    placement = plan(variables, 1, Partitioner(num_shards=1), optimizer={"name": "sgd", "lr": 3.0})
    top = 32000.0  # under the float16 limit; 3 times it, or 64 of it added, is not a float16
    assert top < limit(np.dtype(np.float16)) and 3 * top > 65504

    async def body() -> None:
        ps = PS(placement)
        await ps.create()
        if mode == "sync":
            await ps.net.client("ps0", "chief:0").request(
                "sync_config", {"mode": "sync", "required": 1}
            )
        (dense,), (rows,), (table,) = (ps.placement.shards_of(v.name) for v in variables)
        ids = np.full(64, rows.row_start + 2, np.int64)
        tids = np.full(64, 5, np.int64)
        await ps.client.request(  # the table's row exists before (a push creates none)
            "pull_rows", {"shards": [table.id]}, [Tensor(tids[:1], "index", table.id)]
        )
        before = ps.state()
        seq = iter(range(100))

        def push(op: str, shards: list[Any], tensors: list[Tensor]) -> Any:
            body = {
                "shards": [s.id for s in shards],
                "versions": [ps.svc.store.get(s.id).version for s in shards],
                "worker": "w0",
                "inc": 0,
                "seq": next(seq),
            }
            if mode == "sync":
                body["step"] = ps.svc.sync_step
            return ps.client.request(op, body, tensors)

        def rows_push(big: float, small: float) -> Any:
            return push(
                "push_rows",
                [rows, table],
                [
                    Tensor(ids, "index", rows.id),
                    Tensor(np.full((64, 4), small, np.float16), "rows", rows.id),
                    Tensor(tids, "index", table.id),
                    Tensor(np.full((64, 4), big, np.float16), "rows", table.id),
                ],
            )

        def dense_push(v: float) -> Any:
            return push("push", [dense], [Tensor(np.full(9, v, np.float16), "grad", dense.id)])

        for attempt in (lambda: rows_push(top, 0.01), lambda: dense_push(top)):
            if mode == "async":
                with pytest.raises(NonFiniteGradient, match="65504"):
                    await attempt()
            else:
                await attempt()
        after = ps.state()
        # async: the whole push is undone, its good shard too; sync: each shard applies
        # its own step's mean, and only the shards that would overflow keep their values
        unchanged = (dense, rows, table) if mode == "async" else (dense, table)
        for s in (dense, rows, table):
            assert np.isfinite(ps.svc.store.get(s.id).values).all()
            if s in unchanged:  # values and slots bit-identical
                assert after[s.id][1:] == before[s.id][1:], s.var
        if mode == "async":
            assert ps.svc.dropped["nonfinite"] == 2
        else:
            assert ps.svc.mode.shards.dropped["overflow"] == 2
        # pushes that fit are applied
        for attempt in (lambda: rows_push(0.01, 0.01), lambda: dense_push(0.01)):
            assert (await attempt()).body["applied"]
        assert all(ps.state()[s.id][1] != before[s.id][1] for s in (dense, rows, table))

    run(body())


def test_a_float16_value_infinite_before_a_push_does_not_refuse_it() -> None:
    """A float16 parameter already infinite (an older checkpoint's) is not the push's
    doing: only values a push would take from finite to infinite refuse it."""
    placement = plan((HALF,), 1, Partitioner(num_shards=1), optimizer={"name": "sgd", "lr": 0.1})

    async def body() -> None:
        ps = PS(placement)
        await ps.create()
        (s,) = ps.placement.shards_of(HALF.name)
        shard = ps.svc.store.get(s.id)
        shard.values[0] = np.inf
        body = {"shards": [s.id], "versions": [0], "worker": "w0", "inc": 0, "seq": 0}
        grad = Tensor(np.full(shard.values.size, 0.5, np.float16), "grad", s.id)
        out = await ps.client.request("push", body, [grad])
        assert out.body["applied"] and shard.version == 1
        assert np.isinf(shard.values[0]) and np.isfinite(shard.values[1:]).all()

    run(body())
