"""The parameter-server role: serves shards from a :class:`ShardStore` over the transport.

Rules of this module:

* :class:`PSService` maps requests to the store; it does no IO itself, so tests
  drive it through the in-memory transport. Its op table (:meth:`PSService.ops`)
  names every op it serves with its typed body (:mod:`zmqps.wire.ops`), checked
  once by the codec.
* A push is planned whole (every shard of the message validated by the store)
  before anything is applied, then committed by the consistency mode
  (:mod:`zmqps.roles.ps.modes`) without being checked again: a bad push changes
  nothing; a good one is applied completely.
* A duplicate push (same worker, incarnation and sequence) is acknowledged with
  ``applied: false`` and not applied again; an older incarnation is fenced.
* Data requests of another generation (made before a restore) are refused, and so
  is every data request while the PS holds no shards (restarted, not restored).
* A pull reply is a consistent snapshot of each shard at one version. Over TCP the
  live values are lent to the transport without a copy; an update that comes while
  a send still holds them copies them first (copy-on-write, :meth:`Shard.own`).
* Same-host fast path: a worker may attach shared-memory regions
  (:mod:`zmqps.roles.ps.regions`); then a pull writes each snapshot straight into
  the worker's region and a push applies the gradient straight from it. The rows of
  a row push and of a row pull's reply may travel the same way (``shm``,
  ``shm_out``): the ids always come in the message, and the places of the rows are
  the sizes those ids give, validated whole before anything is read or written
  (:meth:`Regions.rows`).
* Per worker (all incarnations) the PS counts pushes applied and dropped and keeps
  the highest batch cursor applied (:class:`~zmqps.core.dedup.PushLedger`): a
  ``fence`` answers with it, so a worker's new incarnation resumes exactly there.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import logging
import math
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from zmqps.core.dedup import ClosureLedger, PushDeduper, PushLedger
from zmqps.core.finite import first_bad_of, limit
from zmqps.core.packs import split, units
from zmqps.core.store import Pack, ShardStore, Update
from zmqps.core.sync import ReleasedTokens
from zmqps.core.variables import ShardDef
from zmqps.logs import RateLimitedLog
from zmqps.metrics import Metrics
from zmqps.process import available_memory
from zmqps.roles.optable import Handler, OpTable
from zmqps.roles.ps.checkpoints import ShardCheckpoints
from zmqps.roles.ps.modes import Accumulate, Apply, PSMode, StepWaiters, make_mode
from zmqps.roles.ps.regions import MAX_PER_WORKER, Regions
from zmqps.roles.threads import CheckThreads
from zmqps.roles.waiters import Changes
from zmqps.transport.dispatch import Held
from zmqps.wire import Message, Tensor, reply
from zmqps.wire import ops as o
from zmqps.wire.codec import is_bfloat16
from zmqps.wire.errors import (
    FencedError,
    InvalidArgument,
    NonFiniteGradient,
    NotFound,
    NotReady,
    RolledBack,
    ZmqpsError,
)
from zmqps.wire.schema import FREE_CHUNKS, MAX_ROW_VALUES, MAX_ROWS, MIN_CHUNK_BYTES

__all__ = ["PSService"]

log = logging.getLogger("zmqps.ps")

#: shared-memory pulls remembered per sender (a copy sent again is answered by TCP),
#: and the senders remembered
SHM_PULLS_KEPT = 16
MAX_SHM_PULL_SENDERS = 8192
#: seconds between two log lines of one kind of request any peer may repeat
NOTE_INTERVAL_S = 10.0
#: workers (and incarnations) a ``status`` lists one by one; past it, ``pushes_cut``
#: says how many there are (a status stays small and quick whatever names clients sent)
STATUS_WORKERS = 1024

#: how long a sync push that asks for the worker's next token (``Push.token``) may
#: wait for its release before it is answered without one
PUSH_TOKEN_WAIT_S = 0.25

#: sync: how long past its wait a chief's poll that lets this PS release a run of
#: steps (``WaitStep.release_until``) holds: the chief polls again at once, so a run
#: whose chief stopped polling ends (a chief come back releases them itself)
RELEASE_LEASE_S = 5.0

_PUSH_OPS = frozenset({"push", "push_pull", "push_rows", "push_pull_rows"})
_DATA_OPS = _PUSH_OPS | {"pull", "pull_rows", "table_rows"}
#: the ops this PS takes beyond those every PS takes, said in its row replies (a
#: client sends them only to a PS that said so: an older one refuses them)
TAKES = ("push_pull_rows", "shm_rows", "rows_joined")
#: the row ops whose index tensors may come joined into one (``counts``)
_JOINED_OPS = frozenset({"pull_rows", "push_rows", "push_pull_rows"})

#: what a sync PS's dense push replies say it takes beyond the common fields:
#: ``Push.fresh`` (a worker asks for the next step's values only of a PS that said so)
DENSE_TAKES = ("fresh",)


class PSService:
    """Request handler of one PS task."""

    MAX_REGIONS_PER_WORKER = MAX_PER_WORKER

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
        #: the signal (its name) that stopped this PS's process before the chief shut
        #: it down, if one did (the process's exit code says it)
        self.stop_signal: str | None = None
        #: a new value every process start: the chief tells a restarted PS by it
        self.boot = secrets.token_hex(8)
        #: the cluster's generation (restores so far); requests of another one are refused
        self.gen = 0
        self.placement: Mapping[str, Any] | None = None  # as the chief sent it (wire form)
        self.store = store or ShardStore(memory=self._growth_memory)
        self.checkpoints = ShardCheckpoints(index, self.store, checkpoint_dir)
        self.metrics = metrics
        if metrics is not None:
            self._observe(metrics)
        #: threads that read a large push's values for the finite check (and update a
        #: large shard, round values for a pull: passes over arrays no one else reads)
        self.check_threads = CheckThreads()
        if self.store.parts is None:
            self.store.parts = self.check_threads
        #: the request being handled had its values found finite already
        #: (:meth:`checked`): the finite check does not read them again
        self._values_known = False
        self.dedup = PushDeduper()
        #: lines of requests any peer may repeat (create, mode, fence, attach): at most
        #: one per kind per NOTE_INTERVAL_S, with a count of the others
        self.notes = RateLimitedLog(log, NOTE_INTERVAL_S)
        self.pushes = PushLedger()
        self.closures = ClosureLedger()
        self.chunk_elems_bytes = chunk_bytes
        self.duplicates = 0
        self.fenced = 0
        #: a chief has asked this PS for its state (it probes every PS, shards or none)
        self.chief_seen = False
        self._chief_heard: float | None = None
        #: pushes refused or acknowledged without being applied, by reason
        self.dropped: Counter[str] = Counter()
        #: the consistency mode; the chief sets it (``sync_config``)
        self.mode: PSMode = Apply(self.store)
        self.restored_step = 0  # the step of the last restore (sync shards start there)
        #: the batch cursors of the last restore to a checkpoint's (see o.Restore.rewind)
        self.rewinds: dict[str, int] | None = None
        self.waiters = StepWaiters(lambda: self.visible_step, self._step_moved)
        #: sync: the tokens the chief released, handed to the workers that ask here
        self.tokens = ReleasedTokens(o.MAX_TOKEN_WAITS)
        self._token_changes = Changes()
        self.regions = Regions(max_region_bytes)
        #: shared-memory pulls served lately, by sender (see _shm_pull_again)
        self._shm_pulls: collections.OrderedDict[str, collections.deque[int]] = (
            collections.OrderedDict()
        )
        self.shutdown_requested = asyncio.Event()
        #: this state's part in replication (``roles/ps/replica``: Primary or Backup),
        #: set by the process's slots; None: not replicated
        self.replica: Any = None
        self._ops = OpTable("a PS", self.ops())

    def ops(self) -> dict[str, tuple[type[o.Body], Handler]]:
        """The op table: every op this PS serves, its typed body, its handler."""
        return {
            "ping": (o.Ping, self._op_ping),
            "status": (o.Status, self._op_status),
            "shutdown": (o.Shutdown, self._op_shutdown),
            "create_shards": (o.CreateShards, self._op_create_shards),
            "pull": (o.Pull, self._op_pull),
            "push": (o.Push, self._op_push),
            "push_pull": (o.PushPull, self._op_push),
            "push_rows": (o.PushRows, self._op_push_rows),
            "push_pull_rows": (o.PushPullRows, self._op_push_pull_rows),
            "pull_rows": (o.PullRows, self._op_pull_rows),
            "table_rows": (o.TableRows, self._op_table_rows),
            "shm_attach": (o.ShmAttach, self._op_shm_attach),
            "shm_detach": (o.ShmDetach, self._op_shm_detach),
            "sync_config": (o.SyncConfigure, self._op_sync_config),
            "wait_step": (o.WaitStep, self._op_wait_step),
            "take_token": (o.TakeToken, self._op_take_token),
            "ps_state": (o.PsState, self._op_ps_state),
            "fence": (o.Fence, self._op_fence),
            "checkpoint_save": (o.CheckpointSave, self._op_checkpoint_save),
            "checkpoint_done": (o.CheckpointDone, self._op_checkpoint_done),
            "restore": (o.Restore, self._op_restore),
        }

    def _observe(self, metrics: Metrics) -> None:
        metrics.set_info("ps", self.index)
        previous = self.store.observer

        def observe(shard: ShardDef, staleness: int) -> None:
            metrics.applied(shard.var, staleness)
            if previous is not None:
                previous(shard, staleness)

        self.store.observer = observe
        metrics.watch(metrics.shard_bytes, self.store.nbytes)
        metrics.watch_tables(self.store.table_stats)

    # The transport calls this for every decoded (and schema-checked) request.
    def __call__(self, msg: Message) -> Message | Awaitable[Message]:
        req, handler = self._ops.resolve(msg)
        if msg.op in _DATA_OPS:
            self._check_generation(msg.op, req.gen)
        # index tensors joined into one (``counts``): one per shard again, as sent
        # by a client that does not join them (the body's ``counts`` is not read after)
        joined = "counts" in msg.body and msg.op in _JOINED_OPS
        if msg.op not in _PUSH_OPS:
            return handler(split_index(msg) if joined else msg, req)
        try:
            return handler(split_index(msg) if joined else msg, req)
        except NonFiniteGradient:
            self._drop("nonfinite")
            raise
        except (InvalidArgument, NotFound):
            self._drop("invalid")
            raise
        except RolledBack:  # pulled from values that are gone (a version ahead)
            self._drop("rolled_back")
            raise

    def _check_generation(self, op: str, gen: int | None) -> None:
        if gen is not None and gen != self.gen:
            if op in _PUSH_OPS:
                self._drop("rolled_back")
            raise RolledBack(
                f"ps {self.index} is at generation {self.gen}; the request is of generation"
                f" {gen}: pull again"
            )
        if not len(self.store):
            raise NotReady(f"ps {self.index} holds no shards (restarted and not restored yet?)")

    def _growth_memory(self) -> tuple[int, int] | None:
        """The machine's memory, for the room check of an unbounded hash table; None (no
        check) for a replicated state: its copies must decide alike, and the machines'
        memory is not (a table there is bounded by its ``row_budget`` only)."""
        return None if self.replica is not None else available_memory()

    def _drop(self, reason: str, worker: str | None = None) -> None:
        self.dropped[reason] += 1  # reasons are a fixed handful: bounded
        if worker is not None and worker in self.dedup:
            # per name only for names the deduper keeps (bounded); another is counted
            # in ``dropped`` alone (a push of a new name refused before it counted)
            self.pushes.dropped(worker, reason)
        if self.metrics is not None:
            self.metrics.drop(reason)

    @property
    def sync_step(self) -> int:
        return self.mode.step

    @property
    def visible_step(self) -> int:
        """The sync step as others read it (``wait_step``, ``ps_state``): on a
        replicated primary, the step of what every backup has too, so that a step the
        chief counted is never undone by a fail-over."""
        visible = getattr(self.replica, "visible", None)
        return self.mode.step if visible is None else int(visible(self.mode.step))

    # -- plain ops -------------------------------------------------------------

    def _op_ping(self, msg: Message, req: o.Ping) -> Message:
        return reply(msg, o.Pong("ps", self.index).to_wire())

    def _op_status(self, msg: Message, req: o.Status) -> Message:
        if req.sync_of is not None:  # the chief's look-up: small whatever the workers
            out: dict[str, Any] = {"role": "ps", "index": self.index, "gen": self.gen}
            sync = self.mode.status(req.sync_of)
            if sync is not None:
                # the tokens of the chief's last release handed here (zmqps status)
                tokens = {"granted_of": self.tokens.step, "granted": self.tokens.granted}
                out["sync"] = {**sync, **tokens}
            return reply(msg, out)
        return reply(msg, self.status())

    def _op_shutdown(self, msg: Message, req: o.Shutdown) -> Message:
        log.info("ps %d: shutdown requested by %s", self.index, msg.sender or "?")
        self.shutdown_requested.set()
        return reply(msg)

    def _op_create_shards(self, msg: Message, req: o.CreateShards) -> Message:
        defs = [ShardDef.from_wire(d) for d in req.shards]
        need = self.store.bytes_to_create(defs)
        memory = available_memory()
        if memory is not None:
            # zeros are allocated lazily: what the PS holds already counts against
            # the machine's whole memory, not only against what is free now
            available, total = memory
            held = self.store.nbytes()
            if need > available or need + held > total:
                raise InvalidArgument(
                    f"create_shards: the shards need {need:,} bytes; this machine has"
                    f" {available:,} available ({total:,} in all, {held:,} held by this PS):"
                    " use more PS, or smaller variables"
                )
        try:
            self.store.create(defs)
        except (MemoryError, ValueError) as exc:  # an allocation refused: nothing was made
            raise InvalidArgument(f"create_shards: refused: {exc}") from None
        if req.placement is not None:
            self.placement = req.placement
        self.notes.log(
            logging.INFO,
            "ps %d: %d shards ready (%d bytes)",
            self.index,
            len(defs),
            self.store.nbytes(),
            key="create_shards",
        )
        return reply(msg, o.ShardsCreated(tuple(d.id for d in defs)).to_wire())

    # -- pulls -----------------------------------------------------------------

    def _held_packs(self, sids: Sequence[int], packs: Sequence[int]) -> list[Pack] | None:
        """The packs a message names (``packs``: shards in each leading pack), if every one
        is a pack here; None otherwise (the message is then taken shard by shard)."""
        if not packs:
            return None
        held: list[Pack] = []
        for span in units(sids, packs)[0]:
            pack = self.store.pack_of(span)
            if pack is None or pack.buf.nbytes > self.chunk_elems_bytes:
                return None
            held.append(pack)
        return held

    def _snapshot_tensors(
        self, sids: Sequence[int], exact: bool = False, packs: Sequence[int] = ()
    ) -> tuple[list[int], list[Tensor], bool]:
        """Each shard's values as reply tensors of at most ``chunk_bytes``: zero-copy
        (the next update of the shard copies first), or rounded to the shard's wire
        dtype unless ``exact``. The message's packs, when they are packs here, travel as
        one tensor each, lent whole (True is then returned last)."""
        versions: list[int] = []
        tensors: list[Tensor] = []
        held = self._held_packs(sids, packs)
        if held is not None:
            for pack in held:
                versions.extend(pack.versions())
                tensors.append(Tensor(pack.lend(), "value", pack.ids[0], 0))
            sids = units(sids, packs)[1]
        for sid in sids:
            if exact:
                shard = self.store.get(sid)
                version, flat = shard.version, shard.lend()
            else:
                version, flat = self.store.snapshot_wire(sid, self.check_threads)
            step = max(1, self.chunk_elems_bytes // flat.itemsize)
            versions.append(version)
            tensors.extend(
                Tensor(flat[off : off + step], "value", sid, off)
                for off in range(0, max(flat.size, 1), step)
            )
        return versions, tensors, held is not None

    def _snapshot_to_region(
        self,
        sids: Sequence[int],
        ref: o.ShmRef,
        views: Sequence[Any] | None = None,
        packs: Sequence[int] = (),
    ) -> list[int]:
        """Each shard's values into its place in the region (``views``: the places of the
        message's units, already validated by :meth:`Regions.views` in this event-loop
        turn); a pack held here in one copy."""
        if views is None:
            views = self.regions.views(self.store, sids, ref, packs=packs)
        store = self.store
        spans, rest = units(sids, packs)
        versions: list[int] = []
        places: list[tuple[int, Any]] = []
        for span, view in zip(spans, views, strict=False):
            pack = store.pack_of(span)
            if pack is not None:
                view[...] = pack.buf
                versions.extend(pack.versions())
            else:
                places += zip(span, split(view, self._sizes(span), "pull"), strict=True)
        places += zip(rest, views[len(spans) :], strict=True)
        versions += [
            store.snapshot_into(sid, view.reshape(store.get(sid).values.shape), self.check_threads)
            for sid, view in places
        ]
        return versions

    def _sizes(self, sids: Sequence[int]) -> list[int]:
        return [self.store.get_dense(sid).definition.size for sid in sids]

    def _op_pull(self, msg: Message, req: o.Pull) -> Message:
        if len(set(req.shards)) != len(req.shards):
            raise InvalidArgument("pull: a shard appears twice in one pull")
        for sid in req.shards:
            self.store.get(sid)  # NotFound before any work
        if req.shm_out is not None and req.exact:
            raise InvalidArgument("pull: exact values travel by TCP, not shared memory")
        packs = req.packs or ()
        if req.shm_out is not None and not self._shm_pull_again(msg):
            versions = self._snapshot_to_region(req.shards, req.shm_out, packs=packs)
            self._shm_pull_served(msg)
            return reply(msg, o.Values(tuple(versions)).to_wire())
        # TCP, or a shared-memory pull sent again (its connection came back): the worker
        # may already have the first reply and be computing on the region, so the
        # values travel in the reply instead (a worker still waiting copies them in)
        versions, tensors, packed = self._snapshot_tensors(req.shards, bool(req.exact), packs)
        return reply(msg, o.Values(tuple(versions), packed or None).to_wire(), tensors)

    def _shm_pull_again(self, msg: Message) -> bool:
        """Whether this shared-memory pull (sender, request id) was served already."""
        seen = self._shm_pulls.get(msg.sender)
        return seen is not None and msg.id in seen

    def _shm_pull_served(self, msg: Message) -> None:
        """Remember a shared-memory pull served. Bounded: the last SHM_PULLS_KEPT ids of
        MAX_SHM_PULL_SENDERS senders."""
        seen = self._shm_pulls.get(msg.sender)
        if seen is None:
            seen = self._shm_pulls[msg.sender] = collections.deque(maxlen=SHM_PULLS_KEPT)
            while len(self._shm_pulls) > MAX_SHM_PULL_SENDERS:
                self._shm_pulls.popitem(last=False)
        self._shm_pulls.move_to_end(msg.sender)
        seen.append(msg.id)

    def _op_pull_rows(self, msg: Message, req: o.PullRows) -> Message:
        if len(msg.tensors) != len(req.shards):
            raise InvalidArgument("pull_rows: one index tensor per shard expected")
        for sid, t in zip(req.shards, msg.tensors, strict=True):
            if t.kind != "index" or t.ref != sid:
                raise InvalidArgument(f"pull_rows: expected the index tensor of shard {sid}")
        ids = [t.array for t in msg.tensors]
        self._check_row_counts("pull_rows", req.shards, ids)
        out = self._rows_out(msg, req.shards, ids, req.shm_out)  # validated before the pull
        create = req.create is not False  # False: read-only (evaluation, serving)
        pulled = self.store.pull_rows_of(list(zip(req.shards, ids, strict=True)), create, out)
        return self._rows_reply(msg, req.shards, pulled, out is not None)

    def _row_spans(
        self, sids: Sequence[int], ids: Sequence[Any]
    ) -> list[tuple[np.dtype[Any], tuple[int, ...]]]:
        """The dtype and shape of each shard's rows for ``ids`` (its ids): the places a
        row request's rows take in a region are these, never sizes the wire names."""
        spans: list[tuple[np.dtype[Any], tuple[int, ...]]] = []
        for sid, a in zip(sids, ids, strict=True):
            dtype, row = self.store.get(sid).row_wire
            spans.append((dtype, (int(a.size), *row)))
        return spans

    def _rows_out(
        self,
        msg: Message,
        sids: Sequence[int],
        ids: Sequence[Any],
        ref: o.ShmRef | None,
        worker: str | None = None,
    ) -> list[Any] | None:
        """Where a row pull's rows go in the worker's pull region (validated whole), or
        None: in the reply (no region named, or a copy of a pull served already: the
        worker may hold the first reply and read the region, see :meth:`_op_pull`)."""
        if ref is None or self._shm_pull_again(msg):
            return None
        return self.regions.rows(ref, self._row_spans(sids, ids), worker)

    def rows_in_place(self, msg: Message) -> Message:
        """A ``push_rows`` whose rows are in the worker's push region (``shm``) as the
        message a TCP push of them is: ``(index, rows)`` of each shard, the rows views
        of the region (validated whole: the region the pushing worker attached, in
        bounds, aligned, not overlapping; the sizes the ids give). Any other message
        as it is. A backup gets such a push's rows as these tensors."""
        shm = msg.body.get("shm")
        if msg.op != "push_rows" or shm is None:
            return msg
        req = o.PushRows.from_wire(msg.body)
        tensors = self._rows_in_region(msg.tensors, req.shards, o.ShmRef.from_wire(shm), req.worker)
        body = {k: v for k, v in msg.body.items() if k != "shm"}
        return replace(msg, body=body, tensors=tensors)

    def _rows_in_region(
        self, index: Sequence[Tensor], sids: Sequence[int], ref: o.ShmRef, worker: str
    ) -> tuple[Tensor, ...]:
        """The tensors a TCP ``push_rows`` of these shards carries, ``(index, rows)`` of
        each, from a push whose rows are in ``worker``'s push region (``ref``): the
        rows views of the region, validated whole (:meth:`rows_in_place`)."""
        if len(index) != len(sids):
            raise InvalidArgument("push_rows: over shm, one index tensor per shard expected")
        for sid, t in zip(sids, index, strict=True):
            if t.kind != "index" or t.ref != sid:
                raise InvalidArgument(f"push_rows: expected the index tensor of shard {sid}")
            if sid not in self.store:
                raise NotFound(f"shard {sid} is not on ps {self.index}")
        ids = [t.array for t in index]
        self._check_row_counts("push_rows", sids, ids)
        views = self.regions.rows(ref, self._row_spans(sids, ids), worker)
        tensors: list[Tensor] = []
        for sid, t, rows in zip(sids, index, views, strict=True):
            tensors += [t, Tensor(rows, "rows", sid)]
        return tuple(tensors)

    def _rows_reply(
        self,
        msg: Message,
        sids: Sequence[int],
        pulled: Sequence[tuple[int, Any]],
        in_region: bool = False,
    ) -> Message:
        """The reply to a pull of rows: each shard's version and rows (``in_region``:
        the rows are in the worker's region already, the reply carries none)."""
        versions, tensors = self._rows_of(sids, pulled, in_region)
        if in_region:
            self._shm_pull_served(msg)
        return reply(msg, o.Values(tuple(versions), takes=TAKES).to_wire(), tensors)

    def _rows_of(
        self, sids: Sequence[int], pulled: Sequence[tuple[int, Any]], in_region: bool
    ) -> tuple[list[int], list[Tensor]]:
        """The versions and the rows tensors (none: ``in_region``) of a pull of rows,
        counted in the metrics."""
        versions, tensors = [], []
        for sid, (version, rows) in zip(sids, pulled, strict=True):
            versions.append(version)
            if not in_region:
                tensors.append(Tensor(rows, "rows", sid))
            if self.metrics is not None:
                self.metrics.rows(self.store.get(sid).definition.var, "pull", rows.shape[0])
        return versions, tensors

    def _op_push_pull_rows(self, msg: Message, req: o.PushPullRows) -> Message:
        """A ``push_rows`` then a ``pull_rows`` in one message, handled as the two
        would be, one after the other in this turn of the loop (the pull reads the
        push's update), with the checks :meth:`split_push_pull_rows` makes, in its
        order, before anything changes; but with no message or body made for either
        half. A replicated primary runs the two through its log instead (``PSSlots``)."""
        n, _, keyed, views = self._pull_part(msg, req)
        # a copy of a pull served already: the rows travel in the reply (_rows_out)
        out = None if views is None or self._shm_pull_again(msg) else views
        pushed = msg.tensors[:n]
        if req.shm is not None:
            pushed = self._rows_in_region(pushed, req.shards, req.shm, req.worker)
        body = self._push_rows(req, pushed).to_wire()
        # the pull's ids were validated above (a push changes no id's validity, nor a
        # table's room: it creates no row): read with those keys
        create = req.create is not False
        places: Sequence[Any] = [None] * len(keyed) if out is None else out
        pulled = [
            (shard.version, shard.read_rows(keys, create, place))
            for (shard, keys), place in zip(keyed, places, strict=True)
        ]
        versions, tensors = self._rows_of(req.pull, pulled, out is not None)
        if out is not None:
            self._shm_pull_served(msg)
        return self._joined_reply(msg, body, versions, tensors)

    def split_push_pull_rows(
        self, msg: Message, req: o.PushPullRows
    ) -> tuple[Message, Message, list[tuple[Any, Any]]]:
        """The ``push_rows`` and the ``pull_rows`` a ``push_pull_rows`` is, the pull's
        part checked first as its ``pull_rows`` would be (its structure, its counts,
        its ids, a hash table's room): a pull that would be refused refuses the whole
        message before the push changes anything. Third: each pulled shard and the
        validated keys of its ids (:meth:`ShardStore.check_pull_rows`)."""
        n, wanted, keyed, _ = self._pull_part(msg, req)
        body = {k: v for k, v in msg.body.items() if k not in ("pull", "create", "shm_out")}
        pull_body = o.PullRows(req.pull, req.gen, req.create, req.shm_out).to_wire()
        push = self.rows_in_place(replace(msg, op="push_rows", body=body, tensors=msg.tensors[:n]))
        return push, replace(msg, op="pull_rows", body=pull_body, tensors=wanted), keyed

    def _pull_part(
        self, msg: Message, req: o.PushPullRows
    ) -> tuple[int, tuple[Tensor, ...], list[tuple[Any, Any]], Any]:
        """A ``push_pull_rows``' pull checked as its ``pull_rows`` would be (structure,
        counts, ids, a hash table's room, the region its rows go to): the number of the
        push's tensors, the pull's tensors, each pulled shard with the validated keys of
        its ids, and where in the worker's region its rows go (None: in the reply)."""
        n = (1 if req.shm is not None else 2) * len(req.shards)  # shm: the index only
        if len(msg.tensors) != n + len(req.pull):
            raise InvalidArgument(
                "push_pull_rows: (index, rows) of every pushed shard (its index only, rows"
                " in shared memory), then the index tensor of every pulled shard expected"
            )
        wanted = msg.tensors[n:]
        for sid, t in zip(req.pull, wanted, strict=True):
            if t.kind != "index" or t.ref != sid:
                raise InvalidArgument(f"push_pull_rows: expected the index tensor of shard {sid}")
        ids = [t.array for t in wanted]
        self._check_row_counts("pull_rows", req.pull, ids)
        keyed = self.store.check_pull_rows(
            list(zip(req.pull, ids, strict=True)), req.create is not False
        )
        views = None
        if req.shm_out is not None:  # where the rows go: refused before the push too
            views = self.regions.rows(req.shm_out, self._row_spans(req.pull, ids), req.worker)
        return n, wanted, keyed, views

    def joined_rows(self, msg: Message, pushed: Message, pulled: Message) -> Message:
        """The reply to ``push_pull_rows`` ``msg``: its push's (``pushed``), with the
        versions and rows of its pull's (``pulled``)."""
        return self._joined_reply(msg, pushed.body, pulled.body["versions"], pulled.tensors)

    @staticmethod
    def _joined_reply(
        msg: Message, push_body: Mapping[str, Any], versions: Any, tensors: Sequence[Tensor]
    ) -> Message:
        body = dict(push_body)
        body["pulled"] = versions
        return reply(msg, body, tensors)

    def _check_row_counts(self, op: str, sids: Sequence[int], ids: Sequence[Any]) -> None:
        """A row request names at most MAX_ROWS ids and moves at most MAX_ROW_VALUES
        values (ids times each shard's row width), all its shards together: what it
        costs the PS is bounded, whatever the ids."""
        rows = values = 0
        for sid, a in zip(sids, ids, strict=True):
            n = int(a.size)
            rows += n
            values += n * self.store.get(sid).row_width
        if rows > MAX_ROWS or values > MAX_ROW_VALUES:
            raise InvalidArgument(
                f"{op}: {rows:,} row ids, {values:,} values in one request; at most"
                f" {MAX_ROWS:,} ids and {MAX_ROW_VALUES:,} values (split the request)"
            )

    def _op_table_rows(self, msg: Message, req: o.TableRows) -> Message:
        version, ids, values, total = self.store.table_page(req.shard, req.start, req.limit)
        tensors = [Tensor(ids, "index", req.shard), Tensor(values, "rows", req.shard)]
        return reply(msg, o.TablePage(version, total).to_wire(), tensors)

    # -- same-host fast path ---------------------------------------------------

    def _op_shm_attach(self, msg: Message, req: o.ShmAttach) -> Message:
        rid, region = self.regions.attach(req.name, req.size, req.worker)
        self.notes.log(
            logging.INFO,
            "ps %d: %s attached shared memory (%d bytes)",
            self.index,
            req.worker,
            region.size,
            key="shm_attach",
        )
        return reply(msg, o.ShmAttached(rid, region.token.hex()).to_wire())

    def _op_shm_detach(self, msg: Message, req: o.ShmDetach) -> Message:
        self.regions.detach(req.region, req.name)
        return reply(msg)

    # -- pushes ----------------------------------------------------------------

    def _grad_tensors(
        self,
        tensors: Sequence[Tensor],
        req: o.Push,
        kinds: tuple[str, ...],
        heads: Sequence[int] | None = None,
    ) -> dict[int, list[Tensor]]:
        """The message's gradient tensors by shard (``heads``: the shards tensors are
        named by, when not every shard: a pack's first), its structure checked."""
        sids = req.shards
        if len(set(sids)) != len(sids):
            raise InvalidArgument("a shard appears twice in one push")
        if len(req.versions) != len(sids):
            raise InvalidArgument("push: one version per shard expected")
        for sid in sids:
            if sid not in self.store:
                raise NotFound(f"shard {sid} is not on ps {self.index}")
        by_shard: dict[int, list[Tensor]] = defaultdict(list)
        named_in_order = sids if heads is None else heads
        named = set(named_in_order)
        for t in tensors:
            if t.kind not in kinds:
                raise InvalidArgument(f"push: unexpected tensor kind {t.kind!r}")
            if t.ref not in named:
                raise InvalidArgument(f"push: tensor for shard {t.ref} not named in the body")
            by_shard[t.ref].append(t)
        for sid in named_in_order:
            if sid not in by_shard:
                raise InvalidArgument(f"push: no gradient for shard {sid}")
        return by_shard

    def _pulled(self, sids: Sequence[int], versions: Sequence[Any]) -> tuple[Any, ...]:
        """The versions a push says its values were pulled at. A copy serving in a
        replication role (a moved or replicated state) may be behind what a worker
        read: the worker read an update the replaced primary had applied and never
        committed (that push, answered not_primary, is sent here again). Such a
        version counts as the current one (staleness 0); a plain PS refuses a version
        ahead of its own, as before. Backups replaying the entry read it alike."""
        if self.replica is None:
            return tuple(versions)
        out = []
        for sid, v in zip(sids, versions, strict=True):
            if isinstance(v, int) and not isinstance(v, bool) and sid in self.store:
                v = min(v, self.store.get(sid).version)
            out.append(v)
        return tuple(out)

    def _dense_plans(self, msg: Message, req: o.Push) -> list[Update]:
        """Every shard's gradient, from the push region or the message, validated. A pack
        named by the message that is a pack here is checked and planned whole (in sync
        mode, whose sums are per shard, it is cut into its shards)."""
        sids = req.shards
        spans, rest = units(sids, req.packs or ())
        if req.shm is not None:
            if msg.tensors or len(set(sids)) != len(sids) or len(req.versions) != len(sids):
                raise InvalidArgument("push: shm pushes name each shard once, with no tensors")
            views = self.regions.views(self.store, sids, req.shm, req.worker, req.packs or ())
            packed = views[: len(spans)]
            chunks: dict[int, list[tuple[int, Any]]] = {
                sid: [(0, view)] for sid, view in zip(rest, views[len(spans) :], strict=True)
            }
        else:
            heads = [span[0] for span in spans] + rest if spans else None
            by_shard = self._grad_tensors(msg.tensors, req, ("grad",), heads)
            packed = []
            for span in spans:
                ts = by_shard.pop(span[0])
                if len(ts) != 1 or ts[0].offset != 0:
                    raise InvalidArgument(f"push: the pack of shard {span[0]} in one tensor")
                packed.append(ts[0].array.reshape(-1))
            self._check_chunk_counts(by_shard)
            chunks = {sid: [(t.offset, t.array.reshape(-1)) for t in by_shard[sid]] for sid in rest}
        versions = self._pulled(sids, req.versions)
        whole: list[tuple[Pack, Any, int]] = []  # (pack, gradient, first version's index)
        pos = 0
        for span, flat in zip(spans, packed, strict=True):
            pack = self.store.pack_of(span) if self.mode.fused else None
            if pack is not None:
                whole.append((pack, flat, pos))
            else:  # not a pack here (or sync mode): shard by shard
                for sid, view in zip(span, split(flat, self._sizes(span), "push"), strict=True):
                    chunks[sid] = [(0, view)]
            pos += len(span)
        plans: list[Update] = [
            self.store.plan_pack(pack, flat, versions[at : at + len(pack.ids)])
            for pack, flat, at in whole
        ]
        self._check_values(
            [(pack.ids[0], flat, 0) for pack, flat, _ in whole]
            + [(sid, chunk, offset) for sid in chunks for offset, chunk in chunks[sid]],
            {pack.ids[0]: pack for pack, _, _ in whole},
        )
        in_packs = {sid for pack, _, _ in whole for sid in pack.ids}
        return plans + [
            self.store.plan_dense(sid, chunks[sid], ver)
            for sid, ver in zip(sids, versions, strict=True)
            if sid not in in_packs
        ]

    def _check_chunk_counts(self, by_shard: Mapping[int, Sequence[Tensor]]) -> None:
        """A shard's gradient comes in at most one chunk per :data:`MIN_CHUNK_BYTES` (or
        per the PS's own chunk size, if smaller), or in up to :data:`FREE_CHUNKS` chunks
        of any size: the work of a push stays in proportion to its bytes. (A push cut
        into 32,768 chunks of 8 bytes held the event loop 1.4 s, against 2 ms for the
        same bytes in one chunk.)"""
        least = max(1, min(MIN_CHUNK_BYTES, self.chunk_elems_bytes))
        for sid, ts in by_shard.items():
            d = self.store.get(sid).definition
            most = max(FREE_CHUNKS, -(-d.size * d.wire_dtype.itemsize // least))
            if len(ts) > most:
                raise InvalidArgument(
                    f"push: shard {sid} in {len(ts)} chunks, at most {most}"
                    f" (chunks of at least {least} bytes)"
                )

    def _check_values(
        self, grads: Sequence[tuple[int, Any, int]], packs: Mapping[int, Pack] | None = None
    ) -> None:
        """Every pushed gradient ``(shard, values, offset)`` is of its variable's dtype
        (the client converts; nothing else reaches a kernel), finite and below the
        dtype's limit past which an update could overflow: refused before anything
        changes. The value check reads a large push with several threads
        (:func:`first_bad_of`). ``packs``: the packs whose gradient is one entry, by
        their first shard (a bad value is said with the shard it belongs to)."""
        for sid, grad, _ in grads:
            shard = self.store.get(sid)
            if grad.dtype != shard.row_wire[0]:  # the dtype it travels as
                d = shard.definition
                travels = "" if d.wire is None else f" (travels as {d.wire})"
                raise InvalidArgument(
                    f"shard {sid}: the gradient is {grad.dtype}, the variable is {d.dtype}{travels}"
                )
        if self._values_known:
            return
        bad = first_bad_of([grad for _, grad, _ in grads], self.check_threads)
        if bad is not None:
            j, i = bad
            sid, grad, offset = grads[j]
            value = grad[i]
            pack = None if packs is None else packs.get(sid)
            if pack is not None:  # the member the element belongs to
                k = bisect.bisect_right(pack.bounds, i) - 1
                sid, offset = pack.ids[k], -pack.bounds[k]
            why = (
                ""
                if not math.isfinite(float(value))
                else f", at or past the limit {limit(grad.dtype):.4g} of {grad.dtype}"
                " values (an update could overflow)"
            )
            raise NonFiniteGradient(
                f"shard {sid}: gradient element {offset + i} is {value}{why}; nothing was applied"
            )

    def finite(self, tensors: Sequence[Tensor]) -> bool:
        """Whether a push's gradients (every tensor but row ids) are floats, all finite
        and below their dtype's limit: what :meth:`_check_values` reads, read once."""
        grads = [t.array.reshape(-1) for t in tensors if t.kind != "index"]
        if not all(g.dtype.kind == "f" or is_bfloat16(g.dtype) for g in grads):
            return False
        return first_bad_of(grads, self.check_threads) is None

    def checked(self, msg: Message) -> Message | Awaitable[Message]:
        """Handle ``msg``, whose values :meth:`finite` found good (on this copy or on
        the primary that shipped it): the finite check does not read them again."""
        self._values_known = True
        try:
            return self(msg)
        finally:
            self._values_known = False

    def _op_push(self, msg: Message, req: o.Push) -> Message | Awaitable[Message]:
        """``push`` and ``push_pull`` (the fresh values come back in the reply)."""
        pull = msg.op == "push_pull"
        try:
            plans = self._dense_plans(msg, req)
        except NonFiniteGradient:
            self._refused(req)
            raise
        out_views = None
        packs = req.packs or ()
        if pull and req.shm_out is not None:  # validated before applying; used after
            out_views = self.regions.views(self.store, req.shards, req.shm_out, req.worker, packs)
        out = self._commit(req, plans)  # no await in between: the views stay valid
        if pull and req.fresh and not out.duplicate:
            return self._fresh_values(msg, req, out, packs)
        if not pull:
            takes = DENSE_TAKES if self._hands_tokens() else None
            out = _with_versions(out, self._versions(req.shards), takes=takes)
            if req.token and req.step is not None and takes:
                return self._with_token(msg, out, req)
            return reply(msg, out.to_wire())
        if req.shm_out is not None and not out.duplicate:
            versions = self._snapshot_to_region(req.shards, req.shm_out, out_views, packs)
            return reply(msg, _with_versions(out, versions).to_wire())
        # TCP, or a resent shared-memory push_pull: the worker may already have the first
        # reply and be computing on the region, so the values travel in the reply instead
        # (a worker still waiting copies them in; else they are dropped)
        versions, tensors, packed = self._snapshot_tensors(req.shards, packs=packs)
        return reply(msg, _with_versions(out, versions, packed).to_wire(), tensors)

    def _op_push_rows(self, msg: Message, req: o.Push) -> Message:
        if req.shm_out is not None:
            raise InvalidArgument("push_rows: a pull region only with push_pull_rows")
        tensors = msg.tensors
        if req.shm is not None:  # the rows in the worker's push region: views of it
            tensors = self._rows_in_region(tensors, req.shards, req.shm, req.worker)
        return reply(msg, self._push_rows(req, tensors).to_wire())

    def _push_rows(self, req: o.Push, tensors: Sequence[Tensor]) -> o.PushReply:
        """Apply a row push whose tensors are ``tensors`` (``(index, rows)`` of each
        shard; its ``shm`` and ``shm_out`` are not read): its reply's body."""
        by_shard = self._grad_tensors(tensors, req, ("index", "rows"))
        for sid in req.shards:
            if [t.kind for t in by_shard[sid]] != ["index", "rows"]:
                raise InvalidArgument(f"push_rows: shard {sid} needs exactly (index, rows)")
        self._check_row_counts("push_rows", req.shards, [by_shard[s][0].array for s in req.shards])
        try:  # every shard's rows in one check, as a dense push's
            self._check_values([(sid, by_shard[sid][1].array.reshape(-1), 0) for sid in req.shards])
        except NonFiniteGradient:
            self._refused(req)
            raise
        plans: list[Update] = [
            self.store.plan_rows(sid, by_shard[sid][0].array, by_shard[sid][1].array, ver)
            for sid, ver in zip(req.shards, self._pulled(req.shards, req.versions), strict=True)
        ]
        if self.metrics is not None:
            for sid, ts in by_shard.items():
                var = self.store.get(sid).definition.var
                self.metrics.rows(var, "push", ts[0].array.shape[0])
        out = self._commit(req, plans)
        return _with_versions(out, self._versions(req.shards), takes=TAKES)

    def _versions(self, sids: Sequence[int]) -> list[int]:
        return [self.store.get(sid).version for sid in sids]

    def _hands_tokens(self) -> bool:
        """Whether a push's reply may carry the worker's next token: sync, and not a
        replicated state (whose sync pushes are answered once their entry is on every
        copy: the worker asks for its token as before)."""
        return isinstance(self.mode, Accumulate) and self.replica is None

    def _with_token(
        self, msg: Message, out: o.PushReply, req: o.Push
    ) -> Message | Awaitable[Message]:
        """The reply to a push that asked for the worker's next token (``Push.token``):
        with it, the step after the push's as the chief released it here (the same one
        to a push sent again), at once or within :data:`PUSH_TOKEN_WAIT_S`; without it
        after that (the worker asks with ``take_token``, as before). Whatever became of
        the push, the worker computed its step: the next token is the one after it."""
        have = req.step

        def answer(final: bool) -> Message | None:
            token = self.tokens.grant(have, self.gen)
            if token is None:
                return reply(msg, out.to_wire()) if final else None
            step, gen = token
            with_token = replace(out, token_step=step, token_gen=gen, token_ps=self.index)
            return reply(msg, with_token.to_wire())

        return self._held(answer, self._token_changes.wait, token=True)

    def _held(
        self,
        answer: Callable[[bool], Message | None],
        changed: Callable[[float], Awaitable[Any]],
        token: bool,
    ) -> Message | Awaitable[Message]:
        """A push's reply that may wait: ``answer(False)`` now, or, while that is None,
        again after each change (``changed(left)``: a release, a step) within
        :data:`PUSH_TOKEN_WAIT_S`, when ``answer(True)`` answers whatever it has; at
        once with that where the server has no room for one more pending request (a
        :class:`Held`: the push is applied, so it is never refused ``busy``).
        ``token``: the wait is reported as a token request's (``zmqps status``)."""
        now = answer(False)
        if now is not None:
            if token:
                self.tokens.waited(0.0)
            return now

        async def held() -> Message:
            # looked at again first: the release may have come between the handler's
            # return and this coroutine's start (pushes handled in one batch, the last
            # of them completing the step)
            loop = asyncio.get_running_loop()
            started = loop.time()
            deadline = started + PUSH_TOKEN_WAIT_S
            while True:
                left = deadline - loop.time()
                got = answer(left <= 0)
                if got is not None:
                    if token:
                        self.tokens.waited(loop.time() - started)
                    return got
                await changed(left)

        def at_once() -> Message:  # no room to hold it (the server's pending bound)
            if token:
                self.tokens.waited(0.0)
            got = answer(True)
            assert got is not None  # (a final answer always answers)
            return got

        return Held(held(), at_once)

    def _fresh_values(
        self, msg: Message, req: o.Push, out: o.PushReply, packs: Sequence[int]
    ) -> Message | Awaitable[Message]:
        """The reply to a sync ``push_pull`` that asks for the values of after its step
        (``Push.fresh``): the worker's next pull, saved. Held until this PS applied the
        push's step (and, asked for, released the next token), at most
        :data:`PUSH_TOKEN_WAIT_S`; then it brings the values read at that moment and
        the step they are of (``values_step``). Answered at once with no values
        (``unvalued``) where this PS holds no such replies (not sync, replicated), and
        with none after the wait (the worker pulls, as without)."""
        if req.step is None or not self._hands_tokens():  # (a worker then stops asking)
            bare = replace(_with_versions(out, self._versions(req.shards)), unvalued=True)
            return reply(msg, bare.to_wire())
        out = _with_versions(out, self._versions(req.shards), takes=DENSE_TAKES)
        bare = replace(out, unvalued=True)
        want, asked, step = req.step + 1, bool(req.token), req.step

        def answer(final: bool) -> Message | None:
            if self.visible_step < want:
                return reply(msg, bare.to_wire()) if final else None
            token = self.tokens.grant(step, self.gen) if asked else None
            if asked and token is None and not final:
                return None
            body = (
                out
                if token is None
                else replace(out, token_step=token[0], token_gen=token[1], token_ps=self.index)
            )
            return self._with_values(msg, req, body, packs, bare)

        def changed(left: float) -> Awaitable[Any]:
            if self.visible_step < want:
                return self.waiters.wait(want, left)
            return self._token_changes.wait(left)

        return self._held(answer, changed, token=asked)

    def _with_values(
        self, msg: Message, req: o.Push, out: o.PushReply, packs: Sequence[int], bare: o.PushReply
    ) -> Message:
        """``out`` with the values of the push's shards now, and their step: into the
        worker's pull region (looked up again: the reply may have been held) or in
        the reply; ``bare`` (with ``out``'s token) where the region is gone meanwhile."""

        def stamped(body: o.PushReply, values_step: int | None = None) -> o.PushReply:
            return replace(
                body,
                takes=out.takes,
                token_step=out.token_step,
                token_gen=out.token_gen,
                token_ps=out.token_ps,
                values_step=values_step,
            )

        step = self.visible_step
        if req.shm_out is not None:
            try:
                views = self.regions.views(self.store, req.shards, req.shm_out, req.worker, packs)
            except ZmqpsError:
                return reply(msg, stamped(bare).to_wire())
            versions = self._snapshot_to_region(req.shards, req.shm_out, views, packs)
            return reply(msg, stamped(_with_versions(out, versions), values_step=step).to_wire())
        versions, tensors, packed = self._snapshot_tensors(req.shards, packs=packs)
        body = stamped(_with_versions(out, versions, packed), values_step=step)
        return reply(msg, body.to_wire(), tensors)

    def _commit(self, req: o.Push, plans: Sequence[Update]) -> o.PushReply:
        """Deduplicate, then commit a validated push through the consistency mode."""
        if self.mode.name == "sync" and req.step is None:
            raise InvalidArgument("sync mode: a push carries its local step (take a token first)")
        if not self._is_new(req):
            return o.PushReply(False, duplicate=True)
        if (
            req.step is not None
            and req.cursor is not None
            and self.pushes.counted_at_another_step(req.worker, req.cursor, req.step)
        ):
            # a batch counted here toward an earlier step already (a new incarnation
            # redoing what its predecessor pushed to some PS only; the step went on
            # meanwhile): never applied twice, counted toward this step as nobody's
            # gradient so the step waits for no one
            self._drop("duplicate", req.worker)
            self._count_as_nobodys(req)
            return o.PushReply(False, duplicate=True)
        tagged = req.closure is not None and req.closure_seq is not None
        if tagged and not self.closures.is_new(req.closure, req.closure_seq):  # type: ignore[arg-type]
            # a scheduled function run again: this push of it was applied already
            self.closures.dropped += 1
            self._drop("duplicate", req.worker)
            self.dedup.commit(req.worker, req.inc, req.seq)
            return o.PushReply(False, duplicate=True)
        try:
            done = self.mode.commit(req.shards, plans, req.worker, req.step)
        except RolledBack as e:
            self._drop("rolled_back", req.worker)
            raise RolledBack(f"ps {self.index}: {e}") from None
        except NonFiniteGradient:  # a float16 update past 65504: undone, refused
            self._refused(req)
            raise
        if done.dropped is not None:
            self._drop(done.dropped, req.worker)
        else:
            self.pushes.applied(req.worker, req.inc, self.gen, req.cursor, req.step)
            if tagged:
                self.closures.commit(req.closure, req.closure_seq)  # type: ignore[arg-type]
        if done.advanced:
            self.waiters.notify()
        self.dedup.commit(req.worker, req.inc, req.seq)
        if done.dropped is not None:
            return o.PushReply(False, dropped=done.dropped)
        return o.PushReply(True, done.staleness)

    def replay_step(self, msg: Message) -> None:
        """A backup applies its primary's ``sync_step`` entry (replication after
        aggregation): the shards' accumulated gradients become the primary's, then each
        push is counted as the primary counted it (deduplication, ledgers, its place in
        the step), with no gradient: a step one of them completes applies the sum the
        primary applied, with the same kernels, so the values stay bit-identical."""
        req = o.SyncStep.from_wire(msg.body)
        mode = self.mode
        if not isinstance(mode, Accumulate):
            raise InvalidArgument(
                f"ps {self.index}: a sync step entry, and the mode is {mode.name}"
            )
        if len(msg.tensors) != len(req.data):
            raise InvalidArgument("sync_step: one tensor per data item expected")
        data: dict[int, tuple[Any, dict[int, Any], dict[int, Any]]] = {}
        for (sid, what, item), t in zip(req.data, msg.tensors, strict=True):
            dense, ids, rows = data.setdefault(sid, (None, {}, {}))
            if what == "sum":
                data[sid] = (t.array.reshape(-1), ids, rows)
            else:
                (ids if what == "ids" else rows)[item] = t.array
        for sid, (dense, ids, rows) in data.items():
            if ids.keys() != rows.keys() or sorted(ids) != list(range(len(ids))):
                raise InvalidArgument(f"sync_step: shard {sid}'s row gradients do not pair up")
            mode.shards.install_data(sid, dense, [(ids[i], rows[i]) for i in range(len(ids))])
        mode.shards.ghost = True
        try:
            for op, body, refused in req.pushes:
                push = o.PushRows.from_wire(body) if op == "push_rows" else o.Push.from_wire(body)
                with contextlib.suppress(ZmqpsError):  # refused there too, the same way
                    self._replay_push(op, push, refused)
        finally:
            mode.shards.ghost = False

    def _replay_push(self, op: str, req: o.Push, refused: bool) -> None:
        """One push of a ``sync_step`` entry, as :meth:`_op_push` / :meth:`_op_push_rows`
        and :meth:`__call__` counted it on the primary."""
        self._check_generation(op, req.gen)
        if refused:
            self._refused(req)
            self._drop("nonfinite")
            return
        rows = op == "push_rows"
        plans = [
            self.store.plan_counted(sid, ver, rows=rows)
            for sid, ver in zip(req.shards, self._pulled(req.shards, req.versions), strict=True)
        ]
        self._commit(req, plans)

    def _refused(self, req: o.Push | o.PushRows) -> None:
        """A push refused for its values (not finite): nothing is applied, but its batch
        is done (the worker skips it and goes on: its cursor counts, so it is never
        trained again) and, sync, it counts toward its step as a gradient of nobody's,
        so the step is not left waiting for it (the mean is of the others)."""
        if not self._is_new(req):
            return
        self.pushes.refused(req.worker, req.cursor, req.step)
        self._count_as_nobodys(req)

    def _count_as_nobodys(self, req: o.Push | o.PushRows) -> None:
        """Nothing of the push is applied; sync, it counts toward its step as nobody's
        gradient (the step waits for no one); the push is recorded as done."""
        if req.step is not None:
            self.mode.refuse(req.shards, req.worker, req.step)
        self.dedup.commit(req.worker, req.inc, req.seq)
        self.waiters.notify()

    def _is_new(self, req: o.Push) -> bool:
        try:
            new = self.dedup.check(req.worker, req.inc, req.seq)
        except FencedError:
            self.fenced += 1
            self._drop("fenced", req.worker)
            raise
        if not new:
            self.duplicates += 1
            self._drop("duplicate", req.worker)
            log.debug("ps %d: duplicate push %s/%s/%s", self.index, req.worker, req.inc, req.seq)
        return new

    # -- sync coordination -----------------------------------------------------

    def _op_sync_config(self, msg: Message, req: o.SyncConfigure) -> Message:
        mode = make_mode(req.mode, self.store, req.required, self.restored_step, self.mode)
        if mode is self.mode:
            if mode.set_required(req.required):
                self.waiters.notify()
        else:
            self.mode = mode
        if self.metrics is not None:
            self.metrics.set_info("ps", self.index, req.mode)
        self.notes.log(
            logging.INFO,
            "ps %d: mode %s (replicas to aggregate %d)",
            self.index,
            req.mode,
            req.required,
            key="sync_config",
        )
        return reply(msg, o.StepReply(step=self.visible_step).to_wire())

    def _step_moved(self, step: int) -> None:
        """The step (as others read it) may have moved: the tokens the chief let this
        PS release at it go out now."""
        tokens = self.tokens
        if tokens.then is not None and tokens.reached(step, self.gen, time.monotonic()):
            self._token_changes.notify_all()

    async def _op_wait_step(self, msg: Message, req: o.WaitStep) -> Message:
        releases = req.released is not None and req.gen is not None
        if releases and self.tokens.release(req.released or 0, req.gen or 0):
            self._token_changes.notify_all()
        if releases and req.release_until is not None and req.gen == self.gen:
            # every step up to it, each as this PS reaches it (the chief's last word)
            lease = time.monotonic() + (req.wait or 0.0) + RELEASE_LEASE_S
            self.tokens.allow_until(req.release_until, self.gen, lease)
            self._step_moved(self.visible_step)  # reached already
        elif releases and req.release_step and req.gen == self.gen:
            self.tokens.allow(req.step, self.gen)
            self._step_moved(self.visible_step)  # reached already
        elif releases:
            # the chief's last word: this boundary is its own (e.g. a checkpoint due; a
            # restarted chief's, whatever the last one allowed)
            self.tokens.then = None
        step = await self.waiters.wait(req.step, (0.0 if req.wait is None else req.wait))
        if not releases:  # not the chief's stepping poll: it does not take the report
            return reply(msg, o.StepReply(step=step).to_wire())
        of, granted, waits = self.tokens.report(req.released)
        tokens = self.tokens
        out = o.StepReply(
            step=step,
            granted_of=of,
            granted=granted,
            token_waits=tuple(waits) or None,
            releases=True,
            releases_until=True,
            released=tokens.step if tokens.gen == req.gen else None,
        )
        return reply(msg, out.to_wire())

    async def _op_take_token(self, msg: Message, req: o.TakeToken) -> Message:
        """A token of the step the chief released last (see ReleasedTokens), or
        NotReady after ``wait`` seconds: the worker then asks the chief."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        wait = 10.0 if req.wait is None else req.wait
        deadline = started + wait
        while True:
            token = self.tokens.grant(req.have, req.have_gen)
            if token is not None:
                self.tokens.waited(loop.time() - started)
                by_push = self._hands_tokens() or None
                out = o.Token(token[0], token[1], ps=self.index, by_push=by_push)
                return reply(msg, out.to_wire())
            left = deadline - loop.time()
            if left <= 0:
                raise NotReady(f"ps {self.index}: no token released within {wait:g}s")
            await self._token_changes.wait(left)

    # -- recovery --------------------------------------------------------------

    def chief_silent_for(self, now: float | None = None) -> float | None:
        """Seconds since a chief last probed this PS (``ps_state``, every heartbeat
        interval while one runs), or None if none ever did."""
        if self._chief_heard is None:
            return None
        return (time.monotonic() if now is None else now) - self._chief_heard

    def _op_ps_state(self, msg: Message, req: o.PsState) -> Message:
        """What a (restarted) chief needs to adopt this PS's state or to restore it."""
        self.chief_seen = True  # a chief probes every PS with this, shards or none
        self._chief_heard = time.monotonic()  # ... each heartbeat interval
        state = o.PsStateReply(
            index=self.index,
            boot=self.boot,
            gen=self.gen,
            shards=[[sh.definition.id, sh.version] for sh in self.store],
            mode="sync" if self.mode.name == "sync" else "",
            step=self.visible_step,
            contributors=tuple(self.mode.contributors(every_shard=False)),
            placement=self.placement,
            cursors=self.pushes.cursors() or None,
            done=self.pushes.finished() or None,
            rewinds=self.rewinds,
            highs=self.pushes.highs() or None,
            checkpoints=self.checkpoints.root is not None,
        )
        return reply(msg, state.to_wire())

    def _op_fence(self, msg: Message, req: o.Fence) -> Message:
        """The chief registered an incarnation of a worker: fence the older ones now,
        and say how far that worker's pushes got (read in the same turn). A name new
        here, the names at their bound, takes the place of the oldest name the chief
        never fenced: pushes under names no worker registered with (a client inventing
        them) never lock a registered worker out."""
        if self.dedup.full_for(req.worker):
            gone = self.dedup.unregistered()
            if gone is not None:
                self.dedup.forget(gone)
                self.pushes.forget(gone)
                self.notes.log(
                    logging.WARNING,
                    "ps %d: the worker names are at their bound: %s (never registered by the"
                    " chief) forgotten to keep %s",
                    self.index,
                    gone,
                    req.worker,
                    key="names_full",
                )
        if self.dedup.fence(req.worker, req.inc):
            self.notes.log(
                logging.INFO,
                "ps %d: %s incarnations before %d fenced",
                self.index,
                req.worker,
                req.inc,
                key="fence",
            )
        if req.left:
            self.pushes.left(req.worker, req.steps or 0)
        cursor, step = self.pushes.progress(req.worker)
        return reply(msg, o.Fenced(cursor, step, holds=bool(len(self.store))).to_wire())

    def _op_checkpoint_save(self, msg: Message, req: o.CheckpointSave) -> Message:
        if not len(self.store):  # restarted, not restored: its part would be missing
            raise NotReady(f"ps {self.index} holds no shards (restarted and not restored yet?)")
        sync_step = self.sync_step if self.mode.name == "sync" else None
        versions, cursors, seconds = self.checkpoints.save(
            req.name, req.id, self.pushes.included(sync_step)
        )
        log.debug("ps %d: checkpoint snapshot in %.3fs", self.index, seconds)
        saved = o.Saved(versions, self.sync_step, round(seconds, 6), cursors)
        return reply(msg, saved.to_wire())

    async def _op_checkpoint_done(self, msg: Message, req: o.CheckpointDone) -> Message:
        records = await self.checkpoints.done(req.id, (0.0 if req.wait is None else req.wait))
        return reply(msg, o.Written(records).to_wire())

    async def _op_restore(self, msg: Message, req: o.Restore) -> Message:
        """Replace every shard by its state in a checkpoint (``name``; resharded as the
        shard definitions say) or by its initial values (no ``name``); enter generation
        ``gen``. Every accumulated sync gradient is dropped; the PS is at ``step``."""
        defs = [ShardDef.from_wire(d) for d in req.shards]
        if req.gen < self.gen:
            raise InvalidArgument(f"ps {self.index}: restore to generation {req.gen} < {self.gen}")
        await self.checkpoints.restore(req.name, defs)
        self.gen = req.gen
        self.restored_step = req.step
        if req.placement is not None:
            self.placement = req.placement
        self.pushes.restored(req.cursors or {}, exact=req.rewind)
        self.rewinds = dict(req.cursors or {}) if req.rewind else None
        self.mode.reset(req.step)
        self.tokens.clear()  # the steps went back: nothing until the chief releases again
        self.waiters.notify()
        log.info(
            "ps %d: restored %d shards from %s (generation %d, step %d)",
            self.index,
            len(defs),
            req.name or "initial values",
            self.gen,
            req.step,
        )
        versions = [[d.id, self.store.get(d.id).version] for d in defs]
        return reply(msg, o.Restored(self.gen, versions).to_wire())

    def status(self) -> dict[str, Any]:
        out = {
            "role": "ps",
            "index": self.index,
            "gen": self.gen,
            "duplicates": self.duplicates,
            "fenced": self.fenced,
            "dropped": dict(self.dropped),
            "pushes": self.pushes.snapshot(STATUS_WORKERS),
            "applied_pushes": dict(
                islice(reversed(self.pushes.by_incarnation.items()), STATUS_WORKERS)
            ),
            "closures": self.closures.stats(),
            **self.store.stats(),
        }
        if len(self.pushes) > STATUS_WORKERS or len(self.pushes.by_incarnation) > STATUS_WORKERS:
            # a status stays small and quick whatever names clients sent
            out["pushes_cut"] = {
                "workers": len(self.pushes),
                "incarnations": len(self.pushes.by_incarnation),
                "listed": STATUS_WORKERS,
            }
        sync = self.mode.status()
        if sync is not None:
            out["sync"] = sync
        if self.replica is not None:
            out["replica"] = self.replica.state()
        return out


def split_index(msg: Message) -> Message:
    """A row request whose index tensors came joined into its first tensor (``counts``:
    the ids of each shard of ``shards``, then of ``pull``, back to back) as the request
    with one index tensor per shard, views of it (a TCP push's rows tensors, which
    follow it, each after its shard's index), without ``counts``: what a client that
    does not join them sends, so that everything past here (a replicated primary's
    log and its backups included) sees that. InvalidArgument if they do not add up."""
    body = msg.body
    counts = body["counts"]
    sids = list(body.get("shards", ()))
    pull = list(body.get("pull", ())) if msg.op == "push_pull_rows" else []
    if len(counts) != len(sids) + len(pull):
        raise InvalidArgument(f"{msg.op}: one count per shard named expected")
    if not msg.tensors:
        raise InvalidArgument(f"{msg.op}: counts without the joined index tensor")
    joined, rest = msg.tensors[0], msg.tensors[1:]
    ids = joined.array
    if joined.kind != "index" or joined.ref != -1 or ids.ndim != 1:
        raise InvalidArgument(f"{msg.op}: the joined ids must be one 1-D index tensor (ref -1)")
    if sum(counts) != ids.shape[0]:
        raise InvalidArgument(
            f"{msg.op}: counts of {sum(counts)} ids, the index holds {ids.shape[0]}"
        )
    rows = msg.op != "pull_rows" and body.get("shm") is None  # a TCP push: its rows follow
    if len(rest) != (len(sids) if rows else 0):
        raise InvalidArgument(f"{msg.op}: joined ids, then the rows of each pushed shard only")
    tensors: list[Tensor] = []
    lo = 0
    for k, (sid, n) in enumerate(zip([*sids, *pull], counts, strict=True)):
        tensors.append(Tensor(ids[lo : lo + n], "index", sid))
        if rows and k < len(sids):
            tensors.append(rest[k])
        lo += n
    return replace(
        msg, body={k: v for k, v in body.items() if k != "counts"}, tensors=tuple(tensors)
    )


def _with_versions(
    out: o.PushReply,
    versions: Sequence[int],
    packed: bool = False,
    takes: tuple[str, ...] | None = None,
) -> o.PushReply:
    return o.PushReply(
        out.applied,
        out.staleness,
        tuple(versions),
        out.duplicate,
        out.dropped,
        packed or None,
        takes=takes,
    )
