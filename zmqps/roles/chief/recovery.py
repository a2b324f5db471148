"""The chief's recovery controller: one owner for everything that keeps training alive
through faults.

Rules of this module:

* :class:`RecoveryController` owns the cluster's phase (the state machine of
  :mod:`zmqps.core.recovery`), each PS's health, the generation, restores, the
  adoption of running PS by a restarted chief, and the admission of workers
  (fencing their old incarnations, the batch they resume after, re-admission of a
  worker that comes back). Op handlers and variable placement live elsewhere and
  ask it.
* Training runs only in the phases that allow it: entering RUNNING starts the
  consistency mode's loop and the checkpoint schedule (:meth:`_start_training`),
  leaving it stops them.
* A PS silent for the heartbeat timeout is *down*: training waits for it (its
  shards exist nowhere else) and status says so. A PS that answers with another
  boot id or generation lost its shards: every shard of every PS is restored to
  the latest committed checkpoint, into a new generation, all at one step.
* A worker's every registration fences its older incarnations on every PS before
  it gets an answer, and reads there how far its pushes got: a new incarnation
  resumes after the batches that really reached the PS.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zmqps.checkpoint import Checkpoint
from zmqps.core.finished import Finished, Held, lost_verdict, work_lost
from zmqps.core.membership import Membership
from zmqps.core.recovery import (
    Event,
    Lifecycle,
    Phase,
    Progress,
    PsHealth,
    decide_start,
    resume_point,
)
from zmqps.core.replication import fail_over
from zmqps.core.variables import Placement, ShardInfo
from zmqps.logs import RateLimitedLog
from zmqps.metrics import Metrics
from zmqps.roles.checkpointer import Checkpointer
from zmqps.roles.chief.done_record import DoneRecord, GenerationMark, record_path
from zmqps.roles.chief.modes import ChiefMode
from zmqps.roles.chief.moves import Mover
from zmqps.roles.chief.rereplication import Rereplicator
from zmqps.roles.chief.variables import TERM, Variables
from zmqps.roles.client import tell_left
from zmqps.roles.configs import ChiefConfig
from zmqps.roles.homes import Homes
from zmqps.transport import Requester
from zmqps.wire import ops as o
from zmqps.wire.errors import (
    ConfigError,
    DeadlineExceeded,
    NotFound,
    NotPrimary,
    NotReady,
    RunFailed,
    ZmqpsError,
)
from zmqps.wire.schema import INT64_MAX

if TYPE_CHECKING:
    from zmqps.roles.chief.checkpoints import ChiefCheckpoints

__all__ = ["RecoveryController", "RunFinished", "WorkLost"]

log = logging.getLogger("zmqps.chief")

#: fail-overs whose details the chief keeps for its status (the count goes on)
KEEP_FAILOVERS = 8
#: a restore that fails (a PS stopped or lost again while it ran) is made again, from
#: every PS's state, this many times in all; then the chief ends with the error and,
#: restarted, decides its start from what the PS hold
RESTORE_ATTEMPTS = 3
#: a worker's placement epoch this far past the chief's is none a chief of the run
#: published (each placement change tells a process; those lost with the last chief
#: are a few): it is ignored
EPOCH_GAP = 1 << 16
#: the least time (seconds) a worker that finished, and part of whose work the cluster
#: lost, is awaited from this chief's start (:meth:`RecoveryController.awaited_for`)
AWAIT_S = 10.0


class RunFinished(Exception):
    """At start: the checkpoint directory holds the run's final checkpoint and the PS
    do not answer (they were shut down at the end of the run): nothing is left to do."""

    def __init__(
        self, ckpt: Checkpoint, summary: dict[str, Any], why: str, ps_up: bool = False
    ) -> None:
        super().__init__(f"the run already finished ({ckpt.name}, step {ckpt.step}): {why}")
        self.ckpt = ckpt
        #: the summary the run wrote when it ended
        self.summary = summary
        #: PS answered (started again after the end, holding nothing): shut down too
        self.ps_up = ps_up


class WorkLost(RunFailed):
    """At start: workers finished their work and left, and the state the cluster would
    start from (a checkpoint, or the initial values: the PS lost theirs, no copy of it
    was kept) does not hold all of it. Their batches cannot be trained again: the run
    ends failed (exit code 3), saying so (:func:`zmqps.core.finished.lost_verdict`)."""

    def __init__(self, verdict: str, checkpoint: str | None, ps_up: bool = True) -> None:
        super().__init__(verdict)
        #: the checkpoint the verdict is against (None: none was committed); the summary
        #: records it, so that a chief started again after this end fails the same way
        self.checkpoint = checkpoint
        #: PS answered: they are shut down
        self.ps_up = ps_up


def _held(ckpt: Checkpoint | None) -> Held:
    """What a cluster that goes back to ``ckpt`` (None: the initial values) holds."""
    if ckpt is None:
        return Held()
    return Held(ckpt.name, ckpt.step, ckpt.cursors, ckpt.final, ckpt.generation)


def _resumed(ckpt: Checkpoint | None) -> dict[str, int] | None:
    """The batches per worker a new cluster on ``ckpt`` resumes after: those it holds,
    when it is the checkpoint of a run stopped before its end. None for a finished run's
    final checkpoint (a new run on it trains its epochs again) or one that does not say."""
    if ckpt is None or ckpt.final or not ckpt.cursors:
        return None
    return dict(ckpt.cursors)


def _async_steps(ckpt: Checkpoint, own_end: bool = False) -> tuple[int, int]:
    """Async / SSP: ``(step offset, global step)`` of a new cluster on ``ckpt``. The
    checkpoint of a run stopped before its end holds each worker's pushes up to its
    cursor: the global step is the steps of the runs before that one (its step offset)
    plus those pushes, which the workers count again as the batches they resume after.
    Its label is the step the chief had heard from heartbeats, which lags the pushes its
    values hold after a stop that was not clean (a kill -9: 235 for 326), so the global
    step is not taken from it. A finished run's final checkpoint (a new run trains
    more epochs on it): its step, on top of which the new workers count. ``own_end``:
    the final checkpoint is of this very run, its workers done (a chief killed after it
    and before the run's summary): the run's own offset, the workers that finished
    count their pushes on top of it again (the global step was twice the run's)."""
    resumed = _resumed(ckpt)
    if own_end and ckpt.final:
        try:
            before = int(ckpt.manifest.extra["step_offset"])
        except (KeyError, TypeError, ValueError):
            before = ckpt.step - sum((ckpt.cursors or {}).values())
        return max(0, min(before, ckpt.step)), ckpt.step
    if resumed is None:
        return ckpt.step, ckpt.step
    held = sum(resumed.values())
    extra = ckpt.manifest.extra
    try:
        before = int(extra["step_offset"])
    except (KeyError, TypeError, ValueError):
        # an older writer: the offset it counted on top of the workers it had heard
        try:
            heard = sum(int(v) for v in dict(extra["workers"]).values())
        except (KeyError, TypeError, ValueError):
            heard = held  # nor that: the offset as its step says it
        before = ckpt.step - heard
    before = max(0, before)
    return before, before + held


class RecoveryController:
    def __init__(
        self,
        cfg: ChiefConfig,
        ps: Sequence[Requester],
        members: Membership,
        mode: ChiefMode,
        variables: Variables,
        checkpointer: Checkpointer | None,
        checkpoints: ChiefCheckpoints | None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        homes: Homes | None = None,
    ) -> None:
        self.cfg = cfg
        self.ps = list(ps)
        #: the process serving each PS state (replication: a fail-over moves states)
        self.homes = homes
        #: each replicated PS state's term (one more at each promotion)
        self.terms: dict[int, int] = {}
        #: the last fail-overs: {"dead", "promoted", "epoch", "seconds"} (KEEP_FAILOVERS)
        self.failovers: deque[dict[str, Any]] = deque(maxlen=KEEP_FAILOVERS)
        #: fail-overs so far
        self.failover_count = 0
        self.promotions = 0
        #: held by whatever changes the copies of the states (a fail-over, a copy
        #: joining): one at a time
        self.placement_lock = asyncio.Lock()
        #: held by the one copy of a state under way, re-replication's or a move's,
        #: from its join until the placement names the copy (or its joiner is dropped):
        #: a second join of a state, given up, drops the first's joiner with it, and the
        #: state's primary then commits without it (fault schedule 716: a move promoted
        #: a copy a sync step behind, and sync waited on it for ever)
        self.copy_lock = asyncio.Lock()
        #: brings the states back to R copies (replication only)
        self.rereplicator = None if homes is None else Rereplicator(self, homes, clock=clock)
        #: moves PS states between processes (``zmqps scale``, a PS joining)
        self.mover = None if homes is None else Mover(self, homes, clock=clock)
        #: the state move under way (the re-replication leaves the copies alone)
        self.moving: dict[str, Any] | None = None
        self.members = members
        self.mode = mode
        self.variables = variables
        self.checkpointer = checkpointer
        self.checkpoints = checkpoints
        self.metrics = metrics
        self.clock = clock
        #: lines a client's requests cause: one per kind and task per 10 s
        self.notes = RateLimitedLog(log, 10.0, clock=clock)
        #: the placement epoch this chief last told a task (None: none yet)
        self.told_epoch: int | None = None
        self.lifecycle = Lifecycle()
        #: called at every change of phase (the service wakes the heartbeats it holds)
        self.on_phase: Callable[[], None] | None = None
        self.health = PsHealth(len(self.ps), cfg.heartbeat_timeout, clock())
        #: the chief is shutting the PS down at the run's end: none is failed over
        self.ps_shutting_down = False
        #: restores so far; data requests of another generation are refused by the PS
        self.gen = 0
        self.recoveries: list[dict[str, Any]] = []
        #: restores so far (``recoveries`` keeps the last 20)
        self.restore_count = 0
        #: of them, restores with no committed checkpoint (every shard to its initial
        #: values)
        self.restores_from_scratch = 0
        #: the last restore to a checkpoint's batch cursors, per worker name (None: no
        #: restore went back, or the checkpoint did not say): each live worker trains
        #: its batches after its cursor again (heartbeat replies say it)
        self.rewinds: dict[str, int] | None = None
        #: batches the restores sent back to be trained again, in all
        self.rewound = 0
        #: the generation a start with empty PS and no checkpoint made the cluster in,
        #: until a restore: a worker that ran under an earlier chief registering again
        #: then finds every value it held, and every push it has in flight, gone with
        #: the cluster it knew, in the same generation number (:meth:`admit`)
        self.made_anew: int | None = None
        self._renewing: asyncio.Future[None] | None = None
        #: a worker that ran under an earlier chief registered before training began
        #: (the variables not made, or made and not yet in use): training's start
        #: restores them past the lost cluster's generation (:meth:`variables_created`)
        self._lost_cluster_heard = False
        #: each PS's boot id as last heard at a start or a restore
        self.boots: dict[int, str] = {}
        #: per PS state, the boot id of the incarnation last found without
        #: --checkpoint-dir (said once each; as many entries as PS states at most)
        self._without_checkpoints: dict[int, str] = {}
        #: set once the start decision is made (adopt, restore or fresh)
        self.started = asyncio.Event()
        #: start() is under way: what a worker resumes after is not known yet
        self.starting = False
        #: processes that had left the run when this chief started (scaled down: the
        #: newest placement the processes heard names no copy on them), while no scale
        #: was asked of this chief: no restore puts a state there
        self.left_at_start: list[int] = []
        self.training_failed = asyncio.Event()
        self.training_error: BaseException | None = None
        self._training: asyncio.Task[None] | None = None
        path = record_path(cfg.checkpoint.directory if cfg.checkpoint else None, cfg.summary_path)
        #: the record of the workers that finished, where this chief keeps it (None: a
        #: chief with neither checkpoints nor a summary keeps none)
        self.done_record = None if path is None else DoneRecord(path)
        #: the highest generation a chief of this run restored to (beside the record):
        #: a restore goes past it
        self.gen_mark = None if path is None else GenerationMark(path)
        self.gen_floor = 0
        #: processes that did not answer the start's first look (``_moved_homes``)
        self.silent_at_start: set[int] = set()
        #: the workers that finished their work, as the record holds them
        self.finished: dict[int, Finished] = {}
        #: workers that finished under an earlier chief, part of whose work the state
        #: this chief started from lost: each is waited for (a member expected to speak
        #: within the heartbeat timeout) to train it again, and kept in the record until
        #: it registers; one that does not speak fails the run, saying what holds its
        #: work and how the rest was lost (:attr:`lost_in`)
        self.awaited: dict[int, Finished] = {}
        self.lost_in: tuple[Held, str] = (Held(), "")
        #: where training (re)started last: the step, the generation and the global
        #: step the status showed then (async and ssp never show a lower one: after a
        #: restore below it, the workers train again the steps up to it first). The
        #: status names it as what training waits on until the shown step moves.
        self.resumed: tuple[int, int, int] | None = None
        self._record_lock = asyncio.Lock()
        #: called with the one line a run fails with when a restore took back batches of
        #: workers that finished and left (they cannot train them again)
        self.on_work_lost: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ the phase

    @property
    def phase(self) -> Phase:
        return self.lifecycle.phase

    @property
    def recovering(self) -> bool:
        """Workers wait: their values may be rolled back."""
        return self.lifecycle.recovering

    @property
    def training(self) -> bool:
        """PS health is watched (fail-over, restore) while this is true: not once the
        chief shuts the PS down at the end (their going is no failure)."""
        return not self.ps_shutting_down and self.phase in (
            Phase.RUNNING,
            Phase.DEGRADED,
            Phase.FINISHING,
        )

    @property
    def ps_down(self) -> dict[int, float]:
        return self.health.down

    def handle(self, event: Event) -> Phase:
        before = self.phase
        after = self.lifecycle.handle(event)
        if after is not before:
            log.debug("cluster %s -> %s (%s)", before.value, after.value, event.value)
            if self.on_phase is not None:
                self.on_phase()
        return after

    # ------------------------------------------------------------------ training

    def _start_training(self, step: int) -> None:
        self.resumed = (step, self.gen, max(step, self.mode.global_step))
        holders = self.variables.holders()

        async def train() -> None:
            if self.checkpoints is not None and self.mode.name != "sync":
                await asyncio.gather(self.mode.start(holders, step), self.checkpoints.schedule())
            else:
                await self.mode.start(holders, step)
                await asyncio.Future()  # async: nothing more to drive; wait to be stopped

        self.stop_training()
        self._training = asyncio.ensure_future(train())
        self._training.add_done_callback(self._training_done)

    def _training_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self.training_error = task.exception()
        self.training_failed.set()

    def stop_training(self) -> None:
        if self._training is not None:
            self._training.cancel()
            self._training = None
        self.mode.stop()

    async def close(self) -> None:
        self.stop_training()
        if self.checkpointer is not None:
            await self.checkpointer.cancel()

    # ------------------------------------------------------------------ start

    async def ps_states(self, timeout: float, left: Collection[int] = ()) -> list[dict[str, Any]]:
        """``ps_state`` of every PS, waiting up to ``timeout`` s for each to answer.
        One of ``left`` (it left the run: a scale-down drained it) that does not answer
        within a few heartbeats reads as a process that holds no copy of any state."""
        deadline = self.clock() + timeout
        brief = self.clock() + min(timeout, max(5.0, 5 * self.cfg.heartbeat_interval))
        # one that left and was silent to the start's first look already: a second
        # and no more (each look of a few heartbeats made a restarted chief's pause
        # longer, fault schedule 730)
        briefer = min(brief, self.clock() + 1.0)

        async def one(i: int) -> dict[str, Any]:
            while True:
                ends = deadline
                if i in left:
                    ends = briefer if i in self.silent_at_start else brief
                wait = max(0.05, min(2.0, ends - self.clock()))
                try:
                    rep = await self.ps[i].request("ps_state", timeout=wait)
                    return dict(rep.body)
                except (NotPrimary, NotFound) as exc:
                    home = None if self.homes is None else self.homes.of[i]
                    if self.replicated() or home is None or home == i:
                        raise
                    # unreplicated: a state moved to another process, which restarted
                    # since (it holds no copy): lost there, as a restarted PS's own is
                    return await self._lost_copy(i, home, exc, wait)
                except DeadlineExceeded:
                    if i in left and self.clock() >= ends:
                        return {"boot": "", "gen": 0, "shards": [], "roles": [], "left": True}
                    if self.clock() >= deadline:
                        raise NotReady(
                            f"ps {i} ({self.ps[i].endpoint}) did not answer within {timeout:g}s"
                        ) from None
                    log.info("waiting for ps %d at %s", i, self.ps[i].endpoint)

        return list(await asyncio.gather(*(one(i) for i in range(len(self.ps)))))

    async def _lost_copy(
        self, state: int, home: int, exc: ZmqpsError, timeout: float
    ) -> dict[str, Any]:
        """``ps_state`` of PS state ``state``, moved to process ``home`` which holds no
        copy of it (restarted since): the process's own answer (its boot id and
        generation), with no shards and nothing of the state's progress."""
        assert self.homes is not None
        log.warning("ps %d's state is gone from ps %d (%s): a restore follows", state, home, exc)
        rep = await self.homes.processes[home].request("ps_state", timeout=timeout, slot=home)
        body = dict(rep.body)
        lost = ("placement", "cursors", "done", "rewinds", "highs", "contributors", "newest")
        for key in lost:
            body.pop(key, None)
        body.update(index=state, shards=[], step=0)
        return body

    async def start(self) -> None:
        """At start: adopt the state of PS that already hold shards (this chief was
        restarted), or restore every PS from the latest checkpoint, or start fresh."""
        self.starting = True
        try:
            await self._start()
        finally:
            self.starting = False
            self.silent_at_start = set()

    async def _start(self) -> None:
        latest = None
        if self.checkpointer is not None:
            await asyncio.to_thread(self.checkpointer.clean)
            latest = await asyncio.to_thread(self.checkpointer.latest)
        summary = None if latest is None else self._ended(latest)
        probe = min(self.cfg.startup_timeout, max(5.0, 5 * self.cfg.heartbeat_interval))
        # This run ended (its final checkpoint, and the summary of that step): a chief
        # restarted after the end (killed while it shut the cluster down) finds the PS
        # gone. When none answers within a few heartbeats, it does not wait the whole
        # start-up timeout: the run is over.
        if latest is not None and summary is not None and not await self._any_ps_answers(probe):
            raise RunFinished(latest, summary, f"no PS answered within {probe:g}s")
        if self.done_record is not None:
            # the workers that finished under an earlier chief of this run: the PS may
            # have lost what said it (restarted without a copy of their state)
            self.finished = await asyncio.to_thread(self.done_record.load)
        failed = self._failed_before(latest)
        if failed is not None and not await self._any_ps_answers(probe):
            # An earlier chief of this run ended it failed, finished work lost, and shut
            # the PS down; the record still says that work is not held. A chief started
            # again (by a supervisor that restarts whatever exits non-zero) fails the
            # same way at once, not after its whole start-up timeout.
            self._name_record()
            raise WorkLost(failed, None if latest is None else latest.name, ps_up=False)
        if self.gen_mark is not None:
            self.gen_floor = await asyncio.to_thread(self.gen_mark.load)
        elastic, named = await self._moved_homes()
        # replicated: each process's own account of its copies (a process the newest
        # placement names no copy on left the run, and is not waited for)
        left = [] if named is None else [q for q in range(len(self.ps)) if q not in named]
        outside = [] if named is not None else self._outside(latest)
        states = first = await self.ps_states(self.cfg.startup_timeout, [*left, *outside])
        self._check_ps_checkpoints(states)
        # (those outside the latest checkpoint's run that answer are part of it again)
        self.left_at_start = left = [*left, *(q for q in outside if states[q].get("left"))]
        moved, orphans, gone = self._copies_of(states) if self.replicated() else (elastic, [], [])
        if moved is not None:  # each state from its primary, wherever it is now
            assert self.homes is not None
            self.homes.update(moved)
            if gone:
                moved = await self.adopt_gone(moved, orphans, gone)
                if self.phase is not Phase.STARTING:
                    # a state's last copy was lost meanwhile (a backup died during the
                    # fail-over): it restored every PS and training restarted there.
                    # Deciding the start again would take the restored PS for a
                    # running cluster to adopt.
                    self._learn_progress(states)
                    self.started.set()
                    return
            states = await self.ps_states(self.cfg.startup_timeout, left)
        self._learn_progress(states)
        plan = decide_start(states, sync=self.mode.name == "sync")
        if latest is not None and summary is not None and plan.kind == "fresh":
            # the run ended, and the PS that answer hold nothing of it: started again
            # after its end (a supervisor restarting processes that exited 0, fault
            # schedule 814). Restored, the run would wait for workers that finished.
            raise RunFinished(
                latest, summary, "the PS that answer were started after it ended", ps_up=True
            )
        if plan.kind != "adopt":
            # the cluster goes back to the latest checkpoint, or to the initial values:
            # the work of a worker that finished must be in it, or the worker still
            # running (it waits for the run's end) must train it again
            self._check_finished_work(states, latest, plan.kind, plan.reason)
            if self.awaited:
                # in the record before any PS is restored: a chief killed after the
                # restore, before the workers spoke, would find the PS restored and the
                # workers done in the record, and end the run without their batches
                await self.note_done()
        self.gen = plan.gen
        self.boots = boots = {i: str(st["boot"]) for i, st in enumerate(states)}
        try:
            if plan.kind == "adopt":
                assert plan.placement is not None
                self.members.adopted = True
                if latest is not None and latest.manifest.generation == self.gen:
                    # a checkpoint of this run (a run resumed from an older one is in a
                    # later generation): the run's figures so far, as it recorded them
                    self.members.carry(latest.manifest.extra)
                self.variables.use(moved or Placement.from_wire(plan.placement))
                if self.mode.name == "sync":
                    self.mode.global_step = plan.step
                self.rewinds = _rewinds(states, self.gen)
                if self.rewinds is None and not any(_knows_workers(st) for st in states):
                    # values no worker pushed to or was sent back on: a fresh cluster,
                    # or one made anew by a chief lost before any worker registered (its
                    # generation may be the one of a cluster lost before it, whose
                    # workers would take these values for theirs): as made anew here
                    self.made_anew = self.gen
                again = self._await_recorded(latest)
                self.health.expect(boots, self.gen, self.clock())
                self.handle(Event.ADOPTED)
                log.info(
                    "adopted the running PS: %d variables, generation %d%s",
                    len(self.variables.placement.variables),  # type: ignore[union-attr]
                    self.gen,
                    f", global step {plan.step}" if self.mode.name == "sync" else "",
                )
                self._start_training(self.mode.global_step)
                if again:
                    # awaited workers, and no restore of this generation says where
                    # they go back to (the chief before was lost before it restored
                    # the values it made anew): restored now, in a new generation
                    self._renewing = asyncio.ensure_future(
                        self._renew("workers that finished are awaited to train again")
                    )
                return
            if plan.placement is not None:
                log.warning("%s: restoring every shard", plan.reason)
                self.variables.use(moved or Placement.from_wire(plan.placement))
                if self.replicated():
                    # every copy down first, each state back on its own process, at a
                    # term past any a copy holds: the restore reaches the one that serves;
                    # the placement at an epoch past any a process was told, or workers
                    # that heard it would keep the old routes
                    self._terms_past(first)
                    self._epoch_past(max(int(st.get("epoch") or 0) for st in first))
                    await self._unreplicate(self.variables.placement)  # type: ignore[arg-type]
                    states = await self.ps_states(self.cfg.startup_timeout, left)
                elif moved is not None or left:
                    # states moved between processes (unreplicated), or processes left
                    # the run: each state's process holds a copy again (made empty there
                    # if it restarted; one that left gives its states to one that
                    # stays) first
                    await self._unreplicate(moved or self.variables.placement)  # type: ignore[arg-type]
                    states = await self.ps_states(self.cfg.startup_timeout, left)
                await self._restore(Event.RESTORE, "chief restart with PS in disagreement", states)
                return
            ckpt = latest  # verified above, off the event loop (it hashes every file)
            if ckpt is None:
                self.handle(Event.FRESH)
                self.made_anew = self.gen
                return
            variables = tuple(ckpt.variable_defs())
            placement = self.variables.plan(variables, dict(ckpt.manifest.optimizer))
            self.variables.use(placement)
            if (moved is not None and not self.replicated()) or self.left_at_start:
                # states moved between processes, every copy lost: each state's process
                # holds a copy again (made empty there if it restarted) before the
                # restore (sent by the moved homes, it found no copy there); the states
                # of processes that left go to processes that stay
                await self._unreplicate(placement)
                states = await self.ps_states(self.cfg.startup_timeout, left)
            # the final checkpoint of this very run, taken once every worker finished,
            # the chief lost before the run's end (its summary): the record of the
            # workers that finished is still there (a run that ended in order, or a
            # launch --resume, removes it), and the run ends now on what it holds,
            # not as a new run on a finished one's checkpoint
            own_end = ckpt.final and bool(self._finished_here())
            if self.mode.name != "sync":
                # the steps the checkpoint holds; those of the batches its workers resume
                # after are counted again by the workers themselves
                self.mode.step_offset, held = _async_steps(ckpt, own_end)
                # the checkpoint's step from the restore on, not the offset alone until
                # the workers report the batches they resume after (it read 0 there,
                # after the lost chief had said more)
                self.mode.global_step = held
            self.gen = max(self.gen, ckpt.manifest.generation)
            # never silent: a run that goes on from a checkpoint says so, and from which
            log.warning(
                "resuming from %s (global step %d%s) in %s",
                ckpt.name,
                ckpt.step,
                ", the final checkpoint of this run: its workers had finished"
                if own_end
                else ", the final checkpoint of a finished run"
                if ckpt.final
                else "",
                ckpt.path.parent,
            )
            await self._restore(Event.RESTORE, "start", states, ckpt=ckpt)
        finally:
            self.started.set()

    async def publish_past(self, epoch: int) -> None:
        """A worker registering again heard of placement epoch ``epoch`` (from the
        last chief): the placement is published past it, or the worker would take it
        for one it has (an equal epoch too) and keep its old routes. This chief's
        epoch comes from what the PS were told, and a process told the last one may
        have restarted with the last chief. Under the placement lock: a fail-over
        under way publishes past it in turn."""
        async with self.placement_lock:
            placement = self.variables.placement
            if placement is not None and epoch > placement.epoch + EPOCH_GAP:
                # no chief of this run got that far past what the PS were told: a
                # hostile or broken client's, which would use up the epochs
                self.notes.warning(
                    "a worker says placement epoch %d: not one of this run", epoch, key="epoch"
                )
                return
            if placement is not None and epoch == placement.epoch == self.told_epoch:
                return  # it heard this chief's own placement: its routes are current
            if self._epoch_past(epoch):
                self.notes.log(
                    logging.INFO,
                    "a worker heard of placement epoch %d: published past it",
                    epoch,
                    key="epoch_past",
                )

    def told(self, epoch: int | None) -> None:
        """This chief told a task the placement of ``epoch`` (a registration's reply, a
        heartbeat's): a task that says it heard that epoch has this placement."""
        if epoch is not None:
            self.told_epoch = epoch

    def _epoch_past(self, epoch: int) -> bool:
        """The placement published at an epoch past ``epoch`` unless it is already;
        True when it moved on."""
        placement = self.variables.placement
        if placement is None or epoch < placement.epoch or epoch >= INT64_MAX - 1:
            return False
        newer = replace(placement, epoch=epoch + 1)
        self.variables.use(newer)
        if self.homes is not None:
            self.homes.update(newer)
        return True

    def _terms_past(self, states: Sequence[dict[str, Any]]) -> None:
        """Each state's term, at least the highest any process holds a copy at."""
        for st in states:
            for slot, _, term, *_ in st.get("roles") or ():
                self.terms[int(slot)] = max(self.terms.get(int(slot), TERM), int(term))

    def _copies_of(
        self, states: Sequence[dict[str, Any]]
    ) -> tuple[Placement | None, list[int], list[int]]:
        """Replicated, at start (a restarted chief): ``(placement, orphans, gone)``, the
        placement as the copies say it is. Each state's primary is its unfenced
        primary copy of the highest term, its backups that primary's in-sync ones.
        *Gone*: processes a primary counts as in-sync backups that hold no such copy
        (restarted with the last chief, their copies lost): the placement still names
        them, so that failing them over tells their primaries to stop waiting for
        them. *Orphans*: states whose primary is gone (killed around the last chief's
        end, before or during its fail-over) but whose backups live: the placement
        names their backups of the highest term and, as their primary, a process that
        holds no copy of them (one that holds none at all, the restarted one, when
        there is one), also gone: its fail-over promotes the furthest backup. The
        epoch is past any a process was told. ``(None, [], [])`` when no process
        reports copies (a fresh cluster) or a state has no copy left (decided as
        without them: a restore)."""
        roles = {i: st["roles"] for i, st in enumerate(states) if st.get("roles")}
        base = next((st["placement"] for st in states if st.get("placement") is not None), None)
        if not roles or base is None:
            return None, [], []
        placement = Placement.from_wire(base)
        # the newest placement any process heard the last chief publish: a backup it
        # dropped (silent or restarted) is not named there
        published = [st["newest"] for st in states if st.get("newest") is not None]
        newest = (
            Placement.from_wire(max(published, key=lambda p: int(p.get("epoch") or 0)))
            if published
            else None
        )
        homes: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # state -> (term, ps, backups)
        orphans: list[int] = []
        gone: set[int] = set()
        for state in sorted({s.state for s in placement.shards}):
            # its copies: (process, role, term, fenced, in-sync backups, entry applied)
            copies = [
                (i, kind, int(term), fenced, [int(q) for q in in_sync], int(head))
                for i, held in roles.items()
                for slot, kind, term, head, fenced, in_sync in held
                if slot == state
            ]
            primaries = [c for c in copies if c[1] == "primary" and not c[3]]
            if primaries:
                primary, _, term, _, in_sync, _ = max(primaries, key=lambda c: c[2])
                gone |= set(in_sync) - _backups_at(copies, term)
                homes[state] = (term, primary, tuple(in_sync))
                continue
            if newest is not None:
                # a backup the newest placement does not name was dropped and missed
                # what its primary acknowledged since: not a copy to promote
                named = {q for s in newest.shards if s.state == state for q in s.copies}
                copies = [c for c in copies if c[0] in named]
            terms = [t for _, kind, t, *_ in copies if kind == "backup"]
            if not terms:
                return None, [], []
            old = next(s.ps for s in placement.shards if s.state == state)
            spare = sorted(
                (q for q in range(len(states)) if q not in {c[0] for c in copies}),
                key=lambda q: (q in roles, q != old, q),  # empty first, then the old one
            )
            if not spare:
                # every process holds a copy and none is its primary (the last chief
                # killed in a hand-over, after the source stepped down and before the
                # target was promoted: fault schedule 821). The furthest copy of the
                # highest term is named the primary, the others of that term its
                # backups, and the re-replication's first watch promotes it there
                # (``Rereplicator._promote_again``). Before, the start fell back on the
                # placement of the PS's first report, and its homes were wrong for
                # states failed over or moved since.
                top = max(terms)
                at_top = [c for c in copies if c[1] == "backup" and c[2] == top]
                chosen = max(at_top, key=lambda c: (c[5], -c[0]))[0]
                backups = tuple(sorted(c[0] for c in at_top if c[0] != chosen))
                homes[state] = (top, chosen, backups)
                continue
            gone.add(spare[0])
            homes[state] = (max(terms), spare[0], tuple(sorted(_backups_at(copies, max(terms)))))
            orphans.append(state)
        for state, (term, _, _) in homes.items():
            self.terms[state] = term
        shards = tuple(
            replace(
                s,
                ps=homes[s.state][1],
                backups=homes[s.state][2],
                slot=s.state if homes[s.state][1] != s.state else None,
            )
            for s in placement.shards
        )
        # past any a process was told (within the wire's range, whatever was sent to it)
        epoch = min(max(int(st.get("epoch") or 0) for st in states) + 1, INT64_MAX)
        moved = replace(placement, shards=shards, epoch=epoch)
        log.info(
            "the copies of the PS states: %s (placement epoch %d)",
            ", ".join(
                f"ps {st} on ps {p}"
                + (" (no primary left)" if st in orphans else "")
                + (f" (backups {list(b)})" if b else "")
                for st, (_, p, b) in sorted(homes.items())
            ),
            epoch,
        )
        return moved, orphans, sorted(gone)

    async def adopt_gone(
        self, placement: Placement, orphans: Sequence[int], gone: Sequence[int]
    ) -> Placement:
        """At start: the copies on ``gone`` processes are lost (see :meth:`_copies_of`):
        they are failed over as under a running chief, the states of ``orphans``
        promoting their furthest backup."""
        log.warning(
            "copies lost with the last chief's end (ps process %s restarted%s):"
            " failing over to the others",
            ", ".join(map(str, gone)),
            f"; no primary left for ps {', '.join(map(str, orphans))}'s state" if orphans else "",
        )
        self.variables.use(placement)
        await self.fail_over(orphans, gone)
        assert self.variables.placement is not None
        return self.variables.placement

    def _check_ps_checkpoints(self, states: Sequence[dict[str, Any]]) -> None:
        """A chief that takes checkpoints, with a PS that cannot write them (started
        without ``--checkpoint-dir``): refused at the start (exit code 2), not found
        by the first checkpoint, the final one maybe, after all the training."""
        policy = self.cfg.checkpoint
        if self.checkpointer is None or policy is None:
            return
        without = [i for i, st in enumerate(states) if st.get("checkpoints") is False]
        if without:
            raise ConfigError(
                f"ps {', '.join(map(str, without))} {'runs' if len(without) == 1 else 'run'}"
                " without --checkpoint-dir, and this chief takes checkpoints"
                f" (--checkpoint-dir {policy.directory}): give every PS"
                " --checkpoint-dir (a folder all of them and the chief see), or the chief"
                " none"
            )

    def _check_restarted_checkpoints(self, i: int, st: o.PsStateReply) -> None:
        """PS state ``i``'s process, started again mid-run without ``--checkpoint-dir``
        while this chief takes checkpoints (by hand, the flag forgotten): said at once,
        once per incarnation. The run goes on (its restore or fail-over needs no
        checkpoint folder there), but each checkpoint fails until that PS is started
        again with it, and the final one fails the run."""
        policy = self.cfg.checkpoint
        if self.checkpointer is None or policy is None or st.checkpoints is not False:
            return
        if self._without_checkpoints.get(i) == st.boot:
            return
        self._without_checkpoints[i] = st.boot
        home = self.homes.of[i] if self.homes is not None else i
        log.error(
            "ps %d (%s) was started again without --checkpoint-dir, and this chief takes"
            " checkpoints (--checkpoint-dir %s): every checkpoint fails, the final one"
            " too, until it is started again with it",
            home,
            self.ps[i].endpoint,
            policy.directory,
        )

    def _ended(self, ckpt: Checkpoint) -> dict[str, Any] | None:
        """The run's summary (the chief's ``summary_path``) when ``ckpt`` is this run's
        final checkpoint and the summary was written for it: the run ended before this
        chief started. None otherwise (a new run started on an old run's checkpoints
        writes another summary)."""
        summary = self._summary() if ckpt.final else None
        step = ckpt.manifest.extra.get("global_step", ckpt.step)
        if summary is not None and summary.get("global_step") == step:
            return summary
        return None

    def _failed_before(self, latest: Checkpoint | None) -> str | None:
        """At start: the verdict of an earlier chief of this run that found the work of
        finished workers lost against ``latest`` (the summary says so), when the
        record of those workers still says that work is not in ``latest``. None
        otherwise (e.g. the record was removed for a new run)."""
        summary = self._summary() if self.finished else None
        if summary is None or not summary.get("work_lost") or not summary.get("failed"):
            return None
        if summary.get("checkpoint") != (None if latest is None else latest.name):
            return None
        if not work_lost(self._finished_here(), _held(latest)):
            return None
        return str(summary["failed"])

    def _summary(self) -> dict[str, Any] | None:
        """The summary the chief's ``summary_path`` holds (None: none, or unreadable)."""
        if not self.cfg.summary_path:
            return None
        try:
            summary = json.loads(Path(self.cfg.summary_path).read_text())
        except (OSError, ValueError):
            return None
        return summary if isinstance(summary, dict) else None

    async def _moved_homes(self) -> tuple[Placement | None, set[int] | None]:
        """At start: the newest placement any process heard the last chief publish, and
        the processes it names a copy on (None, None: no process heard one).
        Unreplicated, the placement of states moved between processes (``zmqps
        scale``): the homes follow it, so that the processes a scale-down drained are
        not waited for (replicated, the copies' roles say where the states are, and
        this placement only which processes are still part of the run). The processes
        are given a few heartbeats to answer: those that serve states wait for each
        other at start anyway."""
        if self.homes is None:
            return None, None
        within = min(self.cfg.startup_timeout, max(5.0, 5 * self.cfg.heartbeat_interval))

        async def one(c: Requester) -> dict[str, Any] | None:
            try:
                rep = await c.request("ps_state", timeout=within)
                return dict(rep.body)
            except ZmqpsError:
                return None

        answers = await asyncio.gather(*map(one, self.homes.processes))
        self.silent_at_start = {q for q, st in enumerate(answers) if st is None}
        heard = [st for st in answers if st]
        published = [st["newest"] for st in heard if st.get("newest") is not None]
        if not published:
            return None, None
        newest = Placement.from_wire(max(published, key=lambda p: int(p.get("epoch") or 0)))
        named = {q for s in newest.shards for q in s.copies}
        if self.replicated():
            return None, named
        self._terms_past(heard)
        # past any epoch a process was told (a worker may have heard the last one)
        told = max([newest.epoch, *(int(st.get("epoch") or 0) for st in heard)])
        placement = replace(newest, epoch=min(told + 1, INT64_MAX))
        placement, halted = _moves_the_copies_say(placement, answers)
        named = {q for s in placement.shards for q in s.copies}
        self.homes.update(placement)
        for state, q, term in halted:
            # a move the last chief began and did not finish: given up (the target's
            # copy would otherwise count in every commit of the state, and the target,
            # serving nothing by the placement, is drained: the state's steps stood)
            body = o.ReplicaSet(state, term, True, (), epoch=placement.epoch)
            try:
                await self.homes.processes[q].request("replica", body.to_wire(), timeout=within)
            except ZmqpsError as exc:
                log.warning("ps %d: the move of ps %d's state not given up: %s", q, state, exc)
                continue
            log.warning(
                "the move of ps %d's state the last chief began is given up: ps %d serves it"
                " with no other copy",
                state,
                q,
            )
        if self.mover is not None:
            self.mover.adopt({q: str(st["boot"]) for q, st in enumerate(answers) if st})
        log.info(
            "the PS states were moved: %s (placement epoch %d)",
            ", ".join(f"ps {st} on ps {p}" for st, p in enumerate(self.homes.of)),
            placement.epoch,
        )
        return placement, named

    def _outside(self, latest: Checkpoint | None) -> list[int]:
        """No running process heard where the states are (every one that did restarted,
        or none was told): the processes the latest checkpoint says did not serve the
        run (drained by a scale-down, exited). The start waits for them a few
        heartbeats, not its whole timeout: before, it waited for them, failed, and a
        launcher started it again, for ever. A final checkpoint (a run resumed) and
        one of another PS count (another cluster) say nothing of this one."""
        if latest is None or latest.final or latest.manifest.num_ps != len(self.ps):
            return []
        serving = latest.manifest.extra.get("serving")
        if not isinstance(serving, list) or not serving:
            return []
        return [q for q in range(len(self.ps)) if q not in serving]

    async def _any_ps_answers(self, within: float) -> bool:
        async def one(c: Requester) -> bool:
            try:
                await c.request("ps_state", timeout=within)
                return True
            except ZmqpsError:
                return False

        return any(await asyncio.gather(*(one(c) for c in self.ps)))

    def _finished_here(self, finished: dict[int, Finished] | None = None) -> dict[int, Finished]:
        """The workers of this cluster among those that finished (default: the record's)."""
        of = self.finished if finished is None else finished
        return {i: f for i, f in of.items() if i < self.members.num_workers}

    def _name_record(self) -> None:
        """Say where the record of the workers that finished is (a run that cannot
        finish for their lost work; a new run in the same directory must remove it)."""
        if self.done_record is not None and self.finished:
            log.warning(
                "the workers that finished under an earlier chief of this run are in %s"
                " (a new run in this directory starts without it: remove it)",
                self.done_record.path,
            )

    def _check_finished_work(
        self,
        states: Sequence[dict[str, Any]],
        latest: Checkpoint | None,
        kind: str,
        reason: str,
    ) -> None:
        """At start, before a restore or a fresh start: the workers that finished (the
        record says, or a PS) and did batches that ``latest`` (None: the initial values)
        does not hold. Each may still be running, waiting for the run's end: it is
        awaited (:attr:`awaited`), a member expected to speak within the heartbeat
        timeout, which registers again and trains those batches again (the restore's
        cursors say where it goes back to). :class:`WorkLost` at once when the
        checkpoint does not say where each worker goes back to (an older writer's, or
        a finished run's)."""
        finished = dict(self.finished)
        for index, done in _done_on_ps(states).items():
            was = finished.get(index)
            if was is None or was.steps < done.steps:
                finished[index] = done
        held = _held(latest)
        lost = work_lost(self._finished_here(finished), held)
        if not lost:
            return
        how = (
            "every PS started again without the state that held it (no copy of it was kept)"
            if kind == "fresh"
            else f"the PS lost part of the state that held it ({reason})"
        )
        if held.name is not None and (held.final or held.cursors is None):
            self._name_record()
            raise WorkLost(lost_verdict(lost, held, how), held.name)
        self._await(lost, finished, held, how)

    def _await_recorded(self, latest: Checkpoint | None) -> bool:
        """At start, adopting the PS: the workers that finished, part of whose work the
        PS's generation does not hold, are awaited (:meth:`_await`). The record says so
        of those a chief before this one awaited (``held``); a restore of this
        generation that went back below what a worker finished with before it (the PS
        keep its cursors, ``ps_state.rewinds``) says so of the others (a chief lost
        after that restore, before it wrote the record). True when no restore of this
        generation says where they go back to: the caller restores (:meth:`_renew`)."""
        finished = self._finished_here()
        lost: dict[int, tuple[int, int]] = {}
        for i, f in finished.items():
            back = None if self.rewinds is None else self.rewinds.get(f"worker:{i}", 0)
            if back is not None and f.gen < self.gen and back < f.steps:
                lost[i] = (back, f.steps)
            elif f.held is not None:
                lost[i] = (f.held if back is None else back, f.steps)
        if not lost:
            return False
        self._await(lost, finished, _held(latest), "the PS state that held it was lost since")
        return self.rewinds is None

    def _await(
        self,
        lost: Mapping[int, tuple[int, int]],
        finished: Mapping[int, Finished],
        held: Held,
        how: str,
    ) -> None:
        """Await the workers ``lost`` (index -> (batches held, batches done)) of those
        ``finished``, ``held`` what the cluster goes back to, ``how`` the rest was lost
        (the run's line if one does not speak, :meth:`_awaited_gone`)."""
        self.lost_in = (held, how)
        now = self.clock()
        for index, (have, did) in sorted(lost.items()):
            self.awaited[index] = replace(finished[index], held=have)
            self.members.await_back(index, now)
            log.warning(
                "worker %d finished its work (%d batches), and the cluster holds %d of"
                " them since: it trains the other %d again if it is still running"
                " (waiting for the run's end); it must speak within %gs, or the run fails",
                index,
                did,
                have,
                did - have,
                self.awaited_for(),
            )

    async def note_done(self) -> None:
        """The record holds the workers done now (each with the batches it did and the
        generation it finished in): written before a leave is answered, after a start
        and a restore. A record that cannot be written is said in the log."""
        async with self._record_lock:
            now: dict[int, Finished] = {}
            for index, w in sorted(self.members.workers.items()):
                if w.done:
                    was = self.finished.get(index)
                    # (one awaited, ``held``, that finished again: in this generation)
                    if was is None or was.steps != w.total_steps or was.held is not None:
                        seconds = round(self.members.train_seconds(self.clock()), 3)
                        was = Finished(w.total_steps, self.gen, w.total_examples, seconds)
                    elif was.examples != w.total_examples:
                        was = replace(was, examples=w.total_examples)
                    now[index] = was
            for index, was in self.awaited.items():
                # it finished, and has not registered again to train what was lost: a
                # chief started after this one awaits it too (``held``)
                now[index] = was
            self.finished = now
            if self.done_record is None:
                return
            try:
                await asyncio.to_thread(self.done_record.save, now)
            except OSError as exc:
                self.notes.warning(
                    "cannot write %s (the workers that finished): %s",
                    self.done_record.path,
                    exc,
                    key="done_record",
                )

    async def forget_done(self) -> None:
        """The run ended in order (its summary written): the record goes."""
        if self.done_record is None:
            return
        async with self._record_lock:
            try:
                await asyncio.to_thread(self.done_record.remove)
            except OSError as exc:
                log.warning("cannot remove %s: %s", self.done_record.path, exc)

    def _learn_progress(self, states: Sequence[dict[str, Any]]) -> None:
        """What the PS know of the workers when this chief starts (it may have been
        restarted): which finished their work (the chief waits for no one that left),
        and, async / ssp, the batches pushed so far (the global step never goes back)."""
        done = {i: f.steps for i, f in _done_on_ps(states).items()}
        for index, f in self.finished.items():  # the record: what no PS says any more
            done.setdefault(index, f.steps)
        # the run's training seconds when the last of them finished (a chief started
        # after they all did trained nothing itself)
        said = [f.seconds for f in self.finished.values() if f.seconds is not None]
        if said:
            self.members.carry_seconds(max(said))
        pushed: dict[str, int] = {}
        for st in states:
            # the highest batches ever pushed (a restore to a checkpoint took some
            # back, but the global step of async / ssp never goes back in a generation)
            for name, cursor in (st.get("highs") or st.get("cursors") or {}).items():
                pushed[name] = max(pushed.get(name, 0), int(cursor))
        now = self.clock()
        for index, steps in sorted(done.items()):
            if index < self.members.num_workers:
                # its examples as the record keeps them (for the batches the PS say)
                rec = self.finished.get(index)
                examples = rec.examples if rec is not None and rec.steps == steps else None
                self.members.known_done(index, steps, now, examples)
                log.info("worker %d finished its work before this chief started", index)
        # Workers that pushed are running (or were, and died meanwhile): members from
        # now, so one that never speaks to this chief (dead, or stopped) is counted
        # dead after the heartbeat timeout, like any silent worker, and no step waits
        # on it for ever.
        running = sorted(
            int(index)
            for role, _, index in (name.partition(":") for name in pushed)
            if role == "worker" and index.isdigit() and int(index) < self.members.num_workers
        )
        expected = [i for i in running if self.members.expect(i, now)]
        if expected:
            log.info(
                "%s training before this chief started; each counts as dead unless it"
                " speaks within %gs",
                _workers(expected),
                self.members.timeout,
            )
        if self.mode.name != "sync" and pushed:
            self.mode.global_step = sum(pushed.values())  # only ever raises it

    async def worker_left(self, who: o.Who, steps: int) -> None:
        """Worker ``who`` left with its work done after ``steps`` batches: every PS keeps
        it (a restarted chief learns it there) and fences the incarnation."""
        await tell_left(self.ps, who.name, who.incarnation, steps)

    def variables_created(self) -> None:
        """The variables of a fresh cluster exist now: training may begin."""
        if self.phase is Phase.WAITING:
            self.handle(Event.VARIABLES)
            self.health.expect(self.boots, self.gen, self.clock())
            self._start_training(0)
            if (self.awaited or self._lost_cluster_heard) and self.made_anew == self.gen:
                # workers that finished in the cluster lost before any checkpoint are
                # awaited, or one that ran in it registered already: they train their
                # work again from the initial values, in a generation past any of that
                # cluster (the PS start a fresh one at 0, which may be the one they
                # trained in: their work would stand, their pushes of it in flight be
                # taken as of these values)
                self.made_anew = None
                self._renewing = asyncio.ensure_future(
                    self._renew(
                        "the work of workers that finished was lost with every PS"
                        if self.awaited
                        else "workers ran in a cluster lost before its first checkpoint"
                    )
                )

    # ------------------------------------------------------------------ restores

    async def _restore(
        self,
        event: Event,
        reason: str,
        states: Sequence[dict[str, Any]],
        ckpt: Checkpoint | None = None,
        lost: Sequence[int] = (),
        detected_at: float | None = None,
        anew: bool = False,
    ) -> int:
        """Restore every shard on every PS (``states``: what they answered) to ``ckpt``
        (default: the latest committed checkpoint, or the initial values if there is
        none), all PS to one step, in a new generation; training restarts there.
        ``anew``: the values this chief made anew, past a cluster lost before them
        (:meth:`_renew`): every worker goes back to what they hold of it."""
        self.handle(event)
        self.made_anew = None
        started = self.clock()
        self.stop_training()
        before = self.mode.global_step
        self.boots = boots = {i: str(st["boot"]) for i, st in enumerate(states)}
        self.gen = max([self.gen, *(int(st["gen"]) for st in states)])
        cursors: dict[str, int] = {}
        for st in states:
            for worker, c in (st.get("cursors") or {}).items():
                cursors[worker] = max(cursors.get(worker, 0), int(c))
        if not cursors:
            # no PS kept what it had applied (every one restarted: a lone PS killed),
            # yet workers are at work in this run: the restore still takes back their
            # batches after the checkpoint (what they said they did, an estimate of how
            # many), else those batches are lost
            cursors = {
                f"worker:{i}": w.total_steps
                for i, w in self.members.workers.items()
                if w.total_steps > 0
            }
        rewound = self.rewound
        step = await self.restore_all(reason, ckpt, cursors, anew)
        rewound = self.rewound - rewound
        self.health.expect(boots, self.gen, self.clock())
        if self.phase is Phase.RESTORING:
            self.handle(Event.RESTORED)
            self._start_training(step)
        # else a shutdown came meanwhile: the restored values are for its last checkpoint
        if detected_at is not None:
            now = self.clock()
            record = {
                "reason": reason,
                "ps": list(lost),
                "step": step,
                "lost_steps": max(0, before - step) if self.mode.name == "sync" else None,
                # batches whose pushes the restore took back, trained again
                "rewound_batches": rewound,
                "gen": self.gen,
                "detect_to_resume_s": round(now - detected_at, 3),
                "restore_s": round(now - started, 3),
                "at": time.time(),
            }
            self.recoveries.append(record)
            self.recoveries = self.recoveries[-20:]
            self.restore_count += 1
            if self.metrics is not None:
                self.metrics.recovery_seconds.observe(now - detected_at)
            log.warning(
                "recovered from %s: every shard at step %d (generation %d), %.2fs after detection",
                reason,
                step,
                self.gen,
                now - detected_at,
            )
        return step

    async def restore_all(
        self,
        reason: str,
        ckpt: Checkpoint | None = None,
        cursors: dict[str, int] | None = None,
        anew: bool = False,
    ) -> int:
        """Send every PS its shards of ``ckpt`` (default: the latest), in a new
        generation; returns the step restored. ``anew``: see :meth:`_restore`."""
        placement = self.variables.placement
        assert placement is not None
        if ckpt is None and self.checkpointer is not None:
            await self.checkpointer.cancel()
            ckpt = await asyncio.to_thread(self.checkpointer.latest)
        step = 0 if ckpt is None else ckpt.step
        sync_step = step if self.mode.name == "sync" else 0
        # past any generation a chief of this run restored to: one killed during its
        # restore, its PS restarted too, left no PS that says it, but workers heard it
        gen = self.gen_floor = max(self.gen, self.gen_floor) + 1
        if self.gen_mark is not None:
            try:
                await asyncio.to_thread(self.gen_mark.save, gen)
            except OSError as exc:
                log.warning("cannot keep generation %d in %s: %s", gen, self.gen_mark.path, exc)
        self.gen = gen
        if self.mode.name == "sync":
            # with the generation, in the same turn: a status never says the new
            # generation with the old step (the step would seem to go back within it)
            self.mode.global_step = sync_step
        if ckpt is None:
            log.warning("no committed checkpoint: every shard restarts from its initial values")
            self.restores_from_scratch += 1
        # Pushes applied since the checkpoint are gone with the restore: when the PS
        # applied any (a restore during the run), every worker goes back to the batches
        # the checkpoint holds and trains the later ones again, so no acknowledged
        # batch is lost. A checkpoint that does not say (an older writer) keeps the
        # cursors the PS knew (those batches are lost).
        held = {} if ckpt is None else ckpt.cursors
        rewind = bool(cursors) and held is not None
        resumed = None
        if rewind:
            assert held is not None and cursors is not None
            back = {w: c - held.get(w, 0) for w, c in sorted(cursors.items())}
            if any(b > 0 for b in back.values()):  # (none: the checkpoint holds them all)
                log.warning("the workers train again the batches after the checkpoint: %s", back)
            self.rewound += sum(max(0, b) for b in back.values())
            cursors = held
        elif not cursors and (resumed := _resumed(ckpt)):
            # No PS knows any worker (a new cluster on the checkpoint of a run that was
            # stopped before its end): every worker resumes after the batches the
            # checkpoint holds, so the run finishes its work, once; the run's examples
            # and seconds count those batches as the checkpoint recorded them
            cursors = resumed
            assert ckpt is not None
            self.members.resume(ckpt.manifest.extra)
        # the workers hear where they go back to (:meth:`rewind_of`): after a restore that
        # took pushes back, and after one onto a checkpoint no PS knew more than (every PS
        # lost with the chief): a worker that ran on through both resumes after the
        # batches the checkpoint holds of it, not after its own count (fault schedule
        # 10309: worker 0 went on after 133 batches, the checkpoint held 132 of them; one
        # batch never trained, the run 2 steps short). A new worker starts there anyway.
        self.rewinds = dict(cursors or {}) if rewind or resumed else None
        if self.rewinds is None and (self.awaited or anew) and held is not None:
            # workers awaited to train their lost work again (:meth:`_check_finished_work`),
            # and, the values made anew, every worker of the cluster lost before them
            # (one that finished pushes nothing, so no PS knows it), go back to what the
            # restored state holds of them: the initial values, nothing
            self.rewinds = dict(held)
        if rewind or (anew and self.rewinds is not None):
            self._reopen(self.rewinds or {})
            # a worker back at work is not done any more (before the restore is sent:
            # a chief restarted in between must not wait for it as for one done)
            await self.note_done()
            self._finished_work_taken_back(reason, ckpt, step)
        await asyncio.gather(
            *(
                self.ps[i].request(
                    "restore",
                    o.Restore(
                        self.gen,
                        sync_step,
                        tuple(defs),
                        None if ckpt is None else ckpt.name,
                        placement.to_wire(),
                        cursors or None,
                        # the PS keep the cursors workers go back to for a chief started
                        # after this one (``ps_state.rewinds``): one killed before every
                        # worker heard them would leave them going on past the checkpoint
                        # (no PS knew any worker: the ledgers take the cursors all the same)
                        self.rewinds is not None,
                    ).to_wire(),
                    # sent again at once when the connection comes back (a PS killed
                    # during the restore: the one started in its place never heard it,
                    # and the chief waited its whole start-up timeout, then exited and
                    # was started again); a second copy to the same process restores
                    # the same values, nothing trained in between (every reply first)
                    timeout=self.cfg.startup_timeout / 2,
                    attempts=2,
                )
                for i, defs in self.variables.defs_by_ps().items()
            )
        )
        await self._boots_after_restore()
        if self.metrics is not None:
            self.metrics.restores.labels(reason.split()[0]).inc()
        log.info(
            "restored every shard to %s (step %d, generation %d): %s",
            "initial values" if ckpt is None else ckpt.name,
            step,
            self.gen,
            reason,
        )
        return step

    async def _boots_after_restore(self) -> None:
        """Each PS's boot id as it answers now, where it holds this restore's generation:
        a PS restarted during the restore (the restore sent again to the process
        started in its place) answers with another boot id than the one read before
        it, and the health watch took it for restarted and restored every PS a second
        time. One silent, or of another generation (restarted since: its restore is
        the watch's), keeps the boot id read before."""

        async def one(i: int) -> None:
            try:
                rep = await self.ps[i].request("ps_state", timeout=1.0)
            except ZmqpsError:
                return
            st = o.PsStateReply.parse(rep.body)
            if st.gen == self.gen and st.boot:
                self.boots[i] = st.boot

        await asyncio.gather(*(one(i) for i in range(len(self.ps))))

    def silent_ps(self) -> set[int]:
        """PS processes known silent: those of states counted down, and (replicated)
        those the re-replication's probes have not heard for the heartbeat timeout."""
        out = set(self.health.down) if self.cfg.replication <= 1 else set()
        if self.rereplicator is not None:
            out |= set(self.rereplicator.silent())
        return out

    def rewind_of(self, index: int) -> int | None:
        """The batch cursor worker ``index`` went back to at the last restore (None:
        none, or the worker is done: a done worker the restore did not reopen trains no
        more)."""
        state = self.members.workers.get(index)
        if self.rewinds is None or (state is not None and state.done):
            return None
        return self.rewinds.get(f"worker:{index}", 0)

    def _finished_work_taken_back(self, reason: str, ckpt: Checkpoint | None, step: int) -> None:
        """After :meth:`_reopen`: the workers still done (they left, no longer heard
        from) whose batches the restore takes back lost them for good. The run cannot
        end truthfully: :attr:`on_work_lost` hears why."""
        if self.on_work_lost is None or self.rewinds is None:
            return
        done = {i: Finished(w.total_steps) for i, w in self.members.workers.items() if w.done}
        held = Held(None if ckpt is None else ckpt.name, step, self.rewinds)
        lost = work_lost(done, held)
        if lost:
            how = f"the PS state that held it was lost ({reason})"
            self.on_work_lost(lost_verdict(lost, held, how))

    def _reopen(self, rewinds: dict[str, int]) -> None:
        """Workers that finished their data but still wait for the run's end, and whose
        batches the restore took back, are members at work again (the heartbeat tells
        them where to go back to)."""
        now = self.clock()
        for index, w in sorted(self.members.workers.items()):
            back = rewinds.get(f"worker:{index}", 0) < w.total_steps
            if w.done and back and self.members.reopen(index, now):
                log.warning(
                    "worker %d had finished: it trains its batches after %d again",
                    index,
                    rewinds.get(f"worker:{index}", 0),
                )

    async def restore_lost(self, lost: Sequence[int], detected_at: float, reason: str) -> None:
        """PS ``lost`` restarted without their shards: restore every PS."""
        placement = self.variables.placement
        if placement is None:
            return
        for attempt in range(1, RESTORE_ATTEMPTS + 1):
            if not self.lifecycle.can(Event.RESTORE):
                break
            placement = self.variables.placement
            assert placement is not None
            try:
                if self.replicated() or any(s.slot is not None for s in placement.shards):
                    await self._unreplicate(placement)  # again on a retry: a PS missed it
                states = await self.ps_states(self.cfg.startup_timeout)
                if not self.lifecycle.can(Event.RESTORE):
                    break  # a shutdown meanwhile
                await self._restore(
                    Event.RESTORE, reason, states, lost=lost, detected_at=detected_at
                )
                return
            except (DeadlineExceeded, NotFound, NotReady) as exc:  # NotPrimary: a NotFound
                # a PS stopped or restarted meanwhile (a restore sent to the process it
                # replaced is never answered), or not yet its state's only copy again
                # (stopped while the copies were taken down)
                if attempt == RESTORE_ATTEMPTS:
                    raise
                log.warning("restoring every PS failed (%s): once more", exc)
        log.warning("ps %s lost its shards in phase %s: no restore", lost, self.phase.value)

    # ------------------------------------------------------------------ watching the PS

    async def watch_ps(self) -> None:
        """Probe every PS each heartbeat interval (until cancelled). A probe still in
        flight when the interval ends counts as no answer yet, and the next probe of
        that PS waits for it: a silent PS is found within an interval of the heartbeat
        timeout, not after its probe's own timeout on top."""
        interval = min(self.cfg.heartbeat_interval, self.cfg.heartbeat_timeout / 4)
        inflight: dict[int, asyncio.Task[tuple[int, int, o.PsStateReply | None]]] = {}

        async def probe(i: int, gen: int) -> tuple[int, int, o.PsStateReply | None]:
            # the process it is routed to: a state moved meanwhile answers from its new
            # home, whose boot id the watch expects from then on (a new placement epoch
            # that leaves the state where it was, a copy added or dropped, changes
            # nothing: moves and copies back to back change the epoch every probe)
            home = self.homes.of[i] if self.homes is not None else i
            try:
                # attempts=2: a read, so it may be sent again, and is, at once, when the
                # connection comes back after a partition (the PS is heard without delay)
                rep = await self.ps[i].request(
                    "ps_state", timeout=max(0.5, 2 * interval), attempts=2
                )
                return gen, home, o.PsStateReply.parse(rep.body)
            except ZmqpsError:
                return gen, home, None

        def forget() -> None:
            for t in inflight.values():
                t.cancel()
            inflight.clear()

        try:
            while True:
                if not self.training or self.variables.placement is None:
                    forget()
                else:
                    for i in range(len(self.ps)):
                        if i not in inflight:
                            inflight[i] = asyncio.ensure_future(probe(i, self.gen))
                await asyncio.sleep(interval)
                if not inflight or not self.training:
                    continue
                failing: list[int] = []
                lost = self._hear(inflight, failing)
                if failing:
                    for i in failing:
                        inflight.pop(i, None)
                    await self.fail_over(failing)
                    continue
                if lost:
                    forget()
                    detected = self.health.detected(lost, self.clock())
                    log.warning("ps %s restarted without its shards: restoring every PS", lost)
                    reason = f"ps {','.join(map(str, lost))} restarted"
                    async with self.placement_lock:
                        await self.restore_lost(lost, detected, reason)
        finally:
            forget()

    def _hear(
        self,
        inflight: dict[int, asyncio.Task[tuple[int, int, o.PsStateReply | None]]],
        failing: list[int] | None = None,
    ) -> list[int]:
        """Take the answered probes; returns the PS that restarted. A replicated PS
        state newly silent is added to ``failing`` (a fail-over follows) instead of
        being waited for."""
        now = self.clock()
        lost = []
        for i in range(len(self.ps)):
            task = inflight.get(i)
            st: o.PsStateReply | None = None
            if task is not None and task.done():
                del inflight[i]
                gen, home, st = task.result()
                # a probe of before a restore, or routed to where a state no longer is
                moved = self.homes is not None and home != self.homes.of[i]
                st = st if gen == self.gen and not moved else None
            if st is None:
                if self.health.silent(i, now):
                    if failing is not None and self.can_fail_over(i):
                        failing.append(i)
                        continue
                    log.warning(
                        "ps %d (%s) has not answered for %.0fs: down; waiting for it to come back",
                        i,
                        self.ps[i].endpoint,
                        self.health.down[i],
                    )
                    self.handle(Event.PS_SILENT)
                continue
            heard = self.health.answered(i, st.boot, st.gen, now)
            if heard == "restarted":
                self._check_restarted_checkpoints(i, st)
                # restarted without its state; a copy of it lives on: fail over
                if failing is not None and self.can_fail_over(i):
                    failing.append(i)
                    continue
                lost.append(i)
            elif heard == "back":
                log.info("ps %d answers again", i)
                if not self.health.down and self.phase is Phase.DEGRADED:
                    self.handle(Event.PS_BACK)
        return lost

    # ------------------------------------------------------------------ fail-over

    def can_fail_over(self, state: int) -> bool:
        """Whether PS state ``state`` has a copy on a process other than its home."""
        placement = self.variables.placement
        if self.homes is None or placement is None or placement.replication < 2:
            return False
        return any(s.state == state and s.backups for s in placement.shards)

    async def publish_placement(self, placement: Placement, skip: Iterable[int] = ()) -> int:
        """Tell every PS process but ``skip`` the placement (``placement`` op): what a
        restarted chief trusts a copy by. Returns how many took it; one that does not
        answer within the heartbeat timeout is not waited for (it is silent: the
        watch deals with it)."""
        homes = self.homes
        assert homes is not None
        skipped = set(skip)
        body = o.PlacementNote(placement.to_wire()).to_wire()
        timeout = max(0.1, min(1.0, self.cfg.heartbeat_timeout))

        async def tell(q: int) -> bool:
            try:
                await homes.processes[q].request("placement", body, timeout=timeout)
                return True
            except ZmqpsError as exc:
                log.info("ps %d: placement epoch %d not told: %s", q, placement.epoch, exc)
                return False

        told = await asyncio.gather(
            *(tell(q) for q in range(len(homes.processes)) if q not in skipped)
        )
        return sum(told)

    async def fail_over(self, states: Sequence[int], processes: Sequence[int] = ()) -> None:
        """The processes serving ``states`` (and ``processes``: ones that serve no state
        but hold backups) are silent past the heartbeat timeout, or restarted: every
        state whose primary they were goes on on a backup (no restore, no new
        generation); every primary they backed up stops waiting for them. The surviving
        copies are fenced at a new term first (their answers say how far each got), the
        furthest is promoted, the new placement epoch is published.

        The processes are the ones serving ``states`` *now*, when they were found
        silent: a state moved meanwhile (a move's hand-over held the placement lock
        this waits for) is served by another process, which is not taken for dead."""
        if self.homes is not None:
            processes = [*processes, *(self.homes.of[i] for i in states)]
        async with self.placement_lock:
            await self._fail_over([], processes)

    async def _fail_over(self, states: Sequence[int], processes: Sequence[int]) -> None:
        assert self.homes is not None and self.variables.placement is not None
        started = self.clock()
        placement = self.variables.placement
        dead = {self.homes.of[i] for i in states} | set(processes)
        if not any(dead & set(s.copies) for s in placement.shards):
            return  # handled already (another fail-over took them out)
        if self.rereplicator is not None:  # no copy goes to them until they answer anew
            self.rereplicator.forget(dead)
        first: dict[int, ShardInfo] = {}
        for s in placement.shards:
            first.setdefault(s.state, s)
        process = self.homes.processes
        log.warning(
            "ps process %s silent for %gs or restarted: failing over to the copies",
            ", ".join(map(str, sorted(dead))),
            self.cfg.heartbeat_timeout,
        )

        async def replica(q: int, body: o.ReplicaSet) -> o.ReplicaState | None:
            try:
                rep = await process[q].request("replica", body.to_wire(), timeout=2.0)
                return o.ReplicaState.parse(rep.body)
            except ZmqpsError as exc:
                log.warning(
                    "ps %d: setting its copy of ps %d's state failed: %s", q, body.slot, exc
                )
                return None

        async def term_of(q: int, state: int) -> int:
            try:
                rep = await process[q].request("status", timeout=2.0, slot=state)
                return int((rep.body.get("replica") or {}).get("term", 0))
            except (ZmqpsError, TypeError, ValueError):
                return 0

        # 1. fence the surviving copies of every state whose primary died
        survivors: dict[int, dict[int, int]] = {}
        for state, s in first.items():
            if s.ps not in dead:
                continue
            alive = [q for q in s.backups if q not in dead]
            # the copies say their term (a restarted chief does not know it): the new
            # one is past every term any copy has seen, so the old primary is fenced
            seen = await asyncio.gather(*(term_of(q, state) for q in alive))
            term = self.terms[state] = max([self.terms.get(state, TERM), *seen]) + 1
            answers = await asyncio.gather(
                *(
                    replica(q, o.ReplicaSet(state, term, primary=False, epoch=placement.epoch + 1))
                    for q in alive
                )
            )
            survivors[state] = {q: a.applied for q, a in zip(alive, answers, strict=True) if a}
        heads = {s.id: survivors[s.state] for s in placement.shards if s.state in survivors}
        out = fail_over(placement, dead, heads, self.cfg.replication)
        if any(s.ps not in dead and set(s.backups) & dead for s in first.values()):
            # a primary is about to acknowledge without a backup it had: the other
            # processes hear of it first (the dropped copy itself may come back, and a
            # restarted chief must not then take it for an up-to-date one)
            await self.publish_placement(out.placement, skip=dead)
        # 2. promote the furthest copy of each; primaries stop waiting for dead backups
        after: dict[int, ShardInfo] = {}
        for s in out.placement.shards:
            after.setdefault(s.state, s)
        said: dict[int, str] = {}  # state -> the boot id its promoted copy answered with
        for state, s in after.items():
            if s.id in out.lost:
                continue
            before = first[state]
            if state in survivors or set(before.backups) & dead:
                links = tuple((q, process[q].endpoint) for q in s.backups)
                applied = (
                    tuple(survivors[state][q] for q in s.backups) if state in survivors else None
                )
                term = self.terms.get(state, TERM)
                body = o.ReplicaSet(state, term, True, links, applied, epoch=out.placement.epoch)
                got = await replica(s.ps, body)
                if got is not None and got.boot:
                    said[state] = got.boot
        lost_states = {s.state for s in out.placement.shards if s.id in out.lost}
        promoted = sorted(set(survivors) - lost_states)
        self.variables.use(out.placement)
        self.homes.update(out.placement)
        # 3. the moved states answer from their new homes (another boot id)
        await self.rehome(promoted, said)
        seconds = round(self.clock() - started, 3)
        # counted with the record in one turn: a status never shows one without the other
        self.promotions += len(promoted)
        self.failover_count += 1
        self.failovers.append(
            {
                "dead": sorted(dead),
                "promoted": {str(st): after[st].ps for st in promoted},
                "epoch": out.placement.epoch,
                "seconds": seconds,
            }
        )
        log.warning(
            "fail-over done in %.2fs: %s now served by ps %s (placement epoch %d)%s",
            seconds,
            ", ".join(f"ps {st}'s state" for st in promoted) or "nothing",
            ", ".join(str(after[st].ps) for st in promoted) or "-",
            out.placement.epoch,
            f"; {len(out.under_replicated)} shards under-replicated"
            if out.under_replicated
            else "",
        )
        if lost_states and not self.replicated():
            # a run without copies: the states that have none (the fail-over was of a
            # copy a move left, on a process silent past the heartbeat timeout) are
            # those of any silent PS: waited for, restored only if their process comes
            # back without them (the health watch). Before, a process stalled 12 s
            # during a move (the suite at three tests at once) had its own state
            # restored from the checkpoint as it answered again, its shards intact.
            log.warning(
                "ps %s's state has no copy elsewhere: waiting for its process to come back"
                " (restored if it comes back without it)",
                sorted(lost_states),
            )
        elif lost_states:
            log.error(
                "every copy of ps %s's state is gone: restoring every PS from the checkpoint"
                " (the copies are made again once it is restored)",
                sorted(lost_states),
            )
            await self.restore_lost(sorted(lost_states), started, "every copy of a PS state lost")

    async def rehome(self, states: Sequence[int], said: Mapping[int, str] | None = None) -> None:
        """``states`` moved to other processes: the health watch expects their new
        homes' boot ids (as their promotions answered, ``said``; else asked)."""
        boots = {i: said[i] for i in states if said and said.get(i)}
        # asked at once, each waited for up to the heartbeat timeout: a loaded process
        # answering late is not taken for restarted at its next probe
        wait = max(2.0, self.cfg.heartbeat_timeout)

        async def ask(state: int) -> None:
            try:
                rep = await self.ps[state].request("ps_state", timeout=wait)
                boots[state] = o.PsStateReply.parse(rep.body).boot
            except ZmqpsError as exc:
                log.warning("ps %d's new primary does not answer: %s", state, exc)

        await asyncio.gather(*(ask(i) for i in states if i not in boots))
        self.boots.update(boots)
        self.health.expect(boots, self.gen, self.clock())

    def restore_homes(self) -> dict[int, int]:
        """Where a restore puts each state: on its own process, unless the run was
        scaled to processes without it; then where it is served now, if that process
        stays, else on the first that stays."""
        assert self.homes is not None
        stays = None if self.mover is None or self.mover.wanted is None else self.mover.wanted
        if stays is None and self.left_at_start:
            stays = [q for q in range(len(self.homes.of)) if q not in self.left_at_start]
        out = {}
        for state, home in enumerate(self.homes.of):
            if stays is None or state in stays:
                out[state] = state
            else:
                out[state] = home if home in stays else stays[0]
        return out

    async def _unreplicate(self, placement: Placement) -> None:
        """Back to one copy of each state, on its own process, before a restore (every
        copy of some state was lost, or one had none left): every
        primary stops shipping (a backup left would keep a copy of before the restore,
        and a later fail-over could promote it), and the states go home."""
        assert self.homes is not None
        epoch = placement.epoch + 1
        processes = self.homes.processes

        async def tell(q: int, body: o.ReplicaSet, what: str) -> None:
            try:
                await processes[q].request("replica", body.to_wire(), timeout=2.0)
            except ZmqpsError as exc:
                log.warning("ps %d: could not %s ps %d's state: %s", q, what, body.slot, exc)

        # every state (one with a copy joining but no backup yet too), at a newer term:
        # a copy left of an older one can never be taken for the state's primary
        back = self.restore_homes()
        for state in sorted({s.state for s in placement.shards}):
            home = self.homes.of[state]
            term = self.terms[state] = self.terms.get(state, TERM) + 1
            if home != back[state]:  # served elsewhere since: that copy steps down
                await tell(home, o.ReplicaSet(state, term, False, epoch=epoch), "retire")
            # the state's own process serves it, the only copy (a backup of it there,
            # made since the process restarted, promoted: the restore overwrites it);
            # one that left the run (scaled down) is served where it was moved, an
            # empty copy made there when that process restarted
            body = o.ReplicaSet(state, term, True, epoch=epoch, make=back[state] != state)
            await tell(back[state], body, "take back")
        plain = replace(
            placement,
            shards=tuple(
                replace(
                    s,
                    ps=back[s.state],
                    backups=(),
                    slot=None if back[s.state] == s.state else s.state,
                )
                for s in placement.shards
            ),
            epoch=epoch,
        )
        self.variables.use(plain)
        self.homes.update(plain)
        # every process hears where the states go: a chief started after every one
        # that heard the moves restarted learns them here (fault schedule 730: after a
        # restore onto the process left by a scale-down, none had heard, and the next
        # chief restored again onto the drained one and waited for it)
        await self.publish_placement(plain)

    # ------------------------------------------------------------------ workers

    async def admit(
        self, who: o.Who, steps_planned: int, running: int | None = None
    ) -> tuple[bool, int, int]:
        """Register a worker: ``(rejoin, batches to skip, last sync step computed)``.

        Its older incarnations are fenced on every PS first (a late push of a paused
        old process is refused even if it comes before the new one's first push), and
        each PS says how far the worker's pushes got there. ``running``: an incarnation
        that runs already registers again (this chief restarted), having started after
        that many batches."""
        unknown = who.index not in self.members.workers
        if who.index in self.awaited and self._making_anew():
            # (speaking: not dead meanwhile)
            self.members.seen(who.index, self.clock())
            raise NotReady(
                f"the chief makes the initial values anew for the work {who.name} did and"
                " lost with every PS: register again"
            )
        rejoin = self.members.register(who.index, who.incarnation, self.clock(), steps_planned)
        if who.index in self.finished and not self.members.workers[who.index].done:
            await self.note_done()  # it trains again: not done any more
        progress, silent = await self._fence(who)
        if silent and running is None:
            # where it resumes needs what every PS applied from it: a PS left out (paused,
            # say) may hold a batch the others lack, which would then be trained twice
            raise NotReady(
                f"ps {', '.join(silent)} did not answer the fence of {who.name}:"
                " register again (where it resumes needs every PS)"
            )
        state = self.members.workers[who.index]
        if self.awaited.pop(who.index, None) is not None:
            log.info("worker %d, awaited, registered: it trains what was lost again", who.index)
            await self.note_done()  # awaited no more: a chief started later need not
        if running is not None:
            skip, last = running, -1
        else:
            reported = state.steps_before
            if self.rewinds is not None:
                # the last restore set every PS's cursors to the checkpoint's: they know
                # exactly; the steps heard in heartbeats before it were taken back
                reported = min(reported, self.rewinds.get(who.name, 0))
            skip, last = resume_point(
                reported,
                progress,
                sync=self.mode.name == "sync",
                global_step=self.mode.global_step,
            )
        # the batches its earlier incarnations really pushed, not the count last heard in
        # a heartbeat (it lags): the run's step count stays exact
        self.members.set_steps_before(who.index, skip)
        self.notes.log(
            logging.INFO,
            "worker %d (incarnation %d) %s%s",
            who.index,
            who.incarnation,
            "rejoined" if rejoin else "registered",
            f"; resumes after batch {skip}" if skip else "",
            key=("rejoined" if rejoin else "registered", who.index),
        )
        await self.mode.membership_changed(back=[who.index])
        if running is not None and unknown and self.made_anew == self.gen:
            if self.variables.placement is None or self.phase is Phase.WAITING:
                # the values are not made yet (or made, training not yet begun: a
                # restore would be refused for the phase): they are restored as soon
                # as training begins (:meth:`variables_created`). Before, a worker
                # registering between the two waited for ever for a new generation.
                self._lost_cluster_heard = True
                return rejoin, skip, last
            # it ran under an earlier chief, in a cluster this one never knew (every
            # PS lost with the chief before any checkpoint): it waits for a new
            # generation, which only a restore makes. Made anew, as a living chief
            # does when its PS come back empty with no checkpoint: initial values, a
            # new generation, its batches trained again.
            self.made_anew = None
            self._renewing = asyncio.ensure_future(
                self._renew(f"{who.name} ran in a cluster lost before its first checkpoint")
            )
        return rejoin, skip, last

    def renewing(self) -> bool:
        """The values made anew are being restored past the lost cluster's generation
        (:meth:`_renew`): a worker's leave waits for it (it may be of that cluster)."""
        return self._renewing is not None and not self._renewing.done()

    def _making_anew(self) -> bool:
        """This chief started the initial values anew, and has not yet restored them in
        a generation past those of the cluster lost before it (:meth:`_renew`)."""
        return self.made_anew == self.gen or self.renewing()

    async def _renew(self, reason: str) -> None:
        """Every shard back to its initial values in a new generation: a worker of a
        cluster lost before its first checkpoint registered again (:meth:`admit`), or
        workers that finished in it are awaited (:meth:`variables_created`)."""
        async with self.placement_lock:
            if self.phase not in (Phase.RUNNING, Phase.DEGRADED):
                return  # a restore, the end or a shutdown came first
            states = await self.ps_states(self.cfg.startup_timeout)
            await self._restore(Event.RESTORE, reason, states, anew=True)

    async def _fence(self, who: o.Who) -> tuple[list[Progress], list[str]]:
        """Tell every PS that the worker's incarnations before this one are gone: what
        each PS holding shards applied from it, and the PS that did not answer (they
        fence at the new incarnation's first push)."""
        body = o.Fence(who.name, who.incarnation).to_wire()

        async def one(c: Requester) -> Progress | str | None:
            try:
                rep = o.Fenced.parse((await c.request("fence", body, timeout=2.0)).body)
            except ZmqpsError as e:
                log.warning("could not fence %s on ps %s: %s", who.name, c.endpoint, e)
                return c.endpoint
            return Progress(rep.cursor, rep.step) if rep.holds else None

        got = await asyncio.gather(*(one(c) for c in self.ps))
        return [p for p in got if isinstance(p, Progress)], [s for s in got if isinstance(s, str)]

    async def watch_workers(self) -> None:
        """Log every worker that stops heartbeating (and every one that comes back); a
        death shrinks M (and N if needed) so no step waits for a dead worker, and a
        worker back is re-admitted (its token, its share of N)."""
        dead: set[int] = set()
        lapsed: set[int] = set()
        period = min(self.cfg.heartbeat_interval, self.cfg.heartbeat_timeout / 4)
        while True:
            await asyncio.sleep(period)
            now = self.clock()
            now_dead = set(self.members.dead(now))
            for i in sorted(now_dead - dead):
                log.warning(
                    "worker %d missed heartbeats for %.0fs: considered dead",
                    i,
                    self.cfg.heartbeat_timeout,
                )
            for i in sorted(dead - now_dead):
                log.info("worker %d is back: re-admitted", i)
            self._awaited_gone(now)
            # left unfinished and not back within a heartbeat timeout: a sync step no
            # longer waits for its share (SyncMode.gone)
            now_lapsed = set(self.members.lapsed(now))
            if self.mode.name == "sync":
                for i in sorted(now_lapsed - lapsed):
                    w = self.members.workers[i]
                    log.warning(
                        "worker %d left (%s) and is not back after %.0fs: the steps go on"
                        " without it",
                        i,
                        w.left_reason,
                        self.cfg.heartbeat_timeout,
                    )
            if now_dead != dead or now_lapsed - lapsed:
                await self.mode.membership_changed(
                    gone=sorted((now_dead - dead) | (now_lapsed - lapsed)),
                    back=sorted(dead - now_dead),
                )
            dead, lapsed = now_dead, now_lapsed

    def awaited_for(self) -> float:
        """How long an awaited worker (:attr:`awaited`) may stay silent: the heartbeat
        timeout, at least ``AWAIT_S`` (it fails the run; a worker waiting for the run's
        end speaks within about one heartbeat interval of this chief's start)."""
        return max(self.cfg.heartbeat_timeout, AWAIT_S)

    def _awaited_gone(self, now: float) -> None:
        """An awaited worker that did not speak within :meth:`awaited_for` is not
        running: nothing will train its lost batches again, and the run cannot end
        truthfully (:attr:`on_work_lost` hears why: exit code 3)."""
        if self.starting or self.recovering:
            # its wait counts from the end of the start or the restore (it is told to
            # register again meanwhile)
            for index in self.awaited:
                self.members.seen(index, now)
            return
        within = self.awaited_for()
        gone = sorted(
            i
            for i in self.awaited
            if i in self.members.workers and now - self.members.workers[i].last_seen > within
        )
        if not gone or self.on_work_lost is None:
            return
        lost = {i: (self.awaited[i].held or 0, self.awaited[i].steps) for i in gone}
        self.on_work_lost(
            f"{lost_verdict(lost, *self.lost_in)} ({_workers(gone)} not heard within"
            f" {within:g}s of this chief's start: not running)"
        )

    # ------------------------------------------------------------------ status

    def blocker(self) -> str | None:
        """Why training cannot advance now, from the recovery side (None: nothing here)."""
        phase = self.phase
        if phase is Phase.STARTING:
            return "the chief is starting: waiting for every PS to answer"
        if phase is Phase.WAITING:
            return "waiting for the variables to be created"
        if phase is Phase.RESTORING:
            return "restoring every shard from the checkpoint"
        if phase is Phase.DEGRADED or self.health.down:
            down = ", ".join(
                f"ps {i} (silent {s:.0f}s when found)" for i, s in sorted(self.health.down.items())
            )
            return f"waiting for {down} to come back"
        return None

    def status(self) -> dict[str, Any]:
        return {
            "phase": self.phase.value,
            "gen": self.gen,
            "recovering": self.recovering,
            "recoveries": self.recoveries[-5:],
            "rewound_batches": self.rewound,
            # workers that finished, part of whose work was lost since: each trains it
            # again once it speaks, or the run fails
            "awaited": sorted(self.awaited),
            "ps_down": {str(i): s for i, s in sorted(self.health.down.items())},
            "promotions": self.promotions,
            "failovers": list(self.failovers),
            "failover_count": self.failover_count,
            **(
                {"replication": self.rereplicator.status()}
                if self.rereplicator is not None and self.replicated()
                else {}
            ),
            **({"elastic": self.mover.status()} if self.mover is not None else {}),
        }

    def replication_figures(self) -> dict[str, Any]:
        """What the chief's replication metrics say (read at scrape time)."""
        rr = self.rereplicator if self.replicated() else None
        return {
            "factor": self.cfg.replication,
            "under_replicated": 0 if rr is None else len(rr.under_replicated()),
            "failovers": self.failover_count,
            "promotions": self.promotions,
            "last_failover_seconds": self.failovers[-1]["seconds"] if self.failovers else 0.0,
            "copies_made": 0 if rr is None else rr.copies,
            "copies_failed": 0 if rr is None else rr.failures,
            "copied_bytes": 0 if rr is None else rr.bytes,
            "copy_progress": float(((rr and rr.current) or {}).get("progress", 0.0)),
        }

    def replicated(self) -> bool:
        """Whether the run keeps copies (``--replication`` above 1)."""
        return self.homes is not None and self.cfg.replication > 1


def _done_on_ps(states: Sequence[dict[str, Any]]) -> dict[int, Finished]:
    """The workers the PS say finished their work: the most batches any says, in the
    generation of the PS that says it."""
    out: dict[int, Finished] = {}
    for st in states:
        for name, steps in (st.get("done") or {}).items():
            role, _, index = name.partition(":")
            if role == "worker" and index.isdigit():
                was = out.get(int(index))
                if was is None or was.steps < int(steps):
                    out[int(index)] = Finished(int(steps), int(st.get("gen") or 0))
    return out


def _knows_workers(state: Mapping[str, Any]) -> bool:
    """Whether a PS's ``ps_state`` knows any worker (a push, a leave, a cursor)."""
    return any(state.get(key) for key in ("cursors", "highs", "done"))


def _rewinds(states: Sequence[dict[str, Any]], gen: int) -> dict[str, int] | None:
    """The batch cursors of the last restore to a checkpoint, as the PS of generation
    ``gen`` were told it (None: that restore did not go back, or no PS says)."""
    for st in states:
        if int(st["gen"]) == gen and st.get("rewinds") is not None:
            return {str(w): int(c) for w, c in st["rewinds"].items()}
    return None


def _workers(indices: Sequence[int]) -> str:
    """``worker 3`` / ``workers 0, 2, 5`` / ``1000 workers (0 .. 999)`` for a log line."""
    if len(indices) == 1:
        return f"worker {indices[0]} was"
    if len(indices) <= 8:
        return f"workers {', '.join(map(str, indices))} were"
    return f"{len(indices)} workers ({indices[0]} .. {indices[-1]}) were"


def _moves_the_copies_say(
    placement: Placement, answers: Sequence[dict[str, Any] | None]
) -> tuple[Placement, list[tuple[int, int, int]]]:
    """Unreplicated, at start: ``placement`` (the newest any process heard) as the
    copies the processes hold say it is, and the moves the last chief left half done.
    A state whose unfenced primary copy of the highest term is on another process than
    the placement says took the move's hand-over before the chief could publish it:
    its home is that process. A primary that still counts other copies in sync (a
    move's target, joined) is listed ``(state, process, term)``: the move is to be
    given up there (no run without replication keeps a second copy)."""
    shards = list(placement.shards)
    halted: list[tuple[int, int, int]] = []
    for state in sorted({s.state for s in shards}):
        primaries = [
            (int(term), q, [int(b) for b in in_sync])
            for q, st in enumerate(answers)
            if st
            for slot, kind, term, _, fenced, in_sync in st.get("roles") or ()
            if int(slot) == state and kind == "primary" and not fenced
        ]
        if not primaries:
            continue
        term, q, in_sync = max(primaries)
        home = next(s.ps for s in shards if s.state == state)
        if q != home:
            log.warning(
                "ps %d's state is served by ps %d (term %d), not ps %d: a move's hand-over"
                " the last chief did not publish",
                state,
                q,
                term,
                home,
            )
            shards = [
                replace(s, ps=q, backups=(), slot=None if q == state else state)
                if s.state == state
                else s
                for s in shards
            ]
        if in_sync:
            halted.append((state, q, term))
    return replace(placement, shards=tuple(shards)), halted


def _backups_at(copies: Sequence[tuple[Any, ...]], term: int) -> set[int]:
    """The processes among a state's ``copies`` (process, role, term, fenced, in-sync
    backups, entry applied) that hold a backup at ``term``."""
    return {i for i, kind, t, *_ in copies if kind == "backup" and t == term}
