"""Sync tokens that come back with the push reply, and steps a PS releases by itself.

The PS half runs through the in-memory cluster of tests/unit/test_ps_client.py (the
chief's ``wait_step`` played by hand); the worker half is
:class:`~zmqps.roles.worker.modes.SyncSteps` with a session stand-in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_ps_client import DoublePush, initial, run
from test_sync import (
    DENSE,
    SGD,
    grads,
    mean,
    ps_sync,
    step_reference,
    sync_cluster,
    sync_job,
    until,
)

from zmqps.core.sync import ReleasedTokens
from zmqps.roles.channels import Delivery
from zmqps.roles.chief import modes
from zmqps.roles.ps import service as ps_service
from zmqps.roles.worker.modes import SyncSteps
from zmqps.wire.ops import Who

# ------------------------------------------------------------------ ReleasedTokens


def test_a_step_allowed_ahead_is_released_when_the_ps_reaches_it_and_not_before() -> None:
    t = ReleasedTokens()
    assert t.release(3, 0)
    t.allow(4, 0)
    assert not t.reached(3, 0)  # still at the released step
    assert t.grant(3, 0) is None  # this worker computed 3: it waits
    assert t.reached(4, 0)
    assert (t.step, t.then) == (4, None)
    assert t.grant(3, 0) == (4, 0)
    assert t.grant(3, 0) == (4, 0)  # sent again: the same token
    # the chief's own release of it afterwards is no news
    assert not t.release(4, 0)


def test_a_step_allowed_in_another_generation_is_never_released() -> None:
    t = ReleasedTokens()
    t.release(3, 0)
    t.allow(4, 0)
    assert not t.reached(4, 1)  # the PS was restored meanwhile
    assert (t.step, t.then) == (3, None)
    t.allow(2, 0)  # older than the release: nothing
    assert t.then is None


def test_a_restore_forgets_a_step_allowed_ahead() -> None:
    t = ReleasedTokens()
    t.release(3, 0)
    t.allow(4, 0)
    t.clear()
    assert not t.reached(4, 0)
    assert t.grant(3, 0) is None


def test_the_chief_hears_the_tokens_of_the_step_it_asks_about_after_the_ps_moved_on() -> None:
    t = ReleasedTokens()
    t.release(3, 0)
    for _ in range(4):
        assert t.grant(2, 0) == (3, 0)
    t.allow(4, 0)
    assert t.reached(4, 0)
    assert t.grant(3, 0) == (4, 0)
    assert t.report(3)[:2] == (3, 4)  # the step the chief's poll released: all 4
    assert t.report(4)[:2] == (4, 1)
    assert t.report()[:2] == (4, 1)


# ------------------------------------------------------------------ the PS


def released_ahead(c: Any, step: int, gen: int = 0, ps: int = 0) -> Any:
    """The chief's poll that released ``step - 1`` and lets PS ``ps`` release ``step``."""
    body = {"step": step, "wait": 0.0, "released": step - 1, "gen": gen, "release_step": True}
    return c.net.client(f"ps{ps}", "chief:0").request("wait_step", body)


async def token_push(w: Any, g: dict[str, np.ndarray], step: int) -> tuple[bool, Delivery]:
    """A sync push that asks PS 0 for the next token, as a worker sends it: whether it
    was applied, and its delivery (``offered``: the token its reply brought)."""
    asks = Delivery(token_ps=0)
    return await w.push(g, step=step, delivery=asks), asks


def test_the_push_completing_the_step_releases_the_next_and_every_reply_carries_it() -> None:
    async def body() -> None:
        c = await sync_cluster(required=2, num_ps=1)
        await released_ahead(c, 1)
        w0, w1 = c.client("worker:0"), c.client("worker:1")
        first = asyncio.ensure_future(token_push(w0, grads(0), step=0))
        await asyncio.sleep(0.01)
        assert not first.done()  # held: the next step is not released yet
        applied, asks1 = await token_push(w1, grads(1), step=0)
        assert applied
        applied, asks0 = await first
        assert applied
        assert asks0.offered == asks1.offered == (1, 0, 0)
        assert ps_sync(c, 0)["step"] == 1
        # a push that did not ask gets none
        w2, none = c.client("worker:2"), Delivery()
        assert not await w2.push(grads(2), step=0, delivery=none)  # late: stale
        assert none.offered is None

    run(body())


def test_a_ps_says_it_takes_the_new_fields_so_that_peers_send_them_only_then() -> None:
    async def body() -> None:
        c = await sync_cluster(required=1, num_ps=1)
        rep = await released_ahead(c, 1)
        assert rep.body["releases"] is True  # the chief may send release_step
        body = {"role": "worker", "index": 0, "incarnation": 1, "wait": 1.0, "have": -1}
        rep = await c.net.client("ps0", "worker:0:1").request("take_token", body)
        assert (rep.body["step"], rep.body["ps"], rep.body["by_push"]) == (0, 0, True)

    run(body())


def test_a_poll_that_keeps_the_boundary_takes_back_a_release_ahead() -> None:
    async def body() -> None:
        c = await sync_cluster(required=1, num_ps=1)
        await released_ahead(c, 1)
        assert c.services[0].tokens.then == (1, 0)
        # a restarted chief's poll, a checkpoint due at step 1: it releases step 1 itself
        body = {"step": 1, "wait": 0.0, "released": 0, "gen": 0}
        await c.net.client("ps0", "chief:0").request("wait_step", body)
        assert c.services[0].tokens.then is None
        w0 = c.client("worker:0")
        assert await w0.push(grads(0), step=0)
        assert ps_sync(c, 0)["step"] == 1
        assert c.services[0].tokens.step == 0  # not released: the chief's to release

    run(body())


def test_a_late_push_of_a_backup_worker_gets_the_next_token_at_once() -> None:
    async def body() -> None:
        c = await sync_cluster(required=2, num_ps=1)  # N = 2 of 3 workers
        await released_ahead(c, 1)
        w0, w1, w2 = (c.client(f"worker:{i}") for i in range(3))
        await asyncio.gather(token_push(w0, grads(0), 0), token_push(w1, grads(1), 0))
        applied, asks = await token_push(w2, grads(2), 0)
        assert not applied
        assert w2.dropped == {"stale": 1}
        assert asks.offered == (1, 0, 0)  # it computed step 0: the next is 1

    run(body())


def test_a_push_sent_again_gets_the_same_token() -> None:
    async def body() -> None:
        c = await sync_cluster(required=1, num_ps=1)
        await released_ahead(c, 1)
        twice = c.client("worker:0", wrap=DoublePush)
        applied, asks = await token_push(twice, grads(0), 0)
        assert not applied  # the second copy: a duplicate
        assert twice.dropped == {"duplicate": 1}
        assert asks.offered == (1, 0, 0)
        assert c.services[0].tokens.granted == 2  # shown twice, handed once

    run(body())


def test_without_a_release_the_push_is_answered_without_a_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ps_service, "PUSH_TOKEN_WAIT_S", 0.01)

    async def body() -> None:
        c = await sync_cluster(required=1, num_ps=1)  # no chief poll: nothing released
        w0 = c.client("worker:0")
        applied, asks = await token_push(w0, grads(0), 0)
        assert applied
        assert asks.offered is None  # the worker asks take_token, as before
        assert ps_sync(c, 0)["step"] == 1
        for v in DENSE:
            assert np.isfinite(c.shard_values(v.name)).all()

    run(body())


def test_a_replicated_state_hands_no_token_with_the_push() -> None:
    async def body() -> None:
        c = await sync_cluster(required=1, num_ps=1)
        await released_ahead(c, 1)
        c.services[0].replica = object()  # as a primary: answered once on every copy
        try:
            assert not c.services[0]._hands_tokens()
        finally:
            c.services[0].replica = None
        assert c.services[0]._hands_tokens()

    run(body())


# ------------------------------------------------------------------ the worker


class FakeSession:
    def __init__(self) -> None:
        self.gen = 0
        self.who = Who("worker", 0, 1)
        self.name = "worker:0"
        self.restored: list[Callable[[int], None]] = []
        self.polls = 0

    def on_restored(self, f: Callable[[int], None]) -> None:
        self.restored.append(f)

    def restore(self, gen: int) -> None:
        self.gen = gen
        for f in self.restored:
            f(gen)

    async def long_poll(self, op: str, body: Callable[[], Any], kind: Any, poll: float) -> Any:
        self.polls += 1
        b = body()
        return kind(b.have + 1, self.gen, ps=None)


def test_the_worker_takes_the_token_its_push_brought_and_asks_nobody() -> None:
    async def body() -> None:
        s = FakeSession()
        steps = SyncSteps(s, links=lambda k: None)  # type: ignore[arg-type]
        assert await steps.begin(0, 1.0) == 0  # the first from the chief
        assert s.polls == 1
        steps.token_ps = 0
        assert steps.push_asks() is None  # not known to answer a push that asks
        steps.by_push.add(0)  # its take_token reply said so
        assert steps.push_asks() == 0
        steps.step_done()
        steps.offered((1, 0, 0))
        assert await steps.begin(1, 1.0) == 1
        assert (s.polls, steps.from_push, steps.token_ps) == (1, 1, 0)

    run(body())


def test_a_token_brought_before_a_restore_is_void() -> None:
    async def body() -> None:
        s = FakeSession()
        steps = SyncSteps(s, links=lambda k: None)  # type: ignore[arg-type]
        await steps.begin(0, 1.0)
        steps.step_done()
        steps.offered((1, 0, 0))
        s.restore(1)
        assert await steps.begin(1, 1.0) == 0  # asked again: the steps went back
        assert (s.polls, steps.from_push) == (2, 0)

    run(body())


def test_a_token_brought_by_the_push_starts_the_step_without_the_io_loop() -> None:
    async def body() -> None:
        s = FakeSession()
        steps = SyncSteps(s, links=lambda k: None)  # type: ignore[arg-type]
        assert steps.ready() is None  # nothing brought: begin() asks
        await steps.begin(0, 1.0)
        steps.step_done()
        steps.offered((1, 0, 0))
        assert steps.ready() == 1
        assert (steps.tag(), steps.token_ps, s.polls) == (1, 0, 1)
        steps.step_done()
        steps.offered((2, 0, 0))
        s.restore(1)
        assert steps.ready() is None  # void: begin() asks again
        assert await steps.begin(2, 1.0) == 0

    run(body())


def test_a_token_not_past_the_step_computed_is_not_taken() -> None:
    async def body() -> None:
        s = FakeSession()
        steps = SyncSteps(s, last_step=4, links=lambda k: None)  # type: ignore[arg-type]
        steps.offered((4, 0, 0))  # the step it computed already
        assert await steps.begin(0, 1.0) == 5
        assert (s.polls, steps.from_push) == (1, 0)

    run(body())


# ------------------------------------------------------------------ the chief's loop


async def push(job: Any, i: int, g: dict[str, np.ndarray], step: int) -> Any:
    """Worker ``i``'s push of ``step``; the next token its reply brought, if any."""
    applied, asks = await token_push(job.workers[i], g, step)
    assert applied
    return asks.offered


async def steps_by_push_replies(job: Any, steps: int, optimizer: dict[str, Any]) -> list[int]:
    """Each worker takes its first token from the chief, then only from its push
    replies; the values follow the mean of every step exactly. Returns, per step, how
    many workers' replies brought the next token."""
    n = len(job.workers)
    params = {v.name: initial(v) for v in DENSE}
    slots: dict[str, dict[str, np.ndarray]] = {}
    tokens = [await job.token(i) for i in range(n)]
    brought = []
    for step in range(steps):
        assert tokens == [step] * n
        gs = [grads(10 * step + i) for i in range(n)]
        for w in job.workers:
            await w.pull()

        offered = await asyncio.gather(*(push(job, i, gs[i], step) for i in (2, 0, 1)[:n]))
        brought.append(sum(o is not None for o in offered))
        tokens = [step + 1 if o is None else o[0] for o in offered]
        await until(lambda s=step: job.step == s + 1, what=f"global step {step + 1}")
        step_reference(params, slots, optimizer, mean(gs), step + 1)
        for v in DENSE:
            np.testing.assert_allclose(job.values(v.name), params[v.name], atol=1e-6)
    return brought


def test_one_ps_releases_each_step_itself_and_the_steps_stay_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the chief hears of the steps the PS released within this (each step waits on it)
    monkeypatch.setattr(modes, "AHEAD_POLL_S", 0.02)

    async def body() -> None:
        job = await sync_job(3, 1, num_shards=1)
        ahead = []
        mode = job.env.chief.consistency
        real = mode._may_release_ahead

        def spy(step: int) -> bool:
            ahead.append(real(step))
            return ahead[-1]

        mode._may_release_ahead = spy  # type: ignore[method-assign]
        brought = await steps_by_push_replies(job, 4, SGD)
        assert brought == [3, 3, 3, 3]
        assert len(ahead) >= 3 and all(ahead)  # from the second step's poll on
        await job.close()

    run(body())


def test_a_checkpoint_due_or_several_ps_keep_the_release_with_the_chief() -> None:
    async def body() -> None:
        job = await sync_job(2, 1, num_shards=1)
        mode = job.env.chief.consistency
        mode.step_due = lambda step: step % 2 == 0  # a checkpoint at every even step
        assert not mode._may_release_ahead(3)  # the PS has not said it takes the field
        mode._releases.add(0)
        assert not mode._may_release_ahead(2)
        assert mode._may_release_ahead(3)
        mode.counted.add(1)  # a gone worker still counted for the step
        assert not mode._may_release_ahead(3)
        mode.counted.clear()
        await job.close()
        job = await sync_job(2, 2)
        assert not job.env.chief.consistency._may_release_ahead(1)  # several PS
        await job.close()

    run(body())
