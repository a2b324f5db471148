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

__all__ = [
    "DEFAULT_BUCKETS",
    "TABLE_INITIALIZERS",
    "TableConfig",
    "bucket_of",
    "initial_rows",
    "mix64",
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
    z = np.asarray(x).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    out: Array = z
    return out


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
        z = mix64(base[:, None] + (elems[None, :] + np.uint64(1)) * _GOLDEN)
    out: Array = ((z >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))
    return out


def _normal(ids: Array, key: np.uint64, dim: int, counter: int) -> Array:
    u1 = _uniform01(ids, key, dim, 2 * counter)
    u2 = _uniform01(ids, key, dim, 2 * counter + 1)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)


def initial_rows(init: Mapping[str, Any], var: str, ids: Array, dim: int, dtype: str) -> Array:
    """The initial rows of ``ids`` (shape ``(len(ids), dim)``), a function of the id,
    the variable name and the seed only."""
    name = str(init.get("name"))
    name = {"random_uniform": "uniform", "random_normal": "normal"}.get(name, name)
    ids = np.asarray(ids, dtype=np.int64)
    if name == "zeros":
        return np.zeros((ids.size, dim), dtype)
    if name in ("ones", "constant"):
        value = 1.0 if name == "ones" else float(init.get("value", 0.0))
        return np.full((ids.size, dim), value, dtype)
    key = _key(var, int(init.get("seed", 0)))
    if name == "uniform":
        low, high = float(init.get("low", -0.05)), float(init.get("high", 0.05))
        out = low + (high - low) * _uniform01(ids, key, dim, 0)
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
        out = mean + std * z
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
        self.index: dict[int, int] = {}
        self.free: list[int] = list(range(cap - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return int(self.ids.shape[0])

    def __len__(self) -> int:
        return len(self.index)

    def lookup(self, ids: Array) -> Array:
        """Row of every id, -1 where it has none."""
        get = self.index.get
        return np.fromiter((get(i, -1) for i in ids.tolist()), np.int64, ids.size)

    def _grow(self, need: int) -> None:
        cap = self.capacity
        new_cap = max(2 * cap, len(self.index) + need)
        if self.budget is not None:
            new_cap = min(new_cap, self.budget)
        if new_cap <= cap:
            return
        extra = new_cap - cap

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
        self.free.extend(range(new_cap - 1, cap - 1, -1))

    def evict_rows(self, rows: Array) -> None:
        for r, i in zip(rows.tolist(), self.ids[rows].tolist(), strict=True):
            del self.index[i]
            self.free.append(r)
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
        if len(self.free) < ids.size:
            self._grow(ids.size - len(self.free))
        rows = np.array([self.free.pop() for _ in range(ids.size)], np.int64)
        self.values[rows] = values
        for name, slot in self.optimizer.init_slots((ids.size, self.dim), self.dtype).items():
            self.slots[name][rows] = slot
        self.ids[rows] = ids
        self.touched[rows] = stamp
        self.index.update(zip(ids.tolist(), rows.tolist(), strict=True))
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
