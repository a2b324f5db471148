"""Command-line flags of coordinator mode (workers as function servers, the chief as
the driver) and the two entry points they lead to."""

from __future__ import annotations

import argparse
from typing import Any

from zmqps.wire.errors import ConfigError

__all__ = [
    "DEFAULT_JOB",
    "add_driver_args",
    "add_launch_driver_args",
    "add_serve_args",
    "launch_flags",
    "run_driver",
    "serve",
]

#: The built-in demo job module (the digits MLP).
DEFAULT_JOB = "zmqps.coordinator.digits"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("coordinator mode (worker)")
    g.add_argument(
        "--serve",
        action="store_true",
        help="serve functions scheduled by the chief's coordinator instead of running the"
        " built-in training loop",
    )
    g.add_argument(
        "--job",
        metavar="PACKAGE.MODULE",
        help=f"the module whose functions --serve runs, by name (default: {DEFAULT_JOB})",
    )


def add_driver_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("coordinator mode (chief)")
    g.add_argument(
        "--driver",
        choices=("worker", "coordinator"),
        default="worker",
        help="worker: workers run their own training loop (default); coordinator: this"
        " chief runs the job module's drive() and schedules functions onto workers"
        " started with --serve",
    )
    g.add_argument(
        "--job",
        metavar="PACKAGE.MODULE",
        help=f"(--driver coordinator) the job module with drive() (default: {DEFAULT_JOB})",
    )
    g.add_argument(
        "--steps-per-execution",
        type=int,
        default=1,
        metavar="N",
        help="(--driver coordinator) training steps packed into one scheduled function"
        " (default: 1)",
    )


def add_launch_driver_args(p: argparse.ArgumentParser) -> None:
    add_driver_args(p)


def launch_flags(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The flags of the chief and of every worker for ``zmqps launch --driver ...``."""
    if getattr(args, "driver", "worker") != "coordinator":
        return [], []
    job = args.job or DEFAULT_JOB
    chief = ["--driver", "coordinator", "--job", job]
    chief += ["--steps-per-execution", str(args.steps_per_execution)]
    return chief, ["--serve", "--job", job]


def check_launch(args: argparse.Namespace) -> None:
    if getattr(args, "driver", "worker") != "coordinator":
        return
    if args.mode != "async":
        raise ConfigError("--driver coordinator trains asynchronously (--mode async)")
    if args.steps_per_execution < 1:
        raise ConfigError("--steps-per-execution must be >= 1")


def run_driver(cfg: Any, args: argparse.Namespace, options: Any) -> int:
    from zmqps.coordinator.driver import run_chief_driver

    return run_chief_driver(
        cfg,
        args.job or DEFAULT_JOB,
        steps_per_execution=args.steps_per_execution,
        options=options,
    )


def serve(args: argparse.Namespace, cluster: Any, task: Any, options: Any, metrics: Any) -> int:
    from zmqps.cli.args import job_from_args
    from zmqps.coordinator.serve import run_function_server

    return run_function_server(
        cluster,
        task,
        args.job or DEFAULT_JOB,
        job=job_from_args(args),
        options=options,
        metrics=metrics,
        connect_timeout=args.connect_timeout,
        shared_memory=args.shared_memory,
    )
