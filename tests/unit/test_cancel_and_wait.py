"""zmqps.transport.base.cancel_and_wait: a helper cancelled and waited for, without
taking the caller's own cancellation (which left a loop that could not be cancelled,
and an event loop's shutdown waiting for it for ever)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from zmqps.transport.base import cancel_and_wait


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
