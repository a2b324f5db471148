"""The PS side of a hash-keyed table: one shard's rows, admission and eviction.

Rules of this module (see :mod:`zmqps.core.hashtable` for the hash, the initial
values and the row policy):

* :class:`HashShard` is a :class:`~zmqps.core.store.Shard` whose rows are addressed
  by int64 id instead of row number; :class:`~zmqps.core.store.ShardStore` routes
  ``pull_rows`` / ``apply_rows`` of such a shard here and refuses dense access.
* ``check_ids`` validates a request whole (1-D integer ids, every id's bucket in this
  shard's range, not more new ids than the row budget) before anything changes.
* Counters (``created``, ``admitted``, ``evicted`` by reason, ``not_admitted``) only
  grow; :meth:`HashShard.stats` reports them with the live row count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.core.hashtable import RowTable, TableConfig, bucket_of, initial_rows, unique_ids
from zmqps.core.optimizers import Optimizer, make_optimizer
from zmqps.core.store import Shard, summed_rows
from zmqps.core.variables import ShardDef
from zmqps.wire.errors import InvalidArgument

__all__ = ["HashShard", "TableCounters"]

Array = npt.NDArray[Any]

#: Rows a new shard starts with (capacity doubles as rows arrive, up to the budget).
INITIAL_CAPACITY = 1024


@dataclass
class TableCounters:
    created: int = 0
    admitted: int = 0
    not_admitted: int = 0
    evicted_budget: int = 0
    evicted_idle: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "created": self.created,
            "admitted": self.admitted,
            "not_admitted": self.not_admitted,
            "evicted": {"budget": self.evicted_budget, "idle": self.evicted_idle},
        }


@dataclass
class HashShard(Shard):
    """One shard of a hash-keyed table (``definition.table`` is set)."""

    table: RowTable = field(default=None, repr=False)  # type: ignore[assignment]
    config: TableConfig = field(default_factory=TableConfig)
    counters: TableCounters = field(default_factory=TableCounters)
    #: ids seen but not admitted yet -> sightings (insertion order = age)
    pending: dict[int, int] = field(default_factory=dict)
    #: a listing in progress (:meth:`page`): (what the id set was, rows in id order)
    _order: tuple[tuple[int, ...], Array] | None = field(default=None, repr=False)

    @classmethod
    def make(cls, d: ShardDef, optimizer: Optimizer | None = None) -> HashShard:
        optimizer = optimizer or make_optimizer(d.optimizer)
        config = TableConfig.parse(d.table or {})
        dim = int(np.prod(d.full_shape[1:]))
        table = RowTable(dim, d.dtype, optimizer, INITIAL_CAPACITY, config.row_budget)
        return cls(d, table.values, table.slots, optimizer, table=table, config=config)

    def _sync(self) -> None:
        self.values, self.slots = self.table.values, self.table.slots
        self._views()
        self.flat_slots = {k: v.reshape(-1) for k, v in self.slots.items()}

    is_table = True

    def lend(self) -> Array:
        raise InvalidArgument(
            f"shard {self.definition.id} is a hash-keyed table: pull rows by id (pull_rows)"
        )

    def dense(self) -> Shard:
        raise InvalidArgument(
            f"shard {self.definition.id} is a hash-keyed table: pull and push rows by id"
        )

    def row_keys(self, indices: Array, create: bool = True) -> Array:
        """The validated ids of a request (:meth:`check_ids`): a table's rows by id."""
        return self.check_ids(indices, create)

    def growth_bytes(self, keys: Array) -> int:
        """Bytes the table would allocate to create rows for the validated ``keys``: its
        new arrays whole, since the old ones live until they are copied (0 while it has
        room: the lookup runs only when they might not fit)."""
        table = self.table
        if keys.size <= table.nfree:
            return 0
        new = int(np.count_nonzero(table.lookup(np.unique(keys)) < 0))
        extra = table.growth(new)
        return (table.capacity + extra) * table.row_bytes() if extra else 0

    def read_rows(self, keys: Array, create: bool, out: Array | None = None) -> Array:
        """Rows of validated ids: :meth:`pull` (creates admitted rows) or, read-only,
        :meth:`peek` (copied into ``out`` when given)."""
        rows = self.pull(keys) if create else self.peek(keys)
        if out is None:
            return rows
        out[...] = rows
        return out

    def apply_row_grads(self, keys: Array, grad_rows: Array, scale: float) -> None:
        """Lazy update of the rows of validated ids ``keys`` (duplicates summed; ids
        not admitted dropped and counted)."""
        grad2d = grad_rows.reshape(keys.shape[0], self.row_width)  # explicit: 0 rows too
        uniq, grad2d = summed_rows(keys, grad2d)  # unsorted or repeated ids: summed
        rows = self.rows_for(uniq, sighting=False)
        have = rows >= 0
        self.counters.not_admitted += int((~have).sum())
        if not have.all():
            rows, grad2d = rows[have], grad2d[have]
        self.optimizer.apply_rows(self.values, rows, grad2d, self.slots, self.version + 1, scale)
        self.table.touched[rows] = self.version + 1
        self.evict_idle(self.version + 1)

    @property
    def nbytes(self) -> int:
        t = self.table
        return int(t.values.nbytes + sum(s.nbytes for s in t.slots.values()) + t.ids.nbytes * 2)

    @property
    def rows(self) -> int:
        return len(self.table)

    # -- validation ------------------------------------------------------------

    def check_ids(self, ids: Any, create: bool = True) -> Array:
        """Validated ids as int64 (any values; their buckets must be this shard's).

        ``create=False`` (a read-only pull) creates no row, so the row budget does not
        bound how many ids one request names."""
        d = self.definition
        if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise InvalidArgument(f"shard {d.id}: ids must be a 1-D integer array")
        if ids.dtype == np.uint64:
            ids = ids.view(np.int64)  # the same 64-bit patterns
        out: Array = ids.astype(np.int64, copy=False)
        self.check_buckets(out)
        budget = self.config.row_budget
        if create and budget is not None and out.size > budget and np.unique(out).size > budget:
            raise InvalidArgument(
                f"shard {d.id}: one request names more ids than the row budget {budget}"
            )
        return out

    def check_buckets(self, ids: Array) -> None:
        """InvalidArgument unless every id hashes into this shard's bucket range."""
        d = self.definition
        if ids.size:
            b = bucket_of(ids, d.full_shape[0])
            if int(b.min()) < d.row_start or int(b.max()) >= d.row_start + d.rows:
                raise InvalidArgument(
                    f"shard {d.id}: an id hashes outside buckets"
                    f" [{d.row_start}, {d.row_start + d.rows}) (routed to the wrong shard?)"
                )

    # -- rows ------------------------------------------------------------------

    def _admit(self, missing: Array) -> Array:
        """Count a sighting of every missing id; return those admitted now."""
        k = self.config.admit_after
        if k <= 1:
            return missing
        pending = self.pending
        ready = []
        for i in missing.tolist():
            c = pending.pop(i, 0) + 1
            if c >= k:
                ready.append(i)
            else:
                pending[i] = c
        over = len(pending) - self.config.pending_limit
        if over > 0:  # forget the ids waiting longest (dicts keep insertion order)
            for i in [i for i, _ in zip(pending, range(over), strict=False)]:
                del pending[i]
        self.counters.admitted += len(ready)
        return np.array(ready, np.int64)

    def _make_room(self, n: int, protect: Array) -> None:
        budget = self.config.row_budget
        if budget is None:
            return
        excess = len(self.table) + n - budget
        if excess > 0:
            # evict 1/16 of the budget more than needed: finding the oldest rows is a
            # pass over the whole table, so the next requests find room without one
            victims = self.table.oldest(excess + budget // 16, protect)
            self.table.evict_rows(victims)
            self.counters.evicted_budget += int(victims.size)

    def rows_for(self, ids: Array, sighting: bool) -> Array:
        """Row of every (unique) id, creating the admitted ones; -1 for ids not admitted.

        ``sighting``: count this as a sighting for admission (pulls do)."""
        rows = self.table.lookup(ids)
        missing_at = np.flatnonzero(rows < 0)
        if missing_at.size:
            missing = ids[missing_at]
            if sighting or self.config.admit_after <= 1:
                new = self._admit(missing)
            else:
                new = np.zeros(0, np.int64)
            if new.size:
                self._make_room(new.size, rows[rows >= 0])
                d = self.definition
                values = initial_rows(d.init, d.var, new, self.table.dim, d.dtype)
                made = self.table.insert(new, values, self.version)
                self.counters.created += int(new.size)
                self._sync()
                if new.size == missing.size:  # all admitted: made is in missing's order
                    rows[missing_at] = made
                else:
                    rows[missing_at] = self.table.lookup(missing)
        present = rows[rows >= 0]
        self.table.touched[present] = self.version
        return rows

    def pull(self, ids: Array) -> Array:
        """Rows of ``ids`` (validated; duplicates allowed), zeros for ids not admitted."""
        uniq, inverse = unique_ids(ids)
        rows = self.rows_for(uniq, sighting=True)
        have = rows >= 0
        if have.all():
            out = np.take(self.table.values, rows, axis=0)
        else:
            out = np.zeros((uniq.size, self.table.dim), self.table.values.dtype)
            out[have] = self.table.values[rows[have]]
        if inverse is not None:
            out = out[inverse]
        return out.reshape((ids.size, *self.definition.shape[1:]))

    def peek(self, ids: Array) -> Array:
        """Rows of ``ids`` as a pull would return them, changing nothing (read-only).

        A live row reads as its values; an id without a row reads as what a creating
        pull would give it now: its initial value (:func:`initial_rows`) when ids are
        admitted at once, zeros while admission needs more sightings (``admit_after >
        1``: training reads such ids as zeros too). No row is created, stamped or
        evicted; no sighting, admission or counter is recorded."""
        uniq, inverse = np.unique(ids, return_inverse=True)
        rows = self.table.lookup(uniq)
        have = rows >= 0
        out = np.zeros((uniq.size, self.table.dim), self.table.values.dtype)
        out[have] = self.table.values[rows[have]]
        if self.config.admit_after <= 1 and not have.all():
            d = self.definition
            out[~have] = initial_rows(d.init, d.var, uniq[~have], self.table.dim, d.dtype)
        return out[inverse.reshape(-1)].reshape((ids.size, *self.definition.shape[1:]))

    def page(self, start: int, limit: int) -> tuple[Array, Array, int]:
        """Live rows ``[start, start + limit)`` in ascending id order: ``(ids, values,
        live row count)`` (copies; reads only, like :meth:`peek`). Pages of a table
        whose set of ids did not change tile its rows exactly (exports list a table
        this way). The id order is kept between the pages of one listing (until the
        last page is read or a row is created or evicted), not sorted again per page."""
        t = self.table
        c = self.counters
        key = (len(t), c.created, c.evicted_budget, c.evicted_idle)
        if self._order is None or self._order[0] != key:
            live = np.flatnonzero(t.touched >= 0)
            self._order = (key, live[np.argsort(t.ids[live], kind="stable")])
        order = self._order[1]
        rows = order[start : start + limit]
        if start + limit >= order.size:
            self._order = None  # the listing is over: do not hold the order
        values = t.values[rows].reshape((rows.size, *self.definition.shape[1:]))
        return t.ids[rows].copy(), values.copy(), int(order.size)

    def evict_idle(self, version: int) -> None:
        """Drop rows untouched for more than ``evict_after`` updates (checked every
        ``evict_after // 8`` updates, so a row may outstay it by that much)."""
        t = self.config.evict_after
        if t is None or version % max(1, t // 8):
            return
        live = self.table.touched >= 0
        idle = np.flatnonzero(live & (self.table.touched < version - t))
        if idle.size:
            self.table.evict_rows(idle)
            self.counters.evicted_idle += int(idle.size)

    def stats(self) -> dict[str, Any]:
        return {
            "rows": len(self.table),
            "capacity": self.table.capacity,
            "pending": len(self.pending),
            **self.counters.to_dict(),
        }

    # -- an exact copy (a backup joining) ---------------------------------------

    def raw(self) -> tuple[dict[str, Any], dict[str, Array]]:
        """The whole shard as it is (copies): :meth:`load_raw` makes its twin."""
        counts, arrays = self.table.raw()
        meta = {
            **counts,
            "version": self.version,
            "pending": [[i, c] for i, c in self.pending.items()],
            "counters": asdict(self.counters),
        }
        return meta, arrays

    def load_raw(self, meta: Mapping[str, Any], arrays: Mapping[str, Array]) -> None:
        """Become the shard :meth:`raw` described (InvalidArgument, nothing changed,
        when it does not fit this shard's definition)."""
        try:
            version = int(meta["version"])
            pending = {int(i): int(c) for i, c in meta["pending"]}
            counters = TableCounters(**{str(k): int(v) for k, v in meta["counters"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidArgument(f"shard {self.definition.id}: a malformed copy ({exc})") from None
        if version < 0 or len(pending) > self.config.pending_limit:
            raise InvalidArgument(f"shard {self.definition.id}: a malformed copy")
        self.table.load_raw(meta, arrays)
        self.version, self.pending, self.counters = version, pending, counters
        self._order = None
        self._sync()

    # -- checkpoints -----------------------------------------------------------

    def state(self) -> tuple[Array, Array, dict[str, Array], Array]:
        """``(ids, values, slots, touched)`` of every live row (copies, id order)."""
        return self.table.compact_state()

    def load(
        self, ids: Array, values: Array, slots: Mapping[str, Array], touched: Array, version: int
    ) -> None:
        """Fill an empty shard with restored rows (already validated by the caller)."""
        budget = self.config.row_budget
        if budget is not None and ids.size > budget:
            # restored onto fewer PS than the budget allows: keep the most recent rows
            self.counters.evicted_budget += int(ids.size - budget)
            keep = np.argsort(-touched, kind="stable")[:budget]
            keep.sort()
            ids, values, touched = ids[keep], values[keep], touched[keep]
            slots = {k: v[keep] for k, v in slots.items()}
        self.version = int(version)
        rows = self.table.insert(ids, values.reshape(ids.size, -1), 0)
        for k, v in slots.items():
            self.table.slots[k][rows] = v.reshape(ids.size, -1)
        self.table.touched[rows] = np.minimum(touched, self.version)
        self._sync()
