"""The copies of a PS state: its primary ships what it applied, its backups apply it.

Rules of this module:

* What is shipped: every request of an op that changes a PS state
  (``REPLICATED_OPS`` of :mod:`zmqps.wire.ops`; a pull of rows only when it names a
  hash-keyed table, :func:`changes_state`), whatever its outcome (a push
  applied, a duplicate, a refusal for its values all change the dedup window or the
  ledgers). A backup runs the same handler on the same requests in the same order,
  so it ends in the same state, bit for bit: the same store kernels, dedup window
  and ledgers on every copy (a refusal that changes nothing, :data:`_UNCHANGED`, is
  refused there too, and answered here at once).
* Sync pushes are replicated after aggregation: held here (applied, counted toward
  their step, not shipped) until the push that completes a step ships them all in
  one ``sync_step`` entry, without their gradients, with the sum the step applied;
  a backup replays their bookkeeping on that sum (``PSService.replay_step``).
  Anything else logged ships the held pushes first, with their shards' running
  sums, and so does :data:`HOLD_S` without the step completing. A held push is
  answered once its entry is committed.
* Order: a request is appended to the log, put on the wire to the backups
  (:meth:`Primary._kick`, sent before it returns) and applied here in one
  event-loop turn, so the log's order is the order the primary applied them in, and
  the backups apply it while the primary does. Room in the log (its bound,
  :mod:`zmqps.core.replication`) is waited for before the request is logged: a slow
  backup holds pushes back, it never makes the log grow.
* A request that changed the state is answered once every in-sync backup applied
  it (committed). Reads go to the primary and may see an update that is not
  committed yet; the push of that update is then not acknowledged, and is resent
  (deduplicated) if the primary dies.
* A shared-memory push travels to the backups as tensors: views of the worker's
  region, which the worker leaves alone until it has the push's answer (which comes
  after the backups have it).
* A backup on the primary's host takes an entry's tensors in a ring of shared memory
  the two map (:mod:`zmqps.roles.ps.ring`), not over TCP a second time: the entry
  names the ring and where each tensor is, and the backup reads them there, checked
  like buffers beside a message (:meth:`Backup.receive`).
* A backup answers each entry with the index it applied up to; an entry after a gap
  is answered with ``gap`` and the primary sends again from there; an entry of an
  older term (a primary replaced since) is refused. A copy in the backup role
  refuses requests from anyone but its primary (:class:`NotPrimary`).
* A new backup joins (re-replication; the chief's ``join``): the primary takes a
  whole copy of the state in one event-loop turn (:mod:`zmqps.roles.ps.image`),
  sends it as ``install`` parts at a throttled pace, then ships it every entry
  after the copy's; no commit waits for it until it caught up with the head. The
  entries kept for it are bounded (:data:`~zmqps.core.replication.JOIN_ENTRIES`,
  ``JOIN_BYTES``): one that falls further behind is dropped and the chief starts
  again later. While a copy joins, entries own their tensors (a shared-memory push's
  region is reused by its worker once answered, and the joiner gets it later).
* Who is primary, and which backups are in sync, is the chief's decision (the
  ``replica`` op): a backup that does not answer keeps pushes waiting until the chief
  drops it; the primary only retries. A primary whose entries a backup refuses as
  of an older term was replaced (it was cut off): it stops shipping and refuses
  every request that would change the state (``not_primary``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from zmqps.core.packs import units
from zmqps.core.replication import Entry, Offer, PrimaryLog, ReplicaLog
from zmqps.core.store import ShardStore
from zmqps.core.sync import SyncShards
from zmqps.roles.ps.image import Installing, Part
from zmqps.roles.ps.ring import RING_MAX_BYTES, RingLink
from zmqps.transport import Requester
from zmqps.transport.base import cancel_and_wait, send_soon, waited
from zmqps.transport.shm import HEADER_BYTES, Region, attach_region
from zmqps.wire import Message, Tensor, reply
from zmqps.wire import ops as o
from zmqps.wire.codec import check_spec
from zmqps.wire.errors import (
    DeadlineExceeded,
    FencedError,
    InvalidArgument,
    NonFiniteGradient,
    NotFound,
    NotPrimary,
    NotReady,
    ProtocolError,
    Superseded,
    ZmqpsError,
)

__all__ = ["Backup", "Primary", "changes_state"]

log = logging.getLogger("zmqps.ps")

#: refusals that change nothing but a counter: answered at once (but see changed_nothing)
_UNCHANGED = (InvalidArgument, NotFound, NotReady, ProtocolError)
#: seconds a primary waits for a backup's answer to an entry before sending again
SHIP_TIMEOUT = 2.0
#: seconds a backup's entries may fail before the primary says so in the log (and as
#: often after): a timeout or two is a backup busy; this long, one stuck or gone
FAILING_REPORT_S = 5.0
#: seconds a request waits for its commit when it carries no deadline
COMMIT_WAIT = 60.0
#: seconds a sync push is held for the push that completes its step (which ships the
#: step's sum once, :meth:`Primary.flush`); past it the held pushes ship with the
#: running sums, so a push is answered soon whoever else pushes
HOLD_S = 0.05
#: times one ``install`` part is sent before the join is given up
INSTALL_ATTEMPTS = 10
#: joins whose outcome a primary keeps for its status
KEEP_JOINS = 8

Handler = Callable[[Message], "Message | Any"]

#: the ops of a push: in sync mode replicated after aggregation (:meth:`Primary.flush`)
_PUSH_OPS = frozenset({"push", "push_pull", "push_rows"})


def changes_state(msg: Message, store: ShardStore) -> bool:
    """Whether the request is one a PS state's copies must all apply. A pull of rows
    changes only hash-keyed tables (rows created, ids sighted, rows touched): one that
    names none, or reads only (``create`` false), is a read like a dense pull."""
    if msg.op not in o.REPLICATED_OPS:
        return False
    if msg.op != "pull_rows":
        return True
    if msg.body.get("create") is False:
        return False
    shards = msg.body.get("shards", ())
    return not all(sid in store and not store.get(sid).is_table for sid in shards)


class _Signal:
    """Wakes whoever waits for the log to change (an append, an acknowledgement)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def until(self, ready: Callable[[], bool], deadline: float | None) -> None:
        """Wait until ``ready()`` (TimeoutError past ``deadline``, a monotonic time)."""
        while not ready():
            if deadline is None:
                await self._event.wait()
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError
            await waited(self._event.wait(), left)


class Primary:
    """The primary's side of one PS state: applies, logs, ships, answers on commit."""

    def __init__(
        self,
        slot: int,
        term: int,
        links: Mapping[int, Requester],
        *,
        head: int = 0,
        retained: tuple[Entry, ...] = (),
        acked: Mapping[int, int] | None = None,
        resolve: Callable[[Message], tuple[str, dict[str, Any], list[Tensor]]] | None = None,
        ship_timeout: float = SHIP_TIMEOUT,
        step: Callable[[], int] | None = None,
        on_commit: Callable[[], None] | None = None,
        sync: Callable[[], SyncShards | None] | None = None,
        finite: Callable[[Sequence[Tensor]], bool] | None = None,
        checked: Handler | None = None,
    ) -> None:
        """``links``: a requester to each backup (by PS index), bound to ``slot``;
        ``acked``: the entry each backup has (promotion), else ``head``; ``resolve``:
        turns a request into the entry's (op, body, tensors); ``step``: the state's
        sync step now; ``on_commit``: called when the step every copy has moves;
        ``sync``: the state's sync accumulators while it is in sync mode, else None
        (its pushes are then replicated after aggregation); ``finite``: whether a push's
        gradients are all finite and below their dtype's limit (the state's value
        check); ``checked``: the state's handler for a request whose values were found
        so (it does not look again)."""
        self.slot = slot
        #: the value check read once before shipping, and the handler that skips it
        self._values = None if finite is None or checked is None else (finite, checked)
        self.links = dict(links)
        self.ship_timeout = ship_timeout
        self._resolve = resolve or _as_entry
        at = {str(b): (head if acked is None else acked.get(b, 0)) for b in self.links}
        self.log = PrimaryLog(term, head, at, retained)
        self._signal = _Signal()
        self._closed = False
        #: links of dropped backups being closed
        self._closing: set[asyncio.Future[None]] = set()
        #: each backup's batch on the wire (see :meth:`_kick`)
        self._inflight: dict[int, set[asyncio.Task[None]]] = {}
        #: the ring of shared memory each backup on this host takes the tensors in
        self.rings = {b: RingLink(slot, b, link, term) for b, link in self.links.items()}
        self._senders = {b: asyncio.ensure_future(self._ship_to(b)) for b in self.links}
        #: entries shipped again (a timeout, a gap), for status
        self.resent = 0
        #: backups whose entries fail: (since, last said in the log), by PS
        self._failed_since: dict[int, tuple[float, float]] = {}
        #: a backup refused an entry of this term: another copy was promoted since
        #: (this process was cut off); it applies nothing more, ships nothing more
        self.fenced = False
        #: backups joining or joined lately: PS -> how the copy goes (bounded)
        self.joins: dict[int, dict[str, Any]] = {}
        #: the sync step as of the last committed entry, and the step after each entry
        #: not committed yet (at most the log's bound): a step read from this copy is
        #: one every backup has (see :meth:`visible`)
        self._step = step or (lambda: 0)
        self._on_commit = on_commit
        self.committed_step = self._step()
        self._steps: deque[tuple[int, int, float]] = deque()  # (entry, step, appended at)
        self._sync = sync or (lambda: None)
        #: sync pushes applied here and not in an entry yet, in the order applied (at
        #: most one step's: the push that completes a step ships them)
        self._held: list[_Held] = []
        self._hold_timer: asyncio.TimerHandle | None = None

    @property
    def term(self) -> int:
        return self.log.term

    def backups(self) -> list[int]:
        return sorted(int(b) for b in self.log.backups)

    async def run(self, msg: Message, handler: Handler) -> Message:
        """Apply ``msg`` with ``handler`` (the state's own), log it, and answer once
        every in-sync backup applied it."""
        self._check_fenced()
        sync = self._sync()
        if sync is not None and msg.op in _PUSH_OPS:
            return await self._run_held(msg, handler, sync)
        op, body, tensors = self._resolve(msg)
        if self.log.joining():  # kept for a joiner past the answer: own the data
            tensors = [Tensor(np.array(t.array), t.kind, t.ref, t.offset) for t in tensors]
        nbytes = sum(t.array.nbytes for t in tensors)
        deadline = _deadline(msg)

        def room() -> bool:  # held pushes go first, in an entry of their own
            if not self._held:
                return self.log.room(nbytes)
            return self.log.room(nbytes + _held_bound(self._sync()), 2)

        await self._room(room, deadline)
        self.flush()
        before = self._step()
        # logged and on its way to the backups before it is applied here: they apply
        # it while this copy does (the same handler on the same state gives the same
        # outcome, a refusal included, so nothing needs the outcome first)
        # a push's values are looked at once, here, before it ships: its copies (this
        # one too) then apply it without looking again (one refused for them is looked
        # at by every copy, and refused by each)
        apply = handler
        if op in _PUSH_OPS and self._values is not None and self._values[0](tensors):
            apply = self._values[1]
        entry = self.log.append((op, body, tensors, apply is not handler), nbytes, force=True)
        for b in self.links:
            self._kick(b)
        try:
            out, failure = await _apply(msg, apply)
        finally:
            if not self._steps:  # everything before was committed: so was the step then
                self.committed_step = before
            self._steps.append((entry.index, self._step(), time.monotonic()))
            self._changed()
        try:
            await self._signal.until(
                lambda: self.fenced or self._closed or self.log.committed >= entry.index,
                deadline,
            )
        except asyncio.TimeoutError:
            raise DeadlineExceeded(
                f"ps {self.slot}: applied but not yet on every backup ({self.backups()});"
                " send it again (it is deduplicated)"
            ) from None
        if self.log.committed < entry.index:
            self._check_fenced()  # not acknowledged: the new primary gets it again
        if failure is not None:
            raise failure
        assert out is not None
        return out

    async def _room(self, ready: Callable[[], bool], deadline: float) -> None:
        """Wait until ``ready()`` says the log has room (DeadlineExceeded past ``deadline``)."""
        if ready():
            return
        try:
            await self._signal.until(lambda: self.fenced or self._closed or ready(), deadline)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(
                f"ps {self.slot}: the replication log stayed full (a backup not answering)"
            ) from None
        self._check_fenced()

    async def _run_held(self, msg: Message, handler: Handler, sync: SyncShards) -> Message:
        """A sync push: applied here (counted toward its step), shipped without its
        gradient in the entry of the push that completes its step, with the sum that
        step applied (:meth:`flush`); answered once every in-sync backup has that
        entry. A worker's resent push is held the same way, so its answer (a
        duplicate) never comes before the first one's entry is on every copy."""
        deadline = _deadline(msg)
        extra = sum(t.array.nbytes for t in msg.tensors)  # rows it may add to the sums
        # (everything committed: any entry fits, and the bound, a pass over the shards,
        # is not needed; so on most pushes)
        await self._room(
            lambda: self.log.committed == self.log.head or self.log.room(_held_bound(sync) + extra),
            deadline,
        )
        before, applied = self._step(), sync.steps_applied
        sync.capture = True  # a step this push completes keeps the sum it applied
        try:
            out, failure = await _apply(msg, handler)
        finally:
            sync.capture = False
        body = {k: v for k, v in msg.body.items() if k not in ("shm", "shm_out")}
        op = "push_rows" if msg.op == "push_rows" else "push"
        held = _Held(op, body, isinstance(failure, NonFiniteGradient))
        self._held.append(held)
        if (
            sync.steps_applied != applied
            or not self.log.backups  # nothing to save: committed at once
            or len(self._held) >= o.MAX_STEP_PUSHES
        ):
            self.flush(before)  # in this turn: room was made for it above
        elif self._hold_timer is None:  # a step that does not complete soon ships anyway
            self._hold_timer = asyncio.get_running_loop().call_later(HOLD_S, self._held_due)
        try:
            await self._signal.until(
                lambda: self.fenced or self._closed or held.committed(self.log.committed),
                deadline,
            )
        except asyncio.TimeoutError:
            raise DeadlineExceeded(
                f"ps {self.slot}: applied, and its step is not yet on every backup"
                f" ({self.backups()}); send it again (it is deduplicated)"
            ) from None
        if not held.committed(self.log.committed):
            self._check_fenced()
            raise NotPrimary(f"ps {self.slot}'s state is no longer served here: send again")
        if failure is not None:
            raise failure
        assert out is not None
        return out

    def flush(self, before: int | None = None) -> None:
        """Put the held sync pushes in one entry (``sync_step``): their bodies, and the
        accumulated gradients of the shards they touched (the sum a step applied, or
        the running sum); ``before``: the step before the first of them was applied
        (default: now). Called before anything else is logged, and before a copy of the
        state is taken for a joining backup, so the log keeps the order things were
        applied in."""
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        if not self._held:
            return
        sync = self._sync()
        items: list[list[Any]] = []
        tensors: list[Tensor] = []
        for sid, dense, rows in [] if sync is None else sync.take_data():
            if dense is not None:
                items.append([sid, "sum", 0])
                tensors.append(Tensor(dense, "grad", sid, 0))
            for i, (ids, grads) in enumerate(rows):
                items += [[sid, "ids", i], [sid, "rows", i]]
                tensors += [Tensor(ids, "index", sid, 0), Tensor(grads, "grad", sid, 0)]
        held, self._held = self._held, []
        pushes = tuple([h.op, h.body, h.refused] for h in held)
        body = o.SyncStep(pushes, tuple(items)).to_wire()
        if not self._steps:  # everything before was committed: so was the step then
            self.committed_step = self._step() if before is None else before
        entry = self.log.append(
            (o.SYNC_STEP, body, tensors, False), sum(t.array.nbytes for t in tensors), force=True
        )
        for h in held:
            h.index = entry.index
        for b in self.links:
            self._kick(b)
        self._steps.append((entry.index, self._step(), time.monotonic()))
        self._changed()

    def _held_due(self) -> None:
        """Held pushes waited :data:`HOLD_S` for their step: ship them with the running
        sums (room was made for such an entry when each was applied, and anything
        logged since shipped them first)."""
        self._hold_timer = None
        if not (self._closed or self.fenced):
            self.flush()

    def visible(self, step: int) -> int:
        """``step`` (the state's sync step now) as far as every backup has it: a chief
        that reads a step here and goes on never sees it undone by a fail-over (a step
        completed by an entry not committed yet is not told)."""
        return step if not self._steps else min(step, self.committed_step)

    def lag(self) -> tuple[float, dict[int, int]]:
        """Seconds the oldest entry not committed has waited (0: none waits), and the
        entries each backup has not acknowledged. Read by the metrics exporter's thread
        while the event loop changes the log: copies first, nothing indexed twice."""
        try:
            waited = time.monotonic() - self._steps[0][2]
        except IndexError:
            waited = 0.0
        head = self.log.head
        return waited, {int(b): head - info.acked for b, info in list(self.log.backups.items())}

    def _changed(self) -> None:
        """The log changed: take the step of what is committed, wake the waiters."""
        moved = False
        while self._steps and self._steps[0][0] <= self.log.committed:
            self.committed_step = self._steps.popleft()[1]
            moved = True
        if moved and self._on_commit is not None:
            self._on_commit()
        self._signal.notify()

    def _check_fenced(self) -> None:
        if self.fenced:
            raise NotPrimary(
                f"ps {self.slot}'s state has a newer primary (term past {self.term}):"
                " send to the one the placement names"
            )
        if self._closed:  # stepped down (a move, a newer term): what waited goes elsewhere
            raise NotPrimary(
                f"ps {self.slot}'s state is no longer served here (its primary of term"
                f" {self.term} stepped down): send to the one the placement names"
            )

    def drop(self, backup: int) -> None:
        """``backup`` is gone (the chief says): nothing waits for it any more."""
        self.log.remove(str(backup))
        task = self._senders.pop(backup, None)
        if task is not None:
            task.cancel()
        for task in self._inflight.pop(backup, set()):
            task.cancel()
        ring = self.rings.pop(backup, None)
        if ring is not None:
            self._closing.add(asyncio.ensure_future(ring.close()))
        link = self.links.pop(backup, None)
        if link is not None:  # an open socket would hang the context's termination
            self._closing.add(asyncio.ensure_future(link.close()))
        self._changed()

    def join(self, backup: int, link: Requester, parts: list[Part], rate: float | None) -> int:
        """Bring ``backup`` (not one yet) in: ``parts`` is a copy of the state as of the
        head now (taken in this event-loop turn); returns that entry's index."""
        at = self.log.head
        self.log.join(str(backup), at, installing=True)
        self.links[backup] = link
        self.rings[backup] = RingLink(self.slot, backup, link, self.term)
        self.joins[backup] = {
            "state": "copying",
            "at": at,
            "parts": len(parts),
            "sent": 0,
            "bytes": 0,
            "total_bytes": sum(p.nbytes for p in parts),
            "seconds": 0.0,
        }
        while len(self.joins) > KEEP_JOINS:
            self.joins.pop(next(iter(self.joins)))
        self._senders[backup] = asyncio.ensure_future(self._copy_to(backup, parts, at, rate))
        log.info(
            "ps %d: copying the state to ps %d (as of entry %d, %d parts)",
            self.slot,
            backup,
            at,
            len(parts),
        )
        return at

    async def _copy_to(self, backup: int, parts: list[Part], at: int, rate: float | None) -> None:
        name = str(backup)
        info = self.joins[backup]
        started = time.monotonic()
        try:
            for p in parts:
                body = o.Install(
                    self.term,
                    at,
                    p.index,
                    p is parts[-1],
                    tuple(p.items),
                    None if p.defs is None else tuple(p.defs),
                    p.meta,
                    p.state,
                ).to_wire()
                if not await self._install_part(backup, body, p):
                    return
                info["sent"] += 1
                info["bytes"] += p.nbytes
                info["seconds"] = round(time.monotonic() - started, 3)
                if rate:  # throttled: training keeps most of the bandwidth
                    ahead = info["bytes"] / rate - (time.monotonic() - started)
                    if ahead > 0:
                        await asyncio.sleep(ahead)
            if name not in self.log.backups:
                info["state"] = "failed: dropped while copying (fell too far behind)"
                return
            self.log.installed(name)
            info["state"] = "catching up"
            info["seconds"] = round(time.monotonic() - started, 3)
            self._changed()
            await self._ship_to(backup)
        finally:
            if name not in self.log.backups and backup in self.links and not self._closed:
                self.drop(backup)

    async def _install_part(self, backup: int, body: dict[str, Any], p: Part) -> bool:
        info = self.joins[backup]
        for attempt in range(INSTALL_ATTEMPTS):
            link = self.links.get(backup)
            if link is None or str(backup) not in self.log.backups or self._closed:
                info["state"] = "failed: removed while copying"
                return False
            try:
                await link.request("install", body, p.tensors, timeout=4 * self.ship_timeout)
                return True
            except (FencedError, Superseded) as exc:
                info["state"] = f"failed: {exc}"
                self._replaced(backup, exc)
                return False
            except ZmqpsError as exc:
                log.debug("ps %d: part %d to ps %d: %s", self.slot, p.index, backup, exc)
                info["state"] = f"copying (part {p.index} sent again: {exc.code})"
                await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
        info["state"] = f"failed: part {p.index} not taken after {INSTALL_ATTEMPTS} attempts"
        self.log.remove(str(backup))
        return False

    def _kick(self, backup: int) -> None:
        """Put the entries ``backup`` was not sent on the wire now, unless a batch to
        it is still unanswered (one batch at a time: the next goes when it is answered
        or sent again)."""
        name = str(backup)
        inflight = self._inflight.setdefault(backup, set())
        link = self.links.get(backup)
        if inflight or link is None or self._closed or self.fenced or name not in self.log.backups:
            return
        ring = self.rings.get(backup)
        for e in self.log.to_send(name):
            op, body, tensors, known = e.payload
            committed = self.log.committed
            placed = None if ring is None else ring.place(e.index, tensors)
            ring_name, specs = (None, None) if placed is None else placed
            # sent at this primary's term: an entry a promoted copy kept from the
            # replaced primary (its term older) is this primary's to send, and a backup
            # fenced at the new term refuses only what is older than that
            wire = o.Replicate(
                self.log.term,
                e.index,
                op,
                body,
                committed,
                ring_name=ring_name,
                ring=None if specs is None else tuple(specs),
                checked=True if known else None,
            ).to_wire()
            beside = tensors if placed is None else []
            answer = send_soon(link, "replicate", wire, beside, timeout=self.ship_timeout)
            if ring is not None and placed is not None:  # the ring's count of entries out
                answer.add_done_callback(ring.answered_by(placed[0]))
            task = asyncio.ensure_future(self._answered(backup, e, answer, committed))
            inflight.add(task)
            task.add_done_callback(inflight.discard)

    async def _ship_to(self, backup: int) -> None:
        name = str(backup)
        inflight = self._inflight.setdefault(backup, set())
        try:
            while name in self.log.backups and not self._closed and not self.fenced:
                self._kick(backup)
                if inflight:
                    await asyncio.wait(set(inflight))
                    continue
                await self._signal.until(
                    lambda: (
                        name not in self.log.backups or self.log.backups[name].sent < self.log.head
                    ),
                    None,
                )
        finally:
            for task in inflight:
                task.cancel()

    async def _answered(
        self,
        backup: int,
        e: Entry,
        answer: asyncio.Future[Message],
        committed: int,
    ) -> None:
        """``backup``'s answer to entry ``e``, sent with ``committed``."""
        name = str(backup)
        try:
            done = o.Replicated.parse((await answer).body)
        except (FencedError, Superseded) as exc:
            self._replaced(backup, exc)
            return
        except ZmqpsError as exc:
            self._failing(backup, e, exc)
            await self._again(name)
            return
        self._failed_since.pop(backup, None)
        ring = self.rings.get(backup)
        if ring is not None:  # applied there, and not kept for a promotion
            ring.release(min(committed, done.applied))
        task = asyncio.current_task()
        if task is not None:  # answered: once the batch is, the next may go at once
            self._inflight.get(backup, set()).discard(task)
        if name not in self.log.backups:
            return
        self.log.ack(name, done.applied)
        if done.gap:
            self.log.resend(name)
            self.resent += 1
        self._changed()

    def _failing(self, backup: int, e: Entry, exc: ZmqpsError) -> None:
        """An entry to ``backup`` failed (it is sent again): said in the log once it has
        gone on past :data:`FAILING_REPORT_S` (every commit of this state waits for
        that backup until it answers or the chief drops it), and as often after."""
        now = time.monotonic()
        since, said = self._failed_since.setdefault(backup, (now, now))
        if now - said < FAILING_REPORT_S:
            log.debug("ps %d: entry %d to backup %d: %s", self.slot, e.index, backup, exc)
            return
        self._failed_since[backup] = (since, now)
        log.warning(
            "ps %d: backup ps %d has taken no entry for %.0fs (entry %d: %s); the state's"
            " commits wait for it",
            self.slot,
            backup,
            now - since,
            e.index,
            exc,
        )

    def _replaced(self, backup: int, exc: Exception) -> None:
        """A copy refused this primary's term: another copy was promoted since."""
        if not self.fenced:
            log.warning("ps %d: replaced as primary (ps %d: %s)", self.slot, backup, exc)
        self.fenced = True
        self._changed()

    async def _again(self, name: str) -> None:
        await asyncio.sleep(0.05)
        if name in self.log.backups:
            self.log.resend(name)
            self.resent += 1
            self._changed()

    def state(self) -> dict[str, Any]:
        n, nbytes = self.log.unacked()
        return {
            "role": "primary",
            "term": self.log.term,
            "head": self.log.head,
            "committed": self.log.committed,
            "backups": {b: self.log.backups[b].acked for b in self.log.backups},
            "waiting": n,
            "waiting_bytes": nbytes,
            "resent": self.resent,
            "fenced": self.fenced,
            "joins": {str(b): self._join_state(b) for b in self.joins},
            "rings": {str(b): r.state() for b, r in self.rings.items() if r.sent or r.off},
        }

    def _join_state(self, backup: int) -> dict[str, Any]:
        info = dict(self.joins[backup])
        b = self.log.backups.get(str(backup))
        if b is not None and b.in_sync:
            info["state"] = "in sync"
        elif b is None and not str(info["state"]).startswith("failed"):
            info["state"] = "failed: dropped (fell too far behind, or removed)"
        return info

    async def close(self) -> None:
        self._closed = True
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        for task in [*self._senders.values(), *(t for s in self._inflight.values() for t in s)]:
            task.cancel()
        for task in self._senders.values():
            await cancel_and_wait(task, Exception)
        self._senders.clear()
        for ring in self.rings.values():
            await ring.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        self._changed()


class _Held:
    """A sync push applied by the primary and not yet shipped (:meth:`Primary.flush`)."""

    __slots__ = ("body", "index", "op", "refused")

    def __init__(self, op: str, body: dict[str, Any], refused: bool) -> None:
        self.op = op
        self.body = body
        self.refused = refused  # for its values: replayed as a refusal
        self.index: int | None = None  # its entry, once shipped

    def committed(self, committed: int) -> bool:
        return self.index is not None and committed >= self.index


async def _apply(msg: Message, handler: Handler) -> tuple[Message | None, ZmqpsError | None]:
    """``handler``'s answer to ``msg``, or the refusal that changed the state (one that
    changed nothing, nor will on the backups, is raised: answered at once)."""
    try:
        result = handler(msg)
        if inspect.isawaitable(result):  # none of REPLICATED_OPS waits: defensive
            result = await result
        return result, None
    except ZmqpsError as exc:
        if changed_nothing(exc):
            raise
        return None, exc


def _held_bound(sync: SyncShards | None) -> int:
    """At most the bytes of an entry of held pushes (their shards' sums)."""
    return 0 if sync is None else sync.held_bytes()


def _deadline(msg: Message) -> float:
    """The monotonic time by which ``msg`` must be answered."""
    return time.monotonic() + (
        COMMIT_WAIT if msg.deadline is None else max(0.0, msg.deadline - time.time())
    )


class Backup:
    """A backup's side of one PS state: applies the primary's entries in order."""

    def __init__(self, slot: int, term: int, applied: int = 0) -> None:
        self.slot = slot
        self.log = ReplicaLog(term, applied)
        #: a whole copy on its way (its parts staged; at most one)
        self._installing: Installing | None = None
        #: copies installed, and the last one's (term, entry): its last part sent again
        #: (the answer was lost) is answered, not refused
        self.installed = 0
        self._last: tuple[int, int] | None = None
        #: the ring of shared memory the primary writes entries' tensors into (one)
        self.ring: Region | None = None

    @property
    def term(self) -> int:
        return self.log.term

    def expect_copy(self) -> None:
        """The chief asks for a copy to be made here (``replica`` with ``make``): a whole
        copy follows, to be installed even if it is as of the same (term, entry) as the
        one installed last (a copy left by a move given up, its primary since replaced
        by a restarted process restored at the same term), not answered as that copy's
        last part sent again."""
        self._last = None

    def attach_ring(self, msg: Message) -> Message:
        """The primary shares a ring with this copy (``replica_ring``): map it, after
        :func:`~zmqps.transport.shm.attach_region`'s checks, in place of any earlier
        one (whose views, kept entries', keep their mapping while they live)."""
        req = o.ReplicaRing.from_wire(msg.body)
        if req.term < self.log.term:
            raise FencedError(
                f"ps {self.slot}'s copy follows term {self.log.term}; the ring is of term"
                f" {req.term} (a primary since replaced)"
            )
        region = attach_region(req.name, req.size, max_bytes=RING_MAX_BYTES + HEADER_BYTES)
        self.close()
        self.ring = region
        return reply(msg, o.RingAttached(region.token.hex()).to_wire())

    def _from_ring(self, req: o.Replicate, beside: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """An entry's tensors, read in place in the ring (checked as the codec checks
        buffers beside a message, and each inside the ring)."""
        ring = self.ring
        if ring is None or ring.name != req.ring_name:
            raise NotFound(f"ps {self.slot}'s copy shares no ring {req.ring_name} with its primary")
        if beside:
            raise InvalidArgument("replicate: tensors both in the ring and beside")
        out = []
        for i, spec in enumerate(req.ring or ()):
            dtype, shape, kind, ref, offset = check_spec(
                list(spec[:5]), i, ring.data_bytes, "replicate.ring"
            )
            count = int(np.prod(shape, dtype=np.int64))
            arr = ring.view(spec[5], dtype, count).reshape(shape)
            out.append(Tensor(arr, kind, ref, offset))
        return tuple(out)

    def close(self) -> None:
        """Unmap the ring (arrays still viewing it keep it until they go)."""
        if self.ring is not None:
            self.ring.close()
            self.ring = None

    async def receive(
        self,
        msg: Message,
        handler: Handler,
        replay: Callable[[Message], None] | None = None,
        checked: Handler | None = None,
    ) -> Message:
        """Entry ``msg`` from the primary, applied with ``handler`` (the state's own),
        with ``checked`` when the primary found its values finite (``checked``: they
        are not looked at again) or, a ``sync_step`` entry, with ``replay``."""
        req = o.Replicate.from_wire(msg.body)  # the inner body too was checked by the codec
        tensors = msg.tensors
        if req.ring is not None and req.term >= self.log.term:  # an older one is refused
            tensors = self._from_ring(req, tensors)
        payload = (req.op, dict(req.body), list(tensors), bool(req.checked))
        nbytes = sum(t.array.nbytes for t in tensors)
        offer = self.log.offer(Entry(req.index, req.term, payload, nbytes))
        if offer is Offer.STALE:
            raise FencedError(
                f"ps {self.slot}'s copy follows term {self.log.term}; the entry is of term"
                f" {req.term} (a primary since replaced)"
            )
        if req.committed is not None:
            self.log.forget(min(req.committed, self.log.applied))
        if offer is Offer.GAP:
            return reply(msg, o.Replicated(self.log.applied, gap=True).to_wire())
        if offer is Offer.APPLY:
            inner = Message(req.op, msg.id, msg.sender, req.body, tensors)
            if req.op == o.SYNC_STEP:
                if replay is None:
                    raise InvalidArgument(f"ps {self.slot}'s copy cannot replay a sync step")
                handler = replay
            elif req.checked and checked is not None:
                handler = checked
            try:
                result = handler(inner)
                if inspect.isawaitable(result):
                    await result
            except ZmqpsError:
                pass  # refused on the primary too: the same state changed the same way
        return reply(msg, o.Replicated(self.log.applied).to_wire())

    def install(self, msg: Message, service: Any) -> Message:
        """A part of a whole copy from the primary; the last one makes ``service`` the
        copy, as of the copy's entry (all or nothing)."""
        req = o.Install.from_wire(msg.body)
        if req.term < self.log.term:
            raise FencedError(
                f"ps {self.slot}'s copy follows term {self.log.term}; the copy is of term"
                f" {req.term} (a primary since replaced)"
            )
        staged = self._installing
        if staged is None and req.last and self._last == (req.term, req.index):
            return reply(msg, o.Replicated(self.log.applied).to_wire())
        if req.part == 0:
            if req.defs is None:
                raise InvalidArgument("install: the first part carries the shard definitions")
            staged = self._installing = Installing(req.term, req.index, req.defs, req.meta)
        elif staged is None or (staged.term, staged.index) != (req.term, req.index):
            raise InvalidArgument(f"install: part {req.part} of a copy not begun")
        try:
            staged.add(req.part, req.items, msg.tensors)
            if req.last:
                if req.state is None:
                    raise InvalidArgument("install: the last part carries the ledgers")
                staged.finish(service, req.state)
        except InvalidArgument:
            self._installing = None
            raise
        if req.last:
            self._installing = None
            self.log = ReplicaLog(req.term, req.index, self.log.max_entries, self.log.max_bytes)
            self.installed += 1
            self._last = (req.term, req.index)
            log.info(
                "ps %d's state: a copy as of entry %d installed (term %d)",
                self.slot,
                req.index,
                req.term,
            )
        return reply(msg, o.Replicated(self.log.applied).to_wire())

    def state(self) -> dict[str, Any]:
        out = {"role": "backup", "term": self.log.term, "applied": self.log.applied}
        if self.installed:
            out["installed"] = self.installed
        if self._installing is not None:
            out["installing"] = {"at": self._installing.index, "parts": self._installing.next}
        return out


def changed_nothing(exc: ZmqpsError) -> bool:
    """Whether a request refused with ``exc`` left the state as it was (a refusal for
    non-finite values did not: its batch counts as done)."""
    return isinstance(exc, _UNCHANGED) and not isinstance(exc, NonFiniteGradient)


def _as_entry(msg: Message) -> tuple[str, dict[str, Any], list[Tensor]]:
    op = "push" if msg.op == "push_pull" else msg.op
    body = {k: v for k, v in msg.body.items() if k != "shm_out"}
    return op, body, list(msg.tensors)


def entry_resolver(
    views: Callable[[list[int], o.ShmRef, str | None, Sequence[int]], list[Any]],
) -> Callable[[Message], tuple[str, dict[str, Any], list[Tensor]]]:
    """The entry of a request, a shared-memory push's gradient as tensors (``views``:
    the places of the message's units, its packs and its other shards, in a region the
    pushing worker attached, validated): one per pack, named by its first shard, and
    one per other shard, as the push would have carried them by TCP."""

    def resolve(msg: Message) -> tuple[str, dict[str, Any], list[Tensor]]:
        op, body, tensors = _as_entry(msg)
        shm = body.pop("shm", None)
        if shm is not None:
            sids = list(body.get("shards", ()))
            worker = body.get("worker")
            packs = list(body.get("packs") or ())
            ref = o.ShmRef.from_wire(shm)
            arrays = views(sids, ref, None if worker is None else str(worker), packs)
            spans, rest = units(sids, packs)
            heads = [span[0] for span in spans] + rest
            tensors = [Tensor(a, "grad", sid, 0) for sid, a in zip(heads, arrays, strict=True)]
        return op, body, tensors

    return resolve
