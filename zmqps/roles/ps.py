"""The parameter-server role: serves shards from a :class:`ShardStore` over the transport.

Rules of this module:

* :class:`PSService` maps requests to the store and the push deduplicator; it
  does no IO itself, so tests drive it through the in-memory transport.
* A push is validated whole (every shard of the message) before anything is
  applied: a bad push changes nothing; a good one is applied completely.
* A duplicate push (same worker, incarnation and sequence) is acknowledged with
  ``applied: false`` and not applied again; an older incarnation is fenced.
* A pull reply is a consistent snapshot of each shard at one version. Over TCP
  the live values are lent to the transport without a copy; an update that comes
  while a send still holds them copies them first (copy-on-write,
  :meth:`Shard.own`), so the frames in flight never change.
* Same-host fast path: a worker may attach shared-memory regions; then a pull
  writes each snapshot straight into the worker's region and a push applies the
  gradient straight from it. Offsets are checked against the region (in bounds,
  aligned, no two shards overlapping) before anything is read or written.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq.asyncio

from zmqps.core.dedup import PushDeduper
from zmqps.core.store import ShardStore
from zmqps.core.sync import MODES, SyncShards
from zmqps.core.variables import ShardDef
from zmqps.metrics import Metrics
from zmqps.roles._run import run_server, start_exporter
from zmqps.transport import Server, SocketOptions
from zmqps.transport.shm import Region, attach_region
from zmqps.wire import Message, Tensor, reply
from zmqps.wire.errors import (
    FencedError,
    InvalidArgument,
    NotFound,
    NotReady,
    ProtocolError,
    RolledBack,
    ZmqpsError,
)

__all__ = ["PSConfig", "PSService", "run_ps"]

log = logging.getLogger("zmqps.ps")


@dataclass(frozen=True)
class PSConfig:
    index: int
    bind: str
    chunk_bytes: int = 4 << 20
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no exporter; 0: a free port
    checkpoint_dir: str | None = None  # the shared checkpoint root this PS writes shards to
    stop_grace: float = 8.0  # SIGTERM: seconds to serve on for the chief's final checkpoint


_PUSH_OPS = frozenset({"push", "push_pull", "push_rows"})
_DATA_OPS = _PUSH_OPS | {"pull", "pull_rows", "table_rows"}


class PSService:
    """Request handler of one PS task."""

    MAX_REGIONS_PER_WORKER = 4

    def __init__(
        self,
        index: int,
        store: ShardStore | None = None,
        chunk_bytes: int = 4 << 20,
        max_region_bytes: int = 16 << 30,
        metrics: Metrics | None = None,
        checkpoint_dir: str | Path | None = None,
    ):
        self.index = index
        #: a new value every process start: the chief tells a restarted PS by it
        self.boot = secrets.token_hex(8)
        #: the cluster's generation (restores so far); requests of another one are refused
        self.gen = 0
        self.placement: dict[str, Any] | None = None  # as the chief sent it (wire form)
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self._saves: dict[int, asyncio.Future[list[dict[str, Any]]]] = {}
        self.restored_step = 0  # the step of the last restore (sync shards start there)
        self.store = store or ShardStore()
        self.metrics = metrics
        if metrics is not None:
            metrics.set_info("ps", index)
            previous = self.store.observer

            def observe(shard: ShardDef, staleness: int) -> None:
                metrics.applied(shard.var, staleness)
                if previous is not None:
                    previous(shard, staleness)

            self.store.observer = observe
            metrics.watch(metrics.shard_bytes, self.store.nbytes)
            metrics.watch_tables(self.store.table_stats)
        self.dedup = PushDeduper()
        self.chunk_elems_bytes = chunk_bytes
        self.duplicates = 0
        self.fenced = 0
        #: pushes answered ``applied``, by "worker/incarnation/generation" (fault tests)
        self.applied_pushes: dict[str, int] = defaultdict(int)
        self.sync: SyncShards | None = None
        self._step_waiters: list[tuple[int, asyncio.Future[int]]] = []
        self.regions: dict[int, tuple[str, Region]] = {}  # id -> (worker, region)
        self._next_region = 1
        self.max_region_bytes = max_region_bytes
        self.shutdown_requested = asyncio.Event()

    # The transport calls this for every decoded request.
    def __call__(self, msg: Message) -> Message:
        handler = getattr(self, f"_op_{msg.op}", None)
        if handler is None:
            raise ProtocolError(f"a PS does not serve {msg.op!r}")
        if msg.op in _DATA_OPS:
            self._check_generation(msg)
        if self.metrics is None or msg.op not in _PUSH_OPS:
            result: Message = handler(msg)
            return result
        try:
            result = handler(msg)
        except (InvalidArgument, NotFound):
            self.metrics.drop("invalid")
            raise
        return result

    def _check_generation(self, msg: Message) -> None:
        """Data requests of another generation (made before a restore) are refused, and
        so is every data request to a PS that holds no shards (restarted, not restored)."""
        gen = msg.body.get("gen")
        if gen is not None and gen != self.gen:
            if msg.op in _PUSH_OPS:
                self._drop("rolled_back")
            raise RolledBack(
                f"ps {self.index} is at generation {self.gen}; the request is of generation"
                f" {gen}: pull again"
            )
        if not len(self.store):
            raise NotReady(f"ps {self.index} holds no shards (restarted and not restored yet?)")

    def _drop(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.drop(reason)

    def _op_ping(self, msg: Message) -> Message:
        return reply(msg, {"role": "ps", "index": self.index})

    def _op_create_shards(self, msg: Message) -> Message:
        defs = [ShardDef.from_wire(d) for d in msg.body["shards"]]
        self.store.create(defs)
        if "placement" in msg.body:
            self.placement = msg.body["placement"]
        log.info("ps %d: %d shards ready (%d bytes)", self.index, len(defs), self.store.nbytes())
        return reply(msg, {"shards": [d.id for d in defs]})

    def _snapshot_tensors(self, sids: Sequence[int]) -> tuple[list[int], list[Tensor]]:
        versions: list[int] = []
        tensors: list[Tensor] = []
        for sid in sids:
            shard = self.store.get(sid)
            flat = shard.lend()  # zero-copy; the next update of this shard copies first
            version = shard.version
            step = max(1, self.chunk_elems_bytes // flat.itemsize)
            versions.append(version)
            tensors.extend(
                Tensor(flat[off : off + step], "value", sid, off)
                for off in range(0, max(flat.size, 1), step)
            )
        return versions, tensors

    def _op_pull(self, msg: Message) -> Message:
        sids = msg.body["shards"]
        for sid in sids:
            self.store.get(sid)  # NotFound before any work
        if "shm_out" in msg.body:
            return reply(msg, {"versions": self._snapshot_to_region(sids, msg.body["shm_out"])})
        versions, tensors = self._snapshot_tensors(sids)
        return reply(msg, {"versions": versions}, tensors)

    # -- same-host fast path ---------------------------------------------------

    def _op_shm_attach(self, msg: Message) -> Message:
        b = msg.body
        region = attach_region(b["name"], b["size"], max_bytes=self.max_region_bytes)
        worker = b["worker"]
        mine = sorted(rid for rid, (w, _) in self.regions.items() if w == worker)
        for rid in mine[: max(0, len(mine) - self.MAX_REGIONS_PER_WORKER + 1)]:
            self.regions.pop(rid)[1].close()  # the oldest of this worker's regions
        rid = self._next_region
        self._next_region += 1
        self.regions[rid] = (worker, region)
        log.info("ps %d: %s attached shared memory (%d bytes)", self.index, worker, region.size)
        return reply(msg, {"region": rid, "token": region.token.hex()})

    def _op_shm_detach(self, msg: Message) -> Message:
        entry = self.regions.pop(msg.body["region"], None)
        if entry is not None:
            entry[1].close()
        return reply(msg)

    def _region_views(self, sids: Sequence[int], ref: Any) -> list[np.ndarray[Any, Any]]:
        """The shards' places in a region, validated whole before any use."""
        entry = self.regions.get(ref["region"])
        if entry is None:
            raise NotFound(f"shm region {ref['region']} is not attached")
        offsets = ref["offsets"]
        if len(offsets) != len(sids):
            raise InvalidArgument("shm: one offset per shard expected")
        region = entry[1]
        views = []
        spans = []
        for sid, off in zip(sids, offsets, strict=True):
            shard = self.store.get(sid)
            view = region.view(off, shard.values.dtype, shard.values.size)
            views.append(view)
            spans.append((off, off + view.nbytes))
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                raise InvalidArgument("shm: shards overlap in the region")
        return views

    def _snapshot_to_region(self, sids: Sequence[int], ref: Any) -> list[int]:
        views = self._region_views(sids, ref)
        return [
            self.store.snapshot_into(sid, view.reshape(self.store.get(sid).values.shape))
            for sid, view in zip(sids, views, strict=True)
        ]

    def _grad_chunks(self, msg: Message, kinds: tuple[str, ...]) -> dict[int, list[Tensor]]:
        sids = msg.body["shards"]
        if len(set(sids)) != len(sids):
            raise InvalidArgument("a shard appears twice in one push")
        if len(msg.body["versions"]) != len(sids):
            raise InvalidArgument("push: one version per shard expected")
        by_shard: dict[int, list[Tensor]] = defaultdict(list)
        for t in msg.tensors:
            if t.kind not in kinds:
                raise InvalidArgument(f"push: unexpected tensor kind {t.kind!r}")
            if t.ref not in sids:
                raise InvalidArgument(f"push: tensor for shard {t.ref} not named in the body")
            by_shard[t.ref].append(t)
        for sid in sids:
            if sid not in self.store:
                raise NotFound(f"shard {sid} is not on ps {self.index}")
            if sid not in by_shard:
                raise InvalidArgument(f"push: no gradient for shard {sid}")
        return by_shard

    def _is_new(self, msg: Message) -> bool:
        body = msg.body
        try:
            new = self.dedup.check(body["worker"], body["inc"], body["seq"])
        except FencedError:
            self.fenced += 1
            self._drop("fenced")
            raise
        if not new:
            self.duplicates += 1
            self._drop("duplicate")
            log.debug(
                "ps %d: duplicate push %s/%s/%s",
                self.index,
                body["worker"],
                body["inc"],
                body["seq"],
            )
        return new

    def _op_push(self, msg: Message, pull: bool = False) -> Message:
        sids, pulled = msg.body["shards"], msg.body["versions"]
        if "shm" in msg.body:
            if msg.tensors or len(set(sids)) != len(sids) or len(pulled) != len(sids):
                raise InvalidArgument("push: shm pushes name each shard once, with no tensors")
            views = self._region_views(sids, msg.body["shm"])
            chunks = {sid: [(0, view)] for sid, view in zip(sids, views, strict=True)}
        else:
            by_shard = self._grad_chunks(msg, ("grad",))
            chunks = {sid: [(t.offset, t.array.reshape(-1)) for t in by_shard[sid]] for sid in sids}
        if pull and "shm_out" in msg.body:
            self._region_views(sids, msg.body["shm_out"])  # validate before applying
        for sid, ver in zip(sids, pulled, strict=True):
            self.store.check_dense(sid, chunks[sid], ver)
        body_out = self._commit_push(
            msg,
            lambda sid, ver: self.store.apply_dense(sid, chunks[sid], ver)[1],
            lambda sid: (
                self.sync is not None and self.sync.add_dense(sid, chunks[sid], msg.body["worker"])
            ),
        )
        if pull and "shm_out" in msg.body and not body_out.get("duplicate"):
            body_out["versions"] = self._snapshot_to_region(sids, msg.body["shm_out"])
            return reply(msg, body_out)
        if pull:
            # TCP, or a resent shared-memory push_pull: the worker may already have the
            # first reply and be computing on the region, so the values travel in the
            # reply instead (a worker still waiting copies them in; else it is dropped)
            body_out["versions"], tensors = self._snapshot_tensors(sids)
            return reply(msg, body_out, tensors)
        body_out["versions"] = [self.store.get(sid).version for sid in sids]
        return reply(msg, body_out)

    def _op_push_pull(self, msg: Message) -> Message:
        return self._op_push(msg, pull=True)

    def _op_pull_rows(self, msg: Message) -> Message:
        sids = msg.body["shards"]
        if len(msg.tensors) != len(sids):
            raise InvalidArgument("pull_rows: one index tensor per shard expected")
        versions, tensors = [], []
        for sid, t in zip(sids, msg.tensors, strict=True):
            if t.kind != "index" or t.ref != sid:
                raise InvalidArgument(f"pull_rows: expected the index tensor of shard {sid}")
        create = msg.body.get("create", True)  # False: read-only (evaluation, serving)
        for sid, t in zip(sids, msg.tensors, strict=True):
            version, rows = self.store.pull_rows(sid, t.array, create)
            versions.append(version)
            tensors.append(Tensor(rows, "rows", sid))
            if self.metrics is not None:
                self.metrics.rows(self.store.get(sid).definition.var, "pull", rows.shape[0])
        return reply(msg, {"versions": versions}, tensors)

    def _op_table_rows(self, msg: Message) -> Message:
        b = msg.body
        version, ids, values, total = self.store.table_page(b["shard"], b["start"], b["limit"])
        tensors = [Tensor(ids, "index", b["shard"]), Tensor(values, "rows", b["shard"])]
        return reply(msg, {"version": version, "rows": total}, tensors)

    def _op_push_rows(self, msg: Message) -> Message:
        by_shard = self._grad_chunks(msg, ("index", "rows"))
        sids, pulled = msg.body["shards"], msg.body["versions"]
        pairs: dict[int, tuple[Any, Any]] = {}
        for sid in sids:
            ts = by_shard[sid]
            kinds = [t.kind for t in ts]
            if kinds != ["index", "rows"]:
                raise InvalidArgument(f"push_rows: shard {sid} needs exactly (index, rows)")
            pairs[sid] = (ts[0].array, ts[1].array)
        for sid, ver in zip(sids, pulled, strict=True):
            self.store.check_rows(sid, *pairs[sid], ver)
            if self.metrics is not None:
                var = self.store.get(sid).definition.var
                self.metrics.rows(var, "push", pairs[sid][0].shape[0])
        body_out = self._commit_push(
            msg,
            lambda sid, ver: self.store.apply_rows(sid, *pairs[sid], ver)[1],
            lambda sid: (
                self.sync is not None and self.sync.add_rows(sid, *pairs[sid], msg.body["worker"])
            ),
        )
        body_out["versions"] = [self.store.get(sid).version for sid in sids]
        return reply(msg, body_out)

    def _commit_push(
        self,
        msg: Message,
        apply: Callable[[int, int], int],
        accumulate: Callable[[int], bool],
    ) -> dict[str, Any]:
        """Deduplicate, then apply (async, ssp) or accumulate (sync) a validated push.

        Sync: the message's local step is the worker's token; if any of its shards has
        moved past it, the whole push is stale and dropped (counted). Returns the
        reply's fields (without versions).
        """
        body = msg.body
        sids, pulled = body["shards"], body["versions"]
        if self.sync is not None and "step" not in body:
            raise InvalidArgument("sync mode: a push carries its local step (take a token first)")
        if not self._is_new(msg):
            return {"applied": False, "duplicate": True, "staleness": []}
        out: dict[str, Any] = {"applied": True, "staleness": []}
        if self.sync is None:
            out["staleness"] = [apply(sid, ver) for sid, ver in zip(sids, pulled, strict=True)]
        elif any(self.sync.is_ahead(sid, body["step"]) for sid in sids):
            self._drop("rolled_back")
            raise RolledBack(
                f"ps {self.index}: a gradient for step {body['step']}, but the shards are at"
                f" step {self.sync.min_step()} (restored): take a new token"
            )
        elif any(self.sync.is_stale(sid, body["step"]) for sid in sids):
            self.sync.dropped["stale"] += 1
            self._drop("stale")
            out = {"applied": False, "dropped": "stale", "staleness": []}
        elif all(self.sync.has_contributed(sid, body["worker"], body["step"]) for sid in sids):
            self.sync.dropped["duplicate"] += 1
            self._drop("duplicate")
            out = {"applied": False, "dropped": "duplicate", "staleness": []}
        else:
            advanced = False
            for sid, ver in zip(sids, pulled, strict=True):
                out["staleness"].append(self.store.get(sid).version - ver)
                advanced = accumulate(sid) or advanced
            if advanced:
                self._notify_steps()
        if out["applied"]:
            self.applied_pushes[f"{body['worker']}/{body['inc']}/{self.gen}"] += 1
        self.dedup.commit(body["worker"], body["inc"], body["seq"])
        return out

    # -- sync coordination -----------------------------------------------------

    @property
    def sync_step(self) -> int:
        return 0 if self.sync is None else self.sync.min_step()

    def _notify_steps(self) -> None:
        step = self.sync_step
        still = []
        for target, fut in self._step_waiters:
            if fut.done():
                continue
            if step >= target:
                fut.set_result(step)
            else:
                still.append((target, fut))
        self._step_waiters = still

    def _op_sync_config(self, msg: Message) -> Message:
        mode, required = msg.body["mode"], msg.body["required"]
        if mode not in MODES:
            raise InvalidArgument(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        if mode != "sync":
            self.sync = None
        elif self.sync is None:
            self.sync = SyncShards(self.store, required, self.restored_step)
        elif self.sync.set_required(required):
            self._notify_steps()
        if self.metrics is not None:
            self.metrics.set_info("ps", self.index, mode)
        log.info("ps %d: mode %s (replicas to aggregate %d)", self.index, mode, required)
        return reply(msg, {"step": self.sync_step})

    async def _op_wait_step(self, msg: Message) -> Message:
        target, wait = msg.body["step"], float(msg.body.get("wait", 0.0))
        if self.sync_step < target and wait > 0:
            fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self._step_waiters.append((target, fut))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(fut, wait)
        return reply(msg, {"step": self.sync_step})

    # -- checkpoints and recovery ----------------------------------------------

    def _op_ps_state(self, msg: Message) -> Message:
        """What a (restarted) chief needs to adopt this PS's state or to restore it."""
        body: dict[str, Any] = {
            "index": self.index,
            "boot": self.boot,
            "gen": self.gen,
            "shards": [[sh.definition.id, sh.version] for sh in self.store],
            "mode": "sync" if self.sync is not None else "",
            "step": self.sync_step,
            "contributors": [] if self.sync is None else self.sync.contributors_any(),
        }
        if self.placement is not None:
            body["placement"] = self.placement
        return reply(msg, body)

    def _op_fence(self, msg: Message) -> Message:
        """The chief registered a new incarnation of a worker: fence the older ones now."""
        b = msg.body
        if self.dedup.fence(b["worker"], b["inc"]):
            log.info("ps %d: %s incarnations before %d fenced", self.index, b["worker"], b["inc"])
        return reply(msg)

    def _root(self) -> Path:
        if self.checkpoint_dir is None:
            raise InvalidArgument(f"ps {self.index} runs without --checkpoint-dir")
        return self.checkpoint_dir

    def _checkpoint_path(self, name: str) -> Path:
        from zmqps.checkpoint import is_valid_name

        if not is_valid_name(name):
            raise InvalidArgument(f"not a checkpoint directory name: {name!r}")
        path = self._root() / name
        if not path.is_dir():
            raise NotFound(f"ps {self.index}: no checkpoint directory {path}")
        return path

    def _op_checkpoint_save(self, msg: Message) -> Message:
        """Snapshot every shard now (values, slots, version: one consistent state of this
        PS), reply, and write the snapshot into the checkpoint directory in a thread."""
        from zmqps.checkpoint import write_shard
        from zmqps.checkpoint.tables import write_table_shard

        path = self._checkpoint_path(msg.body["name"])
        started = time.perf_counter()
        snap = [
            (
                sh.definition,
                sh.values.copy(),
                {k: v.copy() for k, v in sh.slots.items()},
                sh.version,
            )
            for sh in self.store
            if sh.definition.table is None
        ]
        tables = [(t.definition, t.state(), t.version) for t in self.store.tables()]
        copied = time.perf_counter() - started

        def write() -> list[dict[str, Any]]:
            out = [write_shard(path, d, v, sl, ver).to_json() for d, v, sl, ver in snap]
            for d, (ids, v, sl, touched), ver in tables:
                out.append(write_table_shard(path, d, ids, v, sl, touched, ver).to_json())
            return out

        save_id = msg.body["id"]
        for old in sorted(self._saves)[: max(0, len(self._saves) - 7)]:
            self._saves.pop(old)  # keep a few outcomes for retried checkpoint_done
        self._saves[save_id] = asyncio.ensure_future(asyncio.to_thread(write))
        log.debug("ps %d: checkpoint snapshot in %.3fs", self.index, copied)
        return reply(
            msg,
            {
                "versions": [[d.id, ver] for d, _, _, ver in snap]
                + [[d.id, ver] for d, _, ver in tables],
                "step": self.sync_step,
                "snapshot_s": round(copied, 6),
            },
        )

    async def _op_checkpoint_done(self, msg: Message) -> Message:
        fut = self._saves.get(msg.body["id"])
        if fut is None:
            raise NotFound(f"ps {self.index}: no checkpoint save {msg.body['id']}")
        wait = float(msg.body.get("wait", 0.0))
        if not fut.done() and wait > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(fut), wait)
        if not fut.done():
            raise NotReady(f"ps {self.index}: checkpoint save {msg.body['id']} still writing")
        try:
            records = fut.result()
        except ZmqpsError:
            raise
        except OSError as e:
            raise InvalidArgument(f"ps {self.index}: writing the checkpoint failed: {e}") from e
        return reply(msg, {"shards": records})

    async def _op_restore(self, msg: Message) -> Message:
        """Replace every shard by its state in a checkpoint (``name``; resharded as the
        shard definitions say) or by its initial values (no ``name``); enter generation
        ``gen``. Every accumulated sync gradient is dropped; the PS is at ``step``."""
        b = msg.body
        defs = [ShardDef.from_wire(d) for d in b["shards"]]
        if b["gen"] < self.gen:
            raise InvalidArgument(f"ps {self.index}: restore to generation {b['gen']} < {self.gen}")
        if "name" in b:
            from zmqps.checkpoint import Checkpoint

            ckpt = Checkpoint.load(self._checkpoint_path(b["name"]))

            def load() -> list[tuple[ShardDef, Any, dict[str, Any], int]]:
                out = []
                for d in defs:
                    if d.table is None:
                        values, slots, version = ckpt.read_rows(d.var, d.row_start, d.rows)
                        out.append((d, values.reshape(d.shape), slots, version))
                return out

            def load_tables() -> list[Any]:
                from zmqps.checkpoint.tables import read_table

                return [
                    (d, *read_table(ckpt, d.var, d.row_start, d.rows))
                    for d in defs
                    if d.table is not None
                ]

            states = await asyncio.to_thread(load)
            tables = await asyncio.to_thread(load_tables)
            self.store.replace(states, tables)
        else:
            self.store.clear()
            self.store.create(defs)
        self.gen = b["gen"]
        self.restored_step = b["step"]
        if "placement" in b:
            self.placement = b["placement"]
        if self.sync is not None:
            self.sync.reset(b["step"])
            self._notify_steps()
        log.info(
            "ps %d: restored %d shards from %s (generation %d, step %d)",
            self.index,
            len(defs),
            b.get("name", "initial values"),
            self.gen,
            b["step"],
        )
        return reply(
            msg, {"gen": self.gen, "versions": [[d.id, self.store.get(d.id).version] for d in defs]}
        )

    def status(self) -> dict[str, Any]:
        out = {
            "role": "ps",
            "index": self.index,
            "gen": self.gen,
            "duplicates": self.duplicates,
            "fenced": self.fenced,
            "applied_pushes": dict(self.applied_pushes),
            **self.store.stats(),
        }
        if self.sync is not None:
            out["sync"] = {
                **self.sync.status(),
                "contributors": self.sync.contributors_of_current_step(),
            }
        return out

    def _op_status(self, msg: Message) -> Message:
        return reply(msg, self.status())

    def _op_shutdown(self, msg: Message) -> Message:
        log.info("ps %d: shutdown requested by %s", self.index, msg.sender or "?")
        self.shutdown_requested.set()
        return reply(msg)


async def serve_ps(
    cfg: PSConfig, ctx: zmq.asyncio.Context, options: SocketOptions | None = None
) -> PSService:
    metrics = Metrics() if cfg.metrics_port is not None else None
    service = PSService(
        cfg.index, chunk_bytes=cfg.chunk_bytes, metrics=metrics, checkpoint_dir=cfg.checkpoint_dir
    )
    server = Server(
        ctx, cfg.bind, service, name=f"ps{cfg.index}", options=options, observer=metrics
    )
    # The task's own address first (the cluster spec names it); the metrics port after,
    # so a metrics port picked as 0 can never take it.
    endpoint = server.bind()
    try:
        exporter = start_exporter(metrics, cfg.metrics_host, cfg.metrics_port, f"ps {cfg.index}")
    except OSError:
        await server.stop()
        raise
    log.info("ps %d: serving on %s", cfg.index, endpoint)
    server.start()
    loop = asyncio.get_running_loop()
    terminated = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, terminated.set)
    try:
        stop = asyncio.ensure_future(service.shutdown_requested.wait())
        term = asyncio.ensure_future(terminated.wait())
        await asyncio.wait([stop, term], return_when=asyncio.FIRST_COMPLETED)
        if not service.shutdown_requested.is_set():
            # SIGTERM (the whole cluster is stopping): serve on a little, so the chief
            # can take its final checkpoint, until it says shutdown or the grace ends.
            log.info("ps %d: SIGTERM; serving until the chief's shutdown", cfg.index)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(service.shutdown_requested.wait(), cfg.stop_grace)
        stop.cancel()
        term.cancel()
        await asyncio.sleep(0.05)  # let the shutdown reply leave
    finally:
        await server.stop()
        if exporter is not None:
            exporter.close()
    log.info("ps %d: stopped (%s)", cfg.index, service.status())
    return service


def run_ps(cfg: PSConfig, options: SocketOptions | None = None) -> int:
    return run_server(lambda ctx: serve_ps(cfg, ctx, options))
