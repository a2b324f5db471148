"""Command-line arguments shared by the commands, turned into frozen configs once."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import math
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

from zmqps.config import (  # bind_address is re-exported: it moved to zmqps.config
    KEYS_ENV,
    ClusterSpec,
    Resolution,
    TaskSpec,
    bind_address,
    keys_dir,
    resolve_source,
    seal_bulk,
)
from zmqps.core.lowp import WIRE_DTYPES
from zmqps.core.partition import Partitioner
from zmqps.core.sync import MODES
from zmqps.data import CLASSES, DATASETS, FEATURES
from zmqps.data.ctr import CTR_DATASETS
from zmqps.device import Device
from zmqps.logs import OneLineFormatter
from zmqps.models import MODELS
from zmqps.process import exit_with_parent  # re-exported: it moved to zmqps.process
from zmqps.roles.configs import (
    NONFINITE_POLICIES,
    STALL_TIMEOUT_S,
    CheckpointPolicy,
    SyncConfig,
)
from zmqps.roles.job import JobConfig
from zmqps.slurm import DEFAULT_PORT_BASE
from zmqps.transport import SocketOptions, load_keys
from zmqps.wire.errors import ConfigError

__all__ = [
    "MIN_HEARTBEAT_TIMEOUT_S",
    "add_cluster_args",
    "add_elastic_arg",
    "add_evaluator_args",
    "add_job_args",
    "add_metrics_args",
    "add_nonfinite_args",
    "add_replication_arg",
    "add_security_args",
    "add_server_args",
    "add_stall_timeout_arg",
    "add_sync_args",
    "add_wire_dtype_arg",
    "bind_address",
    "check_heartbeat_timeout",
    "check_output_dir",
    "checkpoint_policy_from_args",
    "cluster_and_task",
    "exit_with_parent",
    "job_from_args",
    "metrics_port",
    "on_nonfinite_from_args",
    "optimizer_from_args",
    "partitioner_from_args",
    "resolution",
    "setup_logging",
    "socket_options",
    "sync_from_args",
    "wire_dtype_from_args",
]

OPTIMIZERS = ("sgd", "momentum", "adagrad", "adam", "ftrl")
#: ssp: how many steps a worker may run ahead of the slowest, when not given
MAX_STALENESS = 2


def drop_stdout() -> None:
    """Point stdout at /dev/null: its reader is gone (``zmqps ... | head``), and the
    interpreter's last flush must not fail on the pipe again."""
    with contextlib.suppress(OSError, ValueError):  # no file descriptor (captured output)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def setup_logging(verbose: int = 0, quiet: bool = False) -> None:
    level = logging.WARNING if quiet else (logging.DEBUG if verbose else logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        OneLineFormatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    )
    logging.basicConfig(level=level, handlers=[handler])


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (flags win over the TF_CONFIG environment variable)")
    g.add_argument(
        "--cluster",
        metavar="FILE|JSON",
        help="cluster spec: a TF_CONFIG-shaped JSON object or file",
    )
    g.add_argument(
        "--ps-hosts", "--ps_hosts", metavar="H:P,...", help="comma-separated PS addresses"
    )
    g.add_argument(
        "--worker-hosts",
        "--worker_hosts",
        metavar="H:P,...",
        help="comma-separated worker addresses",
    )
    g.add_argument("--chief-host", "--chief_host", metavar="H:P", help="the chief's address")
    g.add_argument("--evaluator-hosts", metavar="H:P,...", help=argparse.SUPPRESS)
    g.add_argument(
        "--role", "--job-name", "--job_name", dest="role", help="chief, ps, worker or evaluator"
    )
    g.add_argument(
        "--index",
        "--task-id",
        "--task_id",
        "--task-index",
        "--task_index",
        dest="index",
        type=int,
        help="task index within its role",
    )
    g.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    g = p.add_argument_group(
        "Slurm (used when no flag above and no TF_CONFIG give the cluster, in a task that"
        " srun started: ranks are the chief, then the evaluator, the PS, the workers)"
    )
    g.add_argument(
        "--ps",
        type=int,
        default=None,
        metavar="N",
        help="number of PS tasks (default: 1); the ranks after the chief, evaluator and PS"
        " are the workers",
    )
    g.add_argument(
        "--chief", type=int, default=None, metavar="N", help="number of chief tasks: 1 (default)"
    )
    g.add_argument(
        "--evaluators",
        type=int,
        default=None,
        metavar="N",
        help="number of evaluator tasks: 0 (default) or 1",
    )
    g.add_argument(
        "--port-base",
        type=int,
        default=DEFAULT_PORT_BASE,
        metavar="PORT",
        help=f"first port on each node; a node's tasks use PORT, PORT+1, ..."
        f" (default: {DEFAULT_PORT_BASE})",
    )


def add_job_args(
    p: argparse.ArgumentParser, *, model_default: str | None = "mlp", worker: bool = False
) -> None:
    g = p.add_argument_group("job")
    g.add_argument(
        "--mode",
        choices=MODES,
        # a worker follows the chief's mode: given, it is only compared with it
        default=None if worker else "async",
        help="consistency model: async, sync (SyncReplicas) or ssp (bounded staleness);"
        " set on the chief, workers follow it"
        + (
            " (a worker given another one says so in the chief's log) (default: the chief's)"
            if worker
            else " (default: async)"
        ),
    )
    g.add_argument(
        "--model",
        choices=(*MODELS, "ctr", "none"),
        default=model_default,
        help=f"built-in model; ctr: wide-and-deep click-through rate over hash-keyed"
        f" embedding tables (default: {model_default or 'none'})",
    )
    g.add_argument(
        "--dataset",
        choices=(*DATASETS, *CTR_DATASETS),
        default=None,
        help="built-in dataset (default: digits; synthetic-ctr for --model ctr; criteo reads"
        " DATA_DIR/train.txt)",
    )
    g.add_argument(
        "--examples",
        type=int,
        default=100_000,
        help="--dataset synthetic-ctr: training examples (default: 100000)",
    )
    g.add_argument("--data-dir", help="folder with the MNIST IDX files (for --dataset mnist)")
    g.add_argument(
        "--hidden", default="128", help="MLP hidden layer sizes, comma-separated (default: 128)"
    )
    g.add_argument(
        "--batch-size",
        type=int,
        help="examples per worker step (default: 32; 256 for --model ctr)",
    )
    g.add_argument(
        "--epochs",
        type=int,
        help="passes of each worker over its data (default: 20; 2 for --model ctr)",
    )
    g.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=None,
        help="server-side optimizer (default: momentum; adam for --model ctr's dense tower)",
    )
    g.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate (default: 0.05; adam 0.001, 0.003 for ctr; adagrad, ftrl 0.1)",
    )
    g.add_argument("--momentum", type=float, default=0.9, help="momentum (default: 0.9)")
    g.add_argument(
        "--seed", type=int, default=0, help="seed of initializers and data order (default: 0)"
    )
    g.add_argument(
        "--log-every", type=int, default=50, help="log a training line every N steps (default: 50)"
    )


def add_sync_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sync / ssp (chief)")
    g.add_argument(
        "--replicas-to-aggregate",
        type=int,
        metavar="N",
        help="sync: gradients averaged per step (default: --total-replicas)",
    )
    g.add_argument(
        "--total-replicas",
        type=int,
        metavar="M",
        help="sync: replicas computing each step; M > N gives backup workers"
        " (default: number of workers)",
    )
    g.add_argument(
        "--init-tokens",
        type=int,
        default=0,
        metavar="K",
        help="sync: extra tokens of step 0 so workers can run ahead (default: 0)",
    )
    g.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        metavar="S",
        help="ssp: how many steps (>= 0) a worker may run ahead of the slowest; only with"
        f" --mode ssp (default: {MAX_STALENESS})",
    )


def add_stall_timeout_arg(g: Any, *, role: str = "") -> None:
    """``--stall-timeout S`` (the chief's, and ``zmqps launch``'s)."""
    g.add_argument(
        "--stall-timeout",
        type=seconds,
        default=STALL_TIMEOUT_S,
        metavar="S",
        help=f"{role}a run whose training stands still this many seconds (a step waiting on"
        " a worker that never comes back or never pushes it, workers never started, a PS"
        " that is never restarted) ends failed (exit code 3) with what it waited on; set"
        " it above your longest step; 0: wait for ever"
        f" (default: {STALL_TIMEOUT_S:g})",
    )


def seconds(text: str) -> float:
    """A duration flag: a finite number of seconds, >= 0 (``nan``, ``inf`` and negative
    values made waits without a limit, or said "within -1s")."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number of seconds >= 0")
    return value


def positive_seconds(text: str) -> float:
    """A duration flag that must be more than 0 (a wait of none would fail at once): a
    finite number of seconds > 0, one message for 0 and negative values alike (0 was
    said "must be > 0" and -5 "expected ... >= 0")."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number of seconds > 0")
    return value


def parse_bytes(text: str) -> int:
    """A size: an integer of bytes, or with K, M, G (powers of 1,024), e.g. ``512M``."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or e.g. 512M, 2G)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def add_elastic_arg(g: Any, *, role: str = "") -> None:
    """``--add-ps-above BYTES`` (the chief's, and ``zmqps launch``'s)."""
    g.add_argument(
        "--add-ps-above",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help=f"{role}when a PS serves more than this many bytes of shards (values, slots,"
        " hash-table rows; e.g. 512M), ask for the next PS of the cluster spec and move"
        " states onto it (zmqps launch starts it; elsewhere, start it yourself)"
        " (default: never)",
    )


def add_replication_arg(g: Any, *, role: str = "") -> None:
    """``--replication R`` (the chief's, and ``zmqps launch``'s)."""
    g.add_argument(
        "--replication",
        type=int,
        default=1,
        metavar="R",
        help=f"{role}copies of every PS's state, each on another PS (at most the number of PS):"
        " with 2 or more, a PS that dies is replaced by a copy within the heartbeat timeout,"
        " without a restore; 1: none, a PS death restores the last checkpoint (default: 1)",
    )


def add_wire_dtype_arg(g: Any, *, role: str = "") -> None:
    """``--wire-dtype`` (the chief's, and ``zmqps launch``'s)."""
    g.add_argument(
        "--wire-dtype",
        choices=("float32", *sorted(WIRE_DTYPES)),
        default="float32",
        help=f"{role}what dense float32 variables travel as between workers and PS:"
        " bfloat16 halves the bytes of every pull and push (values rounded to nearest;"
        " the PS keep float32 values and optimizer slots, and update in float32)"
        " (default: float32)",
    )


def wire_dtype_from_args(args: argparse.Namespace) -> str | None:
    """The chief's ``wire_dtype`` from ``--wire-dtype`` (float32: None, as they are)."""
    wire = getattr(args, "wire_dtype", "float32")
    return None if wire == "float32" else str(wire)


def add_nonfinite_args(
    p: argparse.ArgumentParser, *, worker: bool = True, chief: bool = True
) -> None:
    """``--on-nonfinite`` (workers) and ``--max-nonfinite-share`` (the chief)."""
    g = p.add_argument_group("non-finite values (a NaN or infinity in a loss or gradient)")
    if worker:
        default = "skip; stop with --max-nonfinite-share 0" if chief else "skip"
        g.add_argument(
            "--on-nonfinite",
            choices=NONFINITE_POLICIES,
            default=None,
            help="a step whose gradient is not finite (the PS refuse it, nothing is applied):"
            " skip it and log it (at most one line per 10 s), skip it silently, or stop the"
            f" run at the first one (exit code 3) (default: {default})",
        )
    if chief:
        g.add_argument(
            "--max-nonfinite-share",
            type=float,
            default=0.05,
            metavar="F",
            help="the run fails (exit code 3, after its final checkpoint) when more than this"
            " share of the workers' steps had non-finite gradients; 0: the first one stops"
            " it (default: 0.05)",
        )


def on_nonfinite_from_args(args: argparse.Namespace) -> str:
    """The workers' policy: as given, else ``stop`` when no share is allowed, else ``skip``."""
    given: str | None = getattr(args, "on_nonfinite", None)
    if given is not None:
        return given
    return "stop" if getattr(args, "max_nonfinite_share", None) == 0 else "skip"


def sync_from_args(args: argparse.Namespace) -> SyncConfig:
    """The sync settings of the flags, checked; ``--max-staleness`` is refused
    outside ``--mode ssp`` (it would do nothing)."""
    staleness: int | None = args.max_staleness
    if staleness is not None and args.mode != "ssp":
        raise ConfigError(f"--max-staleness applies only to --mode ssp (this run is {args.mode})")
    return SyncConfig(
        mode=args.mode,
        replicas_to_aggregate=args.replicas_to_aggregate,
        total_replicas=args.total_replicas,
        init_tokens=args.init_tokens,
        max_staleness=MAX_STALENESS if staleness is None else staleness,
    )


def checkpoint_policy_from_args(
    args: argparse.Namespace,
    directory: str | None,
    *,
    default_secs: float,
    needs: str = "--checkpoint-dir",
) -> CheckpointPolicy | None:
    """The checkpoint policy of ``--checkpoint-steps`` / ``--checkpoint-secs`` /
    ``--keep-checkpoints`` (``zmqps-server``'s chief and ``zmqps launch``), or None
    when ``directory`` is None (no checkpoints: an interval given anyway is refused,
    it ``needs`` what is missing). Steps and seconds, when given, must be positive
    (none is "off" here: a run without checkpoints has no ``--checkpoint-dir``, or
    ``zmqps launch --no-checkpoints``); neither given: every ``default_secs`` seconds."""
    steps: int | None = args.checkpoint_steps
    secs: float | None = args.checkpoint_secs
    keep: int = args.keep_checkpoints
    if steps is not None and steps < 1:
        raise ConfigError(f"--checkpoint-steps must be >= 1, got {steps}")
    if secs is not None and not secs > 0:
        raise ConfigError(f"--checkpoint-secs must be > 0, got {secs:g}")
    if keep < 1:
        raise ConfigError(f"--keep-checkpoints must be >= 1, got {keep}")
    if directory is None:
        if steps is not None or secs is not None:
            raise ConfigError(f"--checkpoint-steps / --checkpoint-secs need {needs}")
        return None
    if secs is None:
        secs = 0.0 if steps is not None else default_secs
    return CheckpointPolicy(directory, steps or 0, secs, keep)


#: the shortest ``--heartbeat-timeout``: two of the heartbeats workers send each
#: second (``ChiefConfig.heartbeat_interval``); a shorter one counted live workers dead
#: between two of them (0.1 s: both workers of a digits run dead as they registered, one
#: left for want of word from the chief, the run took 18 s instead of 5)
MIN_HEARTBEAT_TIMEOUT_S = 2.0


def check_heartbeat_timeout(seconds: float) -> None:
    if not seconds >= MIN_HEARTBEAT_TIMEOUT_S:  # (NaN too)
        raise ConfigError(
            f"--heartbeat-timeout must be at least {MIN_HEARTBEAT_TIMEOUT_S:g} s, got"
            f" {seconds:g} (workers send a heartbeat each second: a shorter timeout counts"
            " live workers dead)"
        )


def check_output_dir(flag: str, path: str | os.PathLike[str] | None, *, keep: bool = False) -> None:
    """``path`` (the folder of ``flag``) can be created and written in, checked
    before anything starts: a :class:`ConfigError` naming the flag, the path and
    the system's reason otherwise. What this creates to find out is removed again
    (a folder that appears would look like an earlier run's), unless ``keep``: a task
    started by hand keeps it, since the tasks of a run check their shared folders at
    once (one's removal must not make another's check fail)."""
    if path is None:
        return
    target = os.path.abspath(path)
    if os.path.lexists(target) and not os.path.isdir(target):
        raise ConfigError(f"{flag} {path}: cannot create it (a file of that name is in the way)")
    missing = []
    parent = target
    while not keep and not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    try:
        os.makedirs(target, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot create it ({exc.strerror})") from None
    finally:
        for made in missing:  # deepest first
            with contextlib.suppress(OSError):
                os.rmdir(made)
    if not missing and not os.access(target, os.W_OK | os.X_OK):  # (kept: made or not)
        raise ConfigError(f"{flag} {path}: cannot write in it (Permission denied)")


def check_output_file(
    flag: str, path: str | os.PathLike[str] | None, *, keep: bool = False
) -> None:
    """``path`` (the file of ``flag``, written at the end of a run) can be written,
    checked before anything starts: a run that trained for an hour must not fail at
    its last line on a path that was never a file's."""
    if path is None:
        return
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise ConfigError(f"{flag} {path}: that is a folder (name the file to write)")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):  # made when the file is written: it must be possible
        check_output_dir(flag, parent, keep=keep)
        return
    # tried, not judged by its modes: root may write anywhere by them, yet not in /proc
    # (`--summary /proc/x.json` failed only after the whole run had trained)
    try:
        if os.path.exists(target):
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND))  # changes nothing
        else:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(target)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot write it ({exc.strerror or exc})") from None


def add_metrics_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("metrics (Prometheus)")
    g.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics; 0 picks a free port"
        " (logged at start); omitted or -1: no metrics endpoint (default)",
    )
    g.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address the metrics endpoint binds (default: 127.0.0.1, this host only)",
    )
    g.add_argument(
        "--logdir",
        metavar="DIR",
        help="TensorBoard: write this task's scalars (loss, rates, staleness, token wait,"
        " evaluations) against the global step into DIR/<task> (chief, worker0, ...,"
        " evaluator); a PS writes none. Watch with: tensorboard --logdir DIR",
    )


def add_security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security (CurveZMQ)")
    g.add_argument(
        "--keys",
        metavar="DIR",
        help="CURVE keys folder made by zmqps keygen: every socket is encrypted and"
        " servers accept only the clients in DIR/allowed (default: the"
        f" {KEYS_ENV} environment variable; neither: plaintext)",
    )


def socket_options(
    args: argparse.Namespace, role: str, index: int | None, *, serve: bool, connect: bool
) -> SocketOptions | None:
    """The SocketOptions of a task: with its CURVE keys when ``--keys`` / ZMQPS_KEYS
    names a folder, else None (plaintext defaults)."""
    folder = keys_dir(getattr(args, "keys", None))
    if folder is None:
        return None
    return SocketOptions(
        curve=load_keys(folder, role, index, serve=serve, connect=connect), seal=seal_bulk()
    )


def add_evaluator_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("evaluator (--role evaluator)")
    g.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="evaluate each new committed checkpoint in DIR (default: pull snapshots"
        " from the PS when the global step moved)",
    )
    g.add_argument(
        "--eval-interval",
        type=seconds,
        default=2.0,
        metavar="S",
        help="seconds between evaluations, at most one per interval (default: 2)",
    )
    g.add_argument("--eval-log", metavar="FILE", help="append one JSON line per evaluation to FILE")
    g.add_argument(
        "--chief-timeout",
        type=seconds,
        metavar="S",
        help="a chief that has not answered for S seconds (before the run's end) is gone for"
        " good: a worker ends its step and stops, an evaluator stops, both with exit code 1"
        " (default: 60 for a worker, 30 for an evaluator; 0: never)",
    )
    g.add_argument(
        "--eval-idle-timeout",
        type=seconds,
        default=30.0,
        metavar="S",
        help="an evaluator with no chief in its cluster (checkpoints only) ends when no new"
        " checkpoint appeared for S seconds, or after a run's final one (default: 30)",
    )


def add_device_args(p: argparse.ArgumentParser, *, launch: bool = False) -> None:
    who = "every worker computes" if launch else "this worker computes"
    g = p.add_argument_group("device")
    g.add_argument(
        "--device",
        default="cpu",
        metavar="DEV",
        help=f"where {who}: cpu, cuda or cuda:N (cupy: pip install 'zmqps[gpu]')"
        + (
            "; cuda spreads the workers over the visible GPUs, cuda:N puts them all on GPU N"
            if launch
            else ""
        )
        + " (default: cpu)",
    )
    if launch:
        g.add_argument(
            "--gpus-per-worker",
            type=int,
            default=1,
            metavar="K",
            help="with --device cuda: K towers per worker, one per GPU (worker i on GPUs"
            " i*K .. i*K+K-1, wrapping around the visible GPUs; a GPU may hold several"
            " towers); --batch-size is each tower's (default: 1)",
        )
    else:
        g.add_argument(
            "--devices",
            metavar="DEV,DEV,...",
            help="towers: compute each step on these devices (e.g. cuda:0,cuda:1), each"
            " on --batch-size examples, gradients averaged on the first before one push"
            " (default: --device alone)",
        )
    g.add_argument(
        "--prefetch",
        action="store_true",
        help="async: pull the next step's values when a step begins, overlapping the whole"
        " step (they lack the worker's own last gradient: one more step of staleness);"
        " default: each layer's push brings its fresh values back",
    )


def worker_devices(device: str, gpus_per_worker: int, index: int, visible: int) -> str:
    """The devices of launched worker ``index`` (comma-separated): ``cuda`` spreads
    the workers and their ``gpus_per_worker`` towers over ``visible`` GPUs in turn;
    ``cuda:N`` and ``cpu`` are every worker's (towers: N, K times)."""
    if gpus_per_worker < 1:
        raise ConfigError(f"--gpus-per-worker must be >= 1, got {gpus_per_worker}")
    spec = Device.parse(device)
    if gpus_per_worker > 1 and not spec.is_cuda:
        raise ConfigError("--gpus-per-worker needs --device cuda (towers are GPUs)")
    if spec.is_cuda and device.strip().lower() == "cuda":
        first = index * gpus_per_worker
        gpus = [(first + k) % max(1, visible) for k in range(gpus_per_worker)]
    else:
        gpus = [spec.index] * gpus_per_worker
    return ",".join(str(spec) if not spec.is_cuda else f"cuda:{g}" for g in gpus)


def metrics_port(args: argparse.Namespace) -> int | None:
    """The --metrics-port to serve on, or None (no endpoint)."""
    port: int | None = args.metrics_port
    if port is None or port < 0:
        return None
    if port > 65535:
        raise ConfigError(f"--metrics-port must be at most 65535, got {port}")
    return port


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument(
        "--bind",
        help="address to bind (default: the task's own address; all interfaces for host names)",
    )
    g.add_argument("--num-shards", type=int, help="fixed number of shards per variable")
    g.add_argument(
        "--min-shard-bytes",
        type=int,
        default=256 * 1024,
        help="minimum shard size (default: 256 KiB)",
    )
    g.add_argument(
        "--max-shard-bytes", type=int, default=64 << 20, help="maximum shard size (default: 64 MiB)"
    )
    g.add_argument(
        "--placement",
        choices=("round_robin", "greedy"),
        default="round_robin",
        help="(chief) shard placement on the PS tasks: round_robin (shard i on PS i mod N)"
        " or greedy (largest shard first onto the least-loaded PS) (default: round_robin)",
    )
    add_replication_arg(g, role="(chief) ")
    add_wire_dtype_arg(g, role="(chief) ")
    add_stall_timeout_arg(g, role="(chief) ")
    add_elastic_arg(g, role="(chief) ")
    g.add_argument(
        "--heartbeat-timeout",
        type=seconds,
        default=10.0,
        metavar="S",
        help="(chief) seconds without a heartbeat before a worker counts as dead (default: 10)",
    )
    g.add_argument(
        "--startup-timeout",
        type=seconds,
        default=120.0,
        help="seconds to wait for peers at start (default: 120)",
    )
    g.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="checkpoint root shared by the chief and every PS (PS write their shards"
        " there, the chief commits; on start the latest checkpoint is restored)",
    )
    g.add_argument(
        "--checkpoint-steps",
        type=int,
        default=None,
        metavar="N",
        help="(chief) checkpoint every N >= 1 global steps, with --checkpoint-dir"
        " (default: not by steps)",
    )
    g.add_argument(
        "--checkpoint-secs",
        type=seconds,
        default=None,
        metavar="S",
        help="(chief) checkpoint every S > 0 seconds, with --checkpoint-dir (default: 600"
        " unless --checkpoint-steps is given; no --checkpoint-dir: no checkpoints)",
    )
    g.add_argument(
        "--keep-checkpoints",
        type=int,
        default=5,
        metavar="K",
        help="(chief) keep the last K >= 1 checkpoints, delete older ones (default: 5)",
    )
    g.add_argument(
        "--export-dir",
        metavar="DIR",
        help="(chief) export the final model here (built-in jobs; see zmqps predict)",
    )
    g.add_argument("--summary", help="(chief) write the end-of-training summary JSON here")
    g.add_argument(
        "--keep-alive", action="store_true", help="(chief) keep serving after training ends"
    )


def cluster_and_task(
    args: argparse.Namespace,
    *,
    default_role: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[ClusterSpec, TaskSpec]:
    """This task's cluster and task from its flags, else ``TF_CONFIG``, else Slurm's
    variables in ``environ`` (default: this process' environment)."""
    got = resolution(args, default_role=default_role, environ=environ)
    return got.cluster, got.task


def resolution(
    args: argparse.Namespace,
    *,
    default_role: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Resolution:
    """:func:`cluster_and_task` with the source it came from (``zmqps cluster``)."""
    counts = {
        role: n
        for role, n in (
            ("chief", args.chief),
            ("ps", 1 if args.ps is None else args.ps),
            ("evaluator", args.evaluators),
        )
        if n is not None
    }
    return resolve_source(
        args.cluster,
        args.ps_hosts,
        args.worker_hosts,
        args.chief_host,
        args.evaluator_hosts,
        args.role,
        args.index,
        environ,
        default_role=default_role,
        slurm_counts=counts,
        port_base=args.port_base,
    )


def optimizer_from_args(args: argparse.Namespace) -> dict[str, Any]:
    ctr = getattr(args, "model", None) == "ctr"
    name = args.optimizer or ("adam" if ctr else "momentum")
    default_lr = {"sgd": 0.1, "momentum": 0.05, "adagrad": 0.1, "adam": 0.001, "ftrl": 0.1}[name]
    if ctr and name == "adam":
        default_lr = 0.003
    opt: dict[str, Any] = {"name": name, "lr": default_lr if args.lr is None else args.lr}
    if name == "momentum":
        opt["momentum"] = args.momentum
    return opt


def _hidden(text: str) -> tuple[int, ...]:
    try:  # every part a size: "128,,64" is a typo, not two layers
        sizes = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise ConfigError(f"--hidden {text!r}: expected sizes like 128 or 256,128") from None
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--hidden {text!r}: sizes must be positive")
    return sizes


def _check_mlp_size(job: JobConfig) -> None:
    """The built-in MLP's weights at most :data:`MAX_MLP_WEIGHTS`: a size mistyped by a
    few digits is a clear error, not tasks that run out of memory."""
    sizes = (FEATURES.get(job.dataset, 0), *job.hidden, CLASSES)
    weights = sum(a * b for a, b in itertools.pairwise(sizes))
    if weights > MAX_MLP_WEIGHTS:
        raise ConfigError(
            f"--hidden {','.join(map(str, job.hidden))} on {job.dataset}: about"
            f" {weights / 1e6:,.0f} million weights ({weights * 4 / 2**30:,.1f} GiB of"
            " float32 on the PS and on each worker); the built-in MLP takes at most"
            f" {MAX_MLP_WEIGHTS / 1e6:,.0f} million"
        )


#: the built-in MLP's weights at most (1 GiB of float32)
MAX_MLP_WEIGHTS = 2**28


#: the built-in jobs' defaults: digits MLP / softmax, and the CTR model
BATCH_SIZE, EPOCHS = 32, 20
CTR_BATCH_SIZE, CTR_EPOCHS = 256, 2


def _given(value: int | None, default: int) -> int:
    return default if value is None else value


def job_from_args(args: argparse.Namespace) -> JobConfig | None:
    """The job the flags describe, checked whole (its data set's files included)."""
    if args.model in (None, "none"):
        return None
    ctr = args.model == "ctr"
    job = JobConfig(
        model=args.model,
        dataset=args.dataset or ("synthetic-ctr" if ctr else "digits"),
        examples=args.examples,
        data_dir=args.data_dir,
        hidden=_hidden(args.hidden),
        # each model's defaults give its documented result quickly (README)
        batch_size=_given(args.batch_size, CTR_BATCH_SIZE if ctr else BATCH_SIZE),
        epochs=_given(args.epochs, CTR_EPOCHS if ctr else EPOCHS),
        optimizer=optimizer_from_args(args),
        seed=args.seed,
        log_every=args.log_every,
    )
    if job.model == "mlp":
        _check_mlp_size(job)
    job.check_data()
    return job


def partitioner_from_args(args: argparse.Namespace) -> Partitioner:
    """The chief's partitioner of ``--num-shards`` (and ``--min-shard-bytes`` /
    ``--max-shard-bytes`` where the command has them), checked."""
    given = {
        name: getattr(args, name)
        for name in ("num_shards", "min_shard_bytes", "max_shard_bytes")
        if hasattr(args, name)
    }
    for name, value in given.items():
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return Partitioner(**given)
