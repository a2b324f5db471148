"""Worker membership as the chief sees it: incarnations, liveness, progress.

Rules of this module:

* It owns every worker state transition (absent -> alive -> done / dead -> alive
  again as a new incarnation) and knows nothing about sockets; time is passed in.
* An incarnation older than the one registered is fenced (:class:`FencedError`).
* A worker is dead when its last heartbeat is older than ``timeout``; a dead or
  done worker registering again is a new incarnation and resumes. A worker a
  restarted chief knows only from the PS (:meth:`Membership.expect`,
  :meth:`Membership.known_done`) is a member of unknown incarnation: any real one
  is asked to register.
* A worker leaving with reason "done" (or "out of data") has finished its work. Any
  other reason ("error", "terminated", "nonfinite": it stopped at a non-finite
  value, ``--on-nonfinite stop``; one this chief does not know) has not: it is gone
  (neither alive nor dead) and the job waits for it to rejoin.
* The global step of async training is the number of updates the workers have
  reported (each step's push is one update); it never goes backwards, because
  the steps of every past incarnation are kept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zmqps.wire.errors import FencedError, InvalidArgument, NotFound

__all__ = ["FINISHED_REASONS", "Membership", "WorkerState"]

#: leave reasons that finish a worker's share of the job (any other leaves it
#: unfinished: a reason a worker made up, "interrupted", counted as done and ended
#: the run without its work)
FINISHED_REASONS = frozenset({"done", "out of data"})


#: a chief restarted during the run measures the rate on what it saw when it saw
#: training for this long at least (seconds)
MEASURED_SPAN_S = 1.0

#: the incarnation of a worker the chief knows of from the PS only (it left with its
#: work done before this chief started): any real incarnation is later
UNKNOWN_INCARNATION = 0
#: what the chief's sums of the workers' counts stop at: each count is at most
#: MAX_TALLY, but incarnations add up; past this the sum says "at least" (an int64
#: every reply can carry, with room for a restored run's offset)
SUM_CAP = 2**62


def _capped(n: int) -> int:
    return min(n, SUM_CAP)


@dataclass
class WorkerState:
    index: int
    incarnation: int
    registered_at: float
    last_seen: float
    step: int = 0
    steps_before: int = 0  # steps reported by earlier incarnations
    steps_planned: int = 0
    examples: int = 0
    examples_before: int = 0
    #: ``examples_before`` as the worker's data says it (``Heartbeat.examples_before``),
    #: not counted here from what earlier incarnations or a stopped run said
    examples_exact: bool = False
    #: steps whose gradients the PS refused (not finite), this incarnation / earlier ones
    nonfinite: int = 0
    nonfinite_before: int = 0
    loss: float | None = None
    done: bool = False
    gone: bool = False  # left without finishing; expected to rejoin
    waits: bool = False  # done, and heartbeats until the run's end (Leave.waits)
    told_finished: bool = False  # heard that the run finished (a heartbeat after it)
    left_reason: str = ""

    @property
    def total_steps(self) -> int:
        return self.steps_before + self.step

    @property
    def total_examples(self) -> int:
        return self.examples_before + self.examples

    @property
    def total_nonfinite(self) -> int:
        return self.nonfinite_before + self.nonfinite


class Membership:
    def __init__(self, num_workers: int, timeout: float = 10.0) -> None:
        if num_workers < 1:
            raise InvalidArgument("a cluster needs at least one worker")
        self.num_workers = num_workers
        self.timeout = timeout
        self.workers: dict[int, WorkerState] = {}
        self.first_registration: float | None = None
        self.all_done_at: float | None = None
        #: a restarted chief: the examples and training seconds of the run before it
        #: started, as its latest checkpoint recorded them (0: a chief of the whole run)
        self.examples_carried = 0
        self.seconds_carried = 0.0
        #: a new cluster on a stopped run's checkpoint (``--resume``): the examples of
        #: one batch of that run, at its mean (0: not resumed); the batches a worker
        #: resumes after count at that rate in the run's examples until it says their
        #: examples itself (the built-in loops: exact, ``Heartbeat.examples_before``)
        self.examples_per_batch = 0.0
        #: resumed: the training seconds of the stopped run, as its checkpoint recorded
        #: them (in :meth:`train_seconds`; None: not resumed)
        self.seconds_resumed: float | None = None
        #: this chief took over a running cluster (restarted during the run)
        self.adopted = False
        #: adopted: each worker's examples as this chief first heard them (what they
        #: trained before it, whatever its checkpoint recorded): the rate is measured
        #: on what came after (:meth:`examples_per_second`)
        self._examples_when_heard: dict[int, int] = {}
        #: the sum of every worker's ``total_steps``, kept as they change (the global
        #: step of async training is read with every heartbeat: a sum over the workers
        #: there would cost O(workers) per heartbeat)
        self._steps = 0
        #: how many of ``workers`` are done, kept as they change (:meth:`all_done` is
        #: asked at every leave: a look at every worker would cost O(workers²) at the
        #: end of a run)
        self._done = 0

    def _put(self, w: WorkerState) -> None:
        """``w`` is worker ``w.index``'s state from now (the one place states are
        put, so the count of those done follows)."""
        old = self.workers.get(w.index)
        self._done += int(w.done) - int(old is not None and old.done)
        self.workers[w.index] = w

    def _set_done(self, w: WorkerState, done: bool) -> None:
        self._done += int(done) - int(w.done)
        w.done = done

    def carry(self, extra: Mapping[str, Any]) -> None:
        """This chief took over a running cluster: the run's figures so far are those
        its latest checkpoint recorded (``extra``: examples, train seconds)."""
        try:
            self.examples_carried = max(0, int(extra.get("examples") or 0))
            self.carry_seconds(float(extra.get("train_seconds") or 0.0))
        except (TypeError, ValueError):
            return  # a checkpoint that does not say: the figures count from this chief

    def carry_seconds(self, seconds: float) -> None:
        """The run had trained at least ``seconds`` before this chief started (its latest
        checkpoint, or the record of the workers that finished, said so)."""
        if math.isfinite(seconds):
            self.seconds_carried = max(self.seconds_carried, seconds, 0.0)

    def resume(self, extra: Mapping[str, Any]) -> None:
        """A new cluster goes on from a stopped run's checkpoint: the batches its workers
        resume after were trained by that run, so the run's examples and training
        seconds count them as its checkpoint recorded (``extra``): the examples of those
        batches at the mean of that run's until each worker says them exactly (a worker
        whose loop knows its data: :attr:`WorkerState.examples_exact`), so that
        examples, worker steps, the global step and the training seconds all say the
        whole run."""
        try:
            steps = sum(int(v) for v in dict(extra.get("workers") or {}).values())
            examples = int(extra.get("examples") or 0)
            seconds = float(extra.get("train_seconds") or 0.0)
        except (TypeError, ValueError):
            return  # a checkpoint that does not say: the figures count from this run
        if steps > 0 and examples > 0:
            self.examples_per_batch = examples / steps
            self.seconds_carried = self.seconds_resumed = max(0.0, seconds)

    def train_seconds(self, now: float) -> float:
        """Seconds of training: from the first registration this chief saw to the end
        (or ``now``), plus what the run had before a restarted chief took over."""
        first = self.first_registration if self.first_registration is not None else now
        return max(0.0, (self.all_done_at or now) - first) + self.seconds_carried

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_workers:
            raise InvalidArgument(f"worker index {index} out of range ({self.num_workers} workers)")

    def _current(self, index: int, incarnation: int) -> WorkerState:
        self._check_index(index)
        w = self.workers.get(index)
        if w is None:
            raise NotFound(f"worker {index} is not registered (the chief restarted?): register")
        if incarnation < w.incarnation:
            raise FencedError(
                f"worker {index} incarnation {incarnation} replaced by {w.incarnation}"
            )
        if incarnation > w.incarnation:
            if w.incarnation == UNKNOWN_INCARNATION:
                # known from the PS only (done before this chief started): it registers
                raise NotFound(f"worker {index} is not registered with this chief: register")
            raise InvalidArgument(f"worker {index} incarnation {incarnation} never registered")
        return w

    def register(self, index: int, incarnation: int, now: float, steps_planned: int = 0) -> bool:
        """Register a worker; returns True for a rejoin (a later incarnation)."""
        self._check_index(index)
        if self.first_registration is None:
            self.first_registration = now
        old = self.workers.get(index)
        if old is not None and incarnation < old.incarnation:
            raise FencedError(
                f"worker {index} incarnation {incarnation} replaced by {old.incarnation}"
            )
        if old is not None and incarnation == old.incarnation:
            old.last_seen = now  # a retried register
            return False
        w = WorkerState(index, incarnation, now, now, steps_planned=steps_planned)
        if old is not None:
            w.steps_before = old.total_steps
            w.examples_before = old.total_examples
            w.nonfinite_before = old.total_nonfinite
        self._put(w)
        self.all_done_at = None
        return old is not None

    def known_done(self, index: int, steps: int, now: float, examples: int | None = None) -> None:
        """Worker ``index`` left with its work done before this chief started (the PS
        said so), after ``steps`` batches in all, of ``examples`` examples (None: not
        known; the run's examples are then at least what its checkpoint recorded)."""
        self._check_index(index)
        if index in self.workers:
            return
        if self.first_registration is None:
            self.first_registration = now
        w = WorkerState(
            index,
            UNKNOWN_INCARNATION,
            now,
            now,
            steps_before=steps,
            examples_before=examples or 0,
            examples_exact=examples is not None,
        )
        self._steps += steps
        w.done, w.left_reason = True, "done"
        self._put(w)
        if self.all_done() and self.all_done_at is None:
            self.all_done_at = now

    def expect(self, index: int, now: float) -> bool:
        """Worker ``index`` was training before this chief started (the PS hold its
        pushes): it is a member from now, alive until ``timeout`` passes without a
        word from it, then dead like any silent worker (a step never waits on it for
        ever). Its real incarnation is asked to register when it speaks. False when
        the worker is known already."""
        self._check_index(index)
        if index in self.workers:
            return False
        if self.first_registration is None:
            self.first_registration = now
        self._put(WorkerState(index, UNKNOWN_INCARNATION, now, now))
        return True

    def await_back(self, index: int, now: float) -> None:
        """Worker ``index`` finished its work before this chief started, and the state the
        cluster goes back to lost some of it: not done any more, a member expected to
        speak (:meth:`expect`), and train those batches again, within ``timeout``."""
        self._check_index(index)
        old = self.workers.get(index)
        if old is not None:
            self._steps -= old.total_steps
            self._set_done(old, False)
            del self.workers[index]
        self.all_done_at = None
        self.expect(index, now)

    def seen(self, index: int, now: float) -> None:
        """Worker ``index`` counts as heard from at ``now`` (its ``timeout`` starts again)."""
        w = self.workers.get(index)
        if w is not None:
            w.last_seen = max(w.last_seen, now)

    def heartbeat(
        self,
        index: int,
        incarnation: int,
        step: int,
        now: float,
        loss: float | None = None,
        examples: int | None = None,
        nonfinite: int | None = None,
        examples_before: int | None = None,
    ) -> None:
        w = self._current(index, incarnation)
        w.last_seen = now
        if step > w.step:
            self._steps += step - w.step
            w.step = step
        if examples_before is not None:
            # the examples of the batches it resumed after, as its data says them:
            # exact, where the chief's count of them was at a mean
            w.examples_before, w.examples_exact = examples_before, True
        if examples is not None:
            w.examples = max(w.examples, examples)
        if self.adopted and index not in self._examples_when_heard:
            self._examples_when_heard[index] = w.total_examples
        if nonfinite is not None:
            w.nonfinite = max(w.nonfinite, nonfinite)
        if loss is not None:
            w.loss = loss

    def leave(
        self,
        index: int,
        incarnation: int,
        step: int,
        now: float,
        reason: str,
        examples: int | None,
        waits: bool = False,
        nonfinite: int | None = None,
        examples_before: int | None = None,
    ) -> None:
        self.heartbeat(
            index,
            incarnation,
            step,
            now,
            examples=examples,
            nonfinite=nonfinite,
            examples_before=examples_before,
        )
        w = self.workers[index]
        w.left_reason = reason
        unfinished = reason not in FINISHED_REASONS
        w.waits = waits and not unfinished
        if unfinished:
            w.gone = True
            return
        self._set_done(w, True)
        if self.all_done() and self.all_done_at is None:
            self.all_done_at = now

    def reopen(self, index: int, now: float) -> bool:
        """Worker ``index``, done and still heard from (it waits for the run's end), must
        train again (a restore took its last batches back): it is a member at work
        again. False (nothing changed) if it is not done or no longer heard from."""
        w = self.workers.get(index)
        if w is None or not w.done or not w.waits or now - w.last_seen > self.timeout:
            return False
        self._set_done(w, False)
        w.waits, w.left_reason, w.last_seen = False, "", now
        self.all_done_at = None
        return True

    def waiting(self, now: float) -> list[int]:
        """Workers done that wait for the run's end, still heard from, and not yet told
        it finished (the chief stays until they are, briefly)."""
        return sorted(
            i
            for i, w in self.workers.items()
            if w.done and w.waits and not w.told_finished and now - w.last_seen <= self.timeout
        )

    def alive(self, now: float) -> list[int]:
        return sorted(
            i
            for i, w in self.workers.items()
            if not (w.done or w.gone) and now - w.last_seen <= self.timeout
        )

    def dead(self, now: float) -> list[int]:
        return sorted(
            i
            for i, w in self.workers.items()
            if not (w.done or w.gone) and now - w.last_seen > self.timeout
        )

    def lapsed(self, now: float) -> list[int]:
        """Workers that left unfinished (expected back) more than ``timeout`` ago and
        have not registered again."""
        return sorted(
            i
            for i, w in self.workers.items()
            if w.gone and not w.done and now - w.last_seen > self.timeout
        )

    def all_done(self) -> bool:
        """Every worker of the cluster registered (or is known) and is done: O(1)."""
        return len(self.workers) == self.num_workers and self._done == self.num_workers

    def set_steps_before(self, index: int, steps: int) -> None:
        """The batches worker ``index``'s earlier incarnations pushed, as the PS know
        them (its heartbeats lag)."""
        w = self.workers[index]
        heard = w.steps_before
        if w.examples_exact:
            pass  # the worker said the examples of the batches it resumed after
        elif heard == 0 and steps > 0 and self.examples_per_batch and not w.examples_before:
            # resumed after the batches of a stopped run (:meth:`resume`)
            w.examples_before = round(steps * self.examples_per_batch)
        elif steps > heard > 0:
            # the batches pushed after the last heartbeat heard (a worker killed): their
            # examples at the mean of those heard (a SIGKILLed worker's last seconds
            # were missing from the run's examples, 4,905 of 172,560)
            w.examples_before += round((steps - heard) * w.examples_before / heard)
        self._steps += steps - heard
        w.steps_before = steps

    @property
    def global_step(self) -> int:
        return _capped(self._steps)

    @property
    def examples(self) -> int:
        """Examples trained: as the workers said, at least what a restarted chief's
        checkpoint recorded (workers that finished before it started say nothing)."""
        return _capped(
            max(sum(w.total_examples for w in self.workers.values()), self.examples_carried)
        )

    def examples_per_second(self, now: float) -> float | None:
        """The run's training rate. A chief that took over a running cluster measures it
        on what it saw: the examples trained since it first heard each worker, over the
        seconds since the first registration it saw (the workers' examples cover the
        whole run, its seconds only its own and those its checkpoint recorded: after a
        restart with no checkpoint yet the rate read 3 to 18 times too high)."""
        if self.adopted:
            first = self.first_registration if self.first_registration is not None else now
            span = (self.all_done_at or now) - first
            seen = sum(
                max(0, w.total_examples - self._examples_when_heard.get(i, w.total_examples))
                for i, w in self.workers.items()
            )
            if seen > 0 and span >= MEASURED_SPAN_S:
                return seen / span
            # it saw too little training to measure (the workers were done, or nearly,
            # when it started: it said 0.0): the run's examples over its seconds as its
            # checkpoint and the record of the workers that finished said them; None
            # (not known: 0.0 would say the run trained nothing) when neither said any
            if self.seconds_carried <= 0:
                return None
        seconds = self.train_seconds(now)
        return self.examples / seconds if seconds >= 1e-3 else 0.0

    @property
    def nonfinite(self) -> int:
        """Steps whose gradients the PS refused (not finite), every worker's."""
        return _capped(sum(w.total_nonfinite for w in self.workers.values()))

    @property
    def steps_planned(self) -> int:
        return _capped(sum(w.steps_planned for w in self.workers.values()))

    @property
    def max_steps_planned(self) -> int:
        return max((w.steps_planned for w in self.workers.values()), default=0)

    def _state(self, w: WorkerState, now: float) -> str:
        if w.done:
            return "done"
        if w.gone:
            return "left"
        return "alive" if now - w.last_seen <= self.timeout else "dead"

    def snapshot(self, now: float) -> list[dict[str, Any]]:
        return [
            {
                "index": w.index,
                "incarnation": w.incarnation,
                "step": w.total_steps,
                "loss": w.loss,
                "state": self._state(w, now),
                "last_seen_s": round(now - w.last_seen, 3),
            }
            for w in sorted(self.workers.values(), key=lambda w: w.index)
        ]
