"""The chief's side of checkpoints: when to take one, how the PS write it, the commit.

Rules of this module:

* Every PS writes its own shards into the shared checkpoint root (DESIGN §6); the
  chief makes the temporary directory, asks every PS that holds shards to snapshot
  (``checkpoint_save``: a copy in memory, so training goes on at once) and to write
  (``checkpoint_done``), then commits the manifest last
  (:meth:`zmqps.checkpoint.CheckpointRoot.commit`: atomic rename, then ``LATEST``).
  A failure anywhere aborts the temporary directory: the previous checkpoint stays
  the latest, and the failure is logged and counted.
* Sync mode takes the snapshot at a step boundary (the chief holds the next step's
  tokens back until every PS has its copy), so all shards are at one step. Async
  and SSP record each shard's version in the manifest.
* One checkpoint at a time; a trigger that comes while one is being written waits
  for the next one.
* Which checkpoint to restore is the newest one that verifies (sha256 of every
  file); broken ones are skipped with a warning.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zmqps.checkpoint import Checkpoint, CheckpointError, CheckpointRoot, Manifest, ShardRecord
from zmqps.core.variables import Placement
from zmqps.metrics import Metrics
from zmqps.roles.configs import CheckpointPolicy
from zmqps.transport import Requester
from zmqps.transport.base import cancel_and_wait
from zmqps.wire import ops as o
from zmqps.wire.errors import (
    DeadlineExceeded,
    NotFound,
    NotReady,
    RolledBack,
    ShutdownError,
    ZmqpsError,
)

__all__ = ["CheckpointPolicy", "Checkpointer", "Snapshot"]

log = logging.getLogger("zmqps.chief")


#: the wait before the policy's next checkpoint after a failed one (seconds), doubling
#: from the first to the second while they keep failing
RETRY_MIN_S = 0.5
RETRY_MAX_S = 8.0


@dataclass
class Snapshot:
    """A checkpoint whose shards every PS has copied, being written."""

    step: int
    temp: Path
    save_id: int
    holders: list[int]
    versions: dict[int, int]
    started: float
    #: the sync step each holder reported when it copied its shards
    steps: dict[int, int]
    #: per worker, the highest batch cursor whose gradient some holder's copy holds
    #: (None: a PS did not say); stored in the manifest's ``extra["cursors"]``
    cursors: dict[str, int] | None = None


class Checkpointer:
    def __init__(
        self,
        policy: CheckpointPolicy,
        ps: Sequence[Requester],
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.root = CheckpointRoot(policy.directory, keep=policy.keep)
        self.ps = list(ps)
        self.metrics = metrics
        self.clock = clock
        self.last_step = 0
        self.last_time = clock()
        self.last_committed: Checkpoint | None = None
        self.committed = 0
        self.failed = 0
        self.last_error = ""
        #: the last failure came from the cluster's state (a PS restarting, cut off, a
        #: restore): the same checkpoint may succeed once the cluster has recovered
        self.last_transient = False
        self._ids = itertools.count(int(time.time() * 1000) % (1 << 40))
        self._writing: asyncio.Task[Checkpoint | None] | None = None
        #: one ``take`` at a time: callers that come together (the policy's trigger, a
        #: ``checkpoint`` request) would otherwise snapshot and commit side by side
        self._taking = asyncio.Lock()
        #: take one at the next chance whatever the policy says (``checkpoint`` op)
        self.forced = False
        #: after a failure the policy's next one waits this long (doubling while they
        #: fail, at most RETRY_MAX_S; none after a success): a cluster that cannot be
        #: checkpointed is not asked again five times a second, nor its log flooded
        self._backoff = 0.0
        self._retry_at = 0.0

    # ------------------------------------------------------------ start

    def clean(self) -> list[str]:
        removed = self.root.clean_orphans()
        if removed:
            log.info("checkpoints: removed %d orphaned temporary files", len(removed))
        return removed

    def latest(self) -> Checkpoint | None:
        ckpt = self.root.latest(verify=True)
        for _ in self.root.skipped:  # each logged by latest()
            if self.metrics is not None:
                self.metrics.checkpoints.labels("failed").inc()
        if ckpt is not None:
            self.last_step = ckpt.step
            self.last_committed = ckpt
        return ckpt

    # ------------------------------------------------------------ taking one

    @property
    def busy(self) -> bool:
        return self._writing is not None and not self._writing.done()

    def due(self, step: int) -> bool:
        if self.busy:
            return False
        return self.planned(step)

    def planned(self, step: int) -> bool:
        """Whether one is due at ``step`` as things stand, the one being written (if
        any) done by then: from a step on, every later one is due too (sync: a run of
        steps the PS releases by itself ends before the first)."""
        if self.forced and step > self.last_step:
            return True
        now = self.clock()
        return now >= self._retry_at and self.policy.due(step, self.last_step, self.last_time, now)

    async def cancel(self) -> None:
        """Give up the checkpoint being written (a PS was lost): its directory is removed."""
        task, self._writing = self._writing, None
        if task is not None and not task.done():
            await cancel_and_wait(task)

    async def snapshot(self, step: int, placement: Placement) -> Snapshot | None:
        """Ask every PS holding shards to copy them now (fast); None if that failed."""
        holders = sorted({s.state for s in placement.shards})  # PS states
        temp = self.root.new_temp(step)
        save_id = next(self._ids)
        started = self.clock()
        body = o.CheckpointSave(temp.name, save_id).to_wire()
        try:
            reps = await asyncio.gather(
                # attempts=2: a save is idempotent by its id on the PS, so the request is
                # sent again as soon as a cut-off connection comes back (else the
                # checkpoint waited out its 30 s deadline after the partition healed);
                # two attempts of 15 s keep the 30 s a dead PS is given
                *(
                    self.ps[i].request("checkpoint_save", body, timeout=15.0, attempts=2)
                    for i in holders
                )
            )
            saved = [o.Saved.parse(r.body) for r in reps]
        except ZmqpsError as e:
            self._failed(temp, step, f"snapshot: {e}", transient=_transient(e))
            return None
        versions = {int(sid): int(v) for s in saved for sid, v in s.versions}
        steps = {i: s.step for i, s in zip(holders, saved, strict=True)}
        return Snapshot(step, temp, save_id, holders, versions, started, steps, _cursors(saved))

    async def snapshot_sync(self, step: int, placement: Placement) -> Snapshot | None:
        """Sync: a snapshot of ``step`` that every PS holding shards copied at that very
        step (else None, and nothing is written: a checkpoint is one step everywhere)."""
        snap = await self.snapshot(step, placement)
        if snap is not None and set(snap.steps.values()) != {step}:
            self._failed(
                snap.temp, step, f"the PS were at steps {sorted(set(snap.steps.values()))}"
            )
            return None
        return snap

    def write(
        self,
        snap: Snapshot,
        placement: Placement,
        mode: str,
        generation: int,
        extra: Mapping[str, Any],
    ) -> asyncio.Task[Checkpoint | None]:
        """Wait for every PS to write its files, then commit (in the background)."""
        self.last_step, self.last_time = snap.step, self.clock()
        self.forced = False
        self._writing = asyncio.ensure_future(
            self._finish(snap, placement, mode, generation, dict(extra), self._writing)
        )
        return self._writing

    async def take(
        self,
        step: int | Callable[[], int],
        placement: Placement,
        mode: str,
        generation: int,
        extra: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    ) -> Checkpoint | None:
        """Snapshot and write one checkpoint; wait for its commit. ``step`` and
        ``extra`` may be functions: read when the snapshot is taken (after the take and
        the write before this one), so the manifest names the step its values are of,
        not the step the caller asked at."""
        async with self._taking:
            if self._writing is not None:
                await asyncio.wait([self._writing])  # its outcome is its own caller's
            at = step() if callable(step) else step
            snap = await self.snapshot(at, placement)
            if snap is None:
                return None
            figures = extra() if callable(extra) else extra
            return await self.write(snap, placement, mode, generation, figures)

    async def wait(self) -> None:
        if self._writing is not None:
            await asyncio.shield(self._writing)

    async def wait_committed(self) -> Checkpoint | None:
        """The checkpoint being written, once committed (None: it failed, or none)."""
        if self._writing is None:
            return None
        return await asyncio.shield(self._writing)

    async def _done(self, ps: int, save_id: int, deadline: float) -> list[dict[str, Any]]:
        while True:
            left = deadline - self.clock()
            if left <= 0:
                raise NotReady(f"ps {ps} did not finish writing its shards in time")
            try:
                rep = await self.ps[ps].request(
                    "checkpoint_done",
                    {"id": save_id, "wait": min(5.0, left)},
                    timeout=min(5.0, left) + 5.0,
                    attempts=2,  # a wait: sent again at once over a new connection
                )
            except NotReady:
                continue
            return list(rep.body["shards"])

    async def _finish(
        self,
        snap: Snapshot,
        placement: Placement,
        mode: str,
        generation: int,
        extra: dict[str, Any],
        previous: asyncio.Task[Checkpoint | None] | None,
    ) -> Checkpoint | None:
        deadline = self.clock() + 600.0
        cancelled = True
        try:
            per_ps = await asyncio.gather(
                *(self._done(i, snap.save_id, deadline) for i in snap.holders)
            )
            if previous is not None:  # commits in the order of their snapshots, one at a time
                await asyncio.wait([previous])
            records = [ShardRecord.from_json(r) for rs in per_ps for r in rs]
            if snap.cursors is not None:
                extra["cursors"] = snap.cursors
            manifest = Manifest(
                format_version=1,
                step=snap.step,
                generation=generation,
                mode=mode,
                created=time.time(),
                variables=[v.to_wire() for v in placement.variables],
                optimizer=dict(placement.optimizer),
                num_ps=len(self.ps),
                shards=records,
                extra=extra,
            )
            ckpt = await asyncio.to_thread(self.root.commit, snap.temp, manifest)
            cancelled = False
        except (ZmqpsError, OSError) as e:
            cancelled = False
            self._failed(snap.temp, snap.step, str(e), transient=_transient(e))
            return None
        finally:
            if cancelled:
                self._failed(snap.temp, snap.step, "cancelled (a PS was lost)", transient=True)
        seconds = self.clock() - snap.started
        self.committed += 1
        self.last_committed = ckpt
        self._backoff = self._retry_at = 0.0
        if self.metrics is not None:
            self.metrics.checkpoints.labels("committed").inc()
            self.metrics.checkpoint_duration.observe(seconds)
            self.metrics.checkpoint_last_step.set(snap.step)
        log.info("checkpoint %s committed in %.2fs", ckpt.name, seconds)
        return ckpt

    def _failed(self, temp: Path, step: int, why: str, transient: bool = False) -> None:
        self.failed += 1
        self.last_error, self.last_transient = why, transient
        self._backoff = min(RETRY_MAX_S, max(RETRY_MIN_S, 2 * self._backoff))
        self._retry_at = self.clock() + self._backoff
        if self.metrics is not None:
            self.metrics.checkpoints.labels("failed").inc()
        log.error(
            "checkpoint of step %d failed: %s (%s)",
            step,
            why,
            "the previous one stays the latest"
            if self.last_committed is not None
            else "none is committed yet",
        )
        try:
            self.root.abort(temp)
        except (OSError, CheckpointError) as e:  # the next start's clean_orphans will
            log.warning("could not remove %s: %s", temp, e)

    def status(self) -> dict[str, Any]:
        last = self.last_committed
        return {
            "directory": str(self.policy.directory),
            "committed": self.committed,
            "failed": self.failed,
            "last": None if last is None else last.name,
            "last_step": None if last is None else last.step,
            "last_error": self.last_error,
            "writing": self.busy,
        }


def _transient(exc: BaseException) -> bool:
    """A failure that says the cluster is recovering, not that checkpoints cannot work."""
    return isinstance(exc, (NotReady, NotFound, RolledBack, DeadlineExceeded, ShutdownError))


def _cursors(saved: list[o.Saved]) -> dict[str, int] | None:
    """The batch cursors a checkpoint holds, per worker: the highest any PS's copy
    holds (a batch pushed to some PS and not yet to others counts as in: trained again
    it would be applied twice where it is). None when a PS did not say (an older PS)."""
    if any(s.cursors is None for s in saved):
        return None
    out: dict[str, int] = {}
    for s in saved:
        for worker, c in (s.cursors or {}).items():
            out[worker] = max(out.get(worker, 0), int(c))
    return out
