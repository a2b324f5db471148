"""Replication entries through shared memory, when a primary and a backup share a host.

Over TCP an entry's tensors cross the loopback once more after the push that made
them: copied into the kernel by the primary and out of it by the backup, with the
system calls in between. On one host the primary writes them once into a ring of
shared memory both map, and the entry (a small message on the same socket) says
where they are (:class:`~zmqps.wire.ops.Replicate`'s ``ring``).

Rules of this module:

* The primary creates the ring (:func:`~zmqps.transport.shm.create_region`: a name
  private to this user, space reserved up front) when the first entry of
  :data:`RING_MIN_BYTES` or more goes to a backup, offers it with ``replica_ring``
  and unlinks its name once answered: the backup maps it only after the checks of
  :func:`~zmqps.transport.shm.attach_region` and answers with the token it read.
  Anything that fails (another host, no room in ``/dev/shm``, an older backup)
  leaves the entries' tensors beside them, as over another host; it is tried again
  at most :data:`RING_ATTEMPTS` times per link.
* Until the ring is answered, entries go with their tensors beside: nothing waits
  for it. An entry with no room in the ring now goes the same way.
* Where each entry's bytes go is :class:`~zmqps.core.ring.RingSpace`'s. A block is
  reused only once the backup cannot read it any more: it applied the entry, and it
  was told (an entry's ``committed``) that every in-sync backup has it, so it keeps
  no view of it for a promotion (:class:`~zmqps.core.replication.ReplicaLog`). A
  primary replaced while stopped writes only into such blocks: whatever a promoted
  copy kept is never overwritten.
* A larger ring replaces the first only when no entry sent in it is unanswered, and
  nothing is written in the first while it is offered: the backup never reads one
  ring's offsets in another (every entry names its ring, and one naming another is
  refused). What the backup keeps of the first stays mapped while it keeps it.
* Bounded: one ring per primary and backup, at most :data:`RING_MAX_BYTES`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from zmqps.core.ring import RingSpace, aligned
from zmqps.transport import Requester
from zmqps.transport.shm import Region, create_region, unlink_region
from zmqps.wire import Tensor
from zmqps.wire import ops as o
from zmqps.wire.codec import tensor_spec
from zmqps.wire.errors import NotFound, ZmqpsError

__all__ = ["RING_MAX_BYTES", "RING_MIN_BYTES", "RingLink"]

log = logging.getLogger("zmqps.ps")

#: entries smaller than this travel beside their message (a copy into the ring would
#: save nothing worth a ring)
RING_MIN_BYTES = 64 << 10
#: the largest ring a primary shares with one backup; an entry larger than it travels
#: beside its message
RING_MAX_BYTES = 512 << 20
#: the ring holds this many entries of the size that made it
RING_ENTRIES = 3
#: times a primary offers a ring to one backup before it stops trying
RING_ATTEMPTS = 3


class RingLink:
    """The primary's ring with one backup (none until the backup took one)."""

    def __init__(self, slot: int, backup: int, link: Requester, term: int) -> None:
        self.slot = slot
        self.backup = backup
        self.link = link
        self.term = term
        self.region: Region | None = None
        self.space = RingSpace(0)
        self.attempts = 0
        #: why entries travel beside their message, once the ring is given up
        self.off: str | None = None
        self._attaching: asyncio.Task[None] | None = None
        #: entries sent in the ring and not answered yet
        self.inflight = 0
        #: entries sent in the ring, and bytes
        self.sent = 0
        self.sent_bytes = 0

    def place(self, index: int, tensors: Sequence[Tensor]) -> tuple[str, list[list[Any]]] | None:
        """Write entry ``index``'s tensors into the ring: the ring's name and their specs
        (``ring_name``, ``ring``), or None (send them beside the message)."""
        nbytes = sum(aligned(t.array.nbytes) for t in tensors)
        if self.off is not None or not tensors or nbytes < RING_MIN_BYTES:
            return None
        region = self.region
        if region is None or (nbytes > self.space.size and not self.inflight):
            self._offer(nbytes)  # none yet, or one too small and idle: a larger one
            return None
        if self._attaching is not None:  # a larger one is offered: nothing in this one
            return None
        at = self.space.alloc(index, nbytes)
        if at is None:
            return None
        specs: list[list[Any]] = []
        for t in tensors:
            arr = t.array
            spec = tensor_spec(t)
            dst = region.view(at, np.dtype(np.uint8), arr.nbytes)
            np.copyto(dst, arr.reshape(-1).view(np.uint8))
            specs.append([*spec, at])
            at += aligned(arr.nbytes)
        self.sent += 1
        self.sent_bytes += nbytes
        self.inflight += 1
        return region.name, specs

    def answered_by(self, name: str) -> Callable[[asyncio.Future[Any]], None]:
        """What to call when the answer to an entry sent in ring ``name`` comes (or
        fails): one entry fewer out in it, and a refusal for the ring (``not_found``:
        none of that name there, a new process) drops it, a ring being offered again
        (within the attempts) while the entry goes again beside its message."""

        def done(answer: asyncio.Future[Any]) -> None:
            self.inflight = max(0, self.inflight - 1)
            exc = None if answer.cancelled() else answer.exception()
            if isinstance(exc, NotFound) and self.region is not None and self.region.name == name:
                log.info(
                    "ps %d's state: its ring to ps %d refused (%s)", self.slot, self.backup, exc
                )
                self._drop()

        return done

    def release(self, upto: int) -> None:
        """The backup applied the entries up to ``upto`` and keeps none of them."""
        self.space.free_through(upto)

    def _offer(self, nbytes: int) -> None:
        if self._attaching is not None:
            return
        if self.attempts >= RING_ATTEMPTS:
            self.off = f"not taken after {self.attempts} offers"
            return
        size = min(RING_MAX_BYTES, RING_ENTRIES * nbytes)
        if nbytes > size or (self.region is not None and size <= self.space.size):
            return  # larger than any ring: beside, as it comes
        self.attempts += 1
        self._attaching = asyncio.ensure_future(self._attach(size))

    async def _attach(self, size: int) -> None:
        try:
            region = create_region(size)
        except OSError as exc:
            self.off = f"no shared memory ({exc.strerror or exc})"
            log.info("ps %d's state: no ring to ps %d: %s", self.slot, self.backup, self.off)
            self._attaching = None
            return
        try:
            body = o.ReplicaRing(self.term, region.name, region.size).to_wire()
            got = o.RingAttached.parse(
                (await self.link.request("replica_ring", body, timeout=10.0)).body
            )
            if got.token != region.token.hex():
                raise ZmqpsError("the backup sees another region under that name")
        except (ZmqpsError, asyncio.TimeoutError) as exc:
            log.info("ps %d's state: no ring to ps %d: %s", self.slot, self.backup, exc)
            if self.attempts >= RING_ATTEMPTS:
                self.off = str(exc)[:200]
            region.close()
            return
        finally:
            unlink_region(region)  # both mappings stay; nothing is left if either dies
            self._attaching = None
        self._drop()
        self.region = region
        self.space = RingSpace(region.data_bytes)
        log.info(
            "ps %d's state: its entries to ps %d go through a ring of %.1f MiB of shared memory",
            self.slot,
            self.backup,
            region.size / 2**20,
        )

    def _drop(self) -> None:
        if self.region is not None:
            self.region.close()
        self.region = None
        self.space = RingSpace(0)
        self.inflight = 0

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bytes": 0 if self.region is None else self.region.size}
        out.update(entries=self.sent, sent_bytes=self.sent_bytes)
        if self.off is not None:
            out["off"] = self.off
        return out

    async def close(self) -> None:
        task = self._attaching
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        self._drop()
