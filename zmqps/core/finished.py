"""Workers that finished their work, as a restarted chief must know them (sans-IO).

Rules of this module:

* A worker that left with its work done is a :class:`Finished`: the batches it did
  (``steps``), the generation the cluster was in then (``gen``) and the examples of
  its batches (a chief restarted after it left counts them in the run's examples). The chief keeps
  every such worker in a small record beside the run's checkpoints (or its summary),
  written at each change, before the worker's leave is answered: a chief started
  again after the PS lost their state (no copy) still knows who finished, where the
  PS no longer say it. :func:`record_bytes` / :func:`parse_record` are its format
  (JSON, never pickle: the record is read, not trusted).
* :func:`work_lost`: from the workers that finished and what the state the cluster
  goes back to holds (a checkpoint's batch cursors, or nothing: the initial values),
  the workers whose batches are not all in it. Those batches cannot be trained again
  (their workers left), so the run cannot end truthfully: :func:`lost_verdict` is the
  one line it fails with, unless they are still running (waiting for the run's
  end): a chief awaits them to train those batches again, and the record keeps each
  one it awaits with the batches the cluster still holds of it (``held``), so that a
  chief started after that one awaits it too.
* A run's final checkpoint holds the work of every worker that finished before it
  (in its generation or an earlier one); another checkpoint holds what its cursors say.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RECORD_FORMAT",
    "RECORD_NAME",
    "SUMMARY_SUFFIX",
    "Finished",
    "Held",
    "lost_verdict",
    "parse_record",
    "record_bytes",
    "work_lost",
]

#: the record's name in a checkpoint directory
RECORD_NAME = "workers-done.json"
#: what the record's name is, beside a summary, for a run without checkpoints
SUMMARY_SUFFIX = ".workers-done.json"
#: what the record says it is (a file of another kind is not taken for one)
RECORD_FORMAT = "zmqps-workers-done"
RECORD_VERSION = 1
#: the largest worker index and count a record may hold (an int64 on the wire)
_MAX = 2**63 - 1


@dataclass(frozen=True)
class Finished:
    """A worker that left with its work done: after ``steps`` batches, the cluster in
    generation ``gen``; ``examples``: those of its batches, as it said them, and the
    run's training ``seconds`` then (None: a record that does not say)."""

    steps: int
    gen: int = 0
    examples: int | None = None
    #: the run's training seconds when it finished, as the chief measured them (None:
    #: a record that does not say)
    seconds: float | None = None
    #: awaited to train again the batches after these (the cluster lost them since it
    #: finished); None: its work stands
    held: int | None = None


@dataclass(frozen=True)
class Held:
    """What the state a cluster goes back to holds: a committed checkpoint (``name``,
    its ``step``, batch ``cursors`` per worker name, None when it does not say, whether
    it is the run's ``final`` one, its generation ``gen``), or, ``name`` None, the
    initial values (no batch of any worker)."""

    name: str | None = None
    step: int = 0
    cursors: Mapping[str, int] | None = None
    final: bool = False
    gen: int = 0


def record_bytes(finished: Mapping[int, Finished]) -> bytes:
    """The record of ``finished`` (worker index -> what it did) as the file holds it."""
    workers: dict[str, dict[str, float]] = {}
    for i, f in sorted(finished.items()):
        workers[str(i)] = {"steps": f.steps, "gen": f.gen}
        if f.examples is not None:
            workers[str(i)]["examples"] = f.examples
        if f.seconds is not None:
            workers[str(i)]["seconds"] = f.seconds
        if f.held is not None:
            workers[str(i)]["held"] = f.held
    body = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "workers": workers}
    return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX:
        raise ValueError(f"{what} is not a count: {value!r}")
    return value


def _seconds(value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"seconds is not a duration: {value!r}")
    return float(value)


def parse_record(raw: bytes) -> dict[int, Finished]:
    """The workers a record holds; ValueError for anything that is not such a record."""
    try:
        body = json.loads(raw.decode())
    except UnicodeDecodeError as exc:
        raise ValueError(f"not text: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != RECORD_FORMAT:
        raise ValueError(f"not a {RECORD_FORMAT} record")
    if body.get("version") != RECORD_VERSION:
        raise ValueError(f"version {body.get('version')!r}, this one reads {RECORD_VERSION}")
    workers = body.get("workers")
    if not isinstance(workers, dict):
        raise ValueError("no map of workers")
    out: dict[int, Finished] = {}
    for key, rec in workers.items():
        if not isinstance(key, str) or not key.isdigit() or len(key) > 19:
            raise ValueError(f"worker {key!r} is not an index")
        if not isinstance(rec, dict):
            raise ValueError(f"worker {key}: not a map")
        index = _count(int(key), "a worker index")
        examples, seconds, held = rec.get("examples"), rec.get("seconds"), rec.get("held")
        out[index] = Finished(
            _count(rec.get("steps"), "steps"),
            _count(rec.get("gen", 0), "gen"),
            None if examples is None else _count(examples, "examples"),
            None if seconds is None else _seconds(seconds),
            None if held is None else _count(held, "held"),
        )
    return out


def work_lost(finished: Mapping[int, Finished], held: Held) -> dict[int, tuple[int, int]]:
    """The workers of ``finished`` whose batches ``held`` does not all hold: index ->
    (batches held, batches it did). A final checkpoint of a generation at or past the
    one a worker finished in holds all of it (it was taken once every worker was
    done); a checkpoint that does not say its cursors holds none that can be shown."""
    out: dict[int, tuple[int, int]] = {}
    for index, done in sorted(finished.items()):
        if done.steps <= 0:
            continue
        if held.name is not None and held.final and held.gen >= done.gen:
            continue
        have = 0
        if held.name is not None and not held.final and held.cursors is not None:
            have = held.cursors.get(f"worker:{index}", 0)
        if have < done.steps:
            out[index] = (have, done.steps)
    return out


def _workers(indices: list[int]) -> str:
    if len(indices) == 1:
        return f"worker {indices[0]}"
    if len(indices) <= 8:
        return f"workers {', '.join(map(str, indices))}"
    return f"{len(indices)} workers ({indices[0]} .. {indices[-1]})"


def lost_verdict(lost: Mapping[int, tuple[int, int]], held: Held, how: str) -> str:
    """The one line a run whose finished work was ``lost`` fails with; ``how``: how the
    PS state that held it was lost."""
    who = sorted(lost)
    did = sum(steps for _, steps in lost.values())
    kept = sum(have for have, _ in lost.values())
    head = (
        f"the run cannot finish: {_workers(who)} finished {'its' if len(who) == 1 else 'their'}"
        f" work ({did} batches) and left, but {how}"
    )
    if held.name is None:
        return f"{head}, and no checkpoint was committed: that training is lost; train again"
    return (
        f"{head}, and the latest checkpoint {held.name} (step {held.step}) holds {kept} of"
        f" those {did} batches: go on from it (zmqps launch --resume) to train the"
        f" other {did - kept} again"
    )
