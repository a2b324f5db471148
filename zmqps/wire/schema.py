"""A tiny, strict schema language for decoded msgpack headers, and the body schema of every op.

Rules of this module:

* Validation never trusts the input: every container has a length bound, every
  number a range, every string a length; unknown keys are refused.
* A schema only *checks*; it never converts or copies the value.
* Failures raise :class:`~zmqps.wire.errors.ProtocolError` naming the path of the bad field.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zmqps.wire.errors import ProtocolError

__all__ = [  # noqa: F822 - REQUEST_BODIES is served by __getattr__ (the typed ops)
    "REQUEST_BODIES",
    "AnyList",
    "AnyMap",
    "Bool",
    "Dict",
    "Float",
    "Int",
    "List",
    "Map",
    "Nullable",
    "Schema",
    "Str",
    "Tree",
    "Tuple",
]

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


class Schema:
    """Base class: ``check(value, path)`` raises ProtocolError or returns None."""

    def check(self, value: Any, path: str) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Schema):
    lo: int = INT64_MIN
    hi: int = INT64_MAX

    def check(self, value: Any, path: str) -> None:
        if type(value) is not int:
            raise ProtocolError(f"{path}: expected int, got {type(value).__name__}")
        if not self.lo <= value <= self.hi:
            raise ProtocolError(f"{path}: {value} outside [{self.lo}, {self.hi}]")


@dataclass(frozen=True)
class Float(Schema):
    lo: float = float("-inf")
    hi: float = float("inf")

    def check(self, value: Any, path: str) -> None:
        if type(value) not in (int, float):
            raise ProtocolError(f"{path}: expected number, got {type(value).__name__}")
        if value != value or not self.lo <= value <= self.hi:  # NaN or out of range
            raise ProtocolError(f"{path}: {value!r} outside [{self.lo}, {self.hi}]")


@dataclass(frozen=True)
class Str(Schema):
    max_len: int = 256

    def check(self, value: Any, path: str) -> None:
        if type(value) is not str:
            raise ProtocolError(f"{path}: expected str, got {type(value).__name__}")
        if len(value) > self.max_len:
            raise ProtocolError(f"{path}: string longer than {self.max_len}")


@dataclass(frozen=True)
class OneOf(Schema):
    """One of a few known strings."""

    values: frozenset[str]

    def check(self, value: Any, path: str) -> None:
        if type(value) is not str or value not in self.values:
            shown = repr(value)[:40] if type(value) is str else type(value).__name__
            raise ProtocolError(f"{path}: {shown} is not one of {', '.join(sorted(self.values))}")


@dataclass(frozen=True)
class Bool(Schema):
    def check(self, value: Any, path: str) -> None:
        if type(value) is not bool:
            raise ProtocolError(f"{path}: expected bool, got {type(value).__name__}")


@dataclass(frozen=True)
class List(Schema):
    item: Schema
    max_len: int = 1024

    def check(self, value: Any, path: str) -> None:
        if type(value) is not list:
            raise ProtocolError(f"{path}: expected list, got {type(value).__name__}")
        if len(value) > self.max_len:
            raise ProtocolError(f"{path}: list longer than {self.max_len}")
        item = self.item
        if type(item) is Int:  # the common long list (shard ids, versions): no call per item
            lo, hi = item.lo, item.hi
            for v in value:
                if type(v) is not int or not lo <= v <= hi:
                    break
            else:
                return
        for i, v in enumerate(value):  # names the first bad item
            item.check(v, f"{path}[{i}]")


@dataclass(frozen=True)
class Map(Schema):
    """A map with string keys: ``required`` and ``optional`` fields, each with its
    schema. Unknown keys are refused, unless ``extra`` (reply bodies: a newer peer may
    send fields this side does not know; they are ignored, never trusted)."""

    required: Mapping[str, Schema] = field(default_factory=dict)
    optional: Mapping[str, Schema] = field(default_factory=dict)
    extra: bool = False

    @functools.cached_property
    def _fields(self) -> Mapping[str, Schema]:
        """Every field's schema, by name (a required one's where a name is both)."""
        return {**self.optional, **self.required}

    def check(self, value: Any, path: str) -> None:
        if type(value) is not dict:
            raise ProtocolError(f"{path}: expected map, got {type(value).__name__}")
        for key in self.required:
            if key not in value:
                raise ProtocolError(f"{path}: missing field {key!r}")
        fields = self._fields
        for key, v in value.items():
            sub = fields.get(key)
            if sub is None:
                if self.extra and type(key) is str:
                    continue
                raise ProtocolError(f"{path}: unknown field {key!r}")
            # the common scalar fields checked here, with no path made; anything else
            # (or a bad value: its check says what is wrong) by the field's schema
            kind = type(sub)
            if kind is Int:
                if type(v) is int and sub.lo <= v <= sub.hi:  # type: ignore[attr-defined]
                    continue
            elif kind is Str:
                if type(v) is str and len(v) <= sub.max_len:  # type: ignore[attr-defined]
                    continue
            elif kind is Bool:
                if type(v) is bool:
                    continue
            elif kind is Float:
                if type(v) in (int, float) and sub.lo <= v <= sub.hi:  # type: ignore[attr-defined]
                    continue  # (NaN fails the comparisons)
            elif kind is AnyList and type(v) is list:
                continue
            sub.check(v, f"{path}.{key}")


@dataclass(frozen=True)
class Nullable(Schema):
    """``None``, or a value of ``schema`` (a field that is always sent, maybe empty)."""

    schema: Schema

    def check(self, value: Any, path: str) -> None:
        if value is not None:
            self.schema.check(value, path)


@dataclass(frozen=True)
class Dict(Schema):
    """A map from strings (at most ``max_len`` of them) to values of one schema."""

    value: Schema
    key: Str = field(default_factory=lambda: Str(256))
    max_len: int = 1 << 16

    def check(self, value: Any, path: str) -> None:
        if type(value) is not dict:
            raise ProtocolError(f"{path}: expected map, got {type(value).__name__}")
        if len(value) > self.max_len:
            raise ProtocolError(f"{path}: more than {self.max_len} entries")
        for k, v in value.items():
            self.key.check(k, f"{path} key")
            self.value.check(v, f"{path}.{k}")


@dataclass(frozen=True)
class AnyMap(Schema):
    """A map with string keys whose values are not checked here (msgpack limits bound them)."""

    def check(self, value: Any, path: str) -> None:
        if type(value) is not dict:
            raise ProtocolError(f"{path}: expected map, got {type(value).__name__}")
        for key in value:
            if type(key) is not str:
                raise ProtocolError(f"{path}: map keys must be strings")


@dataclass(frozen=True)
class AnyList(Schema):
    """A list whose items are checked elsewhere."""

    def check(self, value: Any, path: str) -> None:
        if type(value) is not list:
            raise ProtocolError(f"{path}: expected list, got {type(value).__name__}")


@dataclass(frozen=True)
class Tuple(Schema):
    """A list of fixed length whose i-th item matches ``items[i]``."""

    items: tuple[Schema, ...]

    def check(self, value: Any, path: str) -> None:
        if type(value) is not list:
            raise ProtocolError(f"{path}: expected list, got {type(value).__name__}")
        if len(value) != len(self.items):
            raise ProtocolError(f"{path}: expected {len(self.items)} items, got {len(value)}")
        for i, (item, v) in enumerate(zip(self.items, value, strict=True)):
            item.check(v, f"{path}[{i}]")


#: Tags of :class:`Tree` nodes (see :mod:`zmqps.wire.values`): list, tuple, dict,
#: array buffer, numpy scalar buffer, per-worker resource reference.
TREE_TAGS = frozenset({"l", "t", "d", "a", "s", "r"})


@dataclass(frozen=True)
class Tree(Schema):
    """A nested value of a scheduled function (:mod:`zmqps.wire.values`): scalars (None,
    bool, int, float, str) or ``[tag, payload]`` nodes. Walked without recursion, so a
    hostile nesting depth costs no stack; deeper than ``max_depth`` or more than
    ``max_nodes`` nodes is refused."""

    max_depth: int = 32
    max_nodes: int = 1 << 16
    #: the tag the top node must have (``t``: positional arguments, ``d``: keywords)
    root: str | None = None

    def check(self, value: Any, path: str) -> None:
        if self.root is not None and not (
            type(value) is list and len(value) == 2 and value[0] == self.root
        ):
            raise ProtocolError(f"{path}: expected a {self.root!r} node")
        stack: list[tuple[Any, int]] = [(value, 0)]
        nodes = 0
        while stack:
            v, depth = stack.pop()
            nodes += 1
            if nodes > self.max_nodes:
                raise ProtocolError(f"{path}: more than {self.max_nodes} nodes")
            if v is None or type(v) in (bool, int, float, str):
                continue
            if depth >= self.max_depth:
                raise ProtocolError(f"{path}: nested deeper than {self.max_depth}")
            if type(v) is not list or len(v) != 2 or type(v[0]) is not str:
                raise ProtocolError(f"{path}: expected a scalar or a [tag, payload] node")
            tag, payload = v
            if tag not in TREE_TAGS:
                raise ProtocolError(f"{path}: unknown node tag {tag[:8]!r}")
            if tag in ("l", "t"):
                if type(payload) is not list:
                    raise ProtocolError(f"{path}: a {tag!r} node holds a list")
                stack.extend((item, depth + 1) for item in payload)
            elif tag == "d":
                if type(payload) is not dict:
                    raise ProtocolError(f"{path}: a 'd' node holds a map")
                for key, item in payload.items():
                    if type(key) is not str:
                        raise ProtocolError(f"{path}: map keys must be strings")
                    stack.append((item, depth + 1))
            elif type(payload) is not int or not 0 <= payload < 2**31:
                raise ProtocolError(f"{path}: a {tag!r} node holds an index")


# ---------------------------------------------------------------------------
# Building blocks shared by several ops.

NAME = Str(256)
ROLE = Str(32)
#: the roles a task that registers with the chief may have (anything else is refused:
#: it used to count as an evaluator, whose last evaluation a finished run waits for)
TASK_ROLE = OneOf(frozenset({"worker", "evaluator"}))
COUNT = Int(0, INT64_MAX)
#: what one task reports of itself (steps, examples, skipped steps): far past any run
#: (2**48 steps at a million a second is nine years), so that every task's summed by
#: the chief stays an int64 the replies can carry
MAX_TALLY = 2**48
TALLY = Int(0, MAX_TALLY)
SHARD_ID = Int(0, 2**31 - 1)
#: a shard's dense gradient travels in at most one chunk per this many bytes (a PS
#: whose own chunks are smaller takes chunks that small), or in up to
#: :data:`FREE_CHUNKS` chunks of any size: its work stays in proportion to its bytes
MIN_CHUNK_BYTES = 64 << 10
FREE_CHUNKS = 64
#: the largest frame a peer takes (``MAXMSGSIZE``): a worker's chunks (4 MiB by
#: default) and a shard's whole gradient sum in a backup's entry fit
MAX_FRAME_BYTES = 256 << 20
DIM = Int(0, 2**48)
SHAPE = List(DIM, 8)
MAX_SHARDS = 1 << 16
#: the most copies of a shard (``--replication``)
MAX_REPLICATION = 16
#: the most row ids one ``pull_rows`` or ``push_rows`` names, all its shards together
MAX_ROWS = 1 << 20
#: the most row values (ids times the row's width) one ``pull_rows`` or ``push_rows``
#: moves, all its shards together: 128 MiB of float32. A request's reply, and the
#: work and memory a PS spends on it, is bounded by this whatever the ids (clients
#: split a larger pull into several requests).
MAX_ROW_VALUES = 1 << 25

INIT = Map(
    {"name": Str(32)},
    {
        "seed": Int(),
        "value": Float(),
        "low": Float(),
        "high": Float(),
        "mean": Float(),
        "stddev": Float(0.0),
    },
)

OPTIMIZER = Map(
    {"name": Str(32), "lr": Float(0.0)},
    {
        "momentum": Float(0.0, 1.0),
        "nesterov": Bool(),
        "beta1": Float(0.0, 1.0),
        "beta2": Float(0.0, 1.0),
        "eps": Float(0.0),
        "initial_accumulator": Float(0.0),
        "weight_decay": Float(0.0),
        "l1": Float(0.0),
        "l2": Float(0.0),
        "beta": Float(0.0),
    },
)

#: A hash-keyed table's row policy (``zmqps.core.hashtable.TableConfig``).
TABLE = Map(
    {},
    {
        "row_budget": Int(1, INT64_MAX),
        "admit_after": Int(1, INT64_MAX),
        "evict_after": Int(1, INT64_MAX),
        "pending_limit": Int(1, INT64_MAX),
    },
)

VARIABLE = Map(
    {"name": NAME, "shape": SHAPE, "dtype": Str(16)},
    {"init": INIT, "optimizer": OPTIMIZER, "sparse": Bool(), "table": TABLE, "wire": Str(16)},
)

SHARD = Map(
    {
        "id": SHARD_ID,
        "var": NAME,
        "index": Int(0, MAX_SHARDS),
        "dtype": Str(16),
        "full_shape": SHAPE,
        "row_start": DIM,
        "rows": DIM,
        "init": INIT,
        "optimizer": OPTIMIZER,
        "sparse": Bool(),
    },
    {"table": TABLE, "wire": Str(16)},
)

#: The chief's placement map (``Placement.to_wire``); the PS keep it so a restarted
#: chief can learn it back from them.
PLACEMENT = Map(
    {
        "variables": List(VARIABLE, 1 << 14),
        "shards": List(
            Tuple((SHARD_ID, NAME, Int(0, MAX_SHARDS), DIM, DIM, Int(0, 1 << 20))), MAX_SHARDS
        ),
        "optimizer": OPTIMIZER,
    },
    # ``--replication R``: the PS of each shard's R - 1 backups, in shard order
    {
        "backups": List(List(Int(0, 1 << 20), MAX_REPLICATION - 1), MAX_SHARDS),
        # after a fail-over: the PS state each shard belongs to (its first primary),
        # where it differs from the PS serving it now
        "slots": List(Int(0, 1 << 20), MAX_SHARDS),
        "epoch": Int(0, INT64_MAX),
    },
)

#: A checkpoint directory's name inside the checkpoint root (never a path).
CKPT_NAME = Str(96)


def __getattr__(name: str) -> Any:
    # The body schema of every request op is derived from the typed ops, which are
    # built on this module: imported lazily to keep the dependency one way.
    if name == "REQUEST_BODIES":
        from zmqps.wire.ops import REQUEST_BODIES

        return REQUEST_BODIES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
