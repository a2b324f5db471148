"""Variable, shard and placement definitions: plain frozen data, with wire forms.

Rules of this module:

* A variable is split along axis 0 into shards; a shard is the row range
  ``[row_start, row_start + rows)`` of its variable.
* The chief computes the :class:`Placement` once; workers receive it and never
  compute it themselves. Shard ids are dense ``0..n-1`` in placement order.
* ``to_wire`` / ``from_wire`` produce / accept the msgpack-able dicts of
  :mod:`zmqps.wire.schema` (``VARIABLE``, ``SHARD``); ``from_wire`` raises
  :class:`InvalidArgument` for values the schema cannot express (bad dtype...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from zmqps.core.lowp import WIRE_DTYPES
from zmqps.wire.codec import DTYPES
from zmqps.wire.errors import InvalidArgument

__all__ = ["FLOAT_DTYPES", "Placement", "ShardDef", "ShardInfo", "VariableDef"]

#: dtypes a trainable variable may have.
FLOAT_DTYPES = ("float16", "float32", "float64")


def _check_wire(name: str, wire: str | None, dtype: str, sparse: bool) -> None:
    """A wire dtype must be one of :data:`~zmqps.core.lowp.WIRE_DTYPES`, for a dense
    variable of a dtype it narrows."""
    if wire is None:
        return
    if wire not in WIRE_DTYPES:
        raise InvalidArgument(
            f"variable {name}: wire dtype {wire!r} not in {', '.join(sorted(WIRE_DTYPES))}"
        )
    if sparse:
        raise InvalidArgument(f"variable {name}: a wire dtype is for dense variables only")
    if dtype not in WIRE_DTYPES[wire]:
        raise InvalidArgument(
            f"variable {name}: wire dtype {wire} is for {', '.join(WIRE_DTYPES[wire])}"
            f" variables, not {dtype}"
        )


def _wire_dtype(wire: str | None, dtype: str) -> np.dtype[Any]:
    return np.dtype(dtype) if wire is None else DTYPES[wire]


def _frozen(d: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(sorted((d or {}).items()))


def _check_table(name: str, table: Mapping[str, Any], init: Mapping[str, Any]) -> dict[str, Any]:
    from zmqps.core.hashtable import TableConfig, validate_table_init

    try:
        TableConfig.parse(table)
        validate_table_init(init)
    except ValueError as e:
        raise InvalidArgument(f"variable {name}: {e}") from None
    return _frozen(table)


@dataclass(frozen=True)
class VariableDef:
    """A variable as users declare it.

    ``init`` and ``optimizer`` are config maps, e.g. ``{"name": "normal", "stddev": 0.1,
    "seed": 1}`` and ``{"name": "adam", "lr": 1e-3}``; ``optimizer=None`` means the
    job's default optimizer. ``sparse`` marks an embedding table (pulled / pushed by rows).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    init: Mapping[str, Any] = field(default_factory=lambda: {"name": "zeros"})
    optimizer: Mapping[str, Any] | None = None
    sparse: bool = False
    #: a hash-keyed table's row policy (:mod:`zmqps.core.hashtable`); ``shape[0]`` is then
    #: its number of hash buckets
    table: Mapping[str, Any] | None = None
    #: the dtype its values and gradients travel as (:mod:`zmqps.core.lowp`), when
    #: narrower than ``dtype``: ``"bfloat16"`` for a dense float32 variable; None: ``dtype``
    wire: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "init", _frozen(self.init))
        if self.optimizer is not None:
            object.__setattr__(self, "optimizer", _frozen(self.optimizer))
        if self.table is not None:
            object.__setattr__(self, "table", _check_table(self.name, self.table, self.init))
            object.__setattr__(self, "sparse", True)
        if not self.name or len(self.name) > 256:
            raise InvalidArgument(f"variable name {self.name!r} must be 1..256 characters")
        if self.dtype not in FLOAT_DTYPES:
            raise InvalidArgument(
                f"variable {self.name}: dtype {self.dtype!r} not in {', '.join(FLOAT_DTYPES)}"
            )
        if not 1 <= len(self.shape) <= 8:
            raise InvalidArgument(
                f"variable {self.name}: shape {self.shape} must have 1..8 dims"
                " (use shape (1,) for a scalar)"
            )
        if any(d <= 0 for d in self.shape):
            raise InvalidArgument(f"variable {self.name}: dims of {self.shape} must be positive")
        _check_wire(self.name, self.wire, self.dtype, self.sparse)

    @property
    def row_size(self) -> int:
        """Elements per row (product of dims after the first)."""
        return math.prod(self.shape[1:])

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def wire_dtype(self) -> np.dtype[Any]:
        """The dtype its values and gradients travel as."""
        return _wire_dtype(self.wire, self.dtype)

    @property
    def hashed(self) -> bool:
        """Is this a hash-keyed table (rows addressed by int64 id)?"""
        return self.table is not None

    def with_optimizer(self, default: Mapping[str, Any]) -> VariableDef:
        """This variable with ``default`` filled in when it has no optimizer of its own."""
        if self.optimizer is not None:
            return self
        return replace(self, optimizer=default)

    def with_wire(self, wire: str | None) -> VariableDef:
        """This variable travelling as ``wire`` (a job's ``--wire-dtype``) when it has no
        wire dtype of its own and can take that one (dense, of a dtype ``wire`` narrows);
        else as it is."""
        if wire is None or self.wire is not None or self.sparse:
            return self
        if self.dtype not in WIRE_DTYPES.get(wire, ()):
            return self
        return replace(self, wire=wire)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "init": dict(self.init),
            "sparse": self.sparse,
        }
        if self.optimizer is not None:
            out["optimizer"] = dict(self.optimizer)
        if self.table is not None:
            out["table"] = dict(self.table)
        if self.wire is not None:
            out["wire"] = self.wire
        return out

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> VariableDef:
        return cls(
            name=d["name"],
            shape=tuple(d["shape"]),
            dtype=d["dtype"],
            init=d.get("init", {"name": "zeros"}),
            optimizer=d.get("optimizer"),
            sparse=d.get("sparse", False),
            table=d.get("table"),
            wire=d.get("wire"),
        )


@dataclass(frozen=True)
class ShardInfo:
    """Where one shard lives: rows ``[row_start, row_start + rows)`` of ``var`` on PS ``ps``."""

    id: int
    var: str
    index: int
    row_start: int
    rows: int
    ps: int
    #: the PS holding the shard's other copies (``--replication R``: R - 1 of them),
    #: none of them ``ps`` nor each other; ``ps`` is the primary
    backups: tuple[int, ...] = ()
    #: the PS state the shard belongs to (the index of its first primary), when a
    #: fail-over moved its primary to another PS; None: ``ps``
    slot: int | None = None

    def __post_init__(self) -> None:
        copies = self.copies
        if len(set(copies)) != len(copies):
            raise InvalidArgument(f"shard {self.id}: two copies on one PS: {list(copies)}")

    @property
    def copies(self) -> tuple[int, ...]:
        """Every PS holding the shard, the primary first."""
        return (self.ps, *self.backups)

    @property
    def state(self) -> int:
        """The PS state the shard belongs to: what a request for it names as its slot
        (sequence numbers, deduplication and ledgers are per state)."""
        return self.ps if self.slot is None else self.slot

    def to_wire(self) -> list[Any]:
        return [self.id, self.var, self.index, self.row_start, self.rows, self.ps]

    @classmethod
    def from_wire(cls, d: Sequence[Any]) -> ShardInfo:
        sid, var, index, row_start, rows, ps = d
        return cls(int(sid), str(var), int(index), int(row_start), int(rows), int(ps))


@dataclass(frozen=True)
class ShardDef:
    """Everything a PS needs to create one shard (its variable's config + its row range)."""

    id: int
    var: str
    index: int
    dtype: str
    full_shape: tuple[int, ...]
    row_start: int
    rows: int
    init: Mapping[str, Any]
    optimizer: Mapping[str, Any]
    sparse: bool = False
    table: Mapping[str, Any] | None = None
    #: its variable's wire dtype (None: ``dtype``)
    wire: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "full_shape", tuple(int(d) for d in self.full_shape))
        object.__setattr__(self, "init", _frozen(self.init))
        object.__setattr__(self, "optimizer", _frozen(self.optimizer))
        if self.table is not None:
            object.__setattr__(self, "table", _check_table(self.var, self.table, self.init))
        if self.dtype not in FLOAT_DTYPES:
            raise InvalidArgument(f"shard {self.id}: dtype {self.dtype!r} not allowed")
        if not self.full_shape or any(d <= 0 for d in self.full_shape):
            raise InvalidArgument(f"shard {self.id}: bad full shape {self.full_shape}")
        if self.rows <= 0 or self.row_start < 0 or self.row_start + self.rows > self.full_shape[0]:
            raise InvalidArgument(
                f"shard {self.id}: rows [{self.row_start}, {self.row_start + self.rows})"
                f" outside {self.full_shape}"
            )
        _check_wire(self.var, self.wire, self.dtype, self.sparse)

    @property
    def wire_dtype(self) -> np.dtype[Any]:
        """The dtype its values and gradients travel as."""
        return _wire_dtype(self.wire, self.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.full_shape[1:])

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    @classmethod
    def of(
        cls, var: VariableDef, info: ShardInfo, default_optimizer: Mapping[str, Any]
    ) -> ShardDef:
        return cls(
            id=info.id,
            var=var.name,
            index=info.index,
            dtype=var.dtype,
            full_shape=var.shape,
            row_start=info.row_start,
            rows=info.rows,
            init=var.init,
            optimizer=var.optimizer if var.optimizer is not None else default_optimizer,
            sparse=var.sparse,
            table=var.table,
            wire=var.wire,
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "var": self.var,
            "index": self.index,
            "dtype": self.dtype,
            "full_shape": list(self.full_shape),
            "row_start": self.row_start,
            "rows": self.rows,
            "init": dict(self.init),
            "optimizer": dict(self.optimizer),
            "sparse": self.sparse,
            **({} if self.table is None else {"table": dict(self.table)}),
            **({} if self.wire is None else {"wire": self.wire}),
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> ShardDef:
        return cls(
            id=d["id"],
            var=d["var"],
            index=d["index"],
            dtype=d["dtype"],
            full_shape=tuple(d["full_shape"]),
            row_start=d["row_start"],
            rows=d["rows"],
            init=d["init"],
            optimizer=d["optimizer"],
            sparse=d["sparse"],
            table=d.get("table"),
            wire=d.get("wire"),
        )


@dataclass(frozen=True)
class Placement:
    """The chief's placement map: variables (with their optimizer resolved) and shards."""

    variables: tuple[VariableDef, ...]
    shards: tuple[ShardInfo, ...]
    optimizer: Mapping[str, Any] = field(default_factory=lambda: {"name": "sgd", "lr": 0.01})
    #: one more at every change of where shards live (a backup promoted, a copy
    #: dropped or added): a request routed by an older epoch is re-routed
    epoch: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {v.name: v for v in self.variables})

    def variable(self, name: str) -> VariableDef:
        by_name: dict[str, VariableDef] = self._by_name  # type: ignore[attr-defined]
        return by_name[name]

    def shards_of(self, name: str) -> list[ShardInfo]:
        return [s for s in self.shards if s.var == name]

    def shard_defs(self) -> list[tuple[int, ShardDef]]:
        """``(ps index, ShardDef)`` for every shard, for sending to the PS."""
        by_name = {v.name: v for v in self.variables}
        return [(s.ps, ShardDef.of(by_name[s.var], s, self.optimizer)) for s in self.shards]

    @property
    def replication(self) -> int:
        """Copies of each shard (1: no backups)."""
        return 1 + max((len(s.backups) for s in self.shards), default=0)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "variables": [v.to_wire() for v in self.variables],
            "shards": [s.to_wire() for s in self.shards],
            "optimizer": dict(self.optimizer),
        }
        if self.replication > 1:  # a placement without backups reads as before
            out["backups"] = [list(s.backups) for s in self.shards]
        if any(s.slot is not None and s.slot != s.ps for s in self.shards):
            out["slots"] = [s.state for s in self.shards]
        if self.epoch:
            out["epoch"] = self.epoch
        return out

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Placement:
        shards = [ShardInfo.from_wire(s) for s in d["shards"]]
        backups = d.get("backups")
        if backups is not None:
            if len(backups) != len(shards):
                raise InvalidArgument(
                    f"placement: {len(backups)} backup lists for {len(shards)} shards"
                )
            shards = [
                replace(s, backups=tuple(int(b) for b in bs))
                for s, bs in zip(shards, backups, strict=True)
            ]
        slots = d.get("slots")
        if slots is not None:
            if len(slots) != len(shards):
                raise InvalidArgument(f"placement: {len(slots)} slots for {len(shards)} shards")
            shards = [
                replace(s, slot=int(slot) if int(slot) != s.ps else None)
                for s, slot in zip(shards, slots, strict=True)
            ]
        return cls(
            variables=tuple(VariableDef.from_wire(v) for v in d["variables"]),
            shards=tuple(shards),
            optimizer=d["optimizer"],
            epoch=int(d.get("epoch", 0)),
        )
