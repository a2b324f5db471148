"""Schedules: a cluster, a job and the faults to inject, all drawn from one integer seed.

Rules of this module:

* :func:`draw` is a pure function of its arguments: the same seed (and the same answer
  to "can network namespaces be made here") gives the same schedule, on any machine.
  Nothing in a schedule depends on timing; faults fire at fractions of the run's
  progress (its global step over the unfaulted run's final one), so a replay injects
  the same faults at the same points of training.
* Faults never meant to be fatal: every kill is followed by a restart (as a supervisor
  does), every stop by SIGCONT, every partition by a heal.
* A fault kind that cannot be injected here (a partition without namespaces) is left
  out of the draw, and the schedule says why (:attr:`Schedule.left_out`).
* Replicated schedules (:func:`draw_replicated`, ``--replication 2``) are drawn apart:
  3 PS with two copies of each state, one PS killed (and, once its states have two
  copies again, often a second), perhaps one fault of any other kind. A PS fault
  waits until no state is short of copies (:mod:`faults.inject`), so one copy of
  every state always lives: no restore may happen.
* PS moves (:data:`MOVE_KINDS`) are drawn from a Random of their own (as the one-PS
  share is), after everything else: a seed's other faults are what they were before
  moves were drawn. About half the schedules with 2 PS or more carry one: the chief is
  asked for fewer PS (``scale_ps``, or ``kill_during_move``: a task of the move under
  way, or the chief, killed meanwhile), and for all of them again later (a second
  ``scale_ps``). The PS left without states are drained (they exit 0) and started
  again before the scale back up, as ``zmqps launch --ps-schedule`` does.
* A worker SIGTERMed (:data:`TERM_KINDS`) is drawn the same way, from a Random of its
  own, in plain and replicated schedules alike.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any

__all__ = [
    "EPOCHS",
    "FAULT_KINDS",
    "HEARTBEAT_TIMEOUT",
    "JOB",
    "MOVE_KINDS",
    "MOVE_SHARE",
    "TERM_KINDS",
    "Fault",
    "Schedule",
    "draw",
    "draw_replicated",
]

#: The fault kinds drawn before moves were (their draws stay as they were).
BASE_KINDS = (
    "kill_chief",  # kill -9 the chief; restarted
    "kill_ps",  # kill -9 one PS; restarted (the chief restores every shard)
    "kill_worker",  # kill -9 one worker; restarted (a new incarnation)
    "kill_evaluator",  # kill -9 the side-car evaluator; restarted
    "stop_short",  # SIGSTOP a role for less than the heartbeat timeout, then SIGCONT
    "stop_long",  # SIGSTOP a role for longer than the heartbeat timeout, then SIGCONT
    "finish_while_stopped",  # SIGSTOP a worker until another one has finished its data
    "chief_during_ps_restart",  # kill -9 a PS, then the chief while the PS restarts
    "partition_ps",  # drop every packet of one PS's namespace, then heal
)
#: PS moves (drawn apart, :func:`_moves`): the chief asked for fewer PS (``Fault.ps``)
#: and later for all of them again
MOVE_KINDS = (
    # the chief asked for Fault.ps PS (the states of the others move off them, and
    # they are drained: exit 0), or for all of them again (the drained ones started
    # again first)
    "scale_ps",
    # the chief asked for Fault.ps PS, and the move's source ("source"), destination
    # ("destination") or the chief killed -9 while its status says the move is under
    # way; restarted as usual
    "kill_during_move",
)
#: Signals a task handles (drawn apart, :func:`_terms`): SIGTERM one worker, which
#: leaves unfinished ("terminated") and exits; restarted (a new incarnation), as
#: ``zmqps launch`` or an orchestrator does
TERM_KINDS = ("term_worker",)
#: Every fault kind the harness injects.
FAULT_KINDS = BASE_KINDS + MOVE_KINDS + TERM_KINDS
#: the share of the schedules that carry moves: plain ones with 2 PS or more (with
#: the one-PS share, about half of them all), replicated ones
MOVE_SHARE = 0.6
MOVE_SHARE_REPLICATED = 0.5
#: the share of the schedules (plain and replicated) with a worker SIGTERMed
TERM_SHARE = 0.4

#: Heartbeat timeout of every schedule (seconds): short, so detection is quick.
HEARTBEAT_TIMEOUT = 2.5
#: The job: the digits MLP with plain SGD, trained close to convergence, so that the
#: steps a fault costs or adds barely move the final accuracy (+25 % steps: +0.25
#: points). Sync averages the gradients of every worker in one update: a larger rate
#: and half the epochs.
JOB = ("--model", "mlp", "--optimizer", "sgd", "--seed", "0")
#: Hidden layers of the replicated schedules that draw a wide model: the updates of
#: two of the three PS states are past ``RING_MIN_BYTES`` (64 KiB), so they reach the
#: backup through the ring of shared memory, the third's beside its message.
WIDE = "256,256"
#: Epochs and learning rate by mode: about 2-5 s of training on 2 cores.
EPOCHS = {"async": 80, "ssp": 80, "sync": 40}
LR = {"async": 0.05, "ssp": 0.05, "sync": 0.2}


@dataclass(frozen=True)
class Fault:
    kind: str
    #: the task: "chief", "ps1", "worker0", "evaluator"
    target: str
    #: fires when the global step reaches this fraction of the unfaulted run's final one
    at: float
    #: seconds the fault lasts (stops, partitions); for finish_while_stopped the least
    #: time stopped; 0 for kills
    duration: float = 0.0
    #: chief_during_ps_restart: seconds between the PS's kill and the chief's
    delay: float = 0.0
    #: scale_ps, kill_during_move: the PS the chief is asked for (the first ``ps`` of
    #: the cluster spec); 0 for the other kinds
    ps: int = 0

    def describe(self) -> str:
        if self.kind == "scale_ps":
            return f"scale_ps to {self.ps} PS at {self.at:.0%}"
        if self.kind == "kill_during_move":
            return f"kill_during_move {self.target} (scale to {self.ps} PS) at {self.at:.0%}"
        what = f"{self.kind} {self.target} at {self.at:.0%}"
        if self.duration:
            what += f" for {self.duration:.1f}s"
        if self.kind == "chief_during_ps_restart":
            what += f", chief {self.delay:.1f}s later"
        return what


@dataclass(frozen=True)
class Schedule:
    seed: int
    mode: str  # async, sync, ssp
    ps: int
    workers: int
    #: the side-car evaluator's model source: None (no evaluator), "checkpoint", "snapshot"
    evaluator: str | None
    #: "worker" (each worker runs its loop) or "coordinator" (the chief schedules functions)
    driver: str
    #: steps per scheduled function (coordinator driver)
    steps_per_execution: int
    #: every task in its own network namespace (schedules with a partition)
    netns: bool
    faults: tuple[Fault, ...]
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT
    #: fault kinds left out of the draw, and why
    left_out: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    #: copies of each PS state (``--replication``): 1, or 2 for replicated schedules
    replication: int = 1
    #: the MLP's hidden layers (``--hidden``), None: the job's default (128). Wide
    #: enough (:data:`WIDE`), a PS state's updates go to its backup through the ring
    #: of shared memory the two share rather than beside their message
    hidden: str | None = None

    @property
    def epochs(self) -> int:
        return EPOCHS[self.mode]

    def job(self) -> list[str]:
        """The job's flags (chief, workers and evaluator alike)."""
        job = [*JOB, "--mode", self.mode, "--lr", str(LR[self.mode]), "--epochs", str(self.epochs)]
        return job if self.hidden is None else [*job, "--hidden", self.hidden]

    @property
    def checkpoint_steps(self) -> int:
        """A checkpoint every ~2 % of the run's global steps: a restore loses little."""
        if self.mode == "sync":
            per_worker = 1438 // self.workers // 32 + 1  # digits: 1438 training images
            return max(5, per_worker * self.epochs // 50)
        return max(10, (1438 // 32) * self.epochs // 50)

    def config(self) -> dict[str, Any]:
        """What the unfaulted reference run shares with this schedule: everything but the
        evaluator (it never pushes: it cannot change the model). In namespaces tensors
        travel by TCP across a bridge, which changes the pace of async training."""
        return {
            "mode": self.mode,
            "ps": self.ps,
            "workers": self.workers,
            "driver": self.driver,
            "steps_per_execution": self.steps_per_execution,
            "epochs": self.epochs,
            "job": self.job(),
            "checkpoint_steps": self.checkpoint_steps,
            "netns": self.netns,
            **({"replication": self.replication} if self.replication > 1 else {}),
        }

    def config_key(self) -> str:
        """A file name for the configuration: readable, plus a digest of all of it."""
        c = self.config()
        key = f"{c['mode']}-{c['driver']}-ps{c['ps']}-w{c['workers']}"
        if self.driver == "coordinator":
            key += f"-spe{self.steps_per_execution}"
        key += "-netns" if self.netns else ""
        key += f"-r{self.replication}" if self.replication > 1 else ""
        key += f"-h{self.hidden.replace(',', 'x')}" if self.hidden else ""
        digest = hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest()[:8]
        return f"{key}-{digest}"

    def unfaulted(self) -> Schedule:
        return replace(self, faults=(), evaluator=None)

    def kinds(self) -> list[str]:
        return [f.kind for f in self.faults]

    def describe(self) -> str:
        cluster = f"{self.mode}, {self.ps} PS, {self.workers} workers"
        if self.driver == "coordinator":
            cluster += f", coordinator (steps per execution {self.steps_per_execution})"
        if self.evaluator:
            cluster += f", evaluator ({self.evaluator})"
        if self.netns:
            cluster += ", namespaces"
        if self.replication > 1:
            cluster += f", replication {self.replication}"
        if self.hidden:
            cluster += f", hidden {self.hidden}"
        faults = "; ".join(f.describe() for f in self.faults) or "no faults"
        return f"seed {self.seed}: {cluster}: {faults}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return json.dumps(self.to_json())


def _tasks(rng: random.Random, ps: int, workers: int, evaluator: bool) -> list[str]:
    out = ["chief", *(f"ps{i}" for i in range(ps)), *(f"worker{i}" for i in range(workers))]
    return [*out, "evaluator"] if evaluator else out


def _stop(rng: random.Random, kind: str, at: float, tasks: list[str], hb: float) -> Fault:
    """A SIGSTOP of one of ``tasks``: shorter than the heartbeat timeout, or longer."""
    target = rng.choice(tasks)
    low, high = (0.2, 0.6) if kind == "stop_short" else (1.5, 2.5)
    return Fault(kind, target, at, duration=round(rng.uniform(low, high) * hb, 2))


def _fault(
    rng: random.Random,
    kind: str,
    at: float,
    ps: int,
    workers: int,
    evaluator: str | None,
    hb: float,
) -> Fault:
    """A fault of ``kind`` at ``at``, its target and timing drawn from ``rng``."""
    if kind == "kill_chief":
        return Fault(kind, "chief", at)
    if kind == "kill_ps":
        return Fault(kind, f"ps{rng.randrange(ps)}", at)
    if kind == "kill_worker":
        return Fault(kind, f"worker{rng.randrange(workers)}", at)
    if kind == "kill_evaluator":
        return Fault(kind, "evaluator", at)
    if kind in ("stop_short", "stop_long"):
        return _stop(rng, kind, at, _tasks(rng, ps, workers, evaluator is not None), hb)
    if kind == "finish_while_stopped":
        # late in the run, so another worker runs out of data while this one is stopped
        late = max(at, round(rng.uniform(0.55, 0.8), 3))
        return Fault(kind, f"worker{rng.randrange(workers)}", late, duration=round(1.5 * hb, 2))
    if kind == "chief_during_ps_restart":
        delay = round(rng.uniform(0.1, 1.0) * hb, 2)
        return Fault(kind, f"ps{rng.randrange(ps)}", at, delay=delay)
    if kind == "partition_ps":
        duration = round(rng.uniform(0.5, 3.0) * hb, 2)
        return Fault(kind, f"ps{rng.randrange(ps)}", at, duration=duration)
    raise ValueError(f"unknown fault kind {kind!r}")


#: the share of :func:`draw`'s schedules with one PS (a PS kill then restores every
#: shard; a sync run's steps are released by that PS itself between the chief's polls)
ONE_PS_SHARE = 0.2


def draw(seed: int, netns_unavailable: str | None = None) -> Schedule:
    """The schedule of ``seed``. ``netns_unavailable``: why network namespaces cannot be
    made here (None: they can), so partitions are left out of the draw."""
    rng = random.Random(seed)
    mode = rng.choice(("async", "sync", "ssp"))
    ps = rng.randint(2, 3)
    if random.Random(f"single-ps-{seed}").random() < ONE_PS_SHARE:
        ps = 1  # drawn apart: the other seeds keep their schedules
    workers = rng.randint(2, 4)
    driver = "coordinator" if mode == "async" and rng.random() < 0.25 else "worker"
    spe = rng.choice((2, 5)) if driver == "coordinator" else 1
    evaluator = rng.choice(("checkpoint", "snapshot")) if rng.random() < 0.4 else None
    hb = HEARTBEAT_TIMEOUT

    kinds = list(BASE_KINDS)
    left_out: list[tuple[str, str]] = []
    if evaluator is None:
        kinds.remove("kill_evaluator")
    if netns_unavailable is not None:
        kinds.remove("partition_ps")
        left_out.append(("partition_ps", f"no network namespaces: {netns_unavailable}"))

    count = rng.randint(1, 4)
    points = sorted(round(rng.uniform(0.1, 0.8), 3) for _ in range(count))
    faults = []
    for at in points:
        faults.append(_fault(rng, rng.choice(kinds), at, ps, workers, evaluator, hb))
    faults += _moves(random.Random(f"moves-{seed}"), ps, 1, MOVE_SHARE)
    faults += _terms(random.Random(f"term-{seed}"), workers)
    faults.sort(key=lambda f: f.at)
    return Schedule(
        seed=seed,
        mode=mode,
        ps=ps,
        workers=workers,
        evaluator=evaluator,
        driver=driver,
        steps_per_execution=spe,
        netns=any(f.kind == "partition_ps" for f in faults),
        faults=tuple(faults),
        heartbeat_timeout=hb,
        left_out=tuple(left_out),
    )


def _terms(rng: random.Random, workers: int) -> list[Fault]:
    """A worker SIGTERMed (``term_worker``), :data:`TERM_SHARE` of the time, at a point
    between 10 % and 85 % of the run. Drawn from ``rng`` alone: the rest of the
    schedule is as it would be without (a worker that left "terminated" shrank a sync
    run's N at once, and the others applied steps without it while it restarted)."""
    if rng.random() >= TERM_SHARE:
        return []
    return [
        Fault("term_worker", f"worker{rng.randrange(workers)}", round(rng.uniform(0.1, 0.85), 3))
    ]


def _moves(rng: random.Random, ps: int, least: int, share: float) -> list[Fault]:
    """PS moves, ``share`` of the time with 2 PS or more: the chief asked for
    fewer PS (at least ``least``; the one fault ``kill_during_move`` half the time, else
    ``scale_ps``) between 10 % and 50 % of the run, and for all ``ps`` again (a second
    ``scale_ps``) 15-35 % later. Drawn from ``rng`` alone: the rest of the schedule is
    as it would be without."""
    if ps < 2 or ps <= least:
        return []
    if rng.random() >= share:
        return []
    n = rng.randint(least, ps - 1)
    at = round(rng.uniform(0.1, 0.5), 3)
    back = round(min(0.85, at + rng.uniform(0.15, 0.35)), 3)
    if rng.random() < 0.5:
        down = Fault("scale_ps", "ps", at, ps=n)
    else:
        victim = rng.choice(("source", "destination", "chief"))
        down = Fault("kill_during_move", victim, at, ps=n)
    return [down, Fault("scale_ps", "ps", back, ps=ps)]


#: Fault kinds of replicated schedules beside ``kill_ps`` (at most one of them each)
REPLICATED_EXTRA = tuple(k for k in BASE_KINDS if k != "kill_ps")


def draw_replicated(seed: int, netns_unavailable: str | None = None) -> Schedule:
    """The replicated schedule of ``seed``: 3 PS, two copies of each state, an evaluator
    one time in three; one PS killed at a random point, a second one (any, the
    restarted one too) half the time once every state has two copies again, and half
    the time one more fault of any other kind: the chief killed (alone, or while a
    killed PS restarts), a worker or the evaluator killed, a worker stopped until
    another has finished, a PS cut off (``netns_unavailable``: why namespaces cannot
    be made here, None when they can), or any task stopped shorter or longer than
    the heartbeat timeout (a PS stopped or cut off past it is failed over, and comes
    back holding copies since replaced)."""
    rng = random.Random(f"replicated-{seed}")
    mode = rng.choice(("async", "sync", "ssp"))
    ps, workers = 3, rng.randint(2, 4)
    evaluator = rng.choice(("checkpoint", "snapshot")) if rng.random() < 1 / 3 else None
    hb = HEARTBEAT_TIMEOUT
    faults = [Fault("kill_ps", f"ps{rng.randrange(ps)}", round(rng.uniform(0.1, 0.5), 3))]
    if rng.random() < 0.5:
        at = round(rng.uniform(faults[0].at, 0.8), 3)
        faults.append(Fault("kill_ps", f"ps{rng.randrange(ps)}", at))
    kinds = [
        k
        for k in REPLICATED_EXTRA
        if (k != "kill_evaluator" or evaluator) and (k != "partition_ps" or not netns_unavailable)
    ]
    if rng.random() < 0.5:
        at = round(rng.uniform(0.1, 0.8), 3)
        faults.append(_fault(rng, rng.choice(kinds), at, ps, workers, evaluator, hb))
    faults.sort(key=lambda f: f.at)
    left_out = (
        ()
        if netns_unavailable is None
        else (("partition_ps", f"no network namespaces: {netns_unavailable}"),)
    )
    hidden = WIDE if rng.random() < 0.5 else None  # drawn last: the rest as before
    # moves apart: two copies of each state need 2 PS at least
    moves = _moves(random.Random(f"replicated-moves-{seed}"), ps, 2, MOVE_SHARE_REPLICATED)
    terms = _terms(random.Random(f"replicated-term-{seed}"), workers)
    faults = sorted([*faults, *moves, *terms], key=lambda f: f.at)
    return Schedule(
        seed=seed,
        mode=mode,
        ps=ps,
        workers=workers,
        evaluator=evaluator,
        driver="worker",
        steps_per_execution=1,
        netns=any(f.kind == "partition_ps" for f in faults),
        faults=tuple(faults),
        heartbeat_timeout=hb,
        left_out=left_out,
        replication=2,
        hidden=hidden,
    )
