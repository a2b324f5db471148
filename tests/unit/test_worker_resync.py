"""When a worker whose data request failed goes on: after a restore, or, for a PS that
was only cut off (a partition), as soon as the chief hears every PS again."""

from __future__ import annotations

from typing import Any

import pytest

from zmqps.roles.worker import _unreachable_again
from zmqps.wire.errors import DeadlineExceeded, NotReady, RolledBack

TIMEOUT = DeadlineExceeded("pull to tcp://10.0.0.3:2222: no reply within 30s")


def state(**kw: Any) -> dict[str, Any]:
    return {"gen": 0, "recovering": False, "ps_down": [], **kw}


def test_a_timeout_with_every_ps_answering_is_retried_at_once() -> None:
    assert _unreachable_again(TIMEOUT, 0, 0, state())


@pytest.mark.parametrize(
    "st",
    [
        state(ps_down=[1]),  # still cut off (or dead, not yet restarted): wait
        state(recovering=True),  # a restore is under way: wait for its generation
    ],
)
def test_a_timeout_waits_while_a_ps_is_down_or_restoring(st: dict[str, Any]) -> None:
    assert not _unreachable_again(TIMEOUT, 0, 0, st)


def test_a_new_generation_is_not_a_partition() -> None:
    assert not _unreachable_again(TIMEOUT, 1, 0, state(gen=1))


@pytest.mark.parametrize("error", [RolledBack("gen 0 != 1"), NotReady("no shards")])
def test_refusals_always_wait_for_the_restore(error: Exception) -> None:
    # The PS answered: it restarted without its shards, a restore must come.
    assert not _unreachable_again(error, 0, 0, state())
