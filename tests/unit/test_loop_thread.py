"""The worker's private event loop: stopping it never leaves a thread blocked in it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from zmqps.transport import LoopThread


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
    with pytest.raises(RuntimeError):
        io.run(late)  # the loop is closed
    late.close()
