"""Membership: registration, rejoin, fencing, liveness, leaving, progress sums (time passed in)."""

from __future__ import annotations

import pytest

from zmqps.core.membership import Membership
from zmqps.wire.errors import FencedError, InvalidArgument, NotFound


def states(m: Membership, now: float) -> dict[int, str]:
    return {w["index"]: w["state"] for w in m.snapshot(now)}


def test_needs_a_worker() -> None:
    with pytest.raises(InvalidArgument):
        Membership(0)


def test_register_first_time_is_not_a_rejoin() -> None:
    m = Membership(2, timeout=5.0)
    assert m.register(0, incarnation=7, now=1.0, steps_planned=10) is False
    assert m.first_registration == 1.0
    assert m.register(1, incarnation=3, now=2.0) is False
    assert m.first_registration == 1.0  # the first one sticks
    assert m.alive(2.0) == [0, 1]
    assert m.steps_planned == 10


@pytest.mark.parametrize("index", [-1, 2, 100])
def test_index_out_of_range(index: int) -> None:
    m = Membership(2)
    with pytest.raises(InvalidArgument):
        m.register(index, 0, now=0.0)
    with pytest.raises(InvalidArgument):
        m.heartbeat(index, 0, step=1, now=0.0)


def test_retried_register_refreshes_liveness_only() -> None:
    m = Membership(1, timeout=5.0)
    m.register(0, 1, now=0.0, steps_planned=4)
    m.heartbeat(0, 1, step=3, now=1.0, examples=96)
    assert m.register(0, 1, now=4.0, steps_planned=99) is False  # same incarnation: a retry
    w = m.workers[0]
    assert (w.step, w.examples, w.steps_planned, w.registered_at) == (3, 96, 4, 0.0)
    assert w.last_seen == 4.0
    assert m.global_step == 3


def test_rejoin_keeps_earlier_steps_so_global_step_never_goes_back() -> None:
    m = Membership(2, timeout=5.0)
    m.register(0, 1, now=0.0)
    m.register(1, 1, now=0.0)
    m.heartbeat(0, 1, step=10, now=1.0, examples=320)
    m.heartbeat(1, 1, step=4, now=1.0, examples=128)
    assert m.global_step == 14
    assert m.examples == 448

    # worker 0 dies and comes back as a new process: its step counter restarts at 0
    assert m.register(0, 2, now=20.0) is True
    assert m.global_step == 14
    assert m.examples == 448
    w = m.workers[0]
    assert (w.incarnation, w.step, w.steps_before, w.total_steps) == (2, 0, 10, 10)

    m.heartbeat(0, 2, step=3, now=21.0, examples=96)
    assert m.global_step == 17
    assert m.examples == 544
    assert {s["index"]: s["step"] for s in m.snapshot(21.0)} == {0: 13, 1: 4}

    # a third incarnation stacks on both earlier ones
    assert m.register(0, 5, now=30.0) is True
    assert m.workers[0].total_steps == 13
    assert m.global_step == 17


def test_heartbeat_step_and_examples_never_go_back() -> None:
    m = Membership(1)
    m.register(0, 0, now=0.0)
    m.heartbeat(0, 0, step=5, now=1.0, loss=2.5, examples=50)
    m.heartbeat(0, 0, step=3, now=2.0, examples=30)  # reordered / late heartbeat
    w = m.workers[0]
    assert (w.step, w.examples, w.loss) == (5, 50, 2.5)  # loss None keeps the last one
    m.heartbeat(0, 0, step=6, now=3.0, loss=1.5)
    assert (w.step, w.examples, w.loss) == (6, 50, 1.5)


def test_older_incarnation_is_fenced_on_register_and_heartbeat() -> None:
    m = Membership(1)
    m.register(0, 1, now=0.0)
    m.register(0, 2, now=1.0)
    with pytest.raises(FencedError):
        m.register(0, 1, now=2.0)
    with pytest.raises(FencedError):
        m.heartbeat(0, 1, step=9, now=2.0)
    with pytest.raises(FencedError):
        m.leave(0, 1, step=9, now=2.0, reason="done", examples=None)
    # nothing changed for the current incarnation
    w = m.workers[0]
    assert (w.incarnation, w.step, w.done, w.last_seen) == (2, 0, False, 1.0)


def test_heartbeat_of_unknown_worker_or_incarnation() -> None:
    m = Membership(2)
    # NotFound (not InvalidArgument): the worker's cue to register again (a new chief)
    with pytest.raises(NotFound, match="not registered"):
        m.heartbeat(1, 0, step=1, now=0.0)
    m.register(1, 3, now=0.0)
    with pytest.raises(InvalidArgument, match="never registered"):
        m.heartbeat(1, 4, step=1, now=0.0)


def test_heartbeat_timeout_makes_a_worker_dead() -> None:
    m = Membership(2, timeout=10.0)
    m.register(0, 0, now=0.0)
    m.register(1, 0, now=0.0)
    m.heartbeat(0, 0, step=1, now=8.0)
    assert m.alive(10.0) == [0, 1]  # exactly `timeout` old is still alive
    assert m.dead(10.0) == []
    assert m.alive(10.5) == [0]
    assert m.dead(10.5) == [1]
    assert states(m, 10.5) == {0: "alive", 1: "dead"}
    assert m.dead(100.0) == [0, 1]

    # a dead worker that heartbeats again (same incarnation) is alive again
    m.heartbeat(1, 0, step=2, now=100.0)
    assert m.alive(100.0) == [1]
    # a dead worker that restarts is a new incarnation and alive
    assert m.register(0, 1, now=100.0) is True
    assert m.alive(100.0) == [0, 1]


def test_leave_and_all_done() -> None:
    m = Membership(2, timeout=10.0)
    m.register(0, 0, now=0.0)
    assert not m.all_done()
    m.leave(0, 0, step=7, now=5.0, reason="done", examples=70)
    assert not m.all_done()  # worker 1 never registered
    assert m.all_done_at is None
    m.register(1, 0, now=6.0)
    assert not m.all_done()
    # a reason not known to finish (a script's own close("interrupted")) leaves the work
    # unfinished: it counted as done and ended the run without it
    m.leave(1, 0, step=2, now=7.0, reason="interrupted", examples=None)
    assert not m.all_done() and m.workers[1].gone and not m.workers[1].done
    m.register(1, 1, now=8.0)
    m.leave(1, 1, step=1, now=9.0, reason="out of data", examples=None)
    assert m.all_done()
    assert m.all_done_at == 9.0
    assert m.global_step == 10
    assert m.examples == 70
    w1 = m.workers[1]
    assert (w1.done, w1.left_reason, w1.total_steps) == (True, "out of data", 3)
    # done workers are neither alive nor dead, however old their last heartbeat
    assert m.alive(1000.0) == []
    assert m.dead(1000.0) == []
    assert states(m, 1000.0) == {0: "done", 1: "done"}


def test_rejoin_after_done_reopens_the_job() -> None:
    m = Membership(1)
    m.register(0, 0, now=0.0)
    m.leave(0, 0, step=4, now=1.0, reason="done", examples=None)
    assert m.all_done() and m.all_done_at == 1.0
    assert m.register(0, 1, now=2.0) is True
    assert not m.all_done()
    assert m.all_done_at is None
    assert m.global_step == 4
    m.leave(0, 1, step=2, now=3.0, reason="done", examples=None)
    assert m.all_done_at == 3.0
    assert m.global_step == 6


def test_sums_over_workers() -> None:
    m = Membership(3)
    m.register(0, 0, now=0.0, steps_planned=100)
    m.register(1, 0, now=0.0, steps_planned=50)
    m.register(2, 0, now=0.0)
    m.heartbeat(0, 0, step=11, now=1.0, examples=110)
    m.heartbeat(1, 0, step=5, now=1.0, examples=50)
    assert m.global_step == 16
    assert m.examples == 160
    assert m.steps_planned == 150
    # a rejoin brings the new incarnation's plan (the old one's is replaced)
    m.register(1, 1, now=2.0, steps_planned=45)
    assert m.steps_planned == 145
    assert m.global_step == 16


def test_snapshot() -> None:
    m = Membership(3, timeout=5.0)
    m.register(2, 4, now=0.0)
    m.register(0, 1, now=0.0)
    m.register(1, 1, now=0.0)
    m.heartbeat(0, 1, step=3, now=9.0, loss=0.25)
    m.heartbeat(2, 4, step=1, now=2.0)
    m.leave(1, 1, step=2, now=9.5, reason="done", examples=None)
    snap = m.snapshot(10.0)
    assert [s["index"] for s in snap] == [0, 1, 2]  # sorted by index
    assert snap[0] == {
        "index": 0,
        "incarnation": 1,
        "step": 3,
        "loss": 0.25,
        "state": "alive",
        "last_seen_s": 1.0,
    }
    assert snap[1]["state"] == "done"
    assert snap[2]["state"] == "dead"
    assert snap[2]["incarnation"] == 4
    assert snap[2]["last_seen_s"] == 8.0
    assert snap[2]["loss"] is None


def test_a_worker_known_done_from_the_ps_is_asked_to_register() -> None:
    """Fault schedule 75 of run 10: a restarted chief learned from the PS that worker 0
    had finished; the worker's next request, of its real incarnation, was refused as
    'never registered' and the worker exited 1. It is asked to register instead."""
    m = Membership(2, timeout=10.0)
    m.known_done(0, 600, now=0.0)
    with pytest.raises(NotFound, match="register"):
        m.heartbeat(0, 1795577026030011, 600, now=1.0)
    assert m.register(0, 1795577026030011, now=1.0)  # a later incarnation: it rejoins
    m.heartbeat(0, 1795577026030011, 600, now=2.0)
    with pytest.raises(InvalidArgument, match="never registered"):  # a real one stays exact
        m.heartbeat(0, 1795577026030012, 600, now=3.0)


def test_a_finished_worker_whose_work_was_lost_is_awaited_as_a_member() -> None:
    """A chief started after the PS lost part of the work of a worker that finished:
    the worker is no longer done (the run does not end without it), its batches leave
    the global step until it says them again, and it is dead if it never speaks."""
    m = Membership(2, timeout=2.5)
    m.known_done(0, 600, now=0.0)
    m.known_done(1, 500, now=0.0)
    assert m.all_done() and m.global_step == 1100
    m.await_back(1, now=1.0)
    assert not m.all_done() and m.global_step == 600
    assert m.alive(3.0) == [1] and m.dead(3.6) == [1]
    m.seen(1, now=3.0)  # (a chief's start over: the timeout counts from there)
    assert m.alive(5.0) == [1]
    assert m.register(1, 7, now=5.0)  # its real incarnation, as a rejoin
    m.leave(1, 7, 500, 6.0, "done", None, waits=True)
    assert m.all_done() and m.global_step == 1100


def test_a_worker_running_before_the_chief_started_dies_if_it_never_speaks() -> None:
    """Fault schedule 9 of run 11: a restarted chief adopted the PS while worker 1,
    SIGSTOPped, had not registered again; never a member, it was never counted dead,
    and the sync step waited 34 s for it. Known from the PS, it is a member from the
    chief's start: dead after the timeout, and its real incarnation registers."""
    m = Membership(3, timeout=2.5)
    m.register(0, 11, now=0.0)
    assert m.expect(1, now=0.0)
    assert not m.expect(0, now=0.0)  # registered already: unchanged
    assert m.workers[0].incarnation == 11
    assert m.alive(2.0) == [0, 1] and m.dead(2.0) == []
    m.heartbeat(0, 11, 5, now=3.0)
    assert m.alive(3.0) == [0] and m.dead(3.0) == [1]
    with pytest.raises(NotFound, match="register"):  # its process, back: register first
        m.heartbeat(1, 1795580723840147, 56, now=40.0)
    assert m.register(1, 1795580723840147, now=40.0)
    assert m.alive(40.0) == [1] and m.dead(40.0) == [0]


def test_a_restarted_chief_carries_the_runs_examples_and_time_from_its_checkpoint() -> None:
    """A chief that took over a running cluster whose workers finished before it
    started: its figures are at least what its latest checkpoint recorded, never 0."""
    m = Membership(2, timeout=10.0)
    m.carry({"examples": 5000, "train_seconds": 12.5, "global_step": 40})
    m.known_done(0, 20, now=100.0)
    m.known_done(1, 20, now=100.0)
    assert m.all_done() and m.examples == 5000
    assert m.train_seconds(now=200.0) == 12.5  # done at once: nothing of its own
    m.carry({"examples": "many"})  # a checkpoint that does not say: nothing changes
    assert m.examples == 5000
    fresh = Membership(1)
    fresh.register(0, 0, now=10.0)
    fresh.heartbeat(0, 0, 3, now=13.0, examples=96)
    assert fresh.examples == 96 and fresh.train_seconds(now=14.0) == 4.0


@pytest.mark.parametrize("seed", range(20))
def test_the_global_step_kept_as_counts_change_is_the_sum_over_every_incarnation(seed: int) -> None:
    """The running totals read with every heartbeat and every leave (the global step,
    whether every worker is done) equal what a look at every worker says, whatever
    mix of registrations, heartbeats (also lagging ones), rejoins, leaves (done,
    waiting for the end, unfinished), reopenings, workers known from the PS only or
    expected, and resume points comes."""
    import random

    rng = random.Random(seed)
    m = Membership(6, timeout=5.0)
    incarnation = dict.fromkeys(range(6), 0)
    for t in range(300):
        i = rng.randrange(6)
        op = rng.random()
        w = m.workers.get(i)
        if w is None or op < 0.1:
            if w is None and rng.random() < 0.2:
                m.known_done(i, rng.randrange(50), float(t))
            elif w is None and rng.random() < 0.2:
                m.expect(i, float(t))
            else:
                incarnation[i] += 1
                m.register(i, incarnation[i], float(t))
        elif w.incarnation == 0:
            incarnation[i] += 1
            m.register(i, incarnation[i], float(t))
        elif op < 0.8:
            m.heartbeat(i, w.incarnation, w.step + rng.randrange(-3, 5), float(t))
        elif op < 0.85:
            m.set_steps_before(i, rng.randrange(100))
        elif op < 0.9:
            m.reopen(i, float(t))
        else:
            reason = rng.choice(["done", "done", "failed"])
            m.leave(
                i, w.incarnation, w.step + rng.randrange(3), float(t), reason, None,
                waits=rng.random() < 0.5,
            )  # fmt: skip
        assert m.global_step == sum(x.total_steps for x in m.workers.values())
        every = len(m.workers) == m.num_workers and all(x.done for x in m.workers.values())
        assert m.all_done() == every
    # the end of a run: every worker leaves with its work done, in a random order
    for i in rng.sample(range(6), 6):
        w = m.workers.get(i)
        if w is None or w.incarnation == 0:
            incarnation[i] += 1
            m.register(i, incarnation[i], 300.0)
            assert not m.all_done()
        m.leave(i, incarnation[i], 0, 301.0, "done", None)
        every = all(x.done for x in m.workers.values())
        assert m.all_done() == (len(m.workers) == m.num_workers and every)
    assert m.all_done() and m.all_done_at is not None


def test_a_chief_that_took_over_measures_the_rate_on_what_it_saw() -> None:
    """Killed before its first checkpoint, a chief started again counted every example
    the workers had trained (they say their totals) over its own seconds only: 59,648
    examples/s reported against about 17,000 measured by hand. It measures the rate on
    the examples trained after it first heard each worker."""
    m = Membership(2, timeout=10.0)
    m.adopted = True  # no checkpoint to carry: examples_carried, seconds_carried 0
    m.register(0, 1, now=100.0)
    m.register(1, 1, now=100.0)
    m.heartbeat(0, 1, step=500, now=100.5, examples=16_000)  # trained before the restart
    m.heartbeat(1, 1, step=500, now=100.5, examples=16_000)
    m.heartbeat(0, 1, step=600, now=110.0, examples=19_200)
    m.heartbeat(1, 1, step=600, now=110.0, examples=19_200)
    assert m.examples == 38_400  # the whole run's
    assert m.examples_per_second(110.0) == pytest.approx(6_400 / 10.0)
    fresh = Membership(1, timeout=10.0)  # a chief of the whole run: all it counted
    fresh.register(0, 1, now=100.0)
    fresh.heartbeat(0, 1, step=10, now=104.0, examples=3_200)
    assert fresh.examples_per_second(104.0) == pytest.approx(3_200 / 4.0)


def test_a_chief_started_after_every_worker_finished_counts_their_examples_and_rate() -> None:
    """Every worker finished before this chief started (the old one was killed during
    the final checkpoint): their examples come from the chief's record of them, and the
    rate from the seconds its latest checkpoint recorded (it said 0.0 examples/s and
    26,428 to 46,353 examples of 57,520). Without a record, at least the checkpoint's."""
    m = Membership(2, timeout=10.0)
    m.adopted = True
    m.carry({"examples": 50_000, "train_seconds": 20.0})  # a checkpoint before the end
    m.known_done(0, 920, now=500.0, examples=28_760)
    m.known_done(1, 920, now=500.0, examples=28_760)
    assert m.all_done() and m.examples == 57_520 and m.global_step == 1_840
    assert m.examples_per_second(501.0) == pytest.approx(57_520 / 20.0)
    # the record of the workers that finished says the run's seconds at the end: its
    # checkpoint was of before it (5,829 examples/s said for about 3,800)
    m.carry_seconds(15.0)  # never lowers what is carried
    m.carry_seconds(24.0)
    assert m.examples_per_second(501.0) == pytest.approx(57_520 / 24.0)
    assert m.train_seconds(501.0) == pytest.approx(24.0)
    # workers that rejoin and leave at once (async: their last push was before): the
    # chief saw nothing to measure, the run's rate all the same (it said 0.0)
    rejoined = Membership(2, timeout=10.0)
    rejoined.adopted = True
    rejoined.carry({"examples": 50_000, "train_seconds": 20.0})
    for i in (0, 1):
        rejoined.register(i, 2, now=500.0)
        rejoined.heartbeat(i, 2, step=920, now=500.2, examples=28_760)
        rejoined.leave(i, 2, 920, 500.3, "done", 28_760)
    assert rejoined.examples_per_second(500.3) == pytest.approx(57_520 / 20.3, rel=1e-3)
    # nothing said how long the run trained before (no checkpoint, nobody finished
    # before this chief): not known, None (it said 102,531 examples/s over 0.56 s; then
    # 0.0, as if the run trained nothing)
    unknown_seconds = Membership(1, timeout=10.0)
    unknown_seconds.adopted = True
    unknown_seconds.register(0, 2, now=500.0)
    unknown_seconds.leave(0, 2, 920, 500.5, "done", 28_760)
    assert unknown_seconds.examples_per_second(500.5) is None
    unknown = Membership(2, timeout=10.0)  # a record that did not say them
    unknown.adopted = True
    unknown.carry({"examples": 50_000, "train_seconds": 20.0})
    unknown.known_done(0, 920, now=500.0)
    unknown.known_done(1, 920, now=500.0)
    assert unknown.examples == 50_000
    alone = Membership(1, timeout=10.0)  # no checkpoint either: no rate to tell
    alone.adopted = True
    alone.known_done(0, 920, now=500.0, examples=28_760)
    assert alone.examples_per_second(501.0) is None


def test_a_killed_workers_batches_after_its_last_heartbeat_count_their_examples() -> None:
    """A SIGKILLed worker's batches pushed after its last heartbeat were missing from
    the run's examples (167,655 of 172,560): the PS know how many batches it pushed,
    and those not heard count at the mean size of those heard."""
    m = Membership(1, timeout=10.0)
    m.register(0, 1, now=0.0)
    m.heartbeat(0, 1, step=100, now=5.0, examples=3_200)
    m.register(0, 2, now=6.0)  # killed, started again: the PS say 120 batches
    m.set_steps_before(0, 120)
    assert m.global_step == 120 and m.examples == 3_840
    m.heartbeat(0, 2, step=10, now=7.0, examples=320)
    assert m.global_step == 130 and m.examples == 4_160


def test_a_resumed_run_counts_the_examples_and_seconds_of_the_batches_it_resumes_after() -> None:
    """``--resume`` of a stopped run: the global step and the worker steps said the whole
    run, the examples only this launch's (2,876 for a run of 4,314), and the rate was
    over this launch's seconds. The batches each worker resumes after count at the mean
    size of the stopped run's, its training seconds carried."""
    m = Membership(2, timeout=10.0)
    m.resume({"workers": {"0": 30, "1": 30}, "examples": 1_920, "train_seconds": 6.0})
    for i in (0, 1):
        m.register(i, 1, now=100.0)
        m.set_steps_before(i, 30)  # where it resumes: after the batches the checkpoint holds
    assert m.global_step == 60 and m.examples == 1_920
    m.heartbeat(0, 1, step=10, now=104.0, examples=320)
    m.heartbeat(1, 1, step=10, now=104.0, examples=320)
    assert m.global_step == 80 and m.examples == 2_560
    assert m.train_seconds(now=104.0) == 10.0
    assert m.examples_per_second(104.0) == pytest.approx(256.0)
    m.register(1, 2, now=105.0)  # restarted within the resumed run: carries its totals
    m.set_steps_before(1, 40)
    assert m.examples == 2_560
    for extra in ({}, {"workers": {"0": "x"}, "examples": 5}, {"workers": {}, "examples": 9}):
        other = Membership(1, timeout=10.0)
        other.resume(extra)  # a checkpoint that does not say: the figures are this run's
        other.register(0, 1, now=0.0)
        other.set_steps_before(0, 12)
        assert other.examples == 0 and other.train_seconds(now=1.0) == 1.0


@pytest.mark.parametrize(
    ("raised", "reason"),
    [
        (None, "done"),
        (SystemExit(0), "done"),
        (SystemExit(None), "done"),
        (SystemExit(2), "error"),
        (SystemExit("bad input"), "error"),
        (KeyboardInterrupt(), "terminated"),
        (ValueError("a bug"), "error"),
    ],
)
def test_a_worker_block_left_by_sys_exit_0_is_done(
    raised: BaseException | None, reason: str
) -> None:
    """``sys.exit(0)`` in ``with Worker(...)`` left as terminated: the chief waited for
    the worker to come back, and the run failed at its stall timeout."""
    from types import SimpleNamespace

    from zmqps.roles.worker.worker import Worker

    said: list[str] = []
    w = SimpleNamespace(close=said.append)
    Worker.__exit__(w, None if raised is None else type(raised), raised, None)  # type: ignore[arg-type]
    assert said == [reason]


def test_a_worker_that_says_the_examples_it_resumed_after_is_counted_exactly() -> None:
    """``--resume`` and a worker started again counted the batches each resumed after at
    a mean batch size (28,784 and 28,783 examples for 28,760: each epoch's last batch is
    smaller). A worker whose loop knows its data says them: the chief takes that."""
    m = Membership(2, timeout=10.0)
    m.resume({"workers": {"0": 30, "1": 30}, "examples": 1_900, "train_seconds": 6.0})
    for i in (0, 1):
        m.register(i, 1, now=100.0)
        m.set_steps_before(i, 30)
    assert m.examples == 1_900  # at the mean until they say
    m.heartbeat(0, 1, step=2, now=101.0, examples=64, examples_before=951)
    m.heartbeat(1, 1, step=2, now=101.0, examples=64, examples_before=949)
    assert m.examples == 951 + 949 + 128
    m.set_steps_before(0, 30)  # a late count of the PS changes nothing said exactly
    assert m.examples == 951 + 949 + 128
    # a worker killed after its last heartbeat, started again: it says its own too
    m.register(1, 2, now=102.0)
    m.set_steps_before(1, 40)  # estimated from what incarnation 1 said ...
    m.leave(1, 2, step=3, now=103.0, reason="done", examples=96, examples_before=1_271)
    assert m.examples == 951 + 64 + 1_271 + 96  # ... until incarnation 2 says it
    assert m.global_step == 30 + 2 + 40 + 3


def test_a_resumed_run_says_the_seconds_its_train_seconds_carry() -> None:
    """After ``--resume`` the training seconds and the rate count the whole run: the
    stopped part's seconds are said (``train_seconds_before_resume``)."""
    m = Membership(1, timeout=10.0)
    assert m.seconds_resumed is None
    m.resume({"workers": {"0": 10}, "examples": 320, "train_seconds": 5.5})
    m.register(0, 1, now=10.0)
    m.set_steps_before(0, 10)
    m.leave(0, 1, step=10, now=12.0, reason="done", examples=320, examples_before=320)
    assert m.seconds_resumed == 5.5 and m.train_seconds(now=20.0) == 7.5
    assert m.examples_per_second(20.0) == pytest.approx(640 / 7.5)
