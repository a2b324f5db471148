"""Elastic PS, sans-IO: which process serves each PS state after the PS count changes,
and the schedules that change it.

A PS *state* (its shards, hash-table buckets, dedup window, ledgers, sync sums) is
the unit a change of PS count moves: it is what replication copies and a fail-over
promotes, so a move is a copy that catches up, then a hand-over at a new placement
epoch (``roles/chief/moves.py``). A run has as many states as its cluster spec names
PS; the PS count of a run is how many of those processes serve them.

Rules of this module:

* Pure functions of their arguments: no IO, no clock, no randomness. The same sizes,
  homes and processes always give the same plan.
* :func:`plan_homes` puts the highest load first: no process ends above :func:`cap` (a
  longest-processing-time packing's highest load, at least an equal share) when the
  states can be packed so, and never more than one state above it. A plan that would
  not lower the highest load, with no process leaving, moves nothing: planning again
  on a plan's outcome converges (each round that moves lowers the highest load), so
  the chief never moves states back and forth. Then the bytes moved: every state of a
  process that leaves moves, and a process above the cap sheds the fewest bytes that
  bring it under; nothing else moves (a PS that joins takes states only when that
  lowers the highest load). A state that moves goes to its own process (state ``i``
  started on process ``i``) when it fits there, else to the least loaded one it fits
  on: a state that left comes home when its process is back.
* Bad arguments raise :class:`~zmqps.wire.errors.InvalidArgument`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zmqps.wire.errors import InvalidArgument

__all__ = ["Move", "cap", "moves", "parse_schedule", "plan_homes"]


@dataclass(frozen=True)
class Move:
    """PS state ``state`` (``nbytes`` of shards) goes from process ``source`` to ``target``."""

    state: int
    source: int
    target: int
    nbytes: int


def plan_homes(
    sizes: Mapping[int, int], homes: Mapping[int, int], processes: Sequence[int]
) -> dict[int, int]:
    """The process each state is served by once only ``processes`` serve states.

    ``sizes``: each state's bytes; ``homes``: the process serving each state now.
    The highest load comes first: it is kept at most ``cap`` (:func:`cap`, what a
    longest-processing-time packing of the states reaches, and at least an equal
    share). Then the bytes moved: a state stays where it is unless its process leaves
    or holds more than the cap (it sheds the fewest bytes that bring it under); a
    state that must move goes, largest first, to its own process when it fits under
    the cap there, else to the least loaded one it fits on.
    """
    serving = sorted(set(processes))
    if not serving:
        raise InvalidArgument("at least one PS must serve the states")
    if set(sizes) != set(homes):
        raise InvalidArgument("every state needs its size and its home")
    if any(n < 0 for n in sizes.values()):
        raise InvalidArgument("a state's size cannot be negative")
    limit = cap(list(sizes.values()), len(serving))
    out: dict[int, int] = {}
    loads = dict.fromkeys(serving, 0)
    pool = []
    for state in sorted(sizes):
        if homes[state] in loads:
            out[state] = homes[state]
            loads[homes[state]] += sizes[state]
        else:
            pool.append(state)
    highest = max(loads.values())
    leaving = bool(pool)
    for p in serving:
        if loads[p] > limit:
            held = {st: sizes[st] for st, at in out.items() if at == p}
            for st in _shed(held, loads[p] - limit, p):
                del out[st]
                loads[p] -= sizes[st]
                pool.append(st)
    for state in sorted(pool, key=lambda st: (-sizes[st], st)):
        fits = [p for p in serving if loads[p] + sizes[state] <= limit]
        if fits:  # its own process if there is room there, else the least loaded
            target = min(fits, key=lambda p: (p != state, loads[p], p))
        else:
            target = min(serving, key=lambda p: (loads[p], p))
        out[state] = target
        loads[target] += sizes[state]
    # what stayed left no room for a state under the cap: the most loaded process
    # gives the least loaded a state while that lowers the higher of the two
    while max(loads.values()) > limit:
        most = max(serving, key=lambda p: (loads[p], -p))
        least = min(serving, key=lambda p: (loads[p], p))
        gap = loads[most] - loads[least]
        movable = [st for st, p in out.items() if p == most and 0 < sizes[st] < gap]
        if not movable:
            break
        state = min(movable, key=lambda st: (abs(gap - 2 * sizes[st]), sizes[st], st))
        out[state] = least
        loads[most] -= sizes[state]
        loads[least] += sizes[state]
    if not leaving and max(loads.values()) >= highest:
        # no better than where the states are: nothing moves (a plan made again on
        # its own outcome moves nothing unless it lowers the highest load)
        return dict(homes)
    return out


def cap(sizes: Sequence[int], n: int) -> int:
    """The highest load a plan for ``n`` processes aims at: what placing the states
    largest first, each on the least loaded process, reaches (within a third of the
    best there is), and never below an equal share."""
    loads = [0] * n
    for size in sorted(sizes, reverse=True):
        i = loads.index(min(loads))
        loads[i] += size
    return max(max(loads, default=0), -(-sum(sizes) // n))


def _shed(held: Mapping[int, int], excess: int, process: int) -> list[int]:
    """States of ``held`` (state -> bytes, on ``process``) adding up to at least
    ``excess`` bytes, few bytes in all: the smaller of the least single state that
    covers it, and the states taken largest first among those that do not overshoot,
    then the least that covers what is left. Of equal sizes, the process's own state
    is kept."""

    def size(st: int) -> tuple[int, bool, int]:
        return held[st], st == process, st

    some: list[int] = []
    left = excess
    for st in sorted(held, key=lambda st: (-held[st], st == process, st)):
        if 0 < held[st] <= left:
            some.append(st)
            left -= held[st]
    while left > 0:
        rest = [st for st in held if st not in some and held[st] > 0]
        if not rest:
            break
        covering = [st for st in rest if held[st] >= left]
        pick = min(covering, key=size) if covering else max(rest, key=size)
        some.append(pick)
        left -= held[pick]
    one = min((st for st in held if held[st] >= excess), key=size, default=None)
    if one is not None and held[one] <= sum(held[st] for st in some):
        return [one]
    return some


def moves(
    sizes: Mapping[int, int], homes: Mapping[int, int], planned: Mapping[int, int]
) -> list[Move]:
    """The moves from ``homes`` to ``planned``: states of the largest first (a state
    of a leaving process before any other, so a process drains soonest)."""
    out = [
        Move(state, homes[state], planned[state], sizes[state])
        for state in sorted(planned)
        if planned[state] != homes[state]
    ]
    leaving = set(homes.values()) - set(planned.values())
    return sorted(out, key=lambda m: (m.source not in leaving, -m.nbytes, m.state))


def parse_schedule(text: str, most: int) -> list[tuple[int, int]]:
    """``STEP:N[,STEP:N...]``: at global step STEP the run has N PS (1 <= N <= ``most``,
    steps increasing). Returns ``[(step, n), ...]``."""
    out: list[tuple[int, int]] = []
    for part in text.split(","):
        step_text, sep, n_text = part.strip().partition(":")
        try:
            step, n = int(step_text), int(n_text)
        except ValueError:
            step, n = -1, -1
        if not sep or step < 0 or n < 1:
            raise InvalidArgument(
                f"--ps-schedule: {part.strip()!r} is not STEP:N (a step >= 0, a PS count >= 1)"
            )
        if n > most:
            raise InvalidArgument(
                f"--ps-schedule: {n} PS at step {step}, but the cluster names {most}"
            )
        if out and step <= out[-1][0]:
            raise InvalidArgument(f"--ps-schedule: steps must increase ({out[-1][0]}, then {step})")
        out.append((step, n))
    return out


def past_the_end(schedule: list[tuple[int, int]], planned: int) -> str | None:
    """What of a ``--ps-schedule`` a run of ``planned`` global steps never reaches
    (its points at or after the last step), in words; None: all of it is reached, or
    the steps planned are not known (``planned`` 0)."""
    late = [f"{step}:{n}" for step, n in schedule if planned > 0 and step >= planned]
    if not late:
        return None
    return (
        f"--ps-schedule {','.join(late)} never comes: the run has {planned:,} global steps;"
        f" give steps below {planned:,} (or more --epochs)"
    )
