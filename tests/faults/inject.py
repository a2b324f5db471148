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
* Moves (``scale_ps``, ``kill_during_move``): the ask and the kill during a move come
  from tests/faults/scaler.py, a process in the chief's namespace that polls the
  status as fast as the chief answers (a move of the digits' states takes ~0.1 s, less
  than the probe's period) and kills the move's source, destination or the chief the
  moment the status names the move. The fault is over once the chief's plan is done
  (nothing planned, nothing moving, the PS asked for to leave exited). A scale back up
  first starts the drained PS again. A chief killed mid-plan forgets what it was asked
  (a restarted chief takes the PS serving the states for those asked for): it is asked
  again once back, as an operator would.
* Replicated schedules: a fault on a PS first waits (at most ``REPLICATED_WAIT_S``)
  until the chief says every state has all its copies, so one copy of each always
  lives; a killed PS is back once it restarted and its states have all their copies
  again (no restore: the generation does not change).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from faults.cluster import Supervisor, scaler_argv
from faults.observe import Timeline, progress_of
from faults.schedule import Fault, Schedule

__all__ = ["FaultRecord", "Injector"]

Waiting = Generator[None, None, Any]

#: seconds a PS fault of a replicated schedule waits for every state's copies
REPLICATED_WAIT_S = 30.0
#: seconds the chief's plan may take after a scale (moves, drains) before the fault
#: ends saying so
PLAN_WAIT_S = 30.0
#: seconds the scaler keeps asking, then looks for a move under way
ASK_S, WATCH_S = 30.0, 20.0


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
        #: the PS count each scale asked for, in order (the invariants read the last),
        #: and when each was answered
        self.asked: list[int] = []
        self.asked_at: list[float] = []
        self._scales = 0

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

    def _ending(self) -> bool:
        """Training ended or is ending (every worker done, the chief finishing). A PS
        started again from here may come up after the chief's shutdown reached its
        address, and wait for a chief for ever (seed 707: asked for during the final
        evaluation, before the status said ``finished``); ``zmqps launch`` stops such
        a task once the chief ended, the harness does not start it."""
        st = self.timeline.latest() or {}
        workers = st.get("workers") or []
        done = bool(workers) and all(w.get("state") == "done" for w in workers)
        return self._ended() or st.get("phase") in ("finishing", "finished") or done

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

    # -- moves -----------------------------------------------------------------------

    def _scaler(self, n: int, *extra: str) -> Waiting:
        """Run tests/faults/scaler.py asking for ``n`` PS; returns its JSON line (None:
        it wrote none)."""
        self._scales += 1
        cluster = self.sup.cluster
        out = cluster.run_dir / f"scale-{self._scales}.json"
        host = "chief" if self.s.netns else None
        proc = self.sup.helper(
            scaler_argv(cluster, n, out, *extra), host, cluster.run_dir / "scaler.log"
        )
        yield from self.until(lambda: proc.poll() is not None, ASK_S + WATCH_S + 10.0)
        if proc.poll() is None:
            proc.kill()
        try:
            return json.loads(out.read_text().splitlines()[-1])
        except (OSError, ValueError, IndexError):
            return None

    def _plan_done(self, n: int) -> bool:
        """The chief's status says the ask for ``n`` PS is met: the first ``n`` asked for
        (or more: a PS started again joins), each answering, the states served by them
        alone, nothing moving or planned, and the PS asked to leave have exited."""
        st = self.timeline.latest() or {}
        el = st.get("elastic") or {}
        asked = el.get("asked")
        if asked is None or not set(range(n)) <= set(asked):
            return False
        if el.get("moving") is not None or el.get("planned") != 0:
            return False
        if el.get("waiting"):  # a PS asked for not answering yet (started again)
            return False
        if not set(el.get("serving") or []) <= set(asked):
            return False
        tasks = self.sup.cluster.tasks
        return not any(t.role == "ps" and t.index not in asked and t.running for t in tasks)

    def _ask(self, rec: FaultRecord, n: int) -> Waiting:
        """Ask for ``n`` PS (started again first if they were drained) and wait until
        the plan is done; True when asked."""
        if n >= self.s.ps:
            if self._ending():  # as the launcher's PS schedule: none started after the end
                rec.notes.append("training ended: no PS started again")
                return False
            for i in range(self.s.ps):
                if self.sup.start_again(f"ps{i}"):
                    rec.notes.append(f"ps{i} started again")
        line = yield from self._scaler(n)
        if line is None or line.get("answered") is None:
            rec.notes.append(f"the ask for {n} PS failed: {(line or {}).get('error')}")
            return False
        self.asked.append(n)
        self.asked_at.append(time.monotonic())
        return True

    def _chief_pid(self) -> int | None:
        cur = self.sup.cluster.task("chief").current
        return None if cur is None else cur.pid

    def _wait_plan(self, rec: FaultRecord, n: int, since: float, asked_by: int | None) -> Waiting:
        """Until the plan for ``n`` PS is done; a chief other than the one asked
        (``asked_by``, its pid) is asked again once it answers."""
        chief = self.sup.cluster.task("chief")
        deadline = time.monotonic() + PLAN_WAIT_S
        while time.monotonic() < deadline:
            if self._plan_done(n):
                st = self.timeline.latest() or {}
                el = st.get("elastic") or {}
                rec.notes.append(
                    f"plan for {n} PS done after {time.monotonic() - since:.1f}s: serving"
                    f" {el.get('serving')}, {el.get('moves_done')} moves done,"
                    f" {el.get('moves_failed')} failed, drained {el.get('drained')}"
                )
                return True
            cur = chief.current
            if (
                cur is not None
                and cur.pid != asked_by
                and self.timeline.answered_since(cur.started)
            ):
                # a restarted chief forgot the ask: asked again
                asked_by = cur.pid
                rec.notes.append(f"the chief restarted: {n} PS asked for again")
                ok = yield from self._ask(rec, n)
                if not ok:
                    return False
            yield
        st = self.timeline.latest() or {}
        rec.notes.append(
            f"plan for {n} PS not done within {PLAN_WAIT_S:g}s: {st.get('elastic')}; PS"
            f" running {[t.name for t in self.sup.cluster.tasks if t.role == 'ps' and t.running]}"
        )
        return False

    def _scale(self, rec: FaultRecord) -> Waiting:
        f = rec.fault
        if self.s.replication > 1:  # a scale down moves states: every copy there first
            yield from self._copies(rec)
        rec.fired = time.monotonic()
        rec.targets.append("chief")
        asked_by = self._chief_pid()
        ok = yield from self._ask(rec, f.ps)
        if ok:
            yield from self._wait_plan(rec, f.ps, rec.fired, asked_by)

    def _kill_during_move(self, rec: FaultRecord) -> Waiting:
        f = rec.fault
        if self.s.replication > 1:
            yield from self._copies(rec)
        st = self.timeline.latest() or {}
        gen = int(st.get("gen", 0))
        failovers = int(st.get("failover_count") or 0)
        tasks = self.sup.cluster.tasks
        pids = [
            f"--pid={t.name}={t.current.pid}"
            for t in tasks
            if t.role in ("chief", "ps") and t.running and t.current is not None
        ]
        asked, asked_by = time.monotonic(), self._chief_pid()
        line = yield from self._scaler(f.ps, "--victim", f.target, *pids, f"--watch-s={WATCH_S}")
        if line is None or line.get("answered") is None:
            rec.skipped = f"the ask for {f.ps} PS failed: {(line or {}).get('error')}"
            return
        self.asked.append(f.ps)
        self.asked_at.append(time.monotonic())
        name = self.sup.mark_killed(int(line["pid"])) if line.get("killed") else None
        if name is None:
            rec.skipped = f"nobody killed: {line.get('why')} ({line.get('polls')} polls)"
            yield from self._wait_plan(rec, f.ps, asked, asked_by)
            return
        rec.fired = float(line["t"])
        rec.targets.append(name)
        mv = line.get("moving") or {}
        rec.notes.append(
            f"{name} killed while ps {mv.get('state')}'s state moved from ps {mv.get('from')}"
            f" to ps {mv.get('to')} ({mv.get('phase')}; {line.get('polls')} polls)"
        )
        if name == "chief":
            why = yield from self.back("chief", rec.fired, gen, None)
        else:
            why = yield from self._ps_back(name, rec.fired, failovers)
        if why:
            rec.notes.append(why)
        yield from self._wait_plan(rec, f.ps, rec.fired, asked_by)

    def _ps_back(self, name: str, killed_at: float, failovers_before: int) -> Waiting:
        """A PS killed during a move is back: restarted, and the chief counts no PS
        down, recovers nothing, moves nothing (replicated: every copy made again)."""
        task = self.sup.cluster.task(name)
        timeout = self.hb + 20.0

        def back() -> bool:
            cur = task.current
            if len(task.instances) < 2 or cur is None or cur.started <= killed_at:
                return False
            st = self.timeline.latest() or {}
            if st.get("recovering") or str(task.index) in (st.get("ps_down") or {}):
                return False
            if (st.get("elastic") or {}).get("moving") is not None:
                return False
            return self.s.replication <= 1 or self._replicated(st)

        ok = yield from self.until(back, timeout)
        return None if ok else f"{name} not back within {timeout:g}s of the kill"

    def _copies(self, rec: FaultRecord) -> Waiting:
        ok = yield from self.until(
            lambda: self._replicated(self.timeline.latest() or {}), REPLICATED_WAIT_S
        )
        if not ok:
            rec.notes.append(f"states still short of copies after {REPLICATED_WAIT_S:g}s")

    # -- the faults ------------------------------------------------------------------

    def _run(self, rec: FaultRecord) -> Waiting:
        f = rec.fault
        if f.kind == "scale_ps":
            yield from self._scale(rec)
            rec.ended = time.monotonic()
            return
        if f.kind == "kill_during_move":
            yield from self._kill_during_move(rec)
            if rec.injected:
                rec.ended = time.monotonic()
            return
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
        elif kind == "term_worker":
            inc = self._incarnation(task.index)
            if not self.sup.signal(f.target, signal.SIGTERM):
                rec.fired, rec.skipped = None, f"{f.target} was not running"
                return
            rec.targets.append(f.target)
            # it leaves ("terminated") and exits; the supervisor starts it again
            why = yield from self.back(f.target, rec.fired, gen, inc)
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
