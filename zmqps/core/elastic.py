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
* :func:`plan_homes` moves every state off a process that leaves, and otherwise moves
  a state only when that narrows the gap between the most and the least loaded
  process (loads are bytes); it stops once no single move would. So the bytes moved
  are those the leaving processes held plus what balance needs, and afterwards the
  loads differ by less than the smallest state on the most loaded process (within
  one state's bytes). Ties go to a state's own process (state ``i`` started on
  process ``i``), then to the lower index: a state that left comes home when its
  process is back.
* Bad arguments raise :class:`~zmqps.wire.errors.InvalidArgument`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zmqps.wire.errors import InvalidArgument

__all__ = ["Move", "moves", "parse_schedule", "plan_homes"]


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
    """
    serving = sorted(set(processes))
    if not serving:
        raise InvalidArgument("at least one PS must serve the states")
    if set(sizes) != set(homes):
        raise InvalidArgument("every state needs its size and its home")
    if any(n < 0 for n in sizes.values()):
        raise InvalidArgument("a state's size cannot be negative")
    out: dict[int, int] = {}
    loads = dict.fromkeys(serving, 0)
    leaving = []
    for state in sorted(sizes):
        if homes[state] in loads:
            out[state] = homes[state]
            loads[homes[state]] += sizes[state]
        else:
            leaving.append(state)
    # the states of leaving processes: largest first, each onto the least loaded
    for state in sorted(leaving, key=lambda s: (-sizes[s], s)):
        target = min(serving, key=lambda p: (loads[p], p != state, p))
        out[state] = target
        loads[target] += sizes[state]
    # then narrow the gap while one move does
    while True:
        most = max(serving, key=lambda p: (loads[p], -p))
        least = min(serving, key=lambda p: (loads[p], p))
        gap = loads[most] - loads[least]
        movable = [s for s, p in out.items() if p == most and 0 < sizes[s] < gap]
        if not movable:
            return out
        # the move that leaves the two closest; then one going home; then the smaller
        state = min(movable, key=lambda s: (abs(gap - 2 * sizes[s]), s != least, sizes[s], s))
        out[state] = least
        loads[most] -= sizes[state]
        loads[least] += sizes[state]


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
