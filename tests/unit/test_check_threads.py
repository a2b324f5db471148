"""The process's runner of calls at once (``roles/threads.py``): every call runs once
and its result comes back in order, and an error is raised only once no call is left
running over the arrays."""

from __future__ import annotations

import random
import threading
import time

import pytest

from zmqps.roles.threads import CheckThreads


@pytest.mark.parametrize("seed", range(5))
def test_every_call_runs_once_and_results_come_back_in_order(seed: int) -> None:
    rng = random.Random(seed)
    threads = CheckThreads(rng.randint(2, 4))
    try:
        for _ in range(20):
            n = rng.randint(1, 9)
            ran = [0] * n
            lock = threading.Lock()

            def call(
                i: int, pause: float, ran: list[int] = ran, lock: threading.Lock = lock
            ) -> object:
                def go() -> int:
                    time.sleep(pause)
                    with lock:
                        ran[i] += 1
                    return i * 7

                return go

            calls = [call(i, rng.random() * 0.002) for i in range(n)]
            assert threads.run(calls) == [i * 7 for i in range(n)]  # type: ignore[arg-type]
            assert ran == [1] * n
    finally:
        threads.close()


def test_an_error_is_raised_once_every_call_has_finished() -> None:
    threads = CheckThreads(2)
    done: list[int] = []

    def bad() -> bool:
        raise ValueError("bad piece")

    def slow(i: int) -> object:
        def go() -> bool:
            time.sleep(0.05)
            done.append(i)
            return True

        return go

    try:
        with pytest.raises(ValueError, match="bad piece"):
            threads.run([bad, slow(1), slow(2), slow(3)])  # type: ignore[list-item]
        assert sorted(done) == [1, 2, 3]  # none still running after the raise
    finally:
        threads.close()
