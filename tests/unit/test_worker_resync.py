"""When a worker whose data request failed goes on: after a restore, or, for a PS that
was only cut off (a partition), as soon as the chief hears every PS again."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from zmqps.core.sync import TokenLedger
from zmqps.roles.worker.modes import SyncSteps
from zmqps.roles.worker.session import Session, cut_off
from zmqps.wire import Message
from zmqps.wire.errors import DeadlineExceeded, NotReady, RolledBack
from zmqps.wire.ops import HeartbeatReply, TakeToken, Token, Who

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


def test_a_token_poll_after_a_restore_says_what_the_worker_has_now() -> None:
    """A sync worker polls for a token of step 151 (it computed 150); meanwhile the
    cluster is restored to step 144, and the poll is answered NotReady. The next poll
    must say the worker has computed nothing since the restore, or the chief's ledger,
    now at 144, would never give it a token (found by fault schedule seed 36: the
    run hung with a token for the worker on the table)."""
    ledger = TokenLedger()
    ledger.restart(150)
    sent: list[TakeToken] = []

    class Chief:
        endpoint = "tcp://chief"

        async def request(self, op: str, body: Any, **_: Any) -> Message:
            assert op == "take_token"
            await asyncio.sleep(0.01)  # the chief holds the poll
            req = TakeToken.parse(body)
            sent.append(req)
            if len(sent) == 1:  # the chief restarted the cluster at step 144 meanwhile
                ledger.restart(144)
                session.enter(1)  # the heartbeat hears of it
            step = ledger.take(req.who.index, req.who.incarnation, 2, req.have)
            if step is None:
                raise NotReady("no token yet")
            return Message(op="take_token", body=Token(step, 1).to_wire())

    who = Who("worker", 0, 7)
    session = Session(Chief(), who)  # type: ignore[arg-type]
    steps = SyncSteps(session, last_step=150)
    assert asyncio.run(asyncio.wait_for(steps.begin(151, 0.1), 5.0)) == 144  # not a hang
    assert [r.have for r in sent] == [150, -1]


def test_a_push_some_ps_may_lack_asks_for_the_same_token_again() -> None:
    """A sync push failed and no restore came (a PS cut off past the push's attempts):
    the step is not counted as computed, so the ledger gives this worker the same token
    again (its new gradient completes the step on the PS that lacked the first; one
    that has it drops the second). Counting it computed would leave the step waiting
    forever on a gradient that never comes."""
    ledger = TokenLedger()
    ledger.restart(5)
    steps = SyncSteps(Session(None, Who("worker", 0, 7)))  # type: ignore[arg-type]
    steps.token = ledger.take(0, 7, 2, -1)
    assert steps.token == 5
    steps.step_done(delivered=False)
    assert ledger.take(0, 7, 2, steps.have) == 5  # the same token again
    steps.step_done(delivered=True)
    assert ledger.take(0, 7, 2, steps.have) is None  # computed: wait for step 6
