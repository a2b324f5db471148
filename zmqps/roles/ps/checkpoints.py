"""A PS's side of checkpoints: snapshot its shards, write them, restore them.

Rules of this module:

* ``checkpoint_save`` copies every shard (values, slots, version) in one event-loop
  turn (one consistent state of the PS), replies, and writes the copies into the
  checkpoint directory in a thread; ``checkpoint_done`` long-polls for that write.
  A few outcomes are kept for retried ``checkpoint_done`` requests.
* Paths come from the chief as checkpoint directory *names* inside this PS's own
  checkpoint root, never as paths.
* A restore reads each new shard's rows from the checkpoint, resharded as the shard
  definitions say (any number of PS), off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zmqps.core.store import ShardStore
from zmqps.core.variables import ShardDef
from zmqps.transport.base import waited
from zmqps.wire.errors import Busy, InvalidArgument, NotFound, NotReady, ZmqpsError

__all__ = ["ShardCheckpoints"]

log = logging.getLogger("zmqps.ps")

#: ``checkpoint_save`` outcomes kept for retried ``checkpoint_done`` requests.
KEEP_SAVES = 8
#: snapshots being written at once: each holds a copy of every shard, so one more
#: save is refused (``busy``, nothing copied) until a write ends
MAX_WRITING = 2


class ShardCheckpoints:
    def __init__(self, index: int, store: ShardStore, root: str | Path | None) -> None:
        self.index = index
        self.store = store
        self.root = None if root is None else Path(root)
        self._saves: dict[int, asyncio.Future[list[dict[str, Any]]]] = {}
        #: the versions each kept save snapshotted: a save asked again (a request sent
        #: again after a partition healed) is answered from here, not snapshotted twice
        self._versions: dict[int, tuple[str, list[list[int]], dict[str, int]]] = {}
        #: the writes not finished (kept or not): their snapshots are in memory
        self._writing: set[asyncio.Future[list[dict[str, Any]]]] = set()

    def path(self, name: str) -> Path:
        from zmqps.checkpoint import is_valid_name

        if self.root is None:
            raise InvalidArgument(f"ps {self.index} runs without --checkpoint-dir")
        if not is_valid_name(name):
            raise InvalidArgument(f"not a checkpoint directory name: {name!r}")
        path = self.root / name
        if not path.is_dir():
            raise NotFound(f"ps {self.index}: no checkpoint directory {path}")
        return path

    def save(
        self, name: str, save_id: int, cursors: dict[str, int]
    ) -> tuple[list[list[int]], dict[str, int], float]:
        """Snapshot every shard now and start writing it; ``(versions, cursors,
        seconds)``, ``cursors`` being the batch cursors the values hold now (the
        caller's). The same save (id and directory) again, a resent request, answers
        the first one's; an id used again for another directory is a new save."""
        first = self._versions.get(save_id)
        if first is not None and first[0] == name:
            return first[1], first[2], 0.0
        from zmqps.checkpoint import write_shard
        from zmqps.checkpoint.tables import write_table_shard

        path = self.path(name)
        from zmqps.checkpoint import MANIFEST
        from zmqps.checkpoint.root import is_temp_name

        if not is_temp_name(name) or (path / MANIFEST).exists():
            # the chief saves into a checkpoint being written, then commits it: a save
            # into a committed one (a stray or hostile request) would overwrite the
            # files its digests cover
            raise InvalidArgument(
                f"ps {self.index}: checkpoint_save writes only into a checkpoint being"
                f" written (.tmp-ckpt-...), never into a committed one ({name})"
            )
        if len(self._writing) >= MAX_WRITING:
            raise Busy(
                f"ps {self.index}: {len(self._writing)} checkpoints still being written;"
                " nothing was copied"
            )
        started = time.perf_counter()
        snap = [
            (
                sh.definition,
                sh.values.copy(),
                {k: v.copy() for k, v in sh.slots.items()},
                sh.version,
            )
            for sh in self.store
            if not sh.is_table
        ]
        tables = [(t.definition, t.state(), t.version) for t in self.store.tables()]
        copied = time.perf_counter() - started

        def write() -> list[dict[str, Any]]:
            out = [write_shard(path, d, v, sl, ver).to_json() for d, v, sl, ver in snap]
            for d, (ids, v, sl, touched), ver in tables:
                out.append(write_table_shard(path, d, ids, v, sl, touched, ver).to_json())
            return out

        for old in sorted(self._saves)[: max(0, len(self._saves) - KEEP_SAVES + 1)]:
            self._saves.pop(old)
            self._versions.pop(old, None)
        fut = self._saves[save_id] = asyncio.ensure_future(asyncio.to_thread(write))
        self._writing.add(fut)
        fut.add_done_callback(self._written)
        versions = [[d.id, ver] for d, _, _, ver in snap] + [[d.id, ver] for d, _, ver in tables]
        self._versions[save_id] = (name, versions, cursors)
        return versions, cursors, copied

    def _written(self, fut: asyncio.Future[list[dict[str, Any]]]) -> None:
        """A write that failed is said in one line here (the chief hears of it through
        ``checkpoint_done``, or gave that checkpoint up already: e.g. another PS could
        not take part and the chief removed the directory)."""
        self._writing.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("ps %d: writing a checkpoint failed: %s", self.index, fut.exception())

    async def done(self, save_id: int, wait: float) -> list[dict[str, Any]]:
        """The records of save ``save_id`` once written (NotReady while writing)."""
        fut = self._saves.get(save_id)
        if fut is None:
            raise NotFound(f"ps {self.index}: no checkpoint save {save_id}")
        if not fut.done() and wait > 0:
            await waited(asyncio.shield(fut), wait)
        if not fut.done():
            raise NotReady(f"ps {self.index}: checkpoint save {save_id} still writing")
        try:
            return fut.result()
        except ZmqpsError:
            raise
        except OSError as e:
            raise InvalidArgument(f"ps {self.index}: writing the checkpoint failed: {e}") from e

    async def restore(self, name: str | None, defs: Sequence[ShardDef]) -> None:
        """Replace every shard by its state in checkpoint ``name`` (resharded as ``defs``
        say), or by its initial values (``name`` None)."""
        if name is None:
            self.store.clear()
            self.store.create(defs)
            return
        from zmqps.checkpoint import Checkpoint
        from zmqps.checkpoint.tables import read_table

        ckpt = Checkpoint.load(self.path(name))

        def load() -> tuple[list[Any], list[Any]]:
            dense, tables = [], []
            for d in defs:
                if d.table is None:
                    values, slots, version = ckpt.read_rows(d.var, d.row_start, d.rows)
                    dense.append((d, values.reshape(d.shape), slots, version))
                else:
                    tables.append((d, *read_table(ckpt, d.var, d.row_start, d.rows)))
            return dense, tables

        dense, tables = await asyncio.to_thread(load)
        self.store.replace(dense, tables)
