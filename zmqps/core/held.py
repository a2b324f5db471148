"""The examples of the batches of one worker incarnation that hold.

A worker counts the examples of each step it pushes. A restore that goes back to a
checkpoint takes the later batches back and the worker trains them again: counted at
each push, their examples were counted twice in the run's summary. This ledger keeps
the examples of each batch position (the batch's index in the worker's data) that
this incarnation pushed, so that going back subtracts exactly what those batches
counted.

Rules of this module:

* Positions are those of the worker's data (``Worker.position``): the ledger starts
  at the position the incarnation resumed after, and :meth:`HeldExamples.add` records
  one batch at a position; a position before the end goes back there first.
* Runs of equal counts are kept as one (the built-in loops' batches are one size
  but each epoch's last): a run of a whole training is a few entries per epoch.
  Past :data:`MAX_RUNS` runs (a loop whose every batch differs), the oldest half is
  merged into one run of their sum: going back into it counts its batches at their
  mean (the one case that is not exact).
* Nothing here knows the batches of an earlier incarnation: going back before
  :attr:`HeldExamples.start` empties the ledger and counts from there.
"""

from __future__ import annotations

__all__ = ["MAX_RUNS", "HeldExamples"]

#: runs kept before the oldest half are merged (a run is four ints)
MAX_RUNS = 1 << 14


class HeldExamples:
    def __init__(self, start: int = 0) -> None:
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        #: the first position recorded (where the incarnation resumed)
        self.start = start
        #: [first position, batches, examples in all, examples of each (-1: merged)]
        self._runs: list[list[int]] = []
        #: the examples of the positions recorded, ``start`` to :attr:`end`
        self.total = 0
        #: True once a merged run was gone back into (the total is an estimate)
        self.estimated = False

    @property
    def end(self) -> int:
        """The position after the last one recorded."""
        if not self._runs:
            return self.start
        first, count, _, _ = self._runs[-1]
        return first + count

    def add(self, position: int, examples: int) -> None:
        """The batch at ``position`` was pushed with ``examples`` examples."""
        if examples < 0 or position < 0:
            raise ValueError(f"a batch at {position} of {examples} examples")
        if position < self.end:
            self.back(position)
        elif position > self.end:
            self._skip(position)
        runs = self._runs
        if runs and runs[-1][3] == examples:
            runs[-1][1] += 1
            runs[-1][2] += examples
        else:
            runs.append([position, 1, examples, examples])
            if len(runs) > MAX_RUNS:
                self._merge()
        self.total += examples

    def back(self, position: int) -> None:
        """A restore went back to ``position``: the batches from there on no longer
        hold (they are trained again)."""
        if position <= self.start:
            self.start, self._runs, self.total = max(0, position), [], 0
            return
        runs = self._runs
        while runs and runs[-1][0] >= position:
            self.total -= runs.pop()[2]
        if runs and position < runs[-1][0] + runs[-1][1]:
            first, count, total, each = runs[-1]
            keep = position - first
            if each >= 0:
                kept = keep * each
            else:
                kept = round(total * keep / count)
                self.estimated = True
            runs[-1] = [first, keep, kept, each]
            self.total -= total - kept

    def _skip(self, position: int) -> None:
        """A restore's checkpoint holds batches past those recorded (this incarnation
        did not see their pushes acknowledged): counted at the last batch's size."""
        each = self._runs[-1][3] if self._runs and self._runs[-1][3] >= 0 else 0
        end, gap = self.end, position - self.end
        self._runs.append([end, gap, gap * each, -1])
        self.total += gap * each
        self.estimated = self.estimated or bool(gap)

    def _merge(self) -> None:
        half = len(self._runs) // 2
        old = self._runs[:half]
        count = sum(r[1] for r in old)
        total = sum(r[2] for r in old)
        self._runs[:half] = [[old[0][0], count, total, -1]]
