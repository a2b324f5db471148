"""Exactly-once pushes: remembers which (worker, incarnation, sequence) were applied.

Rules of this module:

* A push is first :meth:`PushDeduper.check`-ed (is it new?), then, only once it has
  been applied, :meth:`PushDeduper.commit`-ed. A push that fails validation in
  between is never recorded, so its retry is still new.
* Per worker name we keep the latest incarnation, the highest committed sequence
  ``high`` and a bitmap of the sequences in ``(high - window, high]`` that were
  committed. Memory per worker is bounded by ``window`` bits; out-of-order
  sequences inside the window work.
* A higher incarnation replaces the worker's state (a restarted worker begins
  afresh); a lower one raises :class:`~zmqps.wire.errors.FencedError`. A sequence
  older than the window cannot be judged and raises
  :class:`~zmqps.wire.errors.InvalidArgument`.
* :meth:`PushDeduper.snapshot` / :meth:`PushDeduper.restore` use plain JSON-able dicts.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from zmqps.wire.errors import FencedError, InvalidArgument

__all__ = [
    "MAX_INCARNATIONS",
    "MAX_NAME_CHARS",
    "MAX_WORKERS",
    "RECENT",
    "ClosureLedger",
    "PushDeduper",
    "PushLedger",
    "WorkerPushes",
]

#: worker names a PS keeps a dedup window for: a push from one more name is refused
#: (a cluster has a few thousand workers at most; a client inventing names cannot grow
#: the PS without bound)
MAX_WORKERS = 8192
#: and the characters of those names together (names of up to 64 characters each, so
#: 8192 of the longest would not fit: every map keyed by them, in the ``ps_state`` a
#: chief reads and in ``status``, stays well under a message header's 1 MiB)
MAX_NAME_CHARS = 1 << 17
#: (worker, incarnation, generation) counts of applied pushes kept (the oldest goes)
MAX_INCARNATIONS = 4096

#: sync: the ``(step, cursor)`` pairs of a worker's latest pushes kept per worker (a
#: worker pushes for the step in progress or the one after; a few more for retries)
RECENT = 8


@dataclass
class _Worker:
    incarnation: int
    high: int = -1  # highest committed seq, -1 before the first commit
    bits: int = 0  # bit i set <=> seq (high - i) committed


class PushDeduper:
    """Per-worker sliding window of applied push sequence numbers."""

    def __init__(
        self, window: int = 4096, max_workers: int = MAX_WORKERS, max_chars: int = MAX_NAME_CHARS
    ) -> None:
        if not isinstance(window, int) or window < 1:
            raise InvalidArgument(f"dedup window must be a positive int, got {window!r}")
        self.window = window
        self.max_workers = max_workers
        self.max_chars = max_chars
        self._mask = (1 << window) - 1
        self._workers: dict[str, _Worker] = {}
        self._chars = 0  # of the names in _workers
        #: the names the chief fenced (it registered them): never made room for
        self._fenced: set[str] = set()

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Iterator[str]:
        return iter(self._workers)

    def __contains__(self, worker: object) -> bool:
        return worker in self._workers

    def incarnation(self, worker: str) -> int | None:
        """The latest incarnation seen from ``worker`` (None if never seen)."""
        w = self._workers.get(worker)
        return None if w is None else w.incarnation

    def _state(self, worker: str, incarnation: int, seq: int) -> _Worker | None:
        """The worker's current window, None if ``incarnation`` is new; checks arguments."""
        if seq < 0:
            raise InvalidArgument(f"push sequence must be >= 0, got {seq}")
        w = self._workers.get(worker)
        if w is None:
            self._admit(worker)
        if w is None or incarnation > w.incarnation:
            return None
        if incarnation < w.incarnation:
            raise FencedError(
                f"worker {worker!r} incarnation {incarnation} was replaced by {w.incarnation}"
            )
        if w.high >= 0 and w.high - seq >= self.window:
            raise InvalidArgument(
                f"push sequence {seq} of worker {worker!r} is older than the dedup window"
                f" (latest {w.high}, window {self.window})"
            )
        return w

    def _admit(self, worker: str) -> None:
        """Raise InvalidArgument if a new name ``worker`` would pass the bounds."""
        if self.full_for(worker):
            raise InvalidArgument(
                f"worker {worker!r} refused: this PS already keeps the pushes of"
                f" {len(self._workers)} worker names ({self._chars} characters; the bounds"
                f" are {self.max_workers} names and {self.max_chars} characters)"
            )

    def _put(self, worker: str, state: _Worker) -> None:
        if worker not in self._workers:
            self._admit(worker)
            self._chars += len(worker)
        self._workers[worker] = state

    def check(self, worker: str, incarnation: int, seq: int) -> bool:
        """True if this push is new (apply it, then :meth:`commit`); False if a duplicate.

        Raises FencedError for an old incarnation and InvalidArgument for a sequence
        older than the window. Changes nothing.
        """
        w = self._state(worker, incarnation, seq)
        if w is None or seq > w.high:
            return True
        return not (w.bits >> (w.high - seq)) & 1

    def commit(self, worker: str, incarnation: int, seq: int) -> None:
        """Record that push ``seq`` of ``worker`` / ``incarnation`` was applied."""
        w = self._state(worker, incarnation, seq)
        if w is None:
            w = _Worker(incarnation)
            self._put(worker, w)
        if seq > w.high:
            shift = seq - w.high if w.high >= 0 else self.window
            w.bits = ((w.bits << shift) | 1) & self._mask if shift < self.window else 1
            w.high = seq
        else:
            w.bits |= 1 << (w.high - seq)

    def fence(self, worker: str, incarnation: int) -> bool:
        """From now on refuse every incarnation of ``worker`` older than ``incarnation``
        (the chief registered it: a paused old process that resumes is shut out even
        before the new one's first push). True if that changed anything. A new name
        past the bounds raises InvalidArgument, changing nothing."""
        w = self._workers.get(worker)
        if w is not None and incarnation <= w.incarnation:
            self._fenced.add(worker)
            return False
        self._put(worker, _Worker(incarnation))
        self._fenced.add(worker)
        return True

    def full_for(self, worker: str) -> bool:
        """Whether a new name ``worker`` would pass the bounds."""
        return worker not in self._workers and (
            len(self._workers) >= self.max_workers or self._chars + len(worker) > self.max_chars
        )

    def unregistered(self) -> str | None:
        """The oldest name the chief never fenced (pushes under a name no worker was
        registered with: a client inventing names), or None: what a worker the chief
        registers makes room by, when the names fill the bounds."""
        return next((name for name in self._workers if name not in self._fenced), None)

    def forget(self, worker: str) -> None:
        """Drop everything known about ``worker`` (e.g. it left the job for good)."""
        if self._workers.pop(worker, None) is not None:
            self._chars -= len(worker)
        self._fenced.discard(worker)

    # -- persistence ---------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The whole state as a JSON-able dict (bitmaps as hex strings)."""
        return {
            "window": self.window,
            "workers": {
                name: {"incarnation": w.incarnation, "high": w.high, "bits": format(w.bits, "x")}
                for name, w in self._workers.items()
            },
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Replace the state with a :meth:`snapshot` (keeping this deduper's window).

        Raises InvalidArgument for a malformed snapshot, leaving the state unchanged.
        """
        try:
            workers = {
                str(name): _Worker(
                    incarnation=_int(d["incarnation"], 0),
                    high=_int(d["high"], -1),
                    bits=int(d["bits"], 16) & self._mask,
                )
                for name, d in state["workers"].items()
            }
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InvalidArgument(f"malformed dedup snapshot: {e!r}") from e
        chars = sum(map(len, workers))
        if len(workers) > self.max_workers or chars > self.max_chars:
            raise InvalidArgument("dedup snapshot past its bounds")
        self._workers, self._chars = workers, chars
        self._fenced &= workers.keys()


def _int(v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"expected int >= {lo}, got {v!r}")
    return v


@dataclass
class WorkerPushes:
    """What a PS did with one worker's pushes, over all its incarnations."""

    #: pushes applied (async, ssp) or counted toward their step (sync)
    applied: int = 0
    #: pushes acknowledged without being applied, by reason (duplicate, stale, ...)
    dropped: dict[str, int] = field(default_factory=dict)
    #: the highest batch cursor among the applied pushes (0: none)
    cursor: int = 0
    #: the sync step of the push that carried that cursor (-1: none, or not sync)
    step: int = -1
    #: the worker left with its work done, after this many batches (None: not done)
    done: int | None = None
    #: batches whose applied pushes a restore took back (trained again after it)
    rolled_back: int = 0
    #: sync: ``(step, cursor)`` of the latest counted pushes, oldest first (bounded)
    recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=RECENT))
    #: sync: the highest cursor among the counted pushes that left ``recent``
    older: int = 0
    #: the highest cursor ever applied (a restore that goes back does not lower it):
    #: what a chief started later counts the async global step from
    high: int = 0

    def count(self, cursor: int, step: int | None) -> None:
        """A push with batch ``cursor`` was applied (or, sync, counted toward ``step``)."""
        if cursor > self.cursor:
            self.cursor, self.step = cursor, -1 if step is None else step
        self.high = max(self.high, cursor)
        if step is not None:
            if len(self.recent) == self.recent.maxlen:
                self.older = max(self.older, self.recent[0][1])
            self.recent.append((step, cursor))

    def included(self, sync_step: int | None) -> int:
        """The highest batch cursor whose gradient is in the values now: async / ssp
        (``sync_step`` None), every applied push; sync, the pushes counted toward the
        steps before ``sync_step`` (those of the step in progress are not applied yet)."""
        if sync_step is None:
            return self.cursor
        return max([self.older, *(c for s, c in self.recent if s < sync_step)])

    def to_dict(self) -> dict[str, Any]:
        return {
            "applied": self.applied,
            "dropped": dict(self.dropped),
            "cursor": self.cursor,
            "step": self.step,
            "done": self.done,
            "rolled_back": self.rolled_back,
        }


class PushLedger:
    """Per worker name (``worker:3``, every incarnation together): pushes applied and
    dropped, and how far its data got (the batch cursor of its pushes).

    A worker's new incarnation resumes after the batches its pushes really brought
    to the PS (the chief reads the cursor when it fences the old incarnation), not
    after the steps the chief last heard of in a heartbeat. The counts let anyone
    check that every push acknowledged as applied was applied once.

    Bounded by the :class:`PushDeduper` beside it: a name enters the ledger only
    through a push or a fence that the deduper took first, and the deduper never
    forgets a name the ledger keeps, so the ledger's names are among the deduper's.
    """

    def __init__(self) -> None:
        self._workers: dict[str, WorkerPushes] = {}
        #: pushes applied, by "worker/incarnation/generation" (what each incarnation's
        #: own count of acknowledged pushes must match)
        self.by_incarnation: OrderedDict[str, int] = OrderedDict()  # MAX_INCARNATIONS

    def get(self, worker: str) -> WorkerPushes:
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = WorkerPushes()
        return w

    def forget(self, worker: str) -> None:
        """Drop ``worker``'s record (the deduper forgot the name: room was made)."""
        self._workers.pop(worker, None)

    def applied(
        self, worker: str, incarnation: int, gen: int, cursor: int | None, step: int | None
    ) -> None:
        w = self.get(worker)
        w.applied += 1
        key = f"{worker}/{incarnation}/{gen}"
        counts = self.by_incarnation
        counts[key] = counts.get(key, 0) + 1
        if len(counts) > MAX_INCARNATIONS:
            counts.popitem(last=False)
        if cursor is not None:
            w.count(cursor, step)

    def counted_at_another_step(self, worker: str, cursor: int, step: int) -> bool:
        """Sync: did this PS count ``worker``'s batch ``cursor`` toward a step other than
        ``step``? A worker's new incarnation redoes a batch its predecessor pushed to some
        PS only (it died in between); by the time the redo comes the step may have gone
        on, and the batch must not be counted here twice. Exact for the batches in
        ``recent``; a batch below ``older`` (the steps that left ``recent``, or what a
        restore kept) was counted before (a worker's batches go in step order)."""
        w = self._workers.get(worker)
        if w is None:
            return False
        if cursor < w.older:
            return True
        return any(c == cursor and s != step for s, c in w.recent)

    def refused(self, worker: str, cursor: int | None, step: int | None) -> None:
        """A push refused for non-finite values: dropped, yet its batch is done (the
        worker skipped it), so the cursor counts as for an applied one."""
        self.dropped(worker, "nonfinite")
        if cursor is not None:
            self.get(worker).count(cursor, step)

    def dropped(self, worker: str, reason: str) -> None:
        w = self.get(worker)
        w.dropped[reason] = w.dropped.get(reason, 0) + 1

    def progress(self, worker: str) -> tuple[int, int]:
        """``(cursor, step)`` of the worker's furthest applied push (``(0, -1)``: none)."""
        w = self._workers.get(worker)
        return (0, -1) if w is None else (w.cursor, w.step)

    def restored(self, cursors: Mapping[str, int], exact: bool = False) -> None:
        """A restore, and forget the sync steps of pushes (the steps went back with
        it). ``exact``: ``cursors`` are those of the checkpoint restored (a worker not
        named: 0), and every worker's batches after its cursor are trained again, so the
        cursors go back to them. Else (a checkpoint that does not say) cursors are
        raised to at least ``cursors`` (what every PS knew)."""
        if exact:
            for name, w in self._workers.items():
                back = cursors.get(name, 0)
                w.rolled_back += max(0, w.cursor - back)
                w.cursor = back
        for worker, cursor in cursors.items():
            w = self.get(worker)
            w.cursor = max(w.cursor, cursor)
        for w in self._workers.values():
            w.step = -1
            w.recent.clear()
            w.older = w.cursor
            w.high = max(w.high, w.cursor)

    def included(self, sync_step: int | None) -> dict[str, int]:
        """Per worker, the highest batch cursor whose gradient the values hold now (what
        a checkpoint taken now includes; see :meth:`WorkerPushes.included`)."""
        out = {}
        for name, w in self._workers.items():
            c = w.included(sync_step)
            if c:
                out[name] = c
        return out

    def left(self, worker: str, steps: int) -> None:
        """The worker left with its work done, after ``steps`` batches in all."""
        self.get(worker).done = steps

    def finished(self) -> dict[str, int]:
        """Workers that left with their work done: their batches in all."""
        return {n: w.done for n, w in self._workers.items() if w.done is not None}

    def cursors(self) -> dict[str, int]:
        return {name: w.cursor for name, w in self._workers.items() if w.cursor}

    def highs(self) -> dict[str, int]:
        """Per worker, the highest cursor ever applied (see :attr:`WorkerPushes.high`)."""
        return {name: w.high for name, w in self._workers.items() if w.high}

    def __len__(self) -> int:
        return len(self._workers)

    def snapshot(self, limit: int | None = None) -> dict[str, dict[str, Any]]:
        """Per worker, in name order (the first ``limit`` names only, if given)."""
        names = sorted(self._workers)[:limit]
        return {name: self._workers[name].to_dict() for name in names}

    def image(self) -> dict[str, Any]:
        """Everything, as msgpack-able values: :meth:`load_image` of it makes a twin
        (a backup's copy)."""
        workers = {
            name: {
                **w.to_dict(),
                "recent": [list(r) for r in w.recent],
                "older": w.older,
                "high": w.high,
            }
            for name, w in self._workers.items()
        }
        return {"workers": workers, "by_incarnation": list(map(list, self.by_incarnation.items()))}

    def load_image(self, image: Mapping[str, Any]) -> None:
        """Replace the state with an :meth:`image` (InvalidArgument, unchanged, when
        malformed or past the bounds)."""
        try:
            workers = {}
            for name, d in image["workers"].items():
                w = WorkerPushes(
                    applied=int(d["applied"]),
                    dropped={str(k): int(v) for k, v in d["dropped"].items()},
                    cursor=int(d["cursor"]),
                    step=int(d["step"]),
                    done=None if d["done"] is None else int(d["done"]),
                    rolled_back=int(d["rolled_back"]),
                    older=int(d["older"]),
                    high=int(d["high"]),
                )
                w.recent.extend((int(a), int(b)) for a, b in d["recent"][-RECENT:])
                workers[str(name)] = w
            counts = OrderedDict((str(k), int(v)) for k, v in image["by_incarnation"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InvalidArgument(f"malformed push ledger: {e!r}") from e
        if len(workers) > MAX_WORKERS or len(counts) > MAX_INCARNATIONS:
            raise InvalidArgument("push ledger past its bounds")
        self._workers, self.by_incarnation = workers, counts


class ClosureLedger:
    """The pushes of scheduled functions (coordinator mode) that were applied, by
    ``(closure, seq)``: a function run again because its worker was lost has each of
    its pushes applied at most once, whichever worker sent it.

    The last ``capacity`` closures are remembered (a function is run again within
    seconds of its first run; older ones never come back); ``dropped`` counts pushes
    refused as already applied.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._applied: OrderedDict[int, set[int]] = OrderedDict()
        self.closures = 0  # closures with a push applied here
        self.dropped = 0

    def is_new(self, closure: int, seq: int) -> bool:
        done = self._applied.get(closure)
        return done is None or seq not in done

    def commit(self, closure: int, seq: int) -> None:
        done = self._applied.get(closure)
        if done is None:
            done = self._applied[closure] = set()
            self.closures += 1
            while len(self._applied) > self.capacity:
                self._applied.popitem(last=False)
        done.add(seq)

    def stats(self) -> dict[str, int]:
        return {"closures": self.closures, "dropped": self.dropped}

    def image(self) -> dict[str, Any]:
        return {
            "applied": [[c, sorted(seqs)] for c, seqs in self._applied.items()],
            "closures": self.closures,
            "dropped": self.dropped,
        }

    def load_image(self, image: Mapping[str, Any]) -> None:
        try:
            applied = OrderedDict((int(c), {int(q) for q in seqs}) for c, seqs in image["applied"])
            closures, dropped = int(image["closures"]), int(image["dropped"])
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgument(f"malformed closure ledger: {e!r}") from e
        if len(applied) > self.capacity:
            raise InvalidArgument("closure ledger past its bound")
        self._applied, self.closures, self.dropped = applied, closures, dropped
