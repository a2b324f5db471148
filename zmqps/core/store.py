"""The PS-side shard store: shard values, optimizer slots, versions and staleness.

Rules of this module:

* The store owns every shard's values and slots; nothing outside writes them. It
  knows nothing about sockets, threads or clocks: callers serialize access. (A
  large dense update is cut into pieces run at once by the caller's ``parts``
  runner, :class:`~zmqps.core.finite.Parts`, within the call.)
* Every request is validated completely BEFORE any state changes, so a refused
  request (:class:`~zmqps.wire.errors.InvalidArgument` / ``NotFound``) changes
  nothing.
* A shard's ``version`` starts at 0 and grows by 1 per applied update; it is also
  the 1-based ``step`` handed to the optimizer. Staleness of an update is
  ``version before the apply - version the gradient was pulled at``.
* Dense updates allocate no arrays: gradient chunks are applied in place, in pieces
  of at most ``chunk_elems`` elements, through one scratch buffer owned by the store.
* Reads (:meth:`ShardStore.snapshot`, :meth:`ShardStore.pull_rows`) return copies:
  a consistent snapshot at one version, never a live buffer.
* Shards of hash-keyed tables (:class:`~zmqps.core.hashshard.HashShard`) are addressed
  by int64 id: ``pull_rows`` / ``apply_rows`` take ids (a pull may create rows; a
  read-only pull, ``create=False``, never does), and every dense access to them is
  refused.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.core import _kernels, lowp
from zmqps.core.finite import PARALLEL_BYTES, Parts
from zmqps.core.initializers import initialize, validate_init
from zmqps.core.optimizers import BLOCK_ELEMS, Optimizer, compute_dtype, make_optimizer
from zmqps.core.packs import plan_packs
from zmqps.core.segments import sum_rows
from zmqps.core.variables import ShardDef
from zmqps.wire.errors import InvalidArgument, NonFiniteGradient, NotFound, RolledBack

__all__ = [
    "HISTOGRAM_EXACT",
    "DenseUpdate",
    "Pack",
    "PackUpdate",
    "RowUpdate",
    "Shard",
    "ShardStore",
    "StalenessStats",
    "Update",
]

Array = npt.NDArray[Any]

#: The most bytes of row values one page of a table listing carries (``table_page``).
TABLE_PAGE_BYTES = 16 << 20

#: StalenessStats counts staleness values 0..HISTOGRAM_EXACT-1 exactly, the rest together.
HISTOGRAM_EXACT = 64


class StalenessStats:
    """Count, sum, max and a bounded histogram of staleness values (in updates)."""

    def __init__(self) -> None:
        self.count = 0
        self.sum = 0
        self.max = 0
        #: ``histogram[s]`` for ``s < HISTOGRAM_EXACT``; the last bucket is the overflow.
        self.histogram = [0] * (HISTOGRAM_EXACT + 1)

    def add(self, staleness: int) -> None:
        self.count += 1
        self.sum += staleness
        self.max = max(self.max, staleness)
        self.histogram[min(staleness, HISTOGRAM_EXACT)] += 1

    def add_all(self, values: Sequence[int]) -> None:
        """:meth:`add` each of ``values`` (a pack's members)."""
        if not values:
            return
        top = max(values)
        self.count += len(values)
        self.sum += sum(values)
        self.max = max(self.max, top)
        if top == 0:  # the usual case: every member fresh
            self.histogram[0] += len(values)
            return
        for staleness in values:
            self.histogram[min(staleness, HISTOGRAM_EXACT)] += 1

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary; ``histogram`` maps ``"0".."63"`` and ``"64+"`` to non-zero counts."""
        hist = {
            (str(s) if s < HISTOGRAM_EXACT else f"{HISTOGRAM_EXACT}+"): c
            for s, c in enumerate(self.histogram)
            if c
        }
        return {
            "count": self.count,
            "sum": self.sum,
            "mean": self.mean,
            "max": self.max,
            "histogram": hist,
        }


def _into_spare(holder: Shard | Pack, values: Array) -> Array:
    """A copy of ``values`` in ``holder``'s spare buffer, taken, when no send holds it any
    more, else in a new array (copy-on-write)."""
    spare, holder.spare = holder.spare, None
    if spare is None or sys.getrefcount(spare) > 2:  # the local name + the argument
        spare = np.empty_like(values)
    np.copyto(spare, values)
    return spare


@dataclass
class Shard:
    """One shard: values of ``definition.shape``, slots of the same shape, a version.

    Slots have the optimizer's compute dtype (float32 for a float16 shard).
    """

    definition: ShardDef
    values: Array
    slots: dict[str, Array]
    optimizer: Optimizer
    version: int = 0
    #: Flat (1-D) views of values and slots, made once.
    flat: Array = field(init=False, repr=False)
    flat_slots: dict[str, Array] = field(init=False, repr=False)

    #: A spare buffer for copy-on-write (reused once nothing references it).
    spare: Array | None = field(init=False, repr=False, default=None)
    #: The values rounded to the shard's wire dtype, and the version they are of: every
    #: pull of that version sends this one array, lent (a peer that never reads its
    #: replies pins one per version, as a lent float32 buffer does, not one per pull).
    #: A whole-shard update writes it in its own pass over the values (the fused
    #: kernels' ``w``); any other write leaves it at an older version, and the next
    #: pull rounds the values again (:meth:`ShardStore.snapshot_wire`)
    wire_copy: tuple[int, Array] | None = field(init=False, repr=False, default=None)
    #: a second wire-copy buffer, reused once no send holds it (double buffering)
    wire_spare: Array | None = field(init=False, repr=False, default=None)
    #: the pack whose buffers hold this shard's values and slots (None: its own arrays);
    #: lending and copy-on-write are then the pack's (:class:`Pack`)
    pack: Pack | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if self.values.base is not None:  # must own its data: views of it reference it
            self.values = self.values.copy()
        self._views()
        self.flat_slots = {k: v.reshape(-1) for k, v in self.slots.items()}

    def _views(self) -> None:
        self.flat = self.values.reshape(-1)

    def lend(self) -> Array:
        """The live values, flat, to hand to a zero-copy send. They stay unchanged while
        anything still references them: :meth:`own` copies before the next update."""
        if self.pack is not None:  # a view of its own, counted as the pack's buffer's
            return self.flat[:]
        return self.flat

    #: references to ``values`` that are the shard's own: the attribute, the base of
    #: ``flat``, and getrefcount's argument
    OWN_REFS = 3

    def is_lent(self) -> bool:
        """Does anything beyond the shard (a frame in flight) still reference the values?

        Read ``shard.values`` afresh: after an update it may be another buffer."""
        if self.pack is not None:
            return self.pack.is_lent()
        return sys.getrefcount(self.values) > self.OWN_REFS

    def own(self) -> bool:
        """Make ``values`` safe to update in place; True if that took a copy
        (copy-on-write: the lent buffer goes on serving the sends that hold it)."""
        if self.pack is not None:
            return self.pack.own()
        if not self.is_lent():
            return False
        self.values, lent = _into_spare(self, self.values), self.values
        self._views()
        self.spare = lent  # free again once the sends that hold it are done
        return True

    @property
    def keeps_wire_copy(self) -> bool:
        """Whether whole-shard updates write the wire copy as they go: a dense float32
        shard of its own that travels narrower (bfloat16)."""
        return (
            not self.is_table
            and self.pack is None
            and self.values.dtype == np.float32
            and lowp.is_narrow(self.definition.wire_dtype)
        )

    def wire_buffer(self) -> Array:
        """A flat buffer of the wire dtype for the next wire copy, that no send holds:
        the current copy's or the spare's, whichever is free (a held one becomes the
        spare), else a new one. The current copy is dropped: the caller writes the
        buffer and sets :attr:`wire_copy`."""
        cached, self.wire_copy = self.wire_copy, None
        current = None if cached is None else cached[1]
        del cached  # (the tuple's reference)
        spare, self.wire_spare = self.wire_spare, None
        # a free buffer is referenced by its local name and getrefcount's argument
        if current is not None and sys.getrefcount(current) <= 2:
            self.wire_spare = spare
            return current
        if spare is not None and sys.getrefcount(spare) <= 2:
            self.wire_spare = current
            return spare
        self.wire_spare = current if current is not None else spare
        return np.empty(self.definition.size, self.definition.wire_dtype)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + sum(s.nbytes for s in self.slots.values()))

    @functools.cached_property
    def row_width(self) -> int:
        """Values in one row (1 for a 1-D variable)."""
        return math.prod(self.definition.shape[1:])

    @functools.cached_property
    def row_wire(self) -> tuple[np.dtype[Any], tuple[int, ...]]:
        """The dtype rows travel as and the shape of one row (its definition's)."""
        return self.definition.wire_dtype, self.definition.shape[1:]

    # -- the shard protocol: what the store asks of a shard, dense or hash-keyed ------

    #: a hash-keyed table's shard (rows by id) rather than a dense one
    is_table = False

    def dense(self) -> Shard:
        """This shard, for whole-shard access (a table refuses it)."""
        return self

    def row_keys(self, indices: Array, create: bool = True) -> Array:
        """The validated keys of GLOBAL row ``indices``: here, local row numbers."""
        d = self.definition
        if (
            not isinstance(indices, np.ndarray)
            or indices.ndim != 1
            or indices.dtype.kind not in "iu"
        ):
            raise InvalidArgument(f"shard {d.id}: row indices must be a 1-D integer array")
        local = _kernels.index_kernel("local_rows", indices)
        if local is not None:  # int64 ids (what clients send): one pass
            keys = np.empty(indices.shape[0], np.int64)
            if not local(indices, d.row_start, d.rows, keys):
                raise InvalidArgument(
                    f"shard {d.id}: row index outside [{d.row_start}, {d.row_start + d.rows})"
                )
            return keys
        if indices.shape[0] and (
            int(indices.min()) < d.row_start or int(indices.max()) >= d.row_start + d.rows
        ):
            raise InvalidArgument(
                f"shard {d.id}: row index outside [{d.row_start}, {d.row_start + d.rows})"
            )
        return indices.astype(np.int64) - d.row_start

    def read_rows(self, keys: Array, create: bool, out: Array | None = None) -> Array:
        """The rows of validated ``keys`` (a copy, or written into ``out``: a place in a
        shared-memory region); fixed-size rows never change."""
        if out is None:
            return self.values.take(keys, axis=0)
        # the keys are validated: "clip" changes none of them and writes out unbuffered
        return self.values.take(keys, axis=0, out=out, mode="clip")

    def values2d(self) -> Array:
        """The values as ``(rows, row width)`` (a view)."""
        return self.values.reshape(self.values.shape[0], -1)

    def slots2d(self) -> dict[str, Array]:
        return {k: v.reshape(v.shape[0], -1) for k, v in self.slots.items()}

    def apply_row_grads(self, keys: Array, grad_rows: Array, scale: float) -> None:
        """Apply gradients of validated row ``keys`` (duplicates summed first, in one
        pass; keys strictly increasing, as clients send them, are not sorted again);
        the caller made the values its own (:meth:`own`)."""
        grad2d = grad_rows.reshape(keys.shape[0], self.row_width)  # explicit: 0 rows too
        keys, grad2d = summed_rows(keys, grad2d)
        values2d = self.values.reshape(self.values.shape[0], -1)
        slots2d = {k: v.reshape(v.shape[0], -1) for k, v in self.slots.items()}
        self.optimizer.apply_rows(
            values2d, keys, grad2d, slots2d, self.version + 1, scale, checked=True
        )

    def page(self, start: int, limit: int) -> tuple[Array, Array, int]:
        """Live rows in id order: only hash-keyed tables list their rows."""
        raise InvalidArgument(f"shard {self.definition.id} is not a hash-keyed table")


class Pack:
    """Shards of one PS laid out back to back (:mod:`zmqps.core.packs`): one buffer of
    values and one per optimizer slot, each member's arrays views of them.

    A pull sends the values buffer whole (lent, as a shard lends its values) and a push
    of every member is checked once and applied by one optimizer call when the members
    are at one version. Copy-on-write is the pack's: while a send holds the buffer
    (anything beyond the pack and its members' views references it), :meth:`own` copies
    it and points every member at the copy.
    """

    def __init__(self, members: Sequence[Shard]) -> None:
        first = members[0]
        self.members = list(members)
        self.ids = tuple(m.definition.id for m in members)
        sizes = [m.definition.size for m in members]
        self.bounds = [0, *itertools.accumulate(sizes)]
        self.size = self.bounds[-1]
        self.optimizer = first.optimizer
        self.buf: Array = np.empty(self.size, first.values.dtype)
        self.slots = {k: np.empty(self.size, v.dtype) for k, v in first.slots.items()}
        for m, lo, hi in self.spans():
            self.buf[lo:hi] = m.values.reshape(-1)
            for k, slot in self.slots.items():
                slot[lo:hi] = m.slots[k].reshape(-1)
        self.spare: Array | None = None
        for m, lo, hi in self.spans():
            m.slots = {k: v[lo:hi].reshape(m.definition.shape) for k, v in self.slots.items()}
            m.flat_slots = {k: v[lo:hi] for k, v in self.slots.items()}
            m.pack, m.spare, m.wire_copy = self, None, None
        self._point()

    def spans(self) -> Iterator[tuple[Shard, int, int]]:
        b = self.bounds
        return ((m, b[i], b[i + 1]) for i, m in enumerate(self.members))

    def _point(self) -> None:
        """Every member's values as views of the current buffer."""
        for m, lo, hi in self.spans():
            m.flat = self.buf[lo:hi]
            m.values = m.flat.reshape(m.definition.shape)
        self._own_refs = sys.getrefcount(self.buf)

    def lend(self) -> Array:
        """The values buffer whole, to hand to a zero-copy send (see :meth:`own`)."""
        return self.buf

    def is_lent(self) -> bool:
        return sys.getrefcount(self.buf) > self._own_refs

    def own(self) -> bool:
        """Make the buffer safe to update in place; True if that took a copy."""
        if not self.is_lent():
            return False
        self.buf, lent = _into_spare(self, self.buf), self.buf
        self._point()
        self.spare = lent  # free again once the sends that hold it are done
        return True

    def versions(self) -> list[int]:
        return [m.version for m in self.members]


@dataclass
class _Undo:
    """The values and slots one update may change, saved (float16 updates only)."""

    shard: Shard
    rows: Array | None  # the rows a row update touches; None: the whole shard
    values: Array
    slots: dict[str, Array]

    @classmethod
    def save(cls, update: DenseUpdate | RowUpdate) -> _Undo:
        shard = update.shard
        if isinstance(update, RowUpdate):
            if shard.is_table:  # the rows it will update (created now if new: see apply)
                rows = shard.rows_for(np.unique(update.keys), sighting=False)  # type: ignore[attr-defined]
                rows = rows[rows >= 0]
            else:
                rows = np.unique(update.keys)
            values, slots = shard.values2d(), shard.slots2d()
            return cls(shard, rows, values[rows], {k: v[rows] for k, v in slots.items()})
        return cls(shard, None, shard.values.copy(), {k: v.copy() for k, v in shard.slots.items()})

    def finite(self) -> bool:
        """No value that was finite before the update is infinite (or NaN) after it (one
        already infinite, e.g. from an older checkpoint, is not this update's doing)."""
        now = self.shard.values2d()[self.rows] if self.rows is not None else self.shard.values
        if np.isfinite(now).all():
            return True
        return not bool((np.isfinite(self.values) & ~np.isfinite(now)).any())

    def restore(self) -> None:
        if self.rows is None:
            np.copyto(self.shard.values, self.values)
            for k, v in self.shard.slots.items():
                np.copyto(v, self.slots[k])
            return
        self.shard.values2d()[self.rows] = self.values
        for k, v in self.shard.slots2d().items():
            v[self.rows] = self.slots[k]


@dataclass(frozen=True, slots=True)
class DenseUpdate:
    """A validated whole-shard gradient: ``chunks`` tile the shard exactly."""

    shard: Shard
    chunks: Sequence[tuple[int, Array]]
    staleness: int


@dataclass(frozen=True, slots=True)
class RowUpdate:
    """Validated row gradients: ``keys`` as the shard addresses its rows."""

    shard: Shard
    keys: Array
    grads: Array
    staleness: int


@dataclass(frozen=True, slots=True)
class PackUpdate:
    """A validated gradient of every member of a pack, back to back (``grad``: 1-D,
    the pack's size), with each member's staleness."""

    pack: Pack
    grad: Array
    staleness: list[int]


Update = DenseUpdate | RowUpdate | PackUpdate


def summed_rows(keys: Array, grad2d: Array) -> tuple[Array, Array]:
    """``(distinct keys ascending, their gradient rows)``: the rows of a repeated key
    summed in the order they came (:func:`~zmqps.core.segments.sum_rows`), in the
    compute dtype (float32 at least). Keys already strictly increasing (what clients
    send) come back as they are, with no sort and no copy."""
    if keys.shape[0] < 2:
        return keys, grad2d
    increasing = _kernels.index_kernel("increasing", keys)
    if increasing(keys) if increasing is not None else bool((keys[1:] > keys[:-1]).all()):
        return keys, grad2d
    uniq, inverse = np.unique(keys, return_inverse=True)
    want = np.promote_types(grad2d.dtype, np.float32)
    if want == grad2d.dtype:
        return uniq, sum_rows(grad2d, inverse, uniq.shape[0])
    summed = np.zeros((uniq.shape[0], grad2d.shape[1]), want)  # float16, bfloat16
    np.add.at(summed, inverse.reshape(-1), grad2d)
    return uniq, summed


ShardObserver = Callable[[ShardDef, int], None]
_NO_CONTEXT = contextlib.nullcontext()


def _is_float(dtype: np.dtype[Any]) -> bool:
    """A float dtype a gradient may have (bfloat16 included: numpy counts it a void)."""
    return dtype.kind == "f" or lowp.is_narrow(dtype)


#: ``(available, total)`` bytes of the machine's memory, None where unknown
MemoryReader = Callable[[], "tuple[int, int] | None"]


class ShardStore:
    """Shards held by one PS, and the updates applied to them.

    ``observer(shard_def, staleness)`` is called after every applied update (metrics).
    ``memory()`` says ``(available, total)`` bytes of the machine (None: unknown): a
    hash table without a ``row_budget`` may grow only while its new rows fit in half
    of what is available (:meth:`_check_growth`), so no client naming new ids can
    take the machine's memory.
    """

    def __init__(
        self,
        chunk_elems: int = 1 << 20,
        observer: ShardObserver | None = None,
        memory: MemoryReader | None = None,
        parts: Parts | None = None,
    ) -> None:
        if chunk_elems < 1:
            raise InvalidArgument(f"chunk_elems must be >= 1, got {chunk_elems}")
        self.chunk_elems = chunk_elems
        #: runs the pieces of a large dense update at once (the PS's threads; see
        #: :meth:`_update_values`), or None: one after the other
        self.parts = parts
        self.observer = observer
        self.memory = memory
        self.staleness = StalenessStats()
        self.updates_applied = 0
        #: updates that first copied values still lent to a send (copy-on-write)
        self.copies_on_write = 0
        self._shards: dict[int, Shard] = {}
        #: packs by their first shard's id (:mod:`zmqps.core.packs`)
        self._packs: dict[int, Pack] = {}
        self._scratch = np.empty(0, dtype=np.uint8)

    # -- shards --------------------------------------------------------------

    def create(self, defs: Sequence[ShardDef]) -> None:
        """Create shards (idempotent for identical definitions); all or nothing.

        Raises InvalidArgument if a definition is invalid (optimizer, initializer) or
        conflicts with an existing shard or another definition of the same id.
        """
        new: dict[int, ShardDef] = {}
        for d in defs:
            existing = self._shards.get(d.id)
            other = new.get(d.id)
            if existing is not None and existing.definition != d:
                raise InvalidArgument(f"shard {d.id} exists with a different definition")
            if other is not None and other != d:
                raise InvalidArgument(f"shard {d.id} defined twice, differently")
            make_optimizer(d.optimizer)
            validate_init(d.init)
            if existing is None:
                new[d.id] = d
        made = {sid: self._make(d) for sid, d in new.items()}  # may still refuse (overflow)
        self._shards.update(made)
        self._pack(made.values())

    def bytes_to_create(self, defs: Sequence[ShardDef]) -> int:
        """Bytes the shards of ``defs`` not held yet would allocate at creation (values
        and slots; a hash-keyed table's first rows): refuse before allocating."""
        from zmqps.core.hashshard import INITIAL_CAPACITY

        total = 0
        for d in {d.id: d for d in defs if d.id not in self._shards}.values():
            slots = len(make_optimizer(d.optimizer).slot_names)
            width, rows = math.prod(d.shape[1:]), d.rows
            if d.table is not None:
                budget = d.table.get("row_budget")
                rows = (
                    min(INITIAL_CAPACITY, budget) if isinstance(budget, int) else INITIAL_CAPACITY
                )
            item = np.dtype(d.dtype).itemsize
            total += rows * width * (item + slots * compute_dtype(d.dtype).itemsize)
        return total

    def replace(
        self,
        states: Sequence[tuple[ShardDef, Array, Mapping[str, Array], int]],
        tables: Sequence[tuple[ShardDef, Array, Array, Mapping[str, Array], Array, int]] = (),
    ) -> None:
        """Replace every shard with the given ``(definition, values, slots, version)``
        (a restore) and hash-table shards ``(definition, ids, values, slots, touched,
        version)``; all or nothing: everything is checked before the store changes.

        The arrays are copied. Slots must be exactly the optimizer's slots.
        """
        hashed = self._restored_tables(tables)
        made: dict[int, Shard] = {}
        for d, values, slots, version in states:
            if d.id in made:
                raise InvalidArgument(f"shard {d.id} restored twice")
            optimizer = make_optimizer(d.optimizer)
            validate_init(d.init)
            expected = optimizer.init_slots((1,) * len(d.shape), d.dtype)
            if values.shape != d.shape or values.dtype != np.dtype(d.dtype):
                raise InvalidArgument(
                    f"shard {d.id}: restored values {values.dtype}{list(values.shape)},"
                    f" expected {d.dtype}{list(d.shape)}"
                )
            if set(slots) != set(expected):
                raise InvalidArgument(
                    f"shard {d.id}: restored slots {sorted(slots)}, expected {sorted(expected)}"
                )
            own_slots = {}
            for name, ref in expected.items():
                slot = slots[name]
                if slot.shape != d.shape or slot.dtype != ref.dtype:
                    raise InvalidArgument(
                        f"shard {d.id}: slot {name} is {slot.dtype}{list(slot.shape)},"
                        f" expected {ref.dtype}{list(d.shape)}"
                    )
                own_slots[name] = np.array(slot, copy=True, order="C")
            if version < 0:
                raise InvalidArgument(f"shard {d.id}: negative version {version}")
            made[d.id] = Shard(
                d, np.array(values, copy=True, order="C"), own_slots, optimizer, int(version)
            )
        if set(made) & set(hashed):
            raise InvalidArgument("a shard is restored twice")
        self._shards = {**made, **hashed}
        self._packs = {}
        self._pack(made.values())

    @staticmethod
    def _restored_tables(
        states: Sequence[tuple[ShardDef, Array, Array, Mapping[str, Array], Array, int]],
    ) -> dict[int, Shard]:
        """Hash shards built (validated, copied) from restored rows."""
        from zmqps.core.hashshard import HashShard

        made: dict[int, Shard] = {}
        for d, ids, values, slots, touched, version in states:
            if d.table is None or d.id in made:
                raise InvalidArgument(f"shard {d.id}: not a hash-table shard, or twice")
            shard = HashShard.make(d)
            n, row = ids.shape[0], tuple(d.shape[1:])
            if ids.dtype != np.int64 or ids.ndim != 1 or np.unique(ids).size != n:
                raise InvalidArgument(f"shard {d.id}: restored ids must be unique int64")
            if values.shape != (n, *row) or values.dtype != np.dtype(d.dtype):
                raise InvalidArgument(f"shard {d.id}: restored rows {values.shape} do not match")
            if set(slots) != set(shard.slots) or touched.shape != (n,) or version < 0:
                raise InvalidArgument(f"shard {d.id}: restored slots or stamps do not match")
            shard.check_buckets(ids)
            shard.load(ids, values, slots, touched, int(version))
            made[d.id] = shard
        return made

    def install(self, shards: Sequence[Shard]) -> None:
        """Hold exactly ``shards`` (a whole copy of another PS's state, built and
        checked by the caller; its dense shards are packed here)."""
        self._shards = {sh.definition.id: sh for sh in shards}
        self._packs = {}
        self._pack(shards)

    def clear(self) -> None:
        """Drop every shard (a restore to the initial values re-creates them)."""
        self._shards = {}
        self._packs = {}

    def _pack(self, shards: Iterable[Shard]) -> None:
        """Lay out the packable ones of ``shards`` (not packed yet) in packs."""
        free = {sh.definition.id: sh for sh in shards if not sh.is_table and sh.pack is None}
        for ids in plan_packs(sh.definition for sh in free.values()):
            self._packs[ids[0]] = Pack([free[sid] for sid in ids])

    def pack_of(self, sids: Sequence[int]) -> Pack | None:
        """The pack whose members are exactly ``sids``, in order (None: no such pack)."""
        pack = self._packs.get(sids[0]) if sids else None
        if pack is None or len(pack.ids) != len(sids) or pack.ids != tuple(sids):
            return None
        return pack

    def packs(self) -> list[Pack]:
        return list(self._packs.values())

    @staticmethod
    def _make(d: ShardDef) -> Shard:
        if d.table is not None:  # the one place the kind of shard is chosen
            from zmqps.core.hashshard import HashShard

            return HashShard.make(d)
        optimizer = make_optimizer(d.optimizer)
        values = initialize(d.init, d.var, d.full_shape, d.dtype, d.row_start, d.rows)
        return Shard(d, values, optimizer.init_slots(d.shape, d.dtype), optimizer)

    def get(self, shard_id: int) -> Shard:
        try:
            return self._shards[shard_id]
        except KeyError:
            raise NotFound(f"no shard {shard_id} on this PS") from None

    def __contains__(self, shard_id: object) -> bool:
        return shard_id in self._shards

    def __len__(self) -> int:
        return len(self._shards)

    def __iter__(self) -> Iterator[Shard]:
        return iter(self._shards.values())

    def ids(self) -> list[int]:
        return sorted(self._shards)

    def nbytes(self) -> int:
        """Bytes held in values and slots of every shard."""
        return sum(s.nbytes for s in self._shards.values())

    # -- reads ---------------------------------------------------------------

    def get_dense(self, shard_id: int) -> Shard:
        """The shard, refused (InvalidArgument) if it is a hash-keyed table."""
        shard = self._shards.get(shard_id)
        if shard is None:
            raise NotFound(f"no shard {shard_id} on this PS")
        return shard.dense()

    def tables(self) -> list[Any]:
        """Shards of hash-keyed tables held here (``HashShard``)."""
        return [s for s in self._shards.values() if s.is_table]

    def table_stats(self) -> dict[str, dict[str, Any]]:
        """Per hash-keyed variable, the stats of its shards here summed (rows, created,
        admitted, not_admitted, evicted by reason)."""
        out: dict[str, dict[str, Any]] = {}
        for t in self.tables():
            st = t.stats()
            acc = out.setdefault(
                t.definition.var,
                {"rows": 0, "created": 0, "admitted": 0, "not_admitted": 0, "evicted": {}},
            )
            for k in ("rows", "created", "admitted", "not_admitted"):
                acc[k] += st[k]
            for reason, n in st["evicted"].items():
                acc["evicted"][reason] = acc["evicted"].get(reason, 0) + n
        return out

    def snapshot(self, shard_id: int) -> tuple[int, Array]:
        """``(version, copy of the values)``: a consistent snapshot of the shard."""
        shard = self.get_dense(shard_id)
        return shard.version, shard.values.copy()

    def snapshot_into(self, shard_id: int, out: Array, parts: Any = None) -> int:
        """Copy the shard's values into ``out`` (same shape; the shard's dtype, or its
        wire dtype: rounded to it, by ``parts``' threads if given); returns the version."""
        shard = self.get_dense(shard_id)
        narrow = out.dtype == shard.definition.wire_dtype and lowp.is_narrow(out.dtype)
        if out.shape != shard.values.shape or (out.dtype != shard.values.dtype and not narrow):
            raise InvalidArgument(
                f"snapshot_into: out is {out.dtype}{out.shape},"
                f" shard {shard_id} is {shard.values.dtype}{shard.values.shape}"
            )
        if narrow:
            lowp.narrow(shard.values, out.reshape(-1), parts)
        else:
            np.copyto(out, shard.values)
        return shard.version

    def snapshot_wire(self, shard_id: int, parts: Any = None) -> tuple[int, Array]:
        """``(version, values)`` as they travel: the live values themselves (lent: the
        next update copies first), or their copy rounded to the shard's wire dtype,
        lent likewise (the next update writes another buffer while a send holds it):
        the one a whole-shard update wrote as it went, else rounded now (by ``parts``'
        threads if given), once per version."""
        shard = self.get_dense(shard_id)
        if not lowp.is_narrow(shard.definition.wire_dtype):
            return shard.version, shard.lend()
        cached = shard.wire_copy
        if cached is None or cached[0] != shard.version:
            # values change only with the version (a refused float16 update is undone
            # whole; a restore makes new shards): the rounded copy of a version holds
            out = shard.wire_buffer()
            lowp.narrow(shard.values, out, parts)
            cached = shard.wire_copy = (shard.version, out)
        return cached

    def pull_rows(self, shard_id: int, indices: Array, create: bool = True) -> tuple[int, Array]:
        """``(version, rows)`` for GLOBAL row ids ``indices``; rows is ``(k, *row_shape)``.

        For a hash-keyed table ``indices`` are ids; rows are created on first touch,
        unless ``create`` is False: then nothing changes and ids without a row read as
        their initial value (zeros while not admitted). Fixed-size rows never change."""
        return self.pull_rows_of([(shard_id, indices)], create)[0]

    def pull_rows_of(
        self,
        requests: Sequence[tuple[int, Array]],
        create: bool = True,
        out: Sequence[Array] | None = None,
    ) -> list[tuple[int, Array]]:
        """:meth:`pull_rows` of several shards, all or nothing: every shard's ids are
        validated before the first row is created. ``out``: where each shard's rows
        go (places of the right shape in a shared-memory region), else copies."""
        keyed = self.check_pull_rows(requests, create)
        places: Sequence[Array | None] = [None] * len(keyed) if out is None else out
        return [
            (shard.version, shard.read_rows(keys, create, place))
            for (shard, keys), place in zip(keyed, places, strict=True)
        ]

    def check_pull_rows(
        self, requests: Sequence[tuple[int, Array]], create: bool = True
    ) -> list[tuple[Shard, Array]]:
        """What :meth:`pull_rows_of` checks before it reads (the ids, the room a
        creating pull of a hash table needs), changing nothing: each shard with the
        validated keys of its ids. InvalidArgument or NotFound when the pull would be
        refused."""
        keyed = [(self.get(sid), self.get(sid).row_keys(ids, create)) for sid, ids in requests]
        if create:
            self._check_growth(keyed)
        return keyed

    def table_page(self, shard_id: int, start: int, limit: int) -> tuple[int, Array, Array, int]:
        """``(version, ids, values, live rows)``: live rows ``[start, start + limit)`` of a
        hash-table shard in ascending id order (reads only). InvalidArgument for any
        other shard."""
        shard = self.get(shard_id)
        if start < 0 or limit < 1:
            raise InvalidArgument(f"table page [{start}, +{limit}): bad range")
        # a page is at most TABLE_PAGE_BYTES of values, whatever the request asks
        row_bytes = max(1, math.prod(shard.definition.shape[1:]) * shard.values.itemsize)
        limit = min(limit, max(1, TABLE_PAGE_BYTES // row_bytes))
        ids, values, total = shard.page(start, limit)
        return shard.version, ids, values, total

    # -- updates -------------------------------------------------------------

    def plan_dense(
        self, shard_id: int, chunks: Sequence[tuple[int, Array]], pulled_version: int
    ) -> DenseUpdate:
        """Validate a whole-shard gradient given as flat ``(element offset, chunk)``
        pieces (they must tile ``[0, size)`` exactly, any order, 1-D float arrays);
        changes nothing. :meth:`apply` applies the plan without checking again."""
        shard = self.get_dense(shard_id)
        staleness = self._check_version(shard, pulled_version)
        self._check_tiling(shard, chunks)
        return DenseUpdate(shard, chunks, staleness)

    def plan_pack(self, pack: Pack, grad: Array, pulled_versions: Sequence[int]) -> PackUpdate:
        """Validate a gradient of every member of ``pack``, back to back (1-D, of the
        pack's dtype and size; values are the caller's to check), and the version each
        member was pulled at; changes nothing."""
        if not isinstance(grad, np.ndarray) or grad.ndim != 1 or grad.shape[0] != pack.size:
            raise InvalidArgument(
                f"shards {pack.ids[0]}..{pack.ids[-1]}: a packed gradient of"
                f" {getattr(grad, 'size', '?')} elements, expected {pack.size}"
            )
        if grad.dtype != pack.buf.dtype:
            raise InvalidArgument(
                f"shards {pack.ids[0]}..{pack.ids[-1]}: the gradient is {grad.dtype},"
                f" the variables are {pack.buf.dtype}"
            )
        if len(pulled_versions) != len(pack.members):
            raise InvalidArgument("push: one version per shard expected")
        current = pack.versions()
        if all(type(v) is int for v in pulled_versions):  # the wire's: one pass each
            staleness = [now - v for now, v in zip(current, pulled_versions, strict=True)]
            if min(staleness) >= 0 and min(pulled_versions) >= 0:
                return PackUpdate(pack, grad, staleness)
        staleness = [  # says which member is wrong, and how
            self._check_version(m, v) for m, v in zip(pack.members, pulled_versions, strict=True)
        ]
        return PackUpdate(pack, grad, staleness)

    def plan_rows(
        self,
        shard_id: int,
        indices: Array,
        grad_rows: Array,
        pulled_version: int,
        *,
        growth: bool = True,
    ) -> RowUpdate:
        """Validate gradients of GLOBAL rows ``indices`` (``grad_rows`` of shape
        ``(len(indices), *row_shape)``, a float array; ids for a hash-keyed table);
        changes nothing. ``growth``: check that the rows it creates fit in memory (a
        push as it arrives; not a sync step's mean of pushes checked already)."""
        shard = self.get(shard_id)
        staleness = self._check_version(shard, pulled_version)
        keys = shard.row_keys(indices)
        if growth:
            self._check_growth([(shard, keys)])
        row_shape = shard.definition.shape[1:]
        if not isinstance(grad_rows, np.ndarray) or grad_rows.dtype.kind != "f":
            raise InvalidArgument(f"shard {shard_id}: row gradients must be a float array")
        if grad_rows.shape != (keys.shape[0], *row_shape):
            raise InvalidArgument(
                f"shard {shard_id}: row gradients {grad_rows.shape}"
                f" != {(keys.shape[0], *row_shape)}"
            )
        return RowUpdate(shard, keys, grad_rows, staleness)

    def plan_counted(self, shard_id: int, pulled_version: int, *, rows: bool) -> Update:
        """A push's plan without its gradient, for a backup that replays the pushes of
        a sync step whose sum it was shipped (the counting is the push's, the values
        the sum's); changes nothing."""
        shard = self.get(shard_id)
        staleness = self._check_version(shard, pulled_version)
        if rows:
            width = shard.definition.shape[1:]
            return RowUpdate(
                shard, np.empty(0, np.int64), np.empty((0, *width), shard.values.dtype), staleness
            )
        return DenseUpdate(shard, (), staleness)

    def _check_growth(self, keyed: Sequence[tuple[Shard, Array]]) -> None:
        """InvalidArgument if creating the rows of these validated ids would grow an
        unbounded hash table (no ``row_budget``) past half the machine's available
        memory. Costs nothing while a table has free rows (a growth doubles it)."""
        if self.memory is None:
            return
        need = 0  # the new arrays whole: the old ones live on while they are filled
        for shard, keys in keyed:
            if shard.is_table and shard.config.row_budget is None:  # type: ignore[attr-defined]
                need += shard.growth_bytes(keys)  # type: ignore[attr-defined]
        if not need:
            return
        memory = self.memory()
        if memory is not None and need > memory[0] // 2:
            raise InvalidArgument(
                f"hash table full: its new rows need {need:,} more bytes and this machine"
                f" has {memory[0]:,} available; give the table a row_budget (rows per shard;"
                " the least recently used rows are evicted) or use more PS"
            )

    def apply(self, update: Update, scale: float = 1.0) -> tuple[int, int]:
        """Apply a validated update (from :meth:`plan_dense` / :meth:`plan_rows` in this
        event-loop turn); returns ``(new version, staleness)``. Dense updates allocate
        nothing: chunks go through the optimizer in place, in pieces."""
        return self.apply_all([update], scale)[0]

    def apply_all(self, updates: Sequence[Update], scale: float = 1.0) -> list[tuple[int, int]]:
        """:meth:`apply` each of ``updates`` (one push), all or nothing for float16.

        A float16 parameter is updated in float32 and rounded: a step past 65504 (the
        largest float16) would write an infinity, whatever the pushed values (repeated
        row ids add up; the learning rate multiplies). So the values and slots a float16
        update touches are saved first; if one of them is not finite afterwards, every
        update of the push is undone and NonFiniteGradient raised: nothing changed
        (rows a hash table created for it stay, at their initial values, as a pull's)."""
        scale = self._check_scale(scale)
        journal = [
            _Undo.save(u)
            for u in updates
            if not isinstance(u, PackUpdate) and u.shard.values.dtype == np.float16
        ]
        # (a float16 shard is copied whole per push here: float16 shards are small)
        with np.errstate(over="ignore", invalid="ignore") if journal else _NO_CONTEXT:
            for u in updates:
                self._update_values(u, scale)
        bad = [j for j in journal if not j.finite()]
        if bad:
            for j in reversed(journal):
                j.restore()
            raise NonFiniteGradient(
                f"shard {bad[0].shard.definition.id}: this update would take float16 values"
                " past 65504, the largest float16 (refused: nothing changed; a lower"
                " learning rate, or float32, avoids it)"
            )
        out: list[tuple[int, int]] = []
        for u in updates:
            if isinstance(u, PackUpdate):
                out.extend(self._applied_pack(u))
            else:
                out.append(self._applied(u.shard, u.staleness))
        return out

    def _applied_pack(self, update: PackUpdate) -> list[tuple[int, int]]:
        """:meth:`_applied` for every member of a pack, in one pass."""
        members, staleness = update.pack.members, update.staleness
        versions = []
        for m in members:
            m.version += 1
            versions.append(m.version)
        self.updates_applied += len(members)
        self.staleness.add_all(staleness)
        if self.observer is not None:
            for m, st in zip(members, staleness, strict=True):
                self.observer(m.definition, st)
        return list(zip(versions, staleness, strict=True))

    def _update_pack(self, update: PackUpdate, scale: float) -> None:
        """One optimizer pass over the pack when its members are at one version (the
        optimizer's step is then the same for all), else one per member."""
        pack = update.pack
        if pack.own():
            self.copies_on_write += 1
        versions = pack.versions()
        optimizer, grad = pack.optimizer, update.grad
        if versions.count(versions[0]) == len(versions):
            scratch = self._scratch_of(pack.buf.dtype, optimizer, pack.size)
            self._run(optimizer, pack.buf, pack.slots, grad, 0, versions[0] + 1, scratch, scale)
            return
        for m, lo, hi in pack.spans():
            scratch = self._scratch_for(m)
            self._run(
                m.optimizer, m.flat, m.flat_slots, grad[lo:hi], 0, m.version + 1, scratch, scale
            )

    def _run(
        self,
        optimizer: Optimizer,
        flat: Array,
        slots: Mapping[str, Array],
        chunk: Array,
        offset: int,
        step: int,
        scratch: Array,
        scale: float,
        wire: Array | None = None,
    ) -> None:
        """``chunk`` applied to elements ``[offset, offset + len(chunk))`` of ``flat``, in
        pieces of at most ``chunk_elems`` (and rounded into the same elements of
        ``wire``, the shard's next wire copy, if given)."""
        for lo in range(0, chunk.shape[0], self.chunk_elems):
            hi = min(lo + self.chunk_elems, chunk.shape[0])
            a, b = offset + lo, offset + hi
            optimizer.apply_dense(
                flat[a:b],
                chunk[lo:hi],
                {k: v[a:b] for k, v in slots.items()},
                step,
                scratch,
                scale,
                None if wire is None else wire[a:b],
            )

    def _update_values(self, update: Update, scale: float) -> None:
        if isinstance(update, PackUpdate):
            self._update_pack(update, scale)
            return
        shard = update.shard
        if not shard.is_table and shard.own():  # a send still holds the values: copy first
            self.copies_on_write += 1
        if isinstance(update, RowUpdate):
            shard.apply_row_grads(update.keys, update.grads, scale)
            return
        optimizer, step = shard.optimizer, shard.version + 1
        scratch = self._scratch_for(shard)
        # the chunks tile the shard (or there are none: a backup's counted push), so a
        # wire copy written along is the new version's whole
        wire = shard.wire_buffer() if update.chunks and shard.keeps_wire_copy else None
        if not self._run_parts(shard, update.chunks, step, scratch, scale, wire):
            for offset, chunk in update.chunks:
                self._run(
                    optimizer, shard.flat, shard.flat_slots, chunk, offset, step, scratch, scale,
                    wire,
                )  # fmt: skip
        if wire is not None:  # the version this update makes (apply_all's bump follows)
            shard.wire_copy = (step, wire)

    def _run_parts(
        self,
        shard: Shard,
        chunks: Sequence[tuple[int, Array]],
        step: int,
        scratch: Array,
        scale: float,
        wire: Array | None,
    ) -> bool:
        """A large update's chunks cut into ``parts.threads`` runs of about equal size,
        run at once (the fused kernels release the GIL, write only their own elements
        and no scratch: the result is the same bits as one after the other); False,
        having done nothing, when it is small, or no runner or no kernel is there."""
        parts, optimizer = self.parts, shard.optimizer
        if (
            parts is None
            or parts.threads <= 1
            or shard.values.nbytes < PARALLEL_BYTES
            or not optimizer.has_kernel(shard.flat)
        ):
            return False
        share = -(-shard.definition.size // parts.threads)
        runs: list[list[tuple[int, Array]]] = [[]]
        room = share
        for offset, chunk in chunks:
            lo, n = 0, chunk.shape[0]
            while lo < n:
                take = min(n - lo, room)
                runs[-1].append((offset + lo, chunk[lo : lo + take]))
                lo += take
                room -= take
                if room <= 0:
                    runs.append([])
                    room = share
        flat, slots = shard.flat, shard.flat_slots

        def call(run: list[tuple[int, Array]]) -> Callable[[], bool]:
            def go() -> bool:
                for offset, piece in run:
                    self._run(optimizer, flat, slots, piece, offset, step, scratch, scale, wire)
                return True

            return go

        parts.run([call(r) for r in runs if r])
        return True

    def apply_dense(
        self,
        shard_id: int,
        chunks: Sequence[tuple[int, Array]],
        pulled_version: int,
        scale: float = 1.0,
    ) -> tuple[int, int]:
        """Validate and apply a whole-shard gradient (:meth:`plan_dense`, :meth:`apply`).
        Returns ``(new version, staleness)``."""
        return self.apply(self.plan_dense(shard_id, chunks, pulled_version), scale)

    def apply_rows(
        self,
        shard_id: int,
        indices: Array,
        grad_rows: Array,
        pulled_version: int,
        scale: float = 1.0,
    ) -> tuple[int, int]:
        """Validate and apply row gradients (:meth:`plan_rows`, :meth:`apply`): only the
        touched rows (and their slots) change. Returns ``(new version, staleness)``."""
        return self.apply(self.plan_rows(shard_id, indices, grad_rows, pulled_version), scale)

    def check_dense(
        self,
        shard_id: int,
        chunks: Sequence[tuple[int, Array]],
        pulled_version: int,
        scale: float = 1.0,
    ) -> None:
        """Raise what :meth:`apply_dense` would raise for these arguments; change nothing."""
        self._check_scale(scale)
        self.plan_dense(shard_id, chunks, pulled_version)

    def check_rows(
        self,
        shard_id: int,
        indices: Array,
        grad_rows: Array,
        pulled_version: int,
        scale: float = 1.0,
    ) -> None:
        """Raise what :meth:`apply_rows` would raise for these arguments; change nothing."""
        self._check_scale(scale)
        self.plan_rows(shard_id, indices, grad_rows, pulled_version)

    def _applied(self, shard: Shard, staleness: int) -> tuple[int, int]:
        shard.version += 1
        self.updates_applied += 1
        self.staleness.add(staleness)
        if self.observer is not None:
            self.observer(shard.definition, staleness)
        return shard.version, staleness

    # -- validation ----------------------------------------------------------

    @staticmethod
    def _check_scale(scale: float) -> float:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
            raise InvalidArgument(f"scale must be a number, got {scale!r}")
        if not math.isfinite(scale):
            raise InvalidArgument(f"scale must be finite, got {scale!r}")
        return float(scale)

    @staticmethod
    def _check_version(shard: Shard, pulled_version: int) -> int:
        if isinstance(pulled_version, bool) or not isinstance(pulled_version, (int, np.integer)):
            raise InvalidArgument(f"pulled version must be an int, got {pulled_version!r}")
        if pulled_version > shard.version >= 0:
            # values this PS never had: pulled from an incarnation of the shard that is
            # gone (the PS lost with its chief before any checkpoint, the values made
            # anew in the same generation number); the sender pulls again. Changes
            # nothing, as any refusal.
            raise RolledBack(
                f"shard {shard.definition.id}: pulled version {pulled_version} is ahead of"
                f" this PS's {shard.version}: values that are gone (made anew since): pull"
                " again"
            )
        if not 0 <= pulled_version <= shard.version:
            raise InvalidArgument(
                f"shard {shard.definition.id}: pulled version {pulled_version}"
                f" outside [0, {shard.version}]"
            )
        return shard.version - int(pulled_version)

    @staticmethod
    def _check_tiling(shard: Shard, chunks: Sequence[tuple[int, Array]]) -> None:
        sid, size = shard.definition.id, shard.definition.size
        spans: list[tuple[int, int]] = []
        for offset, chunk in chunks:
            if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
                raise InvalidArgument(f"shard {sid}: chunk offset must be an int, got {offset!r}")
            if not isinstance(chunk, np.ndarray) or chunk.ndim != 1 or not _is_float(chunk.dtype):
                raise InvalidArgument(f"shard {sid}: gradient chunks must be 1-D float arrays")
            if chunk.shape[0] == 0:
                raise InvalidArgument(f"shard {sid}: empty gradient chunk at {offset}")
            spans.append((int(offset), int(offset) + chunk.shape[0]))
        spans.sort()
        end = 0
        for lo, hi in spans:
            if lo != end:
                what = "gap" if lo > end else "overlap"
                raise InvalidArgument(
                    f"shard {sid}: gradient chunks leave a {what} at {min(lo, end)}"
                )
            end = hi
        if end != size:
            raise InvalidArgument(f"shard {sid}: gradient chunks cover [0, {end}), not [0, {size})")

    def _scratch_for(self, shard: Shard) -> Array:
        """The store's scratch buffer viewed as the shard's compute dtype, grown if needed."""
        return self._scratch_of(shard.values.dtype, shard.optimizer, shard.definition.size)

    def _scratch_of(self, values: np.dtype[Any], optimizer: Optimizer, size: int) -> Array:
        dtype = compute_dtype(values)
        itemsize = dtype.itemsize
        # the optimizer works in blocks of at most BLOCK_ELEMS, so that is all it needs
        piece = min(self.chunk_elems, size, BLOCK_ELEMS)
        elems = optimizer.scratch_factor * piece
        if self._scratch.nbytes < elems * itemsize:
            self._scratch = np.empty(elems * itemsize, dtype=np.uint8)
        return self._scratch[: elems * itemsize].view(dtype)

    # -- statistics ----------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """JSON-able summary: shards, bytes, updates applied, staleness."""
        tables: dict[str, list[dict[str, Any]]] = {}
        for t in self.tables():
            tables.setdefault(t.definition.var, []).append(t.stats())
        return {
            "shards": len(self._shards),
            **({"tables": tables} if tables else {}),
            "bytes": self.nbytes(),
            "updates_applied": self.updates_applied,
            "copies_on_write": self.copies_on_write,
            "staleness": self.staleness.to_dict(),
        }

    def versions(self) -> Mapping[int, int]:
        """Current version of every shard."""
        return {sid: s.version for sid, s in sorted(self._shards.items())}
