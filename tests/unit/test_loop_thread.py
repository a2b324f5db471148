"""The worker's private event loop: stopping it never leaves a thread blocked in it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from zmqps.transport import LoopThread, loop
from zmqps.wire.errors import ShutdownError


def test_stop_releases_a_thread_blocked_in_run() -> None:
    # a coordinator function waiting for the cluster to recover when its worker is
    # told to shut down: the process could not exit while that thread waited
    io = LoopThread("test-io")
    outcome: list[BaseException] = []

    def blocked() -> None:
        try:
            io.run(asyncio.sleep(3600))
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.1)
    started = time.monotonic()
    io.stop()
    t.join(timeout=5)
    assert not t.is_alive()
    assert time.monotonic() - started < 5
    assert len(outcome) == 1 and isinstance(outcome[0], concurrent.futures.CancelledError)
    late = asyncio.sleep(0)
    with pytest.raises(ShutdownError, match="test-io is closed"):
        io.run(late)  # the loop is closed: one line, and the coroutine closed
    assert late.cr_frame is None


# -- result: a blocked wait wakes to run signal handlers, and tells timeouts apart


def test_result_waits_across_wake_ups_and_returns_the_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loop, "WAKE_S", 0.01)
    fut: concurrent.futures.Future[int] = concurrent.futures.Future()
    threading.Timer(0.05, fut.set_result, (7,)).start()  # after several wake-ups
    assert loop.result(fut) == 7


def test_a_timeout_of_the_work_itself_is_raised_not_waited_on() -> None:
    fut: concurrent.futures.Future[int] = concurrent.futures.Future()
    fut.set_exception(TimeoutError("the work's own"))
    with pytest.raises(TimeoutError, match="the work's own"):
        loop.result(fut)


def test_a_wait_with_a_timeout_ends_at_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "WAKE_S", 0.01)
    fut: concurrent.futures.Future[int] = concurrent.futures.Future()
    with pytest.raises(concurrent.futures.TimeoutError):
        loop.result(fut, timeout=0.05)
