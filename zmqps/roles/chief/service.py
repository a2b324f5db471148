"""The chief's request handler: membership, variables, the global step, status.

Rules of this module:

* :class:`ChiefService` only answers requests: its op table (:meth:`ChiefService.ops`)
  names every op with its typed body. The state lives in its parts, each the one
  owner of its kind: :class:`~zmqps.core.membership.Membership` (workers),
  :class:`~zmqps.roles.chief.variables.Variables` (the placement), the consistency
  mode (:mod:`zmqps.roles.chief.modes`: tokens, the global step),
  :class:`~zmqps.roles.chief.recovery.RecoveryController` (phase, PS health,
  generation, restores, worker admission), the checkpoint schedule.
* Side-car evaluators register and heartbeat like workers but are never members:
  the chief tracks them only to keep the PS up, at the end, until each took its
  last evaluation (bounded by ``final_eval_timeout``).
* When every worker has left with its work done (after the membership change that
  leave caused has reached the PS), ``all_done`` is set; the process (serve.py)
  then finishes the run.
* ``status`` names the blocker whenever training cannot advance.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from zmqps.core.membership import FINISHED_REASONS, Membership
from zmqps.core.recovery import Phase
from zmqps.core.variables import Placement, VariableDef
from zmqps.logs import RateLimitedLog
from zmqps.metrics import Metrics
from zmqps.metrics.summaries import WINDOW_S, Summaries, Window
from zmqps.roles.agreement import compare, job_flags, refusal
from zmqps.roles.checkpointer import Checkpointer
from zmqps.roles.chief.checkpoints import ChiefCheckpoints
from zmqps.roles.chief.modes import ChiefMode, make_chief_mode
from zmqps.roles.chief.recovery import RecoveryController, RunFinished
from zmqps.roles.chief.variables import Variables
from zmqps.roles.configs import ChiefConfig
from zmqps.roles.homes import Homes
from zmqps.roles.optable import Handler, OpTable
from zmqps.transport import Requester
from zmqps.wire import Message, reply
from zmqps.wire import ops as o
from zmqps.wire.errors import ConfigError, InvalidArgument, NotReady, RolledBack

__all__ = ["ChiefService"]

log = logging.getLogger("zmqps.chief")

#: seconds between two lines of one kind that a client's requests cause
NOTE_INTERVAL_S = 10.0

#: training that stands still this long is reported in the log, once per period
WAIT_REPORT_S = 30.0

#: ... and first after this long (a wait of its own: a task never started, say)
FIRST_WAIT_REPORT_S = 10.0

#: the run's controls: the chief's own key (its coordinator) and the operator's
#: (``status``: zmqps status, zmqps scale) only
OPERATOR_OPS = frozenset({"shutdown", "checkpoint"})

#: the requests made for a task (their body names it: a ``Who``)
TASK_OPS = frozenset({"register", "heartbeat", "leave", "take_token", "ssp_clock"})


def check_key(msg: Message) -> None:
    """Under CURVE, refuse ``msg`` unless the allow-list name of its sender's key may
    send it: :data:`OPERATOR_OPS` and a ``scale`` that changes the PS asked for only
    from the ``chief`` and ``status`` keys; a request that speaks for a task (its
    ``Who``: register, heartbeat, tokens, leave) only from a key of that task's
    role (``worker``, ``evaluator``; a per-task key such as ``worker3`` for that task
    alone), or the chief's; ``create_vars`` (the model, defined by its first creator)
    only from a worker's key or the chief's. Any allow-listed key could otherwise shut
    the run down, register as a worker and fence the real one out, or define the model."""
    name = msg.peer
    role = name.rstrip("0123456789")
    number = name[len(role) :]
    if role == "chief":
        return
    if msg.op == "create_vars" and role != "worker":  # the model, defined by its first
        raise InvalidArgument(  # creator: a worker's (or the chief's coordinator)
            f"the chief: create_vars is sent only by a worker or the chief; refused from"
            f" the key named {name!r} on the allow-list"
        )
    if msg.op in OPERATOR_OPS or (msg.op == "scale" and msg.body.get("ps") is not None):
        if name == "status":
            return
        raise InvalidArgument(
            f"the chief: {msg.op} is sent only by the chief or the operator's key (status);"
            f" refused from the key named {name!r} on the allow-list"
        )
    if msg.op not in TASK_OPS:
        return
    who = msg.body  # a Who travels flattened: role, index, incarnation
    if who.get("role") != role or (number and who.get("index") != int(number)):
        task = f"{str(who.get('role'))[:32]}:{str(who.get('index'))[:32]}"
        raise InvalidArgument(
            f"the chief: the key named {name!r} on the allow-list does not speak for {task}"
        )


#: blockers (``ChiefService.blocker``) that say the run is ending, not a stall. Every
#: other wait is a stall past --stall-timeout: a step waiting on a live worker (its
#: heartbeats say nothing of its step: a worker stuck in it, or a client that pushed
#: part of it, held a sync run for ever), workers that never register and variables
#: never created (a chief started with its PS and no worker waited for ever)
STILL_WORKING = ("finishing", "stopping")

#: side-car evaluators the chief keeps track of (a run has one or a few)
MAX_EVALUATORS = 64

#: how long a worker's create_vars waits for a built-in job's chief to create its own
#: variables (it loads its data set first); under the worker's 130 s request deadline
JOB_VARIABLES_WAIT_S = 100.0


class ChiefService:
    def __init__(
        self,
        cfg: ChiefConfig,
        ps_clients: Sequence[Requester],
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
        homes: Homes | None = None,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.ps = list(ps_clients)
        self.clock = clock
        self.members = Membership(cfg.cluster.num_workers, cfg.heartbeat_timeout)
        #: lines a client's requests cause: one per kind and task per NOTE_INTERVAL_S
        self.notes = RateLimitedLog(log, NOTE_INTERVAL_S, clock=clock)
        self.consistency: ChiefMode = make_chief_mode(cfg.sync, self.members, self.ps, clock)
        self.variables = Variables(cfg, self.ps)
        self.checkpointer = (
            Checkpointer(cfg.checkpoint, self.ps, metrics, clock) if cfg.checkpoint else None
        )
        self.checkpoints = (
            ChiefCheckpoints(self.checkpointer, self) if self.checkpointer is not None else None
        )
        if self.checkpoints is not None:
            self.consistency.on_step = self.checkpoints.at_boundary
            self.consistency.step_due = self.checkpoints.due_at
            self.consistency.plan_due = self.checkpoints.planned_at
        self.recovery = RecoveryController(
            cfg,
            self.ps,
            self.members,
            self.consistency,
            self.variables,
            self.checkpointer,
            self.checkpoints,
            metrics,
            clock,
            homes,
        )
        if metrics is not None:
            metrics.watch_replication(self.recovery.replication_figures)
            if self.recovery.mover is not None:
                metrics.watch_elastic(self.recovery.mover.figures)
        #: side-car evaluators: (index, incarnation) -> last heard (monotonic); those
        #: silent past the heartbeat timeout are forgotten when another registers, and
        #: at most MAX_EVALUATORS are kept (the longest silent goes first)
        self.evaluators: dict[tuple[int, int], float] = {}
        #: an evaluator registered or heartbeated here (a chief restarted at the end of
        #: a run may not have heard the cluster's evaluator yet)
        self.evaluator_heard = False
        self.all_done = asyncio.Event()
        self.shutdown_requested = asyncio.Event()
        #: the signal (SIGTERM, SIGINT) that asked for the shutdown, if one did
        self.stop_signal: signal.Signals | None = None
        #: a second signal: the chief stops waiting (for its last checkpoint, for the PS
        #: to acknowledge their shutdown) and exits
        self.forced = asyncio.Event()
        #: held heartbeats of workers waiting for the run's end, by index (at most one
        #: each), answered by :meth:`_tell_held_beats`
        self._held_beats: dict[int, asyncio.Future[None]] = {}
        self._finished = False
        #: the run ended before this chief started (:class:`RunFinished`): a task that
        #: registers is told so, and nothing more (its PS are gone or hold nothing)
        self.ended_before: RunFinished | None = None
        #: the tasks told that, as ``(role, index)``
        self.told_ended: set[tuple[str, int]] = set()
        self.recovery.on_phase = self._tell_held_beats
        self.recovery.on_work_lost = self._work_lost
        self.consistency.generation = lambda: self.recovery.gen
        self.consistency.on_token_waits = self._token_waits
        #: why the run failed although it ended in order (non-finite values): the
        #: chief's exit says so (:class:`RunFailed`); empty when it did not
        self.failure = ""
        #: the failure is work of finished workers lost (their batches taken back, or
        #: awaited in vain): the summary says so, as a start that found it does
        self.work_lost = False
        self.started = time.time()
        #: when this chief began (monotonic): a cluster's evaluator never heard is waited
        #: for at the end until it has been silent a heartbeat timeout from here
        self.began = time.monotonic()
        self.result: dict[str, Any] = {}
        #: TensorBoard scalars of the cluster (``--logdir``; set by whoever serves it)
        self.summaries: Summaries | None = None
        self._window = Window()
        self._summarized_step = 0
        self._summarized_examples = 0
        #: (worker, flag) whose difference from the chief's was logged (once each)
        self._flags_warned: set[tuple[int, str]] = set()
        self._ops = OpTable("the chief", self.ops())
        if metrics is not None:
            self._watch(metrics)

    def ops(self) -> dict[str, tuple[type[o.Body], Handler]]:
        """The op table: every op the chief serves, its typed body, its handler."""
        return {
            "ping": (o.Ping, self._op_ping),
            "register": (o.Register, self._op_register),
            "heartbeat": (o.Heartbeat, self._op_heartbeat),
            "leave": (o.Leave, self._op_leave),
            "create_vars": (o.CreateVars, self._op_create_vars),
            "get_placement": (o.GetPlacement, self._op_get_placement),
            "take_token": (o.TakeToken, self._op_take_token),
            "ssp_clock": (o.SspClock, self._op_ssp_clock),
            "checkpoint": (o.TakeCheckpoint, self._op_checkpoint),
            "status": (o.Status, self._op_status),
            "shutdown": (o.Shutdown, self._op_shutdown),
            "scale": (o.Scale, self._op_scale),
        }

    def __call__(self, msg: Message) -> Message | Awaitable[Message]:
        if msg.peer:  # CURVE: the allow-list's name of the sender's key
            check_key(msg)
        return self._ops(msg)

    def _watch(self, m: Metrics) -> None:
        """The chief's gauges read its state at scrape time (no per-event updates)."""
        m.set_info("chief", 0, self.mode)
        m.watch(m.global_step, lambda: self.global_step)
        m.watch(m.workers_alive, self._alive_count)
        # what every worker's heartbeats said: the run's throughput and loss, seen from
        # the chief alone (zmqps top given the chief's endpoint only)
        m.watch(m.cluster_examples, lambda: self._read_members(lambda: self.members.examples))
        m.watch(m.cluster_loss, lambda: self._read_members(self._mean_loss))
        m.watch(m.tokens_available, lambda: self.consistency.status().get("tokens_available", 0))
        m.watch(m.generation, lambda: self.recovery.gen)
        m.watch(m.ps_down, lambda: len(self.recovery.ps_down))

    def _alive_count(self) -> float:
        return self._read_members(lambda: len(self.members.alive(self.clock())))

    @staticmethod
    def _read_members(read: Callable[[], float]) -> float:
        # Runs in the exporter's thread: a worker registering meanwhile can change the
        # membership dict under the iteration; read again rather than fail the scrape.
        for _ in range(3):
            try:
                return read()
            except RuntimeError:
                continue
        return float("nan")

    def _mean_loss(self) -> float:
        """The mean of the last loss of each live worker that reported one (NaN: none)."""
        losses = []
        for i in self.members.alive(self.clock()):
            w = self.members.workers.get(i)
            if w is not None and w.loss is not None and math.isfinite(w.loss):
                losses.append(w.loss)
        return sum(losses) / len(losses) if losses else float("nan")

    # ---------------------------------------------------------------- the parts' state

    @property
    def mode(self) -> str:
        return self.consistency.name

    @property
    def global_step(self) -> int:
        return self.consistency.global_step

    @property
    def placement(self) -> Placement | None:
        return self.variables.placement

    @property
    def placement_ready(self) -> asyncio.Event:
        return self.variables.ready

    @property
    def gen(self) -> int:
        return self.recovery.gen

    async def create_variables(
        self, variables: Sequence[VariableDef], optimizer: dict[str, Any]
    ) -> Placement:
        """Create the model's variables (idempotent); a fresh cluster starts training."""
        if self.recovery.phase is Phase.STARTING and self._starting:
            await self.recovery.started.wait()  # adopted or restored ones come first
        placement = await self.variables.create(variables, optimizer)
        self.recovery.variables_created()
        return placement

    _starting = False

    async def start(self) -> None:
        """Decide how the cluster starts (adopt, restore, fresh) and start training."""
        self._starting = True
        await self.recovery.start()
        # what the PS said of the workers that finished is in the record from now
        await self.recovery.note_done()
        if self.members.all_done():  # every worker finished before this chief started
            self.all_done.set()

    # ---------------------------------------------------------------- membership

    def _op_ping(self, msg: Message, req: o.Ping) -> Message:
        return reply(msg, o.Pong("chief", 0).to_wire())

    def _info(self, steps_done: int = 0, last_step: int = -1) -> o.ClusterInfo:
        ended = self.ended_before
        if ended is not None:
            # nothing to train or evaluate: the final checkpoint says where the run ended
            return o.ClusterInfo(
                ps=tuple(self.cfg.cluster.ps),
                mode=self.mode,
                heartbeat_interval=self.cfg.heartbeat_interval,
                global_step=ended.ckpt.step,
                finished=True,
                ended=ended.ckpt.name,
            )
        placement = self.variables.placement
        if placement is not None:
            self.recovery.told(placement.epoch)
        return o.ClusterInfo(
            ps=tuple(self.cfg.cluster.ps),
            mode=self.mode,
            heartbeat_interval=self.cfg.heartbeat_interval,
            gen=self.recovery.gen,
            global_step=self.global_step,
            placement=None if placement is None else placement.to_wire(),
            recovering=self.recovery.recovering,
            steps_done=steps_done,
            last_step=last_step,
            finished=self.finished,
        )

    def _told_ended(self, who: o.Who) -> None:
        """``who`` heard that the run ended; kept only for the tasks of the cluster spec
        (whom the chief waits to tell), so that registers of other indexes cannot
        grow the set."""
        spec = self.cfg.cluster
        count = spec.num_workers if who.role == "worker" else len(spec.evaluator)
        if 0 <= who.index < count:
            self.told_ended.add((who.role, who.index))

    async def _op_register(self, msg: Message, req: o.Register) -> Message:
        who = req.who
        if who.role != "worker":
            self._heard_evaluator(who)
            if self.ended_before is not None:
                self._told_ended(who)
            return reply(msg, self._info().to_wire())
        if req.job is not None and who.index < self.cfg.cluster.num_workers:
            self._check_job_flags(who.index, req.job)  # (admit refuses another index)
        if self.ended_before is not None:
            # the run ended before this chief started: nothing to admit it to (admitting
            # asks every PS, and they are gone); the worker hears so and ends
            self._told_ended(who)
            return reply(msg, self._info().to_wire())
        if self.recovery.starting:
            # where a worker resumes is known once the PS are adopted or restored (a
            # new cluster on an interrupted run's checkpoint resumes after its batches)
            raise NotReady("the chief is starting (adopting or restoring the PS): register again")
        _, skip, last = await self.recovery.admit(who, req.steps_planned or 0, req.steps_done)
        if req.epoch is not None:
            await self.recovery.publish_past(req.epoch)
        return reply(msg, self._info(skip, last).to_wire())

    def _check_job_flags(self, index: int, flags: Mapping[str, str]) -> None:
        """Compare a registering worker's job flags with the chief's: refuse one of
        another cluster layout or model (:class:`ConfigError`: the worker exits with the
        line), warn once per worker and flag about those that run, naming the winner."""
        cfg = self.cfg
        differences = compare(job_flags(cfg.cluster, cfg.job, cfg.sync.mode), flags)
        refused = refusal(index, differences)
        if refused is not None:
            self.notes.warning("%s", refused, key=("refused", index))
            raise ConfigError(refused)
        for d in differences:
            # bounded: the cluster spec's workers times the flags compared
            if (index, d.flag) not in self._flags_warned:
                self._flags_warned.add((index, d.flag))
                log.warning("%s", d.warning(index))

    def _op_heartbeat(self, msg: Message, req: o.Heartbeat) -> Message | Awaitable[Message]:
        who = req.who
        if who.role != "worker":
            self._heard_evaluator(who)
        else:
            self.members.heartbeat(
                who.index,
                who.incarnation,
                req.step,
                self.clock(),
                req.loss,
                req.examples,
                req.nonfinite,
                req.examples_before,
            )
            if req.nonfinite:
                self._nonfinite_heard(who.index, req.step)
            w = self.members.workers[who.index]
            ends = self.finished or self.shutdown_requested.is_set() or self.recovery.recovering
            if req.wait and w.done and w.waits and not ends:
                return self._hold_beat(msg, who, req.wait)
        return reply(msg, self._beat(who).to_wire())

    def _beat(self, who: o.Who) -> o.HeartbeatReply:
        if who.role == "worker" and self.finished:
            self.members.workers[who.index].told_finished = True
        placement = self.variables.placement
        if placement is not None and placement.epoch:
            self.recovery.told(placement.epoch)
        return o.HeartbeatReply(
            global_step=self.global_step,
            gen=self.recovery.gen,
            recovering=self.recovery.recovering,
            finished=self.finished,
            # a shutdown (a signal, the shutdown op, a failed run): every worker ends its
            # step and leaves; none is left behind asking a chief that is gone
            stop=self.shutdown_requested.is_set() and not self.finished,
            ps_down=tuple(sorted(self.recovery.ps_down)),
            rewind=self.recovery.rewind_of(who.index) if who.role == "worker" else None,
            # sent once a fail-over moved a PS state (epoch 1 on)
            epoch=self.variables.placement.epoch or None if self.variables.placement else None,
        )

    async def _hold_beat(self, msg: Message, who: o.Who, wait: float) -> Message:
        """The heartbeat of a worker that waits for the run's end, answered when the
        run finishes, stops or changes phase (a restore), or after ``wait`` seconds
        (at most one heartbeat interval): the worker hears of the end at once instead
        of at its next heartbeat. One held per worker: a newer one answers the older."""
        prior = self._held_beats.pop(who.index, None)
        if prior is not None and not prior.done():
            prior.set_result(None)
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._held_beats[who.index] = mine
        stop = asyncio.ensure_future(self.shutdown_requested.wait())
        wakes: list[asyncio.Future[Any]] = [stop, mine]
        try:
            await asyncio.wait(
                wakes,
                timeout=min(wait, self.cfg.heartbeat_interval),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            stop.cancel()
            if self._held_beats.get(who.index) is mine:
                del self._held_beats[who.index]
        return reply(msg, self._beat(who).to_wire())

    @property
    def finished(self) -> bool:
        """The run is over and its summary written: heartbeats tell every task."""
        return self._finished

    @finished.setter
    def finished(self, value: bool) -> None:
        self._finished = value
        self._tell_held_beats()

    def _tell_held_beats(self) -> None:
        """Something a worker waiting for the run's end must hear changed: every held
        heartbeat is answered now."""
        for held in self._held_beats.values():
            if not held.done():
                held.set_result(None)

    def _nonfinite_heard(self, index: int, step: int) -> None:
        """Worker ``index`` skipped a step as not finite, or stopped at one. With no
        share of them allowed (``max_nonfinite_share`` 0) the run stops now, the model
        as it was before it (nothing non-finite was applied); else it is judged at the
        end (:func:`~zmqps.roles.chief.finish.nonfinite_verdict`)."""
        state = self.members.workers.get(index)
        stopped = state is not None and state.left_reason == "nonfinite"
        if self.failure or not (stopped or self.cfg.max_nonfinite_share == 0):
            return
        self.failure = (
            f"worker {index} met a non-finite loss or gradient after {step} steps"
            + (" and stopped (--on-nonfinite stop)" if stopped else "")
            + ("; --max-nonfinite-share is 0" if self.cfg.max_nonfinite_share == 0 else "")
        )
        log.error("%s: the run stops", self.failure)
        self.shutdown_requested.set()

    async def _op_leave(self, msg: Message, req: o.Leave) -> Message:
        who = req.who
        if who.role != "worker":
            self.evaluators.pop((who.index, who.incarnation), None)
            self.notes.log(
                logging.INFO, "evaluator left (%s)", req.reason or "done", key="evaluator_left"
            )
            return reply(msg, o.StepReply(global_step=self.global_step).to_wire())
        reason = req.reason or "done"
        if reason == "done" and req.gen is not None and req.gen < self.recovery.gen:
            # its work is of before a restore it has not heard of, which may have taken
            # its last batches back: it learns where it stands (a heartbeat), then
            # trains them again or leaves again
            raise RolledBack(
                f"worker {who.index}: the cluster was restored (generation"
                f" {self.recovery.gen}) since this work (generation {req.gen})"
            )
        if reason == "done" and self.recovery.renewing():
            # its work may be of a cluster lost before the values made anew: it hears
            # where it goes back to once they are restored, then leaves again (taken
            # now, the run could end on the initial values before the restore)
            raise RolledBack(
                f"worker {who.index}: the values are being made anew past a lost cluster"
            )
        self.members.leave(
            who.index,
            who.incarnation,
            req.step,
            self.clock(),
            reason,
            req.examples,
            req.waits,
            req.nonfinite,
            req.examples_before,
        )
        self.notes.log(
            logging.INFO,
            "worker %d left (%s) after %d steps",
            who.index,
            reason,
            req.step,
            key=("left", who.index),
        )
        if reason == "nonfinite" or req.nonfinite:
            self._nonfinite_heard(who.index, req.step)
        # N shrinks first (it may apply the step the leaver's gradient completed), so
        # the end of training sees every step the PS will ever apply. Not while the
        # whole run stops (a signal, the shutdown op, a failed run): N stays, so a step
        # some workers pushed before the others left is never applied with fewer
        # gradients (the last one's next push was applied alone: a resumed run took one
        # step more, its values not the unfaulted run's); the final checkpoint is of
        # the last whole step and every worker resumes there.
        if not self._stopping_together(reason):
            await self.consistency.membership_changed(gone=[who.index])
        state = self.members.workers[who.index]
        if state.done:
            # kept where a restarted chief reads it, before the leave is answered: the
            # PS keep it too, but lose it with their state
            await self.recovery.note_done()
            await self.recovery.worker_left(who, state.total_steps)
        if self.members.all_done():
            self.all_done.set()
        return reply(msg, o.StepReply(global_step=self.global_step).to_wire())

    def _stopping_together(self, reason: str) -> bool:
        """Sync: a worker leaving unfinished while the whole run stops (its N is the
        stop's, not this worker's: see :meth:`_op_leave`)."""
        return (
            self.consistency.name == "sync"
            and reason not in FINISHED_REASONS
            and self.shutdown_requested.is_set()
            and not self.finished
        )

    # ---------------------------------------------------------------- steps

    async def _op_take_token(self, msg: Message, req: o.TakeToken) -> Message:
        who = req.who
        self.members.heartbeat(who.index, who.incarnation, 0, self.clock())
        started = time.perf_counter()

        def have() -> int | None:
            """What the worker computed last, as of now: a step of before a restore that
            came while this poll waited means nothing (the steps went back with it)."""
            if req.have_gen is not None and req.have_gen != self.recovery.gen:
                return -1
            return req.have

        try:
            step = await self.consistency.take_token(
                who, (10.0 if req.wait is None else req.wait), have
            )
        finally:
            self._token_waits((time.perf_counter() - started,))
        token = o.Token(step, self.recovery.gen, ps=self.consistency.token_ps(who))
        return reply(msg, token.to_wire())

    def _token_waits(self, waits: Sequence[float]) -> None:
        """How long token polls waited: those answered here, and those the PS answered
        (they hand the tokens the chief releases), counted alike."""
        for waited in waits:
            if self.metrics is not None:
                self.metrics.token_wait.observe(waited)
            if self.summaries is not None:
                self._window.observe("token_wait_seconds", waited)

    async def _op_ssp_clock(self, msg: Message, req: o.SspClock) -> Message:
        who = req.who
        self.members.heartbeat(who.index, who.incarnation, req.completed, self.clock())
        slowest = await self.consistency.ssp_clock(
            who, req.completed, (10.0 if req.wait is None else req.wait)
        )
        return reply(msg, o.SspGrant(slowest).to_wire())

    # ---------------------------------------------------------------- variables

    async def _op_create_vars(self, msg: Message, req: o.CreateVars) -> Message:
        variables = tuple(VariableDef.from_wire(v) for v in req.variables)
        optimizer = dict(req.optimizer or self.cfg.optimizer)
        # a built-in job's chief defines the model: a worker's definitions are checked
        # against it, never taken first (the chief loads its data set meanwhile, a
        # worker of another model would otherwise win the race)
        if self.cfg.job is not None and await self.variables.wait(JOB_VARIABLES_WAIT_S) is None:
            raise NotReady("the chief has not created its job's variables yet: ask again")
        placement = await self.create_variables(variables, optimizer)
        return reply(msg, o.PlacementReply(placement.to_wire()).to_wire())

    async def _op_get_placement(self, msg: Message, req: o.GetPlacement) -> Message:
        placement = await self.variables.wait(0.0 if req.wait is None else req.wait)
        if placement is None:
            raise NotReady("variables have not been created yet")
        return reply(msg, o.PlacementReply(placement.to_wire()).to_wire())

    async def _op_checkpoint(self, msg: Message, req: o.TakeCheckpoint) -> Message:
        """Take a checkpoint now (``zmqps`` tools and tests)."""
        if self.checkpoints is None:
            raise InvalidArgument("the chief runs without --checkpoint-dir")
        ckpt = await self.checkpoints.now(60.0 if req.wait is None else req.wait)
        return reply(msg, o.CheckpointTaken(ckpt.name, ckpt.step).to_wire())

    # ---------------------------------------------------------------- status

    def _heard_evaluator(self, who: o.Who) -> None:
        now = self.clock()
        key = (who.index, who.incarnation)
        if key not in self.evaluators:
            for k, seen in list(self.evaluators.items()):
                # an earlier incarnation of this evaluator is replaced: the run's end
                # waits for the new one only (a killed one counted as live until it
                # had been silent a heartbeat timeout)
                if now - seen > self.cfg.heartbeat_timeout or k[0] == who.index:
                    del self.evaluators[k]
            while len(self.evaluators) >= MAX_EVALUATORS:
                del self.evaluators[min(self.evaluators, key=self.evaluators.__getitem__)]
        self.evaluators[key] = now
        self.evaluator_heard = True

    def live_evaluators(self, within: float | None = None) -> list[tuple[int, int]]:
        """Side-car evaluators heard within ``within`` seconds (default: the heartbeat
        timeout) that have not left."""
        now = self.clock()
        limit = self.cfg.heartbeat_timeout if within is None else within
        return [k for k, seen in self.evaluators.items() if now - seen <= limit]

    def status(self) -> dict[str, Any]:
        now = self.clock()
        placement = self.variables.placement
        return {
            "role": "chief",
            **self.consistency.status(),
            "global_step": self.global_step,
            # a (restarted) chief learns the step and generation from the PS: until then
            # it knows neither, and says so (the fields keep their type: 0 until known)
            "step_known": self.recovery.phase is not Phase.STARTING,
            "steps_planned": self.consistency.steps_planned(),
            "examples": self.members.examples,
            "workers_expected": self.members.num_workers,
            "workers_alive": self.members.alive(now),
            "workers_dead": self.members.dead(now),
            "workers": self.members.snapshot(now),
            "evaluators": len(self.live_evaluators()),
            "ps": list(self.cfg.cluster.ps),
            "variables": 0 if placement is None else len(placement.variables),
            "shards": 0 if placement is None else len(placement.shards),
            "uptime_s": round(time.time() - self.started, 3),
            "finished": self.finished,
            **self.recovery.status(),
            "checkpoints": None if self.checkpointer is None else self.checkpointer.status(),
        }

    async def _op_status(self, msg: Message, req: o.Status) -> Message:
        return reply(msg, await self.full_status())

    async def full_status(self) -> dict[str, Any]:
        """:meth:`status` with whom the current step waits on and what holds it back."""
        out = self.status()
        if self.finished or self.recovery.phase in (Phase.FINISHING, Phase.STOPPING):
            # no step to wait on: the end (the PS about to be shut down; asking them
            # made a status wait 2 s for those gone, and the chief's exit with it)
            out["waiting_on"] = []
        else:
            down = [self.ps[i] for i in self.recovery.ps_down]
            out["waiting_on"] = await self.consistency.waiting_on(out["workers_alive"], skip=down)
        # the PS just said which tokens they handed (they hand most of them)
        out.update(self.consistency.status())
        out["blocker"] = self.blocker(out)
        return out

    def blocker(self, st: dict[str, Any]) -> str | None:
        """Why training cannot advance now (None: nothing holds it back)."""
        if self.finished:
            return None
        why = self.recovery.blocker()
        if why is not None:
            return why
        if self.recovery.phase is Phase.FINISHING:
            return "finishing: the final checkpoint, evaluation and export"
        if self.recovery.phase is Phase.STOPPING:
            return "stopping (a shutdown was requested)"
        refused = self.consistency.refused_by()
        if refused:  # not "step ... waits on workers": they pushed, the PS refuses polls
            now = self.clock()
            states = ", ".join(
                f"ps {k}'s state ({now - since:.0f}s)" for k, since in sorted(refused.items())
            )
            return (
                f"the PS serving {states} refuses the chief's step polls (busy: too many"
                " requests of other peers pending there); asking again"
            )
        held = self.consistency.held_by_copies()
        if held:  # not "step ...": a step no copy can take in is a stall, not work
            now = self.clock()
            states = ", ".join(
                f"ps {k}'s state ({now - since:.0f}s)" for k, (since, _) in sorted(held.items())
            )
            return (
                f"the copies of {states} do not all have step {st['global_step'] + 1},"
                " which their primary applied: the step is not counted until they do"
            )
        missing = sorted(set(range(self.members.num_workers)) - set(self.members.workers))
        never = ""
        if missing and st["workers_alive"] and self.consistency.name == "sync":
            # counted in M: each sync step waits for their gradients too (a stall said
            # "training starts at step 0: the workers take its values")
            never = (
                f"{', '.join(f'worker {i}' for i in missing)}: never registered, counted"
                " among the replicas a sync step waits for (start it)"
            )
        if st["waiting_on"]:
            names = ", ".join(f"worker {i}" for i in st["waiting_on"])
            return (
                f"step {st['global_step']} waits on {names} (alive: heartbeats come,"
                " the step's push does not)" + (f", and on {never}" if never else "")
            )
        if never:
            return f"step {st['global_step']} waits on {never}"
        if not st["workers_alive"] and not self.members.all_done():
            if st["workers_dead"]:
                return f"no live worker: waiting for workers {st['workers_dead']} to come back"
            if missing:
                return f"waiting for workers {missing} to register"
            gone = {
                i: w.left_reason or "left"
                for i, w in sorted(self.members.workers.items())
                if w.gone and not w.done
            }
            left = ", ".join(f"worker {i} ({why})" for i, why in gone.items())
            return (
                f"no live worker: {left or 'a worker'} left without finishing its work;"
                " waiting for it to come back (start it again)"
            )
        resumed = self.recovery.resumed
        if resumed is not None and st["global_step"] <= resumed[2] and st["workers_alive"]:
            # training (re)started here (a restore, a chief's start): no step is counted
            # until the workers have the values of this generation and pushed again
            step, gen, shown = resumed
            why = f"training starts at step {step} (generation {gen}): the workers take its values"
            if shown > step:
                # async, ssp: a restore below the step shown (it never goes back): the
                # workers train again the steps after the checkpoint first
                why += (
                    f" and train again the steps after it; the global step stays {shown}"
                    " until they pass it"
                )
            return why
        return None

    def _not_pushing(self, st: dict[str, Any]) -> str | None:
        """Training stands still with nothing holding it back: the live workers whose
        work is not done push nothing (async, or ssp within its bound: no step waits on
        one, so :meth:`blocker` names none; a worker stuck in its own code, its I/O
        thread heartbeating, kept an async run for ever, silent)."""
        workers = self.members.workers
        idle = [i for i in st["workers_alive"] if i in workers and not workers[i].done]
        if not idle:
            return None
        names = ", ".join(f"worker {i}" for i in idle)
        return (
            f"the global step stays at {st['global_step']}: no push from {names} (alive:"
            " heartbeats come, pushes do not)"
        )

    async def report_waits(
        self, every: float = WAIT_REPORT_S, first: float = FIRST_WAIT_REPORT_S, look: float = 5.0
    ) -> None:
        """While training stands still for ``first`` seconds or more, say in the log
        what it waits on (then once per ``every`` s): a run waiting for a task to come
        back, or for one never started, is never silent."""
        first = min(first, every)
        since: float | None = None
        said, step = -math.inf, (-1, -1)
        while True:
            await asyncio.sleep(min(every, look))
            st = await self.full_status()
            why = st["blocker"] if self.recovery.started.is_set() else None
            now = self.clock()
            # the steps trained again after a restore below the step shown move too
            at = (st["global_step"], self.consistency.counted_step)
            moved, step = at != step, at
            if why is None and not moved and self.recovery.started.is_set():
                why = self._not_pushing(st)
            if why is None or moved:
                since = None
                continue
            since = now if since is None else since
            if (said < since and now - since >= first) or (
                now - since >= every and now - said >= every
            ):
                said = now
                log.warning("training has waited %.0fs: %s", now - since, why)
            self._check_stall(now - since, why)

    def _check_stall(self, stood: float, why: str) -> None:
        """Training stood still ``stood`` seconds for ``why``: past ``--stall-timeout``
        the run ends failed, saying what it waited on (a worker stopped for ever, a PS
        never restarted: every run ends within a bound). The end itself (final
        checkpoint, export) and a shutdown under way are not a stall."""
        limit = self.cfg.stall_timeout
        if not limit or stood < limit or self.failure or self.shutdown_requested.is_set():
            return
        if why.startswith(STILL_WORKING):
            # live tasks at work (a slow step, data loading, tasks not scheduled yet),
            # or the end itself: slow, not stuck
            return
        self.failure = f"training stood still for {stood:.0f}s (--stall-timeout {limit:g}): {why}"
        log.error("%s: the run stops", self.failure)
        self.shutdown_requested.set()

    async def write_summaries(self, every: float = WINDOW_S) -> None:
        """Every ``every`` seconds, the cluster's figures as TensorBoard scalars."""
        while True:
            await asyncio.sleep(every)
            self.summarize()

    def summarize(self, force: bool = False) -> None:
        """The window since the last call (global steps and examples per second, live
        and dead workers, the tokens' wait) at the global step; at the end (``force``)
        also the final model's scores."""
        if self.summaries is None:
            return
        step, examples = self.global_step, self.members.examples
        now = self.clock()
        window = self._window
        window.count("global_steps", max(0, step - self._summarized_step))
        window.count("examples", max(0, examples - self._summarized_examples))
        self._summarized_step, self._summarized_examples = step, examples
        window.last("workers_alive", len(self.members.alive(now)))
        window.last("workers_dead", len(self.members.dead(now)))
        figures = window.take(force) or {}
        values: dict[str, float | None] = {f"cluster/{k}": v for k, v in figures.items()}
        if force:  # the final model's scores on the test split
            for key, value in self.result.items():
                if key.startswith("test_") and isinstance(value, (int, float)):
                    values[f"final/{key}"] = float(value)
        self.summaries.scalars(step, values)

    def _op_scale(self, msg: Message, req: o.Scale) -> Message:
        """``zmqps scale``: the PS processes that serve the states from now on."""
        mover = self.recovery.mover
        if mover is None:
            raise InvalidArgument("this chief does not move PS states")
        if req.ps is not None:
            mover.scale(req.ps)
        return reply(msg, mover.status())

    def _work_lost(self, why: str) -> None:
        """A restore took back batches of workers that finished and left: nothing will
        train them again, so the run stops, failed (exit code 3), saying why."""
        if self.failure:
            return
        self.failure = why
        self.work_lost = True
        log.error("%s: the run stops", why)
        self.shutdown_requested.set()

    def _op_shutdown(self, msg: Message, req: o.Shutdown) -> Message:
        log.info("shutdown requested by %s", msg.sender or "?")
        self.shutdown_requested.set()
        return reply(msg)
