"""``zmqps launch``: a whole cluster as local processes on loopback.

Rules of this module:

* Ports are picked free on 127.0.0.1 and written into one cluster spec that every
  child gets; nothing binds any other address.
* Children run in their own sessions and watch this process: if the launcher dies,
  they stop. Ctrl-C, a timeout or any child failing stops every child (SIGTERM,
  then SIGKILL after a grace period); the exit code is non-zero when anything failed.
* ``--secure``: fresh CURVE keys in ``RUN_DIR/keys`` and every child (and the
  progress bar's status requests) on CURVE; a ``ZMQPS_KEYS`` of the environment is
  not passed on (the run is plaintext or uses its own keys).
* Child output is relayed line by line, prefixed with its task, and kept in
  ``RUN_DIR/<task>.log``; the progress bar reads the chief's status. Nothing here
  blocks on output: the launcher's stderr goes through :class:`Console` (lines
  dropped and counted when it takes none), and the tasks write to their pipe without
  blocking (``--nonblocking-output``), so a terminal or launcher that is stopped
  never stops training.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from zmqps.checkpoint.root import Checkpoint, CheckpointRoot
from zmqps.cli.args import (
    add_device_args,
    add_elastic_arg,
    add_job_args,
    add_nonfinite_args,
    add_replication_arg,
    add_stall_timeout_arg,
    add_sync_args,
    add_wire_dtype_arg,
    check_heartbeat_timeout,
    check_output_dir,
    check_output_file,
    checkpoint_policy_from_args,
    job_from_args,
    on_nonfinite_from_args,
    partitioner_from_args,
    positive_seconds,
    seconds,
    sync_from_args,
    wire_dtype_from_args,
    worker_devices,
)
from zmqps.cli.console import Console
from zmqps.cli.coordinator import add_driver_args, check_launch
from zmqps.cli.entry import exiting
from zmqps.cli.tasks import DEFAULT_JOB, STOP_SIGNALS
from zmqps.config import ClusterSpec
from zmqps.core.finished import RECORD_NAME
from zmqps.device import Device, DeviceError, cuda_device_count
from zmqps.process import blas_threads, thread_env, usable_cores, write_text_whole
from zmqps.roles.configs import (
    ChiefConfig,
    DriverConfig,
    EvaluatorConfig,
    PSConfig,
    TaskConfig,
    WorkerConfig,
    dumps,
)
from zmqps.roles.job import JobConfig
from zmqps.roles.status import fetch_status
from zmqps.transport import free_ports  # re-exported: it moved to zmqps.transport.ports
from zmqps.transport.base import waited, within
from zmqps.transport.shm import sweep
from zmqps.wire.errors import EXIT_CONFIG, EXIT_RUN_FAILED, ConfigError, ZmqpsError

#: the exit codes of a task that stopped on a signal it handled (SIGHUP, SIGINT, SIGTERM)
SIGNALLED_STOP = (128 + signal.SIGHUP, 128 + signal.SIGINT, 128 + signal.SIGTERM)

__all__ = ["add_launch_args", "free_ports", "launch"]

HOST = "127.0.0.1"
GRACE_S = 10.0
#: seconds the other tasks have to end once the chief ended well (it shut them down)
LINGER_S = 20.0
#: checkpoint every this many seconds when neither --checkpoint-steps nor
#: --checkpoint-secs is given (zmqps-server: every 600 s)
CHECKPOINT_SECS = 5.0
#: what --checkpoint-steps / --checkpoint-secs need (said when they are refused)
NEEDS_CHECKPOINTS = "checkpoints (they were turned off by --no-checkpoints)"
#: a task counted dead (or a chief silent) this many heartbeat timeouts, at least
#: HUNG_MIN_S seconds, while its process runs is killed as stopped or hung (unless
#: --hung-after says how long)
HUNG_HEARTBEATS = 3
HUNG_MIN_S = 15.0
#: a task's process started (again) this long ago at least before it can count as hung
START_GRACE_S = 15.0
#: the shortest --hung-after: a few of the launcher's status requests (0.5 s apart);
#: 0.5 s killed a healthy chief in the middle of a run, between two of its answers
MIN_HUNG_AFTER_S = 2.0
#: seconds between two looks of the liveness watch
LIVENESS_TICK_S = 1.0
#: a look this much later than due: the launcher itself was stopped or starved, and
#: what it measured as silence is its own
LAUNCHER_STALL_S = 4.0
#: the launcher's status requests to the chief (progress, and watching for hung tasks)
STATUS_TIMEOUT_S = 5.0
#: a task's log line: time, level letter (D, I, W, E), logger
_LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d ([DIWE]) ")
#: a task's line longer than this is kept whole in its log file, cut on the terminal
RELAY_LINE_CHARS = 4096
#: a task's output without a newline is passed on in parts of this many bytes
RELAY_PART_BYTES = 1 << 20


async def _lines(stream: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The lines of ``stream``, however long: one without a newline in
    :data:`RELAY_PART_BYTES` comes in parts (the task never blocks on a full pipe
    because a line was longer than the reader's buffer)."""
    pending = b""
    while True:
        chunk = await stream.read(1 << 16)
        if not chunk:
            if pending:
                yield pending
            return
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line
        while len(pending) >= RELAY_PART_BYTES:
            yield pending[:RELAY_PART_BYTES]
            pending = pending[RELAY_PART_BYTES:]


@contextlib.contextmanager
def _logging_to(console: Console) -> Iterator[None]:
    """This process's log lines (the root logger's handlers on stderr) through
    ``console`` for the while: a log line never blocks the launcher either."""
    import logging

    moved = []
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.StreamHandler) and h.stream is console.stream:
            moved.append(h)
            h.setStream(console)
    try:
        yield
    finally:
        for h in moved:
            h.setStream(console.stream)


def add_launch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--ps", type=int, default=2, help="number of PS tasks (default: 2)")
    g.add_argument("--workers", type=int, default=2, help="number of workers (default: 2)")
    g.add_argument(
        "--ps-schedule",
        metavar="STEP:N[,STEP:N...]",
        help="change the number of PS serving the model at these global steps (the PS"
        " states move while training goes on; N at most --ps, the PS started)",
    )
    g.add_argument(
        "--placement",
        choices=("round_robin", "greedy"),
        default="round_robin",
        help="shard placement on the PS tasks: round_robin (shard i on PS i mod N) or greedy"
        " (largest shard first onto the least-loaded PS) (default: round_robin)",
    )
    g.add_argument("--num-shards", type=int, help="fixed number of shards per variable")
    add_replication_arg(g)
    add_wire_dtype_arg(g)
    add_stall_timeout_arg(g)
    add_elastic_arg(g)
    g.add_argument(
        "--heartbeat-timeout",
        type=seconds,
        default=10.0,
        metavar="S",
        help="seconds without a heartbeat before the chief counts a worker as dead (default: 10)",
    )
    g.add_argument(
        "--no-shm",
        dest="shared_memory",
        action="store_false",
        help="workers talk to the PS over TCP only (no same-host shared memory)",
    )
    g.add_argument(
        "--secure",
        action="store_true",
        help="CurveZMQ on every socket: keys made in RUN_DIR/keys, every task gets --keys"
        " (tensors on the same-host shared-memory path stay in 0600 memory of this user;"
        " add --no-shm to send them through CURVE too)",
    )
    add_job_args(p)
    add_sync_args(p)
    add_device_args(p, launch=True)
    add_nonfinite_args(p)
    add_driver_args(p)
    g = p.add_argument_group("launcher")
    g.add_argument(
        "--run-dir", help="folder for logs and results (default: a new temporary folder)"
    )
    g.add_argument("--summary", metavar="FILE", help="write the run's summary as JSON here")
    g.add_argument(
        "--logdir",
        metavar="DIR",
        help="TensorBoard: each task writes its scalars into DIR/<task> (chief, worker0,"
        " ..., evaluator); watch with: tensorboard --logdir DIR",
    )
    g.add_argument(
        "--timeout",
        type=positive_seconds,
        default=None,
        metavar="S",
        help="stop everything after S > 0 seconds, the run failed (default: none)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--prometheus-targets",
        metavar="FILE",
        help="write the tasks' /metrics endpoints as Prometheus file_sd JSON (labels job:"
        " chief, ps, worker, evaluator), for docker/prometheus/prometheus-local.yml and zmqps top",
    )
    g.add_argument(
        "--no-metrics",
        dest="metrics",
        action="store_false",
        help="no Prometheus endpoints (default: each task serves /metrics on a free"
        f" {HOST} port, printed at start with -v and in --prometheus-targets)",
    )
    g.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="print only warnings, errors and the summary (by default also one line at the"
        " start and a progress bar; -v: every task's log lines and metrics URLs; every"
        " line is in RUN_DIR/TASK.log whatever is printed)",
    )
    g = p.add_argument_group("checkpoints and faults")
    g.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="checkpoint root (default: RUN_DIR/checkpoints); one that holds checkpoints"
        " is refused unless --resume is given",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="go on from the latest checkpoint in RUN_DIR (or --checkpoint-dir), appending"
        " to the logs: an interrupted run finishes its work, a finished one trains --epochs"
        " more epochs; without --resume a run that would start on an earlier run's"
        " checkpoints or files is refused",
    )
    g.add_argument(
        "--checkpoint-steps",
        type=int,
        default=None,
        metavar="N",
        help="checkpoint every N >= 1 global steps (default: by time, see --checkpoint-secs;"
        " no checkpoints: --no-checkpoints)",
    )
    g.add_argument(
        "--checkpoint-secs",
        type=seconds,
        default=None,
        metavar="S",
        help=f"checkpoint every S > 0 seconds (default: {CHECKPOINT_SECS:g} unless"
        " --checkpoint-steps is given)",
    )
    g.add_argument(
        "--keep-checkpoints",
        type=int,
        default=3,
        metavar="K",
        help="keep the last K >= 1 checkpoints, delete older ones (default: 3)",
    )
    g.add_argument(
        "--no-checkpoints",
        dest="checkpoints",
        action="store_false",
        help="no checkpoints (a lost PS then restarts from the initial values)",
    )
    g.add_argument(
        "--export-dir",
        metavar="DIR",
        help="export the final model here (default: RUN_DIR/model when --run-dir is given)",
    )
    g.add_argument(
        "--restart",
        choices=("on-failure", "never"),
        default="on-failure",
        help="restart a task that dies (like a Kubernetes restart policy; default: on-failure)",
    )
    g.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="N",
        help="restarts per task before the launch gives up (default: 3)",
    )
    g.add_argument(
        "--hung-after",
        type=seconds,
        default=None,
        metavar="S",
        help="kill a task whose process runs while the chief counts it dead (a PS: down)"
        " for S seconds, or a chief that answers no status for S seconds, so that"
        " --restart starts it again, at least 2 (default: 3 heartbeat timeouts, at least"
        " 15; a task, the chief too, has 15 s of start-up first)",
    )
    g.add_argument(
        "--evaluator",
        action="store_true",
        help="also run a side-car evaluator on each new checkpoint (zmqps-worker --role"
        " evaluator); its evaluations go to RUN_DIR/evaluator.jsonl",
    )


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: asyncio.subprocess.Process | None = None
    returncode: int | None = None
    log: IO[str] | None = None
    tail: list[str] = field(default_factory=list)
    restarts: int = 0
    #: added to the launcher's environment for this task (its BLAS threads)
    env: dict[str, str] = field(default_factory=dict)
    #: when its process (the latest one) started (time.monotonic())
    started_at: float = 0.0
    #: since when the chief has counted it dead or down while its process runs (None: not)
    dead_since: float | None = None


class Launcher:
    def __init__(self, args: argparse.Namespace, run_dir: Path) -> None:
        self.args = args
        self.run_dir = run_dir
        n = 1 + args.ps + args.workers
        # the evaluator serves nothing, but is a task of the cluster the chief knows: at
        # the end it waits for one still starting to score the final model (a short run
        # ended before its process was up, and it scored nothing)
        tasks = n + (1 if args.evaluator else 0)
        ports = free_ports(2 * tasks if getattr(args, "metrics", True) else tasks)
        #: Task name -> its metrics port (empty with --no-metrics).
        self.metrics_ports = dict(
            zip(
                [
                    "chief",
                    *(f"ps{i}" for i in range(args.ps)),
                    *(f"worker{i}" for i in range(args.workers)),
                    *(["evaluator"] if args.evaluator else []),
                ],
                ports[tasks:],
                strict=False,
            )
        )
        self.cluster = ClusterSpec(
            chief=f"{HOST}:{ports[0]}",
            ps=tuple(f"{HOST}:{p}" for p in ports[1 : 1 + args.ps]),
            worker=tuple(f"{HOST}:{p}" for p in ports[1 + args.ps : n]),
            evaluator=tuple(f"{HOST}:{p}" for p in ports[n:tasks]),
        )
        self.chief_summary = run_dir / CHIEF_SUMMARY
        folder = checkpoint_folder(args, run_dir)
        self.checkpoint_dir: Path | None = None if folder is None else folder.resolve()
        self.export_dir: Path | None = None
        if args.export_dir or args.run_dir:
            self.export_dir = Path(args.export_dir or run_dir / "model").resolve()
        self.restarts: list[dict[str, Any]] = []
        self.keys_dir: Path | None = None
        self.status_options: Any = None
        if getattr(args, "secure", False):
            from zmqps.transport import SocketOptions, keygen, load_keys

            self.keys_dir = (run_dir / "keys").resolve()
            keygen(self.keys_dir, force=True)
            self.status_options = SocketOptions(
                curve=load_keys(self.keys_dir, "status", None, serve=False, connect=True)
            )
        self.children = self._children()
        self.bar: tqdm[Any] | None = None
        #: the chief's latest status (``_progress`` reads it) and when it came
        #: (time.monotonic(); 0: never): what ``_liveness`` judges by
        self.status: dict[str, Any] | None = None
        self.status_at = 0.0
        #: watchers of PS started again by --ps-schedule
        self._rewatch: list[asyncio.Future[None]] = []
        #: the PS counts --ps-schedule asked for: {"step", "ps", "at_step"}
        self.scaled: list[dict[str, Any]] = []
        self.stopping = False
        self.failure = ""
        self.first_failed: Child | None = None
        self.env: dict[str, str] = {}
        #: the launcher's stderr while the tasks run: written by a thread of its own
        self.console: Console | None = None
        #: descriptors of the folders this launch holds (:func:`hold_folders`): every
        #: task inherits them, so they stay held until the last task has exited
        self.held_fds: tuple[int, ...] = ()

    def worker_stats(self, index: int) -> Path:
        """Where worker ``index`` writes its step statistics."""
        return self.run_dir / f"worker{index}-stats.json"

    def _children(self) -> list[Child]:
        """Every task's configuration, built and checked here, written as data for the
        child (``zmqps task --config FILE``): nothing is rebuilt from flags."""
        tasks_dir = self.run_dir / "tasks"
        made = not tasks_dir.exists()
        keys = None if self.keys_dir is None else str(self.keys_dir)
        kids = []
        threads = self.threads()
        for name, task in self.task_configs(keys):
            path = tasks_dir / f"{name}.json"
            try:
                tasks_dir.mkdir(parents=True, exist_ok=True)
                path.write_text(dumps(task) + "\n")
            except OSError as exc:  # a full disk, a read-only one: said with the path
                if made:  # (left, it would make the folder look like an earlier run's)
                    shutil.rmtree(tasks_dir, ignore_errors=True)
                raise ZmqpsError(f"cannot write {path}: {exc.strerror}") from None
            argv = [sys.executable, "-m", "zmqps", "task", "--config", str(path)]
            computes = task.worker is not None and not Device.parse(self.args.device).is_cuda
            env = thread_env(threads if computes else 1, os.environ)
            argv += ["--parent-pid", str(os.getpid()), "--nonblocking-output"]
            kids.append(Child(name, argv, env=env))
        return kids

    def threads(self) -> int:
        """BLAS threads of each worker computing on the host: the machine's cores
        shared among them once every other task has one (each BLAS taking every core
        oversubscribes the machine); the others get one. ``OMP_NUM_THREADS`` (or
        ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``) set by the user wins."""
        a = self.args
        host = not Device.parse(a.device).is_cuda
        compute = a.workers if host else 0
        others = 1 + a.ps + (0 if host else a.workers) + (1 if a.evaluator else 0)
        return blas_threads(usable_cores(), compute, others)

    def task_configs(self, keys: str | None) -> list[tuple[str, TaskConfig]]:
        a = self.args
        cluster = self.cluster
        job = job_from_args(a)
        assert job is not None
        ports = self.metrics_ports

        def metrics(name: str) -> dict[str, Any]:
            return {"metrics_host": HOST, "metrics_port": ports.get(name)}

        logdir = None if a.logdir is None else str(Path(a.logdir).resolve())

        ckpt_dir = None if self.checkpoint_dir is None else str(self.checkpoint_dir)
        policy = checkpoint_policy_from_args(
            a, ckpt_dir, default_secs=CHECKPOINT_SECS, needs=NEEDS_CHECKPOINTS
        )
        driver = None
        serve_job = None
        if getattr(a, "driver", "worker") == "coordinator":
            driver = DriverConfig(a.job or DEFAULT_JOB, a.steps_per_execution)
            serve_job = driver.job_module
        assert cluster.chief is not None
        chief = ChiefConfig(
            bind=cluster.chief,
            cluster=cluster,
            job=job,
            optimizer=dict(job.optimizer),
            partitioner=partitioner_from_args(a),
            placement=a.placement,
            replication=a.replication,
            wire_dtype=wire_dtype_from_args(a),
            heartbeat_timeout=a.heartbeat_timeout,
            summary_path=str(self.chief_summary),
            sync=sync_from_args(a),
            checkpoint=policy,
            export_dir=None if self.export_dir is None else str(self.export_dir),
            driver=driver,
            max_nonfinite_share=a.max_nonfinite_share,
            logdir=logdir,
            stall_timeout=a.stall_timeout,
            add_ps_above=a.add_ps_above,
            **metrics("chief"),
        )
        out: list[tuple[str, TaskConfig]] = [("chief", TaskConfig(chief=chief, keys=keys))]
        for i, addr in enumerate(cluster.ps):
            ps = PSConfig(index=i, bind=addr, checkpoint_dir=ckpt_dir, **metrics(f"ps{i}"))
            out.append((f"ps{i}", TaskConfig(ps=ps, keys=keys)))
        visible = cuda_device_count() if Device.parse(a.device).is_cuda else 0
        for i in range(cluster.num_workers):
            worker = WorkerConfig(
                cluster=cluster,
                index=i,
                job=job,
                device=worker_devices(a.device, a.gpus_per_worker, i, visible),
                prefetch=a.prefetch,
                shared_memory=a.shared_memory,
                stats_path=str(self.worker_stats(i)),
                serve_job=serve_job,
                on_nonfinite=on_nonfinite_from_args(a),
                logdir=logdir,
                **metrics(f"worker{i}"),
            )
            out.append((f"worker{i}", TaskConfig(worker=worker, keys=keys)))
        if a.evaluator:
            evaluator = EvaluatorConfig(
                chief=cluster.chief,
                job=job,
                checkpoint_dir=ckpt_dir,
                eval_log=str(self.run_dir / "evaluator.jsonl"),
                logdir=logdir,
                **metrics("evaluator"),
            )
            out.append(("evaluator", TaskConfig(evaluator=evaluator, keys=keys)))
        return out

    def file_sd(self) -> list[dict[str, Any]]:
        """The metrics endpoints as Prometheus file_sd target groups, labelled by job."""
        groups: dict[str, list[str]] = {}
        for name, port in self.metrics_ports.items():
            job = name.rstrip("0123456789")
            groups.setdefault(job, []).append(f"{HOST}:{port}")
        return [{"targets": t, "labels": {"job": job}} for job, t in groups.items()]

    def metrics_urls(self) -> list[str]:
        """One line per task: its name and /metrics URL."""
        return [f"{name} http://{HOST}:{port}/metrics" for name, port in self.metrics_ports.items()]

    def say(self, line: str) -> None:
        """A line on the launcher's stderr, never blocking (see :class:`Console`)."""
        out: Any = self.console if self.console is not None else sys.stderr
        if self.bar is not None:
            self.bar.write(line, file=out)
        else:
            print(line, file=out, flush=True)

    async def _relay(self, child: Child) -> None:
        """Every line of the child into its log file; to the terminal its warnings,
        errors and tracebacks (everything with -v)."""
        assert child.proc is not None and child.proc.stdout is not None
        verbose = bool(getattr(self.args, "verbose", 0))
        in_traceback = False
        async for raw in _lines(child.proc.stdout):
            line = raw.decode(errors="replace").rstrip()
            if child.log is not None:
                self._keep(child, line)
            if len(line) > RELAY_LINE_CHARS:  # all of it in the log; a part elsewhere
                line = f"{line[:RELAY_LINE_CHARS]}... ({len(line)} characters in all)"
            child.tail = [*child.tail[-19:], line]
            level = _LOG_LINE.match(line)
            if line.startswith("Traceback"):
                in_traceback = True
            elif level is not None:
                in_traceback = False
            notable = in_traceback or line.startswith("zmqps: ")
            if verbose or notable or (level is not None and level.group(1) in "WE"):
                self.say(f"[{child.name}] {line}")

    def _keep(self, child: Child, line: str) -> None:
        """``line`` into the child's log file. One that cannot be written (a full disk)
        is given up, said once: its output is still read (a task whose output nobody
        reads stands), its warnings still shown (the launcher died of the error, its
        tasks left running)."""
        assert child.log is not None
        try:
            child.log.write(line + "\n")
        except OSError as exc:
            lost, child.log = child.log, None
            with contextlib.suppress(OSError):
                lost.close()
            self.say(
                f"zmqps launch: cannot write {child.name}.log ({exc.strerror or exc}): its"
                " output is no longer kept; its warnings and errors still come here"
            )

    async def _start(self, child: Child) -> None:
        child.returncode = None
        child.started_at, child.dead_since = time.monotonic(), None
        child.proc = await asyncio.create_subprocess_exec(
            *child.argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            env={**self.env, **child.env},
            start_new_session=True,
            pass_fds=self.held_fds,
        )

    async def _watch(self, child: Child) -> None:
        """Supervise one task: restart it when it dies (``--restart on-failure``, at most
        ``--max-restarts`` times), else stop the whole cluster."""
        while True:
            assert child.proc is not None
            relay = asyncio.ensure_future(self._relay(child))
            child.returncode = await child.proc.wait()
            try:
                await relay
            except Exception as exc:  # the task's exit is what counts
                self.say(f"zmqps launch: reading {child.name}'s output failed: {exc!r}")
            if child.returncode == 0 or self.stopping:
                return
            chief = self.children[0]
            if child is not chief and chief.returncode == 0:
                self.say(f"zmqps launch: {child.name} exited with {child.returncode} after the end")
                return  # training is over: nothing to restart it for
            how = (
                f"killed by signal {-child.returncode}"
                if child.returncode < 0
                else f"exited with code {child.returncode}"
            )
            final = child.returncode in (EXIT_CONFIG, EXIT_RUN_FAILED)  # fails again
            if child is chief and child.returncode in SIGNALLED_STOP:
                # a chief told to stop (SIGTERM, SIGINT, SIGHUP to it alone) took its
                # checkpoint and shut the PS down before it exited: started again, it
                # waited minutes for PS that were gone. The run ends, resumable.
                final = True
                how += " (it was told to stop: checkpoint taken, PS shut down; go on with --resume)"
            elif child is chief and not final and child.returncode > 0:
                if self.first_failed is None:
                    self.first_failed = child  # the run's failure is the chief's
                if await self._ps_shut_down():
                    # the chief shut its PS down before it failed (its summary could not
                    # be written, say): a chief started again would wait for them
                    final = True
                    how += " after it shut the PS down"
                elif self.first_failed is child:
                    self.first_failed = None  # started again
            if (
                self.args.restart == "on-failure"
                and child.restarts < self.args.max_restarts
                and not final
            ):
                child.restarts += 1
                self.restarts.append({"task": child.name, "why": how, "at": time.time()})
                self.say(
                    f"zmqps launch: {child.name} {how}; restarting it"
                    f" ({child.restarts}/{self.args.max_restarts})"
                )
                await asyncio.sleep(0.2)
                if self.stopping:
                    return
                await self._start(child)
                continue
            if self.first_failed is None or self.first_failed is child:
                self.first_failed = child  # (a chief's failure, noted before its PS wait)
            self.failure = self.failure or f"{child.name} {how}"
            self.say(f"zmqps launch: {self.failure}; stopping the cluster")
            await self.stop()
            return

    async def _ps_shut_down(self, wait: float = 3.0) -> bool:
        """Whether every PS of the run exited 0 (the chief shut them down), waited for up
        to ``wait`` seconds (a PS acknowledges its shutdown before it exits, and the chief
        may exit first). Asked when the chief exited on its own (a positive code): one
        killed by a signal is started again at once."""
        ps = [c for c in self.children if c.name.startswith("ps") and c.proc is not None]
        deadline = time.monotonic() + wait
        while any(c.returncode is None for c in ps) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return bool(ps) and all(c.returncode == 0 for c in ps)

    async def stop(self) -> None:
        self.stopping = True
        for c in self.children:
            if c.proc is not None and c.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for c in self.children:
            if c.proc is None:
                continue
            try:
                await within(c.proc.wait(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.kill()
                await c.proc.wait()

    async def _after_the_chief(self, watchers: asyncio.Future[Any]) -> None:
        """Once the chief ended, every other task ends within ``LINGER_S`` (the chief
        shut them down) or is stopped: a task that does not leave never holds the
        launcher (it is said, and the run's outcome stays the chief's)."""
        chief = self.children[0]
        while chief.returncode != 0:  # a chief that failed stops the cluster itself
            await asyncio.sleep(0.2)
        # a PS the chief last counted silent (stopped) heard no shutdown: not waited for
        silent = self._silent_ps(self.status or {})
        for c in self.children[1:]:
            if c.name in silent and c.proc is not None and c.returncode is None:
                self._kill_hung(c, "was silent when the run ended")
        if await waited(asyncio.shield(watchers), LINGER_S):
            return
        left = [c.name for c in self.children if c.proc is not None and c.returncode is None]
        self.say(
            f"zmqps launch: {', '.join(left)} still running {LINGER_S:g}s after the chief"
            " ended: stopping"
        )
        await self.stop()

    async def _ps_schedule(self) -> None:
        """``--ps-schedule``: at each global step named, the chief is asked to serve the
        states from that many PS (``scale``); a PS left without states is drained by
        the chief and exits 0 (:meth:`_start_asked` starts it again when asked for)."""
        text = getattr(self.args, "ps_schedule", None)
        if not text:
            return
        from zmqps.core.elastic import parse_schedule, past_the_end

        assert self.cluster.chief is not None
        told = False
        for step, n in (schedule := parse_schedule(text, self.args.ps)):
            while True:
                s = self.status or {}
                known = s.get("step_known", True) and s.get("variables")
                if known and not told and (late := past_the_end(schedule, _planned(s))):
                    self.say(f"zmqps launch: {late}")
                    told = True
                if known and _trained(s):
                    # moves stop when training ends: an ask now would move nothing
                    if not told:  # (its step may be past: a run too short to be seen)
                        self.say(
                            f"zmqps launch: --ps-schedule from step {step} on: training"
                            f" ended (at step {int(s.get('global_step', 0)):,}) before the"
                            " launcher could ask for it"
                        )
                    return
                if known and int(s.get("global_step", -1)) >= step:
                    break
                await asyncio.sleep(0.2)
            while True:
                try:
                    await fetch_status(
                        self.cluster.chief,
                        timeout=STATUS_TIMEOUT_S,
                        options=self.status_options,
                        op="scale",
                        body={"ps": n},
                    )
                    break
                except ZmqpsError as exc:
                    self.say(f"zmqps launch: step {step}: asking for {n} PS failed ({exc})")
                    await asyncio.sleep(1.0)
            self.scaled.append({"step": step, "ps": n, "at_step": int(s.get("global_step", 0))})
            self.say(f"zmqps launch: step {step}: {n} PS serve the model from now on")

    async def _start_asked(self) -> None:
        """A PS the chief drained (it exited 0) and asks for again (``--ps-schedule``,
        ``zmqps scale``, ``--add-ps-above``) is started again, while the run goes on."""
        while not self.stopping:
            await asyncio.sleep(0.2)
            s = self.status or {}
            elastic = s.get("elastic") or {}
            asked = set(elastic.get("asked") or ())
            drained = set(elastic.get("drained") or ())
            if s.get("finished") or self.children[0].returncode is not None:
                continue
            for c in self.children[1:]:
                if not c.name.startswith("ps") or c.returncode != 0 or self.stopping:
                    continue
                i = int(c.name[2:])
                if i in asked and i in drained:
                    self.say(f"zmqps launch: the chief asks for {c.name}: starting it again")
                    await self._start(c)
                    self._rewatch.append(asyncio.ensure_future(self._watch(c)))

    async def _progress(self) -> None:
        """The chief's status twice a second: for the progress bar, and kept for
        :meth:`_liveness` (one poll serves both)."""
        assert self.cluster.chief is not None
        while True:
            await asyncio.sleep(0.5)
            try:
                s = await fetch_status(
                    self.cluster.chief, timeout=STATUS_TIMEOUT_S, options=self.status_options
                )
            except ZmqpsError:
                continue
            self.status, self.status_at = s, time.monotonic()
            if self.bar is not None:
                planned = int(s.get("steps_planned") or 0)
                if planned and self.bar.total != planned:
                    self.bar.total = planned
                if not s.get("step_known", True):
                    continue  # a restarted chief not started yet
                step = int(s.get("global_step", 0))
                self.bar.n = min(step, planned or step)
                blocker = str(s.get("blocker") or "")
                if blocker.startswith("finishing"):
                    self.bar.set_description("finishing", refresh=False)
                self.bar.refresh()

    def hung_after(self) -> float:
        """Seconds a task's process may run while the cluster counts it dead (or the
        chief answers nothing) before the launcher kills it as stopped or hung."""
        given = getattr(self.args, "hung_after", None)
        if given is not None:
            return float(given)
        return max(HUNG_MIN_S, HUNG_HEARTBEATS * float(self.args.heartbeat_timeout))

    async def _liveness(self) -> None:
        """A task whose process runs but does nothing (SIGSTOP, a hang) is killed, so
        that the restart policy starts it again (or the run ends failed): the chief
        when it has answered no status for :meth:`hung_after` seconds; a worker the
        chief counts dead, or a PS it counts down, for that long. A stopped task is
        never waited for without end."""
        chief = self.children[0]
        answered = time.monotonic()
        seen = 0.0  # the status last judged (each is judged once)
        tick = answered
        while not self.stopping:
            await asyncio.sleep(LIVENESS_TICK_S)
            now = time.monotonic()
            if now - tick > LIVENESS_TICK_S + LAUNCHER_STALL_S:
                # this launcher itself was stopped (Ctrl-Z, SIGSTOP) or starved: the
                # silence it measured is its own, not the tasks'; judge afresh
                answered = now
                for c in self.children[1:]:
                    c.dead_since = None
            tick = now
            if self.stopping or chief.returncode == 0:
                return  # the run is ending: the watchers see to the rest
            if chief.returncode is not None:  # it died: its watcher restarts it (or stops all)
                answered = now
                continue
            answered = max(answered, self.status_at)
            silent = now - max(answered, chief.started_at)
            # its start-up first, as every task's (a --hung-after below it killed a
            # chief loading its data, again at each restart, until the run failed)
            if silent > self.hung_after() and now - chief.started_at > START_GRACE_S:
                self._kill_hung(chief, f"has answered no status for {silent:.0f}s")
                answered = now
                continue
            s = self.status if self.status_at > seen else None
            seen = self.status_at
            if s is None or not s.get("step_known", True):
                continue
            dead = {f"worker{i}" for i in s.get("workers_dead") or ()} | self._silent_ps(s)
            for c in self.children[1:]:
                running = c.proc is not None and c.returncode is None
                if c.name not in dead or not running:
                    c.dead_since = None
                    continue
                c.dead_since = now if c.dead_since is None else c.dead_since
                # a process started again gets its start-up first: until it registers,
                # the chief still counts its old incarnation dead
                since = max(c.dead_since, c.started_at + START_GRACE_S)
                if now - since > self.hung_after():
                    what = "down" if c.name.startswith("ps") else "dead"
                    self._kill_hung(
                        c,
                        f"runs, yet the chief has counted it {what} for {now - c.dead_since:.0f}s",
                    )

    def _silent_ps(self, status: Mapping[str, Any]) -> set[str]:
        """The PS processes a chief's status counts silent. Unreplicated it counts PS
        *states* down, state i being process i; replicated a state fails over to a
        copy, and the status names the processes its probes do not hear."""
        if getattr(self.args, "replication", 1) <= 1:
            return {f"ps{i}" for i in (status.get("ps_down") or {})}
        unheard = (status.get("replication") or {}).get("silent") or ()
        return {f"ps{i}" for i in unheard}

    def _kill_hung(self, child: Child, why: str) -> None:
        self.say(f"zmqps launch: {child.name} {why} (stopped or hung): killing it")
        child.dead_since = None
        if child.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGCONT)  # a stopped process dies at once
                child.proc.kill()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        interrupted = asyncio.Event()
        signalled: list[int] = []

        def on_signal(sig: int) -> None:
            signalled.append(sig)
            interrupted.set()

        # a hangup (the terminal closed, an ssh session gone) stops the run like SIGTERM
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        sys.stderr.flush()
        self.console = Console(sys.stderr)
        try:
            with _logging_to(self.console):
                return await self._run(loop, interrupted, signalled)
        finally:
            # the run is over (its children stopped): its exit code stands, whatever
            # signal comes while it is printed (the loop's closing would put their
            # default actions back, and one then would kill the launcher by it)
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
            exiting()
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            self.console.close()
            self.console = None

    async def _run(
        self,
        loop: asyncio.AbstractEventLoop,
        interrupted: asyncio.Event,
        signalled: list[int],
    ) -> int:
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.env.pop("TF_CONFIG", None)
        self.env.pop("ZMQPS_KEYS", None)
        timeout = self.args.timeout or None
        began = time.monotonic()
        watching: list[asyncio.Future[None]] = []
        for c in self.children:
            if interrupted.is_set() or (timeout and time.monotonic() - began > timeout):
                break  # the tasks started are stopped below; those left never start
            # a resumed run goes on with its logs
            mode = "a" if getattr(self.args, "resume", False) else "w"
            # line-buffered: `tail -f RUN_DIR/chief.log` sees each line as it comes
            c.log = open(self.run_dir / f"{c.name}.log", mode, buffering=1)  # noqa: SIM115 - closed below
            await self._start(c)
            # watched (its output read) from its start: with many tasks the first ones
            # filled their pipes and stood while the others started
            watching.append(asyncio.ensure_future(self._watch(c)))
        if not self.args.no_progress and sys.stderr.isatty():
            self.bar = tqdm(
                total=None, unit="step", desc="training", file=self.console, dynamic_ncols=True
            )
        watchers = asyncio.ensure_future(asyncio.gather(*watching))
        lingering = asyncio.ensure_future(self._after_the_chief(watchers))
        progress = asyncio.ensure_future(self._progress())
        liveness = asyncio.ensure_future(self._liveness())
        schedule = asyncio.ensure_future(self._ps_schedule())
        asked = asyncio.ensure_future(self._start_asked())
        interrupt = asyncio.ensure_future(interrupted.wait())
        waitables: list[asyncio.Future[Any]] = [watchers, interrupt]
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - began))
        done, _ = await asyncio.wait(waitables, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        if len(watching) < len(self.children) and watchers in done:
            done = set()  # stopped while they started: the tasks started ended, not the run
        if watchers not in done:
            self.failure = (
                "interrupted" if interrupted.is_set() else f"timed out after {timeout:g}s"
            )
            self.say(f"zmqps launch: {self.failure}; stopping the cluster")
            await self.stop()
            await watchers
        interrupt.cancel()
        progress.cancel()
        liveness.cancel()
        schedule.cancel()
        asked.cancel()
        if self._rewatch:
            # PS started again for the states (their first watch ended when they were
            # drained): they end with the run, told by the chief; stopped past the grace
            _, late = await asyncio.wait(self._rewatch, timeout=GRACE_S)
            if late:
                await self.stop()
                await asyncio.wait(late, timeout=GRACE_S)
            for rewatch in self._rewatch:
                rewatch.cancel()
        lingering.cancel()
        if self.bar is not None:
            if not self.failure and not interrupted.is_set():
                # the run ended well: the bar shows it whole (the last status it read
                # may be a few steps short, taken before the end)
                self.bar.set_description("done", refresh=False)
                if self.bar.total:
                    self.bar.n = self.bar.total
                self.bar.refresh()
            self.bar.close()
            self.bar = None
        for c in self.children:
            if c.log is not None:
                with contextlib.suppress(OSError):  # a full disk: said by _keep if at all
                    c.log.close()
        sweep()  # shared-memory regions a killed child left
        if interrupted.is_set():
            # 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP, as a shell says
            return 128 + signalled[0]
        if not self.failure:
            return 0
        first = self.first_failed
        if first is not None and first.returncode in (EXIT_CONFIG, EXIT_RUN_FAILED):
            return first.returncode  # what the task said: a mistake, a failed run
        if first is self.children[0] and first.returncode in SIGNALLED_STOP:
            return first.returncode  # the chief alone told to stop: the run ends, resumable
        # (a worker signalled past its restarts is the run's failure, not a stop of it:
        # 143 made the launch take itself for stopped, and write no --summary)
        return 1


def _evaluations(path: Path) -> int:
    """The side-car evaluator's evaluations (lines of its log); 0 when it wrote none."""
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except OSError:
        return 0


def _worker_stats(launcher: Launcher, workers: int) -> list[dict[str, Any]]:
    """Each worker's step statistics (time per phase, overlap) of its last run."""
    out = []
    for i in range(workers):
        try:
            out.append(json.loads(launcher.worker_stats(i).read_text()))
        except (OSError, ValueError):
            continue  # a worker that was restarted and then skipped every step
    return out


def _chiefs_summary(path: Path, began: float) -> dict[str, Any] | None:
    """The chief's summary if it wrote one during this launch (since ``began``)."""
    try:
        if path.stat().st_mtime >= began:
            summary = json.loads(path.read_text())
            return summary if isinstance(summary, dict) else None
    except (OSError, ValueError):
        pass
    return None


def _ended_in_order(summary: Path, began: float = -math.inf) -> bool:
    """The chief's summary was written since ``began`` (during this launch; by default
    whenever) and says the run ended well: not failed (a run that failed before its
    first checkpoint, a full disk, left a folder --resume must start over)."""
    written = _chiefs_summary(summary, began)
    return written is not None and not written.get("failed")


def _failed_summary(
    path: str, launcher: Launcher, run_dir: Path, code: int, began: float, started: float
) -> None:
    """``--summary`` of a run that failed: the chief's own summary when it wrote one in
    this launch (it says why: ``failed``, ``work_lost``, the checkpoint), else what
    the launch knows; with the launch's failure, exit code and run folder."""
    summary = _chiefs_summary(launcher.chief_summary, began) or {}
    summary.setdefault("failed", launcher.failure)
    summary["launch_failed"] = launcher.failure
    summary["exit_code"] = code
    summary["restarts"] = launcher.restarts
    summary["wall_seconds"] = round(time.monotonic() - started, 3)
    summary["run_dir"] = str(run_dir)
    try:
        write_text_whole(path, json.dumps(summary, indent=2) + "\n", "--summary")
    except ZmqpsError as exc:
        print(f"zmqps launch: {exc}", file=sys.stderr)


def _print_summary(summary: dict[str, Any]) -> None:
    acc = summary.get("test_accuracy")
    lines = [
        f"zmqps launch: done in {summary['wall_seconds']:.1f} s",
        f"  mode {summary.get('mode')}, {summary.get('ps')} PS, {summary.get('workers')} workers"
        + (f", model {summary['model']} on {summary['dataset']}" if "model" in summary else ""),
        f"  global step {summary.get('global_step')}, {summary.get('examples')} examples,"
        + (
            f" {rate} examples/s"
            if (rate := summary.get("examples_per_second")) is not None
            else " examples/s not known (the chief was restarted and saw too little of the"
            " training to measure it, and nothing recorded the seconds before)"
        ),
    ]
    restarts = summary.get("restarts") or []
    if restarts or summary.get("restores"):
        tasks: dict[str, int] = {}
        for r in restarts:
            tasks[r["task"]] = tasks.get(r["task"], 0) + 1
        said = ", ".join(f"{t} {n}x" for t, n in tasks.items()) or "none"
        line = f"  tasks restarted: {said}"
        if summary.get("restores"):
            scratch = summary.get("restores_from_scratch") or 0
            ckpt = summary["restores"] - scratch
            what = [f"{ckpt} restores from a checkpoint"] if ckpt else []
            if scratch:  # no checkpoint was committed yet: every shard to its initial values
                what.append(f"{scratch} to the initial values (no checkpoint yet)")
            line += (
                f"; {', '.join(what)},"
                f" {summary.get('rewound_batches', 0)} batches trained again (counted once above)"
            )
        lines.append(line)
    if summary.get("evaluations") == 0:
        lines.append(
            "  WARNING: the evaluator evaluated nothing (see evaluator.log in the run folder)"
        )
    if summary.get("train_seconds_before_resume") is not None:
        lines.append(
            "  resumed: steps, examples and examples/s count the whole run, the"
            f" {summary['train_seconds_before_resume']} s of training before the stop"
            f" included ({summary.get('train_seconds')} s in all)"
        )
    if summary.get("chief_restarted") and summary.get("examples_per_second") is not None:
        lines.append(
            "  the chief was restarted: examples/s is measured after its restart; the"
            " seconds of training before it come from its last checkpoint"
        )
    if acc is not None:
        lines.append(f"  test accuracy {acc:.4f}, test loss {summary.get('test_loss'):.4f}")
    rep = summary.get("replication")
    if rep and (rep.get("failovers") or rep.get("copies_made")):
        lines.append(
            f"  replication {rep['factor']}: {rep['failovers']} fail-overs,"
            f" {rep['promotions']} copies promoted, {rep['copies_made']} copies made again,"
            f" {rep['restores']} restores from a checkpoint"
        )
    stats = [s for s in summary.get("worker_stats") or [] if "overlap" in s]
    if stats:
        overlap = sum(s["overlap"] for s in stats) / len(stats)
        step = sum(s["step_seconds"] for s in stats) / len(stats)
        line = f"  workers on {summary.get('device', 'cpu')}: {step * 1000:.2f} ms/step"
        if overlap >= 0.005:  # nothing to say where nothing overlapped (the figure is in --summary)
            line += f", {overlap:.0%} of communication hidden behind compute"
        lines.append(line)
    coord = summary.get("coordinator")
    if coord:
        lines.append(
            f"  coordinator: {coord.get('scheduled')} functions scheduled,"
            f" {coord.get('completed')} completed, {coord.get('retried')} retried"
            f" (steps per execution {coord.get('steps_per_execution')})"
        )
    if "test_auc" in summary:
        line = f"  test AUC {summary['test_auc']:.4f}, log loss {summary['test_logloss']:.4f}"
        if "ground_truth_auc" in summary:
            line += f" (ground truth: AUC {summary['ground_truth_auc']:.4f})"
        lines.append(line)
    tables = summary.get("tables") or {}
    if tables:
        rows = ", ".join(f"{name} {t.get('rows')} rows" for name, t in sorted(tables.items()))
        lines.append(f"  hash tables at the end: {rows}")
    if summary.get("logdir"):
        lines.append(f"  TensorBoard: tensorboard --logdir {summary['logdir']}")
    print("\n".join(lines), flush=True)


def _planned(status: dict[str, Any]) -> int:
    """The global steps a chief's status says the run plans (0: not known, as while
    not every worker expected has registered: the count grows with each)."""
    try:
        expected = int(status.get("workers_expected") or 0)
        if expected < 1 or len(status.get("workers") or ()) < expected:
            return 0
        return int(status.get("steps_planned") or 0)
    except (TypeError, ValueError):
        return 0


def _trained(status: dict[str, Any]) -> bool:
    """Whether a chief's status says training is over (the run finishing or finished,
    or its global step at the steps planned)."""
    if status.get("finished") or str(status.get("phase") or "") in (
        "finishing",
        "stopping",
        "stopped",
    ):
        return True
    planned = _planned(status)
    try:
        return planned > 0 and int(status.get("global_step") or 0) >= planned
    except (TypeError, ValueError):
        return False


#: the least memory one task of a launch takes (a worker's own pages: Python, numpy,
#: zmq; measured 60-120 MiB of RSS each with the libraries they share)
TASK_BYTES = 48 << 20


def _available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_room(tasks: int, available: int | None) -> None:
    """Every task is a process of its own: a launch of more than this machine's memory
    holds is refused before anything starts (``--workers 3000`` on a 2-core machine
    started processes for 17 minutes, deaf to Ctrl-C and to ``--timeout``)."""
    if available is not None and tasks * TASK_BYTES > available:
        gib = 1 << 30
        raise ConfigError(
            f"{tasks} tasks (each a process of {TASK_BYTES >> 20} MiB at least) need"
            f" {tasks * TASK_BYTES / gib:.1f} GiB; this machine has {available / gib:.1f} GiB"
            " available: fewer --workers, or start them on several machines (zmqps-worker;"
            " zmqps bench scale-sim simulates many workers in one process)"
        )


def check_launch_args(args: argparse.Namespace) -> JobConfig:
    """Everything the launcher can know is wrong, found before anything starts (a task
    that still fails on its configuration exits with code 2 and is never restarted)."""
    if args.ps < 1 or args.workers < 1:
        raise ConfigError("--ps and --workers must be >= 1")
    _check_room(args.ps + args.workers + 1, _available_bytes())
    if args.model in (None, "none"):
        raise ConfigError("zmqps launch runs a built-in --model")
    if getattr(args, "ps_schedule", None):
        from zmqps.core.elastic import parse_schedule
        from zmqps.wire.errors import InvalidArgument

        try:
            parse_schedule(args.ps_schedule, args.ps)
        except InvalidArgument as exc:
            raise ConfigError(f"{exc} (--ps {args.ps} PS are started)") from None
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts must be >= 0")
    check_heartbeat_timeout(args.heartbeat_timeout)
    if getattr(args, "hung_after", None) is not None and not args.hung_after >= MIN_HUNG_AFTER_S:
        raise ConfigError(
            f"--hung-after must be at least {MIN_HUNG_AFTER_S:g} s, got {args.hung_after:g}"
            " (the launcher asks the chief's status twice a second: a shorter bound kills a"
            " healthy chief between two of its answers)"
        )
    if not args.stall_timeout >= 0:
        raise ConfigError(f"--stall-timeout must be >= 0, got {args.stall_timeout:g}")
    # the real root is known later (RUN_DIR/checkpoints by default): only the flags here
    checkpoints = (args.checkpoint_dir or "RUN_DIR/checkpoints") if args.checkpoints else None
    checkpoint_policy_from_args(
        args, checkpoints, default_secs=CHECKPOINT_SECS, needs=NEEDS_CHECKPOINTS
    )
    partitioner_from_args(args)
    job = job_from_args(args)  # the model, the optimizer, the data set's files
    assert job is not None
    job.check_data(read=True)  # their content too, once, here
    check_launch(args)
    sync = sync_from_args(args)
    if getattr(args, "driver", "worker") != "coordinator":
        sync.check_workers(args.workers)
    try:
        Device.parse(args.device).check()
    except DeviceError as exc:
        raise ConfigError(f"--device {args.device}: {exc}") from None
    worker_devices(args.device, args.gpus_per_worker, 0, 1)  # --gpus-per-worker's errors
    job.check_towers(args.gpus_per_worker)
    # last: folders the tasks write in (what this creates to find out, it removes)
    if args.checkpoints:
        check_output_dir("--checkpoint-dir", args.checkpoint_dir)
    check_output_dir("--export-dir", args.export_dir)
    check_output_dir("--logdir", args.logdir)
    check_output_file("--summary", args.summary)
    if args.prometheus_targets and not args.metrics:
        raise ConfigError(
            "--prometheus-targets lists the tasks' /metrics endpoints, which --no-metrics"
            " turns off: drop one of them"
        )
    check_output_file("--prometheus-targets", args.prometheus_targets)
    return job


#: Files and folders an earlier launch leaves in its run directory.
#: the chief's summary in a run's folder (a finished run's, resumed: set aside)
CHIEF_SUMMARY = "chief-summary.json"
#: a run folder's checkpoint folder, where no --checkpoint-dir is given
CHECKPOINTS = "checkpoints"
RUN_FILES = ("chief.log", "tasks", "model", CHIEF_SUMMARY, CHECKPOINTS)


def checkpoint_folder(args: argparse.Namespace, run_dir: Path | None) -> Path | None:
    """Where a launch's checkpoints go: ``--checkpoint-dir``, else its run folder's
    (None: ``--no-checkpoints``, or no run folder)."""
    if not args.checkpoints:
        return None
    if args.checkpoint_dir:
        return Path(args.checkpoint_dir)
    return None if run_dir is None else run_dir / CHECKPOINTS


def _holds(path: Path) -> bool:
    """Whether ``path`` is there with something in it (an empty folder holds nothing:
    the checkpoint folder :func:`hold_folders` made for this run, say)."""
    if not path.is_dir():
        return path.exists()
    with os.scandir(path) as entries:
        return any(True for _ in entries)


def resume_from(args: argparse.Namespace, run_dir: Path | None) -> Checkpoint | None:
    """The checkpoint this launch goes on from (``--resume``), else None; refuses to
    start silently on an earlier run's checkpoints or files."""
    root = checkpoint_folder(args, run_dir)
    held = None if root is None or not root.is_dir() else CheckpointRoot(root)
    latest = None if held is None else held.latest()
    if not args.resume:
        if latest is not None:
            raise ConfigError(
                f"{root} holds the checkpoints of an earlier run (latest {latest.name},"
                f" step {latest.step}{', final' if latest.final else ''}): pass --resume to"
                " go on from it, or choose a new --run-dir / --checkpoint-dir"
            )
        found = [] if run_dir is None else [n for n in RUN_FILES if _holds(run_dir / n)]
        if found:
            raise ConfigError(
                f"--run-dir {run_dir} holds an earlier run ({', '.join(found)}) that this one"
                " would overwrite: choose a new --run-dir, or remove that one"
            )
        return None
    if root is None:
        raise ConfigError(
            "--resume needs checkpoints: give --run-dir or --checkpoint-dir, without"
            " --no-checkpoints"
        )
    if latest is None:
        kept = None if run_dir is None else _checkpoints_recorded(run_dir)
        elsewhere = (
            f" (the run in {run_dir} kept its checkpoints in {kept}: pass --checkpoint-dir {kept})"
            if kept is not None and Path(kept).resolve() != root.resolve()
            else ""
        )
        stopped_early = (
            not elsewhere
            and run_dir is not None
            and (run_dir / "tasks" / "chief.json").exists()
            and not _ended_in_order(run_dir / CHIEF_SUMMARY)
        )
        unreadable = [] if held is None else held.skipped
        if unreadable:
            # every checkpoint there is damaged (each said above): nothing to go on
            # from, and it said "stopped before its first" of three it could not read
            names = ", ".join(name for name, _ in unreadable[:5])
            more = f" and {len(unreadable) - 5} more" if len(unreadable) > 5 else ""
            print(
                f"zmqps launch: --resume: none of the {len(unreadable)} checkpoints in"
                f" {root} can be read ({names}{more}: see the lines above): it starts from"
                " the beginning",
                file=sys.stderr,
                flush=True,
            )
            return None
        if stopped_early:
            # a launch in this folder stopped before its first checkpoint: nothing of it
            # is kept to go on from, and the folder could be neither resumed nor used
            # again; it starts over, and says so
            print(
                f"zmqps launch: --resume: no checkpoint in {root} (the run in {run_dir} was"
                " stopped, or failed, before its first): it starts from the beginning",
                file=sys.stderr,
                flush=True,
            )
            return None
        raise ConfigError(f"--resume: no checkpoint in {root} to go on from{elsewhere}")
    _check_same_data(args, latest)
    return latest


def _checkpoints_recorded(run_dir: Path) -> str | None:
    """The checkpoint folder an earlier launch in ``run_dir`` gave its chief (its task
    configuration), or None."""
    try:
        task = json.loads((run_dir / "tasks" / "chief.json").read_text())
        folder = task["chief"]["checkpoint"]["directory"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return folder if isinstance(folder, str) else None


def forget_finished(root: Path) -> None:
    """A resumed run is a new cluster on the checkpoint: the workers the last run's
    chief recorded as finished (``workers-done.json``) train again in it, and its
    chief must not take them for done (it would end the run at once, or fail it)."""
    try:
        (root / RECORD_NAME).unlink(missing_ok=True)
    except OSError as exc:
        raise ConfigError(f"--resume: cannot remove {root / RECORD_NAME}: {exc.strerror}") from None


def set_summary_aside(run_dir: Path, ckpt: Checkpoint) -> None:
    """A finished run resumed in its folder: the summary its chief wrote at the end is
    kept as ``chief-summary-<checkpoint>.json``. Left as the chief's summary, the new
    chief would take the run for over (its final checkpoint, and the summary of that
    step: a chief started again after the end ends at once, and shuts down PS
    started again since)."""
    summary = run_dir / CHIEF_SUMMARY
    if not ckpt.final or not summary.exists():
        return
    try:
        summary.replace(run_dir / f"chief-summary-{ckpt.name}.json")
    except OSError as exc:
        raise ConfigError(f"--resume: cannot move {summary} aside: {exc.strerror}") from None


def _check_same_data(args: argparse.Namespace, ckpt: Checkpoint) -> None:
    """A resumed run's workers go on from their batch cursors: each cursor counts
    batches of that worker's part of the data, so the split (the worker count), the
    batch size, the dataset (and a synthetic one's size) and the shuffling seed must
    be those of the checkpoint's run (else batches are trained twice or never); and the
    model and its optimizer, learning rate included (the PS hold them with the
    variables). More epochs and other PS counts are fine. (A data folder's files are
    the user's: not compared.)"""
    wire = ckpt.manifest.extra.get("wire_dtype")
    now_wire = wire_dtype_from_args(args) or "float32"
    if isinstance(wire, str) and wire != now_wire:
        raise ConfigError(
            f"--resume: {ckpt.name} was trained with --wire-dtype {wire}, this run has"
            f" {now_wire}: its variables travel as they were created; resume with"
            f" --wire-dtype {wire}, or start a new --run-dir"
        )
    job = job_from_args(args)
    model = ckpt.manifest.extra.get("model")
    if job is not None and isinstance(model, dict) and not job.same(model, job.definition()):
        # found here, not by the chief once the cluster started (it refused the model
        # only after the restore, exit 2 some seconds in)
        raise ConfigError(
            f"--resume: {ckpt.name} was trained with {job.describe(model)}, this run has"
            f" {job.describe(job.definition())}: a checkpoint holds one model's variables;"
            " resume with its flags, or start a new --run-dir"
        )
    data = ckpt.manifest.extra.get("data")
    if not isinstance(data, dict):
        return  # a checkpoint of an earlier version: nothing to compare
    if job is None:
        return
    now = {
        "workers": args.workers,
        "dataset": job.dataset,
        "batch_size": job.batch_size,
        "seed": job.seed,
        "examples": job.examples,
    }
    flags = {"workers": "--workers", "dataset": "--dataset", "batch_size": "--batch-size"}
    for key, was in data.items():
        if key in now and now[key] is not None and now[key] != was:
            flag = flags.get(key, f"--{key.replace('_', '-')}")
            raise ConfigError(
                f"--resume: {ckpt.name} was trained with {flag} {was}, this run has {now[key]}:"
                " the workers' places in the data would no longer match (batches trained"
                f" twice or never); resume with {flag} {was}, or start a new --run-dir"
            )


def hold_folders(args: argparse.Namespace) -> tuple[list[int], list[Path]]:
    """Take an exclusive lock on ``--run-dir`` and the checkpoint folder
    (``--checkpoint-dir``, or ``RUN_DIR/checkpoints``; made if missing) for as long as
    this launch and its tasks run: a second launch on the same folders, ``--resume`` or
    not, would share the first one's checkpoints, logs and summary, each taking the
    other's run for its own. It is refused with one line (exit 1) instead. The lock
    goes with the last process holding it, a launcher killed with SIGKILL included
    (its tasks exit soon after it). Returns the locked descriptors and the folders
    made here (removed again if the launch does not start)."""
    fds: list[int] = []
    made: list[Path] = []
    held: set[Path] = set()
    # (what the folder is to the user, the folder)
    folders: list[tuple[str, str | Path | None]] = [("--run-dir", args.run_dir)]
    # (the default, in --run-dir, held too: another launch may name it)
    ckpt = checkpoint_folder(args, Path(args.run_dir) if args.run_dir else None)
    if ckpt is not None:
        what = f"--run-dir {args.run_dir}'s checkpoint folder"
        folders.append(("--checkpoint-dir" if args.checkpoint_dir else what, ckpt))
    try:
        for flag, path in folders:
            if not path or Path(path).resolve() in held:
                continue  # (a lock taken twice by this process would refuse itself)
            folder = Path(path)
            held.add(folder.resolve())
            missing = [d for d in (folder, *folder.parents) if not d.exists()]
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"{flag} {folder}: cannot create it ({exc.strerror})") from None
            made += missing
            try:
                fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            except OSError as exc:
                raise ConfigError(f"{flag} {folder}: cannot open it ({exc.strerror})") from None
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                raise ZmqpsError(
                    f"{flag} {folder} is in use by another zmqps launch (or its tasks, still"
                    " exiting): wait for it to end, or choose another folder"
                ) from None
    except BaseException:
        release_folders(fds, made)
        raise
    return fds, made


def release_folders(fds: list[int], made: list[Path]) -> None:
    """Close the descriptors :func:`hold_folders` locked, and remove the folders it
    made that stayed empty (a launch that did not start leaves nothing behind)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    # deepest first, across folders too (RUN_DIR/checkpoints before RUN_DIR)
    for folder in sorted(made, key=lambda p: len(p.absolute().parts), reverse=True):
        with contextlib.suppress(OSError):
            folder.rmdir()


def launch(args: argparse.Namespace) -> int:
    job = check_launch_args(args)
    fds, made = hold_folders(args)
    try:
        code = _launch(args, job, fds)
    except BaseException:
        release_folders(fds, made)
        raise
    release_folders(fds, [])
    return code


def _launch(args: argparse.Namespace, job: JobConfig, fds: list[int]) -> int:
    for flag in ("summary", "prometheus_targets"):  # written later: their folder must exist
        path = getattr(args, flag, None)
        if path:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(
                    f"--{flag.replace('_', '-')} {path}: cannot create its folder ({exc.strerror})"
                ) from None
    resumed = resume_from(args, Path(args.run_dir) if args.run_dir else None)
    if resumed is not None:
        forget_finished(resumed.path.parent)
        if args.run_dir:
            set_summary_aside(Path(args.run_dir), resumed)
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="zmqps-run-"))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--run-dir {run_dir}: cannot create it ({exc.strerror})") from None
    started = time.monotonic()
    try:
        launcher = Launcher(args, run_dir)
        launcher.held_fds = tuple(fds)
    except ConfigError:  # nothing started: a folder made for the run is not left behind
        if not args.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    if not args.quiet:
        print(
            f"zmqps launch: chief {launcher.cluster.chief}, {args.ps} PS, {args.workers}"
            f" workers; logs in {run_dir}"
            + ("" if args.run_dir else " (removed after a successful run)")
            + (f"; CURVE keys in {launcher.keys_dir}" if launcher.keys_dir else ""),
            file=sys.stderr,
            flush=True,
        )
    for var, why in (
        (
            "TF_CONFIG",
            "it runs a cluster of its own on 127.0.0.1 (for one task of"
            " another cluster: zmqps-server or zmqps-worker)",
        ),
        ("ZMQPS_KEYS", "the run is plaintext, or uses keys of its own with --secure"),
    ):
        if os.environ.get(var):  # its children do not get it: said, not silent
            print(f"zmqps launch: {var} in the environment ignored: {why}", file=sys.stderr)
    if getattr(args, "verbose", 0):
        for line in launcher.metrics_urls():
            print(f"zmqps launch: metrics {line}", file=sys.stderr, flush=True)
    if args.prometheus_targets and launcher.metrics_ports:
        Path(args.prometheus_targets).write_text(json.dumps(launcher.file_sd(), indent=2) + "\n")
        print(
            f"zmqps launch: Prometheus targets in {args.prometheus_targets}"
            f" (zmqps top {args.prometheus_targets})",
            file=sys.stderr,
            flush=True,
        )
    if resumed is not None:
        finished = (
            f", the final checkpoint of a finished run: {job.epochs} more"
            f" epoch{'s' if job.epochs != 1 else ''}"
            if resumed.final
            else ""
        )
        was, now = resumed.manifest.mode, getattr(args, "mode", None) or "async"
        # another consistency model is allowed (the variables are the same), never silent:
        # the global step counts pushes in async and ssp, steps of N gradients in sync
        other = f"; it trained in {was} mode, this run in {now}" if was != now else ""
        print(
            f"zmqps launch: resuming from {resumed.name} (global step {resumed.step}{finished})"
            f" in {resumed.path.parent}{other}",
            file=sys.stderr,
            flush=True,
        )
    began = time.time()
    code = asyncio.run(launcher.run())
    if code >= 128 and _ended_in_order(launcher.chief_summary, began):
        # the stop came after the run had ended (its final checkpoint, model and summary
        # written): it failed as "interrupted", without its summary, and a --resume then
        # took it for finished and trained every epoch again
        print(
            "zmqps launch: the run had ended when the stop came; it is done",
            file=sys.stderr,
            flush=True,
        )
        code = 0
    if code != 0:
        first = launcher.first_failed
        if first is not None and first.tail:
            print(f"--- last lines of {first.name} (exit {first.returncode}):", file=sys.stderr)
            print("\n".join(first.tail[-10:]), file=sys.stderr)
        print(f"zmqps launch: failed: {launcher.failure}; logs in {run_dir}", file=sys.stderr)
        if args.summary and code < 128:  # (told to stop: the user's stop, not a failure)
            _failed_summary(args.summary, launcher, run_dir, code, began, started)
        return code
    summary = json.loads(launcher.chief_summary.read_text())
    summary["wall_seconds"] = round(time.monotonic() - started, 3)
    summary["device"] = args.device
    worker0 = next((c for c in launcher.children if c.name == "worker0"), None)
    threads = (worker0.env if worker0 else {}).get("OMP_NUM_THREADS") or os.environ.get(
        "OMP_NUM_THREADS"
    )
    # a user's value may be anything ("4,2" for nested OpenMP): a count only if it is one
    summary["worker_blas_threads"] = int(threads) if threads and threads.isdigit() else None
    summary["worker_stats"] = _worker_stats(launcher, args.workers)
    summary["restarts"] = launcher.restarts
    if launcher.scaled:
        summary["ps_schedule"] = launcher.scaled
    if args.evaluator:
        summary["evaluations"] = _evaluations(run_dir / "evaluator.jsonl")
    if resumed is not None:
        summary["resumed_from"] = {"checkpoint": resumed.name, "step": resumed.step}
    if args.run_dir:
        summary["run_dir"] = str(run_dir)
    if args.logdir:
        summary["logdir"] = str(Path(args.logdir).resolve())
    unwritten = None
    if args.summary:
        try:
            write_text_whole(args.summary, json.dumps(summary, indent=2) + "\n", "--summary")
        except ZmqpsError as exc:
            unwritten = exc  # said after the results, which are printed all the same
    if not args.run_dir and unwritten is None:
        shutil.rmtree(run_dir, ignore_errors=True)  # a temporary folder is kept on failure only
    _print_summary(summary)
    if unwritten is not None:
        # the run's record is lost (a full disk, /dev/full): failed, as the chief's own
        # summary that cannot be written fails its run (exit code 3, not retried)
        print(f"zmqps launch: failed: {unwritten}; logs in {run_dir}", file=sys.stderr)
        return EXIT_RUN_FAILED
    return 0
