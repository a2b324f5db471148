"""Run one schedule: start its cluster, inject its faults, collect what the invariants read.

Rules of this module:

* :func:`execute` returns when every task has ended on its own, or when the run's
  bound (:func:`bound`, derived from the unfaulted run and the faults) has passed: then
  the harness stops the cluster (SIGTERM, SIGKILL 10 s later) and the run counts as
  hung. Either way every process is reaped and every namespace deleted before it
  returns; what is still found afterwards (a process of the run, a shared-memory
  region) is recorded for invariant 1.
* :class:`References` runs the unfaulted counterpart of a schedule's configuration
  (same cluster, same job, no faults, loopback, no evaluator) a few times and caches
  what the invariants compare with, one JSON file per configuration.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from faults.cluster import ShmSandbox, Supervisor, Task, build, hosts_of
from faults.inject import FaultRecord, Injector
from faults.observe import Sample, Timeline
from faults.schedule import MOVE_KINDS, Schedule

__all__ = ["Reference", "References", "RunRecord", "bound", "execute"]

TICK_S = 0.05
#: Bump when what a reference holds, or how it is made, changes.
REFERENCE_VERSION = 4  # 4: no reference from a run that restored without a fault


def _netns() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
    import netns  # tests/cluster/netns.py

    return netns


def netns_unavailable() -> str | None:
    """Why this machine cannot run a schedule in network namespaces (None: it can)."""
    netns = _netns()
    why: str | None = netns.unavailable()
    if why is None and netns.firewall() is None:
        why = "neither nft nor iptables is installed"
    return why


@dataclass
class Reference:
    """The unfaulted runs of one configuration."""

    key: str
    accuracies: list[float]  # the summary's test accuracy (359 test images)
    accuracies_all: list[float]  # the exported model's, on all 1797 digits images
    losses: list[float]
    global_steps: list[int]
    worker_steps: int  # every worker's planned steps, summed
    planned: dict[int, int]  # worker index -> its planned steps (worker driver)
    wall: float  # the longest wall time of a run, start to end of every process
    train_seconds: float  # the longest training time (the chief's summary)
    closures_per_epoch: float | None = None  # coordinator driver
    version: int = REFERENCE_VERSION
    #: share of the steps taken after the first worker finished, per run (invariant 4)
    lone_shares: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Reference:
        d = dict(d)
        d["planned"] = {int(k): int(v) for k, v in d["planned"].items()}
        return cls(**d)


@dataclass
class PSFinal:
    """The final process of one PS: its status as it logged it when it stopped."""

    status: dict[str, Any] | None
    #: the first generation it served (0 unless it is a restarted process)
    gen_start: int
    #: it lived through the whole run (never killed, never restarted)
    full_life: bool


@dataclass
class RunRecord:
    schedule: Schedule
    run_dir: Path
    started: float
    ended: float
    bound: float
    hung: bool
    failure: str  # the supervisor gave up on a task
    stopped_at: float | None  # when the harness stopped the cluster (hung / failure)
    tasks: list[Task]
    events: list[dict[str, Any]]
    faults: list[FaultRecord]
    samples: list[Sample]
    summary: dict[str, Any] | None
    stats: dict[int, dict[str, Any]]
    ps_final: dict[int, PSFinal]
    restores: list[tuple[str, int, int]]  # (checkpoint name or "initial values", step, gen)
    committed: set[int]  # steps of every checkpoint committed during the run
    evals: list[dict[str, Any]]
    export_problem: str | None  # None: the exported model loads and is finite
    #: the exported model's accuracy on all 1797 digits images (train and test)
    accuracy_all: float | None
    #: the PS count each scale asked the chief for, in order (moves; empty: none)
    asked: list[int] = field(default_factory=list)
    asked_at: list[float] = field(default_factory=list)
    #: PS index -> how many times the chief found it restarted without its shards
    found_restarted: dict[int, int] = field(default_factory=dict)
    leftover_procs: list[str] = field(default_factory=list)
    leftover_shm: list[str] = field(default_factory=list)
    #: how leftover regions were looked for
    shm_how: str = ""
    #: the chief's lines (every incarnation's) counting a worker out of M: missed
    #: heartbeats, or left unfinished and not back within the heartbeat timeout
    workers_gone: list[str] = field(default_factory=list)

    @property
    def wall(self) -> float:
        return self.ended - self.started


def bound(s: Schedule, ref: Reference) -> float:
    """Seconds the run may take before it counts as hung: twice the unfaulted run plus
    20 s, plus per fault its own duration and what recovering from it may take: a
    killed task's restart, detection (the heartbeat timeout) and restore (20 s)."""
    hb = s.heartbeat_timeout
    total = 2 * ref.wall + 20.0
    for f in s.faults:
        if f.kind == "kill_during_move":  # the moves, a kill's recovery
            total += hb + 35.0
        elif f.kind.startswith("kill_") or f.kind == "term_worker":
            total += hb + 20.0
        elif f.kind in ("stop_short", "stop_long"):
            total += f.duration + hb + 5.0
        elif f.kind == "finish_while_stopped":
            total += f.duration + 3 * ref.train_seconds + 3 * hb + 15.0
        elif f.kind == "chief_during_ps_restart":
            total += f.delay + 2 * (hb + 20.0)
        elif f.kind == "partition_ps":
            total += f.duration + hb + 10.0
        elif f.kind == "scale_ps":  # the moves, a drained PS started again
            total += 15.0
    return round(total, 1)


# ---------------------------------------------------------------- what is left


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def leftover_processes(run_dir: Path) -> list[int]:
    """Live processes started for the run in ``run_dir`` (they carry this process's
    pid as ``--parent-pid`` and paths in the run's folder)."""
    me = str(os.getpid())
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        argv = _argv(int(p.name))
        if "--parent-pid" not in argv or str(run_dir) not in " ".join(argv):
            continue
        i = argv.index("--parent-pid")
        if i + 1 < len(argv) and argv[i + 1] == me:
            try:
                state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                found.append(int(p.name))
    return found


SHM_DIR = Path("/dev/shm")


def shm_regions() -> set[str]:
    """zmqps' shared-memory regions (transport/shm.py names them zmqps-<hex>)."""
    try:
        return {p.name for p in SHM_DIR.iterdir() if p.name.startswith("zmqps-")}
    except OSError:
        return set()


def _mapped(names: set[str]) -> set[str]:
    """Which of ``names`` some live process maps (they belong to a run still going)."""
    found: set[str] = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            maps = (p / "maps").read_text()
        except OSError:
            continue
        found |= {n for n in names if n in maps}
    return found


def leftover_shm(before: set[str]) -> list[str]:
    """Regions made during the run that outlive it: not there before, still there 2 s
    after, mapped by no live process (another run on this machine maps its own)."""
    deadline = time.monotonic() + 2.0
    new = shm_regions() - before
    while new and time.monotonic() < deadline:
        time.sleep(0.1)
        new = shm_regions() - before
    return sorted(new - _mapped(new))


# ---------------------------------------------------------------- logs


_STOPPED = re.compile(r"ps \d+: final state: (\{.*\})$", re.MULTILINE)
#: replicated: the final state of each PS state a process was the primary of
_STATE_STOPPED = re.compile(
    r"ps \d+: final state of ps (\d+)'s state \(primary, term (\d+)\): (\{.*\})$", re.MULTILINE
)
_PS_RESTORED = re.compile(r"restored \d+ shards from .+? \(generation (\d+), step \d+\)")
_CHIEF_RESTORED = re.compile(r"restored every shard to (.+?) \(step (\d+), generation (\d+)\)")
#: the chief's health watch found these PS restarted (each such finding: a restore)
_FOUND_RESTARTED = re.compile(r"ps \[([\d, ]+)\] restarted without its shards")
_COMMITTED = re.compile(r"checkpoint ckpt-(\d+) committed")
_WORKER_GONE = re.compile(
    r"worker \d+ (?:missed heartbeats for \S+: considered dead|left \([^)]*\) and is not back)"
)
_START = "### faults: start "


def _segments(log: str) -> list[str]:
    """A task's log cut at each start of it."""
    parts = log.split(_START)
    return [p for p in parts[1:]] or [log]


def _ps_final(log: str, instances: int) -> PSFinal:
    last = _segments(log)[-1]
    m = _STOPPED.search(last)
    status = json.loads(m.group(1)) if m else None
    gen_start = 0
    if instances > 1:
        r = _PS_RESTORED.search(last)
        gen_start = int(r.group(1)) if r else 1 << 30  # never restored: served nothing
    return PSFinal(status, gen_start, full_life=instances == 1)


def _states_final(logs: list[str], states: int, restored: bool) -> dict[int, PSFinal]:
    """Replicated: each PS state's final status, as its last primary (the highest term
    any process's last start logged) saw it. A state lives through the run unless a
    restore replaced every copy."""
    best: dict[int, tuple[int, dict[str, Any]]] = {}
    for log in logs:
        for m in _STATE_STOPPED.finditer(_segments(log)[-1]):
            state, term = int(m.group(1)), int(m.group(2))
            if state not in best or term > best[state][0]:
                best[state] = (term, json.loads(m.group(3)))
    return {
        i: PSFinal(best[i][1] if i in best else None, 0, full_life=not restored)
        for i in range(states)
    }


def _moved_final(
    logs: list[str], instances: list[int], restores: list[tuple[str, int, int]]
) -> dict[int, PSFinal]:
    """Unreplicated, with moves: each PS state's final status. A state that moved (or
    was made ready to) is a replication primary with no backups wherever it is: the
    highest term any process's last start logged for it, as replicated; one that never
    did, its own process's final status. Its counts travel with it (the copy a move
    makes carries its push ledger), so without a restore they cover the whole run;
    after a restore, only the last restore's generation is compared (the process that
    holds the state may have started since) and the per-state shares are not."""
    best: dict[int, tuple[int, dict[str, Any]]] = {}
    for log in logs:
        for m in _STATE_STOPPED.finditer(_segments(log)[-1]):
            state, term = int(m.group(1)), int(m.group(2))
            if state not in best or term > best[state][0]:
                best[state] = (term, json.loads(m.group(3)))
    last_gen = max((g for _, _, g in restores), default=0)
    out = {}
    for i, log in enumerate(logs):
        if i in best:
            out[i] = PSFinal(best[i][1], last_gen, full_life=not restores)
        else:
            out[i] = _ps_final(log, instances[i])
    return out


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _export_check(summary: dict[str, Any] | None) -> tuple[str | None, float | None]:
    """(problem, accuracy): the exported model must load and hold finite values; its
    accuracy is measured on every image of the digits (train and test: 1797)."""
    if not summary or not summary.get("export_dir"):
        return "no exported model", None
    import numpy as np

    from zmqps.data import load_dataset
    from zmqps.export import load_model

    try:
        model, params, _ = load_model(summary["export_dir"])
    except Exception as exc:  # any failure to load is the finding
        return f"the export does not load: {exc}", None
    bad = [k for k, v in params.items() if not np.all(np.isfinite(np.asarray(v)))]
    if bad:
        return f"non-finite values in {bad}", None
    parts = [load_dataset("digits", split) for split in ("train", "test")]
    x = np.concatenate([d.x for d in parts])
    y = np.concatenate([d.y for d in parts])
    return None, float(model.evaluate(params, x, y)["accuracy"])  # type: ignore[union-attr]


# ---------------------------------------------------------------- a run


def execute(
    s: Schedule,
    run_dir: Path,
    ref: Reference,
    say: Callable[[str], None] = lambda _: None,
) -> RunRecord:
    """Run schedule ``s`` in ``run_dir`` (made; must not hold an earlier run)."""
    run_dir.mkdir(parents=True, exist_ok=False)
    shm_before = shm_regions()
    hosts = None
    netns = None
    if s.netns:
        netns = _netns()
        netns.sweep()
        hosts = netns.Hosts(hosts_of(s))
    sup: Supervisor | None = None
    injector: Injector | None = None
    sandbox: ShmSandbox | None = None
    wrap: Callable[[str | None, list[str]], list[str]] | None = None
    if hosts is not None:
        wrap = lambda host, argv: argv if host is None else hosts.argv(host, argv)  # noqa: E731
    elif ShmSandbox.unavailable() is None:
        sandbox = ShmSandbox()
        wrap = lambda host, argv: argv if host is None else sandbox.wrap(argv)  # noqa: E731
    try:
        cluster = build(s, run_dir, None if hosts is None else hosts.ip)
        if sandbox is not None:
            for t in cluster.tasks:
                t.host = "loopback"
        sup = Supervisor(cluster, wrap=wrap)
        timeline = Timeline(cluster.probe_out)
        injector = Injector(
            s,
            sup,
            timeline,
            total_steps=ref.worker_steps,
            train_seconds=ref.train_seconds,
            partition=None if hosts is None else hosts.partition,
            heal=None if hosts is None else hosts.heal,
        )
        limit = bound(s, ref)
        started = time.monotonic()
        sup.start_all()
        sup.start_probe(None if hosts is None else "chief")
        hung = False
        while True:
            now = time.monotonic()
            sup.tick(now)
            timeline.read()
            if sup.stopping or sup.all_done():
                break
            injector.tick(now)
            if now - started > limit:
                hung = True
                say(f"seed {s.seed}: still running after {limit:g}s: stopping it")
                break
            time.sleep(TICK_S)
        injector.abort()
        stopped_at = None
        if not sup.all_done():
            stopped_at = time.monotonic()
            sup.stop()
        ended = max(
            (i.ended or stopped_at or time.monotonic() for t in cluster.tasks for i in t.instances),
            default=time.monotonic(),
        )
        sup.reap()
        timeline.read()
    finally:
        if injector is not None:
            injector.abort()
        if sup is not None:
            sup.stopping = True
            sup.reap()
        if hosts is not None:
            hosts.close()
        shm_left = [] if sandbox is None else sandbox.regions()
        if sandbox is not None:
            sandbox.close()
    left = leftover_processes(run_dir)
    for pid in left:
        from contextlib import suppress

        with suppress(ProcessLookupError):
            os.kill(pid, 9)
    left_desc = [f"{pid}: {' '.join(_argv(pid))[:160]}" for pid in left]
    if sandbox is None and hosts is None:
        shm_left = leftover_shm(shm_before)
        for name in shm_left:  # the harness cleans up after reporting
            (SHM_DIR / name).unlink(missing_ok=True)

    summary = _read_json(cluster.summary)
    stats = {}
    for i in range(s.workers):
        st = _read_json(cluster.stats(i))
        if st is not None:
            stats[i] = st
    chief_log = (run_dir / "chief.log").read_text(errors="replace")
    restores = [
        (m.group(1), int(m.group(2)), int(m.group(3))) for m in _CHIEF_RESTORED.finditer(chief_log)
    ]
    logs = [(run_dir / f"ps{i}.log").read_text(errors="replace") for i in range(s.ps)]
    if s.replication > 1:  # a state outlives the process it started on
        ps_final = _states_final(logs, s.ps, bool(restores))
    elif any(f.kind in MOVE_KINDS for f in s.faults):  # states moved between processes
        instances = [len(cluster.task(f"ps{i}").instances) for i in range(s.ps)]
        ps_final = _moved_final(logs, instances, restores)
    else:
        ps_final = {
            i: _ps_final(log, len(cluster.task(f"ps{i}").instances)) for i, log in enumerate(logs)
        }
    found: dict[int, int] = {}
    for m in _FOUND_RESTARTED.finditer(chief_log):
        for q in m.group(1).split(","):
            found[int(q)] = found.get(int(q), 0) + 1
    committed = {int(m.group(1)) for m in _COMMITTED.finditer(chief_log)}
    # a chief killed between a checkpoint's commit (its manifest renamed into place)
    # and the log line saying so: the checkpoint is there all the same
    committed |= {
        int(d.name.removeprefix("ckpt-"))
        for d in cluster.checkpoints.glob("ckpt-*")
        if (d / "manifest.json").is_file()
    }
    evals = []
    if cluster.eval_log.exists():
        for line in cluster.eval_log.read_text().splitlines():
            try:
                evals.append(json.loads(line))
            except ValueError:
                continue
    export_problem, accuracy_all = _export_check(summary)
    return RunRecord(
        schedule=s,
        run_dir=run_dir,
        started=started,
        ended=ended,
        bound=limit,
        hung=hung,
        failure=sup.failed(),
        stopped_at=stopped_at,
        tasks=cluster.tasks,
        events=sup.events,
        faults=injector.records,
        samples=timeline.samples,
        summary=summary,
        stats=stats,
        ps_final=ps_final,
        restores=restores,
        committed=committed,
        evals=evals,
        export_problem=export_problem,
        accuracy_all=accuracy_all,
        asked=list(injector.asked),
        asked_at=list(injector.asked_at),
        found_restarted=found,
        workers_gone=[m.group(0) for m in _WORKER_GONE.finditer(chief_log)],
        leftover_procs=left_desc,
        leftover_shm=shm_left,
        shm_how=(
            "in the run's own /dev/shm"
            if sandbox is not None
            else "not visible: each namespace had its own /dev/shm, gone with its task"
            if hosts is not None
            else "in /dev/shm: new, still there 2 s after the end, mapped by no process"
        ),
    )


# ---------------------------------------------------------------- references


class References:
    """Unfaulted results per configuration, cached as JSON files in ``directory``."""

    #: unfaulted runs per configuration: async orders updates by timing (and sync adds
    #: three or more float32 gradients in the order they come), so one run is one
    #: sample of the accuracy: the reference is the range of three
    RUNS = 3

    #: attempts per unfaulted run: one that fails is a finding (kept, reported), not
    #: a reason to give up on the configuration
    ATTEMPTS = 3

    def __init__(self, directory: Path, work: Path, say: Callable[[str], None] = print) -> None:
        self.dir = directory
        self.work = work
        self.say = say
        self.dir.mkdir(parents=True, exist_ok=True)
        #: configuration key -> what went wrong in its unfaulted runs (logs kept)
        self.failures: dict[str, list[str]] = {}

    def path(self, s: Schedule) -> Path:
        return self.dir / f"{s.config_key()}.json"

    def get(self, s: Schedule) -> Reference:
        path = self.path(s)
        # one process makes a configuration's runs; another that needs them meanwhile
        # (the suite's schedules spread over its test processes) waits and reads them
        with path.with_suffix(".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cached = _read_json(path)
            if cached and cached.get("version") == REFERENCE_VERSION:
                return Reference.from_json(cached)
            ref = self._make(s)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(ref.to_json(), indent=2) + "\n")
            tmp.replace(path)
            return ref

    def _make(self, s: Schedule) -> Reference:
        base = s.unfaulted()
        runs = self.RUNS
        # a provisional reference: generous bounds for the unfaulted runs themselves
        provisional = Reference(s.config_key(), [], [], [], [], 1, {}, 60.0, 20.0)
        records: list[RunRecord] = []
        failed = self.failures.setdefault(s.config_key(), [])
        while len(records) < runs:
            if len(failed) >= self.ATTEMPTS:
                raise RuntimeError(f"unfaulted runs of {s.config_key()} failed: {failed}")
            k = len(records) + len(failed)
            run_dir = self.work / f"reference-{s.config_key()}-{k}-{os.getpid()}-{time.time_ns()}"
            self.say(f"unfaulted run {len(records) + 1}/{runs} of {s.config_key()}")
            rec = execute(base, run_dir, provisional)
            problem = _unfaulted_problem(rec)
            if problem:
                failed.append(f"{problem}; logs in {run_dir}")
                self.say(f"the unfaulted run failed: {failed[-1]}")
                continue
            records.append(rec)
            shutil.rmtree(run_dir, ignore_errors=True)
        sums = [r.summary for r in records if r.summary]
        planned: dict[int, int] = {}
        for r in records:
            for i, st in r.stats.items():
                planned[i] = int(st["steps"])
        closures = None
        if s.driver == "coordinator":
            closures = sums[0]["coordinator"]["scheduled"] / s.epochs
        return Reference(
            key=s.config_key(),
            accuracies=[float(x["test_accuracy"]) for x in sums],
            accuracies_all=[float(r.accuracy_all or 0.0) for r in records],
            losses=[float(x["test_loss"]) for x in sums],
            global_steps=[int(x["global_step"]) for x in sums],
            worker_steps=int(sums[0]["worker_steps"]),
            planned=planned,
            wall=round(max(r.wall for r in records), 2),
            train_seconds=round(max(float(x["train_seconds"]) for x in sums), 2),
            closures_per_epoch=closures,
            lone_shares=[
                round(x, 4) for r in records if (x := lone_share(r.samples, planned)) is not None
            ],
        )


def lone_share(samples: list[Sample], planned: dict[int, int]) -> float | None:
    from faults.invariants import lone_share as share

    return share(samples, planned)


def _unfaulted_problem(rec: RunRecord) -> str | None:
    if rec.hung:
        return f"it did not end within {rec.bound:g}s"
    bad = [f"{t.name} exit {i.rc}" for t in rec.tasks for i in t.instances if i.rc != 0 or i.killed]
    if bad:
        return ", ".join(bad)
    if not rec.summary or not math.isfinite(float(rec.summary.get("test_loss", math.nan))):
        return "no summary with a finite test loss"
    if int(rec.summary.get("restores") or 0):
        # a task taken for dead with no fault (a stall past the heartbeat timeout): the
        # run is no reference (its workers trained batches again), and a finding
        return f"{rec.summary['restores']} restore(s) from a checkpoint with no fault injected"
    return rec.export_problem
