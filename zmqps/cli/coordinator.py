"""Command-line flags of coordinator mode (workers as function servers, the chief as
the driver); :mod:`zmqps.cli.tasks` turns them into the tasks' configurations."""

from __future__ import annotations

import argparse
import importlib.util

from zmqps.cli.tasks import DEFAULT_JOB
from zmqps.wire.errors import ConfigError

__all__ = [
    "DEFAULT_JOB",
    "add_driver_args",
    "add_launch_driver_args",
    "add_serve_args",
    "check_driver",
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


def check_driver(args: argparse.Namespace) -> None:
    """The chief's coordinator flags: ``--job`` and ``--steps-per-execution`` only with
    ``--driver coordinator`` (else they were ignored: a run said done with the built-in
    loop, the module named never run), and its job module there to import (it was
    found missing by the tasks, after the cluster started)."""
    if getattr(args, "driver", "worker") != "coordinator":
        if getattr(args, "job", None):
            raise ConfigError(
                "--job applies only to --driver coordinator (the module whose drive() the"
                " chief runs); without it the workers run the built-in training loop"
            )
        if getattr(args, "steps_per_execution", 1) != 1:
            raise ConfigError("--steps-per-execution applies only to --driver coordinator")
        return
    find_job_module(args.job or DEFAULT_JOB)
    if (args.job or DEFAULT_JOB) == DEFAULT_JOB and getattr(args, "model", None) == "ctr":
        # (its drive() failed on the dataset after the cluster started, 2 minutes later)
        raise ConfigError(
            f"--driver coordinator's built-in job ({DEFAULT_JOB}) trains the dense models"
            " (--model mlp, softmax): --model ctr trains with the workers' own loop"
            " (--driver worker), or with a --job module of yours"
        )


def find_job_module(name: str) -> None:
    """ConfigError unless module ``name`` can be found (it is not run here: the tasks
    import it, as :func:`zmqps.coordinator.server.load_job_module` says)."""
    if not name or not all(p.isidentifier() for p in name.split(".")):
        raise ConfigError(f"--job {name!r}: expected a module path like package.module")
    try:
        found = importlib.util.find_spec(name)
    except ImportError as exc:  # a package on the way is missing, or fails to import
        raise ConfigError(f"--job {name}: cannot import it ({exc})") from None
    if found is None:
        raise ConfigError(f"--job {name}: cannot import it (No module named {name!r})")


def check_launch(args: argparse.Namespace) -> None:
    check_driver(args)
    if getattr(args, "driver", "worker") != "coordinator":
        return
    if args.mode != "async":
        raise ConfigError("--driver coordinator trains asynchronously (--mode async)")
    if args.steps_per_execution < 1:
        raise ConfigError("--steps-per-execution must be >= 1")
