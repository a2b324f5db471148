"""The benchmark workloads and the frames they move (pure: no IO, no processes).

Rules of this module:

* A :class:`Workload` is what every side runs: the variables, their shards
  (row ranges on PS tasks, as zmqps' chief plans them), the variants of a step
  and the unit of throughput. It travels to child processes as JSON.
* The shard layout comes from zmqps' own planner with the chief's partitioner
  flags; the coordinator replaces it by the placement a zmqps worker actually
  received when they differ, so raw and torch move exactly zmqps' shards.
* Frame sizes mirror zmqps' client and PS: dense shards in chunks of at most
  :data:`CHUNK_BYTES`, one message per PS per operation, row requests with one
  index frame (unique int64 ids) per shard and one rows frame per shard.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.core.partition import Partitioner, plan
from zmqps.core.variables import ShardInfo, VariableDef

__all__ = [
    "CHUNK_BYTES",
    "SUITES",
    "VARIANTS",
    "Workload",
    "dense",
    "hashed_ids",
    "header_bytes",
    "small",
    "sparse",
]

Array = npt.NDArray[Any]

#: zmqps' frame size for large shards (Worker(chunk_bytes=...) and PSConfig defaults).
CHUNK_BYTES = 4 << 20
#: the three suites, in the order they run.
SUITES = ("dense", "sparse", "small")
#: step variants per suite; the first one is the issue's (acceptance) pattern.
VARIANTS = {
    "dense": ("pull+push", "push_pull"),
    "sparse": ("rows", "fresh"),
    "small": ("pull+push", "push_pull"),
}
#: distinct id batches each sparse worker cycles through (drawn before timing).
ID_POOL = 32
#: the hash-keyed side's ids: the pool's ids times this odd constant, mod 2**64, as
#: int64 (a bijection, so as many distinct ids, spread over the whole int64 range).
_SPREAD = np.uint64(0x9E3779B97F4A7C15)
#: rows per PS shard of the hash-keyed side's table unless the bench says otherwise.
DEFAULT_ROW_BUDGET = 262_144
#: shapes of the ``small`` suite's variables, cycled (256 B .. 4 KiB each).
SMALL_SHAPES: tuple[tuple[int, ...], ...] = (
    (64,),
    (128,),
    (16, 16),
    (256,),
    (512,),
    (32, 32),
    (64, 16),
)


def hashed_ids(ids: Array) -> Array:
    """The hash-keyed side's ids for the pool's ``ids`` (same count, same repeats)."""
    with np.errstate(over="ignore"):
        spread: Array = (np.asarray(ids, np.int64).view(np.uint64) * _SPREAD).view(np.int64)
    return spread


def header_bytes(buffers: int) -> int:
    """About the size of a zmqps msgpack header announcing ``buffers`` buffers."""
    return 64 + 24 * buffers


@dataclass(frozen=True)
class Workload:
    suite: str
    variables: tuple[VariableDef, ...]
    shards: tuple[ShardInfo, ...]
    num_ps: int
    partitioner: Partitioner
    variants: tuple[str, ...]
    batch_rows: int = 0  # sparse: ids per step
    lr: float = 0.01
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ units

    @property
    def unit(self) -> str:
        return "rows/s" if self.suite == "sparse" else "steps/s"

    @property
    def units_per_step(self) -> int:
        return self.batch_rows if self.suite == "sparse" else 1

    @property
    def optimizer(self) -> dict[str, Any]:
        return {"name": "sgd", "lr": self.lr}

    @property
    def model_bytes(self) -> int:
        return sum(v.nbytes for v in self.variables)

    @property
    def row_bytes(self) -> int:
        v = self.variables[0]
        return v.row_size * v.itemsize

    def bytes_per_unit(self) -> int:
        """Payload bytes moved (both directions) per unit of throughput."""
        if self.suite == "sparse":
            return 2 * self.row_bytes
        return 2 * self.model_bytes

    # ------------------------------------------------------------------ layout

    def variable(self, name: str) -> VariableDef:
        for v in self.variables:
            if v.name == name:
                return v
        raise KeyError(name)

    def shard_shape(self, s: ShardInfo) -> tuple[int, ...]:
        return (s.rows, *self.variable(s.var).shape[1:])

    def shard_nbytes(self, s: ShardInfo) -> int:
        v = self.variable(s.var)
        return s.rows * v.row_size * v.itemsize

    def shards_on(self, ps: int) -> list[ShardInfo]:
        """The shards of PS ``ps`` in the order zmqps' client sends them."""
        return [s for s in self.shards if s.ps == ps]

    def active_ps(self) -> list[int]:
        """PS tasks holding at least one shard (zmqps sends nothing to the others)."""
        return sorted({s.ps for s in self.shards})

    def chunk_sizes(self, ps: int) -> list[int]:
        """Byte sizes of the dense frames of PS ``ps`` (a pull reply; a push the same)."""
        out: list[int] = []
        for s in self.shards_on(ps):
            n = self.shard_nbytes(s)
            itemsize = self.variable(s.var).itemsize
            step = max(1, CHUNK_BYTES // itemsize) * itemsize
            out.extend(min(step, n - off) for off in range(0, n, step))
        return out

    def frames_per_step(self) -> int:
        return sum(len(self.chunk_sizes(ps)) for ps in self.active_ps())

    def with_shards(self, shards: Sequence[ShardInfo]) -> Workload:
        return replace(self, shards=tuple(shards))

    # ------------------------------------------------------------------ sparse ids

    def id_pool(self, seed: int, worker: int) -> Array:
        """(ID_POOL, batch_rows) int64 ids drawn uniformly; the same on every side."""
        rows = self.variables[0].shape[0]
        rng = np.random.default_rng([seed, worker])
        return rng.integers(0, rows, size=(ID_POOL, self.batch_rows), dtype=np.int64)

    def fresh_ids(self, seed: int, worker: int, *, hashed: bool = False) -> Iterator[Array]:
        """Endless (batch_rows,) int64 id batches, each drawn anew (the ``fresh`` variant):
        uniform over the table's rows, or for a hash-keyed table over the whole int64
        range, so (with overwhelming probability) every id is one the table has not seen."""
        rows = self.variables[0].shape[0]
        rng = np.random.default_rng([seed, worker, 1])
        info = np.iinfo(np.int64)
        while True:
            if hashed:
                yield rng.integers(info.min, info.max, size=self.batch_rows, dtype=np.int64)
            else:
                yield rng.integers(0, rows, size=self.batch_rows, dtype=np.int64)

    def split_ids(self, ids: Array) -> dict[int, list[tuple[ShardInfo, Array]]]:
        """Unique ``ids`` grouped like zmqps' client: ps -> [(shard, its ids)]."""
        uniq = np.unique(ids)
        shards = sorted(self.shards, key=lambda s: s.row_start)
        starts = np.array([s.row_start for s in shards], dtype=np.int64)
        which = np.searchsorted(starts, uniq, side="right") - 1
        out: dict[int, list[tuple[ShardInfo, Array]]] = {}
        for k, s in enumerate(shards):
            part = uniq[which == k]
            if part.size:
                out.setdefault(s.ps, []).append((s, part))
        return out

    # ------------------------------------------------------------------ wire

    def describe(self) -> str:
        return self.description

    def to_json(self) -> dict[str, Any]:
        p = self.partitioner
        return {
            "suite": self.suite,
            "variables": [v.to_wire() for v in self.variables],
            "shards": [s.to_wire() for s in self.shards],
            "num_ps": self.num_ps,
            "partitioner": {
                "num_shards": p.num_shards,
                "min_shard_bytes": p.min_shard_bytes,
                "max_shard_bytes": p.max_shard_bytes,
            },
            "variants": list(self.variants),
            "batch_rows": self.batch_rows,
            "lr": self.lr,
            "description": self.description,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Workload:
        return cls(
            suite=d["suite"],
            variables=tuple(VariableDef.from_wire(v) for v in d["variables"]),
            shards=tuple(ShardInfo.from_wire(s) for s in d["shards"]),
            num_ps=int(d["num_ps"]),
            partitioner=Partitioner(**d["partitioner"]),
            variants=tuple(d["variants"]),
            batch_rows=int(d["batch_rows"]),
            lr=float(d["lr"]),
            description=d.get("description", ""),
            extra=dict(d.get("extra", {})),
        )

    def summary(self) -> dict[str, Any]:
        """What the JSON report says about the workload (no per-shard lists)."""
        out = {
            "suite": self.suite,
            "description": self.description,
            "variables": len(self.variables),
            "model_bytes": self.model_bytes,
            "shards": len(self.shards),
            "num_ps": self.num_ps,
            "chunk_bytes": CHUNK_BYTES,
            "unit": self.unit,
            **self.extra,
        }
        if self.suite == "sparse":
            out["batch_rows"] = self.batch_rows
        else:
            out["frames_per_message_each_way"] = self.frames_per_step()
        return out


def _planned(
    suite: str,
    variables: Sequence[VariableDef],
    num_ps: int,
    partitioner: Partitioner,
    batch_rows: int = 0,
    description: str = "",
    extra: dict[str, Any] | None = None,
) -> Workload:
    lr = 0.01
    placement = plan(variables, num_ps, partitioner, "round_robin", {"name": "sgd", "lr": lr})
    return Workload(
        suite,
        tuple(variables),
        placement.shards,
        num_ps,
        partitioner,
        VARIANTS[suite],
        batch_rows,
        lr,
        description,
        extra or {},
    )


def _mib(n: float) -> str:
    return f"{n / (1 << 20):g} MiB"


def dense(
    size_mb: float, num_ps: int = 1, shard_mb: float = 16, num_shards: int | None = None
) -> Workload:
    """One float32 variable of ``size_mb`` MiB, shape (rows, 1024), in shards."""
    cols = 1024
    rows = max(1, round(size_mb * (1 << 20) / (4 * cols)))
    var = VariableDef("dense", (rows, cols), "float32")
    part = Partitioner(num_shards=num_shards, max_shard_bytes=max(1, int(shard_mb * (1 << 20))))
    w = _planned("dense", [var], num_ps, part)
    desc = (
        f"{_mib(var.nbytes)} float32 model {var.shape}, {len(w.shards)} shards"
        f" on {num_ps} PS, {w.frames_per_step()} frames of <= {_mib(CHUNK_BYTES)} each way"
    )
    return replace(w, description=desc)


def sparse(
    rows: int = 1_000_000,
    dim: int = 64,
    batch_rows: int = 4096,
    num_ps: int = 1,
    shard_mb: float = 64,
    num_shards: int | None = None,
    row_budget: int = DEFAULT_ROW_BUDGET,
    rows_wait: bool = False,
    rows_two: bool = False,
) -> Workload:
    """One embedding table ``(rows, dim)``, ``batch_rows`` uniform random ids per step.

    The ``zmqps-hash`` side moves the same ids (spread by :func:`hashed_ids`) through a
    hash-keyed table of the same row width, ``row_budget`` rows per PS shard.
    ``rows_wait``: the zmqps sides wait for each push before the next step's pull.
    By default a zmqps step is one request to the PS (``Worker.push_pull_rows``: the
    last step's push and this step's pull); ``rows_two``: two, the pull and the push
    (``Worker.push_rows_async``: the push travels while the next step's pull goes out)."""
    var = VariableDef("emb", (rows, dim), "float32", sparse=True)
    part = Partitioner(num_shards=num_shards, max_shard_bytes=max(1, int(shard_mb * (1 << 20))))
    extra: dict[str, Any] = {"row_budget": row_budget}
    if rows_wait:
        extra["rows_wait"] = True
    if rows_two:
        extra["rows_two"] = True
    w = _planned("sparse", [var], num_ps, part, batch_rows, extra=extra)
    desc = (
        f"embedding {var.shape} float32 ({_mib(var.nbytes)}), {len(w.shards)} shards"
        f" on {num_ps} PS, {batch_rows} random ids per step (pull_rows + push_rows);"
        f" hash-keyed: {row_budget} rows per shard at most"
    )
    return replace(w, description=desc)


def small(variables: int = 300, num_ps: int = 1) -> Workload:
    """``variables`` small float32 variables (256 B .. 4 KiB), one shard each."""
    defs = [
        VariableDef(f"v{i:04d}", SMALL_SHAPES[i % len(SMALL_SHAPES)], "float32")
        for i in range(variables)
    ]
    w = _planned("small", defs, num_ps, Partitioner())
    total = sum(v.nbytes for v in defs)
    desc = (
        f"{variables} float32 variables of {min(v.nbytes for v in defs)}"
        f"..{max(v.nbytes for v in defs)} B ({total / 1024:.0f} KiB in all) on {num_ps} PS,"
        f" {w.frames_per_step()} frames each way"
    )
    return replace(w, description=desc)
