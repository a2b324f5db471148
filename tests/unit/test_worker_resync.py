"""When a worker whose data request failed goes on: after a restore, or, for a PS that
was only cut off (a partition), as soon as the chief hears every PS again."""

from __future__ import annotations

from typing import Any

import pytest

from zmqps.roles.worker.session import cut_off
from zmqps.wire.errors import DeadlineExceeded, NotReady, RolledBack
from zmqps.wire.ops import HeartbeatReply

TIMEOUT = DeadlineExceeded("pull to tcp://10.0.0.3:2222: no reply within 30s")


def beat(**kw: Any) -> HeartbeatReply:
    fields: dict[str, Any] = {"global_step": 0, "gen": 0, "recovering": False, "ps_down": ()}
    return HeartbeatReply(**{**fields, **kw})


def test_a_timeout_with_every_ps_answering_is_retried_at_once() -> None:
    assert cut_off(TIMEOUT, beat(), 0)


@pytest.mark.parametrize(
    "st",
    [
        beat(ps_down=(1,)),  # still cut off (or dead, not yet restarted): wait
        beat(recovering=True),  # a restore is under way: wait for its generation
    ],
)
def test_a_timeout_waits_while_a_ps_is_down_or_restoring(st: HeartbeatReply) -> None:
    assert not cut_off(TIMEOUT, st, 0)


def test_a_new_generation_is_not_a_partition() -> None:
    assert not cut_off(TIMEOUT, beat(gen=1), 0)


@pytest.mark.parametrize("error", [RolledBack("gen 0 != 1"), NotReady("no shards")])
def test_refusals_always_wait_for_the_restore(error: Exception) -> None:
    # The PS answered: it restarted without its shards, a restore must come.
    assert not cut_off(error, beat(), 0)
