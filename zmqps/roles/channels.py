"""Dense channels: how a worker's dense tensors travel to and from one PS.

Rules of this module:

* A channel moves whole shards for the three dense operations, written once per
  channel in :meth:`transfer`: ``pull`` (values back), ``push`` (gradients out) and
  ``push_pull`` (both in one round trip).
* :class:`TcpChannel`: tensors travel in the messages, as chunks of at most
  ``chunk_bytes``, in messages of about ``group_bytes`` (small shards together,
  large ones alone), sent zero-copy as views of the caller's arrays.
* :class:`ShmChannel` (same host): the bytes move through two shared-memory
  regions (pull, push) laid out alike; ZeroMQ carries only the control message. A
  variable held whole by the PS is laid out in row order and the client's
  ``params`` array is a view of the pull region, so pulls land in it without a
  copy. Nothing may write the pull region once the worker holds its reply: a
  shared-memory pull is never resent, and a resent push_pull's values come in the
  reply (the PS answers a duplicate that way) and are copied only while the worker
  still waits for it.
* A push sent again (:class:`Delivery`: its PS state moved in a fail-over, or its PS
  was cut off and is back) goes by TCP, as the same messages with the same sequence
  numbers (a PS that has one answers it as a duplicate), and only the messages not
  answered: the shared-memory regions the first was sent through are those of the
  process it was sent to.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from zmqps.core import lowp
from zmqps.transport.shm import Region
from zmqps.wire import Tensor
from zmqps.wire import ops as o
from zmqps.wire.errors import (
    DeadlineExceeded,
    NotPrimary,
    NotReady,
    RolledBack,
    ZmqpsError,
)

if TYPE_CHECKING:
    from zmqps.roles.client import ParameterClient

__all__ = ["ALIGN", "RECOVERABLE", "Delivery", "DenseChannel", "ShmChannel", "TcpChannel", "layout"]

log = logging.getLogger("zmqps.client")

Array = npt.NDArray[Any]
ALIGN = 64


Key = tuple[int, tuple[int, ...]]


#: Failures of a data request that a restore, a healed partition or a fail-over
#: (the state's new primary: ``not_primary`` from a copy) answers.
RECOVERABLE = (RolledBack, NotReady, DeadlineExceeded, NotPrimary)


@dataclass
class Delivery:
    """The messages of one push, kept so that it can be sent again: each message (to a
    PS state, of some of its shards) with its sequence numbers, and the outcome of
    each one answered. Sent again, a message keeps its numbers (a PS that applied it
    already answers it as a duplicate: applied at most once) and an answered one is
    not sent (its outcome stands)."""

    #: (PS state, shards) -> (sequence number, the scheduled function's, if any)
    seqs: dict[Key, tuple[int, int | None]] = field(default_factory=dict)
    #: (PS state, shards) -> applied (False: a duplicate or stale)
    answered: dict[Key, bool] = field(default_factory=dict)
    #: times it was sent again
    again: int = 0
    #: a push sent with a pull (``push_pull_rows``): the rows pulled so far and the PS
    #: states they came from (a message answered is not sent again: its rows stand)
    pulled: Any = None
    #: sync: the PS state asked, with this push, for the worker's next token (its
    #: reply brings it once released: ``Push.token``); None: none is asked
    token_ps: int | None = None
    #: sync: every PS asked for the values of after the step (``Push.fresh``, sent as
    #: ``push_pull``)
    fresh: bool = False
    #: the next token a reply brought, as (step, generation, PS)
    offered: tuple[int, int, int | None] | None = None
    #: with ``fresh``: the step of the values each PS state brought (-1: none), of the
    #: last time it was sent (a message answered before a fail-over brought values of
    #: a step that those sent again may not share)
    fresh_steps: dict[int, int] = field(default_factory=dict)

    def sent_to(self, ps: int) -> bool:
        """Whether a message of this push went to PS state ``ps`` already."""
        return any(k[0] == ps for k in self.seqs)

    def outcome(self, ps: int, sids: list[int]) -> bool | None:
        """The message of ``sids`` to PS state ``ps``: applied or not if answered
        already (sent again, it is not sent), else None."""
        return self.answered.get((ps, tuple(sids)))

    def groups(self, ps: int) -> list[list[int]]:
        """The shards of each message to PS state ``ps``, as first sent."""
        return [list(sids) for p, sids in self.seqs if p == ps]


@dataclass(frozen=True)
class Transfer:
    """One dense operation on some shards of one PS."""

    op: str  # pull, push or push_pull
    sids: list[int]
    grads: Mapping[str, Array] | None = None  # flat gradients by variable (push ops)
    out: Mapping[str, Array] | None = None  # where pulled values land (default: params)
    step: int | None = None
    versions: Mapping[int, int] | None = None
    cursor: int | None = None
    #: the generation of the values ``versions`` are of (with explicit versions)
    versions_gen: int | None = None
    #: the push's messages, kept to send it again (None: sent once)
    delivery: Delivery | None = None


class DenseChannel:
    """The interface (see the two channels below)."""

    kind = ""

    def __init__(self, client: ParameterClient, ps: int) -> None:
        self.client = client
        self.ps = ps

    async def transfer(self, t: Transfer) -> bool:
        """Carry out ``t``; False if a push was acknowledged without being applied."""
        raise NotImplementedError

    async def close(self) -> None:
        pass


class TcpChannel(DenseChannel):
    kind = "tcp"

    async def transfer(self, t: Transfer) -> bool:
        d = t.delivery
        groups = d.groups(self.ps) if d is not None and d.sent_to(self.ps) else None
        groups = groups or self.client.groups(t.sids)
        if len(groups) == 1:
            return await self._message(t, groups[0])
        parts = await asyncio.gather(*(self._message(t, g) for g in groups))
        return all(parts)

    async def _message(self, t: Transfer, sids: list[int]) -> bool:
        c = self.client
        requester = c.ps[self.ps]
        packs = (len(sids),) if c.is_pack(sids) else ()  # one frame for the whole pack
        if t.op == "pull":
            # A TCP pull is idempotent: it may be sent again (after its deadline, or at
            # once when a lost connection comes back).
            pull = o.Pull(tuple(sids), gen=c.gen, exact=c.exact or None, packs=packs or None)
            if getattr(requester, "lands", False):  # a sealed reply opens into params
                rep = await requester.request(  # type: ignore[call-arg]
                    "pull",
                    pull.to_wire(),
                    timeout=c.timeout,
                    attempts=2,
                    landing=c.landing(t.out),
                )
            else:
                rep = await requester.request("pull", pull.to_wire(), timeout=c.timeout, attempts=2)
            c.take_values(rep, sids, t.out, pull.gen)
            return True
        assert t.grads is not None
        done = None if t.delivery is None else t.delivery.outcome(self.ps, sids)
        if done is not None:  # sent again: this message was answered the first time
            return done
        if packs:
            tensors = [Tensor(c.pack_grad(sids, t.grads), "grad", sids[0], 0)]
        else:
            tensors = c.chunks(sids, t.grads, "grad")
        body = c.push_body(
            self.ps,
            sids,
            t.step,
            t.versions,
            t.cursor,
            op=t.op,
            versions_gen=t.versions_gen,
            delivery=t.delivery,
            packs=packs,
        )
        if t.op == "push_pull" and getattr(requester, "lands", False):
            # its sealed reply's values open into params, as a pull's do
            rep = await requester.request(  # type: ignore[call-arg]
                t.op,
                body.to_wire(),
                tensors,
                timeout=c.timeout,
                attempts=c.push_attempts,
                landing=c.landing(t.out),
            )
        else:
            rep = await requester.request(
                t.op, body.to_wire(), tensors, timeout=c.timeout, attempts=c.push_attempts
            )
        accepted = c.after_push(self.ps, rep, body, t.delivery)
        if t.op == "push_pull" and not rep.body.get("unvalued"):
            c.take_values(rep, sids, t.out, body.gen)
        return accepted


@dataclass
class _Regions:
    pull: Region
    push: Region
    pull_id: int
    push_id: int
    offsets: dict[int, int]  # shard id -> data byte offset
    whole: dict[str, int] = field(default_factory=dict)  # variables held whole -> offset
    #: the room for rows after the dense shards, in each region: ``[rows_at, +rows_bytes)``
    rows_at: int = 0
    rows_bytes: int = 0


class ShmChannel(DenseChannel):
    kind = "shm"

    def __init__(self, client: ParameterClient, ps: int, regions: _Regions) -> None:
        super().__init__(client, ps)
        self.regions = regions
        self.lock = asyncio.Lock()
        self.offsets = regions.offsets  # tests and the client read the layout here
        #: the rows room of each region is written by one row request at a time (the
        #: push region's by the worker, the pull region's by the PS), held until its
        #: reply is read; a row request that finds it held goes by TCP
        self.rows_push_lock = asyncio.Lock()
        self.rows_pull_lock = asyncio.Lock()

    def row_places(self, nbytes: Sequence[int]) -> list[int] | None:
        """Offsets for rows of ``nbytes`` each, back to back (aligned) in the rows room,
        or None when they do not fit (they go by TCP)."""
        r = self.regions
        places, pos = [], r.rows_at
        for n in nbytes:
            places.append(pos)
            pos += -(-n // ALIGN) * ALIGN
        return places if pos - r.rows_at <= r.rows_bytes else None

    @classmethod
    def make(
        cls,
        client: ParameterClient,
        ps: int,
        pull: Region,
        push: Region,
        ids: tuple[int, int],
        offsets: dict[int, int],
        whole: dict[str, int],
        rows: tuple[int, int] = (0, 0),
    ) -> ShmChannel:
        regions = _Regions(pull, push, ids[0], ids[1], offsets, whole, rows[0], rows[1])
        ch = cls(client, ps, regions)
        for name, off in whole.items():
            # the variable lives whole in this region: pulls land in params directly
            v = client.placement.variable(name)
            view = pull.view(off, v.wire_dtype, math.prod(v.shape)).reshape(v.shape)
            view[...] = client.params[name]
            client.params[name] = view
        return ch

    def covers(self, sids: Sequence[int]) -> bool:
        return all(s in self.regions.offsets for s in sids)

    def ref(self, pull: bool, heads: Sequence[int]) -> o.ShmRef:
        """The region and the offsets of a message's units (``heads``: each pack's first
        shard, then the other shards; a pack is laid out back to back from its first)."""
        r = self.regions
        return o.ShmRef(r.pull_id if pull else r.push_id, tuple(r.offsets[s] for s in heads))

    async def transfer(self, t: Transfer) -> bool:
        c = self.client
        pulls = t.op != "push"
        spans, rest = c.packed(t.sids)
        sids = [sid for ids in spans for sid in ids] + rest  # the packs lead
        heads = [ids[0] for ids in spans] + rest
        packs = tuple(len(ids) for ids in spans)
        async with self.lock:
            if t.op != "pull":
                assert t.grads is not None
                self._copy_in(spans, rest, t.grads)
                req = c.push_body(
                    self.ps,
                    sids,
                    t.step,
                    t.versions,
                    t.cursor,
                    op=t.op,
                    versions_gen=t.versions_gen,
                    shm=self.ref(False, heads),
                    shm_out=self.ref(True, heads) if pulls else None,
                    delivery=t.delivery,
                    packs=packs,
                )
                rep = await c.ps[self.ps].request(
                    t.op, req.to_wire(), timeout=c.timeout, attempts=c.push_attempts
                )
                accepted = c.after_push(self.ps, rep, req, t.delivery)
                gen = req.gen
            else:
                # sent again at once if its connection comes back (a PS stopped past
                # the heartbeat timeout): the PS answers a copy it served by TCP
                pull = o.Pull(tuple(sids), self.ref(True, heads), c.gen, packs=packs or None)
                rep = await c.ps[self.ps].request(
                    "pull", pull.to_wire(), timeout=c.timeout, attempts=2
                )
                accepted, gen = True, pull.gen
            if pulls and rep.body.get("unvalued"):
                pass  # a fresh push's reply without values (the worker pulls)
            elif pulls and rep.tensors:  # a resend's reply: values by TCP (see above)
                c.take_values(rep, sids, t.out, gen)
            elif pulls:
                c.set_versions(rep, sids, gen)
                self._copy_out(sids, t.out)
        return accepted

    def _copy_out(self, sids: Sequence[int], out: Mapping[str, Array] | None) -> None:
        c, r = self.client, self.regions
        for sid in sids:
            route = c.routes[sid]
            if out is None and route.var.name in r.whole:
                continue  # params[name] is a view of the pull region
            src = r.pull.view(r.offsets[sid], route.wire, route.size)
            flat = (c.params if out is None else out)[route.var.name].reshape(-1)
            dst = flat[route.start : route.start + route.size]
            if lowp.is_narrow(route.wire):
                lowp.widen_into(dst, src, c.threads)
            else:
                np.copyto(dst, src)

    def _copy_in(
        self, packs: Sequence[tuple[int, ...]], sids: Sequence[int], flat: Mapping[str, Array]
    ) -> None:
        c, r = self.client, self.regions
        for ids in packs:  # one copy per pack, into its span
            span = r.push.view(r.offsets[ids[0]], np.dtype(np.float32), c.pack_elems[ids])
            c.pack_grad(ids, flat, out=span)
        for sid in sids:
            route = c.routes[sid]
            dst = r.push.view(r.offsets[sid], route.wire, route.size)
            src = flat[route.var.name][route.start : route.start + route.size]
            if lowp.is_narrow(route.wire):  # rounded straight into the region
                lowp.narrow(src, dst, c.threads)
            else:
                np.copyto(dst, src)

    async def close(self) -> None:
        """Release the regions (best effort: the PS also drops them on rejoin)."""
        r = self.regions

        async def detach(rid: int, name: str) -> None:
            try:
                await self.client.ps[self.ps].request(
                    "shm_detach", o.ShmDetach(rid, name).to_wire(), timeout=1.0
                )
            except ZmqpsError as exc:  # the PS is gone already (it drops them itself)
                log.debug("ps %d: shm_detach failed: %s", self.ps, exc)

        await asyncio.gather(detach(r.pull_id, r.pull.name), detach(r.push_id, r.push.name))
        r.pull.close()
        r.push.close()


def layout(client: ParameterClient, ps: int) -> tuple[dict[int, int], dict[str, int], int]:
    """Byte offsets of PS ``ps``'s dense shards in its regions. A variable whose shards
    all live on this PS is laid out whole, in row order, so ``params`` can be a view of
    the pull region; other shards get blocks of their own."""
    offsets: dict[int, int] = {}
    whole: dict[str, int] = {}
    pos = 0

    def block(nbytes: int) -> int:
        nonlocal pos
        start = pos
        pos += -(-nbytes // ALIGN) * ALIGN
        return start

    placement = client.placement
    for ids, elems in sorted(client.pack_elems.items()):  # each pack back to back
        routes = [client.routes[sid] for sid in ids]
        if routes[0].shard.state != ps:
            continue
        start = block(elems * 4)
        for name, at in client.whole_in(ids).items():  # params of these: views
            whole[name] = start + at * 4
        for r in routes:
            offsets[r.shard.id] = start
            start += r.size * 4
    for v in placement.variables:
        if v.sparse:
            continue
        shards = placement.shards_of(v.name)
        mine = [s for s in shards if s.state == ps and s.id not in offsets]
        itemsize = v.wire_dtype.itemsize
        # a variable travelling narrower is widened into params: never a view of a region
        if not mine:
            continue
        if len(mine) == len(shards) and v.wire is None:
            start = whole[v.name] = block(v.nbytes)
            row_bytes = v.row_size * itemsize
            for s in mine:
                offsets[s.id] = start + s.row_start * row_bytes
        else:
            for s in mine:
                offsets[s.id] = block(s.rows * v.row_size * itemsize)
    return offsets, whole, pos
