"""Re-replication: the chief brings every PS state back to R copies while training goes on.

Rules of this module:

* A state has fewer copies than the replication after a fail-over (its dead copy is
  gone) or after a backup's process died or restarted. The chief picks, for the
  state with the fewest copies, a live process that holds no copy of it (the one
  holding the fewest copies; a restarted process holds none), makes an empty copy
  there (``replica``, backup role, at the state's term) and asks the state's
  primary to ``join`` it: the primary sends a whole copy as of one entry of its log
  at most ``rate`` bytes a second, then the entries after it; no push waits for the
  new copy until it caught up. Once the primary says it is in sync, the placement
  names it (a new epoch). One copy at a time in the whole cluster (a copy costs
  the primary a snapshot of the state and bandwidth).
* A copy that fails (the primary replaced, the target silent, the copy fell too far
  behind) is given up: the primary is told the placement's backups again (which
  drops the joiner) and the pair waits a back-off before it is tried again.
* The chief watches every PS process here, not only those serving a state (the
  recovery controller watches those): a process that serves no state but holds
  backups and is silent past the heartbeat timeout, or answers with another boot id
  (restarted: its copies are gone), is failed over like any other (its copies
  dropped); a restarted or idle process is where copies go.
* Only while training runs and no restore is under way: a restore changes every
  state without the logs, so a copy joining then is dropped (every primary is told
  its backups again) and started again after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from zmqps.core.variables import Placement
from zmqps.roles.chief.copying import StateCopier
from zmqps.roles.chief.variables import TERM
from zmqps.wire import ops as o
from zmqps.wire.errors import NotReady, ZmqpsError

if TYPE_CHECKING:
    from zmqps.roles.chief.recovery import RecoveryController
    from zmqps.roles.homes import Homes

__all__ = ["RATE", "Rereplicator"]

log = logging.getLogger("zmqps.chief")

#: bytes a second a state's copy is sent at (default): a 100 MB state in about 2 s,
#: leaving the primary most of its bandwidth for training
RATE = 64 << 20
#: copies kept in the status
KEEP = 16


class Rereplicator(StateCopier):
    def __init__(
        self,
        recovery: RecoveryController,
        homes: Homes,
        *,
        rate: float = RATE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(recovery, homes, rate=rate, clock=clock)
        self.timeout = recovery.cfg.heartbeat_timeout
        n = len(homes.processes)
        #: each process's boot id as last heard, and when it last answered
        self.boots: dict[int, str] = {}
        self.heard: dict[int, float] = dict.fromkeys(range(n), clock())
        self.copies = 0

    # ------------------------------------------------------------------ the loop

    def active(self) -> bool:
        r = self.recovery
        placement = r.variables.placement
        return placement is not None and r.cfg.replication > 1 and r.training and not r.recovering

    async def run(self) -> None:
        """Watch the processes and copy states until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            if not self.active():
                continue
            await self.watch()
            await self.copy_next()

    async def copy_next(self) -> bool | None:
        """The next copy (:meth:`next_copy`) made, unless a copy or a move is under way
        (``copy_lock``: the next look tries again). None: none was made."""
        lock = self.recovery.copy_lock
        if lock.locked() or not self.active():
            return None
        async with lock:
            job = self.next_copy()
            return None if job is None else await self.copy(*job)

    async def watch(self) -> list[int]:
        """Probe every process; fail over those that serve no state, hold copies and are
        silent past the heartbeat timeout or restarted (returns them); then bring the
        placement and the copies' roles into agreement (:meth:`reconcile`)."""
        n = len(self.homes.processes)
        probed = self.recovery.variables.placement
        states = await asyncio.gather(*(self.probe(q) for q in range(n)))
        dead = await self._watch_boots([None if st is None else st.boot for st in states])
        if not dead and not self._busy():
            await self.reconcile(states, probed)
        return dead

    def _busy(self) -> bool:
        """A copy or a move under way: the copies are not judged meanwhile."""
        r = self.recovery
        return self.current is not None or r.moving is not None or r.copy_lock.locked()

    async def _watch_boots(self, boots: list[str | None]) -> list[int]:
        now = self.clock()
        gone = []
        for q, boot in enumerate(boots):
            if boot is not None:
                self.heard[q] = now
                before = self.boots.get(q)
                self.boots[q] = boot
                if before is not None and before != boot:
                    gone.append(q)
            elif now - self.heard[q] > self.timeout:
                gone.append(q)
        placement = self.recovery.variables.placement
        if placement is None:
            return []
        homes = set(self.homes.of)
        holders = {q for s in placement.shards for q in s.backups}
        # a process serving a state is the recovery controller's to watch
        dead = [q for q in gone if q not in homes and q in holders]
        if dead:
            log.warning(
                "ps process %s (backups only) is silent or restarted: dropping its copies",
                ", ".join(map(str, dead)),
            )
            await self.recovery.fail_over([], dead)
        return dead

    async def reconcile(
        self, states: list[o.PsStateReply | None], probed: Placement | None = None
    ) -> list[int]:
        """Keep each primary's in-sync backups and the placement's the same.

        A primary waits for its in-sync backups before it acknowledges anything. One
        the placement does not name (a copy given up, or dropped by a fail-over, whose
        primary did not hear so: it was stopped, or the word was lost; the copy's
        process then died) would hold every commit of the state, and so its sync
        steps, for ever while every process answers: the primary is told its backups
        again (it drops the others). A backup the placement names and its primary no
        longer ships to (dropped when promoted past what it kept) has not what was
        acknowledged since: a fail-over must never promote it, and the state is short
        of a copy. It leaves the placement (a new epoch), and a new copy is made.

        A backup the placement names whose process answers and holds no copy of the
        state (it restarted before this chief first heard it, so no boot id of the
        lost process was known to compare: a chief restarted just before it) refuses
        every entry its primary ships: the primary waits for it, and every commit of
        the state with it, for ever. It leaves the placement too, its primary is told
        its backups again, and a new copy is made.

        ``states``: every process's ``ps_state``, read while no copy was under way.
        ``probed``: the placement when they were read; a copy named since (another
        placement) is not judged by them. Returns the states changed."""
        changed: list[int] = []
        async with self.recovery.placement_lock:
            placement = self.recovery.variables.placement
            busy = self._busy()
            if placement is None or not self.active() or busy:
                return changed
            named = {s.state: set(s.backups) for s in placement.shards}
            unnamed: dict[int, set[int]] = {}
            changed.extend(await self._promote_again(states, placement))
            if probed is None or probed is placement:
                for state, gone in self._copies_gone(states, named).items():
                    log.warning(
                        "ps %s holds no copy of ps %d's state, which the placement names"
                        " (restarted): that copy is dropped and made again",
                        ", ".join(map(str, sorted(gone))),
                        state,
                    )
                    unnamed[state] = gone
                    changed.append(state)
            for q, st in enumerate(states):
                for state, part, term, _head, fenced, in_sync in (st and st.roles) or ():
                    if part != "primary" or fenced or state not in named:
                        continue
                    if self.homes.of[state] != q or term != self.recovery.terms.get(state, TERM):
                        continue  # not the copy the placement serves it from
                    extra = set(in_sync) - named[state]
                    if extra:
                        log.warning(
                            "ps %d ships ps %d's state to ps %s, which the placement does not"
                            " name (a copy given up): telling it its backups again",
                            q,
                            state,
                            ", ".join(map(str, sorted(extra))),
                        )
                        await self.tell_backups(state)
                        changed.append(state)
                    missing = named[state] - set(in_sync) - unnamed.get(state, set())
                    if missing:
                        log.warning(
                            "ps %d no longer ships ps %d's state to ps %s, which the placement"
                            " names: that copy is dropped and made again",
                            q,
                            state,
                            ", ".join(map(str, sorted(missing))),
                        )
                        unnamed[state] = unnamed.get(state, set()) | missing
                        changed.append(state)
            if unnamed:
                shards = tuple(
                    replace(s, backups=tuple(b for b in s.backups if b not in unnamed[s.state]))
                    if s.state in unnamed
                    else s
                    for s in placement.shards
                )
                new = replace(placement, shards=shards, epoch=placement.epoch + 1)
                self.recovery.variables.use(new)
                self.homes.update(new)
                await self.recovery.publish_placement(new, skip=self.silent())
                for state in sorted(unnamed):
                    await self.tell_backups(state)  # it stops shipping to (and waiting for) them
        return sorted(set(changed))

    def _copies_gone(
        self, states: list[o.PsStateReply | None], named: dict[int, set[int]]
    ) -> dict[int, set[int]]:
        """Per state, the backups the placement names whose process answered and holds
        no copy of it at all."""
        held = {
            (q, int(role[0]))
            for q, st in enumerate(states)
            if st is not None
            for role in st.roles or ()
        }
        gone: dict[int, set[int]] = {}
        for state, backups in named.items():
            for q in backups:
                st = states[q] if q < len(states) else None
                # (a process that holds no copy of any state answers with no roles)
                if st is not None and (q, state) not in held:
                    gone.setdefault(state, set()).add(q)
        return gone

    async def _promote_again(
        self, states: list[o.PsStateReply | None], placement: Placement
    ) -> list[int]:
        """A state whose home, by the placement, holds it as a backup at the state's
        term: a fail-over fenced it there and its promotion was lost (the process was
        stopped, the request timed out). Every request for the state is refused
        (``not_primary``) while that process answers everything else, and nothing else
        would ever change it: the promotion is sent again, with the entry each named
        backup applied (their own account, at the same term; none of them moves while
        no primary ships). Returns the states promoted."""
        roles: dict[tuple[int, int], tuple[str, int, int]] = {}
        for q, st in enumerate(states):
            for state, part, term, head, _fenced, _in_sync in (st and st.roles) or ():
                roles[(q, state)] = (part, term, head)
        promoted: list[int] = []
        for s in {s.state: s for s in placement.shards}.values():
            term = self.recovery.terms.get(s.state, TERM)
            home = roles.get((s.ps, s.state))
            if s.ps != self.homes.of[s.state] or home is None or home[:2] != ("backup", term):
                continue
            applied = [roles.get((b, s.state)) for b in s.backups]
            if any(a is None or a[:2] != ("backup", term) for a in applied):
                continue  # a backup's account is missing: the next watch tries again
            heads = tuple(a[2] for a in applied if a is not None)
            if max(heads, default=0) > home[2]:
                continue  # not the furthest copy: a fail-over's to choose again
            links = tuple((b, self.homes.processes[b].endpoint) for b in s.backups)
            body = o.ReplicaSet(s.state, term, True, links, heads, epoch=placement.epoch)
            log.warning(
                "ps %d holds ps %d's state as a backup, and the placement serves it from"
                " there: promoting it again (a promotion was lost)",
                s.ps,
                s.state,
            )
            try:
                await self.homes.processes[s.ps].request("replica", body.to_wire(), timeout=2.0)
            except ZmqpsError as exc:
                log.warning(
                    "ps %d: promoting its copy of ps %d again failed: %s", s.ps, s.state, exc
                )
                continue
            promoted.append(s.state)
        return promoted

    def forget(self, processes: Iterable[int]) -> None:
        """``processes`` were failed over (their copies dropped): the boot ids known for
        them are of the lost processes. A restarted one counts as alive, to copy to,
        once it answered with its new boot id, and is not taken for restarted again
        (which would drop a copy made on it meanwhile)."""
        for q in processes:
            self.boots.pop(q, None)

    def alive(self, q: int) -> bool:
        return self.clock() - self.heard[q] <= self.timeout and q in self.boots

    def silent(self) -> list[int]:
        """The processes that answered no probe for the heartbeat timeout. While nothing
        is watched (a restore, the run's end: the probes stop) those that had been silent
        that long when another last answered."""
        last = self.clock() if self.active() else max(self.heard.values(), default=0.0)
        return [q for q, at in sorted(self.heard.items()) if last - at > self.timeout]

    def under_replicated(self, placement: Placement | None = None) -> dict[int, list[int]]:
        """Each state with fewer copies than the replication: its copies' processes."""
        placement = placement or self.recovery.variables.placement
        if placement is None:
            return {}
        # the configured factor: the placement's own count shrinks with every copy lost
        want = self.recovery.cfg.replication
        copies = {s.state: list(s.copies) for s in placement.shards}
        return {st: c for st, c in sorted(copies.items()) if len(c) < want}

    def next_copy(self) -> tuple[int, int] | None:
        """``(state, process)``: the next copy to make, or None."""
        placement = self.recovery.variables.placement
        if placement is None:
            return None
        held: dict[int, int] = dict.fromkeys(range(len(self.homes.processes)), 0)
        for s in {s.state: s for s in placement.shards}.values():
            for q in s.copies:
                held[q] += 1
        for state, copies in sorted(self.under_replicated().items(), key=lambda t: len(t[1])):
            if not self.alive(copies[0]):
                continue  # its primary is silent: the fail-over comes first
            mover = self.recovery.mover
            asked = None if mover is None or mover.wanted is None else set(mover.wanted)
            candidates = [
                q
                for q in held
                if q not in copies
                and self.alive(q)
                and (asked is None or q in asked)  # never onto a PS asked to leave
                and not self.backing_off(state, q)
            ]
            if candidates:
                return state, min(candidates, key=lambda q: (held[q], q))
        return None

    # ------------------------------------------------------------------ one copy

    async def copy(self, state: int, target: int) -> bool:
        """Make a copy of ``state`` on process ``target``; True once the placement
        names it."""
        r = self.recovery
        primary = self.homes.of[state]
        term = r.terms.get(state, TERM)
        started = self.clock()
        self.current = {"state": state, "to": target, "from": primary, "phase": "starting"}
        log.info("copying ps %d's state from ps %d to ps %d", state, primary, target)
        try:
            why, info = await self.join(
                state, target, self.rate, self.current, self.active, self.alive
            )
        finally:
            self.current = None
        seconds = round(self.clock() - started, 3)
        if not why:
            async with r.placement_lock:
                if self._moved(state, primary, term) or not self.alive(target):
                    why = "the placement changed while the copy caught up"
                else:
                    added = self._add(state, target)
                    await self._tell_epoch(state, added)
        copied = int(info.get("bytes", 0))
        record: dict[str, Any] = {
            "state": state,
            "to": target,
            "from": primary,
            "seconds": seconds,
            "bytes": copied,
        }
        self.bytes += copied
        if why:
            self.failures += 1
            record["failed"] = why
            self.outcome(state, target, ok=False)
            log.warning("copying ps %d's state to ps %d failed: %s", state, target, why)
            await self.drop_joiner(state)
        else:
            self.copies += 1
            self.outcome(state, target, ok=True)
            log.warning(
                "ps %d's state has a new copy on ps %d (%.2fs, %d bytes); %d states short of"
                " copies",
                state,
                target,
                seconds,
                copied,
                len(self.under_replicated()),
            )
        self.done.append(record)
        del self.done[:-KEEP]
        return not why

    async def join(
        self,
        state: int,
        target: int,
        rate: float,
        current: dict[str, Any],
        active: Callable[[], bool],
        answers: Callable[[int], bool],
        poll: float | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """An empty copy of ``state`` on ``target`` and its primary's ``join``, until the
        primary says the copy is in sync (a copy being made, or a state moving).
        Returns why it was given up ("": in sync) and the primary's account of the
        join; ``current`` is kept up to date with its phase and progress. ``active``
        false (a restore, the run's end, a deadline) or ``answers(target)`` false gives
        it up. The primary is asked how far the copy got every ``poll`` seconds
        (default: the heartbeat interval)."""
        r = self.recovery
        primary = self.homes.of[state]
        term = r.terms.get(state, TERM)
        processes = self.homes.processes
        why = ""
        info: dict[str, Any] = {}
        try:
            # begun under the placement's lock: a fail-over or a restore under way
            # ends first (a copy begun meanwhile would make the target a backup at
            # the term they fence copies with, its own state included)
            async with r.placement_lock:
                if self._moved(state, primary, term) or not active():
                    raise NotReady("the placement changed before the copy began")
                await processes[target].request(
                    "replica",
                    o.ReplicaSet(state, term, primary=False, make=True).to_wire(),
                    timeout=2.0,
                )
                body = o.Join(state, term, target, processes[target].endpoint, rate)
                await processes[primary].request("join", body.to_wire(), timeout=2.0)
            current["phase"] = "copying"
            while True:
                await asyncio.sleep(self.interval if poll is None else poll)
                if self._moved(state, primary, term):
                    why = "the state's primary changed"
                    break
                if not answers(target) or not active():
                    why = (
                        f"ps {target} is silent"
                        if not answers(target)
                        else ("a restore" if r.recovering else "the run's end or a deadline")
                    )
                    break
                rep = await processes[primary].request("status", timeout=2.0, slot=state)
                info = dict((rep.body.get("replica") or {}).get("joins", {}).get(str(target), {}))
                current.update(phase=info.get("state", "?"), progress=_progress(info))
                if info.get("state") == "in sync":
                    break
                if str(info.get("state", "failed")).startswith("failed"):
                    why = str(info.get("state", "failed: the primary forgot the copy"))
                    break
        except ZmqpsError as exc:
            why = f"{exc.code}: {exc}"
        return why, info

    def _moved(self, state: int, primary: int, term: int) -> bool:
        return (
            self.homes.of[state] != primary
            or self.recovery.terms.get(state, TERM) != term
            or self.recovery.variables.placement is None
        )

    def _add(self, state: int, target: int) -> Placement:
        r = self.recovery
        placement = r.variables.placement
        assert placement is not None
        shards = tuple(
            replace(s, backups=(*s.backups, target))
            if s.state == state and target not in s.copies
            else s
            for s in placement.shards
        )
        new = replace(placement, shards=shards, epoch=placement.epoch + 1)
        r.variables.use(new)
        self.homes.update(new)
        return new

    async def _tell_epoch(self, state: int, placement: Placement) -> None:
        """The state's primary hears the placement's epoch (its backups, the new one
        in, as they are): a restarted chief starts past the highest epoch a PS heard."""
        s = next(s for s in placement.shards if s.state == state)
        # every process hears the new copy is one (a restarted chief trusts no copy the
        # newest placement a process heard leaves out)
        await self.recovery.publish_placement(placement, skip=self.silent())
        links = tuple((q, self.homes.processes[q].endpoint) for q in s.backups)
        term = self.recovery.terms.get(state, TERM)
        body = o.ReplicaSet(state, term, True, links, epoch=placement.epoch)
        try:
            await self.homes.processes[s.ps].request("replica", body.to_wire(), timeout=2.0)
        except ZmqpsError as exc:
            log.info("ps %d: the placement epoch not told: %s", s.ps, exc)

    async def drop_joiner(self, state: int) -> None:
        """The primary of ``state`` ships to the placement's backups only (a joiner
        given up is dropped): :meth:`tell_backups` under the placement's lock."""
        async with self.recovery.placement_lock:
            await self.tell_backups(state)

    async def tell_backups(self, state: int) -> None:
        """The state's primary, as the placement names it, told its backups at the
        state's term. The caller holds the placement's lock: read in the middle of a
        fail-over, the home and the term do not go together (fault schedule 716: a
        restarted, empty process was made a primary at the new term)."""
        placement = self.recovery.variables.placement
        if placement is None:
            return
        first = next((s for s in placement.shards if s.state == state), None)
        if first is None:
            return
        links = tuple((q, self.homes.processes[q].endpoint) for q in first.backups)
        body = o.ReplicaSet(state, self.recovery.terms.get(state, TERM), True, links)
        with contextlib.suppress(ZmqpsError):
            await self.homes.processes[first.ps].request("replica", body.to_wire(), timeout=2.0)

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        placement = self.recovery.variables.placement
        copies = (
            {}
            if placement is None
            else {
                str(s.state): {"primary": s.ps, "backups": list(s.backups)}
                for s in {s.state: s for s in placement.shards}.values()
            }
        )
        return {
            "replication": self.recovery.cfg.replication,
            # processes silent past the heartbeat timeout while they are watched (a
            # launcher restarts such a stopped or hung one, so copies can be made again)
            "silent": self.silent(),
            "copies": copies,
            "under_replicated": sorted(self.under_replicated()),
            "copying": self.current,
            "copies_made": self.copies,
            "copies_failed": self.failures,
            "copied_bytes": self.bytes,
            "recent_copies": self.done[-5:],
        }


def _progress(info: dict[str, Any]) -> float:
    total = info.get("total_bytes") or 0
    return 1.0 if not total else round(min(1.0, info.get("bytes", 0) / total), 3)
