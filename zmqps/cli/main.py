"""Entry points: ``zmqps`` (launch, server, worker, status, predict, bench), ``zmqps-server``,
``zmqps-worker``.

Errors users can fix (a bad cluster spec, a bad flag) print one line and exit 2;
runtime failures print one line and exit 1; tracebacks only with ``-v``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from zmqps.cli.args import (
    add_cluster_args,
    add_device_args,
    add_evaluator_args,
    add_job_args,
    add_metrics_args,
    add_security_args,
    add_server_args,
    add_sync_args,
    bind_address,
    cluster_and_task,
    exit_with_parent,
    job_from_args,
    metrics_port,
    optimizer_from_args,
    partitioner_from_args,
    setup_logging,
    socket_options,
    sync_from_args,
)
from zmqps.device import Device, DeviceError
from zmqps.malloc import tune_malloc
from zmqps.wire.errors import ConfigError, ZmqpsError

__all__ = ["main", "server_main", "worker_main"]

log = logging.getLogger("zmqps")


def _server_parser(p: argparse.ArgumentParser) -> None:
    from zmqps.cli.coordinator import add_driver_args

    add_cluster_args(p)
    add_job_args(p, model_default=None)
    add_server_args(p)
    add_sync_args(p)
    add_metrics_args(p)
    add_security_args(p)
    add_driver_args(p)


def _worker_parser(p: argparse.ArgumentParser) -> None:
    from zmqps.cli.coordinator import add_serve_args

    add_serve_args(p)
    add_cluster_args(p)
    add_job_args(p)
    add_device_args(p)
    add_metrics_args(p)
    add_evaluator_args(p)
    add_security_args(p)
    p.add_argument(
        "--no-shm",
        dest="shared_memory",
        action="store_false",
        help="never move tensors through shared memory with a PS on this host (TCP only)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the chief (default: 120)",
    )
    p.add_argument(
        "--stats",
        metavar="FILE",
        help="write this worker's step statistics (seconds per phase, overlap) as JSON",
    )


def cmd_server(args: argparse.Namespace) -> int:
    from zmqps.roles.chief import ChiefConfig, run_chief
    from zmqps.roles.ps import PSConfig, run_ps

    cluster, task = cluster_and_task(args)
    tune_malloc()
    bind = args.bind or bind_address(cluster.address(task.role, task.index))
    if task.role in ("ps", "chief"):
        # the PS only serve; the chief serves and connects to every PS
        options = socket_options(
            args, task.role, task.index, serve=True, connect=task.role == "chief"
        )
    if task.role == "ps":
        return run_ps(
            PSConfig(
                index=task.index,
                bind=bind,
                metrics_host=args.metrics_host,
                metrics_port=metrics_port(args),
                checkpoint_dir=args.checkpoint_dir,
            ),
            options,
        )
    if task.role == "chief":
        job = job_from_args(args)
        cfg = ChiefConfig(
            bind=bind,
            cluster=cluster,
            job=job,
            optimizer=dict(job.optimizer) if job else optimizer_from_args(args),
            partitioner=partitioner_from_args(args),
            placement=args.placement,
            heartbeat_timeout=args.heartbeat_timeout,
            startup_timeout=args.startup_timeout,
            summary_path=args.summary,
            keep_alive=args.keep_alive,
            sync=sync_from_args(args),
            metrics_host=args.metrics_host,
            metrics_port=metrics_port(args),
            checkpoint=_checkpoint_policy(args),
            export_dir=args.export_dir,
        )
        if args.driver == "coordinator":
            from zmqps.cli.coordinator import run_driver

            return run_driver(cfg, args, options)
        return run_chief(cfg, options)
    raise ConfigError(
        f"zmqps-server serves roles chief and ps, not {task.role!r} (use zmqps-worker)"
    )


def _checkpoint_policy(args: argparse.Namespace) -> Any:
    from zmqps.roles.checkpointer import CheckpointPolicy

    if not args.checkpoint_dir:
        if args.checkpoint_steps or args.checkpoint_secs:
            raise ConfigError("--checkpoint-steps / --checkpoint-secs need --checkpoint-dir")
        return None
    if args.checkpoint_steps < 0 or args.checkpoint_secs < 0 or args.keep_checkpoints < 1:
        raise ConfigError("checkpoint intervals must be >= 0 and --keep-checkpoints >= 1")
    secs = args.checkpoint_secs or (0.0 if args.checkpoint_steps else 600.0)
    return CheckpointPolicy(args.checkpoint_dir, args.checkpoint_steps, secs, args.keep_checkpoints)


def cmd_worker(args: argparse.Namespace) -> int:
    from zmqps.roles.worker import Terminated, Worker, train

    cluster, task = cluster_and_task(args, default_role="worker")
    tune_malloc()
    if task.role == "evaluator":
        return _evaluator(cluster.chief, args)
    if task.role != "worker":
        raise ConfigError(f"zmqps-worker runs roles worker and evaluator, not {task.role!r}")
    if args.serve:
        return _serve(args, cluster, task)
    if args.job:
        raise ConfigError("--job names the module of --serve (coordinator mode)")
    job = job_from_args(args)
    if job is None:
        raise ConfigError(
            "zmqps-worker needs a built-in --model (write your own loop with zmqps.Worker)"
        )
    planned = job.planned_steps(task.index, cluster.num_workers)
    options = socket_options(args, "worker", task.index, serve=False, connect=True)
    try:
        device = Device.parse(args.device).check()
    except DeviceError as exc:
        raise ConfigError(f"--device: {exc}") from None
    # SIGTERM (Kubernetes, the launcher) leaves the cluster cleanly instead of vanishing.
    signal.signal(signal.SIGTERM, _terminated)
    metrics, exporter = _worker_metrics(args, task.index)
    try:
        with Worker.from_cluster(
            cluster,
            task,
            connect_timeout=args.connect_timeout,
            steps_planned=planned,
            shared_memory=args.shared_memory,
            metrics=metrics,
            options=options,
            device=device,
        ) as worker:
            # From now on a SIGTERM ends the current step first (its gradient reaches
            # every PS, so a sync step is not left half done); a second one ends at once.
            signal.signal(signal.SIGTERM, _stop_after_step(worker))
            result = train(worker, job, cluster.num_workers, prefetch=args.prefetch)
        if args.stats and "overlap" in result:
            stats = {"worker": task.index, "device": str(device), **result["overlap"]}
            # this incarnation: resumed after steps_done; its pushes by "ps/generation"
            stats.update(incarnation=worker.incarnation, steps_done=worker.steps_done)
            stats["pushes"] = worker.client.push_counts
            Path(args.stats).write_text(json.dumps(stats, indent=2) + "\n")
    except Terminated:
        log.warning("worker %d: terminated by SIGTERM; left the cluster", task.index)
        return 128 + signal.SIGTERM
    finally:
        if exporter is not None:
            exporter.close()
    return 0


def _worker_metrics(args: argparse.Namespace, index: int) -> tuple[Any, Any]:
    """The worker's Metrics and its /metrics server (both None without --metrics-port)."""
    from zmqps.metrics import Metrics, MetricsServer

    port = metrics_port(args)
    if port is None:
        return None, None
    metrics = Metrics()
    exporter = MetricsServer(metrics, args.metrics_host, port)
    log.info("worker %d: metrics at %s", index, exporter.url)
    return metrics, exporter


def _serve(args: argparse.Namespace, cluster: Any, task: Any) -> int:
    from zmqps.cli.coordinator import serve

    options = socket_options(args, "worker", task.index, serve=True, connect=True)
    metrics, exporter = _worker_metrics(args, task.index)
    try:
        return serve(args, cluster, task, options, metrics)
    finally:
        if exporter is not None:
            exporter.close()


def _evaluator(chief: str | None, args: argparse.Namespace) -> int:
    from zmqps.roles.evaluator import EvaluatorConfig, run_evaluator

    job = job_from_args(args)
    if job is None:
        raise ConfigError("the evaluator needs the job's built-in --model")
    if chief is None:
        raise ConfigError("the cluster spec has no chief for the evaluator to follow")
    return run_evaluator(
        EvaluatorConfig(
            chief=chief,
            job=job,
            checkpoint_dir=args.checkpoint_dir,
            interval=args.eval_interval,
            chief_timeout=args.chief_timeout,
            connect_timeout=args.connect_timeout,
            eval_log=args.eval_log,
            metrics_host=args.metrics_host,
            metrics_port=metrics_port(args),
        ),
        socket_options(args, "evaluator", None, serve=False, connect=True),
    )


def _stop_after_step(worker: Any) -> Callable[[int, object], None]:
    def handler(signum: int, frame: object) -> None:
        if worker.stop_requested:
            _terminated(signum, frame)
        worker.stop_requested = True

    return handler


def _terminated(signum: int, frame: object) -> None:
    from zmqps.roles.worker import Terminated

    raise Terminated()


def cmd_status(args: argparse.Namespace) -> int:
    from zmqps.roles.status import fetch_status, format_status

    options = socket_options(args, "status", None, serve=False, connect=True)
    status = asyncio.run(fetch_status(args.chief, timeout=args.timeout, options=options))
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(format_status(status))
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from zmqps.transport.security import CLIENT_ROLES, keygen

    if args.workers is not None and args.workers < 1:
        raise ConfigError("--workers must be >= 1")
    clients = list(CLIENT_ROLES)
    if args.workers:
        clients.remove("worker")
        clients += [f"worker{i}" for i in range(args.workers)]
    written = keygen(args.dir, clients, force=args.force)
    print(
        f"zmqps keygen: {len(written)} key files in {args.dir}: server pair (chief and PS"
        f" need server.key_secret), client pairs {', '.join(clients)},"
        f" allow-list {args.dir}/allowed; secret keys are mode 0600"
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from zmqps.cli.inspect import run

    return run(args)


def cmd_top(args: argparse.Namespace) -> int:
    from zmqps.metrics.top import main_args

    return main_args(args)


def cmd_predict(args: argparse.Namespace) -> int:
    from zmqps.cli.predict import run

    return run(args)


def cmd_launch(args: argparse.Namespace) -> int:
    from zmqps.cli.launch import launch

    return launch(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from zmqps.bench.suites import run_bench

    return run_bench(args)


def _build() -> argparse.ArgumentParser:
    from zmqps.bench.suites import add_bench_args
    from zmqps.cli.inspect import add_args as add_inspect_args
    from zmqps.cli.launch import add_launch_args
    from zmqps.cli.predict import add_args as add_predict_args

    parser = argparse.ArgumentParser(
        prog="zmqps", description="zmqps: a parameter server over ZeroMQ"
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="debug logging and tracebacks"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("launch", help="run a whole cluster as local processes (the demo)")
    add_launch_args(p)
    p.set_defaults(func=cmd_launch)
    p = sub.add_parser("server", help="run a chief or PS task (same as zmqps-server)")
    _server_parser(p)
    p.set_defaults(func=cmd_server)
    p = sub.add_parser("worker", help="run a worker task of a built-in job (same as zmqps-worker)")
    _worker_parser(p)
    p.set_defaults(func=cmd_worker)
    p = sub.add_parser("top", help="live view of a running cluster, from its /metrics endpoints")
    p.add_argument(
        "targets",
        nargs="+",
        metavar="URL|FILE",
        help="/metrics URLs, or the file_sd JSON of zmqps launch --prometheus-targets",
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between redraws")
    p.add_argument(
        "--iterations", type=int, default=0, help="stop after N redraws (default: run until Ctrl-C)"
    )
    p.set_defaults(func=cmd_top)
    p = sub.add_parser("inspect", help="list and verify the checkpoints in a checkpoint root")
    add_inspect_args(p)
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("status", help="show a running cluster's state, from its chief")
    p.add_argument("--chief", required=True, metavar="HOST:PORT", help="the chief's address")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the chief (default: 5)"
    )
    add_security_args(p)
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("keygen", help="make CurveZMQ keys for a cluster (then run it with --keys)")
    p.add_argument("dir", metavar="DIR", help="folder for the keys (created mode 0700)")
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="one client pair per worker task (worker0 .. workerN-1) instead of one"
        " shared by every worker",
    )
    p.add_argument("--force", action="store_true", help="replace existing key files")
    p.set_defaults(func=cmd_keygen)
    p = sub.add_parser("predict", help="run an exported model on a file of examples")
    add_predict_args(p)
    p.set_defaults(func=cmd_predict)
    p = sub.add_parser("bench", help="benchmarks: zmqps vs raw pyzmq vs torch RPC (BENCHMARKS.md)")
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)
    return parser


def _run(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    setup_logging(getattr(args, "verbose", 0), getattr(args, "quiet", False))
    if getattr(args, "parent_pid", None):
        exit_with_parent(args.parent_pid)
    try:
        return func(args)
    except ConfigError as exc:
        print(f"zmqps: error: {exc}", file=sys.stderr)
        return 2
    except (ZmqpsError, OSError) as exc:
        if getattr(args, "verbose", 0):
            raise
        print(f"zmqps: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    args = _build().parse_args(argv)
    return _run(args.func, args)


def _single(
    prog: str,
    build: Callable[[argparse.ArgumentParser], None],
    func: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None,
) -> int:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument(
        "-v", "--verbose", action="count", default=0, help="debug logging and tracebacks"
    )
    build(p)
    args = p.parse_args(argv)
    return _run(func, args)


def server_main(argv: Sequence[str] | None = None) -> int:
    return _single("zmqps-server", _server_parser, cmd_server, argv)


def worker_main(argv: Sequence[str] | None = None) -> int:
    return _single("zmqps-worker", _worker_parser, cmd_worker, argv)


def _entry(fn: Callable[[], int]) -> Any:
    raise SystemExit(fn())


if __name__ == "__main__":
    _entry(main)
