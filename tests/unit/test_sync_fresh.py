"""Sync: the next step's values with the push's reply (``Push.fresh``).

The PS half runs through the in-memory cluster of tests/unit/test_ps_client.py (the
chief's polls played by hand), over TCP-style frames and over shared memory; the
worker half is :class:`~zmqps.roles.worker.fresh.FreshValues`, which decides when a
push asks and when a pull may return what it brought.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_ps_client import run
from test_sync import DENSE, grads, ps_sync, sync_cluster
from test_sync_push_token import released_ahead

from zmqps.roles.channels import Delivery
from zmqps.roles.client import ParameterClient
from zmqps.roles.ps import service as ps_service
from zmqps.roles.worker.fresh import MAX_BACKOFF, FreshValues

NAMES = [v.name for v in DENSE]

# ------------------------------------------------------------------ the PS


async def fresh_push(
    w: ParameterClient, seed: int, step: int | None, token: bool = True
) -> tuple[bool, Delivery]:
    """A sync push that asks for the values of after its step (as the worker sends it):
    whether it was applied, and its delivery (what its replies brought)."""
    asks = Delivery(token_ps=0 if token else None, fresh=True)
    return await w.push(grads(seed), pull=True, step=step, delivery=asks), asks


def assert_params_are_the_ps_values(c: object, w: ParameterClient) -> None:
    for name in NAMES:
        np.testing.assert_array_equal(w.params[name], c.shard_values(name))  # type: ignore[attr-defined]


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
@pytest.mark.parametrize("num_ps", [1, 2])
def test_the_reply_is_held_until_the_step_is_applied_and_brings_its_values(
    shm: bool, num_ps: int
) -> None:
    async def body() -> None:
        c = await sync_cluster(required=2, num_ps=num_ps)
        for i in range(num_ps):
            await released_ahead(c, 1, ps=i)
        w0, w1 = c.client("worker:0", shared_memory=shm), c.client("worker:1", shared_memory=shm)
        for w in (w0, w1):
            await w.pull()
        before = {n: w0.params[n].copy() for n in NAMES}
        first = asyncio.ensure_future(fresh_push(w0, 0, step=0))
        await asyncio.sleep(0.02)
        assert not first.done()  # held: the step waits for worker 1
        for n in NAMES:  # nothing landed in the worker's arrays meanwhile
            np.testing.assert_array_equal(w0.params[n], before[n])
        applied1, asks1 = await fresh_push(w1, 1, step=0)
        applied0, asks0 = await first
        assert applied0 and applied1
        for w, asks in ((w0, asks0), (w1, asks1)):
            assert w.fresh_step(NAMES, asks) == 1  # the values of step 1: the next token's
            assert asks.offered == (1, 0, 0)
            assert_params_are_the_ps_values(c, w)
            assert not np.array_equal(w.params["w"], before["w"])  # the step's update
        assert [ps_sync(c, i)["step"] for i in range(num_ps)] == [1] * num_ps

    run(body())


def test_a_stale_push_brings_the_values_at_once() -> None:
    async def body() -> None:
        c = await sync_cluster(required=2, num_ps=1)  # N = 2 of 3 workers
        await released_ahead(c, 1)
        w0, w1, w2 = (c.client(f"worker:{i}") for i in range(3))
        for w in (w0, w1, w2):
            await w.pull()
        await asyncio.gather(fresh_push(w0, 0, step=0), fresh_push(w1, 1, step=0))
        applied, asks = await fresh_push(w2, 2, step=0)
        assert not applied  # late: dropped as stale
        assert w2.dropped == {"stale": 1}
        assert w2.fresh_step(NAMES, asks) == 1
        assert_params_are_the_ps_values(c, w2)

    run(body())


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_a_step_not_applied_within_the_wait_brings_no_values(
    monkeypatch: pytest.MonkeyPatch, shm: bool
) -> None:
    monkeypatch.setattr(ps_service, "PUSH_TOKEN_WAIT_S", 0.02)

    async def body() -> None:
        c = await sync_cluster(required=2, num_ps=1)
        await released_ahead(c, 1)
        w0 = c.client("worker:0", shared_memory=shm)
        await w0.pull()
        before = {n: w0.params[n].copy() for n in NAMES}
        applied, asks = await fresh_push(w0, 0, step=0)
        assert applied  # counted; the step waits for another
        assert w0.fresh_step(NAMES, asks) is None  # the worker pulls, as without
        assert asks.offered is None
        for n in NAMES:  # nothing written into the worker's arrays
            np.testing.assert_array_equal(w0.params[n], before[n])
        assert ps_sync(c, 0)["step"] == 0
        await w0.pull()  # and the pull that follows is a plain one
        for n in NAMES:
            np.testing.assert_array_equal(w0.params[n], before[n])

    run(body())


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "token"])
def test_at_the_servers_pending_bound_a_held_reply_is_answered_at_once_not_busy(
    fresh: bool,
) -> None:
    """Every place of the PS's pending requests held by long polls of other peers (one
    each: none is evicted). A sync push that would hold its reply was answered ``busy``
    after it was applied: sent again, it was a duplicate, and the worker counted its
    applied push dropped. It is answered at once, as after its wait: applied, without
    values or token (the worker pulls and asks for its token as without)."""

    async def body() -> None:
        c = await sync_cluster(required=2, num_ps=1)
        await released_ahead(c, 1)
        dispatcher = c.net._dispatcher("ps0")
        assert dispatcher is not None
        dispatcher.max_pending = 3
        poll = {"role": "worker", "index": 9, "wait": 5.0, "have": 5}  # never released
        polls = [
            asyncio.ensure_future(
                c.net.client("ps0", f"other:{i}").request("take_token", {**poll, "incarnation": i})
            )
            for i in range(3)
        ]
        await asyncio.sleep(0.02)
        assert dispatcher.pending == 3
        w0 = c.client("worker:0")
        await w0.pull()
        before = {n: w0.params[n].copy() for n in NAMES}
        asks = Delivery(token_ps=0, fresh=fresh)
        applied = await w0.push(grads(0), pull=fresh, step=0, delivery=asks)
        assert applied and w0.dropped == {}
        assert dispatcher.stats.busy == 0 and not c.services[0].dropped  # no duplicate
        assert asks.offered is None and w0.fresh_step(NAMES, asks) is None
        for n in NAMES:  # nothing brought into the worker's arrays
            np.testing.assert_array_equal(w0.params[n], before[n])
        assert ps_sync(c, 0)["contributors"] == ["worker:0"]
        for p in polls:
            p.cancel()

    run(body())


def test_outside_sync_and_on_a_replicated_state_the_reply_is_at_once_and_bare() -> None:
    async def body() -> None:
        c = await sync_cluster(required=1, num_ps=1)
        w0 = c.client("worker:0")
        await w0.pull()
        c.services[0].replica = object()  # as a primary: its sync replies go elsewhere
        try:
            applied, asks = await fresh_push(w0, 0, step=0, token=False)
        finally:
            c.services[0].replica = None
        assert applied
        assert w0.fresh_step(NAMES, asks) is None
        await c.net.client("ps0", "chief:0").request(
            "sync_config", {"mode": "async", "required": 1}
        )
        before = {n: w0.params[n].copy() for n in NAMES}
        applied, asks = await fresh_push(w0, 1, step=None, token=False)
        assert applied
        assert w0.fresh_step(NAMES, asks) is None
        for n in NAMES:  # applied, but brought back nothing
            np.testing.assert_array_equal(w0.params[n], before[n])
        assert not np.array_equal(c.shard_values("w"), before["w"])

    run(body())


def test_a_worker_asks_only_the_ps_that_said_they_take_the_field() -> None:
    async def body() -> None:
        c = await sync_cluster(required=1, num_ps=2)
        w = c.client("worker:0")
        await w.pull()
        assert not w.takes_fresh(NAMES)  # nothing heard yet (an older PS refuses it)
        assert await w.push(grads(0), step=0)  # a sync PS's push reply says so
        assert w.takes_fresh(NAMES)
        c.services[1].replica = object()  # one state becomes a replicated primary
        try:
            applied, _ = await fresh_push(w, 1, step=1, token=False)
            assert applied
        finally:
            c.services[1].replica = None
        assert w.fresh_ps == {0}  # its bare reply did not say it: not asked again
        assert not w.takes_fresh(NAMES)

    run(body())


# ------------------------------------------------------------------ the worker


def test_asked_only_after_a_whole_pull_and_for_a_push_of_every_variable() -> None:
    f = FreshValues()
    assert not f.ask(NAMES, NAMES)  # no pull yet
    assert not f.serve(0, 0, None, NAMES)  # a whole pull
    assert f.ask(NAMES, NAMES)
    assert not f.ask(NAMES[:1], NAMES)  # a push of some variables only
    assert not f.serve(0, 0, NAMES[:1], NAMES)  # a pull of some only
    assert not f.ask(NAMES, NAMES)
    f.serve(0, 0, NAMES, NAMES)  # all of them, named
    assert f.ask(NAMES, NAMES)
    f.pulled_elsewhere()  # into the caller's arrays
    assert not f.ask(NAMES, NAMES)
    f.serve(0, 0, None, NAMES)
    assert not f.ask(NAMES, NAMES, allowed=False)  # not sync, or a PS that does not take it
    assert not f.serve(0, 0, None, NAMES)  # and a push that did not ask serves nothing


def test_a_step_loops_own_whole_pull_lets_the_next_push_ask_and_forgets_the_last() -> None:
    """A step pipeline's record: its pulls go to its own buffers (``pulled_whole``), and
    a pull it made itself (after a restore, a refused push) serves nothing brought."""
    f = FreshValues()
    f.pulled_whole()
    assert f.ask(NAMES, NAMES)
    f.brought(4, 1)
    f.pulled_whole()  # pulled anyway: what the push brought is forgotten
    assert f.asked is False and f.have is None and f.whole_pull
    assert not f.serve(4, 1, None, NAMES) and f.misses == 0  # nothing asked: no miss


def test_a_push_that_does_not_ask_forgets_what_the_one_before_brought() -> None:
    f = FreshValues(whole_pull=True)
    assert f.ask(NAMES, NAMES)
    f.brought(3, 0)
    assert not f.ask(NAMES, NAMES, allowed=False)  # a second push before any pull
    assert not f.serve(3, 0, None, NAMES)


def test_served_only_for_the_token_and_generation_it_is_of_and_only_once() -> None:
    f = FreshValues(whole_pull=True)
    assert f.ask(NAMES, NAMES)
    f.brought(5, 2)
    assert f.serve(5, 2, None, NAMES)
    assert not f.serve(5, 2, None, NAMES)  # the next pull goes to the PS
    for token, gen in ((6, 2), (4, 2), (5, 3), (None, 2)):
        f.skip = 0  # (past the back-off of the miss before)
        assert f.ask(NAMES, NAMES)
        f.brought(5, 2)
        assert not f.serve(token, gen, None, NAMES), (token, gen)
    f.skip = 0
    assert f.ask(NAMES, NAMES)
    f.brought(None, 2)  # some PS brought none
    assert not f.serve(5, 2, None, NAMES)
    assert f.hits == 1 and f.misses == 5


def test_misses_back_off_and_a_hit_resets() -> None:
    f = FreshValues(whole_pull=True)
    skipped = []
    for _ in range(9):
        asks = 0
        while not f.ask(NAMES, NAMES):
            asks += 1
        skipped.append(asks)
        f.brought(None, 0)
        assert not f.serve(1, 0, None, NAMES)
    assert skipped == [0, 1, 2, 4, 8, 16, 32, 64, MAX_BACKOFF]
    while not f.ask(NAMES, NAMES):
        pass
    f.brought(1, 0)
    assert f.serve(1, 0, None, NAMES)
    assert f.ask(NAMES, NAMES)  # the next push asks at once
    f.brought(None, 0)
    f.serve(2, 0, None, NAMES)
    assert not f.ask(NAMES, NAMES) and f.ask(NAMES, NAMES)  # backs off from 1 again
