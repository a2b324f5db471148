"""When the chief takes checkpoints: at sync step boundaries, on a schedule, at the end.

Rules of this module:

* sync: at a step boundary, before the step's tokens are out (the PS are idle, so a
  snapshot is one step everywhere; :meth:`Checkpointer.snapshot_sync` refuses one
  that is not). async / ssp: every N global steps or T seconds, per shard with its
  version. At the end (every worker done, or a shutdown): one more if anything
  changed. On request (the ``checkpoint`` op): now (async) or at the next boundary.
  Requests that arrive while one is taken share the next one (a burst of them takes
  at most two, not one each), and its step is read when its snapshot is taken.
* No checkpoint is taken while the cluster recovers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from zmqps.checkpoint import Checkpoint
from zmqps.roles.checkpointer import Checkpointer
from zmqps.wire.errors import InvalidArgument, NotReady

if TYPE_CHECKING:
    from zmqps.roles.chief.service import ChiefService

__all__ = ["ChiefCheckpoints"]

log = logging.getLogger("zmqps.chief")


class ChiefCheckpoints:
    def __init__(self, checkpointer: Checkpointer, chief: ChiefService) -> None:
        self.ck = checkpointer
        self.chief = chief
        #: async / ssp: the requested checkpoint not yet begun, which every request
        #: arriving meanwhile waits for (None: the next request starts one)
        self._next: asyncio.Future[Checkpoint | None] | None = None

    @property
    def sync(self) -> bool:
        return self.chief.consistency.name == "sync"

    def _extra(self, final: bool = False) -> dict[str, Any]:
        members = self.chief.members
        extra: dict[str, Any] = {
            "global_step": self.chief.global_step,
            "workers": {str(w.index): w.total_steps for w in members.workers.values()},
            "examples": members.examples,
            "train_seconds": round(members.train_seconds(self.chief.clock()), 3),
        }
        if not self.sync:
            # the global step counted before this run's workers' pushes (the runs its
            # checkpoint went on from): with the cursors, the global step its values
            # hold (a resumed run starts there, not at the step heard in heartbeats)
            extra["step_offset"] = self.chief.consistency.step_offset
        job = self.chief.cfg.job
        if job is not None:
            # what each worker's batch cursors mean: its part of the data (of how many
            # workers), batches of what size, in which order; a resumed run must match
            extra["data"] = {
                "workers": members.num_workers,
                "dataset": job.dataset,
                "batch_size": job.batch_size,
                "seed": job.seed,
                **({"examples": job.examples} if job.is_ctr else {}),
            }
            # the model its variables are of: a resumed run must train the same one
            extra["model"] = job.definition()
        # what its variables travel as: a resumed run's must be the same (they are part
        # of the variables' definitions the PS hold)
        extra["wire_dtype"] = self.chief.cfg.wire_dtype or "float32"
        placement = self.chief.variables.placement
        if placement is not None:
            # the processes that serve the run (a scale-down drains the others): a chief
            # started when no running process heard where the states are waits for these
            extra["serving"] = sorted({q for s in placement.shards for q in s.copies})
        if final:  # every worker finished: a lone evaluator ends after this one
            extra["final"] = True
        return extra

    def _write(self, snap: Any, final: bool = False) -> None:
        placement = self.chief.variables.placement
        assert placement is not None
        gen = self.chief.recovery.gen
        self.ck.write(snap, placement, self.chief.consistency.name, gen, self._extra(final))

    def due_at(self, step: int) -> bool:
        """sync: whether :meth:`at_boundary` would take a checkpoint at ``step`` if it
        came now (a boundary without one may be released by the PS itself)."""
        return self.chief.variables.placement is not None and self.ck.due(step)

    def planned_at(self, step: int) -> bool:
        """sync: whether a checkpoint will be due at ``step`` as planned now (a run of
        steps the PS releases by itself ends before the first such step)."""
        return self.chief.variables.placement is not None and self.ck.planned(step)

    async def at_boundary(self, step: int) -> None:
        """sync: called with every new global step, before its tokens are put."""
        placement = self.chief.variables.placement
        if placement is None or not self.ck.due(step):
            return
        snap = await self.ck.snapshot_sync(step, placement)
        if snap is not None:
            self._write(snap)

    async def schedule(self) -> None:
        """async / ssp: checkpoint every N global steps or T seconds (until cancelled)."""
        while True:
            await asyncio.sleep(0.2)
            step = self.chief.global_step
            placement = self.chief.variables.placement
            if placement is not None and self.chief.recovery.training and self.ck.due(step):
                snap = await self.ck.snapshot(step, placement)
                if snap is not None:
                    self._write(snap)

    async def final(self, finished: bool = False) -> Checkpoint | None:
        """At the end: one more checkpoint if anything changed since the last
        (``finished``: every worker did its work; the manifest says so)."""
        placement = self.chief.variables.placement
        if placement is None or self.chief.recovery.recovering:
            return None
        await self.ck.wait()
        mode = self.chief.consistency
        step = await mode.applied_step() if self.sync else mode.global_step
        if step <= self.ck.last_step and not self._unmarked_end(step, finished):
            return None
        if self.sync:
            snap = await self.ck.snapshot_sync(step, placement)
            if snap is None:
                log.warning(
                    "final checkpoint skipped: a step was cut short; %s stays the latest",
                    self.ck.last_committed.name if self.ck.last_committed else "nothing",
                )
                return None
            self._write(snap, finished)
            return await self.ck.wait_committed()
        return await self.ck.take(
            step, placement, mode.name, self.chief.recovery.gen, self._extra(finished)
        )

    def _unmarked_end(self, step: int, finished: bool) -> bool:
        """The run finished and its last checkpoint, of this very step, does not say so:
        the schedule took it as the last pushes landed, just before the end. It is
        taken again as the final one (the same step: the commit replaces it), else a
        resume would take the finished run for one cut short, its workers' cursors
        past the epochs asked for, and train nothing."""
        last = self.ck.last_committed
        return finished and last is not None and last.step == step and not last.final

    async def now(self, wait: float) -> Checkpoint:
        """The ``checkpoint`` op: one now (async, ssp) or at the next boundary (sync)."""
        placement = self.chief.variables.placement
        if placement is None:
            raise NotReady("no variables yet")
        ck = self.ck
        if not self.sync:
            if self._next is None:
                self._next = asyncio.ensure_future(self._requested())
            ckpt = await asyncio.shield(self._next)
        else:  # at the next step boundary
            before, ck.forced = ck.committed + ck.failed, True
            deadline = self.chief.clock() + wait
            while ck.committed + ck.failed == before or ck.busy:
                if self.chief.clock() > deadline:
                    raise NotReady("no step boundary came in time for a checkpoint")
                await asyncio.sleep(0.05)
            ckpt = ck.last_committed if ck.committed + ck.failed > before else None
        if ckpt is None:
            recovery = self.chief.recovery
            if ck.last_transient or recovery.recovering or recovery.ps_down:
                # a PS restarted or is cut off: the cluster is being recovered, and the
                # caller may ask again once it is (NotReady: try later)
                raise NotReady(f"checkpoint failed while the cluster recovers: {ck.last_error}")
            raise InvalidArgument(f"checkpoint failed: {ck.last_error}")
        return ckpt

    async def _requested(self) -> Checkpoint | None:
        """The checkpoint requests wait for: its snapshot taken after every request
        that waits for it arrived (the step read then), its commit waited for."""
        placement = self.chief.variables.placement
        assert placement is not None
        try:
            return await self.ck.take(
                self._begun,
                placement,
                self.chief.consistency.name,
                self.chief.recovery.gen,
                self._extra,
            )
        finally:
            if self._next is not None and self._next.done():
                self._next = None

    def _begun(self) -> int:
        """The step of a requested checkpoint, read as its snapshot is taken: requests
        from now on wait for the next one."""
        self._next = None
        return self.chief.global_step
