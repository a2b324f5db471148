"""Tasks as data: a task's :class:`~zmqps.roles.configs.TaskConfig` from its flags, and
the one runner every process uses.

Rules of this module:

* :func:`task_from_args` turns ``zmqps-server`` / ``zmqps-worker`` flags (and the
  cluster from flags or ``TF_CONFIG``) into a TaskConfig; ``zmqps launch`` builds
  its children's TaskConfigs itself and passes them as JSON files
  (``zmqps task --config FILE``). Either way :func:`run_task` runs it: the same code
  path for a task started by hand, by Kubernetes, or by the launcher.
* Every check that does not need the cluster happens while the TaskConfig is
  built, so the launcher finds a mistake before it starts anything.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from typing import Any

from zmqps.config import ClusterSpec, TaskSpec, bind_address
from zmqps.device import DeviceError, choose_devices, parse_devices
from zmqps.process import write_text_whole
from zmqps.roles.configs import (
    CheckpointPolicy,
    ChiefConfig,
    DriverConfig,
    EvaluatorConfig,
    PSConfig,
    TaskConfig,
    WorkerConfig,
)
from zmqps.roles.job import JobConfig
from zmqps.wire.errors import ConfigError, ZmqpsError

__all__ = ["run_task", "task_from_args"]

log = logging.getLogger("zmqps")

#: The built-in demo job module of coordinator mode (the digits MLP).
DEFAULT_JOB = "zmqps.coordinator.digits"


#: the chief's checkpoint interval when neither --checkpoint-steps nor --checkpoint-secs
#: is given (``zmqps launch``: its own, shorter)
CHECKPOINT_SECS = 600.0


def checkpoint_policy(args: argparse.Namespace) -> CheckpointPolicy | None:
    from zmqps.cli.args import checkpoint_policy_from_args

    return checkpoint_policy_from_args(
        args, args.checkpoint_dir or None, default_secs=CHECKPOINT_SECS
    )


def task_from_args(args: argparse.Namespace, cluster: ClusterSpec, task: TaskSpec) -> TaskConfig:
    """The TaskConfig of ``zmqps-server`` / ``zmqps-worker`` flags for ``task``."""
    from zmqps.cli.args import (
        check_output_dir,
        check_output_file,
        job_from_args,
        metrics_port,
        on_nonfinite_from_args,
    )

    common: dict[str, Any] = {
        "keys": getattr(args, "keys", None),
        "verbose": int(getattr(args, "verbose", 0) or 0),
        "quiet": bool(getattr(args, "quiet", False)),
    }
    if task.role == "ps":
        check_output_dir("--checkpoint-dir", args.checkpoint_dir, keep=True)  # its shards
        bind = args.bind or bind_address(cluster.address("ps", task.index))
        ps = PSConfig(
            index=task.index,
            bind=bind,
            metrics_host=args.metrics_host,
            metrics_port=metrics_port(args),
            checkpoint_dir=args.checkpoint_dir,
        )
        return TaskConfig(ps=ps, **common)
    if task.role == "chief":
        return TaskConfig(chief=chief_config(args, cluster), **common)
    if task.role == "evaluator":
        return TaskConfig(evaluator=evaluator_config(args, cluster), **common)
    job = job_from_args(args)
    check_output_dir("--logdir", args.logdir, keep=True)
    check_output_file("--stats", args.stats, keep=True)  # written at the end of the run
    serve_job = (args.job or DEFAULT_JOB) if getattr(args, "serve", False) else None
    if serve_job is None and getattr(args, "job", None):
        raise ConfigError("--job names the module of --serve (coordinator mode)")
    if job is None and serve_job is None:
        raise ConfigError(
            "zmqps-worker needs a built-in --model (write your own loop with zmqps.Worker)"
        )
    devices = _devices_of(args, job)
    worker = WorkerConfig(
        cluster=cluster,
        index=task.index,
        job=job,
        device=devices,
        prefetch=args.prefetch,
        shared_memory=args.shared_memory,
        connect_timeout=args.connect_timeout,
        chief_timeout=_chief_timeout(args.chief_timeout, 60.0),
        stats_path=args.stats,
        metrics_host=args.metrics_host,
        metrics_port=metrics_port(args),
        serve_job=serve_job,
        on_nonfinite=on_nonfinite_from_args(args),
        logdir=args.logdir,
        mode=args.mode,
    )
    return TaskConfig(worker=worker, **common)


def _devices_of(args: argparse.Namespace, job: JobConfig | None) -> str:
    """The worker's devices (``--devices``, else ``--device``), checked: comma-separated."""
    given = getattr(args, "devices", None)
    device = None if given and args.device == "cpu" else args.device  # cpu: the default
    try:
        devices = [d.check() for d in choose_devices(device, given)]
    except DeviceError as exc:
        raise ConfigError(f"{'--devices' if given else '--device'}: {exc}") from None
    if job is not None:
        job.check_towers(len(devices))
    return ",".join(str(d) for d in devices)


def _chief_timeout(given: float | None, default: float) -> float | None:
    if given is None:
        return default
    if given < 0:
        raise ConfigError(f"--chief-timeout must be >= 0, got {given:g}")
    return given or None  # 0: never


def chief_config(args: argparse.Namespace, cluster: ClusterSpec) -> ChiefConfig:
    from zmqps.cli.args import (
        check_heartbeat_timeout,
        check_output_dir,
        check_output_file,
        job_from_args,
        metrics_port,
        optimizer_from_args,
        partitioner_from_args,
        sync_from_args,
        wire_dtype_from_args,
    )

    job = job_from_args(args)
    check_heartbeat_timeout(args.heartbeat_timeout)
    check_output_file("--summary", args.summary)
    # the folders the chief writes in: refused now, one line (the chief hung on a
    # --logdir it could not create, and failed on the others after serving)
    for flag, path in (
        ("--logdir", args.logdir),
        ("--export-dir", args.export_dir),
        ("--checkpoint-dir", args.checkpoint_dir),
    ):
        check_output_dir(flag, path, keep=True)
    from zmqps.cli.coordinator import check_driver

    check_driver(args)
    driver = None
    if getattr(args, "driver", "worker") == "coordinator":
        if job is None:
            raise ConfigError("--driver coordinator runs a built-in --model")
        if args.mode != "async":
            raise ConfigError("--driver coordinator trains asynchronously (--mode async)")
        if args.steps_per_execution < 1:
            raise ConfigError("--steps-per-execution must be >= 1")
        driver = DriverConfig(args.job or DEFAULT_JOB, args.steps_per_execution)
    return ChiefConfig(
        bind=args.bind or bind_address(cluster.chief),
        cluster=cluster,
        job=job,
        optimizer=dict(job.optimizer) if job else optimizer_from_args(args),
        partitioner=partitioner_from_args(args),
        placement=args.placement,
        replication=args.replication,
        wire_dtype=wire_dtype_from_args(args),
        heartbeat_timeout=args.heartbeat_timeout,
        startup_timeout=args.startup_timeout,
        summary_path=args.summary,
        keep_alive=args.keep_alive,
        sync=sync_from_args(args),
        metrics_host=args.metrics_host,
        metrics_port=metrics_port(args),
        checkpoint=checkpoint_policy(args),
        export_dir=args.export_dir,
        driver=driver,
        max_nonfinite_share=args.max_nonfinite_share,
        logdir=args.logdir,
        stall_timeout=args.stall_timeout,
        add_ps_above=getattr(args, "add_ps_above", None),
    )


def evaluator_config(args: argparse.Namespace, cluster: ClusterSpec) -> EvaluatorConfig:
    from zmqps.cli.args import check_output_dir, check_output_file, job_from_args, metrics_port

    job = job_from_args(args)
    if job is None:
        raise ConfigError("the evaluator needs the job's built-in --model")
    check_output_dir("--logdir", args.logdir, keep=True)
    # (its --checkpoint-dir is only read)
    check_output_file("--eval-log", args.eval_log, keep=True)
    return EvaluatorConfig(
        chief=cluster.chief or None,
        job=job,
        checkpoint_dir=args.checkpoint_dir,
        interval=args.eval_interval,
        chief_timeout=_chief_timeout(args.chief_timeout, 30.0) or float("inf"),
        connect_timeout=args.connect_timeout,
        eval_log=args.eval_log,
        metrics_host=args.metrics_host,
        metrics_port=metrics_port(args),
        idle_timeout=args.eval_idle_timeout,
        logdir=args.logdir,
    )


# ------------------------------------------------------------------ running a task


def _options(
    task: TaskConfig,
    role: str,
    index: int | None,
    serve: bool,
    connect: bool,
    connect_if_present: bool = False,
) -> Any:
    from zmqps.config import keys_dir
    from zmqps.transport import SocketOptions, load_keys

    folder = keys_dir(task.keys)
    if folder is None:
        return None
    keys = load_keys(
        folder, role, index, serve=serve, connect=connect, connect_if_present=connect_if_present
    )
    return SocketOptions(curve=keys)


def run_task(task: TaskConfig) -> int:
    """Run one task to its end; returns the process's exit code."""
    from zmqps.malloc import tune_malloc

    tune_malloc()
    if task.ps is not None:
        from zmqps.roles.ps import run_ps

        # its client pair, to hold copies of other PS's states (--replication)
        options = _options(task, "ps", task.ps.index, True, False, connect_if_present=True)
        return run_ps(task.ps, options)
    if task.chief is not None:
        options = _options(task, "chief", 0, True, True)
        if task.chief.driver is not None:
            from zmqps.coordinator.driver import run_chief_driver

            d = task.chief.driver
            return run_chief_driver(
                task.chief,
                d.job_module,
                steps_per_execution=d.steps_per_execution,
                options=options,
            )
        from zmqps.roles.chief import run_chief

        return run_chief(task.chief, options)
    if task.evaluator is not None:
        from zmqps.roles.evaluator import run_evaluator

        return run_evaluator(task.evaluator, _options(task, "evaluator", None, False, True))
    assert task.worker is not None
    return _run_worker(task, task.worker)


def _run_worker(task: TaskConfig, cfg: WorkerConfig) -> int:
    from zmqps.metrics.summaries import open_summaries
    from zmqps.roles.agreement import job_flags
    from zmqps.roles.worker import RunEnded, Terminated, Worker, train

    tspec = TaskSpec("worker", cfg.index)
    metrics, exporter = _worker_metrics(cfg)
    summaries = None
    try:
        if cfg.serve_job is not None:
            from zmqps.coordinator.serve import run_function_server

            options = _options(task, "worker", cfg.index, True, True)
            return run_function_server(
                cfg.cluster,
                tspec,
                cfg.serve_job,
                job=cfg.job,
                options=options,
                metrics=metrics,
                connect_timeout=cfg.connect_timeout,
                shared_memory=cfg.shared_memory,
                on_nonfinite=cfg.on_nonfinite,
            )
        assert cfg.job is not None
        options = _options(task, "worker", cfg.index, False, True)
        planned = cfg.job.planned_steps(
            cfg.index, cfg.cluster.num_workers, towers=len(parse_devices(cfg.device))
        )
        # SIGTERM (Kubernetes, the launcher) or SIGINT (Ctrl-C) before the worker is
        # connected: it ends at once
        stopper = _Stopper()
        for sig in STOP_SIGNALS:
            signal.signal(sig, stopper.handle)
        worker: Worker | None = None
        result: dict[str, Any] | None = None
        summaries = open_summaries(cfg.logdir, f"worker{cfg.index}")
        try:
            with Worker.from_cluster(
                cfg.cluster,
                tspec,
                connect_timeout=cfg.connect_timeout,
                chief_timeout=cfg.chief_timeout,
                steps_planned=planned,
                shared_memory=cfg.shared_memory,
                metrics=metrics,
                options=options,
                devices=cfg.device,
                on_nonfinite=cfg.on_nonfinite,
                summaries=summaries,
                job_flags=job_flags(cfg.cluster, cfg.job, cfg.mode),
            ) as worker:
                # From now on a stop (a signal, the chief's shutdown, a chief gone) ends
                # the current step first (its gradient reaches every PS, so a sync step
                # is not left half done); a step that does not end within STOP_GRACE_S
                # (or a second signal) ends at once.
                stopper.worker = worker
                worker.on_stop = stopper.bound
                result = train(worker, cfg.job, cfg.cluster.num_workers, prefetch=cfg.prefetch)
        except RunEnded as ended:
            # started again after its run ended (a supervisor, `docker compose up` on
            # the kept volume): the chief of that run says so, and this is no failure
            log.warning("worker %d: %s: nothing to train", cfg.index, ended)
            return 0
        except Terminated:
            why, code = stopper.why(worker)
            step = 0 if worker is None else worker.net_steps
            log.warning("worker %d: %s; left after %d steps", cfg.index, why, step)
            return code
        finally:
            stopper.cancel()
            for sig in STOP_SIGNALS:  # the worker is closed: a late stop has nothing to end
                signal.signal(sig, signal.SIG_IGN)
            if worker is not None and cfg.stats_path:
                _write_stats(cfg, worker, result)
        if worker is not None and worker.stop_requested:  # stopped while waiting for the end
            log.warning("worker %d: %s after its work was done", cfg.index, worker.stop_reason)
        return 0
    finally:
        if summaries is not None:
            summaries.close()
        if exporter is not None:
            exporter.close()


#: signals that stop a worker: after the current step, or at once when repeated
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: seconds a step may still take after a stop was requested
STOP_GRACE_S = 2.0


class _Stopper:
    """A worker process's stop: the first signal (or the worker's own stop: the chief
    stopping the run, or gone) ends the current step; a step still running
    ``STOP_GRACE_S`` later, or a second signal, ends at once (:class:`Terminated`)."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.signal: signal.Signals | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.RLock()  # taken in a signal handler too
        #: the worker is closed: a late signal (or the timer's) has nothing to end
        self.closed = False

    def handle(self, signum: int, frame: object) -> None:
        from zmqps.roles.worker import Terminated

        if self.closed:
            return
        if self.signal is None:
            self.signal = signal.Signals(signum)
        worker = self.worker
        if worker is None or worker.stop_requested:
            raise Terminated()
        worker.request_stop(f"stopped by {self.signal.name}", 128 + int(self.signal))

    def bound(self) -> None:
        """The worker will stop: give its step STOP_GRACE_S, then end it."""
        with self._lock:
            if self._timer is None:
                self._timer = threading.Timer(STOP_GRACE_S, self._interrupt)
                self._timer.daemon = True
                self._timer.start()

    def _interrupt(self) -> None:
        # to the main thread itself: its handler raises there, wherever it waits
        sig = signal.SIGTERM if self.signal is None else self.signal
        signal.pthread_kill(threading.main_thread().ident or 0, sig)

    def cancel(self) -> None:
        with self._lock:
            self.closed = True
            if self._timer is not None:
                self._timer.cancel()

    def why(self, worker: Any) -> tuple[str, int]:
        """Why the worker stopped, and its exit code."""
        if worker is not None and worker.stop_requested:
            return worker.stop_reason, worker.stop_code
        sig = self.signal or signal.SIGTERM
        return f"stopped by {sig.name}", 128 + int(sig)


def _write_stats(cfg: WorkerConfig, worker: Any, result: dict[str, Any] | None) -> None:
    """This incarnation's statistics: steps and pushes (and, when it ran to the end,
    the time per phase and the overlap)."""
    assert cfg.stats_path is not None
    devices = ",".join(str(d) for d in worker.devices)
    stats: dict[str, Any] = {"worker": cfg.index, "device": devices, **worker.stats()}
    if result is not None and "overlap" in result:
        stats.update(result["overlap"])
    try:  # the worker's statistics, not its work: its exit code stays its work's
        write_text_whole(cfg.stats_path, json.dumps(stats, indent=2) + "\n", "the statistics")
    except ZmqpsError as exc:
        log.error("worker %d: %s", cfg.index, exc)


def _worker_metrics(cfg: WorkerConfig) -> tuple[Any, Any]:
    """The worker's Metrics and its /metrics server (both None without a metrics port)."""
    from zmqps.metrics import Metrics
    from zmqps.roles._run import start_exporter

    if cfg.metrics_port is None:
        return None, None
    metrics = Metrics()
    # a port taken says so, as every other role's ("[Errno 98] Address already in use")
    exporter = start_exporter(metrics, cfg.metrics_host, cfg.metrics_port, f"worker {cfg.index}")
    return metrics, exporter
