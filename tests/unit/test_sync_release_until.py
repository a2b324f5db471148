"""Sync steps the one PS releases by itself up to a step the chief names.

The chief lets the PS release every step up to the one before the next boundary it
must see (``WaitStep.release_until``) and polls about once a second, not once a step.
The PS half runs through the in-memory cluster of tests/unit/test_ps_client.py (the
chief's ``wait_step`` played by hand); the chief's loop through the in-memory job of
tests/unit/test_sync.py. No test here asserts a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from test_chief import call, make_env, who
from test_ps_client import initial, run
from test_sync import (
    DENSE,
    SGD,
    SyncJob,
    grads,
    mean,
    ps_sync,
    step_reference,
    sync_cluster,
    sync_job,
    until,
)
from test_sync_push_token import token_push

from zmqps.core.sync import ReleasedTokens
from zmqps.roles.chief import modes
from zmqps.roles.chief.modes import SyncMode
from zmqps.roles.configs import SyncConfig

# ------------------------------------------------------------------ ReleasedTokens


def test_every_step_up_to_the_one_allowed_is_released_as_it_is_reached() -> None:
    t = ReleasedTokens()
    assert t.release(3, 0)
    t.allow_until(6, 0)
    assert not t.reached(3, 0)  # at the released step: nothing new
    for step in (4, 5, 6):
        assert t.reached(step, 0)
        assert t.grant(step - 1, 0) == (step, 0)
        assert t.grant(step - 1, 0) == (step, 0)  # sent again: the same token
    assert t.then is None  # all of it released
    assert not t.reached(7, 0)  # past the last step allowed: the chief's
    assert t.step == 6 and t.grant(6, 0) is None


def test_a_step_reached_past_the_last_allowed_releases_only_that_one() -> None:
    t = ReleasedTokens()
    t.release(3, 0)
    t.allow_until(5, 0)
    assert t.reached(7, 0)
    assert t.step == 5


def test_the_last_poll_is_the_chiefs_word_and_another_generation_gets_nothing() -> None:
    t = ReleasedTokens()
    t.release(3, 0)
    t.allow_until(9, 0)
    t.allow_until(4, 0)  # a checkpoint came due at step 5: it stops sooner
    assert t.reached(6, 0) and t.step == 4
    t.allow_until(4, 0)  # not past the release: allows nothing
    assert t.then is None
    t.allow_until(8, 0)
    assert not t.reached(5, 1)  # the PS was restored meanwhile
    assert (t.step, t.then) == (4, None)
    t.allow_until(8, 0)
    t.clear()  # a restore
    assert not t.reached(5, 0) and t.grant(3, 0) is None


def test_a_run_is_released_only_while_the_chiefs_last_poll_holds() -> None:
    """A chief that stopped polling (or came back not releasing) is not followed
    for ever: past the lease of its last poll the PS releases nothing by itself."""
    t = ReleasedTokens()
    t.release(3, 0)
    t.allow_until(9, 0, lease=100.0)
    assert t.reached(4, 0, now=99.0) and t.step == 4
    assert not t.reached(5, 0, now=101.0)
    assert (t.step, t.then) == (4, None)
    t.allow_until(9, 0, lease=200.0)  # the chief's next poll
    assert t.reached(5, 0, now=150.0) and t.step == 5
    t.allow_until(5, 0)  # not past the release: nothing allowed
    t.allow(6, 0)  # a one-step allowance has no lease
    assert t.lease is None and t.reached(6, 0, now=1e9) and t.step == 6


def test_nothing_is_released_before_a_release_of_the_generation() -> None:
    t = ReleasedTokens()
    t.then = (5, 0)  # never released: the chief's poll releases first
    assert not t.reached(2, 0)
    assert t.step is None


# ------------------------------------------------------------------ the PS


def stepping_poll(
    c: Any, step: int, released: int, gen: int = 0, wait: float = 0.0, **more: Any
) -> Any:
    body = {"step": step, "wait": wait, "released": released, "gen": gen, **more}
    return c.net.client("ps0", "chief:0").request("wait_step", body)


def test_the_ps_releases_each_step_up_to_the_one_named_and_answers_at_the_next() -> None:
    async def body() -> None:
        c = await sync_cluster(required=2, num_ps=1)
        poll = asyncio.ensure_future(stepping_poll(c, 4, 0, wait=30.0, release_until=3))
        await asyncio.sleep(0.01)
        w0, w1 = c.client("worker:0"), c.client("worker:1")
        for step in range(4):
            got = await asyncio.gather(
                token_push(w0, grads(step), step), token_push(w1, grads(9), step)
            )
            assert all(applied for applied, _ in got)
            offered = [asks.offered for _, asks in got]
            if step < 3:  # released by the PS: each reply brings the next token
                assert offered == [(step + 1, 0, 0)] * 2
                assert not poll.done()
            else:  # step 4 is the chief's (a boundary it must see): no token out
                assert offered == [None, None]
        rep = await asyncio.wait_for(poll, 5.0)
        assert rep.body["step"] == 4 and rep.body["released"] == 3
        assert rep.body["releases_until"] is True  # the chief may send release_until
        assert c.services[0].tokens.step == 3 and ps_sync(c, 0)["step"] == 4

    run(body())


def test_a_stepping_poll_without_it_takes_the_steps_back() -> None:
    """A membership change, or a restarted chief's first poll: the PS releases nothing
    more by itself, and says where it is (the ledger of the chief moves there)."""

    async def body() -> None:
        c = await sync_cluster(required=1, num_ps=1)
        await stepping_poll(c, 9, 0, release_until=8)
        w0 = c.client("worker:0")
        assert await w0.push(grads(0), step=0)
        assert c.services[0].tokens.step == 1  # released by the PS
        rep = await stepping_poll(c, 0, 0)  # the chief's word: no more
        assert (rep.body["step"], rep.body["released"]) == (1, 1)
        assert c.services[0].tokens.then is None
        assert await w0.push(grads(1), step=1)
        assert ps_sync(c, 0)["step"] == 2
        assert c.services[0].tokens.step == 1  # step 2 is the chief's to release
        # another generation's poll allows nothing (a chief of before a restore)
        await stepping_poll(c, 9, 1, gen=1, release_until=8)
        assert c.services[0].tokens.then is None

    run(body())


# ------------------------------------------------------------------ the chief's loop


async def one_ps_job(
    monkeypatch: pytest.MonkeyPatch, workers: int, poll_s: float = 30.0, **sync: Any
) -> SyncJob:
    """A job of one PS; the chief's poll of a run of steps answers at its end (or after
    ``poll_s``), so only the boundaries and membership changes move its ledger."""
    monkeypatch.setattr(modes, "AHEAD_POLL_S", poll_s)
    return await sync_job(workers, 1, num_shards=1, **sync)


class Reference:
    """The values every step must give: SGD on the mean of the step's gradients."""

    def __init__(self) -> None:
        self.params = {v.name: initial(v) for v in DENSE}
        self.slots: dict[str, dict[str, np.ndarray]] = {}
        self.step = 0

    def apply(self, gs: Sequence[dict[str, np.ndarray]]) -> None:
        self.step += 1
        step_reference(self.params, self.slots, SGD, mean(gs), self.step)

    def check(self, job: SyncJob) -> None:
        for v in DENSE:
            np.testing.assert_allclose(job.values(v.name), self.params[v.name], atol=1e-6)


async def one_step(
    job: SyncJob, step: int, who_pushes: Sequence[int], ref: Reference, seed: int = 0
) -> list[Any]:
    """``who_pushes`` push step ``step`` (asking for the next token); the PS applies
    their mean. Returns the tokens their replies brought."""
    gs = [grads(100 * step + 10 * seed + i) for i in who_pushes]
    for i in who_pushes:
        await job.workers[i].pull()
    done = await asyncio.gather(
        *(token_push(job.workers[i], g, step) for i, g in zip(who_pushes, gs, strict=True))
    )
    assert all(applied for applied, _ in done)
    assert job.env.services[0].visible_step == step + 1
    ref.apply(gs)
    ref.check(job)
    return [asks.offered for _, asks in done]


def spy_polls(mode: SyncMode) -> list[str]:
    """Every stepping poll the chief's loop sends: "run" (steps the PS releases), or
    "step" (one step, as before)."""
    polls: list[str] = []
    run_ahead, wait_ps = mode._run_ahead, mode._wait_ps

    async def counted_run(*args: Any) -> Any:
        polls.append("run")
        return await run_ahead(*args)

    async def counted_step(*args: Any) -> Any:
        polls.append("step")
        return await wait_ps(*args)

    mode._run_ahead = counted_run  # type: ignore[method-assign]
    mode._wait_ps = counted_step  # type: ignore[method-assign]
    return polls


def test_steps_run_through_the_ps_and_a_checkpoint_is_taken_exactly_at_its_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkpoint every 4 steps: the PS releases steps 1-3 and 5-7 by itself, the
    chief takes the checkpoints at steps 4 and 8, each while the PS is at that step
    and none of its tokens is out, and sends a handful of polls for 9 steps."""

    async def body() -> None:
        job = await one_ps_job(monkeypatch, 3)
        mode = job.env.chief.consistency
        svc = job.env.services[0]
        last = [0]
        taken: list[tuple[int, int, int | None]] = []

        def due(step: int) -> bool:  # a policy of every 4 steps
            return step - last[0] >= 4

        async def checkpoint(step: int) -> None:
            if due(step):
                taken.append((step, svc.visible_step, svc.tokens.step))
                last[0] = step

        mode.on_step, mode.step_due, mode.plan_due = checkpoint, due, due
        polls = spy_polls(mode)
        ref = Reference()
        assert [await job.token(i) for i in range(3)] == [0, 0, 0]
        brought = []
        for step in range(9):
            offered = await one_step(job, step, (2, 0, 1), ref)
            brought.append(sum(o is not None and o[0] == step + 1 for o in offered))
        # at a checkpoint the PS is at its step and released the one before only
        assert taken == [(4, 4, 3), (8, 8, 7)]
        assert brought == [3] * 9  # every token by a push reply
        await until(lambda: job.step == 8, what="the chief at the boundary of step 8")
        # the first step's poll (the PS had not said it takes release_until yet), one
        # poll per run of steps and one per boundary: not one per step
        assert polls.count("run") <= 4 and len(polls) <= 7, polls
        await job.close()

    run(body())


@pytest.mark.parametrize("how", ["done", "dead"])
def test_a_worker_gone_after_its_push_counts_while_the_chief_was_steps_behind(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The PS released steps 1-3 by itself; the chief's ledger is still at step 1.
    Worker 0 pushes step 3 and leaves (or dies): the chief first takes the steps
    back and moves its ledger to step 3, so it finds worker 0's gradient held there
    and step 3 waits for worker 1 (the mean of both); from step 4 on N is 1."""

    async def body() -> None:
        job = await one_ps_job(monkeypatch, 2)
        mode = job.env.chief.consistency
        ref = Reference()
        assert [await job.token(i) for i in range(2)] == [0, 0]
        for step in range(3):
            await one_step(job, step, (0, 1), ref)
        assert mode._allowing and mode.global_step < 3  # behind the PS
        g0 = grads(1000)
        assert await job.workers[0].push(g0, step=3)
        if how == "done":
            await job.leave(0)
        else:
            job.env.clock.now += 11.0
            await call(job.env.chief, "heartbeat", who(1, step=3))
            await mode.membership_changed(gone=[0])
        assert mode.global_step == 3 and mode.counted == {0}
        assert mode.required == 2
        g1 = grads(1001)
        assert await job.workers[1].push(g1, step=3)
        ref.apply([g0, g1])
        ref.check(job)
        await until(lambda: mode.required == 1, what="N = 1 once step 3 is applied")
        await until(lambda: mode._allowing, what="the PS releasing steps again")
        offered = await one_step(job, 4, (1,), ref)
        assert offered[0] is not None and offered[0][0] == 5
        assert job.env.services[0].status()["sync"]["dropped"] == {}
        await job.close()

    run(body())


def test_a_worker_joining_mid_run_gets_the_step_the_ps_is_at(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Worker 1 left and was not back within the heartbeat timeout; worker 0 steps
    alone, released by the PS, the chief's ledger behind. Worker 1's new incarnation
    registers: its token is the PS's step (not the ledger's old one), and the steps
    after are the mean of both."""

    async def body() -> None:
        job = await one_ps_job(monkeypatch, 2)
        mode = job.env.chief.consistency
        ref = Reference()
        assert await job.token(0) == 0
        await job.leave(1, reason="terminated")
        assert mode.required == 2  # expected back: its share is kept a heartbeat timeout
        job.env.clock.now += job.env.chief.cfg.heartbeat_timeout + 1
        await call(job.env.chief, "heartbeat", who(0, step=0))
        await mode.membership_changed(gone=[1])  # not back: the chief's watch says so
        assert mode.required == 1
        for step in range(4):
            await one_step(job, step, (0,), ref)
        await until(lambda: mode._allowing, what="the PS releasing steps")
        await call(job.env.chief, "register", who(1, 1))
        assert mode.required == 2 and mode.global_step == 4
        rep = await call(job.env.chief, "take_token", who(1, 1, wait=1.0))
        assert rep.body["step"] == 4
        job.workers[1].incarnation = 1
        for step in (4, 5):
            await one_step(job, step, (0, 1), ref)
        assert job.env.services[0].status()["sync"]["dropped"] == {}
        await job.close()

    run(body())


def test_backup_workers_n_below_m_step_through_the_ps(monkeypatch: pytest.MonkeyPatch) -> None:
    """N = 2 of 3: each step is the mean of its first two gradients; the third is
    late (stale, not applied) and its reply still brings the next token."""

    async def body() -> None:
        job = await one_ps_job(monkeypatch, 3, replicas_to_aggregate=2)
        mode = job.env.chief.consistency
        ref = Reference()
        assert [await job.token(i) for i in range(3)] == [0, 0, 0]
        for step in range(4):
            first = await one_step(job, step, (step % 3, (step + 1) % 3), ref)
            assert all(o is not None and o[0] == step + 1 for o in first)
            late = (step + 2) % 3
            applied, asks = await token_push(job.workers[late], grads(7), step)
            assert not applied
            assert asks.offered == (step + 1, 0, 0)
            ref.check(job)
        assert mode._allowing
        assert job.env.services[0].status()["sync"]["dropped"] == {"stale": 4}
        await job.close()

    run(body())


def test_a_ps_that_does_not_say_it_takes_release_until_is_not_sent_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def body() -> None:
        job = await one_ps_job(monkeypatch, 2)
        mode = job.env.chief.consistency
        mode._releases.add(0)  # as the PS says in its first answer (tested above)
        mode._ranges.add(0)
        assert mode._release_until(5) == 4 + modes.AHEAD_STEPS
        mode._ranges.clear()  # an older PS: it takes release_step only
        assert mode._release_until(5) is None and mode._may_release_ahead(5)
        await job.close()
        job = await sync_job(2, 2)  # several PS: the chief releases every step
        assert job.env.chief.consistency._release_until(1) is None
        await job.close()

    run(body())


def test_the_run_ends_before_the_first_step_a_checkpoint_is_planned_at() -> None:
    async def body() -> None:
        job = await sync_job(2, 1, num_shards=1)
        mode = job.env.chief.consistency
        mode._ranges.add(0)
        mode._releases.add(0)
        mode.step_due = lambda step: False
        mode.plan_due = lambda step: step >= 1000
        assert mode._release_until(7) == 999
        mode.plan_due = lambda step: step >= 8
        assert mode._release_until(7) == 7
        mode.plan_due = lambda step: step >= 7
        assert mode._release_until(7) is None
        await job.close()

    run(body())


def test_ssp_never_lets_a_ps_release_steps() -> None:
    async def body() -> None:
        env = make_env(1, 2, sync=SyncConfig(mode="ssp", max_staleness=1))
        for i in range(2):
            await call(env.chief, "register", who(i))
        for c in (1, 2):
            for i in range(2):
                await call(env.chief, "ssp_clock", who(i, completed=c, wait=1.0))
        assert env.chief.consistency.name == "ssp"
        assert env.services[0].tokens.then is None and env.services[0].tokens.step is None
        assert not hasattr(env.chief.consistency, "_release_until")

    run(body())
