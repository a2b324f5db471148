"""How a PS commits a validated push: the consistency mode as a strategy.

Rules of this module:

* A PS starts in :class:`Apply` (async) and changes mode only when the chief says
  so (``sync_config``): :func:`make_mode` is the one place a mode name is read.
* :class:`Apply` (async, ssp): each push is applied on arrival, shard by shard;
  the reply carries each shard's staleness.
* :class:`Accumulate` (sync, SyncReplicas): a push carries its token's step. It is
  refused whole when its step is ahead of the shards (a token of before a restore),
  dropped whole when a shard has moved past it (``stale``) or when every shard
  already holds this worker's gradient for the step (``duplicate``); else it is
  added to each shard's accumulator, which applies the mean once N arrived. A push
  refused for non-finite values counts toward its step with nothing in it.
* :class:`StepWaiters` holds the chief's ``wait_step`` long polls and wakes them
  when the PS's step reaches theirs.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zmqps.core.store import DenseUpdate, PackUpdate, RowUpdate, ShardStore, Update
from zmqps.core.sync import MODES, SyncShards
from zmqps.transport.base import waited
from zmqps.wire.errors import InvalidArgument, RolledBack

__all__ = ["Accumulate", "Apply", "Committed", "PSMode", "StepWaiters", "make_mode"]


@dataclass(frozen=True)
class Committed:
    """The outcome of committing a push: ``dropped`` is None when it was applied (or
    counted toward its step), else the reason."""

    staleness: tuple[int, ...] = ()
    dropped: str | None = None
    advanced: bool = False  # sync: a step was applied


class PSMode:
    """The strategy interface (see the subclasses)."""

    name = ""
    #: a pack's gradient may be applied whole (:class:`~zmqps.core.store.PackUpdate`);
    #: a mode that keeps per-shard sums takes it shard by shard
    fused = False

    def __init__(self, store: ShardStore) -> None:
        self.store = store

    @property
    def step(self) -> int:
        """The PS's sync step (0 outside sync)."""
        return 0

    def commit(
        self, sids: Sequence[int], updates: Sequence[Update], worker: str, step: int | None
    ) -> Committed:
        raise NotImplementedError

    def refuse(self, sids: Sequence[int], worker: str, step: int) -> bool:
        """A push for ``step`` whose values were refused (not finite); True if a step
        was applied because of it."""
        return False

    def set_required(self, required: int) -> bool:
        """Change N; True if a step was applied because of it."""
        return False

    def reset(self, step: int) -> None:
        """A restore: every accumulated gradient is gone; the shards are at ``step``."""

    def contributors(self, every_shard: bool, among: Iterable[str] | None = None) -> list[str]:
        return []

    def status(self, among: Iterable[str] | None = None) -> dict[str, Any] | None:
        """The sync state (None in other modes); ``among``: its contributors listed
        only among these workers."""
        return None


class Apply(PSMode):
    """async and ssp: a push is applied on arrival."""

    fused = True

    def __init__(self, store: ShardStore, name: str = "async") -> None:
        super().__init__(store)
        self.name = name

    def commit(
        self, sids: Sequence[int], updates: Sequence[Update], worker: str, step: int | None
    ) -> Committed:
        return Committed(tuple(staleness for _, staleness in self.store.apply_all(updates)))


class Accumulate(PSMode):
    """sync: a push counts toward its step; N of them make the step (their mean)."""

    name = "sync"

    def __init__(self, store: ShardStore, required: int, step: int) -> None:
        super().__init__(store)
        self.shards = SyncShards(store, required, step)

    @property
    def step(self) -> int:
        return self.shards.min_step()

    def commit(
        self, sids: Sequence[int], updates: Sequence[Update], worker: str, step: int | None
    ) -> Committed:
        sync = self.shards
        if step is None:
            raise InvalidArgument("sync mode: a push carries its local step (take a token first)")
        if any(sync.is_ahead(sid, step) for sid in sids):
            raise RolledBack(
                f"a gradient for step {step}, but the shards are at step {sync.min_step()}"
                " (restored): take a new token"
            )
        if any(sync.is_stale(sid, step) for sid in sids):
            sync.dropped["stale"] += 1
            return Committed(dropped="stale")
        if all(sync.has_contributed(sid, worker, step) for sid in sids):
            sync.dropped["duplicate"] += 1
            return Committed(dropped="duplicate")
        staleness, advanced = [], False
        for sid, u in zip(sids, updates, strict=True):
            if isinstance(u, PackUpdate):  # (a pack is planned shard by shard here)
                raise TypeError(f"sync mode: no per-shard update for shard {sid}")
            staleness.append(u.staleness)
            if isinstance(u, DenseUpdate):
                advanced = sync.add_dense(sid, u.chunks, worker) or advanced
            else:
                advanced = sync.add_rows(sid, _global_ids(u), u.grads, worker) or advanced
        return Committed(tuple(staleness), advanced=advanced)

    def refuse(self, sids: Sequence[int], worker: str, step: int) -> bool:
        """Counted toward its step as an empty gradient (see :meth:`SyncShards.refuse`),
        unless the step is not the shards' (then it would have been dropped anyway)."""
        sync = self.shards
        if any(sync.is_ahead(sid, step) or sync.is_stale(sid, step) for sid in sids):
            return False
        if all(sync.has_contributed(sid, worker, step) for sid in sids):
            return False
        return any([sync.refuse(sid, worker) for sid in sids])

    def set_required(self, required: int) -> bool:
        return bool(self.shards.set_required(required))

    def reset(self, step: int) -> None:
        self.shards.reset(step)

    def contributors(self, every_shard: bool, among: Iterable[str] | None = None) -> list[str]:
        if every_shard:
            return self.shards.contributors_of_current_step(among)
        return self.shards.contributors_any(among)

    def status(self, among: Iterable[str] | None = None) -> dict[str, Any]:
        return {**self.shards.status(), "contributors": self.contributors(True, among)}


def _global_ids(u: RowUpdate) -> np.ndarray[Any, Any]:
    """The global row ids of a row update (a table's keys are its ids already)."""
    if u.shard.is_table:
        return u.keys
    return u.keys + u.shard.definition.row_start


def make_mode(
    name: str, store: ShardStore, required: int, step: int, current: PSMode | None = None
) -> PSMode:
    """The strategy for ``name`` (keeping ``current`` when it is that mode already,
    with N changed to ``required``)."""
    if name not in MODES:
        raise InvalidArgument(f"unknown mode {name!r}; expected one of {', '.join(MODES)}")
    if current is not None and current.name == name:
        return current
    if name == "sync":
        return Accumulate(store, required, step)
    return Apply(store, name)


class StepWaiters:
    """The chief's ``wait_step`` long polls: each waits until the step reaches its own.

    Kept in a heap by target step (a notify wakes the due ones only) and a map by
    ticket (a wait that ends is forgotten at once): each costs O(log n), however many
    wait; their number is bounded by the server's pending-request bound."""

    def __init__(self, step: Callable[[], int], moved: Callable[[int], None] | None = None) -> None:
        self._step = step
        #: hears the step at every notify, before the waits are woken (a PS releases
        #: the tokens the chief let it release at that step)
        self._moved = moved
        self._live: dict[int, asyncio.Future[int]] = {}
        self._heap: list[tuple[int, int]] = []  # (target, ticket); ended ones skipped
        self._tickets = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    async def wait(self, target: int, seconds: float) -> int:
        """The step once it reached ``target``, or after ``seconds``, whichever first."""
        if self._step() < target and seconds > 0:
            fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            ticket = next(self._tickets)
            self._live[ticket] = fut
            heapq.heappush(self._heap, (target, ticket))
            try:
                await waited(fut, seconds)
            finally:
                del self._live[ticket]
                if len(self._heap) > 2 * len(self._live) + 64:  # mostly ended: compact
                    self._heap = [e for e in self._heap if e[1] in self._live]
                    heapq.heapify(self._heap)
        return self._step()

    def notify(self) -> None:
        step = self._step()
        if self._moved is not None:
            self._moved(step)
        heap = self._heap
        while heap and heap[0][0] <= step:
            _, ticket = heapq.heappop(heap)
            fut = self._live.get(ticket)
            if fut is not None and not fut.done():
                fut.set_result(step)
