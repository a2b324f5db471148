"""Elastic PS: the chief moves PS states between processes while training goes on.

A run has as many PS states as its cluster spec names PS (state ``i`` starts on
process ``i``). ``zmqps scale --ps N`` (the ``scale`` op) or the launcher's
``--ps-schedule`` asks for the first N processes to serve them; a process of the
spec started by hand afterwards joins on its own (the ``join`` of this module's
watch). The plan (``core/elastic.plan_homes``) moves the states of the processes
that leave, and then only what keeps the loads (bytes) within one state of each
other.

One move of state ``s`` from process ``a`` to process ``b`` (:meth:`Mover.move`):

1. ``a`` serves ``s`` as a replication primary (a run without replication makes it
   one, with no backups: nothing changes but that its updates are numbered).
2. ``b`` gets an empty copy and ``a`` a ``join``: a whole copy as of one entry, sent
   while ``a`` keeps serving, then the entries after it (re-replication's copy,
   ``Rereplicator.join``), until ``a`` says ``b`` is in sync.
3. The hand-over, under the placement lock, at term + 1: ``a`` steps down (it answers
   what it had not committed, and everything after, ``not_primary``: the workers send
   it again to the new home), every other copy is fenced and says how far it applied,
   the furthest is promoted (``b`` on a tie; every acknowledged update is on every
   in-sync copy), the placement names the new copies at a new epoch, and workers
   re-route (heartbeats carry the epoch). The copy on ``a`` is then dropped.

A push is answered only once every in-sync copy has it, and the dedup window moves
with the state, so a push sent again after the hand-over is applied once.

A process none of whose states remain, outside the processes asked for, is told to
shut down: it exits 0 (it was drained).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from zmqps.core.elastic import Move, moves, plan_homes
from zmqps.core.recovery import Phase
from zmqps.core.variables import Placement
from zmqps.roles.chief.copying import StateCopier
from zmqps.roles.chief.variables import TERM
from zmqps.wire import ops as o
from zmqps.wire.errors import InvalidArgument, NotPrimary, NotReady, ZmqpsError

if TYPE_CHECKING:
    from zmqps.roles.chief.recovery import RecoveryController
    from zmqps.roles.homes import Homes

__all__ = ["Mover"]

log = logging.getLogger("zmqps.chief")

#: moves kept in the status
KEEP = 16
#: seconds after the memory policy asked for a PS before it may ask for another
GROW_WAIT_S = 10.0
#: in ``Mover.left``: no incarnation of the process was running when it was asked to
#: leave (a later one is a start of it after it left, which joins)
NONE = ""
#: seconds between the chief's looks at a moving state's copy (a move is asked for:
#: handed over as soon as it is in sync)
MOVE_POLL_S = 0.05
#: bytes a second a moving state's copy is sent at: faster than re-replication's (a
#: move is asked for, and the old process may be about to go)
MOVE_RATE = 256 << 20


class Mover(StateCopier):
    def __init__(
        self,
        recovery: RecoveryController,
        homes: Homes,
        *,
        rate: float = MOVE_RATE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(recovery, homes, rate=rate, clock=clock)
        #: the processes asked to serve the states (None: those serving them now)
        self.wanted: list[int] | None = None
        #: processes asked to leave: process -> the boot id of the incarnation asked
        #: (``NONE``: none was running; None: not looked at yet, the first heard is
        #: the one asked); a later incarnation joins only if that one was drained or
        #: none was running: one restarted while it leaves (a crash, a supervisor's
        #: restart) leaves too
        self.left: dict[int, str | None] = {}
        #: each process's boot id as last heard (kept while it is silent)
        self.known: dict[int, str] = {}
        #: processes told to shut down once drained: process -> the boot id it had
        self.drained: dict[int, str] = {}
        #: states whose source's copy a hand-over kept, named, its new primary not
        #: answering in time: state -> (source, term, the new primary's boot id); the
        #: copy goes once that primary answers (``_confirm_kept``). One per state.
        self.kept: dict[int, tuple[int, int, str]] = {}
        #: states whose promotion in a hand-over was not answered, nor the look after
        #: it: state -> (the process promoted, the term, the promotion, its copy's boot
        #: id, the generation); settled (``_settle_promotions``) once that copy says it
        #: is the primary at that term. One per state.
        self.unsettled: dict[int, tuple[int, int, dict[str, Any], str, int]] = {}
        self.moves = 0
        #: each process's boot id as last heard (None: silent)
        self.boots: dict[int, str | None] = {}
        #: why the plan waits (a process asked for is not up), for the status
        self.waiting: str | None = None
        #: moves the last look planned (None: not looked since the last ask)
        self.planned: int | None = 0
        #: each change of PS count asked for: bytes it plans to move, the least (KEEP)
        self.scales: list[dict[str, Any]] = []
        #: each state's bytes of shards as its PS last said (``--add-ps-above``)
        self.measured: dict[int, int] = {}
        #: no PS asked for by the memory policy before this (monotonic)
        self._grown_at = 0.0

    # ------------------------------------------------------------------ asking

    def scale(self, n: int) -> list[int]:
        """Serve the states from the first ``n`` processes of the spec."""
        total = len(self.homes.processes)
        if isinstance(n, bool) or not 1 <= n <= total:
            raise InvalidArgument(
                f"scale: {n} PS asked for; the cluster spec names {total} (1 to {total})"
            )
        replication = self.recovery.cfg.replication
        if n < replication:
            raise InvalidArgument(
                f"scale: {n} PS cannot hold {replication} copies of each state"
                f" (--replication {replication})"
            )
        return self.ask(list(range(n)))

    def ask(self, processes: list[int]) -> list[int]:
        """Serve the states from ``processes`` (the others leave)."""
        before, self.wanted = self.wanted, sorted(set(processes))
        self.planned = None
        self._account(len(self.wanted))
        for q in range(len(self.homes.processes)):
            if q in self.wanted:
                self.left.pop(q, None)
            else:  # asked to leave: the incarnation running now
                self.left.setdefault(q, self.known.get(q, NONE if q in self.boots else None))
        if self.wanted != before:  # the same ask again is no news (one line per ask)
            log.warning(
                "scaling to %d PS: ps %s serve the states",
                len(self.wanted),
                ", ".join(map(str, self.wanted)),
            )
        return self.wanted

    def _account(self, n: int) -> None:
        """What the change to ``n`` PS moves, by the plan made now, against the least
        any placement balanced within one state moves: the states of the PS that leave,
        and each PS that joins its share of the model less one state."""
        placement = self.recovery.variables.placement
        if placement is None or self.wanted is None:
            return
        sizes = self.sizes(placement)
        homes = dict(enumerate(self.homes.of))
        todo = moves(sizes, homes, plan_homes(sizes, homes, self.wanted))
        total, largest = sum(sizes.values()), max(sizes.values(), default=0)
        leaving = sum(n for st, n in sizes.items() if homes[st] not in self.wanted)
        joining = [q for q in self.wanted if q not in homes.values()]
        share = max(0, total // len(self.wanted) - largest)
        self.scales.append(
            {
                "ps": n,
                "at": round(time.time(), 3),
                "planned_bytes": sum(m.nbytes for m in todo),
                "least_bytes": leaving + share * len(joining),
                "model_bytes": total,
            }
        )
        del self.scales[:-KEEP]

    def adopt(self, boots: dict[int, str]) -> None:
        """A restarted chief found the states moved: the processes serving them are
        those asked for; the others left the run, or are leaving (those that answered
        at the start, ``boots``: drained once they hold no copy)."""
        self.known.update(boots)
        self.wanted = self.serving()
        for q in range(len(self.homes.processes)):
            if q not in self.wanted:
                self.left.setdefault(q, boots.get(q, NONE))

    def serving(self) -> list[int]:
        return sorted(set(self.homes.of))

    def target(self) -> list[int]:
        return self.serving() if self.wanted is None else list(self.wanted)

    def unmet(self) -> str | None:
        """What of the last ask is not done (None: every state is on a PS asked for,
        and the plan for them moves nothing more): moves stop at the run's end, so a
        run may end with states still to move, off a PS that leaves or onto one that
        joined (or was still starting)."""
        if self.wanted is None:
            return None
        asked = f"(ps {', '.join(map(str, self.wanted))})"
        away = [
            f"ps {state}'s state on ps {q}"
            for state, q in enumerate(self.homes.of)
            if q not in self.wanted
        ]
        if away:
            return (
                f"{', '.join(away)}, not on the PS asked for {asked}: moves stop when training ends"
            )
        placement = self.recovery.variables.placement
        if placement is None:
            return None
        todo = self._todo(placement, self.wanted)
        if not todo:
            return None
        left = ", ".join(f"ps {m.state}'s state from ps {m.source} to ps {m.target}" for m in todo)
        return (
            f"{left} not moved, to balance the PS asked for {asked}: moves stop when training ends"
        )

    # ------------------------------------------------------------------ the loop

    def active(self) -> bool:
        """While training runs (not at the run's end: its final checkpoint, evaluation
        and export are of the states where they are), and no restore is under way."""
        r = self.recovery
        running = r.phase in (Phase.RUNNING, Phase.DEGRADED)
        return r.variables.placement is not None and r.training and running

    async def run(self) -> None:
        """Watch the processes, move states toward the plan, drain who leaves. A look
        that fails on a request (a PS gone meanwhile) is made again at the next one."""
        while True:
            await asyncio.sleep(self.interval)
            if not self.active():
                continue
            try:
                await self.step()
            except ZmqpsError as exc:
                log.warning("moving PS states: %s; looking again", exc)

    async def step(self) -> Move | None:
        """One look: join a new process, ask for one more when a PS serves too many
        bytes (``--add-ps-above``), make the next move, or drain. Returns the move made
        (None: none)."""
        await self._probe_all()
        await self._settle_promotions()
        await self._confirm_kept()
        self._join_new()
        await self._grow()
        job = self.next_move()
        # one copy of a state at a time: re-replication's copy under way, the move and
        # the copies below wait for the next look (``copy_lock``)
        lock = self.recovery.copy_lock
        if job is not None:
            if lock.locked() or self.backing_off(job.state, job.target):
                return None  # (a move that failed lately: tried again after its backoff)
            async with lock:
                await self._make(job)
            return job
        placement = self.recovery.variables.placement
        if placement is not None and self.wanted is not None and not lock.locked():
            async with lock:
                for state, leaving in self._backups_leaving(placement):
                    await self._move_backup(state, leaving)
                    break  # one at a time; the next look takes the next
        await self._drain()
        return None

    async def _make(self, job: Move) -> None:
        """One planned move, with one more copy first where its hand-over would drop
        one."""
        if self._short_after(job):
            # a hand-over onto a copy there already drops the source's: the state
            # would have fewer copies than the replication until the re-replication
            # made one (a kill then loses it). A copy where it may go comes first.
            why = (
                f"the hand-over of ps {job.state}'s state from ps {job.source} to"
                f" ps {job.target}, a copy of it, drops one"
            )
            made = await self._new_copy(job.state, why)
            if made is None and self.wanted is not None and job.source in self.wanted:
                # no process to make it on now (each failed lately): a move that only
                # rebalances waits for the next look
                return
            if made is False:
                # failed: a process gone meanwhile, or the source no longer the
                # state's primary (a chief killed during a hand-over: only the
                # hand-over, which fences every copy and promotes one, makes one
                # again). The move goes on; the re-replication makes the copy after.
                log.warning("moving ps %d's state without the copy first", job.state)
        await self.move(job.state, job.target)

    async def _probe_all(self) -> None:
        n = len(self.homes.processes)
        states = await asyncio.gather(*(self.probe(q, timeout=1.0) for q in range(n)))
        boots = [None if st is None else st.boot for st in states]
        self.boots = dict(enumerate(boots))
        for q, boot in self.boots.items():
            if boot is None:
                continue
            self.known[q] = boot
            if q not in self.left and self.drained.get(q, boot) != boot:
                del self.drained[q]  # started again, asked for: no longer the one drained

    def _join_new(self) -> None:
        """A process of the spec that answers and serves nothing, started after it left
        the run (drained, or not running when it was asked to leave), or never asked
        to: it joins the processes asked for. One restarted while it was leaving
        (before it was drained: a crash, a supervisor's restart) leaves too."""
        if self.wanted is None:
            return
        for q, boot in self.boots.items():
            if boot is None or q in self.wanted or q in self.homes.of:
                continue
            if q in self.left:
                gone = self.left[q]
                if gone is None:
                    gone = self.left[q] = boot  # the first heard since the ask
                if gone == boot:
                    continue  # the incarnation asked to leave: drained once it holds nothing
                if gone != NONE and self.drained.get(q) != gone:
                    self.left[q] = boot
                    log.warning("ps %d restarted while it was leaving: it leaves", q)
                    continue
            self.left.pop(q, None)
            self.drained.pop(q, None)
            log.warning("ps %d answers and serves nothing: it joins the PS serving the states", q)
            self.ask([*self.wanted, q])

    def sizes(self, placement: Placement) -> dict[int, int]:
        """Each PS state's bytes: as its PS last said (values, slots, hash-table rows:
        :meth:`_measure`), else by the placement (values)."""
        if len(self.measured) == len(self.homes.of):
            return dict(self.measured)
        out = dict.fromkeys(range(len(self.homes.of)), 0)
        by_name = {v.name: v for v in placement.variables}
        for s in placement.shards:
            v = by_name[s.var]
            out[s.state] = out.get(s.state, 0) + s.rows * v.row_size * v.itemsize
        return out

    async def _measure(self) -> dict[int, int]:
        """Each state's bytes of shards as its process says (``status``)."""

        async def one(state: int) -> tuple[int, int] | None:
            try:
                rep = await self.recovery.ps[state].request("status", timeout=1.0)
                return state, int(rep.body.get("bytes") or 0)
            except (ZmqpsError, TypeError, ValueError):
                return None

        got = await asyncio.gather(*(one(st) for st in range(len(self.homes.of))))
        measured = dict(x for x in got if x is not None)
        if len(measured) == len(self.homes.of):
            self.measured = measured
        return measured

    async def _grow(self) -> None:
        """``--add-ps-above``: a PS serving more bytes than the limit makes the chief ask
        for the next PS of the spec (once the last change settled, at most once per
        ``GROW_WAIT_S``); the launcher starts it, or whoever runs the cluster."""
        limit = self.recovery.cfg.add_ps_above
        if limit is None or self.current is not None or self.clock() < self._grown_at:
            return
        if self.wanted is not None and (self.planned != 0 or self.waiting):
            return  # the last change is still under way
        measured = await self._measure()
        loads: dict[int, int] = {}
        for state, n in measured.items():
            loads[self.homes.of[state]] = loads.get(self.homes.of[state], 0) + n
        over = {q: n for q, n in sorted(loads.items()) if n > limit}
        if not over:
            return
        serving = set(self.target())
        spare = [q for q in range(len(self.homes.processes)) if q not in serving]
        self._grown_at = self.clock() + GROW_WAIT_S
        q, n = next(iter(over.items()))
        if not spare:
            log.warning(
                "ps %d serves %d bytes, above --add-ps-above %d, and every PS of the cluster"
                " spec serves already",
                q,
                n,
                limit,
            )
            return
        log.warning(
            "ps %d serves %d bytes, above --add-ps-above %d: asking for ps %d",
            q,
            n,
            limit,
            spare[0],
        )
        self.ask(sorted(serving | {spare[0]}))

    def next_move(self) -> Move | None:
        placement = self.recovery.variables.placement
        if placement is None or self.wanted is None:
            return None
        # a process told to shut down and not started again since is going away
        up = [
            q
            for q in self.wanted
            if self.boots.get(q) is not None and self.drained.get(q) != self.boots[q]
        ]
        missing = sorted(set(self.wanted) - set(up))
        self.waiting = (
            f"ps {', '.join(map(str, missing))} asked for and not answering" if missing else None
        )
        if not up:
            self.planned = None
            return None
        todo = self._todo(placement, up)
        backups = self._backups_leaving(placement)
        self.planned = len(todo) + len(backups)
        if not todo:
            return None
        first = todo[0]
        if first.source not in up:
            # a state of a process that leaves: to a copy of it where it may go, if one
            # is (promoted: nothing to send), else where the plan says
            copies = next(s.backups for s in placement.shards if s.state == first.state)
            kept = [q for q in copies if q in up]
            if kept and first.target not in copies:
                first = Move(first.state, first.source, kept[0], first.nbytes)
        return first

    def _todo(self, placement: Placement, up: Sequence[int]) -> list[Move]:
        """The moves the plan for processes ``up`` makes from where the states are
        (swap-only rebalancing left out: never made)."""
        sizes = self.sizes(placement)
        homes = dict(enumerate(self.homes.of))
        planned = plan_homes(sizes, homes, up)
        return [m for m in moves(sizes, homes, planned) if not self._swap_only(m, placement, up)]

    def _backups_leaving(self, placement: Placement) -> list[tuple[int, int]]:
        """``(state, process)``: backups on processes that leave (replication)."""
        seen: set[tuple[int, int]] = set()
        for s in placement.shards:
            for q in s.backups:
                if q not in (self.wanted or ()) and (s.state, q) not in seen:
                    seen.add((s.state, q))
        return sorted(seen)

    def _swap_only(self, job: Move, placement: Placement, up: Sequence[int]) -> bool:
        """Whether ``job`` only rebalances (its source stays in the run) by a hand-over
        onto a copy there already, which drops the source's copy, leaving the state
        fewer copies than the replication, with no process that stays without a copy of
        it to make one more on first. Such a move is not made: a kill before the
        re-replication made the copy again lost the state's last copy (fault schedule
        809, draw g10: a restore, acknowledged pushes lost)."""
        if job.source not in up or not self._short_after(job):
            return False
        s = next(s for s in placement.shards if s.state == job.state)
        return all(q in s.copies for q in up)

    def _short_after(self, job: Move) -> bool:
        """Whether ``job`` would leave its state with fewer copies than the replication:
        a hand-over onto a copy there already (a promotion) drops the source's."""
        placement = self.recovery.variables.placement
        replication = self.recovery.cfg.replication
        if placement is None or replication < 2:
            return False
        s = next(s for s in placement.shards if s.state == job.state)
        return job.target in s.copies and len(s.copies) - 1 < replication

    async def _new_copy(self, state: int, why: str) -> bool | None:
        """One more copy of ``state``, on the process asked for that holds the fewest
        copies and none of it, made and caught up as re-replication makes one (the
        others still count meanwhile). True once the placement names it; False when
        it failed; None when no process asked for is without a copy of it (or each
        such failed lately, and waits its backoff)."""
        r = self.recovery
        rr = r.rereplicator
        placement = r.variables.placement
        assert rr is not None and placement is not None and self.wanted is not None
        s = next(s for s in placement.shards if s.state == state)
        held = {
            q: 0
            for q in self.wanted
            if self.boots.get(q)
            and self.drained.get(q) != self.boots[q]
            and q not in s.copies
            and not rr.backing_off(state, q)  # (failed lately: tried again after a wait)
        }
        if not held:
            return None
        for x in {x.state: x for x in placement.shards}.values():
            for q in x.copies:
                if q in held:
                    held[q] += 1
        target = min(held, key=lambda q: (held[q], q))
        log.warning("%s: one more copy of ps %d's state on ps %d first", why, state, target)
        source = self.homes.of[state]
        r.moving = {"state": state, "from": source, "to": target, "phase": "copying a backup"}
        try:
            return await rr.copy(state, target)
        finally:
            r.moving = None

    async def _move_backup(self, state: int, leaving: int) -> bool:
        """A backup of ``state`` on a process that leaves: a new copy on one asked for
        (made and caught up as re-replication makes one, while the old one still
        counts), then the old one dropped. Returns whether it went."""
        r = self.recovery
        rr = r.rereplicator
        assert rr is not None
        if not await self._new_copy(state, f"ps {leaving} leaves, holding a copy"):
            return False
        async with r.placement_lock:
            placement = r.variables.placement
            assert placement is not None
            new = await self._unnamed(placement, state, leaving)
            await rr.tell_backups(state)  # its primary ships to the placement's backups only
            await self._drop_copy(leaving, state, r.terms.get(state, TERM), new.epoch)
        return True

    async def _drain(self) -> None:
        """Processes asked to leave that serve nothing now: told to shut down (they exit
        0). One that still holds a backup of a state is left to the re-replication."""
        if self.wanted is None:
            return
        placement = self.recovery.variables.placement
        holding = {q for s in placement.shards for q in s.copies} if placement else set()
        for q, boot in self.boots.items():
            if boot is None or q in self.wanted or q in holding or self.drained.get(q) == boot:
                continue
            try:
                await self.homes.processes[q].request("shutdown", timeout=2.0)
            except ZmqpsError as exc:
                log.info("ps %d: shutdown after draining not answered: %s", q, exc)
                continue
            self.drained[q] = boot
            log.warning("ps %d drained (it serves no state): told to shut down", q)

    # ------------------------------------------------------------------ one move

    async def move(self, state: int, target: int) -> bool:
        """Move PS state ``state`` to process ``target``; True once the placement
        serves it from there."""
        r = self.recovery
        rr = r.rereplicator
        assert rr is not None
        source = self.homes.of[state]
        started, began = self.clock(), time.time()
        self.current = {"state": state, "from": source, "to": target, "phase": "starting"}
        r.moving = self.current
        log.warning("moving ps %d's state from ps %d to ps %d", state, source, target)
        why = ""
        info: dict[str, Any] = {}
        gen = r.gen
        # the target's process, watched while its copy is made: one restarted holds no
        # copy and refuses every part sent again, one silent past the heartbeat timeout
        # is dead (either way the move would wait out its deadline)
        target_boot = self.boots.get(target)
        restarted: list[str] = []
        heard = {"at": self.clock()}
        watch = asyncio.ensure_future(self._watch_target(target, target_boot, restarted, heard))
        timeout = r.cfg.heartbeat_timeout
        try:
            async with r.placement_lock:
                await self._primary_here(state, source)
            # given up past a deadline: the state's bytes at a quarter of the rate, and
            # a minute more (a target that died mid-copy never gets in sync)
            sizes = self.sizes(self.recovery.variables.placement)  # type: ignore[arg-type]
            deadline = self.clock() + 60.0 + 4 * sizes.get(state, 0) / self.rate

            def going() -> bool:
                # a restore meanwhile: the copy is of the generation before
                return self.active() and self.clock() < deadline and r.gen == gen

            placement = self.recovery.variables.placement
            held = placement is not None and any(
                x.state == state and target in x.backups for x in placement.shards
            )
            if held:
                # the target holds a copy in sync already (a backup; one a move's join
                # made before a chief restart, adopted as such): handed over at once
                self.current["phase"] = "in sync"
            else:
                why, info = await rr.join(
                    state,
                    target,
                    self.rate,
                    self.current,
                    going,
                    lambda q: not restarted and self.clock() - heard["at"] <= timeout,
                    MOVE_POLL_S,
                )
            if restarted:
                why = restarted[0]
            elif r.gen != gen:
                why = f"a restore meanwhile (generation {gen} -> {r.gen}): the copy is of before"
            if not why:
                why = await self._at_boundary(
                    state,
                    source,
                    target,
                    gen,
                    lambda: not restarted and self.clock() - heard["at"] <= timeout,
                )
        except ZmqpsError as exc:
            why = f"{exc.code}: {exc}"
        finally:
            watch.cancel()
            handover = (self.current or {}).get("handover_s")
            target = int((self.current or {}).get("to", target))
            self.current = None
            r.moving = None
        copied = int(info.get("bytes", 0))
        record: dict[str, Any] = {
            "state": state,
            "from": source,
            "to": target,
            "seconds": round(self.clock() - started, 3),
            # the hand-over alone: what the state's requests waited for
            "handover_s": handover,
            "bytes": copied,
            "state_bytes": self.sizes(self.recovery.variables.placement).get(state, 0)
            if self.recovery.variables.placement is not None
            else 0,
            # wall-clock times, to match the workers' step times against
            "began": round(began, 3),
            "ended": round(time.time(), 3),
        }
        self.bytes += copied
        self.outcome(state, target, ok=not why)
        if why:
            self.failures += 1
            record["failed"] = why
            log.warning("moving ps %d's state to ps %d failed: %s", state, target, why)
            with contextlib.suppress(ZmqpsError):
                await rr.drop_joiner(state)
        else:
            self.moves += 1
            # the furthest copy serves (a backup ahead of the target: the target is its
            # backup); the record says which
            home = record["home"] = self.homes.of[state]
            log.warning(
                "ps %d's state moved from ps %d to ps %d (%.2fs, %d bytes; placement epoch %d)%s",
                state,
                source,
                target,
                record["seconds"],
                copied,
                self.homes.epoch,
                "" if home == target else f"; ps {home}'s copy was further: it serves",
            )
        self.done.append(record)
        del self.done[:-KEEP]
        return not why

    async def _watch_target(
        self, target: int, boot: str | None, restarted: list[str], heard: dict[str, float]
    ) -> None:
        """Probe ``target`` while its copy is made: when it last answered (``heard``),
        and a boot id other than ``boot`` (it restarted, the copy gone with it) is said
        in ``restarted``."""
        while True:
            await asyncio.sleep(min(0.5, self.interval))
            try:
                rep = await self.homes.processes[target].request("ps_state", timeout=1.0)
                now = o.PsStateReply.parse(rep.body).boot
            except ZmqpsError:
                continue  # silent: past the heartbeat timeout the move is given up
            heard["at"] = self.clock()
            if boot is None:
                boot = now
            elif now != boot:
                restarted.append(f"ps {target} restarted while its copy was made")
                return

    async def _at_boundary(
        self,
        state: int,
        source: int,
        target: int,
        gen: int,
        target_alive: Callable[[], bool] = lambda: True,
    ) -> str:
        """The hand-over at the next step boundary the chief holds (sync: every worker
        waits for the next step's token, no push of it is on the way, the state's sums
        are empty; async and ssp: at once). Once begun it runs to its end (a task of
        its own: a restore that stops the stepping does not cut it in half). Returns
        why it did not happen ("" once done)."""
        r = self.recovery
        begun: list[asyncio.Future[str]] = []

        async def locked() -> str:
            async with r.placement_lock:
                if r.gen != gen:
                    return f"a restore meanwhile (generation {gen} -> {r.gen})"
                began = self.clock()
                try:
                    return await self._hand_over(state, source, target)
                finally:
                    if self.current is not None:
                        self.current["handover_s"] = round(self.clock() - began, 4)

        async def job(step: int) -> str:
            begun.append(asyncio.ensure_future(locked()))
            return await asyncio.shield(begun[0])

        done = r.mode.at_boundary(job)
        # (its outcome is read from the task begun, when one was: retrieved here too)
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        deadline = self.clock() + max(30.0, 3 * r.cfg.heartbeat_timeout)
        while not begun and not done.done():
            # a target gone while its in-sync copy waits for the boundary holds every
            # step of the state (its primary waits for it): given up at once
            gone = not target_alive()
            late = gone or not self.active() or self.clock() > deadline
            if late and r.mode.drop_boundary_job(done):  # False: it just began
                if gone:
                    return f"ps {target} is silent or restarted"
                if self.active():
                    return "no step boundary came"
                return "a restore meanwhile" if r.recovering else "the run's end"
            await asyncio.sleep(0.02)
        if begun:
            return await begun[0]
        return str(done.result())

    async def _primary_here(self, state: int, source: int) -> None:
        """The state's home numbers its updates (a replication primary): a run without
        replication makes it one with no backups, at the state's term. Called under the
        placement's lock: a fail-over or a restore since the move was planned (its
        source no longer the state's home) gives the move up."""
        r = self.recovery
        placement = r.variables.placement
        assert placement is not None
        if self.homes.of[state] != source:
            # (fault schedule 716: the source, restarted empty and failed over, was
            # made the primary of a state it held nothing of, and no copy could be
            # made on it again)
            raise NotReady(f"ps {state}'s state is no longer served by ps {source}")
        await self._source_as_known(state, source)
        s = next(s for s in placement.shards if s.state == state)
        if s.backups or r.cfg.replication > 1:
            return  # replicated: a primary already (one with no backups left, too)
        term = self.recovery.terms.setdefault(state, TERM)
        body = o.ReplicaSet(state, term, True, (), epoch=placement.epoch)
        await self.homes.processes[source].request("replica", body.to_wire(), timeout=2.0)

    async def _source_as_known(self, state: int, source: int) -> None:
        """The state's home is the incarnation the health watch expects (NotReady:
        restarted since, before the watch's next look; its state lost, a restore
        follows). Moved from a process restarted empty, the state was made primary
        there, copied empty to the target and served from there, a generation behind:
        a chief started after that found the PS in disagreement and could not finish
        (fault schedule 9982). A source that does not answer is left to the move's own
        checks."""
        known = self.recovery.health.expected(state)
        if not known:
            return
        try:
            boot = await self._copy_boot(source, state, 2.0)
        except ZmqpsError:
            return
        if boot != known:
            raise NotReady(
                f"ps {source} restarted since the chief last heard it: ps {state}'s state"
                " is restored first"
            )

    async def _hand_over(self, state: int, source: int, target: int) -> str:
        """``target`` (in sync) takes the state over from ``source`` at a new term;
        returns why not ("" once done)."""
        r = self.recovery
        placement = r.variables.placement
        assert placement is not None
        if self.homes.of[state] != source:
            return "the state's primary changed while it was copied"
        processes = self.homes.processes
        s = next(s for s in placement.shards if s.state == state)
        # the target's copy still counts in the source's commits: one its primary
        # stopped shipping to (dropped as a joiner) lacks what was committed since,
        # and promoted it would serve the state behind (fault schedule 716: a sync
        # step lost, and sync waited on it for ever). A source that does not answer
        # commits nothing more: the fences below decide.
        heard = await self.probe(source, timeout=2.0)
        for st, part, _term, _head, cut_off, in_sync in (heard and heard.roles) or ():
            if st == state and part == "primary" and not cut_off and target not in in_sync:
                return f"ps {target}'s copy fell out of sync (its primary no longer ships to it)"
        others = [q for q in s.backups if q != target]
        term = r.terms[state] = r.terms.get(state, TERM) + 1
        epoch = placement.epoch + 1
        fence = o.ReplicaSet(state, term, primary=False, epoch=epoch).to_wire()

        #: each fenced copy's boot id, as its fence answered
        copy_boots: dict[int, str] = {}

        async def fenced(q: int) -> int | None:
            try:
                rep = await processes[q].request("replica", fence, timeout=2.0)
                got = o.ReplicaState.parse(rep.body)
            except ZmqpsError as exc:
                log.warning("ps %d: fencing its copy of ps %d failed: %s", q, state, exc)
                return None
            copy_boots[q] = got.boot
            return got.applied

        # 1. the target stops taking the source's entries: from here the source commits
        #    nothing more (it answers what it had not committed, and all after,
        #    not_primary: the workers send it again to the new home). Refused: nothing
        #    changed yet, the move is given up.
        at = await fenced(target)
        if at is None:
            r.terms[state] = term - 1
            return "the target did not take the hand-over"
        heads = {target: at}
        # 2. the source steps down (lost: it is fenced by the target's refusals anyway),
        #    every other copy stops at the new term and says how far it applied
        kept = await fenced(source)
        for q in others:
            got = await fenced(q)
            if got is not None:
                heads[q] = got
        # the furthest copy serves (the target on a tie): a fail-over's choice
        chosen = max(heads, key=lambda q: (heads[q], q == target, -q))
        backups = tuple(q for q in (target, *others) if q != chosen and q in heads)
        links = tuple((q, processes[q].endpoint) for q in backups)
        applied = tuple(heads[q] for q in backups)
        body = o.ReplicaSet(state, term, True, links, applied, epoch=epoch)
        # From here the promotion counts as done whatever comes: the source stepped
        # down and every copy is fenced at the new term, so the placement must name the
        # new primary. A copy that does not answer the promotion or the boot id asked
        # after it (its process killed just now) is expected to answer with no boot id:
        # the health watch takes it for restarted and fails it over, and the source's
        # copy (fenced, whole) stays a named copy it may promote (dropped, the state
        # could be left with no copy). Before (fault schedule 831), a promotion not
        # answered raised here: the old placement stayed, naming the stepped-down
        # source, and telling it its backups promoted it, its entries counted from 0.
        # Whether the promoted copy outlived its promotion is known before the new
        # placement is published (no worker has sent the state there yet, so the
        # source's copy is as current as it): its boot id (the promotion's answer names
        # it) and a ps_state after it, waited for up to the heartbeat timeout. A loaded
        # process is slow, not dead: asked with 2 s (fault-free, three clusters on two
        # cores), the late answer left the watch expecting "" and the live copy was
        # taken for restarted (failed over, or restored from a checkpoint); keeping the
        # source's copy named for it left a copy named that its primary never fed.
        boot: str | None = None  # None: the promotion not answered
        try:
            rep = await processes[chosen].request("replica", body.to_wire(), timeout=2.0)
            boot = o.ReplicaState.parse(rep.body).boot
        except ZmqpsError as exc:
            log.warning(
                "ps %d does not answer its promotion (ps %d's state): %s", chosen, state, exc
            )
        asked = self.clock()
        boot, alive = await self._outlived(chosen, state, term, boot)
        if not boot and copy_boots.get(chosen):
            # neither the promotion nor the look after it answered: a process stalled
            # (a loaded machine: 12 s, the suite at three tests at once) or dead. Its
            # copy's boot id, as its fence answered, is expected from here (a process
            # restarted holds no copy that answers with it: the watch fails it over);
            # whether the promotion took is settled at the mover's next looks, sent
            # again if it was dropped (:meth:`_settle_promotions`). Before, "" was
            # expected: the live copy's first answer was taken for a restart, its
            # process failed over whole, and its own state, with no copy, restored.
            boot = copy_boots[chosen]
            self.unsettled[state] = (chosen, term, body.to_wire(), boot, r.gen)
        if self.current is not None:
            self.current["to"] = chosen  # where it is served now (the target a backup)
        keep_source = not alive and kept is not None and source not in backups
        named = (*backups, source) if keep_source else backups
        shards = tuple(
            replace(x, ps=chosen, backups=named, slot=state) if x.state == state else x
            for x in placement.shards
        )
        new = replace(placement, shards=shards, epoch=epoch)
        # in one turn: the health watch expects the new home's boot id from the probe
        # routed by the new placement on (a probe sent to the old home is set aside,
        # not taken for a restart)
        r.variables.use(new)
        self.homes.update(new)
        r.boots[state] = boot
        # last heard: now, or (silent since) when it was asked: one that did not answer
        # for a heartbeat timeout is failed over at the watch's next look, not after
        # a timeout more
        r.health.expect({state: boot}, r.gen, self.clock() if alive else asked)
        await r.publish_placement(new, skip=[q for q, b in self.boots.items() if b is None])
        if keep_source:
            if boot:  # promoted, slow or restarted: the next looks tell which
                self.kept[state] = (source, term, boot)
            return ""  # the source's copy stays (above)
        # 3. the copy left on the source goes (its own state's copy stays a backup that
        #    serves nothing; its process may take it back later)
        await self._drop_copy(source, state, term, epoch)
        return ""

    async def _settle_promotions(self) -> None:
        """Each promotion not answered (``unsettled``): the process says its part in
        the state (``ps_state``). The primary at the hand-over's term: settled. Still a
        backup at that term (the promotion dropped: its deadline passed while the
        process was stalled): sent again. A fail-over, move or restore since (another
        term, the state served elsewhere, another generation) ends it; a copy that
        answers with another boot id (its process restarted) is left to the health
        watch."""
        r = self.recovery
        for state, (q, term, body, boot, gen) in list(self.unsettled.items()):
            if r.terms.get(state) != term or self.homes.of[state] != q or r.gen != gen:
                del self.unsettled[state]
                continue
            link = self.homes.processes[q]
            try:
                if await self._copy_boot(q, state, 1.0) != boot:
                    continue  # restarted: the watch fails it over
                rep = await link.request("ps_state", timeout=1.0)
                roles = o.PsStateReply.parse(rep.body).roles or ()
                part = next(((str(x[1]), int(x[2])) for x in roles if int(x[0]) == state), None)
                if part == ("backup", term):
                    log.warning("ps %d: its promotion to ps %d's primary was lost: again", q, state)
                    rep = await link.request("replica", body, timeout=2.0)
                    got = o.ReplicaState.parse(rep.body)
                    part = ("primary" if got.primary else "backup", got.term)
            except ZmqpsError:
                continue  # silent so far: looked at again next time
            if part == ("primary", term) and self.unsettled.get(state, (0, 0))[1] == term:
                del self.unsettled[state]
                log.warning("ps %d answers as ps %d's state's primary (term %d)", q, state, term)

    async def _confirm_kept(self) -> None:
        """A source's copy a hand-over kept (its new primary did not answer in time) is
        named as a backup that primary does not feed: right while the primary is dead
        (a fail-over promotes the kept copy, as current as the state was at the
        hand-over), wrong once it lives on (a later fail-over would promote a copy
        behind). The new primary answering as the copy promoted, the kept copy is
        unnamed and dropped, as after any move; silent or restarted, the health watch
        fails it over; a fail-over or move of the state since ends the keeping."""
        r = self.recovery
        for state, (source, term, boot) in list(self.kept.items()):
            if self._keeping(state) is None:
                del self.kept[state]
                continue
            if state in self.unsettled:
                continue  # its new primary not known to serve yet
            home = self.homes.of[state]
            try:
                if await self._copy_boot(home, state, 1.0) != boot:
                    continue  # restarted: the watch fails it over
            except ZmqpsError:
                continue  # silent so far
            async with r.placement_lock:
                placement = self._keeping(state)
                if placement is None:
                    continue
                del self.kept[state]
                new = await self._unnamed(placement, state, source)
            log.warning(
                "ps %d answers as ps %d's state's primary: the copy kept on ps %d goes",
                home,
                state,
                source,
            )
            await self._drop_copy(source, state, term, new.epoch)

    async def _unnamed(self, placement: Placement, state: int, q: int) -> Placement:
        """``placement`` with process ``q`` no longer a backup of ``state``, at the next
        epoch: in use, and told to every process (under the placement lock)."""
        shards = tuple(
            replace(x, backups=tuple(b for b in x.backups if b != q)) if x.state == state else x
            for x in placement.shards
        )
        new = replace(placement, shards=shards, epoch=placement.epoch + 1)
        self.recovery.variables.use(new)
        self.homes.update(new)
        await self.recovery.publish_placement(
            new, skip=[p for p, b in self.boots.items() if b is None]
        )
        return new

    async def _drop_copy(self, q: int, state: int, term: int, epoch: int) -> None:
        """Process ``q``'s copy of ``state``, named nowhere any more, goes."""
        drop = o.ReplicaSet(state, term, primary=False, epoch=epoch, drop=True)
        try:
            await self.homes.processes[q].request("replica", drop.to_wire(), timeout=2.0)
        except ZmqpsError as exc:
            log.info("ps %d: dropping its copy of ps %d failed: %s", q, state, exc)

    def _keeping(self, state: int) -> Placement | None:
        """The placement, while it still names the copy kept of ``state`` (``kept``) at
        the hand-over's term; None once a fail-over or a move changed that."""
        source, term, _ = self.kept[state]
        placement = self.recovery.variables.placement
        named = placement is not None and any(
            x.state == state and source in x.backups for x in placement.shards
        )
        return placement if named and self.recovery.terms.get(state) == term else None

    async def _outlived(self, q: int, state: int, term: int, boot: str | None) -> tuple[str, bool]:
        """Process ``q``'s copy of ``state``, just promoted at ``term`` (``boot``: the
        boot id its promotion's answer named; "" from an older PS, None: the promotion
        not answered): the boot id the health watch is to expect of it, and whether it
        answers as that copy, promoted. Waited for up to the heartbeat timeout."""
        wait = max(2.0, self.recovery.cfg.heartbeat_timeout)
        link = self.homes.processes[q]
        # the copy's boot id; and, its promotion's answer lost, the process's roles
        try:
            if boot is None:
                now, rep = await asyncio.gather(
                    self._copy_boot(q, state, wait), link.request("ps_state", timeout=wait)
                )
                roles = o.PsStateReply.parse(rep.body).roles or ()
            else:
                now, roles = await self._copy_boot(q, state, wait), ()
        except ZmqpsError as exc:
            log.warning("ps %d, now serving ps %d's state, does not answer: %s", q, state, exc)
            return boot or "", False
        if boot is None:  # promoted, if it says so
            promoted = any(
                int(r[0]) == state and r[1] == "primary" and int(r[2]) == term for r in roles
            )
            return (now, True) if promoted and now else ("", False)
        if not boot:  # an older PS: the promotion answered, the boot id asked
            return now, bool(now)
        return boot, now == boot  # alive unless its process restarted since

    async def _copy_boot(self, q: int, state: int, timeout: float) -> str:
        """The boot id of process ``q``'s copy of ``state`` (its ``ps_state`` through
        the state's slot); "" when it holds none (restarted since it had one).
        ZmqpsError: no answer within ``timeout``."""
        try:
            rep = await self.homes.processes[q].request("ps_state", timeout=timeout, slot=state)
        except NotPrimary:
            return ""
        return o.PsStateReply.parse(rep.body).boot

    # ------------------------------------------------------------------ status

    def figures(self) -> dict[str, Any]:
        """What the chief's elastic metrics say (read at scrape time, in the exporter's
        thread: the move under way is read once)."""
        current = self.current
        return {
            "epoch": self.homes.epoch,
            "serving": len(self.serving()),
            "asked": len(self.target()),
            "moving": 0 if current is None else 1,
            "move_progress": 0.0 if current is None else float(current.get("progress", 0.0)),
            "moves_done": self.moves,
            "moves_failed": self.failures,
            "moved_bytes": self.bytes,
            "drained": len(self.drained),
        }

    def status(self) -> dict[str, Any]:
        return {
            "serving": self.serving(),
            "asked": self.wanted,
            "waiting": self.waiting,
            "moving": self.current,
            # moves the last look planned (None: not looked yet since the last ask)
            "planned": self.planned,
            "moves_done": self.moves,
            "moves_failed": self.failures,
            "moved_bytes": self.bytes,
            "recent_moves": self.done[-5:],
            "drained": sorted(self.drained),
            "epoch": self.homes.epoch,
        }
