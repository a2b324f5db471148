"""A restore that goes back to a checkpoint loses no acknowledged batch: the checkpoint
records, per worker, the batches (cursor) its values hold; the restore sets every PS's
cursors to them exactly; each worker's data goes back there and the later batches are
trained again. Sans-IO pieces here; the run itself in tests/cluster/test_recovery.py.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_chief import SGD, VARS, call, finished_run, make_env, who
from test_chief import run as run_chief
from test_ps_client import run
from test_ps_recovery import chief, created_cluster, defs_by_ps, grads, placement_for

from zmqps.checkpoint import Checkpoint, CheckpointRoot, Manifest
from zmqps.core.dedup import RECENT, PushLedger
from zmqps.core.membership import Membership
from zmqps.data import Dataset, batches, stream
from zmqps.roles.checkpointer import _cursors
from zmqps.roles.ps import PSService
from zmqps.roles.worker import session as session_module
from zmqps.roles.worker.session import Session
from zmqps.wire import Message
from zmqps.wire import ops as o
from zmqps.wire.errors import DeadlineExceeded, RolledBack

# ---------------------------------------------------------------- the PS's ledger


def test_async_checkpoint_holds_every_applied_push() -> None:
    led = PushLedger()
    for c in (1, 2, 3):
        led.applied("worker:0", 1, 0, c, None)
    led.applied("worker:1", 1, 0, 7, None)
    assert led.included(None) == {"worker:0": 3, "worker:1": 7}


def test_sync_checkpoint_holds_the_pushes_of_applied_steps_only() -> None:
    led = PushLedger()
    # worker 0 pushed batches 1..5 for steps 0..4; step 4 is in progress (not applied)
    for step in range(5):
        led.applied("worker:0", 1, 0, step + 1, step)
    assert led.included(4) == {"worker:0": 4}
    assert led.included(5) == {"worker:0": 5}
    assert led.included(0) == {}
    # far more steps than are kept: the older ones still count, memory stays bounded
    for step in range(5, 100):
        led.applied("worker:0", 1, 0, step + 1, step)
    assert len(led.get("worker:0").recent) == RECENT
    assert led.included(99) == {"worker:0": 99}
    assert led.included(50) == {"worker:0": 100 - RECENT}  # at least what left the window


def test_the_ledger_knows_a_batch_counted_toward_another_step() -> None:
    led = PushLedger()
    assert not led.counted_at_another_step("worker:0", 1, 0)  # never heard of
    led.applied("worker:0", 1, 0, 1, 0)
    led.applied("worker:0", 1, 0, 1, 0)  # a second layer of the same batch and step
    assert not led.counted_at_another_step("worker:0", 1, 0)  # its other layers: fine
    assert led.counted_at_another_step("worker:0", 1, 1)  # redone at a later step
    assert not led.counted_at_another_step("worker:0", 2, 1)  # the next batch
    assert not led.counted_at_another_step("worker:1", 1, 1)  # another worker's
    for step in range(1, 3 * RECENT):  # far more steps than are kept
        led.applied("worker:0", 1, 0, step + 1, step)
    assert led.counted_at_another_step("worker:0", 3, 3 * RECENT)  # left ``recent``
    # an exact restore back to batch 4: batches 5 on are trained again, as new ones
    led.restored({"worker:0": 4}, exact=True)
    assert not led.counted_at_another_step("worker:0", 5, 0)
    assert led.counted_at_another_step("worker:0", 3, 0)


def test_an_exact_restore_sets_cursors_back_and_counts_what_it_took() -> None:
    led = PushLedger()
    for c in range(1, 11):
        led.applied("worker:0", 1, 0, c, None)
    for c in range(1, 5):
        led.applied("worker:1", 1, 0, c, None)
    led.restored({"worker:0": 6}, exact=True)  # worker 1: none of its batches held
    assert led.cursors() == {"worker:0": 6}
    assert led.get("worker:0").rolled_back == 4
    assert led.get("worker:1").rolled_back == 4
    assert led.progress("worker:1") == (0, -1)
    # what a chief started later counts the async global step from does not go back
    assert led.highs() == {"worker:0": 10, "worker:1": 4}
    # a restarted PS (nothing known) learns them; a non-exact restore only raises
    fresh = PushLedger()
    fresh.restored({"worker:0": 6, "worker:1": 2}, exact=True)
    assert fresh.cursors() == {"worker:0": 6, "worker:1": 2}
    led.restored({"worker:0": 3, "worker:1": 9})
    assert led.cursors() == {"worker:0": 6, "worker:1": 9}


def test_ps_reports_held_cursors_and_sets_them_at_a_rewinding_restore(tmp_path: Path) -> None:
    async def body() -> None:
        root = CheckpointRoot(tmp_path / "ckpt")
        c = await created_cluster(placement_for(2, 3), 2, root.path)
        w = c.client("worker:0")
        for cursor in (1, 2, 3):
            assert await w.push(grads(cursor), cursor=cursor)
        temp = root.new_temp(3)
        saved = [
            o.Saved.parse(
                (await chief(c, i).request("checkpoint_save", {"name": temp.name, "id": 1})).body
            )
            for i in range(2)
        ]
        assert [s.cursors for s in saved] == [{"worker:0": 3}] * 2
        # resent (idempotent by id): the first snapshot's cursors, not today's
        assert await w.push(grads(4), cursor=4)
        again = await chief(c, 0).request("checkpoint_save", {"name": temp.name, "id": 1})
        assert again.body["cursors"] == {"worker:0": 3}
        assert _cursors(saved) == {"worker:0": 3}
        by_ps = defs_by_ps(c.placement)
        for i in range(2):
            body = o.Restore(1, 0, tuple(by_ps.get(i, [])), None, c.placement.to_wire())
            wire = {**body.to_wire(), "cursors": {"worker:0": 3}, "rewind": True}
            await chief(c, i).request("restore", wire)
        for svc in c.services:
            assert svc.pushes.cursors() == {"worker:0": 3}
            assert svc.pushes.get("worker:0").rolled_back == 1
            state = o.PsStateReply.parse((await chief(c, svc.index).request("ps_state")).body)
            assert state.rewinds == {"worker:0": 3}

    run(body())


# ---------------------------------------------------------------- the chief's side


def test_snapshot_cursors_merge_by_the_highest_and_need_every_ps() -> None:
    a = o.Saved([], 4, 0.0, {"worker:0": 5, "worker:1": 2})
    b = o.Saved([], 4, 0.0, {"worker:0": 6})
    assert _cursors([a, b]) == {"worker:0": 6, "worker:1": 2}
    assert _cursors([a, o.Saved([], 4, 0.0)]) is None  # a PS that does not say


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ({"cursors": {"worker:0": 4}}, {"worker:0": 4}),
        ({}, None),
        ({"cursors": {"worker:0": -1}}, None),
        ({"cursors": {"worker:0": True}}, None),
        ({"cursors": [1, 2]}, None),
    ],
)
def test_a_checkpoint_says_its_cursors_or_none(
    tmp_path: Path, extra: dict[str, object], want: dict[str, int] | None
) -> None:
    m = Manifest(step=0, variables=[], optimizer={}, num_ps=1, shards=[], extra=extra)
    assert Checkpoint(tmp_path, m).cursors == want


# ---------------------------------------------------------------- the worker's side


class _NoChief:
    endpoint = "inproc://none"


def test_session_hands_a_rewind_over_once_per_restore() -> None:
    s = Session(_NoChief(), o.Who("worker", 0, 1))  # type: ignore[arg-type]
    heard: list[int] = []
    s.on_restored(heard.append)
    s.enter(0, 5)  # the generation it is in already: nothing happened
    assert s.take_rewind() is None
    s.enter(1, 5)
    assert heard == [1]
    assert s.take_rewind() == 5
    assert s.take_rewind() is None
    s.enter(2, None)  # a restore that did not go back (an older checkpoint)
    assert s.take_rewind() is None


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    batch=st.integers(1, 9),
    epochs=st.integers(1, 4),
    seed=st.integers(0, 50),
    data=st.data(),
)
def test_stream_from_any_position_is_the_rest_of_the_epochs(
    n: int, batch: int, epochs: int, seed: int, data: st.DataObject
) -> None:
    rng = np.random.default_rng(seed)
    ds = Dataset(rng.standard_normal((n, 3)).astype(np.float32), rng.integers(0, 4, n), 4, "t")
    every = [b for e in range(epochs) for b in batches(ds, batch, e, seed)]
    start = data.draw(st.integers(0, len(every)))
    got = list(stream(ds, batch, epochs, seed, start))
    assert len(got) == len(every) - start
    for (x, y), (ex, ey) in zip(got, every[start:], strict=True):
        np.testing.assert_array_equal(x, ex)
        np.testing.assert_array_equal(y, ey)


# ---------------------------------------------------------------- finished workers


def test_a_finished_worker_that_waits_is_reopened_by_a_restore_taking_its_batches() -> None:
    m = Membership(3, timeout=10.0)
    for i in range(3):
        m.register(i, 1, 0.0)
    m.leave(0, 1, 50, 1.0, "done", None, waits=True)
    m.leave(1, 1, 50, 1.0, "done", None)  # left for good (a loop that does not wait)
    m.leave(2, 1, 50, 1.0, "done", None, waits=True)
    assert m.all_done() and m.waiting(2.0) == [0, 2]
    assert m.reopen(0, 2.0)
    assert not m.reopen(1, 2.0)  # gone: it cannot train again, nothing waits for it
    assert not m.reopen(2, 30.0)  # no longer heard from
    assert not m.all_done() and m.alive(2.0) == [0]
    assert m.global_step == 150  # the steps reported stay (they never go back)


def test_the_chief_sends_back_only_the_workers_whose_batches_the_restore_took() -> None:
    async def body() -> None:
        env = await finished_run(1, 2, steps=20, waits=True)
        rec = env.chief.recovery
        rec.rewinds = {"worker:0": 12, "worker:1": 20}
        rec._reopen(rec.rewinds)
        assert [w.done for _, w in sorted(env.chief.members.workers.items())] == [False, True]
        beat = o.HeartbeatReply.parse((await call(env.chief, "heartbeat", who(0, step=20))).body)
        assert beat.rewind == 12
        done = o.HeartbeatReply.parse((await call(env.chief, "heartbeat", who(1, step=20))).body)
        assert done.rewind is None

    run_chief(body())


class _ScriptedChief:
    """Answers heartbeats with the replies given, in turn (the last one for ever)."""

    endpoint = "inproc://chief"

    def __init__(self, *replies: o.HeartbeatReply) -> None:
        self.replies = list(replies)
        self.beats = 0

    async def request(self, op: str, body: Any = None, *_: Any, **__: Any) -> Message:
        assert op == "heartbeat"
        self.beats += 1
        rep = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        return Message("ok", body=rep.to_wire())

    async def close(self) -> None:
        pass


def _lingering(chief: _ScriptedChief, position: int) -> tuple[int | None, Session]:
    s = Session(chief, o.Who("worker", 0, 1))  # type: ignore[arg-type]
    s.info = o.ClusterInfo(ps=(), mode="sync", heartbeat_interval=0.01)

    async def go() -> int | None:
        try:
            return await s.linger(position, lambda: False)
        finally:
            if s._heartbeats is not None:
                s._heartbeats.cancel()

    return asyncio.run(asyncio.wait_for(go(), 5.0)), s


def test_a_waiting_worker_goes_back_to_work_when_a_restore_takes_its_batches() -> None:
    chief = _ScriptedChief(
        o.HeartbeatReply(10, 0),
        o.HeartbeatReply(10, 1, recovering=True),
        o.HeartbeatReply(8, 1, rewind=7),
    )
    back, s = _lingering(chief, 10)
    assert back == 7 and s.gen == 1 and chief.beats == 3
    # the run finished: no more waiting
    back, _ = _lingering(
        _ScriptedChief(o.HeartbeatReply(10, 0), o.HeartbeatReply(10, 0, finished=True)), 10
    )
    assert back is None
    # a restore that keeps every batch of this worker: it stays done
    back, s = _lingering(
        _ScriptedChief(o.HeartbeatReply(9, 1, rewind=10), o.HeartbeatReply(10, 1, finished=True)),
        10,
    )
    assert back is None and s.gen == 1


class _SilentThenChief(_ScriptedChief):
    """No answer (after ``jump`` seconds of the session's clock) for ``silent``
    heartbeats, then the replies given."""

    def __init__(self, clock: list[float], jump: float, silent: int, *replies: Any) -> None:
        super().__init__(*replies)
        self.clock, self.jump, self.silent = clock, jump, silent

    async def request(self, op: str, body: Any = None, *_: Any, **__: Any) -> Message:
        if self.silent:
            self.silent -= 1
            self.beats += 1
            self.clock[0] += self.jump
            raise DeadlineExceeded("heartbeat: no reply")
        return await super().request(op, body)


@pytest.mark.parametrize(("jump", "silent", "leaves"), [(15.0, 1, False), (5.0, 9, True)])
def test_a_waiting_worker_leaves_a_silent_chief_after_heartbeats_in_a_row(
    monkeypatch: pytest.MonkeyPatch, jump: float, silent: int, leaves: bool
) -> None:
    """Fault trial D1: a worker waiting for the run's end, stopped 15 s (SIGSTOP) while
    the chief restarted, left on the heartbeat it had sent before the stop ("no word
    from the chief for 10s") without asking the restarted chief, which then failed the
    run for its lost batches. It leaves after 3 heartbeats in a row unanswered, 10 s
    at least."""
    clock = [1000.0]
    monkeypatch.setattr(session_module.time, "monotonic", lambda: clock[0])
    chief = _SilentThenChief(clock, jump, silent, o.HeartbeatReply(10, 0, finished=True))
    back, _ = _lingering(chief, 10)
    assert back is None
    assert chief.beats == (3 if leaves else 2), chief.beats


def test_a_worker_waiting_for_the_runs_end_says_so_now_and_then(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker done with its work sat for minutes without a line while the run went
    on (another worker failed): it says it waits, and for how long."""
    monkeypatch.setattr(session_module, "LINGER_NOTE_S", 0.02)
    replies = [o.HeartbeatReply(10, 0)] * 12 + [o.HeartbeatReply(10, 0, finished=True)]
    with caplog.at_level(logging.INFO, logger="zmqps"):
        back, _ = _lingering(_ScriptedChief(*replies), 10)
    assert back is None
    said = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert said and all("its work done, waiting" in line for line in said), said


def test_a_push_of_values_of_before_a_restore_already_heard_of_is_dropped_at_once() -> None:
    # the session heard of generation 1 by heartbeat, but the values the push was
    # computed on were pulled in generation 0 (a coordinator function keeps its
    # parameters between calls): the PS refuses it; recovery must not wait for a
    # generation after 1 (it would, until its timeout)
    chief = _ScriptedChief(o.HeartbeatReply(10, 1))

    async def refused(_: object) -> bool:
        raise RolledBack("ps 0 is at generation 1; the request is of generation 0")

    async def go(made_in: int | None) -> bool:
        s = Session(chief, o.Who("worker", 0, 1), recovery_timeout=0.5)  # type: ignore[arg-type]
        s.info = o.ClusterInfo(ps=(), mode="async", heartbeat_interval=0.01)
        s.enter(1, None)
        return await s.dropping(refused, made_in)

    assert asyncio.run(asyncio.wait_for(go(0), 5.0)) is False
    with pytest.raises(DeadlineExceeded):  # as before: the session's own generation
        asyncio.run(asyncio.wait_for(go(None), 5.0))


def test_net_steps_never_go_below_zero() -> None:
    # a restarted worker whose restore took back batches of an earlier incarnation too
    # (40 of them, 34 steps done since): heartbeats, leave and ssp clocks say 0, not -6
    from types import SimpleNamespace

    from zmqps.roles.worker import Worker

    net = Worker.net_steps.fget  # type: ignore[attr-defined]
    assert net(SimpleNamespace(step=34, rewound=40)) == 0
    assert net(SimpleNamespace(step=50, rewound=40)) == 10


# ------------------------------------- a restore heard during the last batches' pushes


def test_a_done_of_work_older_than_the_chiefs_generation_is_refused_and_changes_nothing() -> None:
    """A worker whose last push was dropped by a restore (the PS it went to was lost)
    used to leave ``done`` all the same: the batches the restore took back were never
    trained again, and the run ended with exit 0 and the initial model. A done of an
    older generation than the chief's is refused; of the current one, taken."""

    async def body() -> None:
        env = make_env(1, num_workers=2)
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        for i in (0, 1):
            await call(env.chief, "register", who(i))
        env.chief.recovery.gen = 1
        with pytest.raises(RolledBack, match="restored"):
            await call(env.chief, "leave", who(0, step=20, reason="done", gen=0))
        assert not env.chief.members.workers[0].done
        await call(env.chief, "leave", who(0, step=20, reason="done", gen=1, waits=True))
        assert env.chief.members.workers[0].done
        await call(env.chief, "leave", who(1, step=20, reason="error", gen=0))  # not a done
        assert env.chief.members.workers[1].left_reason == "error"

    run_chief(body())


class _RefusingChief(_ScriptedChief):
    """Refuses the first ``leave`` as of an older generation, then takes them."""

    def __init__(self, *replies: o.HeartbeatReply) -> None:
        super().__init__(*replies)
        self.leaves: list[dict[str, Any]] = []

    async def request(self, op: str, body: Any = None, *_: Any, **__: Any) -> Message:
        if op != "leave":
            return await super().request(op, body)
        self.leaves.append(body)
        if len(self.leaves) == 1:
            raise RolledBack("worker 0: the cluster was restored (generation 1)")
        return Message("ok", body=o.StepReply(global_step=10).to_wire())


def test_a_refused_done_puts_the_session_in_the_new_generation_with_its_rewind() -> None:
    chief = _RefusingChief(o.HeartbeatReply(10, 1, rewind=3))
    s = Session(chief, o.Who("worker", 0, 1))  # type: ignore[arg-type]
    s.info = o.ClusterInfo(ps=(), mode="async", heartbeat_interval=0.01)

    async def go() -> tuple[bool | None, bool | None]:
        first = await s.leave("done", waits=True)
        assert s.gen == 1 and s.rewind == 3  # heard of, not taken yet
        return first, await s.leave("done", waits=True)

    assert asyncio.run(asyncio.wait_for(go(), 5.0)) == (None, True)
    assert [b["gen"] for b in chief.leaves] == [0, 1]


def test_finish_trains_again_the_batches_a_restore_took_back_during_the_last_push() -> None:
    """The worker's last push was dropped by a restore it heard of while pushing (the
    rewind waits in its session): finish() goes back there instead of leaving."""
    from zmqps.core.held import HeldExamples
    from zmqps.roles.worker.worker import Worker

    class _Session:
        rewind: int | None = 0
        name = "worker:0"

        def take_rewind(self) -> int | None:
            back, self.rewind = self.rewind, None
            return back

        async def leave(self, *_: Any, **__: Any) -> bool:
            raise AssertionError("left with batches to train again")

    w = Worker.__new__(Worker)
    w.session = _Session()  # type: ignore[assignment]
    w.steps_done, w.step, w.rewound, w._left, w.name = 0, 46, 0, False, "worker:0"
    w._held = HeldExamples()
    assert w.finish() == 0 and w.position == 0 and w.rewound == 46


def test_a_restore_the_ps_never_answered_is_sent_again() -> None:
    """Fault trial C7: a PS killed during the chief's start restore; the one started
    in its place never heard the restore, and the chief waited its whole start-up
    timeout (120 s), exited and was started again. A restore is sent again (at once
    when the connection comes back; here, where nothing reconnects, at half the
    start-up timeout), and the PS restored."""

    async def body() -> None:
        env = make_env(1, num_workers=1, startup_timeout=0.4)
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        ps, lost = env.services[0], []

        def first_lost(msg: Message) -> Any:
            if msg.op == "restore" and not lost:
                lost.append(msg)
                return asyncio.get_running_loop().create_future()  # never answered
            return ps(msg)

        env.net.serve(env.cfg.cluster.ps[0], first_lost, name="ps0")
        await env.chief.recovery.restore_all("a test")
        assert lost and ps.gen == env.chief.recovery.gen == 1

    run_chief(body())


def test_a_ps_restarted_during_a_restore_is_expected_with_its_new_boot_id() -> None:
    """The same, the PS started again in the killed one's place before the restore is
    sent again: it holds the restore. The health watch expected the boot id read
    before the restore, took the PS for restarted at its next probe and restored every
    PS a second time (a few batches trained again, for nothing); it now expects the
    boot id of the process that holds the restore."""

    async def body() -> None:
        env = make_env(1, num_workers=1, startup_timeout=0.4)
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        rec, killed, lost = env.chief.recovery, env.services[0], []
        started = PSService(0)  # the process started in the killed one's place

        def killed_in_the_restore(msg: Message) -> Any:
            if msg.op == "restore" and not lost:
                lost.append(msg)
                env.net.serve(env.cfg.cluster.ps[0], started, name="ps0")
                return asyncio.get_running_loop().create_future()  # never answered
            return killed(msg)

        env.net.serve(env.cfg.cluster.ps[0], killed_in_the_restore, name="ps0")
        await rec.restore_lost([0], env.clock(), "ps 0 restarted")
        assert lost and started.gen == rec.gen == 1 and started.boot != killed.boot
        assert rec.health.answered(0, started.boot, rec.gen, env.clock()) == "ok"
        assert rec.restore_count == 1

    run_chief(body())


def test_a_restore_with_no_ps_left_that_knew_the_cursors_still_rewinds_the_workers() -> None:
    """One PS, killed: the PS restarted knows no worker's cursor, and the restore used
    to keep none, so the workers went on past the batches it took back (a loop of its
    own lost them: 349 of 3,000 in one run). Workers at work in this run are sent back
    to the checkpoint's cursors all the same."""

    async def body() -> None:
        env = make_env(1, num_workers=2)
        rec = env.chief.recovery
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        for i in (0, 1):
            await call(env.chief, "register", who(i))
            await call(env.chief, "heartbeat", who(i, step=30))
        seen: list[Any] = []

        async def restore_all(reason: str, ckpt: Any = None, cursors: Any = None, *_: Any) -> int:
            seen.append(dict(cursors or {}))
            return 0

        rec.restore_all = restore_all  # type: ignore[method-assign]
        await rec.restore_lost([0], env.clock(), "ps 0 restarted")
        assert seen == [{"worker:0": 30, "worker:1": 30}]

    run_chief(body())


def _counting_worker(steps_done: int = 0) -> Any:
    """A Worker's step bookkeeping alone (no cluster): count_step and take_rewind."""
    from types import SimpleNamespace

    from zmqps.core.held import HeldExamples
    from zmqps.metrics.summaries import Window
    from zmqps.roles.worker.worker import Worker

    class _Session:
        rewind: int | None = None

        def take_rewind(self) -> int | None:
            back, self.rewind = self.rewind, None
            return back

    w = Worker.__new__(Worker)
    w.session = _Session()  # type: ignore[assignment]
    w.steps = SimpleNamespace(step_done=lambda: None)  # type: ignore[assignment]
    w.metrics = w.summaries = None
    w._window = Window()
    w.name, w.index, w.loss, w.examples = "worker:0", 0, None, 0
    w.steps_done, w.step, w.rewound, w.retrained, w._furthest = steps_done, 0, 0, 0, steps_done
    w._held, w.examples_of = HeldExamples(steps_done), None
    return w


def test_progress_lines_count_a_batch_trained_again_once_and_say_so() -> None:
    """A worker's "step N" counted every push: after a restore went back 20 batches,
    its lines said step 70 where its data was at 50 and the cluster held 50 of its
    batches. The step shown leaves the batches trained again out, and the line says
    how many there were."""
    from zmqps.roles.worker.train import due, retrained_note

    w = _counting_worker()
    for _ in range(50):
        w.count_step(0.5, 32)
    assert (w.net_steps, w.retrained, retrained_note(w)) == (50, 0, "")
    w.session.rewind = 30  # the checkpoint restored holds its first 30 batches
    assert w.take_rewind() == 30 and w.position == 30
    lines = []
    for _ in range(40):
        w.count_step(0.5, 32)
        if due(w, 10):
            lines.append((w.net_steps, w.retrained))
    # steps 31..50 trained again, 51..70 new: the lines at 40 and 50 come again
    assert (w.step, w.net_steps, w.position, w.retrained) == (90, 70, 70, 20)
    assert lines == [(40, 10), (50, 20), (60, 20), (70, 20)]
    assert retrained_note(w) == "; 20 batches trained again after a restore went back"
    w.session.rewind = 69
    w.take_rewind()
    w.count_step(0.5, 32)
    assert w.retrained == 21 and w.net_steps == 70
    assert not due(_counting_worker(), 10)  # nothing done yet: no line at step 0


def test_a_resumed_worker_counts_only_what_it_trains_again_itself() -> None:
    """A new incarnation that resumed after 100 batches of earlier ones: its steps past
    them are new, not trained again."""
    w = _counting_worker(steps_done=100)
    for _ in range(5):
        w.count_step(None, None)
    assert (w.position, w.net_steps, w.retrained) == (105, 5, 0)


def test_the_examples_of_batches_a_restore_took_back_are_counted_once() -> None:
    """A PS killed before any checkpoint: the restore took 161 batches back, the
    workers trained them again, and the run's examples counted them twice (33,810 for
    28,760). What a worker reports leaves the batches taken back out until trained
    again, by the examples each one had (a custom loop's own counts included)."""
    w = _counting_worker()
    sizes = [32] * 22 + [7]  # one epoch of 711 examples
    for p in range(50):
        w.count_step(0.5, sizes[p % 23])
    w.session.rewind = 0  # from scratch: every batch again
    w.take_rewind()
    assert w.held_examples == 0
    for p in range(50):
        w.count_step(0.5, sizes[p % 23])
    assert w.held_examples == 2 * 711 + 4 * 32 and w.examples == 2 * w.held_examples
    assert w.examples_resumed_after() is None  # a custom loop: the chief counts those


def test_a_loop_that_knows_its_data_reports_every_incarnations_examples_exactly() -> None:
    """The built-in loop says its data (:meth:`Worker.count_examples_by`): a worker that
    resumed after 104 batches says their examples (the chief counted them at the run's
    mean: 23 examples off), and its own are its data's, whatever a restore took back."""
    from zmqps.data import examples_in

    w = _counting_worker(steps_done=104)
    w.count_examples_by(lambda c: examples_in(719, 32, c))
    assert w.examples_resumed_after() == examples_in(719, 32, 104) == 4 * 719 + 12 * 32
    for p in range(104, 130):
        w.count_step(0.5, examples_in(719, 32, p + 1) - examples_in(719, 32, p))
    w.session.rewind = 100  # back past where it resumed
    w.take_rewind()
    assert w.held_examples == 0  # never less
    for p in range(100, 460):
        w.count_step(0.5, examples_in(719, 32, p + 1) - examples_in(719, 32, p))
    assert w.examples_resumed_after() + w.held_examples == 20 * 719


def test_a_worker_whose_earlier_runs_did_all_its_batches_does_not_claim_figures() -> None:
    """A worker rejoining after its earlier incarnation finished its data said "done
    after 0 steps (global step 0, loss nan)" though the global step was at least 69: it
    did no step, saw no global step and computed no loss. It says what happened; one
    that did steps gives its figures."""
    from zmqps.roles.worker.train import done_line

    w = _counting_worker(steps_done=69)
    w._client = None
    w.steps.token = None
    w.nonfinite = 0
    line = done_line(w, float("nan"), 0.0)
    assert line == (
        "worker 0: done, no step of its own: its earlier runs pushed all 69 batches of its data"
    )
    for _ in range(3):
        w.count_step(0.5, 32)
    w.steps.token = 71  # sync: the step of its token, as last seen
    assert done_line(w, 0.5, 0.25) == (
        "worker 0: done after 3 steps (global step 71, loss 0.5000, overlap 0.25)"
    )
    assert done_line(_counting_worker(), float("nan")).endswith("its data has no batch to train")
