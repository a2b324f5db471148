"""Synchronous training state: per-shard step accumulators, the token queue, the SSP bound.

Rules of this module (the semantics of TensorFlow's ``SyncReplicasOptimizer``):

* Every gradient is tagged with the worker's local step: the value of the token it
  took. A shard accumulates gradients whose local step is >= its own step
  ("fresh"); older ones are dropped and counted with the reason ``stale``.
* When ``required`` (N) fresh gradients have arrived, the shard applies their
  mean exactly once and advances its step; the accumulator is then empty again.
  ``required`` can shrink (dead workers, M < N): a shard that already holds that
  many gradients applies at once. A step is never applied from zero gradients.
* A gradient refused for non-finite values counts toward N with nothing in it: the
  step's mean is of the others; a step of refused gradients only advances the step.
* Tokens exist for the current global step only (:class:`TokenLedger`): when the
  step advances, the old step's untaken tokens are discarded (a late backup worker
  takes a fresh token instead of computing a gradient that is sure to be dropped).
  How many a step has left is derived from the replicas live now, never counted
  once when the step begins: a worker that comes back finds its token. A worker
  takes at most one token per step, so a fast worker cannot fill a step with its
  own gradients; the ``init_tokens`` extra tokens of step 0 are the exception that
  lets workers run ahead at the start.
* SSP: a worker may start step ``c`` only while the slowest live worker has
  completed at least ``c - s`` steps.
* Nothing here does IO or reads a clock; waiting is the roles' business.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.core import lowp
from zmqps.core.optimizers import compute_dtype
from zmqps.core.store import ShardStore, Update
from zmqps.wire.errors import InvalidArgument, NonFiniteGradient, NotFound

__all__ = [
    "MODES",
    "ReleasedTokens",
    "ShardAccumulator",
    "StalenessBound",
    "SyncShards",
    "TokenLedger",
]

Array = npt.NDArray[Any]

MODES = ("async", "sync", "ssp")


@dataclass
class ShardAccumulator:
    """The gradients of one shard for its current step."""

    step: int = 0
    count: int = 0
    dense: Array | None = None  # running sum, flat, compute dtype
    rows: list[tuple[Array, Array]] = field(default_factory=list)  # (global ids, rows)
    #: the workers whose gradient the step holds, in arrival order (a dict for an
    #: O(1) look-up: a step of N workers would cost O(N) per push as a list)
    contributors: dict[str, None] = field(default_factory=dict)
    #: gradients counted toward the step with nothing in them (refused: not finite)
    refused: int = 0


class SyncShards:
    """Sync accumulation for the shards of one PS."""

    def __init__(self, store: ShardStore, required: int, step: int = 0) -> None:
        if required < 1:
            raise InvalidArgument("replicas_to_aggregate must be >= 1")
        self.store = store
        self.required = required
        #: the step shards start at (0, or the step of a restored checkpoint)
        self.base_step = step
        self.acc: dict[int, ShardAccumulator] = {}
        self.dropped: Counter[str] = Counter()
        self.steps_applied = 0
        #: shard steps applied, by how many gradients each one's mean was of: fewer
        #: than the configured N are steps taken while workers were missing
        self.aggregated: Counter[int] = Counter()
        #: replicated after aggregation (a primary's): the shards pushes touched since
        #: :meth:`take_data`, and the sum each one applied meanwhile (kept at its apply)
        self.capture = False
        self._touched: set[int] = set()
        self._captured: dict[int, tuple[Array | None, list[tuple[Array, Array]]]] = {}
        #: a backup replaying a primary's pushes: they count, their data is the sums
        #: the primary shipped (:meth:`install_data`), so adds carry nothing
        self.ghost = False

    def reset(self, step: int) -> None:
        """Forget every accumulated gradient; every shard is at ``step`` (a restore)."""
        self.base_step = step
        self.acc.clear()

    def _acc(self, sid: int) -> ShardAccumulator:
        acc = self.acc.get(sid)
        if acc is None:
            self.store.get(sid)  # NotFound for unknown shards
            # Every shard of the store starts at the PS's step together: a worker may push
            # one shard's gradient before another's (layer by layer), and the second must
            # not start at the step the first has already reached. A shard created later
            # starts at the PS's step then.
            step = self.min_step()
            for other in self.store.ids():
                if other not in self.acc:
                    self.acc[other] = ShardAccumulator(step=step)
            acc = self.acc[sid]
        return acc

    def min_step(self) -> int:
        """The step every shard of this PS has reached (the PS's step)."""
        return min((a.step for a in self.acc.values()), default=0) if self.acc else self.base_step

    def has_contributed(self, sid: int, worker: str, local_step: int) -> bool:
        """Did ``worker`` already give shard ``sid`` a gradient for ``local_step``? One
        gradient per worker per step (the extra tokens of step 0 aside): a worker that
        took a second token for a step (e.g. from a restarted chief) is not counted twice."""
        acc = self._acc(sid)
        return local_step > 0 and acc.step == local_step and worker in acc.contributors

    def is_ahead(self, sid: int, local_step: int) -> bool:
        """A token for a step this shard has not reached: it was issued before a restore
        rolled the cluster back (tokens of a step exist only once every PS reached it)."""
        return local_step > self._acc(sid).step

    def step_of(self, sid: int) -> int:
        return self._acc(sid).step

    def is_stale(self, sid: int, local_step: int) -> bool:
        return local_step < self._acc(sid).step

    def add_dense(self, sid: int, chunks: Sequence[tuple[int, Array]], worker: str) -> bool:
        """Accumulate a validated whole-shard gradient; True when the step was applied."""
        acc = self._acc(sid)
        shard = self.store.get(sid)
        if not self.ghost:
            if acc.dense is None:
                acc.dense = np.zeros(shard.definition.size, compute_dtype(shard.values.dtype))
            for offset, chunk in chunks:
                part = acc.dense[offset : offset + chunk.shape[0]]
                lowp.add_into(part, chunk)
        return self._counted(sid, acc, worker)

    def add_rows(self, sid: int, ids: Array, rows: Array, worker: str) -> bool:
        """Accumulate validated row gradients (copied: frames do not outlive the request)."""
        acc = self._acc(sid)
        if not self.ghost:
            acc.rows.append((np.array(ids, dtype=np.int64), np.array(rows)))
        return self._counted(sid, acc, worker)

    def refuse(self, sid: int, worker: str) -> bool:
        """``worker``'s gradient for the shard's step was refused (not finite): it
        counts toward N like any other, with nothing in it, so the step does not wait
        for it; the mean is of the others (a step of refused ones only changes no
        value). True when the step was applied."""
        acc = self._acc(sid)
        acc.refused += 1
        acc.contributors[worker] = None
        self._touched.add(sid)
        return self._full(sid, acc)

    def _counted(self, sid: int, acc: ShardAccumulator, worker: str) -> bool:
        self._touched.add(sid)
        acc.count += 1
        acc.contributors[worker] = None
        return self._full(sid, acc)

    def _full(self, sid: int, acc: ShardAccumulator) -> bool:
        if acc.count + acc.refused >= self.required:
            self._apply(sid, acc)
            return True
        return False

    def _apply(self, sid: int, acc: ShardAccumulator) -> None:
        self.aggregated[acc.count] += 1
        acc.step += 1
        acc.refused = 0
        acc.contributors.clear()
        self.steps_applied += 1
        if self.capture:  # the sum this step applies: what the backups apply too
            dense = None if acc.dense is None or not acc.count else acc.dense.copy()
            self._captured[sid] = (dense, list(acc.rows) if acc.count else [])
        if acc.count == 0:  # every gradient of the step was refused: nothing to apply
            return
        shard = self.store.get(sid)
        scale = 1.0 / acc.count
        try:
            updates: list[Update] = []
            if acc.dense is not None:
                updates.append(self.store.plan_dense(sid, [(0, acc.dense)], shard.version))
            if acc.rows:
                ids = np.concatenate([i for i, _ in acc.rows])
                # explicit row width: a shard no id fell in gets an empty push (size 0)
                width = math.prod(shard.definition.shape[1:])
                rows = np.concatenate([r.reshape(len(i), width) for i, r in acc.rows])
                rows = rows.reshape(len(ids), *shard.definition.shape[1:])
                # each push's rows were checked as it came: the mean needs no room check
                updates.append(self.store.plan_rows(sid, ids, rows, shard.version, growth=False))
            self.store.apply_all(updates, scale)  # all of the step or none of it
        except NonFiniteGradient:
            # the step's mean would take float16 values past their largest: the step
            # goes on without changing them (like a step of refused gradients), counted
            self.dropped["overflow"] += 1
        finally:
            if acc.dense is not None:
                acc.dense.fill(0)
            acc.rows.clear()
            acc.count = 0

    def take_data(self) -> list[tuple[int, Array | None, list[tuple[Array, Array]]]]:
        """Replication after aggregation, on the primary: the accumulated gradients of
        every shard pushes touched since the last call, ``(shard, sum, [(ids, rows)])``
        (copies): for a shard that applied its step since, the sum it applied; else its
        running sum now. Starts the next batch."""
        out = []
        for sid in sorted(self._touched):
            kept = self._captured.get(sid)
            if kept is not None:
                out.append((sid, *kept))
                continue
            acc = self.acc[sid]
            dense = None if acc.dense is None or not acc.count else acc.dense.copy()
            out.append((sid, dense, list(acc.rows)))
        self._touched.clear()
        self._captured.clear()
        return out

    def held_bytes(self) -> int:
        """At most the bytes :meth:`take_data` would return after one more push of
        nothing but already-accumulated shards (the room a batch may need)."""
        total = 0
        for sid, acc in self.acc.items():
            shard = self.store.get(sid)
            total += shard.definition.size * compute_dtype(shard.values.dtype).itemsize
            total += sum(i.nbytes + r.nbytes for i, r in acc.rows)
        return total

    def install_data(self, sid: int, dense: Array | None, rows: list[tuple[Array, Array]]) -> None:
        """Replication after aggregation, on a backup: shard ``sid``'s accumulated
        gradients are the primary's (:meth:`take_data`; owned here)."""
        acc = self._acc(sid)
        shard = self.store.get(sid)
        if dense is None:
            if acc.dense is not None:
                acc.dense.fill(0)
        else:
            want = (shard.definition.size,), compute_dtype(shard.values.dtype)
            if (dense.shape, dense.dtype) != want:
                raise InvalidArgument(f"shard {sid}: a gradient sum {dense.dtype}{dense.shape}")
            acc.dense = np.array(dense, copy=True)
        acc.rows = [(np.array(i, dtype=np.int64), np.array(r)) for i, r in rows]

    def set_required(self, required: int) -> list[int]:
        """Change N; returns the shards that applied their step because of it."""
        if required < 1:
            raise InvalidArgument("replicas_to_aggregate must be >= 1")
        self.required = required
        applied = []
        for sid, acc in self.acc.items():
            if acc.count + acc.refused >= required:
                self._apply(sid, acc)
                applied.append(sid)
        return applied

    def contributors_of_current_step(self, among: Iterable[str] | None = None) -> list[str]:
        """Workers (``among`` these; None: any) whose gradient every shard still at the
        PS's step has received."""
        step = self.min_step()
        behind = [a.contributors for a in self.acc.values() if a.step == step]
        if not behind:
            return []
        first, *rest = behind
        names = first if among is None else (w for w in among if w in first)
        return sorted({w for w in names if all(w in held for held in rest)})

    def contributors_any(self, among: Iterable[str] | None = None) -> list[str]:
        """Workers (``among`` these; None: any) whose gradient some shard still at the
        PS's step has received."""
        step = self.min_step()
        held = [a.contributors for a in self.acc.values() if a.step == step]
        if among is not None:
            return sorted({w for w in among if any(w in h for h in held)})
        return sorted({w for h in held for w in h})

    def image(self) -> tuple[dict[str, Any], dict[tuple[int, str], Array]]:
        """Everything (copies): ``(meta, arrays)``, the arrays by ``(shard, name)``
        (``dense``: the running sum; ``ids.i`` / ``rows.i``: row gradient ``i``).
        :meth:`load_image` of it makes a twin (a backup's copy)."""
        acc, arrays = {}, {}
        for sid, a in self.acc.items():
            acc[str(sid)] = [a.step, a.count, list(a.contributors), a.refused, len(a.rows)]
            if a.dense is not None:
                arrays[(sid, "dense")] = a.dense.copy()
            for i, (ids, rows) in enumerate(a.rows):
                arrays[(sid, f"ids.{i}")] = ids.copy()
                arrays[(sid, f"rows.{i}")] = rows.copy()
        meta = {
            "required": self.required,
            "base_step": self.base_step,
            "dropped": dict(self.dropped),
            "steps_applied": self.steps_applied,
            "aggregated": [[n, k] for n, k in self.aggregated.items()],
            "acc": acc,
        }
        return meta, arrays

    def load_image(self, meta: Mapping[str, Any], arrays: Mapping[tuple[int, str], Array]) -> None:
        """Replace the state with an :meth:`image` (InvalidArgument, unchanged, when
        it does not fit the store's shards)."""
        try:
            acc: dict[int, ShardAccumulator] = {}
            for key, (step, count, contributors, refused, nrows) in meta["acc"].items():
                sid = int(key)
                shard = self.store.get(sid)
                dense = arrays.get((sid, "dense"))
                if dense is not None:
                    want = (shard.definition.size,), compute_dtype(shard.values.dtype)
                    if (dense.shape, dense.dtype) != want:
                        raise ValueError(f"shard {sid}: a running sum {dense.dtype}{dense.shape}")
                    dense = np.array(dense, copy=True)
                rows = [
                    (
                        np.array(arrays[(sid, f"ids.{i}")], dtype=np.int64),
                        np.array(arrays[(sid, f"rows.{i}")]),
                    )
                    for i in range(int(nrows))
                ]
                acc[sid] = ShardAccumulator(
                    int(step),
                    int(count),
                    dense,
                    rows,
                    dict.fromkeys(str(w) for w in contributors),
                    int(refused),
                )
            required = int(meta["required"])
            base_step = int(meta["base_step"])
            dropped = Counter({str(k): int(v) for k, v in meta["dropped"].items()})
            steps_applied = int(meta["steps_applied"])
            aggregated = Counter({int(n): int(k) for n, k in meta["aggregated"]})
        except (KeyError, TypeError, ValueError, AttributeError, NotFound) as e:
            raise InvalidArgument(f"malformed sync state: {e}") from None
        if required < 1:
            raise InvalidArgument("malformed sync state: replicas to aggregate below 1")
        self.required, self.base_step, self.acc = required, base_step, acc
        self.dropped, self.steps_applied, self.aggregated = dropped, steps_applied, aggregated

    def status(self) -> dict[str, Any]:
        return {
            "step": self.min_step(),
            "required": self.required,
            "accumulated": {str(sid): a.count for sid, a in sorted(self.acc.items())},
            "dropped": dict(self.dropped),
            "steps_applied": self.steps_applied,
            "aggregated": {str(n): k for n, k in sorted(self.aggregated.items())},
        }


class TokenLedger:
    """The chief's SyncReplicas tokens of the current global step.

    There is no count of tokens that could drift from the cluster: how many a step
    has left is derived, each time a worker asks, from the replicas live *now*
    (``replicas``, M) minus the workers holding one of this step's tokens. A worker
    that comes back after it was counted dead, or a replica that rejoins, finds its
    token there whatever M was when the step began.

    * A worker index holds at most one token per step; a new incarnation of it takes
      over the slot of the old one (whose token died with it).
    * ``have`` (the step of the last token the worker computed) makes a resent request
      idempotent: an incarnation that already holds this step's token and says it has
      not computed it gets the same token again, not a second one.
    * ``extra`` tokens (``init_tokens``) exist for step 0 only and may be taken by any
      worker, several by one, so workers can run ahead at the start.
    """

    def __init__(self) -> None:
        self.step = 0
        self._holders: dict[int, int] = {}  # worker index -> incarnation
        self._extra = 0
        #: tokens of past steps that nobody took (a late backup worker, a worker gone)
        self.discarded = 0
        self.taken = 0
        #: tokens of this step the PS handed (:class:`ReleasedTokens`), by PS, as they
        #: last said: counted as taken in what the ledger shows, never in what it hands
        #: (a worker whose token reply from a PS was lost asks here and gets one)
        self.relayed: dict[int, int] = {}

    def restart(self, step: int, *, extra: int = 0, holders: Mapping[int, int] = {}) -> None:
        """Start over at ``step`` (a restore, a restarted chief): ``holders`` already
        gave their gradient for it; ``extra`` tokens (step 0 only)."""
        self.step = step
        self._holders = dict(holders)
        self._extra = extra if step == 0 else 0
        self.relayed = {}

    def advance(self, step: int, replicas: int, gone: Collection[int] = ()) -> None:
        """The global step is now ``step``; the old step's untaken tokens are discarded."""
        self.discarded += self.untaken(replicas, gone)
        self.taken += sum(self.relayed.values())
        self.step = step
        self._holders = {}
        self._extra = 0
        self.relayed = {}

    def untaken(self, replicas: int, gone: Collection[int] = ()) -> int:
        """Tokens of the current step nobody took, here or from a PS (as far as the PS
        last said): what ``zmqps status`` and the metrics show as available."""
        return max(0, self.available(replicas, gone) - sum(self.relayed.values()))

    def available(self, replicas: int, gone: Collection[int] = ()) -> int:
        """Tokens of the current step still to take, with ``replicas`` (M) counted and
        the workers ``gone`` not (a token one of them holds is no longer in M)."""
        holders = self._holders
        if len(gone) < len(holders):  # the smaller side: a step's tokens are taken often
            held = len(holders) - sum(1 for i in gone if i in holders)
        else:
            held = sum(1 for i in holders if i not in gone)
        return max(0, replicas - held) + self._extra

    @property
    def extra(self) -> int:
        """``init_tokens`` of step 0 still to take."""
        return self._extra

    def holders(self) -> dict[int, int]:
        """Worker index -> incarnation, of the workers holding this step's token."""
        return dict(self._holders)

    def take(
        self,
        index: int,
        incarnation: int,
        replicas: int,
        have: int | None = None,
        gone: Collection[int] = (),
    ) -> int | None:
        """A token (its value: the step to compute) for this worker, or None to wait.

        ``replicas``: M now; ``gone``: workers not counted in it (their tokens neither).
        ``have``: the step of the last token this worker computed (None: not said). A
        worker that computed the current step already gets only an extra token.
        """
        held = self._holders.get(index)
        if have is None or have < self.step:
            if held == incarnation:
                if have is not None:
                    return self.step  # its first answer was lost: the same token again
            elif held is not None and incarnation > held:
                self._holders[index] = incarnation  # a new incarnation takes over the slot
                self.taken += 1
                return self.step
            elif held is None and self.available(replicas, gone) - self._extra > 0:
                self._holders[index] = incarnation
                self.taken += 1
                return self.step
        if self._extra > 0:
            self._extra -= 1
            self.taken += 1
            return self.step
        return None


class ReleasedTokens:
    """A PS's share of the chief's token queue: the step whose tokens the chief
    released last (every PS applied it and its checkpoint was taken), handed to each
    worker that asks this PS and has not computed it yet.

    The chief tells every PS each release with its ``wait_step`` long poll (no message
    of its own), and names in each token it hands which PS a worker asks for the
    next one: the chief then hears no request per worker and step. The rules are the
    ledger's (:class:`TokenLedger`) where M is every live worker, the only case the
    chief names a PS for (no ``init_tokens`` left, ``total_replicas`` not below the
    workers): one token of a step per worker that says it has not computed it, the
    same one again for a request sent again.

    * ``have`` of another generation than the release's: older means nothing computed
      (the steps went back with a restore); newer means this PS has not heard of the
      restore's release yet, and the worker waits for it.
    * A restore forgets the release (:meth:`clear`): the chief's next one comes with
      its first ``wait_step`` to the restored PS.
    * The chief may let a PS release the step it waits for by itself, the moment
      the PS applied it (:meth:`allow`, :meth:`reached`): it does so only for a
      boundary it needs nothing at (no checkpoint due, nothing of the membership
      to settle) and when this PS is the only one holding shards, so a token of the
      step never lets a worker pull values of before it. The chief then is off the
      step's path; it hears of the step as before, and releases it again (no news).
    * With one PS holding shards the chief may let it release every step up to the
      one before the next boundary it must see (:meth:`allow_until`: a checkpoint
      due, at most :data:`~zmqps.roles.chief.modes.AHEAD_STEPS` ahead): it then
      polls about once a second, not once a step, and a membership change takes the
      allowance back (a stepping poll without it) before the chief looks at who
      holds what.
    * How long each answered request waited is kept for the chief (at most
      ``max_waits`` between two of its looks; the rest are counted only).
    """

    def __init__(self, max_waits: int = 1 << 14) -> None:
        self.step: int | None = None
        self.gen: int | None = None
        self.granted = 0  # tokens of ``step`` handed (a request sent again counts again)
        self.max_waits = max_waits
        self._waits: list[float] = []
        #: the step (and generation) this PS may release by itself once it reached it
        self.then: tuple[int, int] | None = None
        #: ``then`` of :meth:`allow_until` holds until then (the PS's clock), or None
        self.lease: float | None = None
        #: the release before the current one and its tokens handed, when this PS
        #: moved on by itself (the chief's report of it is then still to come)
        self._before: tuple[int, int] | None = None

    def release(self, step: int, gen: int) -> bool:
        """The chief released ``step`` (generation ``gen``); True if that is news (an
        older release, resent or late, changes nothing)."""
        if self.gen is not None and (gen, step) <= (self.gen, self.step or 0):
            return False
        self.step, self.gen, self.granted = step, gen, 0
        self._before = None
        if self.then is not None and (self.then[1], self.then[0]) <= (gen, step):
            self.then = None
        return True

    def allow(self, step: int, gen: int) -> None:
        """The chief lets this PS release ``step`` (generation ``gen``) by itself the
        moment it reached it (:meth:`reached`); an older or a released step is no news."""
        if self.gen is not None and (gen, step) <= (self.gen, self.step or 0):
            return
        if self.then is None or (self.then[1], self.then[0]) < (gen, step):
            self.then = (step, gen)
            self.lease = None

    def allow_until(self, until: int, gen: int, lease: float | None = None) -> None:
        """The chief lets this PS release every step up to ``until`` (generation
        ``gen``) by itself, each the moment it reached it (:meth:`reached`), until
        the clock passes ``lease`` (a chief that stopped polling, or one that came
        back and does not release, is not followed for ever). The chief's last word:
        it replaces what an earlier poll allowed (a smaller ``until`` stops the PS
        sooner; one not past the release allows nothing)."""
        self.lease = lease
        if self.gen is not None and (gen, until) <= (self.gen, self.step or 0):
            self.then = None
        else:
            self.then = (until, gen)

    def reached(self, step: int, gen: int, now: float | None = None) -> bool:
        """This PS (generation ``gen``) is at ``step`` (at ``now`` on the clock of
        the lease): True if that released a step the chief allowed (:meth:`allow`,
        :meth:`allow_until`: the step reached, or the last one allowed if it is past
        it; one of another generation, or past the lease, never is)."""
        then = self.then
        if then is None:
            return False
        lease = self.lease
        if then[1] != gen or (lease is not None and now is not None and now > lease):
            self.then = None
            return False
        upto = min(step, then[0])
        if self.gen != gen or self.step is None or upto <= self.step:
            return False  # nothing reached past a release of this generation yet
        before = (self.step, self.granted)
        if not self.release(upto, gen):
            return False
        if before[0] is not None:
            self._before = (before[0], before[1])
        return True

    def clear(self) -> None:
        """A restore: the steps went back; nothing is handed until the next release."""
        self.step = self.gen = None
        self.granted = 0
        self.then = self._before = None

    def grant(self, have: int | None, have_gen: int | None) -> tuple[int, int] | None:
        """The token (step, generation) for a worker that computed ``have`` last (in
        generation ``have_gen``), or None: it waits for the next release."""
        if self.step is None or self.gen is None:
            return None
        if have_gen is not None and have_gen != self.gen:
            if have_gen > self.gen:
                return None  # a release this PS has not heard of yet
            have = -1
        if have is not None and have >= self.step:
            return None
        self.granted += 1
        return self.step, self.gen

    def waited(self, seconds: float) -> None:
        if len(self._waits) < self.max_waits:
            self._waits.append(seconds)

    def report(self, of: int | None = None) -> tuple[int | None, int, list[float]]:
        """What the chief is told: the release (``of``, the one it asks about, while
        this PS still knows it: it may have moved on by itself), its tokens handed, and
        the waits since the last report (taken)."""
        waits, self._waits = self._waits, []
        before = self._before
        if before is not None and of is not None and before[0] == of:
            return before[0], before[1], waits
        return self.step, self.granted, waits


class StalenessBound:
    """Stale synchronous parallel: clocks are completed steps per worker."""

    def __init__(self, max_staleness: int) -> None:
        if max_staleness < 0:
            raise InvalidArgument("max_staleness must be >= 0")
        self.max_staleness = max_staleness
        self.clocks: dict[int, int] = {}
        self.max_spread = 0

    def report(self, worker: int, completed: int) -> None:
        self.clocks[worker] = max(self.clocks.get(worker, 0), completed)

    def slowest(self, live: Iterable[int]) -> int | None:
        clocks = [self.clocks.get(w, 0) for w in live]
        return min(clocks) if clocks else None

    def may_start(self, step: int, live: Iterable[int]) -> bool:
        """May a worker start (0-based) step ``step``, given the live workers' clocks?

        Granting records the spread ``step - slowest`` (the largest ever granted is
        ``max_spread``, never above ``max_staleness``).
        """
        slowest = self.slowest(live)
        if slowest is not None and step - slowest > self.max_staleness:
            return False
        self.max_spread = max(self.max_spread, step - (slowest if slowest is not None else step))
        return True

    def snapshot(self) -> Mapping[str, Any]:
        return {
            "max_staleness": self.max_staleness,
            "clocks": {str(k): v for k, v in sorted(self.clocks.items())},
            "max_spread": self.max_spread,
        }
