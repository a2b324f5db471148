"""The chief's recovery state: the cluster's phase, each PS's health, how to start.

Rules of this module (a state machine in the style of h11's ``_state.py``):

* The cluster is in one :class:`Phase`. Only the events of :data:`TRANSITIONS` move
  it, and an event that does not apply in the current phase raises
  :class:`InvalidTransition`: events come from the chief's own controller, so one
  that does not fit is a bug to surface, never an input to tolerate.
* :class:`PsHealth` owns what the chief knows of each PS: the boot id and the
  generation it expects, when the PS last answered, whether it is down (silent for
  longer than the heartbeat timeout). An answer with another boot id or generation
  means the PS restarted and lost its shards.
* :func:`decide_start`: from every PS's state at start, what a (re)started chief
  does: adopt the running PS, restore every shard from the checkpoint, or start fresh.
* :func:`resume_point`: where a worker's new incarnation resumes its data.
* Nothing here does IO or reads a clock; time is passed in.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "TRANSITIONS",
    "Event",
    "InvalidTransition",
    "Lifecycle",
    "Phase",
    "Progress",
    "PsHealth",
    "StartPlan",
    "decide_start",
    "resume_point",
]


class Phase(enum.Enum):
    STARTING = "starting"  # waiting for every PS to answer at start
    WAITING = "waiting"  # no variables yet: nothing to train, nothing to lose
    RUNNING = "running"
    DEGRADED = "degraded"  # a PS is silent past the heartbeat timeout; training waits for it
    RESTORING = "restoring"  # every shard back to the checkpoint, into a new generation
    FINISHING = "finishing"  # every worker done: final checkpoint, evaluation, export
    STOPPING = "stopping"  # a shutdown: a last checkpoint within the grace period
    STOPPED = "stopped"


class Event(enum.Enum):
    FRESH = "fresh"  # at start: empty PS, no checkpoint
    ADOPTED = "adopted"  # at start: the running PS agree; their state is the cluster's
    RESTORE = "restore"  # a PS lost its shards, the PS disagree, or a checkpoint to resume
    VARIABLES = "variables"  # the variables exist now
    RESTORED = "restored"  # every PS holds the restored shards
    PS_SILENT = "ps_silent"  # a PS has not answered for the heartbeat timeout
    PS_BACK = "ps_back"  # every PS that was silent answers again, shards intact
    ALL_DONE = "all_done"  # every worker left with its work done
    SHUTDOWN = "shutdown"  # SIGTERM / SIGINT / a shutdown request
    FINISHED = "finished"


P, E = Phase, Event

#: phase -> event -> next phase. Anything else is an :class:`InvalidTransition`.
TRANSITIONS: Mapping[Phase, Mapping[Event, Phase]] = {
    P.STARTING: {
        E.FRESH: P.WAITING,
        E.ADOPTED: P.RUNNING,
        E.RESTORE: P.RESTORING,
        E.SHUTDOWN: P.STOPPING,
    },
    P.WAITING: {E.VARIABLES: P.RUNNING, E.SHUTDOWN: P.STOPPING},
    P.RUNNING: {
        E.PS_SILENT: P.DEGRADED,
        E.RESTORE: P.RESTORING,
        E.ALL_DONE: P.FINISHING,
        E.SHUTDOWN: P.STOPPING,
    },
    P.DEGRADED: {
        E.PS_SILENT: P.DEGRADED,
        E.PS_BACK: P.RUNNING,
        E.RESTORE: P.RESTORING,
        E.ALL_DONE: P.FINISHING,
        E.SHUTDOWN: P.STOPPING,
    },
    # another PS restarting during a restore starts the restore over
    P.RESTORING: {E.RESTORED: P.RUNNING, E.RESTORE: P.RESTORING, E.SHUTDOWN: P.STOPPING},
    # a PS lost at the very end: restore, then finish again; one silent at the end:
    # the end waits for it (its final checkpoint is taken again until the PS answers)
    P.FINISHING: {
        E.PS_SILENT: P.FINISHING,
        E.FINISHED: P.STOPPED,
        E.RESTORE: P.RESTORING,
        E.SHUTDOWN: P.STOPPING,
    },
    P.STOPPING: {E.FINISHED: P.STOPPED, E.SHUTDOWN: P.STOPPING},
    P.STOPPED: {},
}

#: Phases in which workers must wait: their values may be rolled back.
RECOVERING = frozenset({P.STARTING, P.RESTORING})


class InvalidTransition(RuntimeError):
    """An event that does not apply in the cluster's current phase."""


@dataclass
class Lifecycle:
    """The cluster's phase and its history (the last transitions, for status)."""

    phase: Phase = Phase.STARTING
    history: list[tuple[str, str, str]] = field(default_factory=list)

    def handle(self, event: Event) -> Phase:
        nxt = TRANSITIONS[self.phase].get(event)
        if nxt is None:
            raise InvalidTransition(f"{event.value} in phase {self.phase.value}")
        self.history = [*self.history[-19:], (self.phase.value, event.value, nxt.value)]
        self.phase = nxt
        return nxt

    def can(self, event: Event) -> bool:
        return event in TRANSITIONS[self.phase]

    @property
    def recovering(self) -> bool:
        """Workers wait (their values may be rolled back)."""
        return self.phase in RECOVERING

    @property
    def training(self) -> bool:
        """Steps may advance: the variables exist and every shard is where it should be."""
        return self.phase in (Phase.RUNNING, Phase.FINISHING)


# ---------------------------------------------------------------------------- PS health


@dataclass
class _Ps:
    last_ok: float
    boot: str | None = None
    first_fail: float | None = None
    down_after: float | None = None  # seconds of silence when it was found down


class PsHealth:
    """The chief's view of every PS: expected boot id and generation, last answer."""

    def __init__(self, count: int, timeout: float, now: float) -> None:
        self.timeout = timeout
        self.gen = 0
        self._ps = [_Ps(now) for _ in range(count)]

    def expect(self, boots: Mapping[int, str], gen: int, now: float) -> None:
        """After a start or a restore: each PS answers with this boot id and generation."""
        self.gen = gen
        for i, boot in boots.items():
            p = self._ps[i]
            p.boot, p.last_ok, p.first_fail, p.down_after = boot, now, None, None

    def expected(self, i: int) -> str | None:
        """The boot id PS state ``i``'s home is expected to answer with (None: none
        known yet)."""
        return self._ps[i].boot

    def answered(self, i: int, boot: str, gen: int, now: float) -> str:
        """PS ``i`` answered a probe: ``ok``; ``back`` (it was down, shards intact); or
        ``restarted`` (another boot id or generation: its shards are gone)."""
        p = self._ps[i]
        was_down = p.down_after is not None
        p.last_ok = now
        p.down_after = None
        if boot != p.boot or gen != self.gen:
            p.first_fail = p.first_fail if p.first_fail is not None else now
            return "restarted"
        p.first_fail = None
        return "back" if was_down else "ok"

    def silent(self, i: int, now: float) -> bool:
        """PS ``i`` did not answer this round; True when it is newly down."""
        p = self._ps[i]
        if p.first_fail is None:
            p.first_fail = now
        if p.down_after is None and now - p.last_ok > self.timeout:
            p.down_after = round(now - p.last_ok, 3)
            return True
        return False

    @property
    def down(self) -> dict[int, float]:
        """Down PS: index -> seconds of silence when found down."""
        return {i: p.down_after for i, p in enumerate(self._ps) if p.down_after is not None}

    def detected(self, lost: Iterable[int], now: float) -> float:
        """When the first sign of trouble with ``lost`` was seen."""
        times = [self._ps[i].first_fail for i in lost]
        return min([t for t in times if t is not None], default=now)


# ---------------------------------------------------------------------------- start


@dataclass(frozen=True)
class StartPlan:
    """What a starting chief does: ``adopt`` the running PS (``placement`` from them,
    the sync ``step`` and ``contributors`` of that step), ``restore`` every shard
    (``placement`` when the PS know one, else the checkpoint's), or start ``fresh``."""

    kind: str
    gen: int
    placement: Mapping[str, Any] | None = None
    step: int = 0
    contributors: tuple[str, ...] = ()
    reason: str = ""


def decide_start(states: Sequence[Mapping[str, Any]], sync: bool) -> StartPlan:
    """From every PS's ``ps_state`` (index order): adopt, restore or start fresh.

    The running PS are adopted when they hold shards, know the placement and agree:
    one generation, each holds exactly its shards of the placement, and (sync) their
    steps differ by at most one (a step being applied). Anything else is restored.
    """
    gen = max((int(st["gen"]) for st in states), default=0)
    held = [st for st in states if st["shards"]]
    known = [st["placement"] for st in held if st.get("placement") is not None]
    if not held or not known:
        return StartPlan("restore" if held else "fresh", gen, reason="no placement held")
    placement = max(known, key=lambda p: int(p.get("epoch") or 0))
    problem = _disagreement(states, placement, sync)
    if problem is not None:
        return StartPlan("restore", gen, placement, reason=f"the PS do not agree ({problem})")
    holders = sorted(set(_states_of(placement)))
    step = min(int(states[i]["step"]) for i in holders) if holders else 0
    at_step = [st for i, st in enumerate(states) if i in holders and int(st["step"]) == step]
    contributors = set.intersection(*(set(st.get("contributors", ())) for st in at_step))
    return StartPlan("adopt", gen, placement, step, tuple(sorted(contributors)))


def _disagreement(
    states: Sequence[Mapping[str, Any]], placement: Mapping[str, Any], sync: bool
) -> str | None:
    # (a process that left the run, drained and gone, says nothing of a generation)
    gens = {int(st["gen"]) for st in states if not st.get("left")}
    if len(gens) > 1:
        return f"generations {sorted(gens)}"
    state_of = _states_of(placement)
    for i, st in enumerate(states):
        want = {int(s[0]) for s, at in zip(placement["shards"], state_of, strict=True) if at == i}
        have = {int(sid) for sid, _ in st["shards"]}
        if want != have:
            return f"ps {i} holds shards {sorted(have)[:8]}, the placement says {sorted(want)[:8]}"
    if sync:
        holders = sorted(set(state_of))
        steps = {int(states[i]["step"]) for i in holders}
        if len(steps) > 1 and max(steps) - min(steps) > 1:
            return f"sync steps {sorted(steps)}"
    return None


def _states_of(placement: Mapping[str, Any]) -> list[int]:
    """The PS state of each shard of a placement in wire form (its slot when a state
    was moved to another process, else the PS that holds it)."""
    slots = placement.get("slots")
    if slots is not None and len(slots) == len(placement["shards"]):
        return [int(x) for x in slots]
    return [int(s[5]) for s in placement["shards"]]


@dataclass(frozen=True)
class Progress:
    """What one PS last applied from a worker: its batch ``cursor`` (0: nothing) and
    the sync ``step`` that push was for (-1: none, or not sync)."""

    cursor: int = 0
    step: int = -1


def resume_point(
    reported: int, progress: Sequence[Progress], *, sync: bool, global_step: int
) -> tuple[int, int]:
    """Where a worker's new incarnation resumes: ``(batches to skip, the sync step it
    last computed)``, from what every PS holding shards applied from it.

    A batch whose push reached only some PS (the worker died in between) is done
    again only when that can be exact: in sync mode while its step is still the
    current one (the PS that have it drop the second copy as that step's duplicate;
    should the step go on before the redo arrives, they count it toward the new step
    as nobody's gradient, never applying it twice: ``PushLedger.counted_at_another_step``).
    Otherwise it is skipped: applied twice on some PS would be worse than missing on
    others (it was never acknowledged). ``reported`` (the steps earlier incarnations
    reported to the chief) stands in where no PS knows more (they restarted since).
    """
    if not progress:
        return reported, -1
    hi = max(progress, key=lambda p: p.cursor)
    lo = min(progress, key=lambda p: p.cursor)
    if sync and lo.cursor < hi.cursor and hi.step == global_step:
        return lo.cursor, lo.step
    return max(reported, hi.cursor), hi.step
