"""zmqps.process: the BLAS threads each launched task gets."""

from __future__ import annotations

import pytest

from zmqps.process import THREAD_VARS, blas_threads, thread_env, usable_cores


@pytest.mark.parametrize(
    ("cores", "compute", "others", "want"),
    [
        (16, 4, 3, 3),  # 4 CPU workers beside a chief and 2 PS: 13 cores left, 3 each
        (16, 1, 6, 10),  # one CPU worker beside GPU workers
        (2, 4, 3, 1),  # fewer cores than tasks: one thread each, never zero
        (64, 1, 1, 63),
    ],
)
def test_the_cores_are_shared_among_the_tasks_computing_on_the_host(
    cores: int, compute: int, others: int, want: int
) -> None:
    assert blas_threads(cores, compute, others) == want


def test_a_thread_count_the_user_set_wins() -> None:
    assert thread_env(3, {}) == dict.fromkeys(THREAD_VARS, "3")
    for var in THREAD_VARS:  # any one of them set: nothing is changed
        assert thread_env(3, {var: "8", "PATH": "/bin"}) == {}
    assert usable_cores() >= 1
