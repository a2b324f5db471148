"""A whole copy of a PS state, in parts: how a new backup gets its copy (re-replication).

Rules of this module:

* :func:`take` copies everything a request may change in one event-loop turn (so
  the copy is the state as of one entry of the primary's log): every shard's values,
  optimizer slots and version; every hash-table shard as it is (rows, free list,
  index layout, admission counts: the twin evicts the same rows on a tie); the dedup
  window, the push and closure ledgers, the sync accumulators, the generation and
  what the chief last told it. Nothing here is pickled: parts are msgpack bodies
  and raw tensors.
* The copy travels as ``install`` requests of at most ``part_bytes`` of tensors each
  (large arrays in chunks, by element offset), so that a copy can be sent at a
  throttled pace and no message is huge. The first part carries the shard
  definitions, the last the ledgers.
* :class:`Installing` (the backup's side) stages the parts and changes the copy
  only once the last one came and everything checked (all or nothing): a copy cut
  off halfway leaves the old state as it was. What it stages is bounded by the
  shapes the parts announce, checked against the machine's memory before any
  allocation; a part 0 starts over.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.core.hashshard import HashShard
from zmqps.core.store import ShardStore
from zmqps.core.variables import ShardDef
from zmqps.process import available_memory
from zmqps.wire import Tensor
from zmqps.wire.codec import DTYPES, wire_dtype
from zmqps.wire.errors import InvalidArgument

__all__ = ["PART_BYTES", "Installing", "Part", "take"]

Array = npt.NDArray[Any]

#: tensor bytes of one ``install`` part
PART_BYTES = 4 << 20


@dataclass
class Part:
    """One ``install`` request's body fields (but term and index) and tensors."""

    index: int
    items: list[list[Any]] = field(default_factory=list)  # [shard, what, offset, dtype, shape]
    tensors: list[Tensor] = field(default_factory=list)
    defs: list[dict[str, Any]] | None = None
    meta: dict[str, Any] | None = None
    state: dict[str, Any] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.array.nbytes for t in self.tensors)


def take(service: Any, part_bytes: int | None = None) -> list[Part]:
    """The whole state of ``service`` (a :class:`~zmqps.roles.ps.service.PSService`)
    now, in parts. Runs in one event-loop turn (it copies)."""
    store: ShardStore = service.store
    versions: dict[str, int] = {}
    tables: dict[str, Any] = {}
    arrays: list[tuple[int, str, Array]] = []  # every array of the state, copied
    for sh in store:
        sid = sh.definition.id
        if isinstance(sh, HashShard):
            tables[str(sid)], raw = sh.raw()
            arrays += [(sid, f"table:{name}", arr) for name, arr in raw.items()]
        else:
            versions[str(sid)] = sh.version
            arrays.append((sid, "values", sh.values.copy()))
            arrays += [(sid, f"slot:{name}", arr.copy()) for name, arr in sh.slots.items()]
    sync = getattr(service.mode, "shards", None)
    sync_meta = None
    if sync is not None:
        sync_meta, acc = sync.image()
        arrays += [(sid, f"acc:{name}", arr) for (sid, name), arr in acc.items()]
    state = {
        "gen": service.gen,
        "restored_step": service.restored_step,
        "rewinds": service.rewinds,
        "placement": service.placement,
        "duplicates": service.duplicates,
        "fenced": service.fenced,
        "dropped": dict(service.dropped),
        "dedup": service.dedup.snapshot(),
        "pushes": service.pushes.image(),
        "closures": service.closures.image(),
        "mode": service.mode.name,
        "sync": sync_meta,
    }
    parts = [Part(0, defs=[sh.definition.to_wire() for sh in store])]
    parts[0].meta = {"versions": versions, "tables": tables}
    step = max(1, PART_BYTES if part_bytes is None else part_bytes)
    filled = 0  # tensor bytes of the last part
    for sid, what, arr in arrays:
        flat = arr.reshape(-1)
        per = max(1, step // max(1, flat.itemsize))
        for off in range(0, max(flat.size, 1), per):
            chunk = flat[off : off + per]
            if parts[-1].tensors and filled + chunk.nbytes > step:
                parts.append(Part(len(parts)))
                filled = 0
            parts[-1].items.append([sid, what, off, wire_dtype(arr.dtype), list(arr.shape)])
            parts[-1].tensors.append(Tensor(chunk, "value", sid, off))
            filled += chunk.nbytes
    parts[-1].state = state
    return parts


class Installing:
    """The backup's side of one copy on its way: parts staged until the last."""

    def __init__(
        self,
        term: int,
        index: int,
        defs: Sequence[Mapping[str, Any]],
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.term, self.index = term, index
        try:
            self.defs = {d.id: d for d in (ShardDef.from_wire(w) for w in defs)}
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"install: a malformed shard definition ({exc})") from None
        #: the first part's shard versions and table counters
        self.meta: Mapping[str, Any] = meta or {}
        self.arrays: dict[tuple[int, str], Array] = {}
        #: bytes staged so far (checked against the machine's memory)
        self.staged = 0
        self.next = 0

    def add(self, part: int, items: Sequence[Any], tensors: Sequence[Tensor]) -> None:
        """Stage part ``part`` (in order; the same one again is ignored)."""
        if part < self.next:
            return
        if part != self.next:
            raise InvalidArgument(f"install: part {part} after part {self.next - 1}")
        if len(items) != len(tensors):
            raise InvalidArgument("install: one item per tensor")
        for item, t in zip(items, tensors, strict=True):
            self._chunk(item, t.array)
        self.next += 1

    def _chunk(self, item: Any, chunk: Array) -> None:
        try:
            sid, what, off, dtype_name, shape = item
            sid, off, shape = int(sid), int(off), tuple(int(n) for n in shape)
            dtype = DTYPES[dtype_name]
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"install: a malformed item ({exc})") from None
        if sid not in self.defs or not isinstance(what, str) or min(shape, default=0) < 0:
            raise InvalidArgument(f"install: shard {sid} is not in the copy")
        key = (sid, what)
        arr = self.arrays.get(key)
        if arr is None:
            need = math.prod(shape) * dtype.itemsize
            memory = available_memory()
            if memory is not None and self.staged + need > memory[0]:
                raise InvalidArgument(
                    f"install: the copy needs more than {self.staged + need:,} bytes;"
                    f" {memory[0]:,} available"
                )
            arr = self.arrays[key] = np.empty(shape, dtype)
            self.staged += need
        flat = arr.reshape(-1)
        if chunk.dtype != dtype or chunk.ndim != 1 or not 0 <= off <= flat.size - chunk.size:
            raise InvalidArgument(f"install: shard {sid}'s {what}: a chunk out of place")
        flat[off : off + chunk.size] = chunk

    def _named(self, sid: int, prefix: str) -> dict[str, Array]:
        """Shard ``sid``'s staged arrays whose name starts with ``prefix`` (without it)."""
        n = len(prefix)
        return {w[n:]: a for (s, w), a in self.arrays.items() if s == sid and w.startswith(prefix)}

    def finish(self, service: Any, state: Mapping[str, Any]) -> None:
        """Make ``service`` the copy (all or nothing)."""
        from zmqps.roles.ps.modes import make_mode

        store = ShardStore(service.store.chunk_elems, service.store.observer, service.store.memory)
        versions = self.meta.get("versions") or {}
        tables = self.meta.get("tables") or {}
        try:
            dense = [
                (
                    d,
                    self.arrays[(sid, "values")],
                    self._named(sid, "slot:"),
                    int(versions[str(sid)]),
                )
                for sid, d in self.defs.items()
                if d.table is None
            ]
            store.replace(dense)
            made = [*store]
            for sid, d in self.defs.items():
                if d.table is not None:
                    shard = HashShard.make(d)
                    shard.load_raw(tables[str(sid)], self._named(sid, "table:"))
                    made.append(shard)
            mode = make_mode(str(state["mode"]), store, 1, int(state["restored_step"]))
            if state.get("sync") is not None:
                acc = {(s, w[4:]): a for (s, w), a in self.arrays.items() if w.startswith("acc:")}
                mode.shards.load_image(state["sync"], acc)  # type: ignore[attr-defined]
            dedup = type(service.dedup)(
                service.dedup.window, service.dedup.max_workers, service.dedup.max_chars
            )
            dedup.restore(state["dedup"])
            pushes = type(service.pushes)()
            pushes.load_image(state["pushes"])
            closures = type(service.closures)(service.closures.capacity)
            closures.load_image(state["closures"])
            rewinds = state.get("rewinds")
            if rewinds is not None:
                rewinds = {str(k): int(v) for k, v in rewinds.items()}
            gen, restored_step = int(state["gen"]), int(state["restored_step"])
            duplicates, fenced = int(state["duplicates"]), int(state["fenced"])
            dropped = {str(k): int(v) for k, v in state["dropped"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidArgument(f"install: the copy is incomplete or malformed ({exc})") from None
        # everything checked: the copy takes the state's place
        service.store.install(made)
        mode.store = service.store
        if hasattr(mode, "shards"):
            mode.shards.store = service.store
        service.mode = mode
        service.dedup, service.pushes, service.closures = dedup, pushes, closures
        service.gen, service.restored_step, service.rewinds = gen, restored_step, rewinds
        service.duplicates, service.fenced = duplicates, fenced
        service.dropped.clear()
        service.dropped.update(dropped)
        service.placement = state.get("placement")
        service.waiters.notify()
