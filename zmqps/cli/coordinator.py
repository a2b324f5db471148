"""Command-line flags of coordinator mode (workers as function servers, the chief as
the driver); :mod:`zmqps.cli.tasks` turns them into the tasks' configurations."""

from __future__ import annotations

import argparse

from zmqps.cli.tasks import DEFAULT_JOB
from zmqps.wire.errors import ConfigError

__all__ = [
    "DEFAULT_JOB",
    "add_driver_args",
    "add_launch_driver_args",
    "add_serve_args",
    "check_launch",
]


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


def check_launch(args: argparse.Namespace) -> None:
    if getattr(args, "driver", "worker") != "coordinator":
        return
    if args.mode != "async":
        raise ConfigError("--driver coordinator trains asynchronously (--mode async)")
    if args.steps_per_execution < 1:
        raise ConfigError("--steps-per-execution must be >= 1")
