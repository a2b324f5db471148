"""The same-host fast path on a PS: the shared-memory regions workers attached.

Rules of this module:

* A region is mapped only after :func:`~zmqps.transport.shm.attach_region` checked
  its name, owner and size; a worker keeps at most :data:`MAX_PER_WORKER` (its
  oldest is dropped when it attaches another: a restarted worker attaches afresh).
* At most :data:`MAX_REGIONS` in all: at the bound a worker's new region replaces its
  oldest, and a worker with none is refused (it uses TCP).
* Attaching is idempotent: the same worker attaching the same name again (a request
  sent again after its connection came back) gets the region it has.
* :meth:`Regions.views` validates a request's offsets whole (attached region, in
  bounds, aligned, no two shards overlapping) before anything is read or written;
  a push reads only a region its own worker attached (an id sent by another worker,
  or kept from another PS process, may be someone else's region here).
* :meth:`Regions.rows` does the same for the rows of a row request: one span per
  shard, of the size the request's ids give it (never one the wire names), in bounds,
  aligned and not overlapping, all checked before anything is read or written.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from zmqps.core.packs import units
from zmqps.core.store import ShardStore
from zmqps.transport.shm import Region, attach_region
from zmqps.wire.errors import InvalidArgument, NotFound
from zmqps.wire.ops import ShmRef

__all__ = ["MAX_PER_WORKER", "MAX_REGIONS", "Regions"]

MAX_PER_WORKER = 4
_FLOAT32 = np.dtype(np.float32)
#: regions one PS maps in all: one more is refused (the worker uses TCP), so clients
#: inventing worker names cannot map memory without bound
MAX_REGIONS = 4096


class Regions:
    """Regions attached on one PS: id -> (worker, region)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._regions: dict[int, tuple[str, Region]] = {}  # id -> (worker, region)
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._regions)

    def __contains__(self, rid: object) -> bool:
        return rid in self._regions

    def attach(self, name: str, size: int, worker: str) -> tuple[int, Region]:
        for rid, (w, known) in self._regions.items():  # at most MAX_PER_WORKER each
            if w == worker and known.name == name and known.size == size:
                return rid, known
        mine = sorted(rid for rid, (w, _) in self._regions.items() if w == worker)
        drop = max(0, len(mine) - MAX_PER_WORKER + 1)
        if len(self._regions) - drop >= MAX_REGIONS:  # at the bound: replace, or refuse
            if not mine:
                raise InvalidArgument(
                    f"{len(self._regions)} shared-memory regions are attached on this PS"
                    " (the bound): use TCP"
                )
            drop = max(drop, 1)
        region = attach_region(name, size, max_bytes=self.max_bytes)
        for rid in mine[:drop]:
            self.detach(rid)  # the oldest of this worker's regions
        rid = next(self._ids)
        self._regions[rid] = (worker, region)
        return rid, region

    def detach(self, rid: int, name: str | None = None) -> None:
        """Unmap region ``rid`` (only if it is the region ``name``, when given: an id
        a worker kept from an earlier PS process may be another region now)."""
        entry = self._regions.get(rid)
        if entry is None or (name is not None and entry[1].name != name):
            return
        del self._regions[rid]
        entry[1].close()

    def close(self) -> None:
        for rid in list(self._regions):
            self.detach(rid)

    def views(
        self,
        store: ShardStore,
        sids: Sequence[int],
        ref: ShmRef,
        worker: str | None = None,
        packs: Sequence[int] = (),
    ) -> list[np.ndarray[Any, Any]]:
        """The places in a region of the message's units (flat, the wire dtype), validated
        whole; ``worker``: the region must be one it attached. A unit is a pack (``packs``:
        the shards in each leading pack, one offset and one float32 span for all of them)
        or a shard on its own."""
        region = self._attached(ref, worker)
        spans_of, rest = units(sids, packs)
        if len(ref.offsets) != len(spans_of) + len(rest):
            raise InvalidArgument("shm: one offset per pack and per shard expected")
        views = []
        offsets = iter(ref.offsets)
        for span in spans_of:
            pack = store.pack_of(span)
            size = 0 if pack is None else pack.size
            for sid in span if pack is None else ():  # not a pack here: shard by shard
                d = store.get_dense(sid).definition
                if d.wire_dtype != np.float32:
                    raise InvalidArgument(f"shm: shard {sid} is {d.wire_dtype}, not packed")
                size += d.size
            views.append(region.view(next(offsets), _FLOAT32, size))
        for sid in rest:
            shard = store.get_dense(sid)
            views.append(region.view(next(offsets), shard.definition.wire_dtype, shard.values.size))
        _apart(ref.offsets, views, "shards")
        return views

    def rows(
        self,
        ref: ShmRef,
        spans: Sequence[tuple[np.dtype[Any], tuple[int, ...]]],
        worker: str | None = None,
    ) -> list[np.ndarray[Any, Any]]:
        """The places in a region of a row request's rows, one per shard (``spans``: the
        dtype and the shape of each shard's rows, from the ids the request carries),
        validated whole; ``worker``: the region must be one it attached."""
        region = self._attached(ref, worker)
        if len(ref.offsets) != len(spans):
            raise InvalidArgument("shm: one offset per shard's rows expected")
        views = [
            region.view(off, dtype, math.prod(shape)).reshape(shape)
            for off, (dtype, shape) in zip(ref.offsets, spans, strict=True)
        ]
        _apart(ref.offsets, views, "rows")
        return views

    def _attached(self, ref: ShmRef, worker: str | None) -> Any:
        """The region ``ref`` names, attached here (by ``worker``, when given)."""
        entry = self._regions.get(ref.region)
        if entry is None or (worker is not None and entry[0] != worker):
            raise NotFound(f"shm region {ref.region} is not attached")
        return entry[1]


def _apart(offsets: Sequence[int], views: Sequence[np.ndarray[Any, Any]], what: str) -> None:
    """No two places of one message overlap in its region."""
    places = sorted((off, off + view.nbytes) for off, view in zip(offsets, views, strict=True))
    for (_, end), (start, _) in itertools.pairwise(places):
        if start < end:
            raise InvalidArgument(f"shm: {what} overlap in the region")
