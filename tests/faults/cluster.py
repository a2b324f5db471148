"""A schedule's cluster as processes, and the supervisor that restarts them.

Rules of this module:

* Every task is started by hand with a cluster spec (``--cluster``) and the public
  command line, as an orchestrator would: chief and PS with ``zmqps server``, workers
  and the evaluator with ``zmqps worker``. Loopback (127.0.0.1, free ports) unless the
  schedule runs in network namespaces (tests/cluster/netns.py: addresses that exist
  only inside them).
* Every task carries ``--parent-pid`` (this process) and paths inside the run's
  folder, so anything left of a run is found by its command line.
* The supervisor restarts a task that dies the way ``zmqps launch --restart
  on-failure`` does: a non-zero exit (a signal too) is restarted 0.2 s later, unless
  the cluster is stopping or the chief has already ended the job with exit code 0,
  or the exit code says it would fail again (2: its configuration; 3: the run ended
  failed); at most ``MAX_RESTARTS`` times per task, else the run has failed.
* Each task's output (every start of it) goes to ``RUN/<task>.log``, a marker line
  before each start.
* A PS that exits 0 while the run goes on was drained by the chief (its states moved
  off it, ``scale``): it is not restarted; the fault that asks for it again starts it
  again (:meth:`Supervisor.start_again`), as ``zmqps launch --ps-schedule`` does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faults.schedule import Schedule
from zmqps.wire.errors import EXIT_CONFIG, EXIT_RUN_FAILED

__all__ = ["MAX_RESTARTS", "Cluster", "Instance", "Supervisor", "Task", "build"]

HOST = "127.0.0.1"
NETNS_PORT = 2222
MAX_RESTARTS = 6
RESTART_DELAY_S = 0.2
PROBE = Path(__file__).with_name("probe.py")
SCALER = Path(__file__).with_name("scaler.py")
#: The repository: every task runs there, so ``python -m zmqps`` is this checkout's
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Instance:
    """One process of a task."""

    pid: int
    popen: subprocess.Popen[bytes]
    started: float
    ended: float | None = None
    rc: int | None = None
    #: killed by the harness (a fault), so its exit code is no failure
    killed: bool = False


@dataclass
class Task:
    name: str
    argv: list[str]
    host: str | None = None  # network namespace host (None: loopback)
    instances: list[Instance] = field(default_factory=list)
    restart_at: float | None = None
    #: SIGSTOPped by the harness right now
    stopped: bool = False
    #: why it was not restarted after a failure
    given_up: str = ""

    @property
    def current(self) -> Instance | None:
        return self.instances[-1] if self.instances else None

    @property
    def running(self) -> bool:
        cur = self.current
        return cur is not None and cur.rc is None

    @property
    def role(self) -> str:
        return self.name.rstrip("0123456789")

    @property
    def index(self) -> int:
        digits = self.name[len(self.role) :]
        return int(digits) if digits else 0


@dataclass
class Cluster:
    """Addresses and command lines of a schedule's tasks."""

    spec: dict[str, list[str]]
    tasks: list[Task]
    run_dir: Path
    summary: Path
    checkpoints: Path
    export: Path
    eval_log: Path
    probe_out: Path

    @property
    def chief(self) -> str:
        return self.spec["chief"][0]

    def task(self, name: str) -> Task:
        return next(t for t in self.tasks if t.name == name)

    def stats(self, index: int) -> Path:
        return self.run_dir / f"worker{index}-stats.json"


def _free_ports(n: int) -> list[int]:
    from zmqps.cli.launch import free_ports

    return free_ports(n, HOST)


def hosts_of(s: Schedule) -> list[str]:
    """The namespace hosts of a schedule's tasks (one per task)."""
    names = ["chief", *(f"ps{i}" for i in range(s.ps)), *(f"worker{i}" for i in range(s.workers))]
    return [*names, "evaluator"] if s.evaluator else names


def build(s: Schedule, run_dir: Path, ips: dict[str, str] | None = None) -> Cluster:
    """The cluster of ``s`` with its folders in ``run_dir``; ``ips``: each host's address
    in the namespaces (None: loopback with free ports)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    n = 1 + s.ps + s.workers
    if ips is None:
        addrs = [f"{HOST}:{p}" for p in _free_ports(n)]
    else:
        addrs = [f"{ips[h]}:{NETNS_PORT}" for h in hosts_of(s)[:n]]
    spec = {
        "chief": addrs[:1],
        "ps": addrs[1 : 1 + s.ps],
        "worker": addrs[1 + s.ps :],
    }
    cluster_json = json.dumps({"cluster": spec})
    base = [sys.executable, "-m", "zmqps"]
    common = ["--cluster", cluster_json, "--parent-pid", str(os.getpid())]
    job = [*s.job(), "--log-every", "10000"]
    ckpt_dir = run_dir / "checkpoints"
    ckpt = ["--checkpoint-dir", str(ckpt_dir)]
    driver: list[str] = []
    serve: list[str] = []
    if s.driver == "coordinator":
        driver = ["--driver", "coordinator", "--job", "zmqps.coordinator.digits"]
        driver += ["--steps-per-execution", str(s.steps_per_execution)]
        serve = ["--serve", "--job", "zmqps.coordinator.digits"]
    summary = run_dir / "chief-summary.json"
    export = run_dir / "model"
    chief = [
        *base,
        "server",
        "--role",
        "chief",
        *common,
        *job,
        "--heartbeat-timeout",
        str(s.heartbeat_timeout),
        *ckpt,
        "--checkpoint-steps",
        str(s.checkpoint_steps),
        "--keep-checkpoints",
        "10000",
        "--export-dir",
        str(export),
        "--summary",
        str(summary),
        *driver,
        *(["--replication", str(s.replication)] if s.replication > 1 else []),
    ]
    tasks = [Task("chief", chief)]
    for i in range(s.ps):
        argv = [*base, "server", "--role", "ps", "--index", str(i), *common, *ckpt]
        tasks.append(Task(f"ps{i}", argv))
    for i in range(s.workers):
        argv = [*base, "worker", "--index", str(i), *common, *job, *serve]
        argv += ["--stats", str(run_dir / f"worker{i}-stats.json")]
        tasks.append(Task(f"worker{i}", argv))
    eval_log = run_dir / "evaluator.jsonl"
    if s.evaluator:
        argv = [*base, "worker", "--role", "evaluator", *common, *job]
        if s.evaluator == "checkpoint":
            argv += ckpt
        argv += ["--eval-log", str(eval_log), "--eval-interval", "0.5"]
        tasks.append(Task("evaluator", argv))
    if ips is not None:
        for t in tasks:
            t.host = t.name
    return Cluster(
        spec=spec,
        tasks=tasks,
        run_dir=run_dir,
        summary=summary,
        checkpoints=ckpt_dir,
        export=export,
        eval_log=eval_log,
        probe_out=run_dir / "probe.jsonl",
    )


def probe_argv(cluster: Cluster) -> list[str]:
    return [
        sys.executable,
        str(PROBE),
        "--chief",
        cluster.chief,
        "--out",
        str(cluster.probe_out),
        "--parent-pid",
        str(os.getpid()),
    ]


def scaler_argv(cluster: Cluster, n: int, out: Path, *extra: str) -> list[str]:
    """tests/faults/scaler.py asking the chief for ``n`` PS (``extra``: a victim, pids)."""
    return [
        sys.executable,
        str(SCALER),
        "--chief",
        cluster.chief,
        "--ps",
        str(n),
        "--out",
        str(out),
        "--parent-pid",
        str(os.getpid()),
        *extra,
    ]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "ZMQPS_KEYS")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class ShmSandbox:
    """A /dev/shm of the run's own for a loopback cluster: a holder process in a private
    mount namespace with a fresh tmpfs on /dev/shm, which every task enters (``nsenter``
    execs, so each task keeps its pid). The tasks share it, so the same-host fast path
    works as usual, and what is left in it afterwards is the run's alone, however many
    other clusters run on the machine. Needs root, util-linux' unshare and nsenter."""

    def __init__(self) -> None:
        script = (
            "mount -t tmpfs -o size=512m,mode=1777 zmqps-faults /dev/shm"
            " && echo ready && exec sleep 100000"
        )
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert self.holder.stdout is not None
        if self.holder.stdout.readline().strip() != b"ready":
            self.close()
            raise OSError("could not mount a private /dev/shm")

    @staticmethod
    def unavailable() -> str | None:
        """Why a private /dev/shm cannot be made here (None: it can)."""
        import shutil

        if os.geteuid() != 0:
            return "not root"
        for tool in ("unshare", "nsenter"):
            if shutil.which(tool) is None:
                return f"no {tool}"
        return None

    def wrap(self, argv: Sequence[str]) -> list[str]:
        return ["nsenter", f"--mount=/proc/{self.holder.pid}/ns/mnt", "--", *argv]

    def regions(self) -> list[str]:
        """zmqps' regions left in it (transport/shm.py names them zmqps-<hex>)."""
        try:
            names = os.listdir(f"/proc/{self.holder.pid}/root/dev/shm")
        except OSError:
            return []
        return sorted(n for n in names if n.startswith("zmqps-"))

    def close(self) -> None:
        if self.holder.poll() is None:
            self.holder.kill()
        self.holder.wait(10)
        for f in (self.holder.stdout, self.holder.stderr):
            if f is not None:
                f.close()


class Supervisor:
    """Starts the tasks, restarts those that die, stops and reaps them."""

    def __init__(self, cluster: Cluster, wrap: Any = None) -> None:
        self.cluster = cluster
        #: ``wrap(host, argv) -> argv``: run a task inside its namespace(s) (None: as is)
        self.wrap = wrap
        self.stopping = False
        self.events: list[dict[str, Any]] = []  # restarts, give-ups (for the report)
        self.extra: list[subprocess.Popen[bytes]] = []  # the probe

    # -- processes -----------------------------------------------------------------

    def _spawn(self, argv: Sequence[str], host: str | None, log: Path) -> subprocess.Popen[bytes]:
        full = list(argv) if self.wrap is None else self.wrap(host, argv)
        with log.open("ab") as out:
            return subprocess.Popen(
                full,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=_env(),
                cwd=ROOT,
                start_new_session=True,
            )

    def start(self, task: Task) -> None:
        log = self.cluster.run_dir / f"{task.name}.log"
        with log.open("a") as f:
            f.write(f"### faults: start {len(task.instances) + 1} of {task.name}\n")
        popen = self._spawn(task.argv, task.host, log)
        task.instances.append(Instance(popen.pid, popen, time.monotonic()))
        task.restart_at = None

    def start_all(self) -> None:
        for t in self.cluster.tasks:
            self.start(t)

    def start_again(self, name: str) -> bool:
        """Start task ``name`` again if its last process exited 0 (a PS the chief
        drained); False when it runs, or failed, or the cluster is stopping."""
        task = self.cluster.task(name)
        cur = task.current
        if self.stopping or cur is None or cur.rc != 0 or task.restart_at is not None:
            return False
        self.start(task)
        self.events.append({"t": time.monotonic(), "task": name, "what": "started again"})
        return True

    def helper(self, argv: list[str], host: str | None, log: Path) -> subprocess.Popen[bytes]:
        """A helper process of the harness (tests/faults/scaler.py) in ``host``'s
        namespace; reaped with the probe."""
        popen = self._spawn(argv, host, log)
        self.extra.append(popen)
        return popen

    def mark_killed(self, pid: int) -> str | None:
        """The process ``pid`` was killed -9 by a helper of the harness: it counts as a
        fault, not a failure. Returns its task's name (None: no such process)."""
        for t in self.cluster.tasks:
            for inst in t.instances:
                if inst.pid == pid:
                    inst.killed = True
                    t.stopped = False
                    return t.name
        return None

    def start_probe(self, host: str | None) -> None:
        argv = probe_argv(self.cluster)
        self.extra.append(self._spawn(argv, host, self.cluster.run_dir / "probe.log"))

    def signal(self, name: str, sig: int) -> bool:
        """Send ``sig`` to task ``name``'s process; False when it is not running."""
        task = self.cluster.task(name)
        cur = task.current
        if cur is None or cur.rc is not None or cur.popen.poll() is not None:
            return False
        try:
            os.kill(cur.pid, sig)
        except ProcessLookupError:
            return False
        if sig in (signal.SIGKILL, signal.SIGTERM):  # a fault (the run's own end: stop())
            cur.killed = True
        if sig == signal.SIGKILL:
            task.stopped = False
        elif sig == signal.SIGSTOP:
            task.stopped = True
        elif sig == signal.SIGCONT:
            task.stopped = False
        return True

    # -- supervision -----------------------------------------------------------------

    def chief_done(self) -> bool:
        cur = self.cluster.task("chief").current
        return cur is not None and cur.rc == 0

    def tick(self, now: float) -> None:
        """Notice exits, restart what must be (call often)."""
        for t in self.cluster.tasks:
            cur = t.current
            if cur is None:
                continue
            if cur.rc is None:
                rc = cur.popen.poll()
                if rc is None:
                    continue
                cur.rc, cur.ended = rc, now
                self._exited(t, cur, now)
            if t.restart_at is not None and now >= t.restart_at:
                if self.stopping:
                    t.restart_at = None
                else:
                    self.start(t)

    def _exited(self, t: Task, cur: Instance, now: float) -> None:
        if cur.rc is None or cur.rc == 0 or self.stopping:
            return
        how = f"killed by signal {-cur.rc}" if cur.rc < 0 else f"exited with code {cur.rc}"
        if t.name != "chief" and self.chief_done():
            self.events.append({"t": now, "task": t.name, "what": f"{how} after the end"})
            return
        if cur.rc in (EXIT_CONFIG, EXIT_RUN_FAILED):
            # as zmqps launch: a task that failed on its configuration, or a run that
            # ended failed (finished work lost), fails again; it is not restarted
            # (seed 220: a chief restarted after exit 3 waited 120 s for the PS it had
            # shut down)
            t.given_up = f"{how}: not restarted (it would fail again)"
            self.events.append({"t": now, "task": t.name, "what": t.given_up})
            self.stop()  # (zmqps launch stops the cluster too)
            return
        if len(t.instances) - 1 >= MAX_RESTARTS:
            t.given_up = f"{how}; {MAX_RESTARTS} restarts already"
            self.events.append({"t": now, "task": t.name, "what": f"given up: {t.given_up}"})
            self.stop()
            return
        t.restart_at = now + RESTART_DELAY_S
        self.events.append({"t": now, "task": t.name, "what": f"{how}; restarting"})

    def all_done(self) -> bool:
        return all(not t.running and t.restart_at is None for t in self.cluster.tasks)

    def failed(self) -> str:
        return "; ".join(f"{t.name}: {t.given_up}" for t in self.cluster.tasks if t.given_up)

    # -- the end ---------------------------------------------------------------------

    def stop(self, grace: float = 10.0) -> None:
        """SIGCONT + SIGTERM every running task, SIGKILL after ``grace`` seconds."""
        self.stopping = True
        running = [t for t in self.cluster.tasks if t.running]
        for t in running:
            assert t.current is not None
            for sig in (signal.SIGCONT, signal.SIGTERM):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(t.current.pid, sig)
        deadline = time.monotonic() + grace
        for t in running:
            assert t.current is not None
            try:
                t.current.popen.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(t.current.pid, signal.SIGKILL)
        self.reap()

    def reap(self) -> None:
        """Wait for (SIGKILL first if needed) every process started: no zombie is left."""
        now = time.monotonic()
        for t in self.cluster.tasks:
            for inst in t.instances:
                if inst.popen.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(inst.pid, signal.SIGCONT)
                        os.kill(inst.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    inst.popen.wait(10)
                if inst.rc is None:
                    inst.rc, inst.ended = inst.popen.returncode, now
        for p in self.extra:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        self.extra.clear()
