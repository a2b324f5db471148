"""Partitioning (variables -> shards) and placement (shards -> PS tasks), sans-IO.

Rules of this module:

* Pure functions of their arguments: no IO, no randomness, no environment. The
  same variables, ``num_ps``, partitioner and policy always give the same plan.
* A variable is split along axis 0 only, into contiguous row ranges that tile
  it exactly; rows are spread as evenly as possible and the first shards get
  one extra row (TensorFlow's convention).
* Policy is injected: the :class:`Partitioner` decides how many shards, a
  placement policy (a name from :data:`PLACEMENTS` or any callable with the
  same signature) decides which PS holds each shard.
* With ``replication`` R > 1, every shard also gets R - 1 backups
  (:func:`place_backups`), the same for every shard of one primary PS (a PS's
  state is the unit of replication): no two copies on one PS, nor on one host
  when the PS's hosts are given and there are enough of them; each backup on the
  least-loaded eligible PS, counting primaries and backups alike.
* Only the chief calls :func:`plan`; workers receive the resulting
  :class:`~zmqps.core.variables.Placement` and never recompute it.
* Bad arguments raise :class:`~zmqps.wire.errors.InvalidArgument`.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from zmqps.core.variables import Placement, ShardInfo, VariableDef
from zmqps.wire.errors import InvalidArgument
from zmqps.wire.schema import MAX_REPLICATION, MAX_SHARDS

__all__ = [
    "DEFAULT_OPTIMIZER",
    "PLACEMENTS",
    "Partitioner",
    "PlacementPolicy",
    "check_replication",
    "even_split",
    "greedy_by_bytes",
    "place_backups",
    "plan",
    "round_robin",
]

#: A placement policy: shard byte sizes (global shard order) and the number of
#: PS tasks in, the PS index of every shard (same order) out.
PlacementPolicy = Callable[[Sequence[int], int], list[int]]

#: The job-wide default optimizer when :func:`plan` is given none.
DEFAULT_OPTIMIZER: Mapping[str, Any] = MappingProxyType({"name": "sgd", "lr": 0.01})


def _check_positive(name: str, value: int | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{name} must be a positive integer, got {value!r}")


def even_split(rows: int, n: int) -> list[tuple[int, int]]:
    """``(row_start, rows)`` of ``n`` contiguous parts of ``rows`` rows, first parts larger."""
    _check_positive("rows", rows)
    _check_positive("number of shards", n)
    if n > rows:
        raise InvalidArgument(f"cannot split {rows} rows into {n} non-empty shards")
    base, extra = divmod(rows, n)
    out: list[tuple[int, int]] = []
    start = 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append((start, size))
        start += size
    return out


@dataclass(frozen=True)
class Partitioner:
    """How many shards a variable gets (TensorFlow partitioner semantics).

    * ``num_shards`` set: exactly that many shards (``fixed_size_partitioner``),
      capped at the variable's row count; the byte limits are not consulted.
    * otherwise ``n = max(1, nbytes // min_shard_bytes)`` (``MinSizePartitioner``,
      ``min_max_variable_partitioner``'s ``min_slice_size``), capped at
      ``max_shards`` or, when that is ``None``, at the number of PS tasks; then
      raised until no shard exceeds ``max_shard_bytes``
      (``variable_axis_size_partitioner``; this limit wins over the cap); then
      capped at the row count (a single row larger than ``max_shard_bytes``
      cannot be split further).
    """

    num_shards: int | None = None
    min_shard_bytes: int = 256 * 1024
    max_shard_bytes: int = 64 << 20
    max_shards: int | None = None

    def __post_init__(self) -> None:
        _check_positive("num_shards", self.num_shards, optional=True)
        _check_positive("min_shard_bytes", self.min_shard_bytes)
        _check_positive("max_shard_bytes", self.max_shard_bytes)
        _check_positive("max_shards", self.max_shards, optional=True)

    def num_shards_for(self, var: VariableDef, num_ps: int) -> int:
        """The number of shards ``var`` is split into on a cluster of ``num_ps`` PS tasks."""
        _check_positive("num_ps", num_ps)
        rows = var.shape[0]
        if var.hashed:  # buckets: one shard per PS (the row budget is per shard)
            return min(self.num_shards or num_ps, rows)
        if self.num_shards is not None:
            return min(self.num_shards, rows)
        n = max(1, var.nbytes // self.min_shard_bytes)
        n = min(n, self.max_shards if self.max_shards is not None else num_ps)
        row_bytes = var.row_size * var.itemsize
        # A row larger than max_shard_bytes cannot be split: one row per shard then.
        rows_per_shard = max(1, self.max_shard_bytes // row_bytes)
        n = max(n, -(-rows // rows_per_shard))
        return min(n, rows)

    def split(self, var: VariableDef, num_ps: int) -> list[tuple[int, int]]:
        """``(row_start, rows)`` of every shard of ``var``, in shard order."""
        return even_split(var.shape[0], self.num_shards_for(var, num_ps))


def _check_sizes(sizes: Sequence[int], num_ps: int) -> None:
    _check_positive("num_ps", num_ps)
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise InvalidArgument(f"shard sizes must be non-negative integers, got {s!r}")


def round_robin(sizes: Sequence[int], num_ps: int) -> list[int]:
    """Shard ``i`` (global shard order) on PS ``i % num_ps``, like ``replica_device_setter``."""
    _check_sizes(sizes, num_ps)
    return [i % num_ps for i in range(len(sizes))]


def greedy_by_bytes(sizes: Sequence[int], num_ps: int) -> list[int]:
    """Largest shard first onto the least-loaded PS (ties: lowest shard, then lowest PS).

    Returns the PS of every shard in the original order. The spread of loads
    (max - min) is at most the largest shard.
    """
    _check_sizes(sizes, num_ps)
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    loads = [(0, ps) for ps in range(num_ps)]  # a heap of (bytes, ps): ties to lowest ps
    out = [0] * len(sizes)
    for i in order:
        load, ps = heapq.heappop(loads)
        out[i] = ps
        heapq.heappush(loads, (load + sizes[i], ps))
    return out


def check_replication(replication: int, num_ps: int) -> None:
    """``replication`` copies of each shard fit on ``num_ps`` PS tasks."""
    _check_positive("replication", replication)
    if replication > min(num_ps, MAX_REPLICATION):
        raise InvalidArgument(
            f"replication {replication} needs at least {replication} PS tasks, one per copy"
            f" of a shard; the cluster has {num_ps}"
            + (f" (and at most {MAX_REPLICATION} copies)" if replication > MAX_REPLICATION else "")
        )


def place_backups(
    sizes: Sequence[int],
    primaries: Sequence[int],
    num_ps: int,
    replication: int,
    hosts: Sequence[str] | None = None,
) -> list[tuple[int, ...]]:
    """The PS of every shard's ``replication - 1`` backups (shard order).

    Backups are chosen per primary PS, not per shard: every shard of one PS is
    backed up by the same PS, so that a PS's whole state (its shards, and with them
    the dedup tables, ledgers and sync accumulators that change under the same
    requests) is one unit of replication, promoted as one. Largest PS first, each
    backup goes to the least-loaded PS (bytes of primaries and backups so far;
    ties: lowest PS) that is not already a copy and, given ``hosts`` (one label per
    PS), is on a host with the fewest copies: copies share a host only when there
    are fewer hosts than copies.
    """
    _check_sizes(sizes, num_ps)
    check_replication(replication, num_ps)
    if len(primaries) != len(sizes) or any(not 0 <= p < num_ps for p in primaries):
        raise InvalidArgument(f"invalid primaries {list(primaries)!r} for {num_ps} PS")
    if hosts is not None and len(hosts) != num_ps:
        raise InvalidArgument(f"{len(hosts)} host labels for {num_ps} PS tasks")
    host = list(hosts) if hosts is not None else [str(ps) for ps in range(num_ps)]
    group = [0] * num_ps  # bytes each PS holds as primary
    for size, ps in zip(sizes, primaries, strict=True):
        group[ps] += size
    loads = list(group)
    backups_of: dict[int, tuple[int, ...]] = {}
    for primary in sorted(set(primaries), key=lambda ps: (-group[ps], ps)):
        copies = [primary]
        for _ in range(replication - 1):
            on_host = Counter(host[c] for c in copies)
            ps = min(
                (ps for ps in range(num_ps) if ps not in copies),
                key=lambda ps: (on_host[host[ps]], loads[ps], ps),
            )
            copies.append(ps)
            loads[ps] += group[primary]
        backups_of[primary] = tuple(copies[1:])
    return [backups_of[ps] for ps in primaries]


#: Placement policies by the name users type (``--placement``).
PLACEMENTS: Mapping[str, PlacementPolicy] = MappingProxyType(
    {"round_robin": round_robin, "greedy": greedy_by_bytes}
)


def _policy(placement: str | PlacementPolicy) -> PlacementPolicy:
    if callable(placement):
        return placement
    try:
        return PLACEMENTS[placement]
    except KeyError:
        raise InvalidArgument(
            f"unknown placement {placement!r} (expected one of {', '.join(PLACEMENTS)})"
        ) from None


def plan(
    variables: Sequence[VariableDef],
    num_ps: int,
    partitioner: Partitioner,
    placement: str | PlacementPolicy = "round_robin",
    optimizer: Mapping[str, Any] = DEFAULT_OPTIMIZER,
    replication: int = 1,
    hosts: Sequence[str] | None = None,
) -> Placement:
    """The chief's placement map for ``variables`` on ``num_ps`` PS tasks.

    Shard ids are ``0..n-1`` in variable order, then shard order. Variables keep
    their own optimizer (``None`` means the job default, ``optimizer``). The policy
    places the primaries; with ``replication`` > 1, :func:`place_backups` the rest.
    """
    _check_positive("num_ps", num_ps)
    check_replication(replication, num_ps)
    policy = _policy(placement)
    seen: set[str] = set()
    for v in variables:
        if v.name in seen:
            raise InvalidArgument(f"duplicate variable name {v.name!r}")
        seen.add(v.name)

    # counted before anything is split: a variable of 2**40 rows asked for 2**24 shards,
    # and the chief built them all (gigabytes) before any check said no
    counts = [partitioner.num_shards_for(v, num_ps) for v in variables]
    if sum(counts) > MAX_SHARDS:
        n, big = max(zip(counts, variables, strict=True), key=lambda c: c[0])
        raise InvalidArgument(
            f"these variables need {sum(counts):,} shards, at most {MAX_SHARDS:,} are"
            f" possible ({big.name} {list(big.shape)}, {big.nbytes:,} bytes, alone needs"
            f" {n:,} of at most {partitioner.max_shard_bytes:,} bytes)"
        )
    pieces: list[tuple[VariableDef, int, int, int]] = []  # (var, index, row_start, rows)
    for v in variables:
        for index, (row_start, rows) in enumerate(partitioner.split(v, num_ps)):
            pieces.append((v, index, row_start, rows))
    sizes = [rows * v.row_size * v.itemsize for v, _, _, rows in pieces]
    ps_of = policy(sizes, num_ps)
    if len(ps_of) != len(pieces) or any(not 0 <= p < num_ps for p in ps_of):
        raise InvalidArgument(f"placement policy returned an invalid assignment {ps_of!r}")

    backups = (
        place_backups(sizes, ps_of, num_ps, replication, hosts)
        if replication > 1
        else [()] * len(pieces)
    )
    shards = tuple(
        ShardInfo(sid, v.name, index, row_start, rows, ps, bs)
        for sid, ((v, index, row_start, rows), ps, bs) in enumerate(
            zip(pieces, ps_of, backups, strict=True)
        )
    )
    return Placement(
        variables=tuple(variables),
        shards=shards,
        optimizer=dict(sorted(optimizer.items())),
    )
