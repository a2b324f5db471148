"""zmqps.transport.base.cancel_and_wait: a helper cancelled and waited for, without
taking the caller's own cancellation (which left a loop that could not be cancelled,
and an event loop's shutdown waiting for it for ever)."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from zmqps.roles.ps.replica import _Signal
from zmqps.transport.base import cancel_and_wait, unless_set, waited, within


def test_the_helper_ends_and_its_cancellation_is_taken() -> None:
    async def body() -> None:
        helper = asyncio.ensure_future(asyncio.sleep(3600))
        await asyncio.sleep(0)
        await cancel_and_wait(helper)
        assert helper.cancelled()

    asyncio.run(asyncio.wait_for(body(), 5))


def test_the_exceptions_named_are_taken_and_others_go_on() -> None:
    async def fails(exc: BaseException) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            raise exc

    async def body() -> None:
        a = asyncio.ensure_future(fails(KeyError("a")))
        await asyncio.sleep(0)
        await cancel_and_wait(a, KeyError)
        b = asyncio.ensure_future(fails(ValueError("b")))
        await asyncio.sleep(0)
        with pytest.raises(ValueError):
            await cancel_and_wait(b, KeyError)

    asyncio.run(asyncio.wait_for(body(), 5))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() is Python 3.11+")
def test_a_loop_cancelled_while_it_cancels_a_helper_ends() -> None:
    """A watcher loop that cancels a helper each round: cancelled while it waits for
    the helper, the loop ends (with the suppress idiom it ran on for ever)."""
    rounds = 0

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # takes a moment to end: the caller waits in it
            raise

    async def watcher() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            helper = asyncio.ensure_future(stubborn())
            await asyncio.sleep(0.01)
            await cancel_and_wait(helper)

    async def body() -> None:
        loop = asyncio.ensure_future(watcher())
        await asyncio.sleep(0.015)  # inside cancel_and_wait
        loop.cancel()
        done, _ = await asyncio.wait([loop], timeout=2.0)
        assert loop in done and loop.cancelled(), f"the loop ran on ({rounds} rounds)"

    asyncio.run(asyncio.wait_for(body(), 10))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() is Python 3.11+")
def test_a_cleanup_in_a_cancelled_tasks_finally_runs_to_its_end() -> None:
    """A task being cancelled cleans up in ``finally`` (a client's close under a
    ``wait_for`` that timed out): its own earlier cancellation does not cut the
    cleanup short, which would leave a socket open and hang ``ctx.term()``."""
    steps: list[str] = []

    async def owner() -> None:
        helpers = [asyncio.ensure_future(asyncio.sleep(3600)) for _ in range(2)]
        try:
            await asyncio.sleep(3600)
        finally:
            for h in helpers:
                await cancel_and_wait(h)
                steps.append("helper ended")
            steps.append("socket closed")

    async def body() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(owner(), 0.01)
        assert steps == ["helper ended", "helper ended", "socket closed"]

    asyncio.run(asyncio.wait_for(body(), 5))


# -- within / waited: asyncio.wait_for without losing the caller's cancellation --------


def test_within_keeps_a_cancellation_that_comes_in_the_turn_its_awaitable_ends() -> None:
    """A reply arriving in the loop turn its request is cancelled in: the request is
    cancelled (``asyncio.wait_for`` before Python 3.12 returned the reply, and the
    cancellation was lost: a loop told to stop went on)."""

    async def body() -> None:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(within(fut, 60))
        await asyncio.sleep(0)  # waiting on fut
        fut.set_result(1)
        task.cancel()  # the same turn
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(body(), 5))


def test_within_answers_and_times_out_as_wait_for() -> None:
    async def body() -> None:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, fut.set_result, 7)
        assert await within(fut, 5) == 7
        slow = asyncio.ensure_future(asyncio.sleep(3600))
        with pytest.raises(asyncio.TimeoutError):
            await within(slow, 0.01)
        await asyncio.sleep(0)
        assert slow.cancelled()  # what timed out is cancelled, as wait_for does
        never = asyncio.Event()
        assert not await waited(never.wait(), 0.01)
        never.set()
        assert await waited(never.wait(), 0.01)

    asyncio.run(asyncio.wait_for(body(), 5))


def test_a_primary_waiting_for_its_backups_is_cancelled_in_the_turn_they_answer() -> None:
    """The primary's wait for a commit (``_Signal.until``): its request cancelled in the
    turn a backup's answer wakes it ends at once. (It used to go on waiting for the
    commit until the request's deadline, 60 s for a request without one: a fault
    schedule's push hung past its test's bound.)"""

    async def body() -> None:
        signal = _Signal()
        waiting = asyncio.ensure_future(signal.until(lambda: False, time.monotonic() + 60))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # inside the wait for the next change
        signal.notify()
        waiting.cancel()  # the same turn
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiting, 2)  # not a TimeoutError: it ended

    asyncio.run(asyncio.wait_for(body(), 5))


def test_unless_set_cancelled_itself_cancels_its_step() -> None:
    # a chief's second signal cancels the wait around its stepping loop: the loop must
    # not go on checkpointing while the chief closes its server under it
    async def body() -> None:
        ended = asyncio.Event()

        async def step() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                ended.set()

        outer = asyncio.ensure_future(unless_set(asyncio.Event(), step()))
        await asyncio.sleep(0.01)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        assert ended.is_set()  # cancelled and waited for before the caller's end

    asyncio.run(asyncio.wait_for(body(), 5))


def test_unless_set_answers_the_step_or_the_event() -> None:
    async def body() -> None:
        assert await unless_set(asyncio.Event(), asyncio.sleep(0, "done")) == (True, "done")
        stop, ended = asyncio.Event(), asyncio.Event()

        async def step() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                ended.set()

        asyncio.get_running_loop().call_later(0.01, stop.set)
        assert await unless_set(stop, step()) == (False, None)
        assert ended.is_set()

    asyncio.run(asyncio.wait_for(body(), 5))
