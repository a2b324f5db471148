"""The parameter client: pulls and pushes a placement's variables from / to the PS.

Rules of this module:

* One request per PS per operation: every shard a call needs from one PS travels
  in one message (each message costs ~100 us of asyncio Python), and the PS are
  asked in parallel.
* Large shards travel as chunks of at most ``chunk_bytes`` (frames over ~24 MB
  are slow to receive).
* Pulled values land in the client's own arrays (``params``), refreshed in place;
  gradients are sent zero-copy as views of the caller's arrays.
* Every push carries (worker, incarnation, sequence): a retried push is applied
  at most once, and pushes of a replaced incarnation are fenced by the PS. A push
  given a :class:`~zmqps.roles.channels.Delivery` can be sent again whole (the
  caller's, after its PS state moved): the same messages with the same numbers,
  those answered skipped.
* Same-host fast path (``shared_memory=True``, the default): on first use of a PS
  the client offers it two shared-memory regions (pull, push) laid out with every
  dense shard it holds there; if the PS can map them (same machine, same
  ``/dev/shm``), dense pulls and pushes move their bytes through them and ZeroMQ
  carries only the control message. Otherwise TCP is used. A variable held whole
  by one PS is laid out in row order, and its ``params`` array becomes a view of the
  pull region: pulls land in it with no extra copy.
* Rows on the same host: when the PS holds rows of this client's tables, each region
  has a room for rows after the dense shards (``row_region_bytes``). A row push's
  rows and a row pull's reply rows travel there (the ids in the message) once the PS
  said it takes them (``shm_rows``, in a row reply) and the regions are attached
  (set up in the background on the first row request: that one goes by TCP); a
  request whose rows do not fit, a push sent again, or a room in use by another
  request goes by TCP. A room is held from its request's send to its reply's read.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.core import lowp
from zmqps.core.hashtable import bucket_of
from zmqps.core.packs import plan_packs
from zmqps.core.segments import Order, same_ids, sum_rows, unique_sorted
from zmqps.core.variables import Placement, ShardDef, ShardInfo, VariableDef
from zmqps.roles.channels import Delivery, DenseChannel, ShmChannel, TcpChannel, Transfer, layout
from zmqps.roles.threads import CheckThreads
from zmqps.transport.base import Requester
from zmqps.transport.shm import Region, create_region, sweep, unlink_region
from zmqps.wire import Message, Tensor
from zmqps.wire import ops as o
from zmqps.wire.errors import (
    InvalidArgument,
    NonFiniteGradient,
    NotFound,
    NotPrimary,
    ProtocolError,
    RolledBack,
    ZmqpsError,
)
from zmqps.wire.schema import MAX_ROW_VALUES, MAX_ROWS

__all__ = ["Delivery", "ParameterClient", "RowPush"]

#: the body of each push op
_PUSH_BODIES: dict[str, type[o.Push]] = {
    "push": o.Push,
    "push_pull": o.PushPull,
    "push_rows": o.PushRows,
    "push_pull_rows": o.PushPullRows,
}
#: the push ops of rows (their replies say what the PS takes)
_ROW_OPS = frozenset({"push_rows", "push_pull_rows"})

log = logging.getLogger("zmqps.client")

Array = npt.NDArray[Any]

#: the room for rows in each shared-memory region to a PS that holds rows (bytes): a
#: row request whose rows need more goes by TCP
ROW_REGION_BYTES = 8 << 20

_swept = False


def row_ids(name: str, ids: Any) -> Array:
    """A batch's row ids of variable ``name`` as int64 (a copy only where they are of
    another integer type; uint64 ids past 2^63 become the int64 of the same bits).
    InvalidArgument for ids that are not integers: a float id was cut to an integer
    (1.5 read row 1, NaN and floats past 2^63 all one row), a bool mask read rows 0
    and 1, a string failed deep in numpy."""
    if type(ids) is np.ndarray and ids.dtype == np.int64:
        return ids
    try:
        a = np.asarray(ids)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"row ids of {name} must be integers ({exc})") from None
    if a.dtype.kind in "iu" or (a.size == 0 and a.dtype.kind == "f"):  # ([] is float64)
        return a.astype(np.int64, copy=False)
    raise InvalidArgument(f"row ids of {name} must be integers (int64), got {a.dtype} values")


def _rows_per_request(shape: tuple[int, ...]) -> int:
    """The most rows of a variable of ``shape`` one row request may carry."""
    return max(1, min(MAX_ROWS, MAX_ROW_VALUES // max(1, math.prod(shape[1:]))))


async def _every(messages: Iterable[Awaitable[bool]]) -> bool:
    """Every message of a push, each to its PS: whether all were applied. A failure is
    raised once every message has its outcome (none still in flight), so a push sent
    again (its :class:`Delivery`) never races its own first messages."""
    results = await asyncio.gather(*messages, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    # a refusal of the values last: a message that failed otherwise (its state moved)
    # is sent again first, so that every PS state has the push's outcome
    failed.sort(key=lambda e: isinstance(e, NonFiniteGradient))
    if failed:
        raise failed[0]
    return all(results)


def _sweep_once() -> None:
    """Before this process's first regions: remove those dead processes left (a
    worker killed while it set its own up, say)."""
    global _swept
    if not _swept:
        _swept = True
        removed = sweep()
        if removed:
            log.info("removed %d shared-memory regions of dead processes", len(removed))


async def tell_left(ps: Sequence[Requester], worker: str, incarnation: int, steps: int) -> None:
    """Every PS of ``ps`` keeps that ``worker`` (this incarnation) left with its work
    done after ``steps`` batches, and fences its older incarnations: a chief started
    later learns from them that the worker finished (a failure is logged, not raised)."""
    body = o.Fence(worker, incarnation, True, steps).to_wire()

    async def one(c: Requester) -> None:
        try:
            await c.request("fence", body, timeout=2.0)
        except ZmqpsError as e:
            log.warning("could not tell ps %s that %s finished: %s", c.endpoint, worker, e)

    await asyncio.gather(*(one(c) for c in ps))


@dataclass(frozen=True)
class _Route:
    shard: ShardInfo
    var: VariableDef
    start: int  # flat element offset of the shard inside its variable
    size: int  # elements in the shard
    #: the dtype its values and gradients travel as (its variable's wire dtype)
    wire: np.dtype[Any]


@dataclass(frozen=True, slots=True)
class _RowPlan:
    """Where a batch's rows go: made once per batch of ids (:meth:`ParameterClient._row_plan`)."""

    ids: Array  # the batch (a copy: the caller may refill its array)
    #: the distinct ids, each shard's together and ascending within it
    uniq: Array
    #: ``ids == uniq[inverse]``
    inverse: Array
    #: ps -> [(shard, lo, hi)]: the shard's ids are ``uniq[lo:hi]`` (maybe none)
    parts: dict[int, list[tuple[ShardInfo, int, int]]]
    #: the ids sorted with their positions, when ``uniq`` is in their order (a sum
    #: of the batch's rows follows it: :func:`~zmqps.core.segments.sum_rows`)
    order: Order | None = None


#: the pull of a ``push_pull_rows`` message: its parts, their ids (``uniq``), the rows
#: they land in, and what takes the reply (given the region and offsets the PS wrote
#: the rows at, or None: they are in the reply)
_RowPull = tuple[
    list[tuple[ShardInfo, int, int]],
    Array,
    Array,
    Callable[[Message, "tuple[Region, Sequence[int]] | None"], None],
]


@dataclass(slots=True)
class RowPush:
    """A row push made ready to send (:meth:`ParameterClient.rows_push`): the batch's
    plan and its rows summed per distinct id, in the plan's order (arrays of its own).

    Made with ``grads`` (a caller that waits for the push, and leaves its rows alone
    meanwhile), the sum is made when the push is sent: straight into the push
    region when the rows go there, saving a copy of them; else on first use."""

    name: str
    plan: _RowPlan
    #: the sum, once made (None: not yet, ``grads`` holds the batch's rows)
    summed_rows: Array | None
    #: the batch's rows as the caller gave them, until summed (not a copy)
    grads: Array | None = None

    @property
    def summed(self) -> Array:
        """The rows summed per distinct id (made now if not yet)."""
        if self.summed_rows is None:
            assert self.grads is not None
            self.summed_rows = sum_rows(
                self.grads,
                self.plan.inverse,
                self.plan.uniq.size,
                load=False,
                order=self.plan.order,
            )
        return self.summed_rows

    @property
    def rows(self) -> Array:
        """Rows of the dtype and row shape the pushed ones have (summed or not)."""
        rows = self.summed_rows if self.summed_rows is not None else self.grads
        assert rows is not None
        return rows

    def sum_into(self, out: Array) -> bool:
        """Sum the rows into ``out`` (every distinct id's row, in the plan's order) when
        they are not summed yet; False: summed already (copy them instead)."""
        if self.summed_rows is not None:
            return False
        assert self.grads is not None
        plan = self.plan
        sum_rows(self.grads, plan.inverse, plan.uniq.size, load=False, out=out, order=plan.order)
        return True


class ParameterClient:
    def __init__(
        self,
        ps: Sequence[Requester],
        placement: Placement,
        *,
        worker: str,
        incarnation: int,
        chunk_bytes: int = 4 << 20,
        timeout: float = 30.0,
        push_attempts: int = 3,
        shared_memory: bool = True,
        group_bytes: int = 16 << 20,
        generation: Callable[[], int] | None = None,
        exact: bool = False,
        row_region_bytes: int = ROW_REGION_BYTES,
    ) -> None:
        self.ps = list(ps)
        self.placement = placement
        self.worker = worker
        self.incarnation = incarnation
        #: where the cluster generation comes from (a worker's session owns it); a
        #: client of its own (tests, tools) keeps one here
        self._generation = generation
        self._gen = 0
        self.timeout = timeout
        self.push_attempts = push_attempts
        self._chunk_bytes = max(1, chunk_bytes)
        #: over TCP, one PS's shards travel in messages of about this many bytes
        self.group_bytes = group_bytes
        self._seq = [0] * len(self.ps)
        #: coordinator mode: the scheduled function whose pushes these are (see tag())
        self._closure: int | None = None
        self._closure_seq = [0] * len(self.ps)
        self.routes: dict[int, _Route] = {}
        for s in placement.shards:
            var = placement.variable(s.var)
            if s.ps >= len(self.ps):
                raise InvalidArgument(
                    f"shard {s.id} placed on PS {s.ps}, only {len(self.ps)} known"
                )
            wire = np.dtype(var.dtype) if exact else var.wire_dtype
            self.routes[s.id] = _Route(
                s, var, s.row_start * var.row_size, s.rows * var.row_size, wire
            )
        self.params: dict[str, Array] = {
            v.name: np.zeros(v.shape, dtype=v.dtype) for v in placement.variables if not v.sparse
        }
        #: every packed shard's pack (:mod:`zmqps.core.packs`: the PS plan the same)
        self.pack_of: dict[int, tuple[int, ...]] = {}
        #: the elements of every pack
        self.pack_elems: dict[tuple[int, ...], int] = {}
        #: packs of whole variables only: their params are views of one buffer, which a
        #: packed reply lands in with one copy
        self._pack_bufs: dict[tuple[int, ...], tuple[Array, list[tuple[str, Array]]]] = {}
        self._plan_packs()
        self.versions: dict[int, int] = dict.fromkeys(self.routes, 0)
        #: the generation each shard's version (and values) was pulled in: a push is
        #: stamped with it, so that a gradient computed on values of before a restore
        #: is refused RolledBack even when the worker has heard of the restore since
        self.version_gens: dict[int, int] = dict.fromkeys(self.routes, 0)
        #: pulls bring the values as the PS keeps them, not rounded to their wire dtype
        #: (an evaluation's or an export's; such a client pulls only, by TCP)
        self.exact = exact
        #: the threads that convert a bfloat16 wire's large arrays
        self.threads = CheckThreads()
        self.shared_memory = shared_memory and not exact
        self._channels: list[DenseChannel | None] = [None] * len(self.ps)
        self._channel_setup = [asyncio.Lock() for _ in self.ps]
        self.last_staleness = 0
        self.dropped: dict[str, int] = {}  # pushes the PS acknowledged without applying
        #: the PS states whose dense push replies said they take ``Push.fresh`` (an
        #: older PS refuses a field it does not know)
        self.fresh_ps: set[int] = set()
        #: pushes sent / acknowledged applied / dropped, by "ps/generation": what the PS
        #: counted of this incarnation must match (a fault test's exactly-once check)
        self.push_counts: dict[str, dict[str, int]] = {}
        self._row_bounds: dict[str, tuple[Array, list[ShardInfo]]] = {}
        for v in placement.variables:
            shards = sorted(placement.shards_of(v.name), key=lambda s: s.row_start)
            self._row_bounds[v.name] = (np.array([s.row_start for s in shards], np.int64), shards)
        #: the last batch's plan per row variable (one per variable: a step's pull and
        #: push of the same ids share it)
        self._row_plans: dict[str, _RowPlan] = {}
        #: PS states whose last row reply said they take ``push_pull_rows``
        self.rows_both: set[int] = set()
        #: PS states whose last row reply said they take rows in shared memory
        self.rows_shm: set[int] = set()
        #: PS states whose last row reply said they take a request's index tensors
        #: joined into one (``counts``)
        self.rows_joined: set[int] = set()
        #: the room for rows in each region (0: rows always by TCP)
        self.row_region_bytes = max(0, row_region_bytes)
        #: regions being set up in the background for rows, by PS state
        self._attaching: dict[int, asyncio.Future[DenseChannel]] = {}

    # ------------------------------------------------------------------ helpers

    def _plan_packs(self) -> None:
        p = self.placement
        by_state: dict[int, list[ShardDef]] = {}
        for s in p.shards:
            by_state.setdefault(s.state, []).append(ShardDef.of(p.variable(s.var), s, p.optimizer))
        for defs in by_state.values():
            for ids in plan_packs(defs):
                elems = sum(self.routes[sid].size for sid in ids)
                if elems * 4 > self._chunk_bytes:
                    continue  # travels in frames of at most chunk_bytes
                for sid in ids:
                    self.pack_of[sid] = ids
                self.pack_elems[ids] = elems
                held = self.whole_in(ids)
                if set(held) == {self.routes[sid].var.name for sid in ids}:
                    buf = np.zeros(elems, np.float32)
                    views = []
                    for name, pos in held.items():
                        v = p.variable(name)
                        view = buf[pos : pos + math.prod(v.shape)].reshape(v.shape)
                        self.params[name] = view
                        views.append((name, view))
                    self._pack_bufs[ids] = (buf, views)

    def whole_in(self, ids: Sequence[int]) -> dict[str, int]:
        """The variables pack ``ids`` holds whole, in row order, and the element each
        starts at in the pack: their arrays can be views of a buffer laid out as it is."""
        first: dict[str, int] = {}
        count: dict[str, int] = {}
        pos = 0
        ok: dict[str, bool] = {}
        for sid in ids:
            r = self.routes[sid]
            name = r.var.name
            if name not in first:
                first[name], count[name], ok[name] = pos - r.start, 0, True
            ok[name] = ok[name] and first[name] + r.start == pos
            count[name] += 1
            pos += r.size
        return {
            name: at
            for name, at in first.items()
            if ok[name] and count[name] == len(self.placement.shards_of(name))
        }

    def packed(self, sids: Sequence[int]) -> tuple[list[tuple[int, ...]], list[int]]:
        """``sids`` as the packs they hold whole and the shards that travel on their own."""
        packs: list[tuple[int, ...]] = []
        if not self.pack_of:
            return packs, list(sids)
        present = set(sids)
        covered: set[int] = set()
        for sid in sids:
            ids = self.pack_of.get(sid)
            if ids is not None and sid == ids[0] and present.issuperset(ids):
                packs.append(ids)
                covered.update(ids)
        return packs, [sid for sid in sids if sid not in covered]

    def is_pack(self, sids: Sequence[int]) -> bool:
        """Whether ``sids`` are exactly one pack, in order."""
        return len(sids) >= 2 and self.pack_of.get(sids[0]) == tuple(sids)

    def pack_grad(
        self, ids: Sequence[int], grads: Mapping[str, Array], out: Array | None = None
    ) -> Array:
        """The gradient of every shard of pack ``ids``, back to back (into ``out``)."""
        parts = []
        for sid in ids:
            r = self.routes[sid]
            parts.append(grads[r.var.name][r.start : r.start + r.size])
        return np.concatenate(parts, out=out)

    @property
    def gen(self) -> int:
        """The cluster generation this client's values belong to (sent with every data
        request; a PS of another generation refuses it with RolledBack)."""
        return self._gen if self._generation is None else self._generation()

    @gen.setter
    def gen(self, value: int) -> None:
        if self._generation is not None:
            raise AttributeError("this client reads the generation from its session")
        self._gen = value

    @property
    def global_step(self) -> int:
        """Updates applied to the model, as last seen: the highest shard version."""
        return max(self.versions.values(), default=0)

    def dense_names(self) -> list[str]:
        return [v.name for v in self.placement.variables if not v.sparse]

    def check_names(self, names: Iterable[str]) -> None:
        """Every one of ``names`` is a variable of the placement (else
        :class:`InvalidArgument`, naming the unknown ones)."""
        unknown = set(names) - {v.name for v in self.placement.variables}
        if unknown:
            raise InvalidArgument(f"unknown variables: {sorted(unknown)}")

    def _by_ps(self, names: Iterable[str]) -> dict[int, list[int]]:
        wanted = set(names)
        self.check_names(wanted)
        out: dict[int, list[int]] = {}
        for sid, r in self.routes.items():
            if r.shard.var in wanted:
                out.setdefault(r.shard.state, []).append(sid)
        return out

    def chunks(self, sids: Sequence[int], grads: Mapping[str, Array], kind: str) -> list[Tensor]:
        """Shards ``sids`` of the flat gradients in ``grads``, as message tensors of at
        most ``chunk_bytes`` each (zero-copy views). The shards that travel narrower are
        rounded to their wire dtype first, all in one call (cut across the threads as
        one run of work, not shard by shard)."""
        parts: list[tuple[int, Array]] = []
        narrowed: list[tuple[Array, Array]] = []
        for sid in sids:
            r = self.routes[sid]
            part = grads[r.var.name][r.start : r.start + r.size]
            if lowp.is_narrow(r.wire):  # travels narrower: the gradient rounded to it
                out = np.empty(r.size, r.wire)
                narrowed.append((np.ascontiguousarray(part, np.float32).reshape(-1), out))
                part = out
            parts.append((sid, part))
        if narrowed:
            lowp.narrow_all(narrowed, self.threads)
        out_tensors: list[Tensor] = []
        for sid, part in parts:
            step = max(1, self._chunk_bytes // part.itemsize)
            size = self.routes[sid].size
            out_tensors += [
                Tensor(part[off : off + step], kind, sid, off) for off in range(0, size, step)
            ] or [Tensor(part, kind, sid, 0)]
        return out_tensors

    def take_values(
        self,
        reply: Message,
        sids: Sequence[int],
        out: Mapping[str, Array] | None,
        gen: int | None,
    ) -> None:
        """The values a reply carries (to a request of generation ``gen``), copied into
        ``params`` (or ``out``). A pack the PS sent packed is one tensor named by its
        first shard."""
        self.set_versions(reply, sids, gen)
        dst_arrays = self.params if out is None else out
        narrowed: list[tuple[Array, Array]] = []
        tensors: Sequence[Tensor] = reply.tensors
        if reply.body.get("packed"):
            tensors = self._take_packs(reply, sids, dst_arrays, out is None)
        for t in tensors:
            r = self.routes.get(t.ref)
            if r is None or t.kind != "value" or t.offset + t.array.size > r.size:
                raise ProtocolError(f"pull reply: unexpected tensor for shard {t.ref}")
            flat = dst_arrays[r.var.name].reshape(-1)
            dst = flat[r.start + t.offset : r.start + t.offset + t.array.size]
            if t.array.dtype != r.wire:
                raise ProtocolError(
                    f"pull reply: shard {t.ref} values are {t.array.dtype}, not {r.wire}"
                )
            if lowp.is_narrow(r.wire):
                narrowed.append((t.array.reshape(-1), dst))
            elif not _same_memory(t.array, dst):  # else opened there already (landing)
                np.copyto(dst, t.array.reshape(-1), casting="same_kind")
        lowp.widen_all(narrowed, self.threads)  # every chunk at once, by several threads

    def _take_packs(
        self, reply: Message, sids: Sequence[int], dst: Mapping[str, Array], params: bool
    ) -> list[Tensor]:
        """The packed values of a reply copied in; the tensors of other shards returned."""
        heads = {ids[0]: ids for ids in self.packed(sids)[0]}
        rest: list[Tensor] = []
        for t in reply.tensors:
            ids = heads.pop(t.ref, None)
            if ids is None:
                rest.append(t)
                continue
            flat = t.array.reshape(-1)
            if t.kind != "value" or t.offset or flat.dtype != np.float32:
                raise ProtocolError(f"pull reply: unexpected packed tensor for shard {t.ref}")
            if flat.size != self.pack_elems[ids]:
                raise ProtocolError(f"pull reply: the pack of shard {t.ref} has another size")
            kept = self._pack_bufs.get(ids) if params else None
            if kept is not None and all(dst.get(name) is v for name, v in kept[1]):
                if not _same_memory(flat, kept[0]):  # else opened there already (landing)
                    np.copyto(kept[0], flat)  # params are views of the pack's buffer
                continue
            pos = 0
            for r in (self.routes[sid] for sid in ids):
                part = dst[r.var.name].reshape(-1)[r.start : r.start + r.size]
                np.copyto(part, flat[pos : pos + r.size])
                pos += r.size
        if heads:
            raise ProtocolError("pull reply: a pack said to be packed is missing")
        return rest

    def landing(
        self, out: Mapping[str, Array] | None
    ) -> Callable[[np.dtype[Any], tuple[int, ...], str, int, int], Any]:
        """Where each chunk of a pull's (or a push_pull's) reply may be opened when it
        comes sealed (``transport/seal.py``): the slice of ``params`` (or ``out``) that
        :meth:`take_values` copies it to, for a chunk it copies as it is; None for the
        rest (copied, or refused, by :meth:`take_values` as always)."""
        dst_arrays = self.params if out is None else out

        def land(
            dtype: np.dtype[Any], shape: tuple[int, ...], kind: str, ref: int, offset: int
        ) -> Any:
            r = self.routes.get(ref)
            if r is None or kind != "value" or dtype != r.wire or lowp.is_narrow(r.wire):
                return None
            size = math.prod(shape)
            ids = self.pack_of.get(ref)
            kept = self._pack_bufs.get(ids) if ids is not None and out is None else None
            if kept is not None and offset == 0 and size == kept[0].size and size > r.size:
                # a pack sent packed: its buffer, if params are still its views
                if all(self.params.get(name) is v for name, v in kept[1]):
                    return kept[0]
                return None
            arr = dst_arrays.get(r.var.name)
            if offset + size > r.size or not isinstance(arr, np.ndarray):
                return None
            if arr.dtype != dtype or not arr.flags.c_contiguous or not arr.flags.writeable:
                return None
            return arr.reshape(-1)[r.start + offset : r.start + offset + size]

        return land

    def tag(self, closure: int | None) -> None:
        """From now on, pushes belong to scheduled function ``closure`` (None: to no
        function); each PS deduplicates a function's pushes across the workers that
        run it."""
        self._closure = closure
        self._closure_seq = [0] * len(self.ps)

    def push_body(
        self,
        ps: int,
        sids: Sequence[int],
        step: int | None,
        versions: Mapping[int, int] | None = None,
        cursor: int | None = None,
        *,
        op: str = "push",
        shm: o.ShmRef | None = None,
        shm_out: o.ShmRef | None = None,
        versions_gen: int | None = None,
        delivery: Delivery | None = None,
        packs: Sequence[int] = (),
        **more: Any,
    ) -> o.Push:
        """The body of the next push to PS ``ps`` (its own sequence number), stamped
        with the generation of the values its gradients were computed on: those pulled
        last, or, with explicit ``versions``, ``versions_gen`` (default: the current
        one). A message of ``delivery`` sent again keeps its numbers. ``more``: fields
        of ``op``'s body beyond a push's (``push_pull_rows``' ``pull``, ``create``)."""
        key = (ps, tuple(sids))
        kept = None if delivery is None else delivery.seqs.get(key)
        gen = self.gen
        if versions is None and sids:  # the values pulled last: their generation
            gen = min(gen, *(self.version_gens[s] for s in sids))
        elif versions_gen is not None:
            gen = min(gen, versions_gen)
        if kept is not None:
            seq, closure_seq = kept
        else:
            self._seq[ps] += 1
            seq, closure_seq = self._seq[ps], None
            self._tally(ps, gen, "sent")
            if self._closure is not None:
                self._closure_seq[ps] += 1
                closure_seq = self._closure_seq[ps]
            if delivery is not None:
                delivery.seqs[key] = (seq, closure_seq)
        pulled = self.versions if versions is None else versions
        kind = _PUSH_BODIES.get(op, o.Push)
        # sync: what the push asks for beyond applying its gradients (``delivery``'s)
        token_ps = None if delivery is None else delivery.token_ps
        fresh = delivery is not None and delivery.fresh
        return kind(
            shards=tuple(sids),
            versions=tuple(pulled[s] for s in sids),
            worker=self.worker,
            inc=self.incarnation,
            seq=seq,
            step=step,
            shm=shm,
            shm_out=shm_out,
            gen=gen,
            cursor=cursor,
            closure=self._closure,
            closure_seq=closure_seq,
            packs=tuple(packs) or None,
            token=True if ps == token_ps and (op == "push" or fresh) else None,
            fresh=True if op == "push_pull" and fresh else None,
            **more,
        )

    def _tally(self, ps: int, gen: int, what: str) -> None:
        counts = self.push_counts.setdefault(f"{ps}/{gen}", {"sent": 0, "applied": 0, "dropped": 0})
        counts[what] += 1

    def after_push(
        self,
        ps: int,
        reply: Message,
        body: o.Push,
        delivery: Delivery | None = None,
        parsed: o.PushReply | None = None,
    ) -> bool:
        """Read the reply to push ``body`` sent to PS ``ps``; True if it was applied
        (kept in ``delivery``: the message is answered). ``parsed``: the reply's body,
        parsed already."""
        rep = o.PushReply.parse(reply.body, "push reply") if parsed is None else parsed
        if body.OP in _ROW_OPS:
            self.heard_takes(ps, rep.takes)
        elif body.OP == "push" or body.fresh:  # a sync PS says it takes ``fresh``
            if rep.takes is not None and "fresh" in rep.takes:
                self.fresh_ps.add(ps)
            else:
                self.fresh_ps.discard(ps)
        if delivery is not None:
            delivery.answered[(ps, tuple(body.shards))] = rep.applied
        if rep.staleness:
            self.last_staleness = max(rep.staleness)
        if delivery is not None:  # what a sync push asked for, in ``delivery``
            step, gen, offered = rep.token_step, rep.token_gen, delivery.offered
            if (
                step is not None
                and gen is not None
                and (offered is None or offered[:2] < (step, gen))
            ):
                delivery.offered = (step, gen, rep.token_ps)
            if body.fresh:  # the step of the values it brought, the PS state's oldest
                brought = -1 if rep.values_step is None else rep.values_step
                delivery.fresh_steps[ps] = min(brought, delivery.fresh_steps.get(ps, brought))
        outcome = rep.outcome
        self._tally(ps, body.gen or 0, "applied" if rep.applied else "dropped")
        if rep.applied:
            return True
        self.dropped[outcome] = self.dropped.get(outcome, 0) + 1
        return False

    def heard_takes(self, ps: int, takes: Sequence[str] | None) -> None:
        """PS state ``ps`` answered a row request saying which ops it takes beyond the
        common ones (``takes``; None: an older PS, which takes none)."""
        if takes is not None and "push_pull_rows" in takes:
            self.rows_both.add(ps)
        else:
            self.rows_both.discard(ps)
        if takes is not None and "shm_rows" in takes:
            self.rows_shm.add(ps)
        else:
            self.rows_shm.discard(ps)
        if takes is not None and "rows_joined" in takes:
            self.rows_joined.add(ps)
        else:
            self.rows_joined.discard(ps)

    def takes_fresh(self, names: Iterable[str]) -> bool:
        """Whether every PS state holding shards of ``names`` said it takes ``Push.fresh``."""
        return self._by_ps(names).keys() <= self.fresh_ps

    def fresh_step(self, names: Iterable[str], delivery: Delivery) -> int | None:
        """The sync step of the values push ``delivery`` brought for every shard of
        ``names`` (it asked for them: ``fresh``), or None where some PS state brought
        none."""
        steps = [delivery.fresh_steps.get(ps, -1) for ps in self._by_ps(names)]
        return min(steps) if steps and min(steps) >= 0 else None

    def set_versions(self, reply: Message, sids: Sequence[int], gen: int | None) -> None:
        """The versions of the values a reply carries; ``gen``: the generation of the
        request (a PS answers only requests of its own generation)."""
        versions = reply.body.get("versions")
        if not isinstance(versions, list) or len(versions) != len(sids):
            raise ProtocolError("reply: versions do not match the shards asked for")
        g = self.gen if gen is None else gen
        for sid, version in zip(sids, versions, strict=True):
            self.versions[sid] = int(version)
            self.version_gens[sid] = g

    def moved(self, states: Sequence[int]) -> None:
        """PS ``states`` are served by other processes now (a fail-over, a move): their
        shared-memory channels were attached to the old ones, and are set up again
        on next use."""
        for state in states:
            self._channels[state] = None
            self.rows_both.discard(state)  # another process: it says again what it takes
            self.rows_shm.discard(state)
            self.rows_joined.discard(state)

    # ------------------------------------------------------------------ channels

    def transport_of(self, ps: int) -> str:
        """ "shm" when dense tensors to PS ``ps`` travel through shared memory, else "tcp"."""
        ch = self._channels[ps]
        return "shm" if isinstance(ch, ShmChannel) else "tcp"

    async def _channel(self, ps: int, sids: Sequence[int]) -> DenseChannel:
        """The channel to PS ``ps`` (set up on first use) that carries ``sids``."""
        ch = self._channels[ps]
        if ch is None:
            async with self._channel_setup[ps]:
                if self._channels[ps] is None:
                    self._channels[ps] = await self._attach(ps) or TcpChannel(self, ps)
            ch = self._channels[ps]
        assert ch is not None
        if isinstance(ch, ShmChannel) and not ch.covers(sids):
            return TcpChannel(self, ps)
        return ch

    async def _fast_path(self, ps: int) -> ShmChannel | None:
        """The shared-memory channel to PS ``ps``, if there is one."""
        ch = await self._channel(ps, [])
        return ch if isinstance(ch, ShmChannel) else None

    async def _attach(self, ps: int) -> ShmChannel | None:
        if not self.shared_memory:
            return None
        offsets, whole, pos = layout(self, ps)
        rows = self.row_region_bytes if self._holds_rows(ps) else 0
        if not offsets and not rows:
            return None
        regions: list[Region] = []
        try:
            _sweep_once()
            regions = [create_region(pos + rows), create_region(pos + rows)]
            ids = []
            for region in regions:
                body = o.ShmAttach(region.name, region.size, self.worker, self.incarnation)
                # attempts=2: attaching is idempotent on the PS, so the request is sent
                # again at once when its connection comes back (a partition, a stop);
                # two halves of the timeout in all
                rep = await self.ps[ps].request(
                    "shm_attach", body.to_wire(), timeout=self.timeout / 2, attempts=2
                )
                got = o.ShmAttached.parse(rep.body, "shm_attach reply")
                if got.token != region.token.hex():
                    raise NotFound("the PS maps different memory under that name")
                ids.append(got.region)
        except (OSError, ZmqpsError) as exc:
            log.info("ps %d: no same-host fast path (%s); using TCP", ps, exc)
            for region in regions:
                region.close()
            return None
        except BaseException:  # cancelled (the client closes): nothing keeps them
            for region in regions:
                region.close()
            raise
        finally:
            for region in regions:
                unlink_region(region)
        log.info(
            "ps %d: dense tensors (%d bytes) and rows (%d bytes) travel through shared memory",
            ps,
            pos,
            rows,
        )
        return ShmChannel.make(
            self, ps, regions[0], regions[1], (ids[0], ids[1]), offsets, whole, (pos, rows)
        )

    def _holds_rows(self, ps: int) -> bool:
        """Whether PS state ``ps`` holds a shard of a row variable."""
        return any(
            s.state == ps
            for v in self.placement.variables
            if v.sparse
            for s in self.placement.shards_of(v.name)
        )

    def _row_channel(self, ps: int) -> ShmChannel | None:
        """The shared-memory channel a row request to PS state ``ps`` may use, if there
        is one with room for rows and the PS said it takes rows that way. None also while
        it is set up: that starts in the background at the first call, so that a row
        request never waits between being made and being sent (the requests of one
        client to one PS leave in the order they were made)."""
        if ps not in self.rows_shm:
            return None
        ch = self._channels[ps]
        if isinstance(ch, ShmChannel):
            return ch if ch.regions.rows_bytes else None
        setup = self.shared_memory and self.row_region_bytes > 0
        if ch is None and setup and ps not in self._attaching:
            task = asyncio.ensure_future(self._channel(ps, []))
            self._attaching[ps] = task
            task.add_done_callback(functools.partial(self._attached, ps))
        return None

    def _attached(self, ps: int, task: asyncio.Future[DenseChannel]) -> None:
        if self._attaching.get(ps) is task:
            del self._attaching[ps]
        if not task.cancelled() and task.exception() is not None:
            log.info("ps %d: shared memory for rows not set up: %s", ps, task.exception())

    def _lost_region(self, ps: int, ch: ShmChannel, exc: ZmqpsError) -> None:
        """The PS did not know a region of ``ch`` (it restarted, or the state moved away
        and back): the request was refused before anything changed and goes by TCP; the
        next one sets shared memory up afresh."""
        log.info("ps %d: shared memory not known there (%s): set up again", ps, exc)
        if self._channels[ps] is ch:
            self._channels[ps] = None

    def restored(self, gen: int) -> None:
        """The cluster was restored into generation ``gen``: fail the requests still
        waiting (a restarted PS never answers them), and attach shared memory afresh (a
        restarted PS does not know the old regions; the old ones are freed once unused)."""
        if self._generation is None:
            self._gen = gen
        for c in self.ps:
            fail = getattr(c, "fail_pending", None)
            if fail is not None:
                fail(RolledBack(f"the cluster was restored (generation {gen})"))
        self._stop_attaching()
        self._channels = [None] * len(self.ps)

    def _stop_attaching(self) -> None:
        for task in list(self._attaching.values()):
            task.cancel()
        self._attaching.clear()

    async def tell_left(self, steps: int) -> None:
        """Tell every PS that this worker finished its work after ``steps`` batches (what
        the chief does when it hears the worker leave; used when the chief did not)."""
        await tell_left(self.ps, self.worker, self.incarnation, steps)

    async def close(self) -> None:
        """Release shared-memory regions (best effort: the PS also drops them on rejoin),
        every PS at once (a PS gone costs one short timeout, not one per PS)."""
        self._stop_attaching()
        channels = [ch for ch in self._channels if ch is not None]
        self._channels = [None] * len(self.ps)
        await asyncio.gather(*(ch.close() for ch in channels))
        self.threads.close()

    # ------------------------------------------------------------------ dense

    def _check_out(self, out: Mapping[str, Array], by_ps: Mapping[int, Sequence[int]]) -> None:
        for sids in by_ps.values():
            for sid in sids:
                v = self.routes[sid].var
                a = out.get(v.name)
                if not isinstance(a, np.ndarray):
                    raise InvalidArgument(f"no host array for {v.name} to pull into")
                if a.shape != v.shape or a.dtype != np.dtype(v.dtype):
                    raise InvalidArgument(
                        f"pull into {v.name}: {a.dtype}{list(a.shape)} is not"
                        f" {v.dtype}{list(v.shape)}"
                    )
                if not a.flags.c_contiguous or not a.flags.writeable:
                    raise InvalidArgument(f"pull into {v.name}: a writeable C-contiguous array")

    def groups(self, sids: list[int]) -> list[list[int]]:
        """Shards of one PS in messages of about ``group_bytes``: small shards travel
        together, large ones alone, so the PS applies one message while the next
        arrives and the worker copies one reply while the next streams in. A pack
        (:mod:`zmqps.core.packs`) held whole travels as a message of its own."""
        packs, sids = self.packed(sids)
        groups: list[list[int]] = [list(ids) for ids in packs]  # a pack: one message
        size = self.group_bytes
        for sid in sids:
            r = self.routes[sid]
            nbytes = r.size * r.wire.itemsize
            if groups and size + nbytes <= self.group_bytes:
                groups[-1].append(sid)
                size += nbytes
            else:
                groups.append([sid])
                size = nbytes
        return groups

    def _grad_arrays(self, grads: Mapping[str, Any]) -> dict[str, Array]:
        out = {}
        for name, g in grads.items():
            try:
                v = self.placement.variable(name)
            except KeyError:
                raise InvalidArgument(f"gradient for unknown variable {name!r}") from None
            dtype = g.dtype if hasattr(g, "dtype") else np.asarray(g).dtype
            if dtype.kind not in "fiu":
                # complex lost its imaginary part (a warning at most), bool became 0 / 1
                raise InvalidArgument(
                    f"gradient for {name}: {dtype} values; a gradient is real numbers ({v.dtype})"
                )
            arr = np.ascontiguousarray(g, dtype=v.dtype)
            if arr.shape != v.shape:
                raise InvalidArgument(f"gradient for {name}: shape {arr.shape} != {v.shape}")
            out[name] = arr.reshape(-1)
        return out

    async def _dense(
        self,
        op: str,
        names: Iterable[str],
        grads: Mapping[str, Array] | None = None,
        out: Mapping[str, Array] | None = None,
        step: int | None = None,
        versions: Mapping[int, int] | None = None,
        cursor: int | None = None,
        versions_gen: int | None = None,
        delivery: Delivery | None = None,
    ) -> bool:
        """One dense operation over every PS at once, each through its channel (a
        push sent again: by TCP, see :class:`Delivery`)."""
        by_ps = self._by_ps(names)
        if out is not None and op != "push":
            self._check_out(out, by_ps)
        if out is None and op == "pull":
            for sids in by_ps.values():
                for sid in sids:
                    v = self.routes[sid].var
                    if v.name not in self.params:
                        self.params[v.name] = np.zeros(v.shape, dtype=v.dtype)

        async def one(ps: int, sids: list[int]) -> bool:
            if delivery is not None and delivery.sent_to(ps):
                channel: DenseChannel = TcpChannel(self, ps)
            else:
                channel = await self._channel(ps, sids)
            t = Transfer(op, sids, grads, out, step, versions, cursor, versions_gen, delivery)
            try:
                return await channel.transfer(t)
            except NotFound as exc:
                if isinstance(exc, NotPrimary) or not isinstance(channel, ShmChannel):
                    raise
                # the process serving PS state ``ps`` does not know this worker's shared
                # memory (it restarted, or the state moved away and back between two
                # requests): refused before anything changed. Sent again by TCP; the
                # next request attaches shared memory afresh.
                log.info("ps %d: shared memory not known there (%s): set up again", ps, exc)
                self._channels[ps] = None
                return await TcpChannel(self, ps).transfer(t)

        if len(by_ps) == 1:
            return await one(*next(iter(by_ps.items())))
        if op == "pull":
            results = await asyncio.gather(*(one(ps, sids) for ps, sids in by_ps.items()))
            return all(results)
        return await _every(one(ps, sids) for ps, sids in by_ps.items())

    async def pull(
        self, names: Iterable[str] | None = None, *, out: Mapping[str, Array] | None = None
    ) -> dict[str, Array]:
        """Pull whole variables (default: every dense one) into ``params``, or into the
        caller's host arrays ``out`` (same shapes and dtypes; returned as a dict)."""
        await self._dense("pull", self.dense_names() if names is None else names, out=out)
        return self.params if out is None else dict(out)

    async def push(
        self,
        grads: Mapping[str, Any],
        *,
        pull: bool = False,
        step: int | None = None,
        out: Mapping[str, Array] | None = None,
        versions: Mapping[int, int] | None = None,
        cursor: int | None = None,
        versions_gen: int | None = None,
        delivery: Delivery | None = None,
    ) -> bool:
        """Push whole-variable gradients (``pull=True``: :meth:`push_pull`). ``step`` is
        the local step (sync mode: the token's value); ``versions`` the shard versions
        the gradients were computed from (default: of the last pull; a caller that
        pulls ahead keeps its own, and says their generation, ``versions_gen``, from
        :meth:`values_gen` when it took them); ``cursor`` the batch the worker computed
        them on; ``delivery``: keeps its messages, to send it again with the same
        (see :class:`Delivery`). Returns False if some PS dropped the push (stale in
        sync mode, or a duplicate)."""
        flat = self._grad_arrays(grads)
        op = "push_pull" if pull else "push"
        return await self._dense(
            op, flat, flat, out, step, versions, cursor, versions_gen, delivery
        )

    async def push_pull(
        self,
        grads: Mapping[str, Any],
        *,
        step: int | None = None,
        out: Mapping[str, Array] | None = None,
        versions: Mapping[int, int] | None = None,
        cursor: int | None = None,
        versions_gen: int | None = None,
        delivery: Delivery | None = None,
    ) -> bool:
        """Push gradients and get the fresh values back in the same round trip; they
        land in ``params`` (or in ``out``, see :meth:`pull`)."""
        flat = self._grad_arrays(grads)
        return await self._dense(
            "push_pull", flat, flat, out, step, versions, cursor, versions_gen, delivery
        )

    def values_gen(self) -> int:
        """The generation of the dense values pulled last (the oldest of any shard):
        what a caller keeping their ``versions`` passes as ``versions_gen``."""
        return min(self.version_gens.values(), default=self.gen)

    # ------------------------------------------------------------------ rows

    def _variable(self, name: str) -> VariableDef:
        try:
            return self.placement.variable(name)
        except KeyError:
            raise InvalidArgument(f"unknown variable {name!r}") from None

    def _row_plan(self, name: str, ids: Array) -> _RowPlan:
        """Where the rows of batch ``ids`` go (:class:`_RowPlan`), made once per batch:
        a push of the ids just pulled (the usual step) reuses the pull's plan, so the
        ids are sorted once per step, not once per call."""
        kept = self._row_plans.get(name)
        if kept is not None and same_ids(kept.ids, ids, load=False):
            return kept
        v = self._variable(name)
        if not v.sparse:
            # a sync step counted a row push of it as the worker's share of that shard,
            # and its whole push came stale: the step applied one row, another variable
            # none of that worker's gradient
            raise InvalidArgument(
                f"{name!r} is a dense variable: rows are for embedding variables (sparse"
                " or hash-keyed tables); pull, push or push_pull it whole"
            )
        if ids.ndim != 1:
            raise InvalidArgument("row ids must be 1-D")
        uniq, inverse, order = unique_sorted(ids, load=False)
        if v.hashed:  # any int64 id; routed by its stable hash bucket
            keys = bucket_of(uniq, v.shape[0])
        elif uniq.size and (uniq[0] < 0 or uniq[-1] >= v.shape[0]):
            raise InvalidArgument(f"row ids of {name} must be in [0, {v.shape[0]})")
        else:
            keys = uniq
        starts, shards = self._row_bounds[name]
        if v.hashed:
            which = np.searchsorted(starts, keys, side="right") - 1
            if which.size > 1 and not bool((which[1:] >= which[:-1]).all()):
                # each shard's ids together (ascending within it, as the PS likes them)
                by_shard = np.argsort(which, kind="stable")
                uniq, which = uniq[by_shard], which[by_shard]
                rank = np.empty_like(by_shard)
                rank[by_shard] = np.arange(by_shard.size)
                inverse = rank[inverse]
            bounds = np.searchsorted(which, np.arange(len(shards) + 1), side="left").tolist()
        else:  # ascending ids, all in [0, rows): each shard's first is where its start goes
            bounds = [*np.searchsorted(uniq, starts, side="left").tolist(), uniq.size]
        parts: dict[int, list[tuple[ShardInfo, int, int]]] = {}
        for k, sh in enumerate(shards):
            parts.setdefault(sh.state, []).append((sh, bounds[k], bounds[k + 1]))
        # a hash-keyed table's ids are in their shards' order, not ascending
        plan = _RowPlan(ids.copy(), uniq, inverse, parts, None if v.hashed else order)
        self._row_plans[name] = plan
        return plan

    async def pull_rows(self, name: str, ids: Any, *, create: bool = True) -> Array:
        """Rows ``ids`` of variable ``name`` (duplicates allowed), shape (len(ids), *row).

        ``create=False``: a read-only pull for evaluation and serving. A hash-keyed
        table then creates, stamps and admits nothing; an id without a row reads as
        its initial value (zeros while not admitted), as a creating pull would return
        it. The shard versions of a read-only pull are not recorded (no push follows)."""
        v = self._variable(name)
        ids = row_ids(name, ids)
        plan = self._row_plan(name, ids)
        uniq, inverse = plan.uniq, plan.inverse
        rows = np.empty((uniq.size, *v.shape[1:]), dtype=v.dtype)

        def one(ps: int, parts: list[tuple[ShardInfo, int, int]]) -> Awaitable[None]:
            return self._pull_rows_from(ps, parts, uniq, rows, create)

        # a request moves at most MAX_ROW_VALUES values: a larger pull is several
        per = _rows_per_request(v.shape)
        for lo in range(0, max(uniq.size, 1), per):
            window = _row_window(plan, lo, lo + per)
            if len(window) == 1:  # one PS (the usual case): no task of its own
                await one(*next(iter(window.items())))
            else:
                await asyncio.gather(*(one(ps, parts) for ps, parts in window.items()))
        return np.take(rows, inverse, axis=0)

    async def _pull_rows_from(
        self,
        ps: int,
        parts: list[tuple[ShardInfo, int, int]],
        uniq: Array,
        rows: Array,
        create: bool,
    ) -> None:
        """One ``pull_rows`` to PS state ``ps``: the rows of ``uniq[lo:hi]`` of each
        ``(shard, lo, hi)`` of ``parts``, copied into ``rows[lo:hi]``."""
        sids = [s.id for s, _, _ in parts]
        tensors, counts = self._index_tensors(ps, [(uniq, parts)])
        # create is sent only when false: a creating pull stays what older PS understand
        body = o.PullRows(tuple(sids), self.gen, None if create else False, counts=counts)
        ch = self._row_channel(ps)
        places = None
        if ch is not None and not ch.rows_pull_lock.locked():
            row_bytes = rows.itemsize * math.prod(rows.shape[1:])
            places = ch.row_places([(hi - lo) * row_bytes for _, lo, hi in parts])
        if ch is not None and places is not None:
            async with ch.rows_pull_lock:  # the PS writes there: held until read
                shm_out = o.ShmRef(ch.regions.pull_id, tuple(places))
                try:
                    rep = await self.ps[ps].request(
                        "pull_rows",
                        replace(body, shm_out=shm_out).to_wire(),
                        tensors,
                        timeout=self.timeout,
                        attempts=2,
                    )
                except NotFound as exc:
                    if isinstance(exc, NotPrimary):
                        raise
                    self._lost_region(ps, ch, exc)
                else:
                    got = o.Values.parse(rep.body, "pull_rows reply")
                    # rows in the reply: a copy of a pull the PS served already
                    region = None if rep.tensors else (ch.regions.pull, places)
                    self._take_rows(
                        "pull_rows", rep, got.versions, parts, rows, create, body.gen, region
                    )
                    self.heard_takes(ps, got.takes)
                    return
        rep = await self.ps[ps].request(
            "pull_rows", body.to_wire(), tensors, timeout=self.timeout, attempts=2
        )
        got = o.Values.parse(rep.body, "pull_rows reply")
        self._take_rows("pull_rows", rep, got.versions, parts, rows, create, body.gen)
        self.heard_takes(ps, got.takes)

    def _take_rows(
        self,
        op: str,
        rep: Message,
        versions: Sequence[int],
        parts: list[tuple[ShardInfo, int, int]],
        rows: Array,
        create: bool,
        gen: int | None,
        region: tuple[Region, Sequence[int]] | None = None,
        *,
        copy: bool = True,
    ) -> None:
        """The rows a reply to a row pull of ``parts`` brought (``region``: the PS wrote
        them in this region at these offsets), copied into their slices of ``rows``
        (``copy=False``: the caller reads them from the region itself); a creating
        pull's versions recorded (of generation ``gen``)."""
        if len(versions) != len(parts):
            raise ProtocolError(f"{op} reply: versions do not match")
        row_shape = rows.shape[1:]
        if region is not None:
            if rep.tensors:
                raise ProtocolError(f"{op} reply: rows in the region and in the reply")
            width = math.prod(row_shape)
            for (_, lo, hi), off in zip(parts, region[1], strict=True) if copy else ():
                rows[lo:hi] = (
                    region[0].view(off, rows.dtype, (hi - lo) * width).reshape(hi - lo, *row_shape)
                )
        elif len(rep.tensors) != len(parts):
            raise ProtocolError(f"{op} reply: one rows tensor per shard expected")
        for k, ((s, lo, hi), ver) in enumerate(zip(parts, versions, strict=True)):
            if region is None:
                t = rep.tensors[k]
                if t.ref != s.id or t.array.shape != (hi - lo, *row_shape):
                    raise ProtocolError(f"{op} reply: bad rows for shard {s.id}")
                rows[lo:hi] = t.array
            if create:
                self.versions[s.id] = int(ver)
                self.version_gens[s.id] = gen if gen is not None else self.gen

    async def table_rows(self, name: str, *, attempts: int = 3) -> tuple[Array, Array]:
        """Every live row of the hash-keyed table ``name``: ``(ids, values)``, ids
        ascending (an export's tables). Reads only; each shard is listed in pages of
        about ``chunk_bytes``, and listed again if it changed meanwhile."""
        v = self._variable(name)
        if not v.hashed:
            raise InvalidArgument(f"{name} is not a hash-keyed table")
        row_shape = tuple(v.shape[1:])
        limit = max(1, self._chunk_bytes // (8 + math.prod(row_shape) * np.dtype(v.dtype).itemsize))

        async def page(s: ShardInfo, start: int) -> tuple[int, int, Array, Array]:
            body = o.TableRows(s.id, start, limit, self.gen)
            rep = await self.ps[s.state].request(
                "table_rows", body.to_wire(), timeout=self.timeout, attempts=2
            )
            got = o.TablePage.parse(rep.body, "table_rows reply")
            version, total = got.version, got.rows
            if total < start:
                raise ProtocolError("table_rows reply: bad version or row count")
            n = rep.tensors[0].array.shape[0] if len(rep.tensors) == 2 else -1
            # the PS may send fewer rows than asked (it bounds a page's bytes), never none
            # while rows are left
            if (
                not (0 < n <= limit if start < total else n == 0)
                or rep.tensors[0].array.shape != (n,)
                or rep.tensors[1].array.shape != (n, *row_shape)
            ):
                raise ProtocolError(f"table_rows reply: bad rows for shard {s.id}")
            return version, total, rep.tensors[0].array, rep.tensors[1].array

        async def shard(s: ShardInfo) -> tuple[Array, Array]:
            for _ in range(attempts):
                version, total, ids, values = await page(s, 0)
                got_ids, got_values, at, same = [ids], [values], ids.size, True
                while at < total and same:
                    ver, tot, ids, values = await page(s, at)
                    same = (ver, tot) == (version, total)
                    got_ids.append(ids)
                    got_values.append(values)
                    at += ids.size
                all_ids = np.concatenate(got_ids)
                if same and (all_ids.size < 2 or bool((np.diff(all_ids) > 0).all())):
                    return all_ids, np.concatenate(got_values)
            raise ZmqpsError(f"table {name}: shard {s.id} kept changing while being listed")

        parts = await asyncio.gather(*(shard(s) for s in self.placement.shards_of(name)))
        ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
        values = np.concatenate([p[1] for p in parts]).astype(v.dtype, copy=False)
        order = np.argsort(ids, kind="stable")
        return ids[order], values[order]

    async def push_rows(
        self,
        name: str,
        ids: Any,
        grads: Any,
        *,
        step: int | None = None,
        cursor: int | None = None,
        delivery: Delivery | None = None,
    ) -> bool:
        """Push row gradients; duplicate ids are summed here, before sending. With a
        ``step`` (sync mode) every shard of the table gets a push, empty or not;
        ``delivery``: see :meth:`push`."""
        rows = self.rows_push(name, ids, grads)
        return await self.send_rows(rows, step=step, cursor=cursor, delivery=delivery)

    def rows_push(
        self, name: str, ids: Any, grads: Any, *, load: bool = False, later: bool = False
    ) -> RowPush:
        """The first half of :meth:`push_rows`, no I/O: the gradients checked, their
        repeated ids summed into rows of their own (the caller's arrays are not held:
        it may refill them at once). ``load``: the caller's thread may load the row
        kernel (:func:`~zmqps.core.segments.sum_rows`). ``later``: the caller waits
        for the push and leaves ``grads`` alone until then; they are summed as the
        push is sent (into the push region, when the rows go there)."""
        v = self._variable(name)
        ids = row_ids(name, ids)
        grads = np.asarray(grads, dtype=v.dtype)
        if grads.shape != (ids.size, *v.shape[1:]):
            raise InvalidArgument(
                f"row gradients of {name}: shape {grads.shape} != {(ids.size, *v.shape[1:])}"
            )
        plan = self._row_plan(name, ids)  # the pull's, when these are the ids just pulled
        # duplicates summed in one pass, in the batch's order (core/segments.py), into
        # the plan's order: each shard's rows are one slice, sent as a view
        if later:
            return RowPush(name, plan, None, grads)
        return RowPush(
            name, plan, sum_rows(grads, plan.inverse, plan.uniq.size, load=load, order=plan.order)
        )

    async def send_rows(
        self,
        rows: RowPush,
        *,
        step: int | None = None,
        cursor: int | None = None,
        delivery: Delivery | None = None,
    ) -> bool:
        """The second half of :meth:`push_rows`: one request to each PS."""
        uniq = rows.plan.uniq

        async def one(ps: int, parts: list[tuple[ShardInfo, int, int]]) -> bool:
            sids = [s.id for s, _, _ in parts]
            done = None if delivery is None else delivery.outcome(ps, sids)
            if done is not None:  # sent again: this message was answered the first time
                return done
            again = delivery is not None and delivery.sent_to(ps)  # then by TCP
            body = self.push_body(ps, sids, step, cursor=cursor, op="push_rows", delivery=delivery)
            rep = await self._row_request(ps, body, again, parts, uniq, rows)
            return self.after_push(ps, rep, body, delivery)

        routed = self._routed(rows, step)
        if len(routed) == 1:  # one PS (the usual case): no task of its own
            return await one(*next(iter(routed.items())))
        return await _every(one(ps, parts) for ps, parts in routed.items())

    async def _row_request(
        self,
        ps: int,
        body: o.Push,
        again: bool,
        parts: list[tuple[ShardInfo, int, int]],
        uniq: Array,
        pushed: RowPush,
        pull: _RowPull | None = None,
    ) -> Message:
        """Send row push ``body`` (``push_rows``, or ``push_pull_rows`` with ``pull``:
        its parts, their ids, where the rows land, and what reads the reply) to PS
        state ``ps``: the rows of ``pushed.summed[lo:hi]`` of each part, through the
        regions when they fit and are free (not ``again``: a push sent again goes by
        TCP), else in the message; the reply (its pulled rows taken already)."""
        ch = None if again else self._row_channel(ps)
        push_at = pull_at = None
        if ch is not None:
            if not ch.rows_push_lock.locked():
                like = pushed.rows
                row_bytes = like.itemsize * math.prod(like.shape[1:])
                push_at = ch.row_places([(hi - lo) * row_bytes for _, lo, hi in parts])
            if pull is not None and not ch.rows_pull_lock.locked():
                got = pull[2]
                row_bytes = got.itemsize * math.prod(got.shape[1:])
                pull_at = ch.row_places([(hi - lo) * row_bytes for _, lo, hi in pull[0]])
        if ch is not None and (push_at is not None or pull_at is not None):
            # the rooms are held from here until the reply is read (taking a free lock
            # does not wait: the request still leaves before any made after it)
            async with contextlib.AsyncExitStack() as held:
                r = ch.regions
                if push_at is not None:
                    await held.enter_async_context(ch.rows_push_lock)
                    whole = _whole(r.push, parts, push_at, pushed.rows, uniq.size)
                    if whole is None or not pushed.sum_into(whole):
                        summed = pushed.summed
                        for (_, lo, hi), off in zip(parts, push_at, strict=True):
                            src = summed[lo:hi]
                            r.push.view(off, src.dtype, src.size)[...] = src.reshape(-1)
                if pull_at is not None:
                    await held.enter_async_context(ch.rows_pull_lock)
                shm = None if push_at is None else o.ShmRef(r.push_id, tuple(push_at))
                out = None if pull_at is None else o.ShmRef(r.pull_id, tuple(pull_at))
                try:
                    rep = await self._row_send(
                        ps, replace(body, shm=shm, shm_out=out), parts, uniq, pushed, pull
                    )
                except NotFound as exc:
                    if isinstance(exc, NotPrimary):
                        raise
                    self._lost_region(ps, ch, exc)  # refused before anything changed
                else:
                    if pull is not None:  # rows in the reply: a copy the PS served already
                        region = None if pull_at is None or rep.tensors else (r.pull, pull_at)
                        pull[3](rep, region)
                    return rep
        rep = await self._row_send(ps, body, parts, uniq, pushed, pull)
        if pull is not None:
            pull[3](rep, None)
        return rep

    async def _row_send(
        self,
        ps: int,
        body: o.Push,
        parts: list[tuple[ShardInfo, int, int]],
        uniq: Array,
        pushed: RowPush,
        pull: _RowPull | None,
    ) -> Message:
        """One row push message: each part's ids, and its rows unless they are in the
        push region (``body.shm``), then the ids of each part of ``pull``."""
        summed = None if body.shm is not None else pushed.summed
        pieces = [(uniq, parts)] if pull is None else [(uniq, parts), (pull[1], pull[0])]
        index, counts = self._index_tensors(ps, pieces)
        wire = body.to_wire()
        tensors: list[Tensor] = []
        if counts is not None:  # the ids joined, then each shard's rows (TCP)
            wire["counts"] = list(counts)
            tensors += index
            if summed is not None:
                tensors += [Tensor(summed[lo:hi], "rows", s.id) for s, lo, hi in parts]
        else:  # (index, rows) of each pushed shard, then the index of each pulled one
            for k, (s, lo, hi) in enumerate(parts):
                tensors.append(index[k])
                if summed is not None:
                    tensors.append(Tensor(summed[lo:hi], "rows", s.id))
            tensors += index[len(parts) :]
        return await self.ps[ps].request(
            body.OP, wire, tensors, timeout=self.timeout, attempts=self.push_attempts
        )

    def _index_tensors(
        self, ps: int, pieces: Sequence[tuple[Array, Sequence[tuple[ShardInfo, int, int]]]]
    ) -> tuple[list[Tensor], tuple[int, ...] | None]:
        """The index tensors of a row request to PS state ``ps`` (``pieces``: each an
        array of ids and the ``(shard, lo, hi)`` parts of it the request names, in
        order): one per shard and None; or, to a PS that said it takes them joined
        (``rows_joined``) when there are several, one tensor of them all back to back
        and each one's count (fewer message parts: each costs both ends a few
        microseconds of Python)."""
        n = sum(len(parts) for _, parts in pieces)
        if n < 2 or ps not in self.rows_joined:
            return [
                Tensor(a[lo:hi], "index", s.id) for a, parts in pieces for s, lo, hi in parts
            ], None
        spans = []
        for a, parts in pieces:  # consecutive parts of one array: one view of it
            k = 0
            while k < len(parts):
                j = k
                while j + 1 < len(parts) and parts[j + 1][1] == parts[j][2]:
                    j += 1
                spans.append(a[parts[k][1] : parts[j][2]])
                k = j + 1
        joined = spans[0] if len(spans) == 1 else np.concatenate(spans)
        counts = tuple(hi - lo for _, parts in pieces for _, lo, hi in parts)
        return [Tensor(joined, "index", -1)], counts

    def _routed(
        self, rows: RowPush, step: int | None
    ) -> dict[int, list[tuple[ShardInfo, int, int]]]:
        """The parts of a row push each PS state gets (sync, ``step`` given: every
        shard, empty or not); InvalidArgument when one PS's are more than a request
        carries."""
        every_shard = step is not None  # sync: every shard hears from every worker
        routed = {
            ps: kept
            for ps, parts in rows.plan.parts.items()
            if (kept := [(s, lo, hi) for s, lo, hi in parts if hi > lo or every_shard])
        }
        per = _rows_per_request(self._variable(rows.name).shape)
        for ps, parts in routed.items():  # one push is one request to each PS
            n = sum(hi - lo for _, lo, hi in parts)
            if n > per:
                raise InvalidArgument(
                    f"push_rows of {rows.name}: {n:,} distinct rows for ps {ps} in one push;"
                    f" a request carries at most {per:,} of them (MAX_ROWS, MAX_ROW_VALUES):"
                    " push fewer rows per step, or spread the table over more shards"
                )
        return routed

    async def push_pull_rows(
        self,
        name: str,
        ids: Any,
        grads: Any,
        next_ids: Any,
        *,
        create: bool = True,
        step: int | None = None,
        cursor: int | None = None,
        delivery: Delivery | None = None,
    ) -> tuple[bool, Array]:
        """:meth:`push_rows` of ``(ids, grads)``, then :meth:`pull_rows` of
        ``next_ids`` of the same table, in one round trip: whether the push was
        applied, and the rows (which read its update, as after a ``push_rows``)."""
        rows = self.rows_push(name, ids, grads)
        return await self.send_pull_rows(
            rows, next_ids, create=create, step=step, cursor=cursor, delivery=delivery
        )

    async def send_pull_rows(
        self,
        rows: RowPush,
        ids: Any,
        *,
        create: bool = True,
        step: int | None = None,
        cursor: int | None = None,
        delivery: Delivery | None = None,
    ) -> tuple[bool, Array]:
        """The second half of :meth:`push_pull_rows`: to each PS state, its part of
        the push and of the pull of ``ids`` in one ``push_pull_rows`` message (which
        the PS applies, then reads); to a PS that did not say it takes that op, a
        ``push_rows`` then a ``pull_rows``. A pull larger than one request is the push,
        then :meth:`pull_rows`. Sent again (``delivery``), an answered message is not
        sent: the rows it brought are kept in ``delivery``."""
        v = self._variable(rows.name)
        ids = row_ids(rows.name, ids)
        plan = self._row_plan(rows.name, ids)
        per = _rows_per_request(v.shape)
        if plan.uniq.size > per:
            applied = await self.send_rows(rows, step=step, cursor=cursor, delivery=delivery)
            return applied, await self.pull_rows(rows.name, ids, create=create)
        routed = self._routed(rows, step)
        wanted = _row_window(plan, 0, per)
        kept: tuple[Array, set[int]] | None = None if delivery is None else delivery.pulled
        if kept is None or kept[0].shape[0] != plan.uniq.size:
            kept = (np.empty((plan.uniq.size, *v.shape[1:]), dtype=v.dtype), set())
            if delivery is not None:
                delivery.pulled = kept
        got, done = kept
        uniq = rows.plan.uniq
        #: the batch's rows gathered straight from the pull region (one PS): then
        #: ``got`` was not filled, and the PS is not ``done`` (sent again, it pulls anew)
        gathered: list[Array] = []

        async def pull(ps: int) -> None:
            if ps in wanted and ps not in done:
                await self._pull_rows_from(ps, wanted[ps], plan.uniq, got, create)
                done.add(ps)

        async def one(ps: int) -> bool:
            parts = routed.get(ps)
            if parts is None:
                await pull(ps)
                return True
            sids = [s.id for s, _, _ in parts]
            answered = None if delivery is None else delivery.outcome(ps, sids)
            if answered is not None or ps not in wanted or ps not in self.rows_both:
                # answered already, nothing to pull there, or a PS that may not take it
                if answered is None:
                    answered = await self.send_rows(
                        RowPush(
                            rows.name, _only(rows.plan, ps, parts), rows.summed_rows, rows.grads
                        ),
                        step=step,
                        cursor=cursor,
                        delivery=delivery,
                    )
                await pull(ps)
                return answered
            pulls = wanted[ps]
            again = delivery is not None and delivery.sent_to(ps)  # then by TCP
            body = self.push_body(
                ps,
                sids,
                step,
                cursor=cursor,
                op="push_pull_rows",
                delivery=delivery,
                pull=tuple(s.id for s, _, _ in pulls),
                create=None if create else False,
            )
            assert isinstance(body, o.PushPullRows)

            parsed: list[o.PushReply] = []

            def take(rep: Message, region: tuple[Region, Sequence[int]] | None) -> None:
                parsed.append(o.PushReply.parse(rep.body, "push_pull_rows reply"))
                versions = parsed[-1].pulled or ()
                whole = None
                if region is not None and len(every) == 1:
                    whole = _whole(region[0], pulls, region[1], got, plan.uniq.size)
                # the pull read at the request's generation: the PS refuses another one
                self._take_rows(
                    "push_pull_rows",
                    rep,
                    versions,
                    pulls,
                    got,
                    create,
                    body.gen,
                    region,
                    copy=whole is None,
                )
                if whole is not None:  # read before the region is free again: one copy
                    gathered.append(np.take(whole, plan.inverse, axis=0))

            rep = await self._row_request(
                ps, body, again, parts, uniq, rows, (pulls, plan.uniq, got, take)
            )
            if not gathered:
                done.add(ps)
            return self.after_push(ps, rep, body, delivery, parsed[-1] if parsed else None)

        every = set(routed) | set(wanted)
        if len(every) == 1:  # one PS (the usual case): no task of its own
            applied = await one(next(iter(every)))
        else:
            applied = await _every(one(ps) for ps in sorted(every))
        if gathered:
            return applied, gathered[0]
        return applied, np.take(got, plan.inverse, axis=0)


def _row_window(plan: _RowPlan, lo: int, hi: int) -> dict[int, list[tuple[ShardInfo, int, int]]]:
    """The parts of ``plan`` each PS state holds among its distinct ids ``[lo, hi)``
    (one request's worth)."""
    window: dict[int, list[tuple[ShardInfo, int, int]]] = {}
    for ps, parts in plan.parts.items():
        cut = [(s, max(a, lo), min(b, hi)) for s, a, b in parts if a < hi and b > lo]
        if cut:
            window[ps] = cut
    return window


def _only(plan: _RowPlan, ps: int, parts: list[tuple[ShardInfo, int, int]]) -> _RowPlan:
    """``plan`` with only PS state ``ps``'s ``parts``."""
    return _RowPlan(plan.ids, plan.uniq, plan.inverse, {ps: parts}, plan.order)


def _whole(
    region: Region,
    parts: Sequence[tuple[ShardInfo, int, int]],
    places: Sequence[int],
    like: Array,
    size: int,
) -> Array | None:
    """The rows of all ``size`` distinct ids as one view of ``region``, when ``parts``
    cover them in order and their ``places`` there are back to back (rows like
    ``like``'s); else None."""
    width = math.prod(like.shape[1:])
    row_bytes = like.itemsize * width
    if not parts or parts[0][1] != 0 or parts[-1][2] != size:
        return None
    for k, ((_, lo, _), off) in enumerate(zip(parts, places, strict=True)):
        if (k and lo != parts[k - 1][2]) or off != places[0] + lo * row_bytes:
            return None
    return region.view(places[0], like.dtype, size * width).reshape(size, *like.shape[1:])


def _same_memory(a: Array, b: Array) -> bool:
    """``a`` is ``b``'s bytes (a chunk opened into its place): nothing to copy."""
    return bool(
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.nbytes == b.nbytes
    )
