"""Hash-keyed embedding tables: int64 ids mapped to rows on first touch.

Rules of this module:

* A hash-keyed table is a row-sparse variable of shape ``(buckets, dim)`` with a
  ``table`` config (:data:`zmqps.wire.schema.TABLE`). Its first dimension is not a
  row count but the number of hash *buckets*: id ``i`` lives in bucket
  :func:`bucket_of` ``(i, buckets)`` and the partitioner splits the bucket range
  ``[0, buckets)`` into shards like the rows of a fixed-size table. The bucket of an
  id depends on nothing but the id and ``buckets``, so a checkpoint restored onto
  another number of PS re-routes every id by the same function.
* The stable hash is the splitmix64 finalizer (Steele, Lea & Flood 2014) of the id's
  64-bit two's-complement pattern::

      z = id (as uint64)
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
      z = (z ^ (z >> 27)) * 0x94D049BB133111EB
      z =  z ^ (z >> 31)
      bucket = z mod buckets

* A row's initial value depends only on the id, the variable name and the
  initializer's seed (:func:`initial_rows`): a row evicted and created again, or
  created on another PS after a restore, starts from the same value.
* A :class:`HashShard` owns every row whose bucket is in its range. Rows are created
  on first touch (a pull or a push), or, with ``admit_after = k > 1``, once the id
  has been seen ``k`` times (pulls that name it); an id not admitted yet reads as
  zeros and its gradients are dropped (counted). Ids waiting for admission are
  remembered in a bounded map (``pending_limit``; the oldest are forgotten first).
* Eviction: ``evict_after = T`` drops rows untouched for more than ``T`` updates of
  the shard; ``row_budget = B`` bounds the rows of the shard: creating rows beyond
  it first evicts the least recently touched rows not named by the request. The
  row arrays never hold more than ``B`` rows (capacity grows by doubling up to
  ``B``). A single request naming more than ``B`` new ids is refused.
* Everything is validated before any state changes; pulls change state only by
  creating rows, admitting ids and stamping rows as touched.
* A read-only pull (:meth:`HashShard.peek`, ``pull_rows(..., create=False)``)
  changes nothing at all: ids without a row read as the value a creating pull would
  give them (their initial value, or zeros while not admitted). Evaluation and serving
  use it, so held-out ids take no room, evict no trained row and count no sighting.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.core.initializers import validate_init
from zmqps.core.optimizers import Optimizer
from zmqps.wire.errors import InvalidArgument

__all__ = [
    "DEFAULT_BUCKETS",
    "TABLE_INITIALIZERS",
    "TableConfig",
    "bucket_of",
    "initial_rows",
    "mix64",
    "unique_ids",
]

Array = npt.NDArray[Any]

#: Buckets of a table when the user does not say: restores onto up to this many PS.
DEFAULT_BUCKETS = 4096

#: Initializers a hash-keyed table accepts (fan-based ones need a fixed row count).
TABLE_INITIALIZERS = ("zeros", "ones", "constant", "uniform", "normal", "truncated_normal")

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: Array) -> Array:
    """The splitmix64 finalizer of every element (any int64/uint64 array), as uint64."""
    return _mix64_inplace(np.asarray(x).astype(np.uint64, copy=True))


def _mix64_inplace(z: Array) -> Array:
    """:func:`mix64` of a uint64 array, in place, with one scratch array."""
    tmp = np.empty_like(z)
    with np.errstate(over="ignore"):
        for shift, mult in ((30, _M1), (27, _M2), (31, None)):
            np.right_shift(z, np.uint64(shift), out=tmp)
            np.bitwise_xor(z, tmp, out=z)
            if mult is not None:
                np.multiply(z, mult, out=z)
    return z


def bucket_of(ids: Array, buckets: int) -> Array:
    """The bucket (int64 in ``[0, buckets)``) of every id: ``mix64(id) mod buckets``."""
    out: Array = (mix64(ids) % np.uint64(buckets)).astype(np.int64)
    return out


def _key(var: str, seed: int) -> np.uint64:
    return np.uint64(  # type: ignore[no-any-return]
        (zlib.crc32(var.encode()) << 32 ^ (seed & 0xFFFFFFFFFFFFFFFF)) & (2**64 - 1)
    )


def _uniform01(ids: Array, key: np.uint64, dim: int, counter: int) -> Array:
    """Uniform (0, 1) float64 of shape ``(len(ids), dim)``: a counter-based generator
    keyed by (id, variable, seed, element, counter)."""
    with np.errstate(over="ignore"):
        base = mix64(mix64(ids) ^ key)
        elems = np.arange(dim, dtype=np.uint64) + np.uint64(counter * dim)
        z = _mix64_inplace(np.add(base[:, None], (elems[None, :] + np.uint64(1)) * _GOLDEN))
    np.right_shift(z, np.uint64(11), out=z)
    out: Array = z.astype(np.float64)
    out += 0.5
    out *= 1.0 / (1 << 53)
    return out


def _normal(ids: Array, key: np.uint64, dim: int, counter: int) -> Array:
    """Standard normal float64 ``(len(ids), dim)`` by Box-Muller (in place: no temporaries)."""
    r = _uniform01(ids, key, dim, 2 * counter)
    theta = _uniform01(ids, key, dim, 2 * counter + 1)
    np.log(r, out=r)
    r *= -2.0
    np.sqrt(r, out=r)
    theta *= 2.0 * math.pi
    np.cos(theta, out=theta)
    r *= theta
    return r


#: initial rows are drawn this many values at a time: the float64 temporaries of a
#: random draw stay a few MiB, whatever a request's number of ids
INIT_BLOCK_VALUES = 1 << 18


def initial_rows(init: Mapping[str, Any], var: str, ids: Array, dim: int, dtype: str) -> Array:
    """The initial rows of ``ids`` (shape ``(len(ids), dim)``), a function of the id,
    the variable name and the seed only."""
    ids = np.asarray(ids, dtype=np.int64)
    step = max(1, INIT_BLOCK_VALUES // max(dim, 1))
    if ids.size <= step:
        return _initial_rows(init, var, ids, dim, dtype)
    out = np.empty((ids.size, dim), dtype)
    for lo in range(0, ids.size, step):
        out[lo : lo + step] = _initial_rows(init, var, ids[lo : lo + step], dim, dtype)
    return out


def _initial_rows(init: Mapping[str, Any], var: str, ids: Array, dim: int, dtype: str) -> Array:
    name = str(init.get("name"))
    name = {"random_uniform": "uniform", "random_normal": "normal"}.get(name, name)
    if name == "zeros":
        return np.zeros((ids.size, dim), dtype)
    if name in ("ones", "constant"):
        value = 1.0 if name == "ones" else float(init.get("value", 0.0))
        return np.full((ids.size, dim), value, dtype)
    key = _key(var, int(init.get("seed", 0)))
    if name == "uniform":
        low, high = float(init.get("low", -0.05)), float(init.get("high", 0.05))
        out = _uniform01(ids, key, dim, 0)
        out *= high - low
        out += low
    else:
        mean, std = float(init.get("mean", 0.0)), float(init.get("stddev", 0.05))
        z = _normal(ids, key, dim, 0)
        if name == "truncated_normal":  # redraw beyond 2 sigma, like TF's truncated normal
            for counter in range(1, 16):
                bad = np.abs(z) > 2.0
                if not bad.any():
                    break
                z = np.where(bad, _normal(ids, key, dim, counter), z)
            np.clip(z, -2.0, 2.0, out=z)
        z *= std
        z += mean
        out = z
    return out.astype(dtype)


def _count(table: Mapping[str, Any], key: str, default: int | None, minimum: int) -> int | None:
    v = table.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"table {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


@dataclass(frozen=True)
class TableConfig:
    """A hash-keyed table's row policy (the variable's ``table`` map).

    ``row_budget``: most rows per shard (None: unbounded); ``admit_after``: sightings
    before an id gets a row (1: at once); ``evict_after``: updates of the shard a row
    may stay untouched (None: never evicted for idleness); ``pending_limit``: most ids
    remembered while waiting for admission.
    """

    row_budget: int | None = None
    admit_after: int = 1
    evict_after: int | None = None
    pending_limit: int = 1 << 20

    KEYS = ("row_budget", "admit_after", "evict_after", "pending_limit")

    @classmethod
    def parse(cls, table: Mapping[str, Any]) -> TableConfig:
        """Validate a ``table`` map; raises ValueError with a clear message."""
        if not isinstance(table, Mapping):
            raise ValueError(f"table config must be a map, got {type(table).__name__}")
        unknown = sorted(set(table) - set(cls.KEYS))
        if unknown:
            raise ValueError(
                f"table config does not take {', '.join(map(str, unknown))}"
                f" (known: {', '.join(cls.KEYS)})"
            )
        return cls(
            row_budget=_count(table, "row_budget", None, 1),
            admit_after=_count(table, "admit_after", 1, 1) or 1,
            evict_after=_count(table, "evict_after", None, 1),
            pending_limit=_count(table, "pending_limit", 1 << 20, 1) or 1,
        )


def validate_table_init(init: Mapping[str, Any]) -> None:
    """Raise ValueError unless ``init`` is an initializer a hash-keyed table can use."""
    validate_init(init)
    name = init.get("name")
    name = {"random_uniform": "uniform", "random_normal": "normal"}.get(str(name), name)
    if name not in TABLE_INITIALIZERS:
        raise ValueError(
            f"a hash-keyed table cannot use initializer {name!r} (its rows have no fan);"
            f" use one of {', '.join(TABLE_INITIALIZERS)}"
        )


def unique_ids(ids: Array) -> tuple[Array, Array | None]:
    """``(unique ids, inverse)``; inverse is None when ``ids`` are already strictly
    increasing (as clients send them), which saves a sort and a gather."""
    if ids.size < 2 or bool((ids[1:] > ids[:-1]).all()):
        return ids, None
    uniq, inverse = np.unique(ids, return_inverse=True)
    return uniq, inverse.reshape(-1)


class IdIndex:
    """int64 id -> row number: open addressing with linear probing, on numpy arrays.

    Every call takes a whole batch of ids and probes them together (one numpy pass
    per probe step, about as many passes as the longest probe run), so a lookup of
    thousands of ids costs microseconds per probe step instead of a Python dict call
    per id; and a row costs two int64 slots (16 bytes each; 32 to 64 bytes a row)
    where a dict entry and its two Python ints cost about 100.

    A slot holds a row (>= 0), :data:`EMPTY` or :data:`GONE` (a removed key: probes
    go past it, inserts reuse it); inside an insert, for an instant, an id's claim
    mark (below GONE). The slot of an id is the top bits of
    ``mix64(id ^ 0x9E3779B97F4A7C15)``: another hash than the bucket, whose low bits
    are shared by every id of a shard. Live plus GONE slots never pass half of the
    slots (probe runs stay short); when they would, the arrays are rebuilt with at
    least four slots per live id (so, at a steady size, a rebuild that clears GONE
    slots comes only after a quarter of the slots have been removed).
    """

    EMPTY = -1
    GONE = -2
    MIN_SLOTS = 16

    def __init__(self, capacity: int = 0) -> None:
        self._alloc(self._slots_for(capacity))
        self.live = 0
        self.gone = 0

    @classmethod
    def _slots_for(cls, n: int) -> int:
        return max(cls.MIN_SLOTS, 1 << max(0, 4 * n - 1).bit_length())

    def _alloc(self, size: int) -> None:
        self.keys = np.zeros(size, np.int64)
        self.rows = np.full(size, self.EMPTY, np.int64)
        self._shift = np.uint64(64 - (size.bit_length() - 1))
        self._mask = size - 1

    def __len__(self) -> int:
        return self.live

    def _home(self, ids: Array) -> Array:
        with np.errstate(over="ignore"):
            h = mix64(ids.view(np.uint64) ^ _GOLDEN) >> self._shift
        out: Array = h.astype(np.int64)
        return out

    def _probe(self, ids: Array) -> tuple[Array, Array]:
        """``(rows, slots)`` of every id: its row and slot, or -1 and -1."""
        n = ids.size
        rows = np.full(n, -1, np.int64)
        slots = np.full(n, -1, np.int64)
        todo = np.arange(n)
        pos = self._home(ids)
        keys = ids
        while todo.size:
            r = self.rows[pos]
            hit = (r >= 0) & (self.keys[pos] == keys)
            rows[todo[hit]] = r[hit]
            slots[todo[hit]] = pos[hit]
            go = ~hit & (r != self.EMPTY)
            todo, keys = todo[go], keys[go]
            pos = (pos[go] + 1) & self._mask
        return rows, slots

    def lookup(self, ids: Array) -> Array:
        """The row of every id, -1 where it has none."""
        return self._probe(np.ascontiguousarray(ids, np.int64))[0]

    def insert(self, ids: Array, rows: Array) -> None:
        """Add ``ids`` (distinct, none present) with their ``rows``."""
        ids = np.ascontiguousarray(ids, np.int64)
        if 2 * (self.live + self.gone + ids.size) > self.rows.size:
            self._rebuild(self.live + ids.size)
        self._place(ids, np.asarray(rows, np.int64))

    def _place(self, ids: Array, rows: Array) -> None:
        todo = np.arange(ids.size)
        pos = self._home(ids)
        while todo.size:
            free = np.flatnonzero(self.rows[pos] < 0)
            # Several ids may reach the same free slot in one pass: each writes its own
            # mark (below EMPTY and GONE) there, and the one whose mark stayed takes it.
            at = pos[free]
            was = self.rows[at]
            mark = -3 - free
            self.rows[at] = mark
            won = self.rows[at] == mark
            win = free[won]
            at = at[won]
            self.gone -= int((was[won] == self.GONE).sum())
            self.keys[at] = ids[todo[win]]
            self.rows[at] = rows[todo[win]]
            self.live += int(win.size)
            lose = np.ones(todo.size, bool)
            lose[win] = False
            todo = todo[lose]
            pos = (pos[lose] + 1) & self._mask

    def remove(self, ids: Array) -> None:
        """Drop ``ids`` (ids absent are ignored)."""
        _, slots = self._probe(np.ascontiguousarray(ids, np.int64))
        slots = np.unique(slots[slots >= 0])
        self.rows[slots] = self.GONE
        self.live -= int(slots.size)
        self.gone += int(slots.size)

    def _rebuild(self, need: int) -> None:
        live = np.flatnonzero(self.rows >= 0)
        keys, rows = self.keys[live], self.rows[live]
        self._alloc(max(self.rows.size, self._slots_for(need)))
        self.live = self.gone = 0
        self._place(keys, rows)

    def items(self) -> tuple[Array, Array]:
        """``(ids, rows)`` of every live entry (slot order)."""
        live = np.flatnonzero(self.rows >= 0)
        return self.keys[live].copy(), self.rows[live].copy()


class RowTable:
    """The rows of one hash shard: ids, values, slots, last-touched stamps, free rows.

    Pure state, no validation of its callers' arguments (see :class:`HashShard`)."""

    def __init__(
        self, dim: int, dtype: str, optimizer: Optimizer, capacity: int, budget: int | None
    ) -> None:
        self.dim, self.dtype, self.budget = dim, dtype, budget
        self.optimizer = optimizer
        cap = max(1, capacity if budget is None else min(capacity, budget))
        self.values = np.zeros((cap, dim), dtype)
        self.slots = optimizer.init_slots((cap, dim), dtype)
        self.ids = np.zeros(cap, np.int64)
        #: the shard version a row was last touched at; -1 marks a free row
        self.touched = np.full(cap, -1, np.int64)
        self.index = IdIndex(cap)
        #: free rows, a stack: the next one handed out is ``free[nfree - 1]``
        self.free = np.arange(cap - 1, -1, -1, dtype=np.int64)
        self.nfree = cap

    # -- an exact copy (a backup joining) -----------------------------------------

    def raw(self) -> tuple[dict[str, int], dict[str, Array]]:
        """Every array and counter as it is (copies): :meth:`load_raw` of them makes a
        table that behaves exactly like this one (the same rows, free list, index
        layout: the same ids evicted first on a tie)."""
        arrays = {
            "values": self.values.copy(),
            "ids": self.ids.copy(),
            "touched": self.touched.copy(),
            "free": self.free[: self.nfree].copy(),
            "index_keys": self.index.keys.copy(),
            "index_rows": self.index.rows.copy(),
            **{f"slot:{k}": v.copy() for k, v in self.slots.items()},
        }
        return {"live": self.index.live, "gone": self.index.gone}, arrays

    def load_raw(self, counts: Mapping[str, Any], arrays: Mapping[str, Array]) -> None:
        """Become the table :meth:`raw` described; InvalidArgument (nothing changed)
        when the arrays do not fit together or this table's row shape and slots."""
        try:
            values, ids, touched = arrays["values"], arrays["ids"], arrays["touched"]
            free, keys, rows = arrays["free"], arrays["index_keys"], arrays["index_rows"]
            slots = {k: arrays[f"slot:{k}"] for k in self.slots}
            live, gone = int(counts["live"]), int(counts["gone"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"a table copy lacks {exc}") from None
        cap = ids.shape[0] if ids.ndim == 1 else -1
        size = keys.shape[0] if keys.ndim == 1 else -1
        ok = (
            cap >= 1
            and values.shape == (cap, self.dim)
            and values.dtype == self.values.dtype
            and all(
                v.shape == (cap, self.dim) and v.dtype == self.slots[k].dtype
                for k, v in slots.items()
            )
            and ids.dtype == touched.dtype == free.dtype == keys.dtype == rows.dtype == np.int64
            and touched.shape == (cap,)
            and free.ndim == 1
            and free.shape[0] <= cap
            and size >= IdIndex.MIN_SLOTS
            and size & (size - 1) == 0
            and rows.shape == (size,)
            and 0 <= live <= cap
            and 0 <= gone <= size
            and (self.budget is None or cap <= max(self.budget, 1))
            and bool(((free >= 0) & (free < cap)).all())
            and bool((rows < cap).all())
        )
        if not ok:
            raise InvalidArgument("a table copy's arrays do not fit this table")
        self.values = np.array(values, copy=True, order="C")
        self.slots = {k: np.array(v, copy=True, order="C") for k, v in slots.items()}
        self.ids, self.touched = ids.copy(), touched.copy()
        self.free = np.empty(cap, np.int64)
        self.free[: free.shape[0]] = free
        self.nfree = int(free.shape[0])
        self.index._alloc(size)
        self.index.keys[:] = keys
        self.index.rows[:] = rows
        self.index.live, self.index.gone = live, gone

    @property
    def capacity(self) -> int:
        return int(self.ids.shape[0])

    def __len__(self) -> int:
        return len(self.index)

    def lookup(self, ids: Array) -> Array:
        """Row of every id, -1 where it has none."""
        return self.index.lookup(ids)

    def _push_free(self, rows: Array) -> None:
        end = self.nfree + rows.size
        if end > self.free.size:
            grown = np.empty(max(end, 2 * self.free.size), np.int64)
            grown[: self.nfree] = self.free[: self.nfree]
            self.free = grown
        self.free[self.nfree : end] = rows
        self.nfree = end

    def row_bytes(self) -> int:
        """Bytes one row takes: values, slots, id, stamp, and its index entries."""
        slots = sum(a.itemsize * self.dim for a in self.slots.values())
        return self.values.itemsize * self.dim + slots + 16 + 32

    def growth(self, need: int) -> int:
        """Rows a growth adds to make room for ``need`` new rows (0 while the free rows
        hold them): doubling, at most the budget."""
        if need <= self.nfree:
            return 0
        cap = self.capacity
        new_cap = max(2 * cap, cap + need - self.nfree)
        if self.budget is not None:
            new_cap = min(new_cap, self.budget)
        return max(0, new_cap - cap)

    def _grow(self, need: int) -> None:
        """Room for ``need`` more rows than are free now (doubling; at most the budget)."""
        cap = self.capacity
        extra = self.growth(need + self.nfree)
        if not extra:
            return
        new_cap = cap + extra

        def grown(a: Array, fill: Any) -> Array:
            out = np.empty((new_cap, *a.shape[1:]), a.dtype)
            out[:cap] = a
            out[cap:] = fill
            return out

        fresh_slots = self.optimizer.init_slots((extra, self.dim), self.dtype)
        self.values = grown(self.values, 0)
        self.slots = {k: np.concatenate([v, fresh_slots[k]], axis=0) for k, v in self.slots.items()}
        self.ids = grown(self.ids, 0)
        self.touched = grown(self.touched, -1)
        self._push_free(np.arange(new_cap - 1, cap - 1, -1, dtype=np.int64))

    def evict_rows(self, rows: Array) -> None:
        rows = np.asarray(rows, np.int64)
        self.index.remove(self.ids[rows])
        self._push_free(rows)
        self.touched[rows] = -1

    def oldest(self, n: int, protect: Array) -> Array:
        """The ``n`` live rows touched longest ago, never one of ``protect``."""
        stamp = np.where(self.touched < 0, np.iinfo(np.int64).max, self.touched)
        stamp[protect] = np.iinfo(np.int64).max
        n = min(n, int((stamp != np.iinfo(np.int64).max).sum()))
        if n <= 0:
            return np.zeros(0, np.int64)
        return np.argpartition(stamp, n - 1)[:n].astype(np.int64)

    def insert(self, ids: Array, values: Array, stamp: int) -> Array:
        """Rows for new ``ids`` (room must exist within the budget); returns them."""
        if self.nfree < ids.size:
            self._grow(ids.size - self.nfree)
        if self.nfree < ids.size:  # the caller made no room within the budget
            raise ValueError(f"no room for {ids.size} rows ({self.nfree} free)")
        rows: Array = self.free[self.nfree - ids.size : self.nfree][::-1].copy()
        self.nfree -= ids.size
        self.values[rows] = values
        for name, slot in self.optimizer.init_slots((ids.size, self.dim), self.dtype).items():
            self.slots[name][rows] = slot
        self.ids[rows] = ids
        self.touched[rows] = stamp
        self.index.insert(ids, rows)
        return rows

    def compact_state(self) -> tuple[Array, Array, dict[str, Array], Array]:
        """``(ids, values, slots, touched)`` of the live rows, in ascending id order."""
        rows = np.flatnonzero(self.touched >= 0)
        rows = rows[np.argsort(self.ids[rows], kind="stable")]
        return (
            self.ids[rows].copy(),
            self.values[rows].copy(),
            {k: v[rows].copy() for k, v in self.slots.items()},
            self.touched[rows].copy(),
        )
