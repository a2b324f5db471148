"""Sync (SyncReplicas) and SSP without sockets.

Three layers: the pure state of :mod:`zmqps.core.sync` (accumulators, token ledger,
staleness bound); the PS sync path (``sync_config``, tagged pushes, ``wait_step``)
through the in-memory cluster of tests/unit/test_ps_client.py; and the chief's sync
mode (:class:`~zmqps.roles.chief.modes.SyncMode`) running its real loop against
in-memory PS, with workers played by :class:`ParameterClient` objects and chief
messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from test_chief import Env, call, make_env, who
from test_ps_client import EMB, SGD, Cluster, DoublePush, initial, make_cluster, run

from zmqps.core.membership import Membership
from zmqps.core.optimizers import compute_dtype, make_optimizer
from zmqps.core.partition import Partitioner, plan
from zmqps.core.store import ShardStore
from zmqps.core.sync import (
    ReleasedTokens,
    ShardAccumulator,
    StalenessBound,
    SyncShards,
    TokenLedger,
)
from zmqps.core.variables import Placement, VariableDef
from zmqps.roles.chief.modes import SyncMode
from zmqps.roles.client import ParameterClient
from zmqps.roles.configs import SyncConfig
from zmqps.roles.status import format_status
from zmqps.wire import Message
from zmqps.wire.errors import Busy, DeadlineExceeded, InvalidArgument, NotFound, NotReady
from zmqps.wire.ops import Who

LR = SGD["lr"]
W = VariableDef("w", (6, 4), init={"name": "glorot_uniform", "seed": 1})
B = VariableDef("b", (5,), init={"name": "normal", "stddev": 0.5, "seed": 2})
DENSE = (W, B)
ADAM = {"name": "adam", "lr": 0.05}


def grads(seed: int, variables: Sequence[VariableDef] = DENSE) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {v.name: rng.standard_normal(v.shape).astype(np.float32) for v in variables}


def mean(gs: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.mean([g[k] for g in gs], axis=0, dtype=np.float64) for k in gs[0]}


def step_reference(
    params: dict[str, np.ndarray],
    slots: dict[str, dict[str, np.ndarray]],
    optimizer: dict[str, Any],
    g: dict[str, np.ndarray],
    step: int,
) -> None:
    """One single-process update of ``params`` (in place) with the gradient ``g``."""
    opt = make_optimizer(optimizer)
    for name, p in params.items():
        s = slots.setdefault(name, opt.init_slots(p.shape, p.dtype))
        scratch = np.empty(opt.scratch_factor * p.size, compute_dtype(p.dtype))
        flat = {k: v.reshape(-1) for k, v in s.items()}
        opt.apply_dense(p.reshape(-1), g[name].astype(p.dtype).reshape(-1), flat, step, scratch)


async def until(predicate: Callable[[], Any], timeout: float = 2.0, what: str = "") -> None:
    """Let the event loop run until ``predicate()`` holds (fail after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        await asyncio.sleep(0.001)


# ============================================================== core: SyncShards


def one_ps_store(variables: Sequence[VariableDef], optimizer: dict[str, Any] = SGD) -> ShardStore:
    placement = plan(variables, 1, Partitioner(num_shards=1), optimizer=optimizer)
    store = ShardStore()
    store.create([d for _, d in placement.shard_defs()])
    return store


def test_the_mean_is_applied_exactly_once_per_step() -> None:
    store = one_ps_store([W], ADAM)
    sync = SyncShards(store, required=3)
    params, slots = {"w": initial(W)}, {}
    for step in range(1, 4):
        gs = [grads(10 * step + k, [W]) for k in range(3)]
        before = store.get(0).values.copy()
        assert not sync.add_dense(0, [(0, gs[0]["w"].reshape(-1))], "worker:0")
        assert not sync.add_dense(0, [(0, gs[1]["w"].reshape(-1))], "worker:1")
        np.testing.assert_array_equal(store.get(0).values, before)  # nothing yet
        assert sync.contributors_of_current_step() == ["worker:0", "worker:1"]
        assert sync.add_dense(0, [(0, gs[2]["w"].reshape(-1))], "worker:2")
        step_reference(params, slots, ADAM, mean(gs), step)
        np.testing.assert_allclose(store.get(0).values, params["w"], rtol=1e-6, atol=1e-7)
        assert (sync.step_of(0), store.get(0).version, sync.steps_applied) == (step, step, step)
        acc = sync.acc[0]
        assert (acc.count, list(acc.contributors)) == (0, [])
        assert acc.dense is not None and not acc.dense.any()  # the sum starts over
    assert sync.status() == {
        "step": 3,
        "required": 3,
        "accumulated": {"0": 0},
        "dropped": {},
        "steps_applied": 3,
        "aggregated": {"3": 3},
    }


def test_chunks_of_one_gradient_add_up() -> None:
    store = one_ps_store([W])
    sync = SyncShards(store, required=2)
    g0, g1 = grads(1, [W])["w"].reshape(-1), grads(2, [W])["w"].reshape(-1)
    sync.add_dense(0, [(10, g0[10:]), (0, g0[:10])], "worker:0")
    sync.add_dense(0, [(0, g1)], "worker:1")
    expected = initial(W).reshape(-1) - LR * (g0 + g1) / 2
    np.testing.assert_allclose(store.get(0).values.reshape(-1), expected, rtol=1e-6)


def test_shrinking_required_applies_a_step_that_has_enough() -> None:
    store = one_ps_store([W])
    sync = SyncShards(store, required=3)
    g0, g1 = grads(1, [W])["w"].reshape(-1), grads(2, [W])["w"].reshape(-1)
    sync.add_dense(0, [(0, g0)], "worker:0")
    sync.add_dense(0, [(0, g1)], "worker:2")
    assert sync.set_required(3) == []  # unchanged: still waiting
    assert sync.set_required(2) == [0]
    expected = initial(W).reshape(-1) - LR * (g0 + g1) / 2
    np.testing.assert_allclose(store.get(0).values.reshape(-1), expected, rtol=1e-6)
    assert sync.min_step() == 1
    assert sync.set_required(1) == []  # the new step holds nothing: nothing to apply
    sync.add_dense(0, [(0, g0)], "worker:0")
    # each applied step is counted by how many gradients its mean was of
    assert sync.status()["aggregated"] == {"1": 1, "2": 1}


def test_a_step_is_never_applied_from_zero_gradients() -> None:
    store = one_ps_store([W])
    sync = SyncShards(store, required=2)
    sync.step_of(0)  # the accumulator exists, empty
    assert sync.set_required(1) == []
    assert (sync.min_step(), store.get(0).version, sync.steps_applied) == (0, 0, 0)
    np.testing.assert_array_equal(store.get(0).values, initial(W))
    with pytest.raises(InvalidArgument):
        sync.set_required(0)
    with pytest.raises(InvalidArgument):
        SyncShards(store, required=0)
    g = grads(1, [W])["w"].reshape(-1)
    assert sync.add_dense(0, [(0, g)], "worker:0")  # required 1: applied alone, unscaled
    np.testing.assert_allclose(store.get(0).values.reshape(-1), initial(W).reshape(-1) - LR * g)


def test_stale_is_relative_to_each_shard() -> None:
    store = one_ps_store([W, B])
    sync = SyncShards(store, required=1)
    assert (sync.step_of(0), sync.step_of(1)) == (0, 0)
    sync.add_dense(0, [(0, grads(1, [W])["w"].reshape(-1))], "worker:0")
    assert (sync.step_of(0), sync.step_of(1), sync.min_step()) == (1, 0, 0)
    assert sync.is_stale(0, 0) and not sync.is_stale(0, 1) and not sync.is_stale(1, 0)
    with pytest.raises(NotFound):
        sync.step_of(7)


def test_a_shard_first_touched_after_another_advanced_is_still_at_the_step() -> None:
    """Layer-by-layer pushes: the gradient of one shard arrives (and is applied) before
    another shard of the PS was ever touched; that one is still at the PS's step."""
    store = one_ps_store([W, B])
    sync = SyncShards(store, required=1, step=4)
    assert sync.add_dense(0, [(0, grads(1, [W])["w"].reshape(-1))], "worker:0")
    assert (sync.step_of(0), sync.min_step()) == (5, 4)
    assert not sync.is_stale(1, 4)  # a gradient for step 4 is fresh for shard 1
    assert sync.add_dense(1, [(0, grads(2, [B])["b"].reshape(-1))], "worker:0")
    assert (sync.step_of(1), sync.min_step()) == (5, 5)


def test_row_gradients_accumulate_and_apply_their_mean() -> None:
    emb = VariableDef("emb", (8, 3), init={"name": "uniform", "seed": 4}, sparse=True)
    store = one_ps_store([emb])
    sync = SyncShards(store, required=2)
    rng = np.random.default_rng(0)
    ids0, rows0 = np.array([1, 3]), rng.standard_normal((2, 3)).astype(np.float32)
    ids1, rows1 = np.array([3, 5]), rng.standard_normal((2, 3)).astype(np.float32)
    assert not sync.add_rows(0, ids0, rows0, "worker:0")
    rows0[:] = 99.0  # the accumulator kept its own copy (frames die with the request)
    assert sync.add_rows(0, ids1, rows1, "worker:1")
    rows0 = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    expected = initial(emb)
    expected[1] -= LR * rows0[0] / 2
    expected[3] -= LR * (rows0[1] + rows1[0]) / 2  # both workers' rows, one mean
    expected[5] -= LR * rows1[1] / 2
    np.testing.assert_allclose(store.get(0).values, expected, rtol=1e-6)
    assert sync.acc[0].rows == [] and store.get(0).version == 1


def test_accumulator_defaults() -> None:
    acc = ShardAccumulator()
    assert (acc.step, acc.count, acc.dense, acc.rows, list(acc.contributors)) == (
        0,
        0,
        None,
        [],
        [],
    )


# ============================================================== core: TokenLedger


def test_token_ledger_take_advance() -> None:
    q = TokenLedger()
    assert q.take(0, 0, replicas=0) is None and q.available(0) == 0
    assert q.take(0, 0, replicas=3) == 0
    assert q.take(0, 0, replicas=3) is None  # one token per worker and step
    assert q.take(1, 0, replicas=3) == 0 and q.available(3) == 1
    q.advance(1, 3)  # the leftover token of step 0 is discarded
    assert (q.discarded, q.available(3)) == (1, 3)
    assert [q.take(w, 0, 3) for w in (0, 1, 2)] == [1, 1, 1]
    assert q.take(3, 0, 3) is None and q.taken == 5
    assert q.take(3, 0, 4) == 1  # a rejoined replica (M grew): its share of the current step
    q.advance(3, 2)
    assert (q.discarded, q.available(2)) == (1, 2)
    assert q.take(0, 0, 2) == 3


def test_extra_tokens_may_be_taken_by_anyone() -> None:
    q = TokenLedger()
    q.restart(0, extra=2)  # init_tokens
    assert [q.take(0, 0, 2) for _ in range(4)] == [0, 0, 0, None]
    assert q.take(1, 0, 2) == 0 and q.available(2) == 0


def test_a_worker_that_comes_back_finds_its_token_whatever_m_was() -> None:
    """Worker 1 counted dead while step 5 began (M = 1): when it comes back M is 2 again
    and step 5 has a token for it, although none was 'put' for it."""
    q = TokenLedger()
    q.advance(5, replicas=1)
    assert q.take(0, 0, replicas=1) == 5
    q.advance(6, replicas=0)  # worker 0 finished its data, worker 1 dead: M = 0
    assert q.available(0) == 0
    assert q.take(1, 0, replicas=1) == 6  # worker 1 is back: M = 1, and its token is there


def test_a_new_incarnation_takes_over_and_a_resent_request_gets_the_same_token() -> None:
    q = TokenLedger()
    q.restart(4)
    assert q.take(1, 10, replicas=2, have=3) == 4
    assert q.take(1, 10, replicas=2, have=3) == 4  # its answer was lost: the same token
    assert q.take(1, 10, replicas=2, have=4) is None  # it computed step 4: wait for 5
    assert q.take(1, 11, replicas=2, have=-1) == 4  # a new incarnation: the old one's slot
    assert q.take(0, 10, replicas=2) == 4 and q.available(2) == 0
    assert q.taken == 3


# ============================================================== core: StalenessBound


def test_staleness_bound() -> None:
    b = StalenessBound(2)
    live = [0, 1, 2]
    assert b.slowest([]) is None and b.slowest(live) == 0
    assert b.may_start(2, live) and not b.may_start(3, live)
    b.report(0, 3)
    b.report(1, 1)
    b.report(2, 1)
    b.report(1, 0)  # clocks never go back
    assert b.clocks == {0: 3, 1: 1, 2: 1} and b.slowest(live) == 1
    assert b.may_start(3, live) and not b.may_start(4, live)
    assert b.may_start(4, [0])  # alone, nothing holds it back
    assert b.max_spread == 2
    assert b.snapshot() == {
        "max_staleness": 2,
        "clocks": {"0": 3, "1": 1, "2": 1},
        "max_spread": 2,
    }
    with pytest.raises(InvalidArgument):
        StalenessBound(-1)


def test_staleness_zero_is_lock_step() -> None:
    b = StalenessBound(0)
    b.report(0, 1)
    assert not b.may_start(1, [0, 1])
    b.report(1, 1)
    assert b.may_start(1, [0, 1]) and b.max_spread == 0


# ============================================================== PS sync path (in memory)


async def sync_cluster(
    required: int, variables: Sequence[VariableDef] = DENSE, num_ps: int = 2
) -> Cluster:
    c = await make_cluster(variables, num_ps, 2)
    for i in range(num_ps):
        rep = await c.net.client(f"ps{i}", "chief:0").request(
            "sync_config", {"mode": "sync", "required": required}
        )
        assert rep.body == {"step": 0}
    return c


def ps_sync(c: Cluster, i: int) -> dict[str, Any]:
    return dict(c.services[i].status()["sync"])


def test_ps_applies_the_mean_once_n_pushes_arrived() -> None:
    async def body() -> None:
        c = await sync_cluster(required=2)
        w0, w1, w2 = (c.client(f"worker:{i}") for i in range(3))
        g0, g1, g2 = grads(0), grads(1), grads(2)
        assert await w0.push(g0, step=0)
        for v in DENSE:
            np.testing.assert_array_equal(c.shard_values(v.name), initial(v))
        assert [ps_sync(c, i)["contributors"] for i in (0, 1)] == [["worker:0"]] * 2
        assert await w1.push(g1, step=0)
        for v in DENSE:
            expected = initial(v) - LR * (g0[v.name] + g1[v.name]) / 2
            np.testing.assert_allclose(c.shard_values(v.name), expected, rtol=1e-6)
        assert set(c.versions().values()) == {1}
        # The third (backup) gradient of step 0 is late: dropped, counted, not applied.
        before = {v.name: c.shard_values(v.name) for v in DENSE}
        assert not await w2.push(g2, step=0)
        assert w2.dropped == {"stale": 2}  # one reply per PS
        for v in DENSE:
            np.testing.assert_array_equal(c.shard_values(v.name), before[v.name])
        for i in (0, 1):
            st = ps_sync(c, i)
            assert (st["step"], st["dropped"], st["contributors"]) == (1, {"stale": 1}, [])
        # A push without its step is refused in sync mode.
        with pytest.raises(InvalidArgument, match="local step"):
            await w0.push(g0)

    run(body())


def test_ps_counts_a_duplicate_push_once() -> None:
    async def body() -> None:
        c = await sync_cluster(required=2)
        twice = c.client("worker:0", wrap=DoublePush)
        g0, g1 = grads(0), grads(1)
        assert not await twice.push(g0, step=0)  # the second copy: a duplicate
        assert twice.dropped == {"duplicate": 2}  # one reply per PS
        assert [svc.duplicates for svc in c.services] == [1, 1]
        for i in (0, 1):
            assert set(ps_sync(c, i)["accumulated"].values()) == {1}
        assert set(c.versions().values()) == {0}  # one gradient, not the two N needs
        assert await c.client("worker:1").push(g1, step=0)
        for v in DENSE:
            expected = initial(v) - LR * (g0[v.name] + g1[v.name]) / 2
            np.testing.assert_allclose(c.shard_values(v.name), expected, rtol=1e-6)

    run(body())


def test_ps_shrinking_n_applies_the_waiting_step() -> None:
    async def body() -> None:
        c = await sync_cluster(required=3)
        g0, g1 = grads(0), grads(1)
        await c.client("worker:0").push(g0, step=0)
        await c.client("worker:1").push(g1, step=0)
        assert set(c.versions().values()) == {0}
        chief = c.net.client("ps0", "chief:0")
        waiter = asyncio.ensure_future(chief.request("wait_step", {"step": 1, "wait": 2.0}))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        for i in (0, 1):
            rep = await c.net.client(f"ps{i}", "chief:0").request(
                "sync_config", {"mode": "sync", "required": 2}
            )
            assert rep.body == {"step": 1}
        assert (await asyncio.wait_for(waiter, 1.0)).body == {"step": 1}
        for v in DENSE:
            expected = initial(v) - LR * (g0[v.name] + g1[v.name]) / 2
            np.testing.assert_allclose(c.shard_values(v.name), expected, rtol=1e-6)
        # N = 1 with nothing accumulated for step 1 applies nothing.
        rep = await chief.request("sync_config", {"mode": "sync", "required": 1})
        assert rep.body == {"step": 1} and set(c.versions().values()) == {1}

    run(body())


def test_ps_wait_step_long_poll() -> None:
    async def body() -> None:
        c = await sync_cluster(required=1, num_ps=1)
        chief = c.net.client("ps0", "chief:0")
        t0 = time.monotonic()
        rep = await chief.request("wait_step", {"step": 1, "wait": 0.05})
        assert rep.body == {"step": 0} and time.monotonic() - t0 >= 0.04  # no progress
        rep = await chief.request("wait_step", {"step": 0})  # reached: at once
        assert rep.body == {"step": 0}
        far = asyncio.ensure_future(chief.request("wait_step", {"step": 2, "wait": 2.0}))
        near = asyncio.ensure_future(chief.request("wait_step", {"step": 1, "wait": 2.0}))
        await asyncio.sleep(0.01)
        worker = c.client("worker:0")
        await worker.push(grads(0), step=0)
        assert (await asyncio.wait_for(near, 1.0)).body == {"step": 1}
        assert not far.done()
        await worker.push(grads(1), step=1)
        assert (await asyncio.wait_for(far, 1.0)).body == {"step": 2}

    run(body())


def test_ps_rows_in_sync_mode() -> None:
    async def body() -> None:
        c = await sync_cluster(required=2, variables=(EMB,))
        rng = np.random.default_rng(0)
        ids0, ids1 = np.array([1, 3, 3]), np.array([3, 20])  # rows in one shard of two
        r0, r1 = rng.standard_normal((3, 3)), rng.standard_normal((2, 3))
        assert await c.client("worker:0").push_rows("emb", ids0, r0, step=0)
        assert set(c.versions().values()) == {0}
        assert await c.client("worker:1").push_rows("emb", ids1, r1, step=0)
        # every shard heard from both workers (empty pushes included): one step each
        assert set(c.versions().values()) == {1}
        expected = initial(EMB)
        expected[1] -= LR * r0[0] / 2
        expected[3] -= LR * (r0[1] + r0[2] + r1[0]) / 2
        expected[20] -= LR * r1[1] / 2
        np.testing.assert_allclose(c.shard_values("emb"), expected, rtol=1e-5)
        assert not await c.client("worker:2").push_rows("emb", ids0, r0, step=0)  # late

    run(body())


def test_ps_back_to_async() -> None:
    async def body() -> None:
        c = await sync_cluster(required=3, num_ps=1)
        chief = c.net.client("ps0", "chief:0")
        with pytest.raises(InvalidArgument):
            await chief.request("sync_config", {"mode": "lockstep", "required": 1})
        await chief.request("sync_config", {"mode": "async", "required": 1})
        assert "sync" not in c.services[0].status()
        assert await c.client("worker:0").push(grads(0))  # applied on arrival again
        assert set(c.versions().values()) == {1}

    run(body())


# ============================================================== the chief's driver (in memory)


@dataclass
class SyncJob:
    env: Env
    placement: Placement
    workers: list[ParameterClient]

    @property
    def step(self) -> int:
        return self.env.chief.global_step

    async def token(self, i: int, wait: float = 1.0) -> int:
        rep = await call(self.env.chief, "take_token", who(i, wait=wait))
        return int(rep.body["step"])

    async def leave(self, i: int, reason: str = "done") -> None:
        await call(self.env.chief, "leave", who(i, step=0, reason=reason))

    async def status(self) -> dict[str, Any]:
        return dict((await call(self.env.chief, "status")).body)

    def values(self, name: str) -> np.ndarray:
        v = self.placement.variable(name)
        out = np.empty(v.shape, v.dtype)
        for s in self.placement.shards_of(name):
            shard = self.env.services[s.ps].store.get(s.id)
            out[s.row_start : s.row_start + s.rows] = shard.values
        return out

    async def close(self) -> None:
        await self.env.chief.recovery.close()  # training stops


async def sync_job(
    num_workers: int = 3,
    num_ps: int = 2,
    *,
    variables: Sequence[VariableDef] = DENSE,
    optimizer: dict[str, Any] = SGD,
    num_shards: int = 2,
    **sync: Any,
) -> SyncJob:
    env = make_env(
        num_ps,
        num_workers,
        sync=SyncConfig(**{"mode": "sync", **sync}),
        partitioner=Partitioner(num_shards=num_shards),
    )
    await env.chief.start()  # a fresh cluster: training starts with the variables
    placement = await env.chief.create_variables(variables, optimizer)
    for i in range(num_workers):
        await call(env.chief, "register", who(i))
    workers = [
        ParameterClient(
            [env.net.client(addr, f"worker:{i}:0") for addr in env.cfg.cluster.ps],
            placement,
            worker=f"worker:{i}",
            incarnation=0,
            shared_memory=False,
        )
        for i in range(num_workers)
    ]
    job = SyncJob(env, placement, workers)
    await until(lambda: env.chief.consistency.started, what="the driver to start")
    return job


@pytest.mark.parametrize("optimizer", [SGD, ADAM], ids=["sgd", "adam"])
def test_sync_steps_equal_steps_on_the_mean(optimizer: dict[str, Any]) -> None:
    async def body() -> None:
        job = await sync_job(3, 2, optimizer=optimizer)
        params = {v.name: initial(v) for v in DENSE}
        slots: dict[str, dict[str, np.ndarray]] = {}
        for step in range(4):
            assert [await job.token(i) for i in range(3)] == [step] * 3
            gs = [grads(10 * step + i) for i in range(3)]
            for i in (2, 0, 1):  # arrival order does not matter
                await job.workers[i].pull()
                assert await job.workers[i].push(gs[i], step=step)
            await until(lambda s=step: job.step == s + 1, what=f"global step {step + 1}")
            step_reference(params, slots, optimizer, mean(gs), step + 1)
            for v in DENSE:
                np.testing.assert_allclose(job.values(v.name), params[v.name], atol=1e-6)
        await job.close()

    run(body())


def test_take_token_long_polls_then_not_ready() -> None:
    async def body() -> None:
        members = Membership(2)
        mode = SyncMode(SyncConfig(mode="sync"), members, [], clock=time.monotonic)
        w0 = Who("worker", 0, 0)
        t0 = time.monotonic()
        with pytest.raises(NotReady, match=r"no token within 0\.05s"):
            await mode.take_token(w0, 0.05, None)
        assert time.monotonic() - t0 >= 0.04
        # A waiting poll gets the token as soon as there is one (and the waiters woken).
        waiter = asyncio.ensure_future(mode.take_token(w0, 2.0, None))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        mode.started = True
        await mode.membership_changed()
        assert await asyncio.wait_for(waiter, 1.0) == 0
        with pytest.raises(NotReady):  # one token per worker and step
            await mode.take_token(w0, 0.01, None)

    run(body())


class _SlowPS:
    """A PS whose first ``misses`` answers to ``sync_config`` never come in time."""

    endpoint = "slow-ps"

    def __init__(self, misses: int) -> None:
        self.misses = misses
        self.told: list[int] = []

    async def request(self, op: str, body: Any = None, *args: Any, **kwargs: Any) -> Any:
        assert op == "sync_config"
        if self.misses:
            self.misses -= 1
            raise DeadlineExceeded("sync_config to slow-ps: no reply within 10s")
        self.told.append(int(body["required"]))
        return None


def test_a_ps_that_misses_a_new_n_is_told_again_and_the_chief_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At 100 PS on a loaded machine one PS did not answer ``sync_config`` within 10 s
    after a worker died: the error ended the chief's worker watch, and the chief
    exited 1. A PS that misses N is now told again until it answers."""
    import zmqps.roles.chief.modes as modes

    monkeypatch.setattr(modes, "RECONFIGURE_RETRY_S", 0.05)

    async def body() -> None:
        slow, fine = _SlowPS(misses=2), _SlowPS(misses=0)
        members = Membership(2)
        mode = SyncMode(SyncConfig(mode="sync"), members, [fine, slow], clock=time.monotonic)
        mode.started, mode.required = True, 5  # N told before; 2 now
        await mode._reconfigure()  # no error: told again later
        assert mode.required == 0 and slow.told == []
        await until(lambda: slow.told == [2], what="N told again")
        assert mode.required == 2 and fine.told[-1] == 2

    run(body())


class _PollingPS(_SlowPS):
    """A :class:`_SlowPS` whose step never advances (the sync loop's polls wait)."""

    async def request(self, op: str, body: Any = None, *args: Any, **kwargs: Any) -> Any:
        if op == "wait_step":
            await asyncio.Event().wait()
        return await super().request(op, body, *args, **kwargs)


@pytest.mark.parametrize("mode_name", ["async", "ssp", "sync"])
def test_a_ps_that_misses_the_mode_at_the_start_is_told_again_and_training_starts(
    monkeypatch: pytest.MonkeyPatch, mode_name: str
) -> None:
    """A replicated ssp run (fault schedule 7005): a PS killed as training started
    never answered ``sync_config``; the fail-over failed the request (``not_primary``),
    the error ended the chief's training task and the chief exited 1. A PS that misses
    the mode at the start is now told again until it answers."""
    import zmqps.roles.chief.modes as modes

    monkeypatch.setattr(modes, "RECONFIGURE_RETRY_S", 0.05)

    async def body() -> None:
        slow, fine = _PollingPS(misses=2), _PollingPS(misses=0)
        mode = modes.make_chief_mode(
            SyncConfig(mode=mode_name), Membership(2), [fine, slow], clock=time.monotonic
        )
        want = 2 if mode_name == "sync" else 1  # sync: N, every worker
        if mode_name == "sync":  # its stepping loop runs until cancelled
            task = asyncio.ensure_future(mode.start([0, 1], 0))
            await until(lambda: mode.started, what="sync training started")
        else:
            await mode.start([0, 1], 0)  # no error
            task = None
        assert mode.started and fine.told == [want] and slow.told == []
        await until(lambda: slow.told == [want], what="the mode told again")
        mode.stop()
        if task is not None:
            task.cancel()

    run(body())


def test_take_token_waits_for_the_step_to_advance() -> None:
    async def body() -> None:
        job = await sync_job(2, 1)
        assert await job.token(0) == 0
        waiter = asyncio.ensure_future(job.token(0, wait=2.0))  # its next token
        assert await job.token(1) == 0
        await job.workers[0].push(grads(0), step=0)
        await asyncio.sleep(0.01)
        assert not waiter.done()  # step 0 still waits for worker 1
        await job.workers[1].push(grads(1), step=0)
        assert await asyncio.wait_for(waiter, 1.0) == 1
        with pytest.raises(InvalidArgument, match="sync mode"):
            await call(job.env.chief, "ssp_clock", who(0, completed=0))
        await job.close()

    run(body())


def test_backup_workers_late_gradient_and_discarded_tokens() -> None:
    async def body() -> None:
        job = await sync_job(3, 2, total_replicas=3, replicas_to_aggregate=2)
        st = await job.status()
        assert (st["replicas_to_aggregate"], st["total_replicas"], st["tokens_available"]) == (
            2,
            3,
            3,
        )
        for i in (0, 1, 2):
            assert await job.token(i) == 0
        await job.workers[0].push(grads(0), step=0)
        await job.workers[1].push(grads(1), step=0)
        await until(lambda: job.step == 1)
        assert not await job.workers[2].push(grads(2), step=0)  # the backup was late
        for i in (0, 1):
            assert await job.token(i) == 1
            await job.workers[i].push(grads(i), step=1)
        await until(lambda: job.step == 2)
        st = await job.status()
        assert st["tokens_discarded"] == 1  # worker 2 never took its token of step 1
        assert await job.token(2) == 2  # a fresh one, not a sure-to-be-dropped one
        for svc in job.env.services:
            assert svc.status()["sync"]["dropped"] == {"stale": 1}
        await job.close()

    run(body())


def test_status_names_whom_the_step_waits_on_and_a_dead_worker_is_dropped() -> None:
    async def body() -> None:
        job = await sync_job(3, 2)
        for i in range(3):
            await job.token(i)
        for i in (0, 2):
            await job.workers[i].push(grads(i), step=0)
        st = await job.status()
        assert (st["global_step"], st["waiting_on"]) == (0, [1])
        # Worker 1 goes silent; the others heartbeat. Past the timeout it is dead: the
        # watcher's membership change shrinks N and the step is applied without it.
        job.env.clock.now += 11.0
        for i in (0, 2):
            await call(job.env.chief, "heartbeat", who(i, step=1))
        await job.env.chief.consistency.membership_changed(gone=[1])
        await until(lambda: job.step == 1)
        st = await job.status()
        assert (st["replicas_to_aggregate"], st["total_replicas"]) == (2, 2)
        assert st["workers_dead"] == [1] and st["tokens_available"] == 2
        for v in DENSE:
            g0, g2 = grads(0)[v.name], grads(2)[v.name]
            np.testing.assert_allclose(job.values(v.name), initial(v) - LR * (g0 + g2) / 2)
        await job.close()

    run(body())


async def _worker_1_completes_step_0(job: SyncJob, pusher: ParameterClient) -> None:
    """Worker 1's push (through ``pusher``) completes step 0, which worker 0's gradient
    is in: the step applies the mean of the two."""
    assert await pusher.push(grads(1), step=0)
    await until(lambda: job.step == 1)
    for v in DENSE:
        g0, g1 = grads(0)[v.name], grads(1)[v.name]
        np.testing.assert_allclose(job.values(v.name), initial(v) - LR * (g0 + g1) / 2)


@pytest.mark.parametrize("how", ["done", "dead"])
def test_a_worker_gone_after_its_push_still_counts_for_that_step(how: str) -> None:
    """N = M = 2: worker 0 pushes its last gradient and leaves (or dies) while worker 1
    still computes the step. The step must wait for worker 1, not be applied from
    worker 0's gradient alone (which would drop worker 1's as stale)."""

    async def body() -> None:
        job = await sync_job(2, 2)
        for i in (0, 1):
            await job.token(i)
        await job.workers[0].push(grads(0), step=0)
        if how == "done":
            await job.leave(0)
        else:
            job.env.clock.now += 11.0
            await call(job.env.chief, "heartbeat", who(1, step=0))
            await job.env.chief.consistency.membership_changed(gone=[0])
        await asyncio.sleep(0.01)
        assert job.step == 0 and set(job.env.chief.consistency.counted) == {0}
        assert (await job.status())["replicas_to_aggregate"] == 2
        await _worker_1_completes_step_0(job, job.workers[1])
        # From the next step on it no longer counts.
        await until(lambda: job.env.chief.consistency.required == 1)
        assert (await job.status())["total_replicas"] == 1
        assert await job.token(1) == 1
        assert await job.workers[1].push(grads(3), step=1)
        await until(lambda: job.step == 2)
        for svc in job.env.services:
            assert svc.status()["sync"]["dropped"] == {}
        await job.close()

    run(body())


def test_workers_leaving_together_after_their_push_still_count_for_that_step() -> None:
    """N = M = 3: workers 0 and 1 push their last gradient and leave at the same time
    while worker 2 still computes the step. Each leave looks up, on the PS, whether the
    step holds the leaver's gradient; the step must not be applied while one look is
    under way because the other leave shrank N meanwhile (found by the load simulator
    with 1,000 workers: the last step was the mean of 998 and two pushes were stale)."""

    async def body() -> None:
        job = await sync_job(3, 2)
        for i in (0, 1, 2):
            await job.token(i)
        for i in (0, 1):
            assert await job.workers[i].push(grads(i), step=0)
        await asyncio.gather(job.leave(0), job.leave(1))
        await asyncio.sleep(0.01)
        assert job.step == 0 and set(job.env.chief.consistency.counted) == {0, 1}
        assert (await job.status())["replicas_to_aggregate"] == 3
        assert await job.workers[2].push(grads(2), step=0)
        await until(lambda: job.step == 1)
        for v in DENSE:
            total = grads(0)[v.name] + grads(1)[v.name] + grads(2)[v.name]
            np.testing.assert_allclose(
                job.values(v.name), initial(v) - LR * total / 3, rtol=1e-5, atol=1e-6
            )
        for svc in job.env.services:
            assert svc.status()["sync"]["dropped"] == {}
        await job.close()

    run(body())


@pytest.mark.parametrize("error", [DeadlineExceeded, Busy])
def test_a_leaver_looked_up_on_a_ps_that_does_not_answer_still_counts_for_its_step(
    monkeypatch: pytest.MonkeyPatch, error: type[Exception]
) -> None:
    """N = M = 2: worker 0 pushes its last gradient and leaves while a PS is too loaded
    to answer the chief's look-up of the step's contributors in time (or refuses it,
    ``busy``). The chief counted nobody then: N fell to 1 and the PS applied the step
    from worker 0's gradient alone, worker 1's push of it stale (the load simulator's
    last step under a loaded CI machine). The leaver stays counted while the look-up
    is asked again, and the leave is answered meanwhile."""
    import zmqps.roles.chief.modes as modes

    monkeypatch.setattr(modes, "LOOKUP_RETRY_S", (0.01, 0.02))
    monkeypatch.setattr(modes, "LOOKUP_WAIT_S", 0.05)

    async def body() -> None:
        job = await sync_job(2, 2)
        ps0 = job.env.chief.consistency.stepping[0]
        ask = ps0.request
        refusals = [0]

        async def loaded(op: str, body: Any = None, *args: Any, **kwargs: Any) -> Any:
            if op == "status" and body and body.get("sync_of") and refusals[0] < 20:
                refusals[0] += 1
                raise error("ps0: no answer in time")
            return await ask(op, body, *args, **kwargs)

        monkeypatch.setattr(ps0, "request", loaded)
        for i in (0, 1):
            await job.token(i)
        await job.workers[0].push(grads(0), step=0)
        await asyncio.wait_for(job.leave(0), 2.0)  # answered while the look-up goes on
        mode = job.env.chief.consistency
        assert job.step == 0 and mode.required == 2
        await until(lambda: refusals[0] == 20, what="the look-up asked again")
        await until(lambda: not mode.checking, what="the look-up answered")
        assert job.step == 0 and set(mode.counted) == {0} and mode.required == 2
        assert (await job.status())["replicas_to_aggregate"] == 2
        await _worker_1_completes_step_0(job, job.workers[1])
        for svc in job.env.services:
            assert svc.status()["sync"]["dropped"] == {}
            assert set(svc.status()["sync"]["aggregated"]) == {"2"}  # every step of 2
        # from the next step on it no longer counts
        await until(lambda: mode.required == 1)
        await job.close()

    run(body())


def test_a_leaver_whose_look_up_the_step_outran_is_not_counted_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A look-up asked again while the step it is about gets applied (the others'
    pushes completed it): nobody is counted for the next step, N shrinks."""
    import zmqps.roles.chief.modes as modes

    monkeypatch.setattr(modes, "LOOKUP_RETRY_S", (0.01,))
    monkeypatch.setattr(modes, "LOOKUP_WAIT_S", 0.05)

    async def body() -> None:
        job = await sync_job(3, 1, replicas_to_aggregate=2)
        ps0 = job.env.chief.consistency.stepping[0]
        ask = ps0.request

        async def never(op: str, body: Any = None, *args: Any, **kwargs: Any) -> Any:
            if op == "status" and body and body.get("sync_of"):
                raise DeadlineExceeded("ps0: no answer in time")
            return await ask(op, body, *args, **kwargs)

        monkeypatch.setattr(ps0, "request", never)
        for i in (0, 1, 2):
            await job.token(i)
        await job.workers[0].push(grads(0), step=0)
        await job.leave(0)
        mode = job.env.chief.consistency
        assert mode.checking == {0} and mode.required == 2
        assert await job.workers[1].push(grads(1), step=0)
        await until(lambda: job.step == 1)
        await until(lambda: not mode.checking, what="the look-up given up")
        assert not mode.counted and mode.required == 2  # M = 2: workers 1 and 2
        await job.close()

    run(body())


def test_a_worker_gone_before_its_push_shrinks_n_at_once() -> None:
    async def body() -> None:
        job = await sync_job(2, 2)
        for i in (0, 1):
            await job.token(i)
        await job.leave(0)  # took a token, never pushed: nothing to wait for
        assert job.env.chief.consistency.required == 1
        assert await job.workers[1].push(grads(1), step=0)
        await until(lambda: job.step == 1)
        for v in DENSE:
            np.testing.assert_allclose(job.values(v.name), initial(v) - LR * grads(1)[v.name])
        await job.close()

    run(body())


def test_a_ps_without_shards_does_not_stall_the_step() -> None:
    async def body() -> None:
        # One variable in two shards on three PS: ps2 holds nothing and never steps.
        job = await sync_job(2, 3, variables=(W,))
        assert not job.env.services[2].store.ids()
        for i in (0, 1):
            await job.token(i)
        await job.workers[0].push(grads(0, [W]), step=0)
        assert (await job.status())["waiting_on"] == [1]
        await job.workers[1].push(grads(1, [W]), step=0)
        await until(lambda: job.step == 1, what="the global step")
        await job.close()

    run(body())


def test_a_token_poll_held_across_a_restore_forgets_the_step_of_before() -> None:
    """Worker 0 computed step 1 and polls for step 2, which waits on worker 1. The
    cluster is restored to step 1 meanwhile: the poll the chief holds says "computed
    step 1" of the old generation, and must get the token of step 1 at once. It used to
    wait out its poll (10 s) before asking again: sync stood still about 10 s after
    every PS restart (fault schedules 80 and 131)."""

    async def body() -> None:
        job = await sync_job(2, 1)
        chief = job.env.chief
        for i in (0, 1):
            assert await job.token(i) == 0
        for i in (0, 1):
            await job.workers[i].push(grads(i), step=0)
        await until(lambda: job.step == 1, what="step 0 applied")
        assert await job.token(0) == 1
        await job.workers[0].push(grads(0), step=1)  # worker 1 has not pushed step 1
        poll = asyncio.ensure_future(
            call(chief, "take_token", who(0, wait=5.0, have=1, have_gen=0))
        )
        await asyncio.sleep(0.2)
        assert not poll.done()  # step 2 waits on worker 1
        # a restore to step 1 (generation 1), as far as the tokens are concerned
        chief.recovery.gen = 1
        chief.consistency.tokens.restart(1)
        await chief.consistency.membership_changed()  # wakes the polls it holds
        rep = await asyncio.wait_for(poll, 1.0)
        assert rep.body["step"] == 1
        # a poll of the new generation still counts: no second token of step 1
        again = asyncio.ensure_future(
            call(chief, "take_token", who(0, wait=5.0, have=1, have_gen=1))
        )
        await asyncio.sleep(0.2)
        assert not again.done()
        again.cancel()
        await job.close()

    run(body())


@pytest.mark.parametrize("reason", ["terminated", "error"])
def test_a_worker_that_left_unfinished_keeps_its_share_until_it_is_back(reason: str) -> None:
    """N = M = 2. Worker 1 leaves unfinished (SIGTERM: ``terminated``; a crash its loop
    caught: ``error``) and is started again a few seconds later, as ``zmqps launch``
    or an orchestrator does. N shrank to 1 at the leave: worker 0 trained alone
    meanwhile, hundreds of steps of one gradient in a launch (its global step and
    model not the unfaulted run's). The step waits for the leaver's share, as for a
    worker killed outright until it is counted dead; back, it takes its token."""

    async def body() -> None:
        job = await sync_job(2, 1)
        assert await job.token(0) == 0
        await job.leave(1, reason=reason)  # gone, expected back
        mode = job.env.chief.consistency
        assert mode.required == 2 and mode.replicas() == 2
        assert await job.workers[0].push(grads(0), step=0)
        await asyncio.sleep(0.05)
        assert job.step == 0  # not applied from worker 0's gradient alone
        job.env.clock.now += 5.0  # started again within the heartbeat timeout
        await call(job.env.chief, "register", who(1, 1))  # a new incarnation
        assert mode.required == 2
        assert (await call(job.env.chief, "take_token", who(1, 1, wait=1.0))).body["step"] == 0
        again = ParameterClient(
            [job.env.net.client(a, "worker:1:1") for a in job.env.cfg.cluster.ps],
            job.placement,
            worker="worker:1",
            incarnation=1,
            shared_memory=False,
        )
        await _worker_1_completes_step_0(job, again)
        for svc in job.env.services:
            assert set(svc.status()["sync"]["aggregated"]) == {"2"}
        await job.close()

    run(body())


def test_a_worker_that_left_unfinished_and_is_not_back_stops_counting_after_the_timeout() -> None:
    """Not back within the heartbeat timeout: the steps go on without it (N shrinks),
    as for a worker counted dead; its gradient already in the step still counts."""

    async def body() -> None:
        job = await sync_job(3, 1)
        for i in (0, 1, 2):
            assert await job.token(i) == 0
        assert await job.workers[2].push(grads(2), step=0)
        await job.leave(2, reason="terminated")
        await job.leave(1, reason="terminated")  # took a token, never pushed
        chief, mode = job.env.chief, job.env.chief.consistency
        assert mode.required == 3
        assert await job.workers[0].push(grads(0), step=0)
        await asyncio.sleep(0.05)
        assert job.step == 0
        job.env.clock.now += chief.cfg.heartbeat_timeout + 1
        await call(chief, "heartbeat", who(0, step=0))  # worker 0 is alive
        assert chief.members.lapsed(job.env.clock.now) == [1, 2]
        assert mode.replicas() == 2  # worker 0, and worker 2 whose gradient the step holds
        # what the chief's watch does when it sees them lapse
        await mode.membership_changed(gone=[1, 2])
        await until(lambda: job.step == 1, what="step 0 applied without worker 1")
        for v in DENSE:  # worker 2's gradient (in the step before it left) counted
            g0, g2 = grads(0)[v.name], grads(2)[v.name]
            np.testing.assert_allclose(job.values(v.name), initial(v) - LR * (g0 + g2) / 2)
        await until(lambda: mode.required == 1)
        assert await job.token(0) == 1
        await job.close()

    run(body())


def test_workers_leaving_one_by_one_as_the_run_stops_apply_no_step_with_fewer_gradients() -> None:
    """The whole run stopped (SIGTERM to the launcher): worker 1 left after step 0, and
    worker 0's push of step 1, which came after, was applied alone (N shrank to 1): the
    resumed run took one step more than the unfaulted one, its values not the same.
    While the run stops, a leave keeps N: step 1 stays open and the values are step 1's
    (a leave while the run goes on still shrinks N: the test above)."""

    async def body() -> None:
        job = await sync_job(2, 1)
        for i in (0, 1):
            assert await job.token(i) == 0
            assert await job.workers[i].push(grads(i), step=0)
        await until(lambda: job.step == 1, what="step 0 applied")
        before = job.values(DENSE[0].name).copy()
        assert await job.token(0) == 1
        job.env.chief.shutdown_requested.set()  # the chief's signal
        await job.leave(1, reason="terminated")
        assert job.env.chief.consistency.required == 2
        await job.workers[0].push(grads(7), step=1)  # taken, toward a step left open
        await asyncio.sleep(0.2)
        assert job.step == 1 and (await job.status())["global_step"] == 1
        np.testing.assert_array_equal(job.values(DENSE[0].name), before)
        await job.leave(0, reason="terminated")
        assert job.env.chief.consistency.required == 2
        await job.close()

    run(body())


def test_a_worker_counted_dead_while_the_other_finished_gets_tokens_when_back() -> None:
    """N = M = 2. Worker 0 pushes step 0 and runs out of data; worker 1 is stopped past
    the heartbeat timeout, counted dead: step 0 is applied from worker 0's gradient and
    step 1 begins with M = 0. Worker 1 comes back: M is 1 again and step 1 has a token
    for it (it used to find none, and sync hung for ever)."""

    async def body() -> None:
        job = await sync_job(2, 1)
        for i in (0, 1):
            assert await job.token(i) == 0
        await job.workers[0].push(grads(0), step=0)
        await job.leave(0)  # out of data: its gradient still counts for step 0
        job.env.clock.now += 11.0  # worker 1 silent past the heartbeat timeout
        await job.env.chief.consistency.membership_changed(gone=[1])  # what the watcher does
        await until(lambda: job.step == 1, what="step 0 applied without worker 1")
        st = await job.status()
        assert (st["total_replicas"], st["tokens_available"]) == (0, 0)
        await call(job.env.chief, "heartbeat", who(1, step=0))  # SIGCONT: it is back
        await job.env.chief.consistency.membership_changed(back=[1])
        assert (await job.status())["tokens_available"] == 1
        assert await job.token(1) == 1
        assert await job.workers[1].push(grads(1), step=1)
        await until(lambda: job.step == 2, what="worker 1 alone makes step 1")
        await job.close()

    run(body())


def test_a_worker_gone_with_a_token_does_not_hold_a_live_ones() -> None:
    """Worker 0 took step 0's token and left without pushing (out of data); M = 1:
    worker 1 still finds its token (the token of a worker not counted in M is free)."""

    async def body() -> None:
        job = await sync_job(2, 1, total_replicas=1)
        assert await job.token(0) == 0
        await job.leave(0)
        assert await job.token(1) == 0
        await job.close()

    run(body())


def test_applied_step_does_not_lag_behind_the_ps() -> None:
    async def body() -> None:
        job = await sync_job(2, 2)
        for i in (0, 1):
            await job.token(i)
        await job.close()  # the loop stops: it will not hear of the next step
        for i in (0, 1):
            await job.workers[i].push(grads(i), step=0)
        driver = job.env.chief.consistency
        assert driver.global_step == 0
        assert await driver.applied_step() == 1  # what the end-of-training summary reports

    run(body())


# ============================================================== SSP (chief)


def test_ssp_clock_long_poll_and_bound() -> None:
    async def body() -> None:
        env = make_env(1, 3, sync=SyncConfig(mode="ssp", max_staleness=2))
        for i in range(3):
            await call(env.chief, "register", who(i))
        rep = await call(env.chief, "ssp_clock", who(0, completed=2, wait=0.05))
        assert rep.body == {"slowest": 0}
        with pytest.raises(NotReady):
            await call(env.chief, "ssp_clock", who(0, completed=3, wait=0.0))
        waiter = asyncio.ensure_future(call(env.chief, "ssp_clock", who(0, completed=3, wait=2.0)))
        await call(env.chief, "ssp_clock", who(1, completed=1, wait=0.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # worker 2 is still at 0
        await call(env.chief, "ssp_clock", who(2, completed=1, wait=0.0))
        assert (await asyncio.wait_for(waiter, 1.0)).body == {"slowest": 1}
        st = env.chief.status()
        assert st["ssp"] == {
            "max_staleness": 2,
            "clocks": {"0": 3, "1": 1, "2": 1},
            "max_spread": 2,
        }
        with pytest.raises(InvalidArgument, match="ssp mode"):
            await call(env.chief, "take_token", who(0))

    run(body())


def test_ssp_waits_for_workers_not_registered_yet() -> None:
    async def body() -> None:
        env = make_env(1, 2, sync=SyncConfig(mode="ssp", max_staleness=1))
        await call(env.chief, "register", who(0))
        await call(env.chief, "ssp_clock", who(0, completed=1, wait=0.0))
        with pytest.raises(NotReady):  # worker 1 has not even started
            await call(env.chief, "ssp_clock", who(0, completed=2, wait=0.0))
        waiter = asyncio.ensure_future(call(env.chief, "ssp_clock", who(0, completed=2, wait=2.0)))
        # the status names who holds the step back, although it never registered
        # (a worker stopped just as the chief restarted: fault schedule 5 of run 8)
        st = (await call(env.chief, "status")).body
        assert st["waiting_on"] == [1]
        await call(env.chief, "register", who(1))
        await call(env.chief, "ssp_clock", who(1, completed=1, wait=0.0))
        assert (await asyncio.wait_for(waiter, 1.0)).body == {"slowest": 1}
        assert (await call(env.chief, "status")).body["waiting_on"] == []

    run(body())


def test_ssp_stops_waiting_for_a_dead_worker() -> None:
    async def body() -> None:
        env = make_env(1, 2, sync=SyncConfig(mode="ssp", max_staleness=0), heartbeat_timeout=5.0)
        for i in (0, 1):
            await call(env.chief, "register", who(i))
        await call(env.chief, "ssp_clock", who(0, completed=0, wait=0.0))
        with pytest.raises(NotReady):  # lock-step: worker 1 has not finished step 0
            await call(env.chief, "ssp_clock", who(0, completed=1, wait=0.0))
        env.clock.now += 6.0
        rep = await call(env.chief, "ssp_clock", who(0, completed=1, wait=0.0))
        assert rep.body == {"slowest": 1}  # worker 1 is dead: only worker 0 is live

    run(body())


# ============================================================== zmqps status (text)


def test_status_text_for_sync_and_ssp() -> None:
    base = {"global_step": 7, "examples": 0, "workers_alive": [0, 2], "workers_expected": 3}
    sync = {
        **base,
        "mode": "sync",
        "replicas_to_aggregate": 2,
        "total_replicas": 3,
        "tokens_available": 1,
        "tokens_discarded": 4,
        "waiting_on": [1],
        "step_age_s": 2.5,
    }
    text = format_status(sync)
    assert "N = 2 of M = 3" in text
    assert "1 available (4 discarded)" in text
    assert "step waits on worker 1 (for 2.5s)" in text
    assert "step waits on nobody" in format_status({**sync, "waiting_on": []})
    blocked = format_status({**sync, "phase": "running", "blocker": "step 7 waits on worker 1"})
    assert "mode          sync  (running)" in blocked
    assert "blocked       step 7 waits on worker 1" in blocked
    ssp = {**base, "mode": "ssp", "ssp": {"max_staleness": 2, "clocks": {}, "max_spread": 2}}
    assert "max staleness 2, largest spread granted 2" in format_status(ssp)
    assert "step waits on" not in format_status(ssp)


def test_a_refused_gradient_counts_toward_n_with_nothing_in_it() -> None:
    # N = 3: worker 1's gradient was refused (not finite): the step is made of three
    # gradients all the same, and its mean is of the two others
    store = one_ps_store([W])
    sync = SyncShards(store, required=3)
    g0, g2 = grads(1, [W])["w"].reshape(-1), grads(2, [W])["w"].reshape(-1)
    assert not sync.add_dense(0, [(0, g0)], "worker:0")
    assert not sync.refuse(0, "worker:1")
    assert sync.has_contributed(0, "worker:1", 0) is False  # step 0: extra tokens
    assert sync.add_dense(0, [(0, g2)], "worker:2")
    expected = initial(W).reshape(-1) - LR * (g0 + g2) / 2
    np.testing.assert_allclose(store.get(0).values.reshape(-1), expected, rtol=1e-6)
    assert (sync.step_of(0), store.get(0).version) == (1, 1)
    # a step of refused gradients only: the step advances, no value changes
    before = store.get(0).values.copy()
    for w in ("worker:0", "worker:1"):
        assert not sync.refuse(0, w)
    assert sync.contributors_of_current_step() == ["worker:0", "worker:1"]
    assert sync.refuse(0, "worker:2")
    np.testing.assert_array_equal(store.get(0).values, before)
    assert (sync.step_of(0), store.get(0).version, sync.steps_applied) == (2, 1, 2)
    # a refused gradient also counts when N shrinks
    sync.refuse(0, "worker:0")
    assert sync.set_required(1) == [0]
    assert sync.status()["aggregated"] == {"0": 2, "2": 1}


def test_step_waiters_wake_the_due_ones_and_forget_the_ended() -> None:
    import asyncio

    from zmqps.roles.ps.modes import StepWaiters

    async def body() -> None:
        step = [0]
        w = StepWaiters(lambda: step[0])
        due = [asyncio.ensure_future(w.wait(t, 60.0)) for t in (3, 1, 2, 5)]
        # a flood of polls for a step that never comes, all cancelled (their peer's
        # server stopped): each is forgotten, and the heap is compacted
        flood = [asyncio.ensure_future(w.wait(10**9, 300.0)) for _ in range(5000)]
        await asyncio.sleep(0)
        assert len(w) == 5004
        for f in flood:
            f.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        assert len(w) == 4 and len(w._heap) <= 2 * 4 + 64
        step[0] = 2
        w.notify()
        await asyncio.wait(due, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0.01)
        assert [f.done() for f in due] == [False, True, True, False]
        assert due[1].result() == 2
        step[0] = 5
        w.notify()
        assert await asyncio.gather(*due) == [5, 2, 2, 5]
        assert len(w) == 0
        assert await w.wait(4, 1.0) == 5  # reached already: no wait

    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_batch_redone_by_a_new_incarnation_after_its_step_went_on_is_not_applied_twice() -> None:
    """Worker 1's first incarnation pushed batch 5 for step 0 and died; the step went on
    without it; its new incarnation redoes batch 5 with a token of step 1. The PS that
    counted batch 5 already must not apply it again: it counts toward step 1 as nobody's
    gradient (the step waits for no one), so step 1 is worker 0's gradient alone."""

    async def body() -> None:
        c = await sync_cluster(required=2)
        w0, old, new = c.client("worker:0"), c.client("worker:1", 1), c.client("worker:1", 2)
        g0, g1, g0b, redo = grads(0), grads(1), grads(2), grads(3)
        assert await old.push(g1, step=0, cursor=5)
        assert await w0.push(g0, step=0, cursor=1)
        after0 = {v.name: c.shard_values(v.name) for v in DENSE}
        assert not await new.push(redo, step=1, cursor=5)
        assert new.dropped == {"duplicate": 2}  # one reply per PS
        for v in DENSE:  # counted toward step 1, applied nowhere
            np.testing.assert_array_equal(c.shard_values(v.name), after0[v.name])
        assert await w0.push(g0b, step=1, cursor=2)
        for v in DENSE:
            expected = after0[v.name] - LR * g0b[v.name]  # the mean of the others: one
            np.testing.assert_allclose(c.shard_values(v.name), expected, rtol=1e-6)
        assert [ps_sync(c, i)["step"] for i in (0, 1)] == [2, 2]
        # its next batch is trained as usual
        assert await new.push(grads(4), step=2, cursor=6)
        assert [svc.pushes.progress("worker:1") for svc in c.services] == [(6, 2)] * 2

    run(body())


def test_a_leaver_held_by_a_ps_whose_step_is_open_counts_though_another_ps_applied_it() -> None:
    """N = 2 of M = 3, one variable on each PS. ps0 applies step 0 from workers 0 and 1;
    on ps1 the step still holds only worker 0's gradient when worker 2 (a backup that
    never pushed) and then worker 0 leave. Worker 0 must keep counting in M for ps1's
    open step: the look-up used to give up at the first PS past the step, so M fell to
    1, N with it, and ps1 applied the step from worker 0 alone; worker 1's gradient then
    came stale (the load simulator's flaky "ps 1 averaged 27 of 28")."""
    v0 = VariableDef("v0", (4, 2), init={"name": "normal", "seed": 3})
    v1 = VariableDef("v1", (3,), init={"name": "normal", "seed": 4})

    async def body() -> None:
        job = await sync_job(3, 2, variables=(v0, v1), num_shards=1, replicas_to_aggregate=2)
        assert {job.placement.shards_of(n)[0].ps for n in ("v0", "v1")} == {0, 1}
        on0, on1 = sorted((v0, v1), key=lambda v: job.placement.shards_of(v.name)[0].ps)
        for i in (0, 1, 2):
            await job.token(i)
        g = {i: grads(i, (v0, v1)) for i in (0, 1)}
        for i in (0, 1):
            assert await job.workers[i].push({on0.name: g[i][on0.name]}, step=0)
        assert await job.workers[0].push({on1.name: g[0][on1.name]}, step=0)
        await job.leave(2)
        await job.leave(0)
        await asyncio.sleep(0.01)
        assert (await job.status())["replicas_to_aggregate"] == 2
        assert await job.workers[1].push({on1.name: g[1][on1.name]}, step=0)
        await until(lambda: job.step == 1, what="the global step")
        for v in (v0, v1):
            want = initial(v) - LR * (g[0][v.name] + g[1][v.name]) / 2
            np.testing.assert_allclose(job.values(v.name), want, rtol=1e-5, atol=1e-6)
        for svc in job.env.services:
            assert svc.status()["sync"]["dropped"] == {}
        await job.close()

    run(body())


# ---------------------------------------------------------------- tokens handed by a PS


def test_released_tokens_hand_one_token_of_a_step_per_worker_that_has_not_computed_it() -> None:
    t = ReleasedTokens(max_waits=2)
    assert t.grant(None, None) is None  # nothing released yet
    assert t.release(3, gen=1)
    assert not t.release(3, gen=1) and not t.release(2, gen=1)  # resent or late: no news
    assert not t.release(9, gen=0)  # of an older generation (a chief since restored)
    assert t.grant(2, 1) == (3, 1)
    assert t.grant(2, 1) == (3, 1)  # the same request again: the same token
    assert t.grant(None, None) == (3, 1)  # says nothing: like the chief's ledger
    assert t.grant(3, 1) is None  # computed it already: waits for the next release
    assert t.grant(7, 0) == (3, 1)  # an older generation's step: nothing computed
    assert t.grant(0, 2) is None  # knows a newer generation than this PS: waits for it
    assert t.granted == 4
    for waited in (0.1, 0.2, 0.3):
        t.waited(waited)
    assert t.report() == (3, 4, [0.1, 0.2])  # at most max_waits between two reports
    assert t.report() == (3, 4, [])
    assert t.release(4, gen=1) and t.granted == 0
    t.clear()  # a restore
    assert t.grant(-1, 2) is None and t.report()[0] is None
    assert t.release(0, gen=2) and t.grant(-1, 2) == (0, 2)


def test_the_chief_names_a_ps_for_the_next_token_and_the_ps_hands_it_when_released() -> None:
    """The steps of the oracle test, each worker taking its tokens where the last one
    said: the chief answers each worker's first request only, the PS the rest; the
    values are those of the steps on the mean, and the chief counts the tokens the
    PS handed (status, token wait metrics)."""

    async def body() -> None:
        job = await sync_job(3, 2)
        links = [[job.env.net.client(a, f"worker:{i}:0") for a in job.env.cfg.cluster.ps]
                 for i in range(3)]  # fmt: skip
        asked: list[int | None] = [None] * 3
        have = [-1] * 3
        params = {v.name: initial(v) for v in DENSE}
        slots: dict[str, dict[str, np.ndarray]] = {}
        waits: list[float] = []
        job.env.chief.consistency.on_token_waits = waits.extend
        from_chief = 0
        for step in range(4):
            for i in range(3):
                body = who(i, wait=2.0, have=have[i], have_gen=0)
                if asked[i] is None:
                    rep = await call(job.env.chief, "take_token", body)
                    from_chief += 1
                else:
                    rep = await links[i][asked[i]].request("take_token", body)
                assert rep.body["step"] == step
                asked[i], have[i] = rep.body["ps"], step
                assert asked[i] in (0, 1)
            if step == 1:  # zmqps status asks the PS what they handed
                assert (await job.status())["tokens_available"] == 0
            gs = [grads(10 * step + i) for i in range(3)]
            for i in (1, 2, 0):
                assert await job.workers[i].push(gs[i], step=step)
            await until(lambda s=step: job.step == s + 1, what=f"global step {step + 1}")
            step_reference(params, slots, SGD, mean(gs), step + 1)
            for v in DENSE:
                np.testing.assert_allclose(job.values(v.name), params[v.name], atol=1e-6)
        assert from_chief == 3  # one per worker: every later token came from a PS
        assert len(waits) == 3 * 3  # the PS's 9 tokens of steps 1-3, reported
        # step 4 is released (all pushed step 3); a worker that computed it waits for
        # step 5, then hears NotReady: it asks the chief, whose answer holds
        await until(lambda: job.env.services[asked[0]].tokens.step == 4, what="release 4")
        rep = await links[0][asked[0]].request("take_token", who(0, wait=1.0, have=3, have_gen=0))
        assert rep.body["step"] == 4
        with pytest.raises(NotReady):
            await links[0][asked[0]].request("take_token", who(0, wait=0.05, have=4, have_gen=0))
        await job.close()

    run(body())


def test_a_restored_ps_hands_no_token_until_the_chief_releases_again() -> None:
    async def body() -> None:
        job = await sync_job(2, 1)
        link = job.env.net.client(job.env.cfg.cluster.ps[0], "worker:0:0")
        rep = await call(job.env.chief, "take_token", who(0, wait=1.0, have=-1, have_gen=0))
        assert rep.body["ps"] == 0
        ps = job.env.services[0]
        await until(lambda: ps.tokens.step == 0, what="step 0 released to the PS")
        ps.tokens.clear()  # what a restore does
        with pytest.raises(NotReady):
            await link.request("take_token", who(0, wait=0.05, have=-1, have_gen=0))
        await job.close()

    run(body())


class _CopiesBehindPS:
    """A replicated PS state that applied step 1 while its copies do not all have it:
    its step polls answer step 0 (what every copy has), its status step 1."""

    endpoint = "ps-behind"

    def __init__(self) -> None:
        self.polls = 0

    async def request(self, op: str, body: Any = None, *args: Any, **kwargs: Any) -> Any:
        if op == "sync_config":
            return None
        if op == "wait_step":
            self.polls += 1
            await asyncio.sleep(0.01)
            return Message("wait_step", 1, b"", {"step": 0}, [])
        assert op == "status"
        sync = {"step": 1, "contributors": [], "granted_of": 0, "granted": 0}
        replica = {"committed": 7, "head": 9, "backups": {"2": 7}}
        return Message("status", 1, b"", {"sync": sync, "replica": replica}, [])


def test_a_step_held_by_a_states_copies_is_not_blamed_on_the_workers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Fault schedule 7012: every PS state had applied step 1, one's copies did not
    all have it, and the chief stood at step 0 for 97 s, its status saying "step 0
    waits on worker 0, worker 1" (who had both pushed) and its log nothing. The
    workers are no longer named, the status says which state's copies hold the step,
    and the log says it with the primary's account of its backups."""
    import zmqps.roles.chief.modes as modes

    monkeypatch.setattr(modes, "BEHIND_REPORT_S", 0.05)
    monkeypatch.setattr(modes, "BEHIND_LOOK_S", 0.05)  # the first look says it

    async def body() -> None:
        ps = _CopiesBehindPS()
        mode = SyncMode(SyncConfig(mode="sync"), Membership(2), [ps], clock=time.monotonic)
        task = asyncio.ensure_future(mode.start([0], 0))
        await until(lambda: mode.held_by_copies(), what="the state held by its copies")
        assert await mode.waiting_on([0, 1]) == []  # it applied the step: waits on nobody
        assert mode.global_step == 0 and 0 in mode.held_by_copies()
        mode.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert mode.held_by_copies() == {}  # the loop's wait is over: nothing held

    with caplog.at_level(logging.WARNING, logger="zmqps.chief"):
        run(body())
    said = [r.getMessage() for r in caplog.records if "its copies" in r.getMessage()]
    assert said and "applied step 1" in said[0] and "entry 7 of 9 committed" in said[0], said


def test_copies_holding_a_step_are_named_before_the_log_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Replicated fault schedule 9305: a step held by a state's copies was named by the
    status only at the log's first report (15 s), so for the first 15 s of a long wait
    the status named no blocker. The chief looks at the state's status sooner than it
    logs: the status names the copies while the log has said nothing yet."""
    import zmqps.roles.chief.modes as modes

    monkeypatch.setattr(modes, "BEHIND_LOOK_S", 0.02)  # the log's report stays at 15 s

    async def body() -> None:
        ps = _CopiesBehindPS()
        mode = SyncMode(SyncConfig(mode="sync"), Membership(2), [ps], clock=time.monotonic)
        task = asyncio.ensure_future(mode.start([0], 0))
        await until(lambda: mode.held_by_copies(), what="the state held by its copies")
        assert 0 in mode.held_by_copies()
        mode.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.INFO, logger="zmqps.chief"):
        run(body())
    assert not [r for r in caplog.records if "waits on ps" in r.getMessage()]


class _PushesMissingPS(_CopiesBehindPS):
    """A PS state at step 0 holding one push of the two the step needs."""

    async def request(self, op: str, body: Any = None, *args: Any, **kwargs: Any) -> Any:
        if op != "status":
            return await super().request(op, body, *args, **kwargs)
        sync = {"step": 0, "required": 2, "contributors": ["worker:0"]}
        return Message("status", 1, b"", {"sync": sync}, [])


def test_a_step_waiting_for_pushes_names_those_in_not_the_ps(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A sync chief whose worker 1 was stopped logged "step 1 waits on ps 0's state",
    as if the PS were at fault: the line says whose pushes the PS has, and that the
    step waits for the others'."""
    import zmqps.roles.chief.modes as modes

    monkeypatch.setattr(modes, "BEHIND_REPORT_S", 0.05)
    monkeypatch.setattr(modes, "BEHIND_LOOK_S", 0.05)

    async def body() -> None:
        ps = _PushesMissingPS()
        mode = SyncMode(SyncConfig(mode="sync"), Membership(2), [ps], clock=time.monotonic)
        task = asyncio.ensure_future(mode.start([0], 0))
        await until(
            lambda: any("waits on ps" in r.getMessage() for r in caplog.records),
            what="the line",
        )
        mode.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.INFO, logger="zmqps.chief"):
        run(body())
    said = [r.getMessage() for r in caplog.records if "waits on ps" in r.getMessage()]
    assert "the pushes of worker:0 of the 2 it needs are in" in said[0], said
    assert "waits for the other workers' pushes" in said[0], said


class _BusyPS(_CopiesBehindPS):
    """A PS whose pending requests are at their bound (other peers' long polls, a
    flood): it refuses the chief's step polls ``busy`` for a while, then answers."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.refusals = refusals

    async def request(self, op: str, body: Any = None, *args: Any, **kwargs: Any) -> Any:
        if op == "wait_step" and self.refusals > 0:
            self.refusals -= 1
            self.polls += 1
            raise Busy("ps0: too many requests of all peers pending")
        return await super().request(op, body, *args, **kwargs)


def test_a_ps_refusing_the_chiefs_step_polls_never_ends_the_stepping_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flood of long polls from other peers filled a PS's pending requests; it
    refused the chief's step polls ``busy`` and the chief exited with that error (a
    sync run stood, then lost its chief). The chief asks again after a back-off, its
    status names the PS meanwhile, and it goes on once the PS takes its polls."""
    import zmqps.roles.chief.modes as modes

    monkeypatch.setattr(modes, "BUSY_BACKOFF_S", (0.01,))

    async def body() -> None:
        ps = _BusyPS(refusals=30)
        mode = SyncMode(SyncConfig(mode="sync"), Membership(2), [ps], clock=time.monotonic)
        task = asyncio.ensure_future(mode.start([0], 0))
        await until(lambda: mode.refused_by(), what="the PS named as refusing")
        assert 0 in mode.refused_by()
        await until(lambda: ps.refusals == 0 and ps.polls > 31, what="polls taken again")
        await until(lambda: not mode.refused_by(), what="the refusal forgotten")
        assert not task.done()
        mode.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    run(body())


class _OddStatusPS(_CopiesBehindPS):
    """A PS whose status has the wrong shapes (a list for ``sync``, a string for
    ``replica``): the chief's stepping loop reads past them."""

    async def request(self, op: str, body: Any = None, *args: Any, **kwargs: Any) -> Any:
        if op == "status":
            return Message("status", 1, b"", {"sync": [1], "replica": "x"}, [])
        return await super().request(op, body, *args, **kwargs)


def test_a_status_of_the_wrong_shape_never_ends_the_stepping_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import zmqps.roles.chief.modes as modes

    monkeypatch.setattr(modes, "BEHIND_REPORT_S", 0.02)
    monkeypatch.setattr(modes, "BEHIND_LOOK_S", 0.02)

    async def body() -> None:
        ps = _OddStatusPS()
        mode = SyncMode(SyncConfig(mode="sync"), Membership(2), [ps], clock=time.monotonic)
        task = asyncio.ensure_future(mode.start([0], 0))
        await until(lambda: ps.polls > 10, what="polls past several reports")
        assert not task.done() and mode.held_by_copies() == {}
        mode.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    run(body())
