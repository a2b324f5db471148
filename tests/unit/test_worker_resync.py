"""When a worker whose data request failed goes on: after a restore, or, for a PS that
was only cut off (a partition), as soon as the chief hears every PS again."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from zmqps.core.sync import TokenLedger
from zmqps.roles.channels import Delivery
from zmqps.roles.worker.modes import SyncSteps
from zmqps.roles.worker.session import Session, cut_off
from zmqps.wire import Message
from zmqps.wire.errors import DeadlineExceeded, NotPrimary, NotReady, RolledBack
from zmqps.wire.ops import ClusterInfo, HeartbeatReply, TakeToken, Token, Who

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


class _Chief:
    """Answers heartbeats with the replies given, in turn (the last one for ever)."""

    endpoint = "inproc://chief"

    def __init__(self, *replies: HeartbeatReply) -> None:
        self.replies = list(replies)

    async def request(self, op: str, body: Any = None, *_: Any, **__: Any) -> Message:
        assert op == "heartbeat"
        rep = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        return Message("ok", body=rep.to_wire())


def _moved(epoch: int) -> NotPrimary:
    exc = NotPrimary("ps 2 holds no copy of ps 1's state")
    exc.epoch = epoch  # type: ignore[attr-defined]  # routed by (StateLink)
    return exc


@pytest.mark.parametrize(
    "error,beats",
    [
        # routed by an older placement epoch than the session knows: at once
        (_moved(0), [beat()]),
        # the state moves while the worker waits (a heartbeat names epoch 1)
        (_moved(1), [beat(), beat(epoch=2)]),
        # cut off, and every PS answers the chief again
        (TIMEOUT, [beat()]),
    ],
)
def test_a_push_that_failed_with_no_restore_is_sent_again_whole(
    error: Exception, beats: list[HeartbeatReply]
) -> None:
    """A sync push failed and no restore came: it is sent again with the same messages
    (the same Delivery: the same sequence numbers, answered ones skipped) until it is
    delivered, and the step counts as computed. Dropping it instead (as before) left
    the step waiting for ever on a gradient no PS had (a run stalled after a
    fail-over)."""
    session = Session(_Chief(*beats), Who("worker", 0, 7), recovery_timeout=5.0)  # type: ignore[arg-type]
    session.info = ClusterInfo(ps=(), mode="sync", heartbeat_interval=0.01)
    session.epoch = 1
    ledger = TokenLedger()
    ledger.restart(5)
    steps = SyncSteps(session)
    steps.token = ledger.take(0, 7, 2, -1)
    deliveries: list[Delivery] = []

    async def push(delivery: Delivery) -> bool:
        deliveries.append(delivery)
        if len(deliveries) == 1:
            delivery.seqs[(1, (4,))] = (9, None)
            raise error
        return True

    assert asyncio.run(asyncio.wait_for(session.dropping(push), 5.0)) is True
    assert len(deliveries) == 2 and deliveries[0] is deliveries[1]
    assert deliveries[1].seqs == {(1, (4,)): (9, None)} and deliveries[1].again == 1
    assert session.resent == 1 and session.rolled_back == 0
    steps.step_done()
    assert ledger.take(0, 7, 2, steps.have) is None  # computed: wait for step 6


def test_a_push_through_a_restore_is_dropped_and_counted() -> None:
    session = Session(_Chief(beat(gen=1)), Who("worker", 0, 7), recovery_timeout=5.0)  # type: ignore[arg-type]
    session.info = ClusterInfo(ps=(), mode="sync", heartbeat_interval=0.01)
    calls = 0

    async def push(delivery: Delivery) -> bool:
        nonlocal calls
        calls += 1
        raise NotReady("ps 1 holds no shards")

    assert asyncio.run(asyncio.wait_for(session.dropping(push), 5.0)) is False
    assert calls == 1 and session.rolled_back == 1 and session.gen == 1
