"""Fault injectors: signals and namespace firewall rules, from outside the product.

Rules of this module:

* Faults run one after another, each when the run's progress (:meth:`Injector.progress`:
  a fraction of the unfaulted run) reaches the fault's point and the previous fault is
  over. A fault whose point the run never reaches, or whose
  target has already exited, is skipped and says why.
* Each fault is a generator the harness's loop advances every tick (no thread, no
  fixed sleep: waits are polls with deadlines). It records when it fired and when its
  direct effect was over (SIGCONT, heal, or the killed task back: restarted and heard
  of by the chief), which the invariants use to tell whom a pause may be blamed on.
* :meth:`Injector.abort` undoes what is still in force (SIGCONT, heal) at the end.
* Replicated schedules: a fault on a PS first waits (at most ``REPLICATED_WAIT_S``)
  until the chief says every state has all its copies, so one copy of each always
  lives; a killed PS is back once it restarted and its states have all their copies
  again (no restore: the generation does not change).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from faults.cluster import Supervisor
from faults.observe import Timeline, progress_of
from faults.schedule import Fault, Schedule

__all__ = ["FaultRecord", "Injector"]

Waiting = Generator[None, None, Any]

#: seconds a PS fault of a replicated schedule waits for every state's copies
REPLICATED_WAIT_S = 30.0


@dataclass
class FaultRecord:
    fault: Fault
    fired: float | None = None
    #: when its direct effect was over: SIGCONT, heal, or the killed task back
    ended: float | None = None
    #: the tasks it hit (chief_during_ps_restart: the PS and the chief)
    targets: list[str] = field(default_factory=list)
    skipped: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def injected(self) -> bool:
        return self.fired is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.fault.kind,
            "target": self.fault.target,
            "at": self.fault.at,
            "duration": self.fault.duration,
            "fired": self.fired,
            "ended": self.ended,
            "targets": self.targets,
            "skipped": self.skipped,
            "notes": self.notes,
        }


class Injector:
    def __init__(
        self,
        schedule: Schedule,
        sup: Supervisor,
        timeline: Timeline,
        total_steps: int,
        train_seconds: float,
        partition: Callable[[str], None] | None = None,
        heal: Callable[[str], None] | None = None,
    ) -> None:
        self.s = schedule
        self.sup = sup
        self.timeline = timeline
        self.total_steps = max(1, total_steps)
        self.train_seconds = max(0.5, train_seconds)
        self._partition = partition
        self._heal = heal
        self.records = [FaultRecord(f) for f in schedule.faults]
        self._next = 0
        self._running: tuple[FaultRecord, Waiting] | None = None
        self._partitioned: set[str] = set()
        self.hb = schedule.heartbeat_timeout
        self._training_since: float | None = None

    # -- the loop ------------------------------------------------------------------

    def progress(self) -> float:
        """How far training is, as a fraction of the unfaulted run: the workers' steps
        as the chief knows them, or the time since the first worker registered over
        the unfaulted run's training time, whichever is further (the chief hears of
        async steps once a heartbeat, so steps alone lag by up to a second)."""
        st = self.timeline.latest()
        steps = 0.0 if st is None else progress_of(st) / self.total_steps
        if self._training_since is None:
            self._training_since = next(
                (s.t for s in self.timeline.samples if s.status and s.status.get("workers")),
                None,
            )
        if self._training_since is None:
            return steps
        return max(steps, (time.monotonic() - self._training_since) / self.train_seconds)

    def _ended(self) -> bool:
        st = self.timeline.latest()
        return self.sup.chief_done() or bool(st and st.get("finished"))

    def tick(self, now: float) -> None:
        if self._running is not None:
            rec, gen = self._running
            try:
                next(gen)
                return
            except StopIteration:
                if rec.ended is None:
                    rec.ended = time.monotonic()
                self._running = None
        if self._next >= len(self.records) or self.sup.stopping:
            return
        rec = self.records[self._next]
        if self._ended():
            for r in self.records[self._next :]:
                r.skipped = "training ended before its point"
            self._next = len(self.records)
            return
        if self.progress() < rec.fault.at:
            return
        self._next += 1
        gen = self._run(rec)
        self._running = (rec, gen)
        try:
            next(gen)
        except StopIteration:
            if rec.injected and rec.ended is None:
                rec.ended = time.monotonic()
            self._running = None

    def busy(self) -> bool:
        return self._running is not None

    def abort(self) -> None:
        """Undo what is still in force; the fault being injected ends here, those not
        injected yet are skipped."""
        for r in self.records[self._next :]:
            r.skipped = r.skipped or "the run ended before its point"
        self._next = len(self.records)
        if self._running is not None:
            rec, gen = self._running
            gen.close()
            rec.notes.append("cut short: the run ended")
            if rec.ended is None:
                rec.ended = time.monotonic()
            self._running = None
        for t in self.sup.cluster.tasks:
            if t.stopped:
                self.sup.signal(t.name, signal.SIGCONT)
        for host in list(self._partitioned):
            self.heal(host)

    # -- helpers ---------------------------------------------------------------------

    def sleep(self, seconds: float) -> Waiting:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            yield

    def until(self, pred: Callable[[], Any], timeout: float) -> Waiting:
        """Wait for ``pred()``; returns it, or None at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            got = pred()
            if got:
                return got
            if time.monotonic() >= deadline:
                return None
            yield

    def kill(self, rec: FaultRecord, name: str) -> bool:
        if not self.sup.signal(name, signal.SIGKILL):
            rec.notes.append(f"{name} was not running")
            return False
        rec.targets.append(name)
        return True

    def partition(self, host: str) -> None:
        assert self._partition is not None
        self._partition(host)
        self._partitioned.add(host)

    def heal(self, host: str) -> None:
        assert self._heal is not None
        self._heal(host)
        self._partitioned.discard(host)

    def _incarnation(self, index: int) -> int | None:
        st = self.timeline.latest() or {}
        for w in st.get("workers") or []:
            if w.get("index") == index:
                return int(w["incarnation"])
        return None

    def back(
        self,
        name: str,
        killed_at: float,
        gen_before: int,
        inc_before: int | None,
        failovers_before: int = 0,
    ) -> Waiting:
        """Wait until the killed task ``name`` is back: restarted and, for the chief, PS
        and workers, heard of again (the chief answers; the PS restored into a newer
        generation; the worker registered as a new incarnation)."""
        task = self.sup.cluster.task(name)
        # restart allowance: process start on a loaded machine, detection, restore
        timeout = self.hb + 20.0

        def restarted() -> float | None:
            cur = task.current
            if len(task.instances) >= 2 and cur is not None and cur.started > killed_at:
                return cur.started
            return None

        def heard() -> bool:
            st = self.timeline.latest() or {}
            if name == "chief":
                started = restarted()
                return started is not None and self.timeline.answered_since(started)
            if task.role == "ps" and self.s.replication > 1:  # failed over, copies made
                # a chief started since the kill counts its own fail-overs only: one it
                # adopted (the killed chief's) shows in the placement it rebuilt
                failed_over = int(st.get("failover_count") or 0) > failovers_before
                chief = self.sup.cluster.task("chief").current
                adopted = (
                    chief is not None
                    and chief.started > killed_at
                    and self.timeline.answered_since(chief.started)
                )
                return (failed_over or adopted) and self._replicated(st)
            if task.role == "ps":
                return (
                    int(st.get("gen", 0)) > gen_before
                    and not st.get("recovering")
                    and str(task.index) not in (st.get("ps_down") or {})
                )
            if task.role == "worker":
                if self.sup.chief_done() or (task.current is not None and task.current.rc == 0):
                    return True
                inc = self._incarnation(task.index)
                return inc is not None and inc != inc_before
            return restarted() is not None

        ok = yield from self.until(lambda: restarted() is not None and heard(), timeout)
        if not ok:
            return f"{name} not back within {timeout:g}s of the kill"
        return None

    @staticmethod
    def _replicated(st: dict[str, Any]) -> bool:
        """The chief's status says every state has all its copies, none being made."""
        rep = st.get("replication") or {}
        return bool(rep) and not rep.get("under_replicated") and rep.get("copying") is None

    # -- the faults ------------------------------------------------------------------

    def _run(self, rec: FaultRecord) -> Waiting:
        f = rec.fault
        task = self.sup.cluster.task(f.target)
        if self.s.replication > 1 and task.role == "ps":
            ok = yield from self.until(
                lambda: self._replicated(self.timeline.latest() or {}), REPLICATED_WAIT_S
            )
            if not ok:
                rec.notes.append(f"states still short of copies after {REPLICATED_WAIT_S:g}s")
        if not task.running:
            rec.skipped = f"{f.target} was not running (already exited)"
            return
        rec.fired = time.monotonic()
        st = self.timeline.latest() or {}
        gen = int(st.get("gen", 0))
        kind = f.kind
        if kind.startswith("kill_"):
            inc = self._incarnation(task.index) if task.role == "worker" else None
            failovers = int(st.get("failover_count") or 0)
            if not self.kill(rec, f.target):
                rec.fired, rec.skipped = None, rec.notes.pop()
                return
            why = yield from self.back(f.target, rec.fired, gen, inc, failovers)
            if why:
                rec.notes.append(why)
        elif kind in ("stop_short", "stop_long"):
            self.sup.signal(f.target, signal.SIGSTOP)
            rec.targets.append(f.target)
            yield from self.sleep(f.duration)
            self.sup.signal(f.target, signal.SIGCONT)
        elif kind == "finish_while_stopped":
            self.sup.signal(f.target, signal.SIGSTOP)
            rec.targets.append(f.target)
            # held until another worker has finished its data (at least f.duration s);
            # at most what its data could take, with room for the others' detection
            longest = f.duration + 3 * self.train_seconds + 2 * self.hb + 10.0
            started = time.monotonic()

            def other_done() -> str | None:
                if time.monotonic() - started < f.duration:
                    return None
                st = self.timeline.latest() or {}
                for w in st.get("workers") or []:
                    if f"worker{w['index']}" != f.target and w.get("state") == "done":
                        return f"worker{w['index']}"
                return None

            who = yield from self.until(other_done, longest)
            rec.notes.append(
                f"{who} finished while {f.target} was stopped"
                if who
                else f"no other worker finished within {longest:.0f}s"
            )
            self.sup.signal(f.target, signal.SIGCONT)
        elif kind == "chief_during_ps_restart":
            failovers = int(st.get("failover_count") or 0)
            self.kill(rec, f.target)
            yield from self.sleep(f.delay)
            if self.kill(rec, "chief"):
                chief_killed = time.monotonic()
                why = yield from self.back("chief", chief_killed, gen, None)
                if why:
                    rec.notes.append(why)
            why = yield from self.back(f.target, rec.fired, gen, None, failovers)
            if why:
                rec.notes.append(why)
        elif kind == "partition_ps":
            self.partition(f.target)
            rec.targets.append(f.target)
            try:
                yield from self.sleep(f.duration)
            finally:
                self.heal(f.target)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        rec.ended = time.monotonic()
