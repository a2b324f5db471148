"""Typed operations: one frozen dataclass per request body and per reply body.

Rules of this module:

* Every field of a body is declared once, here, with the schema that checks it on
  the wire (:func:`wire`); the body's :class:`~zmqps.wire.schema.Map` is derived
  from those declarations. :data:`REQUEST_BODIES` (op -> schema) is what the codec
  checks every incoming request against, so a request body is checked exactly once,
  at the trust boundary, and :meth:`Body.from_wire` then only builds the object.
* A reply body is checked where it is read: :meth:`Body.parse` (schema, then build).
  Reply schemas allow fields they do not know (a newer peer may add some); request
  schemas refuse them (a request is untrusted input).
* Optional fields (declared with a default) that are ``None`` are left out of the
  wire map, so a body without them is byte-for-byte what older peers sent.
* A :class:`Who` field is flattened into its parent map (``role``, ``index``,
  ``incarnation``), the identity every worker request carries.
* Nothing here does IO; converting never copies arrays (bodies hold no arrays:
  tensors travel as buffers beside the body).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from zmqps.wire.errors import ProtocolError
from zmqps.wire.schema import (
    CKPT_NAME,
    COUNT,
    MAX_REPLICATION,
    MAX_SHARDS,
    OPTIMIZER,
    PLACEMENT,
    ROLE,
    SHARD,
    SHARD_ID,
    TALLY,
    TASK_ROLE,
    VARIABLE,
    AnyList,
    AnyMap,
    Bool,
    Dict,
    Float,
    Int,
    List,
    Map,
    Nullable,
    Schema,
    Str,
    Tree,
    Tuple,
)

__all__ = [
    "BULK_OPS",
    "LONG_POLLS",
    "REPLICATED_OPS",
    "REPLIES",
    "REQUESTS",
    "REQUEST_BODIES",
    "SYNC_STEP",
    "Body",
    "Who",
    "wire",
]

#: generations and steps: counts no run comes near (2**62 restores or steps), bounded
#: so that one more (``gen + 1``, ``step + 1``) never overflows a peer's 64-bit field
#: (a restore of generation 2**63 - 1 made the chief fail at its next one)
MAX_COUNT = 2**62
GEN = Int(0, MAX_COUNT)
STEP = Int(0, MAX_COUNT)

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:

    def dataclass_transform(**_: Any) -> Callable[[Any], Any]:
        return lambda fn: fn  # only type checkers read it


B = TypeVar("B", bound="Body")

_PLAIN, _TUPLE, _BODY, _WHO = range(4)

#: Longest long poll a request may ask for (seconds): a waiting request pins a few KiB
#: on the server, which forgets it at the latest this long after its peer is gone.
MAX_WAIT_S = 300.0
#: token waits a PS reports with one ``wait_step`` reply (one per token it handed)
MAX_TOKEN_WAITS = 1 << 14


def wire(schema: Schema, *, default: Any = MISSING, keep_none: bool = False) -> Any:
    """Declare a body field and the schema that checks it on the wire. Without a
    ``default`` it is required; with one it is optional on the wire, and a field that
    is None is left out of the wire map (unless ``keep_none``: always sent)."""
    meta = {"schema": schema, "keep_none": keep_none}
    if default is not MISSING:
        return field(default=default, metadata=meta)
    return field(metadata=meta)


class Body:
    """Base of every typed body. Subclasses are made with :func:`_body`."""

    __slots__ = ()
    OP: ClassVar[str] = ""  # the request op (empty for reply bodies)
    SCHEMA: ClassVar[Map]
    _CODEC: ClassVar[tuple[tuple[str, int, bool, Any], ...]]
    #: how each wire key that is a field converts (kind, nested body); the Who field
    _FIELDS: ClassVar[dict[str, tuple[int, Any]]]
    _WHO_FIELD: ClassVar[str | None]

    def to_wire(self) -> dict[str, Any]:
        """The body as a msgpack-able map (optional fields left out when None)."""
        out: dict[str, Any] = {}
        for name, kind, drop_none, _ in self._CODEC:
            v = getattr(self, name)
            if v is None and drop_none:
                continue
            if kind == _TUPLE:
                v = list(v)
            elif kind == _BODY:
                v = v.to_wire()
            elif kind == _WHO:
                out.update(v.to_wire())
                continue
            out[name] = v
        return out

    @classmethod
    def from_wire(cls: type[B], body: Mapping[str, Any]) -> B:
        """Build from a map already checked against :attr:`SCHEMA` (no checks here)."""
        kwargs: dict[str, Any] = {}
        fields = cls._FIELDS
        for name, v in body.items():  # the keys sent: most fields are optional
            entry = fields.get(name)
            if entry is None or v is None:  # a Who's keys; a newer peer's in a reply
                continue
            kind, sub = entry
            if kind == _TUPLE:
                v = tuple(v)
            elif kind == _BODY:
                v = sub.from_wire(v)
            kwargs[name] = v
        if cls._WHO_FIELD is not None:
            kwargs[cls._WHO_FIELD] = Who(body["role"], body["index"], body["incarnation"])
        return cls(**kwargs)

    @classmethod
    def parse(cls: type[B], body: Mapping[str, Any], what: str = "") -> B:
        """Check ``body`` against :attr:`SCHEMA` (ProtocolError), then build."""
        cls.SCHEMA.check(body, what or f"{cls.__name__} body")
        return cls.from_wire(body)


def _kind(hint: Any) -> tuple[int, Any]:
    """How a field of type ``hint`` converts (plain, tuple, nested body, flattened Who)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    base = args[0] if union and len(args) == 1 else hint
    if base is Who:
        return _WHO, None
    if isinstance(base, type) and issubclass(base, Body):
        return _BODY, base
    if typing.get_origin(base) is tuple:
        return _TUPLE, None
    return _PLAIN, None


def _kind_of(annotation: Any) -> tuple[int, Any]:
    """:func:`_kind` of a field as written in this module (a string: the module
    postpones its annotations), read without evaluating it: ``typing.get_type_hints``
    evaluated every field of every body, a good part of this module's import, which
    every process makes at its start. A body field is ``X`` or ``X | None`` with ``X``
    ``Who``, a body class, a ``tuple[...]`` or a plain type (``tests/unit/test_ops.py``
    checks that this reads each field as ``get_type_hints`` does)."""
    if not isinstance(annotation, str):
        return _kind(annotation)
    base = annotation.removesuffix(" | None")
    if base == "Who":
        return _WHO, None
    if base.startswith("tuple["):
        return _TUPLE, None
    sub = globals().get(base)
    if isinstance(sub, type) and issubclass(sub, Body):
        return _BODY, sub
    return _PLAIN, None


@dataclass_transform(frozen_default=True, field_specifiers=(field, wire))
def _body(op: str = "", *, reply: bool = False) -> Callable[[type[B]], type[B]]:
    """Make ``cls`` a frozen dataclass body; derive its schema and converters."""

    def make(cls: type[B]) -> type[B]:
        cls = dataclass(frozen=True, slots=True)(cls)
        codec: list[tuple[str, int, bool, Any]] = []
        required: dict[str, Schema] = {}
        optional: dict[str, Schema] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            kind, sub = _kind_of(f.type)
            if kind == _WHO:
                required.update(WHO_FIELDS)
                codec.append((f.name, kind, False, None))
                continue
            schema = f.metadata["schema"]
            (required if f.default is MISSING else optional)[f.name] = schema
            codec.append((f.name, kind, not f.metadata["keep_none"], sub))
        cls.OP = op
        cls.SCHEMA = Map(required, optional, extra=reply)
        cls._CODEC = tuple(codec)
        cls._FIELDS = {name: (kind, sub) for name, kind, _, sub in codec if kind != _WHO}
        cls._WHO_FIELD = next((name for name, kind, _, _ in codec if kind == _WHO), None)
        return cls

    return make


# ---------------------------------------------------------------------------
# Identity and shared pieces.

WHO_FIELDS: Mapping[str, Schema] = {
    "role": TASK_ROLE,
    "index": Int(0, 1 << 20),
    "incarnation": Int(0),
}


@dataclass(frozen=True, slots=True)
class Who:
    """A worker-side process: its role (worker, evaluator), index and incarnation."""

    role: str
    index: int
    incarnation: int

    @property
    def name(self) -> str:
        """``role:index``, the name the PS key dedup state and sync contributions by."""
        return f"{self.role}:{self.index}"

    def to_wire(self) -> dict[str, Any]:
        return {"role": self.role, "index": self.index, "incarnation": self.incarnation}


WAIT = Float(0.0, MAX_WAIT_S)
CURSORS = Dict(COUNT, Str(64), 1 << 20)
#: the job flags a worker runs with, each as its text (``roles/agreement.py``): the
#: chief refuses a worker of another cluster layout or model, and says which of the
#: others differ (a PS list of 1,000 hosts fits)
JOB_FLAGS = Dict(Str(1 << 16), Str(64), 64)
SHARDS = List(SHARD_ID, MAX_SHARDS)
VERSIONS = List(Int(0), MAX_SHARDS)
#: packs (:mod:`zmqps.core.packs`): the number of shards in each of the message's
#: leading packs, in order; each pack's values or gradient travel as one tensor (or one
#: span of a shared-memory region) named by its first shard
PACKS = List(Int(2, MAX_SHARDS), MAX_SHARDS)


@_body()
class ShmRef(Body):
    """Where a shard's bytes are in a shared-memory region (same-host fast path)."""

    region: int = wire(Int(0, 2**31 - 1))
    offsets: tuple[int, ...] = wire(List(Int(0, 2**48), MAX_SHARDS))


# ---------------------------------------------------------------------------
# Requests: membership and the chief.


@_body("ping")
class Ping(Body):
    pass


@_body("register")
class Register(Body):
    who: Who
    steps_planned: int | None = wire(TALLY, default=None)
    address: str | None = wire(Str(256), default=None)
    #: an incarnation already running registers again (the chief restarted): the
    #: batches its earlier incarnations did, as it was told when it started
    steps_done: int | None = wire(TALLY, default=None)
    #: the placement epoch this task last heard of: a restarted chief whose placement
    #: is not past it publishes it again past it (the task would keep its old routes)
    epoch: int | None = wire(COUNT, default=None)
    #: the job flags this worker runs with (flag -> text): the chief compares them with
    #: its own. An older chief refuses the field: the worker registers again without it
    job: Mapping[str, str] | None = wire(JOB_FLAGS, default=None)


@_body("heartbeat")
class Heartbeat(Body):
    who: Who
    step: int = wire(TALLY)
    #: finite (a worker leaves a non-finite loss out): ``zmqps status --json`` prints
    #: the mean loss, and JSON has no infinity
    loss: float | None = wire(Float(-sys.float_info.max, sys.float_info.max), default=None)
    examples: int | None = wire(TALLY, default=None)
    #: steps of this incarnation whose gradients the PS refused (not finite), skipped
    nonfinite: int | None = wire(TALLY, default=None)
    #: a worker that left with its work done and waits for the run's end: the chief
    #: may hold the reply this many seconds, answering as soon as the run finishes,
    #: stops or is restored (one held heartbeat per worker)
    wait: float | None = wire(WAIT, default=None)
    #: the examples of the batches this incarnation resumed after, as its data says
    #: them (exact); None: the chief counts them from what it heard before
    examples_before: int | None = wire(TALLY, default=None)


@_body("leave")
class Leave(Body):
    who: Who
    step: int = wire(TALLY)
    reason: str | None = wire(Str(256), default=None)
    examples: int | None = wire(TALLY, default=None)
    #: the task stays, heartbeating, until the run's end (a restore that takes its
    #: last batches back sends it back to work)
    waits: bool = wire(Bool(), default=False)
    #: steps of this incarnation whose gradients the PS refused (not finite), skipped
    nonfinite: int | None = wire(TALLY, default=None)
    #: the cluster generation the task's work is of: a ``done`` of an older one than
    #: the chief's is refused (a restore meanwhile may have taken its batches back)
    gen: int | None = wire(GEN, default=None)
    #: as :attr:`Heartbeat.examples_before`
    examples_before: int | None = wire(TALLY, default=None)


@_body("create_vars")
class CreateVars(Body):
    variables: tuple[Mapping[str, Any], ...] = wire(List(VARIABLE, 1 << 14))
    optimizer: Mapping[str, Any] | None = wire(OPTIMIZER, default=None)


@_body("get_placement")
class GetPlacement(Body):
    wait: float | None = wire(WAIT, default=None)


@_body("take_token")
class TakeToken(Body):
    who: Who
    wait: float | None = wire(WAIT, default=None)
    #: the step of the last token this worker computed (a resent request is then
    #: answered with the same token, never a second one of that step)
    have: int | None = wire(Int(-1), default=None)
    #: the generation ``have`` was computed in: a poll the chief holds across a restore
    #: then counts as saying nothing computed (the steps went back with the restore)
    have_gen: int | None = wire(GEN, default=None)


@_body("ssp_clock")
class SspClock(Body):
    who: Who
    #: steps this worker completed: a count it reports of itself, as a heartbeat's
    #: (the chief counts it as the worker's steps: 2**63 - 1 made its global step 2**62)
    completed: int = wire(TALLY)
    wait: float | None = wire(WAIT, default=None)


@_body("checkpoint")
class TakeCheckpoint(Body):
    wait: float | None = wire(WAIT, default=None)


@_body("status")
class Status(Body):
    #: a PS: only its sync state, with the contributors of its step listed among
    #: these workers (the chief's look-ups, whose size must not grow with the
    #: cluster); None: the whole status
    sync_of: tuple[str, ...] | None = wire(List(Str(64), 1 << 16), default=None)


@_body("shutdown")
class Shutdown(Body):
    reason: str | None = wire(Str(256), default=None)


@_body("scale")
class Scale(Body):
    """Serve the PS states from the first ``ps`` processes of the cluster spec (the
    chief moves them while training goes on; None: only say where they are)."""

    ps: int | None = wire(Int(1, 1 << 20), default=None)


# ---------------------------------------------------------------------------
# Requests: data (workers -> PS).


@_body("create_shards")
class CreateShards(Body):
    shards: tuple[Mapping[str, Any], ...] = wire(List(SHARD, MAX_SHARDS))
    placement: Mapping[str, Any] | None = wire(PLACEMENT, default=None)


@_body("pull")
class Pull(Body):
    shards: tuple[int, ...] = wire(SHARDS)
    shm_out: ShmRef | None = wire(ShmRef.SCHEMA, default=None)
    gen: int | None = wire(GEN, default=None)
    #: the values as the PS keeps them, not rounded to their variable's wire dtype (the
    #: chief's final evaluation and export, an evaluator)
    exact: bool | None = wire(Bool(), default=None)
    packs: tuple[int, ...] | None = wire(PACKS, default=None)


@_body("push")
class Push(Body):
    """A gradient push. ``push_pull`` and ``push_rows`` share this body."""

    shards: tuple[int, ...] = wire(SHARDS)
    versions: tuple[int, ...] = wire(VERSIONS)
    worker: str = wire(Str(64))
    inc: int = wire(Int(0))
    seq: int = wire(Int(0))
    step: int | None = wire(Int(0), default=None)
    shm: ShmRef | None = wire(ShmRef.SCHEMA, default=None)
    shm_out: ShmRef | None = wire(ShmRef.SCHEMA, default=None)
    gen: int | None = wire(GEN, default=None)
    #: how many batches this worker (all its incarnations) has pushed, this one
    #: included: the PS keep the highest per worker, so a restarted worker resumes
    #: after the batches that really reached them
    cursor: int | None = wire(Int(0), default=None)
    #: coordinator mode: the scheduled function this push belongs to, and its place
    #: among that function's pushes to this PS: a function run again on another worker
    #: (its first worker was lost) has each of its pushes applied once
    closure: int | None = wire(Int(0), default=None)
    closure_seq: int | None = wire(Int(1), default=None)
    packs: tuple[int, ...] | None = wire(PACKS, default=None)
    #: sync (``push`` to the PS the worker's last token named): answer with the
    #: worker's next token, the step after ``step``, once it is released there (or
    #: without one after a short wait: the worker then asks as before)
    token: bool | None = wire(Bool(), default=None)
    #: sync ``push_pull``: answer with the values of after the push's step (held until
    #: this PS applied it, at most a short wait; else answered ``unvalued``): the
    #: worker's next pull, saved
    fresh: bool | None = wire(Bool(), default=None)


@_body("push_pull")
class PushPull(Push):
    pass


#: a row request's index tensors joined into one (``counts``: the ids of each shard it
#: names, in order); sent only to a PS that takes ``rows_joined``
ROW_COUNTS = List(Int(0, 2**31), 2 * MAX_SHARDS)


@_body("push_rows")
class PushRows(Push):
    #: its shards' index tensors joined into its first tensor, this many ids each
    #: (the rows tensors, when in the message, follow in order); None: one index
    #: tensor per shard
    counts: tuple[int, ...] | None = wire(ROW_COUNTS, default=None)


@_body("push_pull_rows")
class PushPullRows(Push):
    """A ``push_rows`` and a ``pull_rows`` to one PS in one message: the PS applies the
    push as a ``push_rows`` of the same body would, then reads the rows as a
    ``pull_rows`` of ``pull`` would (it reads the push's update). Tensors: ``(index,
    rows)`` of every pushed shard in ``shards``' order, then the ``index`` of every shard
    in ``pull``. The reply is the push's, with ``pulled`` (the versions of the rows
    read) and one ``rows`` tensor per shard of ``pull``. Sent only to a PS that says it
    takes it (``takes`` of a row reply)."""

    pull: tuple[int, ...] = wire(SHARDS, default=())
    #: False: the pull is read-only (as ``PullRows.create``)
    create: bool | None = wire(Bool(), default=None)
    #: the index tensors of ``shards`` then of ``pull`` joined into the first tensor,
    #: this many ids each (as ``PushRows.counts``)
    counts: tuple[int, ...] | None = wire(ROW_COUNTS, default=None)


@_body("pull_rows")
class PullRows(Body):
    shards: tuple[int, ...] = wire(SHARDS)
    gen: int | None = wire(GEN, default=None)
    #: False: a read-only pull (hash tables create, stamp and admit nothing)
    create: bool | None = wire(Bool(), default=None)
    #: same host: the rows go into this region (one offset per shard, each shard's
    #: rows back to back there), not in the reply; sent only to a PS that takes
    #: ``shm_rows``
    shm_out: ShmRef | None = wire(ShmRef.SCHEMA, default=None)
    #: the index tensors joined into one, this many ids each (as ``PushRows.counts``)
    counts: tuple[int, ...] | None = wire(ROW_COUNTS, default=None)


@_body("table_rows")
class TableRows(Body):
    """The live rows of a hash-table shard, a page at a time in id order."""

    shard: int = wire(SHARD_ID)
    start: int = wire(Int(0, 2**48))
    limit: int = wire(Int(1, 1 << 24))
    gen: int | None = wire(GEN, default=None)


@_body("shm_attach")
class ShmAttach(Body):
    name: str = wire(Str(64))
    size: int = wire(Int(0, 2**48))
    worker: str = wire(Str(64))
    inc: int = wire(Int(0))


@_body("seal_hello")
class SealHello(Body):
    """Agree a sealed-frames session (CURVE only; answered by the transport itself):
    the client's 32 random bytes, hex."""

    random: str = wire(Str(64))
    #: the key id (hex) of the session this one replaces: the server forgets it (if
    #: the same allow-list name agreed it), and with it its data-connection credential
    retire: str | None = wire(Str(16), default=None)


@_body("shm_detach")
class ShmDetach(Body):
    region: int = wire(Int(0, 2**31 - 1))
    #: the region's name: detached only if the id is still that region's (a restarted
    #: PS numbers its regions afresh; an old id may be another region now)
    name: str | None = wire(Str(64), default=None)


# ---------------------------------------------------------------------------
# Requests: sync coordination, checkpoints and recovery (chief -> PS).


@_body("sync_config")
class SyncConfigure(Body):
    mode: str = wire(Str(8))
    required: int = wire(Int(1, 1 << 20))


@_body("wait_step")
class WaitStep(Body):
    step: int = wire(Int(0))
    wait: float | None = wire(WAIT, default=None)
    #: sync: the step whose tokens the chief has released (every PS applied it, its
    #: checkpoint is taken), of generation ``gen``: this PS hands them to the workers
    #: that ask it (``take_token``); None: it hands none
    released: int | None = wire(Int(0), default=None)
    gen: int | None = wire(GEN, default=None)
    #: sync: this PS may release ``step``'s tokens (generation ``gen``) by itself the
    #: moment it applied the step, before the chief hears of it (the chief says so for
    #: a boundary it needs nothing at, and only to the one PS holding shards)
    release_step: bool | None = wire(Bool(), default=None)
    #: sync: this PS may release every step up to ``release_until`` (generation
    #: ``gen``) by itself, each the moment it applied it (the chief says so up to the
    #: step before the next boundary it must see, and only to the one PS holding
    #: shards; ``step`` is then that boundary). A stepping poll without it takes back
    #: what an earlier one allowed
    release_until: int | None = wire(Int(0), default=None)


@_body("ps_state")
class PsState(Body):
    pass


@_body("fence")
class Fence(Body):
    worker: str = wire(Str(64))
    inc: int = wire(Int(0))
    #: the incarnation left with its work done, after ``steps`` batches in all (every
    #: PS keeps it: a restarted chief learns which workers finished)
    left: bool | None = wire(Bool(), default=None)
    steps: int | None = wire(TALLY, default=None)


@_body("checkpoint_save")
class CheckpointSave(Body):
    name: str = wire(CKPT_NAME)
    id: int = wire(Int(0))


@_body("checkpoint_done")
class CheckpointDone(Body):
    id: int = wire(Int(0))
    wait: float | None = wire(WAIT, default=None)


@_body("restore")
class Restore(Body):
    gen: int = wire(GEN)
    step: int = wire(STEP)
    shards: tuple[Mapping[str, Any], ...] = wire(List(SHARD, MAX_SHARDS))
    name: str | None = wire(CKPT_NAME, default=None)
    placement: Mapping[str, Any] | None = wire(PLACEMENT, default=None)
    #: per worker, the highest batch cursor any PS applied (a restarted PS learns it);
    #: with ``rewind``, the cursors the checkpoint restored holds (set exactly: the
    #: workers train their batches after them again)
    cursors: Mapping[str, int] | None = wire(CURSORS, default=None)
    rewind: bool = wire(Bool(), default=False)


# ---------------------------------------------------------------------------
# Requests: replication (chief -> PS, primary -> backup).


@_body("replica")
class ReplicaSet(Body):
    """The chief tells a PS process its part in PS state ``slot``'s copies at
    ``term``: the primary (``backups``: the PS it ships to, with their addresses) or a
    backup (``backups`` empty). A process told it backs up a state it does not hold
    makes an empty copy of it only when ``make`` (a new copy: its shards come by
    ``create_shards`` for that slot, or a whole copy by ``install``); else it refuses
    (``not_found``): a fail-over fences the surviving copies, and a process restarted
    meanwhile holds none, whatever an empty one would answer."""

    slot: int = wire(Int(0, 1 << 20))
    term: int = wire(Int(0))
    primary: bool = wire(Bool())
    backups: tuple[tuple[int, str], ...] = wire(
        List(Tuple((Int(0, 1 << 20), Str(256))), MAX_REPLICATION), default=()
    )
    #: a promotion: the entry each of ``backups`` applied up to (in their order)
    applied: tuple[int, ...] | None = wire(List(Int(0), MAX_REPLICATION), default=None)
    #: a backup: make an empty copy if the process holds none
    make: bool = wire(Bool(), default=False)
    #: the placement epoch the chief is at (the process remembers the highest: a
    #: restarted chief starts past it)
    epoch: int | None = wire(COUNT, default=None)
    #: the state moved away: the process drops its copy (its own state: emptied, a
    #: backup that refuses every request for it)
    drop: bool = wire(Bool(), default=False)


#: ops whose requests change a PS state (``pull_rows`` creates hash-table rows): a
#: primary ships each to its backups as a ``replicate`` entry
REPLICATED_OPS = frozenset({"push", "push_pull", "push_rows", "pull_rows", "sync_config", "fence"})


@_body("replicate")
class Replicate(Body):
    """Entry ``index`` of PS state ``slot``'s replication log (the message's slot),
    from its primary of ``term``: the request it applied (``op``, ``body``; its tensors
    travel beside), to be applied the same way on the backup. The inner body is
    checked against its op's schema with the outer one (:class:`_EntrySchema`)."""

    term: int = wire(Int(0))
    index: int = wire(Int(1))
    op: str = wire(Str(32))
    body: Mapping[str, Any] = wire(AnyMap())
    #: every in-sync backup applied the entries up to this one (as the primary knows):
    #: the backup keeps only the entries after it, those another backup may lack
    #: should this one be promoted
    committed: int | None = wire(COUNT, default=None)
    #: the tensors are in the ring the primary shares with this backup (region
    #: ``ring_name``), not beside: ``[dtype, shape, kind, ref, offset, at]`` each, ``at``
    #: the byte offset of its data in the ring (the codec's spec of a buffer, and where)
    ring_name: str | None = wire(Str(64), default=None)
    #: the primary found the entry's values finite and below their dtype's limit: the
    #: backup applies it without looking again (as the primary does)
    checked: bool | None = wire(Bool(), default=None)
    ring: tuple[Any, ...] | None = wire(
        List(Tuple((Str(16), List(Int(0), 8), Str(16), Int(-1), Int(0), Int(0, 2**48))), 1 << 17),
        default=None,
    )


@_body("replica_ring")
class ReplicaRing(Body):
    """The primary of PS state ``slot`` (the message's slot), at ``term``, shares a
    ring of ``size`` bytes of shared memory (region ``name``) with this backup: the
    tensors of its entries may travel in it (:class:`Replicate`'s ``ring``). Answered
    with the token the region starts with (the two see the same memory); any refusal
    (another host, another user) means entries keep their tensors beside."""

    term: int = wire(Int(0))
    name: str = wire(Str(64))
    size: int = wire(Int(0, 2**48))


@dataclass(frozen=True)
class _EntrySchema(Map):
    """A ``replicate`` body: its own fields, then the request it carries."""

    def check(self, value: Any, path: str) -> None:
        super().check(value, path)
        op = value["op"]
        if op == SYNC_STEP:
            _check_sync_step(value["body"], f"{path}.body")
            return
        if op not in REPLICATED_OPS:
            raise ProtocolError(f"{path}.op: {op!r} is not an op that changes a PS state")
        REQUEST_BODIES[op].check(value["body"], f"{path}.body")


Replicate.SCHEMA = _EntrySchema(Replicate.SCHEMA.required, Replicate.SCHEMA.optional)

#: the entry op of a sync state's pushes shipped after aggregation (:class:`SyncStep`):
#: an entry only, never a request of its own
SYNC_STEP = "sync_step"
#: pushes one ``sync_step`` entry may carry (a step's, and the ones dropped meanwhile)
MAX_STEP_PUSHES = 1 << 14
#: what a ``sync_step`` tensor is: a shard's gradient sum, or one of its accumulated
#: row gradients (``ids`` and ``rows``, by item)
STEP_DATA = frozenset({"sum", "ids", "rows"})


@_body()
class SyncStep(Body):
    """The pushes a replicated sync state applied since its last entry, shipped once
    and without their gradients (``pushes``: op, body without shared-memory places,
    refused for its values), and the accumulated gradients they left (``data``: one
    ``[shard, what, item]`` per tensor, in order; see :data:`STEP_DATA`): a backup
    replays the pushes' bookkeeping on those sums, which is the primary's state."""

    pushes: tuple[Any, ...] = wire(List(Tuple((Str(32), AnyMap(), Bool())), MAX_STEP_PUSHES))
    data: tuple[Any, ...] = wire(List(Tuple((SHARD_ID, Str(8), Int(0))), 1 << 20))


def _check_sync_step(body: Any, path: str) -> None:
    SyncStep.SCHEMA.check(body, path)
    for i, (op, push, _) in enumerate(body["pushes"]):
        if op not in ("push", "push_rows"):
            raise ProtocolError(f"{path}.pushes[{i}]: {op!r} is not a push")
        REQUEST_BODIES[op].check(push, f"{path}.pushes[{i}].body")
    for i, (_, what, _) in enumerate(body["data"]):
        if what not in STEP_DATA:
            raise ProtocolError(f"{path}.data[{i}]: unknown {what!r}")


@_body("placement")
class PlacementNote(Body):
    """The chief tells every PS process the placement at a new epoch before a primary
    stops waiting for a backup it dropped (silent or restarted): each process keeps
    the newest it heard and reports it in ``ps_state``. A restarted chief promotes,
    for a state whose primary is gone, only a copy the newest placement any process
    reports still names: the dropped backup missed what was acknowledged without it,
    and only the dead primary and the last chief knew."""

    placement: Mapping[str, Any] = wire(PLACEMENT)


@_body("join")
class Join(Body):
    """The chief asks PS state ``slot``'s primary (of ``term``) to bring PS ``ps`` (at
    ``endpoint``) in as one more backup: a whole copy of the state as of now (sent as
    ``install`` parts at most ``rate`` bytes a second), then every entry after it;
    it counts for commits once it caught up. Answered at once; the primary's status
    says how the copy goes (``joins``)."""

    slot: int = wire(Int(0, 1 << 20))
    term: int = wire(Int(0))
    ps: int = wire(Int(0, 1 << 20))
    endpoint: str = wire(Str(256))
    rate: float | None = wire(Float(1.0), default=None)


@_body("install")
class Install(Body):
    """Part ``part`` of a whole copy of PS state ``slot`` (the message's slot) as of
    entry ``index`` of its primary's log at ``term``: tensors, each described by an
    item ``[shard, what, offset, dtype, shape]``; the first part also carries the
    shard definitions and versions (``defs``, ``meta``), the ``last`` one the
    ledgers (``state``). The copy changes only once the last part came."""

    term: int = wire(Int(0))
    index: int = wire(Int(0))
    part: int = wire(Int(0, 1 << 24))
    last: bool = wire(Bool())
    items: tuple[Any, ...] = wire(
        List(Tuple((SHARD_ID, Str(64), Int(0), Str(16), List(Int(0), 8))), 1 << 17),
        default=(),
    )
    defs: tuple[Mapping[str, Any], ...] | None = wire(List(SHARD, MAX_SHARDS), default=None)
    meta: Mapping[str, Any] | None = wire(AnyMap(), default=None)
    state: Mapping[str, Any] | None = wire(AnyMap(), default=None)


# ---------------------------------------------------------------------------
# Requests: coordinator mode (a function of the worker's job module, by name).


@_body("run")
class Run(Body):
    fn: str = wire(Str(128))
    args: Any = wire(Tree(root="t"))
    kwargs: Any = wire(Tree(root="d"))
    steps: int = wire(Int(1, 1 << 20))
    closure: int | None = wire(Int(0), default=None)
    inc: int | None = wire(Int(0), default=None)


@_body("make_resource")
class MakeResource(Body):
    id: int = wire(Int(0, 2**31 - 1))
    fn: str = wire(Str(128))
    args: Any = wire(Tree(root="t"))
    kwargs: Any = wire(Tree(root="d"))
    inc: int | None = wire(Int(0), default=None)


# ---------------------------------------------------------------------------
# Replies.

ANY = AnyMap()


@_body(reply=True)
class Empty(Body):
    """A reply that carries nothing but success."""


@_body(reply=True)
class SealAgreed(Body):
    """The server's 32 random bytes and the session's 8-byte key id (hex), and the
    port of its data connection."""

    random: str = wire(Str(64))
    key: str = wire(Str(16))
    port: int = wire(Int(1, 65535))


@_body(reply=True)
class Pong(Body):
    role: str = wire(ROLE)
    index: int = wire(Int(0))


@_body(reply=True)
class ClusterInfo(Body):
    """What a registering task learns: the PS, the placement (None before the
    variables exist), the mode, the generation, and for a worker's new incarnation
    the batches its earlier incarnations did."""

    ps: tuple[str, ...] = wire(List(Str(256), MAX_SHARDS))
    mode: str = wire(Str(8))
    heartbeat_interval: float = wire(Float(0.0))
    gen: int = wire(GEN, default=0)
    global_step: int = wire(STEP, default=0)
    placement: Mapping[str, Any] | None = wire(Nullable(PLACEMENT), default=None, keep_none=True)
    recovering: bool = wire(Bool(), default=False)
    steps_done: int = wire(COUNT, default=0)
    #: sync: the step of the last token the worker's earlier incarnations computed
    last_step: int = wire(Int(-1), default=-1)
    finished: bool = wire(Bool(), default=False)
    #: the run ended before this chief started (its final checkpoint's name; the
    #: global step is that checkpoint's): nothing is left to train or to evaluate
    ended: str | None = wire(Str(256), default=None)


@_body(reply=True)
class HeartbeatReply(Body):
    global_step: int = wire(STEP)
    gen: int = wire(GEN)
    recovering: bool = wire(Bool(), default=False)
    finished: bool = wire(Bool(), default=False)
    stop: bool = wire(Bool(), default=False)
    ps_down: tuple[int, ...] = wire(List(Int(0), MAX_SHARDS), default=())
    #: the last restore (generation ``gen``) went back to a checkpoint holding this
    #: worker's batches up to this cursor: it trains the ones after it again
    rewind: int | None = wire(COUNT, default=None)
    #: the placement's epoch (replication: one more at every fail-over); a worker that
    #: knows an older one asks for the placement again
    epoch: int | None = wire(COUNT, default=None)


@_body(reply=True)
class StepReply(Body):
    """The global step (leave) or a PS's sync step (sync_config, wait_step)."""

    step: int | None = wire(STEP, default=None)
    global_step: int | None = wire(STEP, default=None)
    #: wait_step: the tokens this PS handed of its released step (``granted_of``), and
    #: how long each of the token polls answered since its last reply waited (at most
    #: :data:`MAX_TOKEN_WAITS`; the rest are counted in ``granted`` only)
    granted_of: int | None = wire(STEP, default=None)
    granted: int | None = wire(COUNT, default=None)
    token_waits: tuple[float, ...] | None = wire(List(WAIT, MAX_TOKEN_WAITS), default=None)
    #: wait_step (the chief's stepping poll): this PS takes ``WaitStep.release_step``
    #: (an older one refuses a field it does not know: the chief sends it only then)
    releases: bool | None = wire(Bool(), default=None)
    #: wait_step (the chief's stepping poll): this PS takes ``WaitStep.release_until``,
    #: and ``released`` is the step whose tokens it hands now (None: none of the poll's
    #: generation), whether the chief or the PS itself released it
    releases_until: bool | None = wire(Bool(), default=None)
    released: int | None = wire(STEP, default=None)


@_body(reply=True)
class Token(Body):
    step: int = wire(STEP)
    gen: int = wire(GEN)
    #: the PS (its index) to ask for the next token: it hands the tokens the chief
    #: releases, so the chief hears no request per worker and step; None: ask the chief
    ps: int | None = wire(Int(0, MAX_SHARDS), default=None)
    #: the PS that handed it answers a push that asks for the next token
    #: (``Push.token``; an older one refuses the field: a worker sends it only then)
    by_push: bool | None = wire(Bool(), default=None)


@_body(reply=True)
class SspGrant(Body):
    slowest: int = wire(Int(0))


@_body(reply=True)
class PlacementReply(Body):
    placement: Mapping[str, Any] = wire(PLACEMENT)


@_body(reply=True)
class ShardsCreated(Body):
    shards: tuple[int, ...] = wire(SHARDS)


@_body(reply=True)
class Values(Body):
    """A pull (pull, pull_rows) reply: the version of each shard asked for, in
    order; the values travel as tensors (or in the shared-memory region)."""

    versions: tuple[int, ...] = wire(VERSIONS)
    #: the request's packs travel packed in the reply (else shard by shard)
    packed: bool | None = wire(Bool(), default=None)
    #: pull_rows: the ops this PS takes beyond those every PS takes (``push_pull_rows``:
    #: a client sends it only to a PS that said so; an older one refuses the op)
    takes: tuple[str, ...] | None = wire(List(Str(32), 16), default=None)


@_body(reply=True)
class PushReply(Body):
    """A push's outcome. ``applied`` False: a duplicate (``duplicate``) or dropped
    (``dropped``: its reason, e.g. ``stale``). ``versions``: the shards' versions
    after it (push_pull: of the values that come back)."""

    applied: bool = wire(Bool())
    staleness: tuple[int, ...] = wire(List(Int(), MAX_SHARDS), default=())
    versions: tuple[int, ...] = wire(VERSIONS, default=())
    duplicate: bool | None = wire(Bool(), default=None)
    dropped: str | None = wire(Str(32), default=None)
    #: push_pull: the request's packs travel packed in the reply (else shard by shard)
    packed: bool | None = wire(Bool(), default=None)
    #: push_pull_rows: the versions of the rows pulled (the request's ``pull``, in order)
    pulled: tuple[int, ...] | None = wire(VERSIONS, default=None)
    #: push_rows: the ops this PS takes beyond those every PS takes (``push_pull_rows``)
    takes: tuple[str, ...] | None = wire(List(Str(32), 16), default=None)
    #: a push that asked for it (``Push.token``): the next token (its step and
    #: generation, the PS that handed it), if released within the PS's short wait
    token_step: int | None = wire(STEP, default=None)
    token_gen: int | None = wire(GEN, default=None)
    token_ps: int | None = wire(Int(0, MAX_SHARDS), default=None)
    #: a push that asked for fresh values (``Push.fresh``): the PS's sync step when
    #: it read the values the reply brings; ``unvalued``: the reply brings none (the
    #: step was not applied within the PS's wait, or it holds no such replies)
    values_step: int | None = wire(STEP, default=None)
    unvalued: bool | None = wire(Bool(), default=None)

    @property
    def outcome(self) -> str:
        """``applied``, ``duplicate`` or the reason it was dropped."""
        if self.applied:
            return "applied"
        return self.dropped or ("duplicate" if self.duplicate else "dropped")


@_body(reply=True)
class TablePage(Body):
    version: int = wire(Int(0))
    rows: int = wire(Int(0))


@_body(reply=True)
class ShmAttached(Body):
    region: int = wire(Int(0, 2**31 - 1))
    token: str = wire(Str(128))


@_body(reply=True)
class RingAttached(Body):
    """The token the shared ring starts with, as the backup read it (hex)."""

    token: str = wire(Str(128))


@_body(reply=True)
class PsStateReply(Body):
    """What a (restarted) chief needs to adopt a PS's state or to restore it."""

    index: int = wire(Int(0))
    boot: str = wire(Str(64))
    gen: int = wire(GEN)
    shards: Sequence[Any] = wire(AnyList())  # [[shard id, version], ...]
    mode: str = wire(Str(8), default="")
    step: int = wire(STEP, default=0)
    contributors: tuple[str, ...] = wire(List(Str(64), 1 << 20), default=())
    placement: Mapping[str, Any] | None = wire(PLACEMENT, default=None)
    #: per worker, the highest batch cursor this PS applied
    cursors: Mapping[str, int] | None = wire(CURSORS, default=None)
    #: workers that left with their work done: their batches in all
    done: Mapping[str, int] | None = wire(CURSORS, default=None)
    #: the cursors of the last restore that went back to a checkpoint's (generation
    #: ``gen``), what a chief started since tells the workers
    rewinds: Mapping[str, int] | None = wire(CURSORS, default=None)
    #: per worker, the highest batch cursor this PS ever applied (``cursors`` go back
    #: with a restore to a checkpoint's; these do not)
    highs: Mapping[str, int] | None = wire(CURSORS, default=None)
    #: replication: this process's part in each PS state it holds a copy of, as
    #: ``[state, "primary" | "backup", term, entry applied, fenced, in-sync backups]``
    roles: tuple[tuple[Any, ...], ...] | None = wire(
        List(
            Tuple(
                (
                    Int(0, 1 << 20),
                    Str(8),
                    Int(0),
                    Int(0),
                    Bool(),
                    List(Int(0, 1 << 20), MAX_REPLICATION),
                )
            ),
            MAX_SHARDS,
        ),
        default=None,
    )
    #: replication: the highest placement epoch this process was told
    epoch: int | None = wire(COUNT, default=None)
    #: replication: the newest placement the chief published to it (``placement``)
    newest: Mapping[str, Any] | None = wire(PLACEMENT, default=None)
    #: whether this PS can write checkpoints (it was given ``--checkpoint-dir``); None:
    #: an older PS, not said
    checkpoints: bool | None = wire(Bool(), default=None)


@_body(reply=True)
class Fenced(Body):
    """A fence's reply, read in the same turn as the fence: the highest batch cursor
    of the worker's pushes this PS applied (0: none), the sync step of that push
    (-1: none), and whether the PS holds shards (one without never hears pushes)."""

    cursor: int = wire(COUNT, default=0)
    step: int = wire(Int(-1), default=-1)
    holds: bool = wire(Bool(), default=True)


@_body(reply=True)
class CheckpointTaken(Body):
    name: str = wire(CKPT_NAME)
    step: int = wire(STEP)


@_body(reply=True)
class Saved(Body):
    versions: Sequence[Any] = wire(AnyList())  # [[shard id, version], ...]
    step: int = wire(STEP)
    snapshot_s: float = wire(Float(0.0))
    #: per worker, the highest batch cursor whose gradient the snapshot holds
    cursors: Mapping[str, int] | None = wire(CURSORS, default=None)


@_body(reply=True)
class Written(Body):
    shards: Sequence[Any] = wire(AnyList())  # shard records (checkpoint.ShardRecord)


@_body(reply=True)
class Restored(Body):
    gen: int = wire(GEN)
    versions: Sequence[Any] = wire(AnyList())


@_body(reply=True)
class Ran(Body):
    result: Any = wire(Tree())
    steps: int = wire(Int(0))
    exec_s: float = wire(Float(0.0))


@_body(reply=True)
class Replicated(Body):
    """A backup applied every entry up to ``applied``; ``gap``: an entry before the one
    sent is missing (send again from ``applied + 1``)."""

    applied: int = wire(Int(0))
    gap: bool | None = wire(Bool(), default=None)


@_body(reply=True)
class ReplicaState(Body):
    """A process's part in one PS state's copies: its term, the last entry it applied
    (a primary: appended), and the boot id its copy answers probes with (the chief
    expects it from a copy it promoted; "" from a copy dropped, or an older PS)."""

    slot: int = wire(Int(0))
    term: int = wire(Int(0))
    primary: bool = wire(Bool())
    applied: int = wire(Int(0))
    boot: str = wire(Str(64), default="")


@_body(reply=True)
class Joining(Body):
    """A join started: the copy is as of entry ``at``."""

    at: int = wire(Int(0))


@_body(reply=True)
class ResourceMade(Body):
    id: int = wire(Int(0, 2**31 - 1))


@_body(reply=True)
class Free(Body):
    """A free-form reply (``status``): a JSON-able map for people and tools."""

    fields: Mapping[str, Any] = wire(ANY)

    def to_wire(self) -> dict[str, Any]:
        return dict(self.fields)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Free:
        return cls(dict(body))

    @classmethod
    def parse(cls, body: Mapping[str, Any], what: str = "") -> Free:
        ANY.check(body, what or "status body")
        return cls(dict(body))


#: Every request body type, by op.
REQUESTS: Mapping[str, type[Body]] = {
    cls.OP: cls
    for cls in (
        Ping,
        Register,
        Heartbeat,
        Leave,
        CreateVars,
        GetPlacement,
        TakeToken,
        SspClock,
        TakeCheckpoint,
        Status,
        Shutdown,
        CreateShards,
        Pull,
        Push,
        PushPull,
        PushRows,
        PushPullRows,
        PullRows,
        TableRows,
        ShmAttach,
        ShmDetach,
        SealHello,
        SyncConfigure,
        WaitStep,
        PsState,
        Fence,
        CheckpointSave,
        CheckpointDone,
        Restore,
        ReplicaSet,
        PlacementNote,
        Replicate,
        ReplicaRing,
        Join,
        Install,
        Scale,
        Run,
        MakeResource,
    )
}

#: Ops that only wait (for a step, a token, a placement, a written checkpoint) and
#: change nothing a second copy would not: a server drops such a pending request when
#: its peer disconnects, and the client sends it again when the connection comes back.
LONG_POLLS: frozenset[str] = frozenset(
    {"get_placement", "take_token", "ssp_clock", "wait_step", "checkpoint_done"}
)

#: Ops whose requests or replies carry tensors in bulk: under CURVE a client sends them
#: on its sealed data connection once it has one (``transport/seal.py``), as it does
#: any request that carries tensors; every other request stays on CURVE.
BULK_OPS: frozenset[str] = frozenset(
    {
        "pull",
        "push",
        "push_pull",
        "push_rows",
        "push_pull_rows",
        "pull_rows",
        "table_rows",
        "replicate",
        "install",
    }
)

#: The body schema of every request op: what the codec checks each request against.
REQUEST_BODIES: Mapping[str, Map] = {op: cls.SCHEMA for op, cls in REQUESTS.items()}

#: The reply body type of every request op.
REPLIES: Mapping[str, type[Body]] = {
    "ping": Pong,
    "register": ClusterInfo,
    "heartbeat": HeartbeatReply,
    "leave": StepReply,
    "create_vars": PlacementReply,
    "get_placement": PlacementReply,
    "take_token": Token,
    "ssp_clock": SspGrant,
    "checkpoint": CheckpointTaken,
    "status": Free,
    "shutdown": Empty,
    "create_shards": ShardsCreated,
    "pull": Values,
    "push": PushReply,
    "push_pull": PushReply,
    "push_rows": PushReply,
    "push_pull_rows": PushReply,
    "pull_rows": Values,
    "table_rows": TablePage,
    "shm_attach": ShmAttached,
    "shm_detach": Empty,
    "seal_hello": SealAgreed,
    "sync_config": StepReply,
    "wait_step": StepReply,
    "ps_state": PsStateReply,
    "fence": Fenced,
    "checkpoint_save": Saved,
    "checkpoint_done": Written,
    "restore": Restored,
    "replica": ReplicaState,
    "placement": Empty,
    "replicate": Replicated,
    "join": Joining,
    "install": Replicated,
    "replica_ring": RingAttached,
    "scale": Free,
    "run": Ran,
    "make_resource": ResourceMade,
}
