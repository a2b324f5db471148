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
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from zmqps.cli.args import (
    add_cluster_args,
    add_device_args,
    add_evaluator_args,
    add_job_args,
    add_metrics_args,
    add_nonfinite_args,
    add_security_args,
    add_server_args,
    add_sync_args,
    check_output_dir,
    drop_stdout,
    exit_with_parent,
    positive_seconds,
    resolution,
    seconds,
    setup_logging,
    socket_options,
)
from zmqps.cli.parser import Parser
from zmqps.cli.tasks import run_task, task_from_args
from zmqps.config import Resolution
from zmqps.device import DeviceError
from zmqps.wire.errors import EXIT_CONFIG, EXIT_RUN_FAILED, ConfigError, RunFailed, ZmqpsError

__all__ = ["main", "server_main", "worker_main"]

log = logging.getLogger("zmqps")


def _server_parser(p: argparse.ArgumentParser) -> None:
    from zmqps.cli.coordinator import add_driver_args

    add_cluster_args(p)
    add_job_args(p, model_default=None)
    add_server_args(p)
    add_sync_args(p)
    add_nonfinite_args(p, worker=False)
    add_metrics_args(p)
    add_security_args(p)
    add_driver_args(p)


def _worker_parser(p: argparse.ArgumentParser) -> None:
    from zmqps.cli.coordinator import add_serve_args

    add_serve_args(p)
    add_cluster_args(p)
    add_job_args(p, worker=True)
    add_device_args(p)
    add_nonfinite_args(p, chief=False)
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
        type=seconds,
        default=120.0,
        help="seconds to wait for the chief (default: 120)",
    )

    p.add_argument(
        "--stats",
        metavar="FILE",
        help="write this worker's step statistics (seconds per phase, overlap) as JSON",
    )


def _resolve(args: argparse.Namespace, default_role: str | None = None) -> Resolution:
    """This task's cluster, said in the log with where it came from; under Slurm,
    ``--metrics-port`` is the node's first one (each local task adds its place)."""
    res = resolution(args, default_role=default_role)
    task = f"{res.task.role} {res.task.index}"
    if res.source == "slurm":
        local = res.local_id or 0
        if args.metrics_port is not None and args.metrics_port > 0:  # -1: none, 0: any
            args.metrics_port += local
        log.info(
            "cluster from Slurm: rank %s is %s (local task %d on its node)%s",
            res.rank,
            task,
            local,
            f", metrics on port {args.metrics_port}"
            if args.metrics_port is not None and args.metrics_port > 0
            else "",
        )
    else:
        log.debug("cluster from %s: this is %s", res.source, task)
    if res.ignored:
        log.info(
            "cluster from %s; also set and ignored: %s (precedence: flags, TF_CONFIG, Slurm)",
            _SOURCE_NAMES[res.source],
            ", ".join(_SOURCE_NAMES[s] for s in res.ignored),
        )
    return res


#: How the log names each source of a cluster.
_SOURCE_NAMES = {"flags": "the flags", "tf_config": "TF_CONFIG", "slurm": "Slurm's SLURM_*"}


def cmd_server(args: argparse.Namespace) -> int:
    res = _resolve(args)
    cluster, task = res.cluster, res.task
    if task.role not in ("ps", "chief"):
        raise ConfigError(
            f"zmqps-server serves roles chief and ps, not {task.role!r} (use zmqps-worker)"
        )
    return run_task(task_from_args(args, cluster, task))


def cmd_worker(args: argparse.Namespace) -> int:
    res = _resolve(args, default_role="worker")
    cluster, task = res.cluster, res.task
    if task.role not in ("worker", "evaluator"):
        raise ConfigError(f"zmqps-worker runs roles worker and evaluator, not {task.role!r}")
    return run_task(task_from_args(args, cluster, task))


def cmd_cluster(args: argparse.Namespace) -> int:
    """``zmqps cluster``: the cluster and this task as resolved here, as JSON."""
    res = resolution(args)
    out: dict[str, Any] = {
        "cluster": res.cluster.to_dict(),
        "task": {"type": res.task.role, "index": res.task.index},
        "source": res.source,
    }
    if res.ignored:
        out["ignored"] = list(res.ignored)
    if res.rank is not None:
        out["slurm"] = {"rank": res.rank, "local_id": res.local_id}
    print(json.dumps(out, indent=None if args.compact else 2))
    return 0


def cmd_task(args: argparse.Namespace) -> int:
    """``zmqps task --config FILE``: run the task a launcher wrote as data."""
    from zmqps.roles.configs import loads

    try:
        text = Path(args.config).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--config: cannot read {args.config}: {e.strerror}") from None
    task = loads(text, source=args.config)
    if task.verbose or task.quiet:
        logging.getLogger().setLevel(
            logging.DEBUG if task.verbose else logging.WARNING if task.quiet else logging.INFO
        )
    return run_task(task)


def cmd_status(args: argparse.Namespace) -> int:
    from zmqps.config import KEYS_ENV
    from zmqps.roles.status import fetch_status, format_status
    from zmqps.wire.errors import DeadlineExceeded

    _chief_address(args)
    if ended := _ended(args):  # nothing to ask: said at once (it waited --timeout)
        print(f"zmqps status: {ended}", file=sys.stderr)
        return 1
    options = socket_options(args, "status", None, serve=False, connect=True)
    try:
        status = asyncio.run(fetch_status(args.chief, timeout=args.timeout, options=options))
    except DeadlineExceeded as exc:
        if args.run_dir is not None:
            raise _not_running(args, exc) from None
        if options is not None:
            raise
        # A CURVE server drops a plaintext client's handshake without a word: all a
        # client sees is silence, so this is a hint, not a diagnosis.
        raise DeadlineExceeded(
            f"{exc} (is the chief running? a cluster started with CURVE keys answers only"
            f" with them: pass --keys DIR or set {KEYS_ENV})"
        ) from None
    role = status.get("role")
    if role != "chief":  # a PS answers ``status`` too (its own, nothing of the run's)
        what = f"{role} {status.get('index', '')}".strip() if role else "not a chief"
        raise ConfigError(
            f"--chief {args.chief}: that is {what}, not the chief (pass the chief's address:"
            " the cluster spec's chief, --chief-host)"
        )
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(format_status(status))
    return 0


#: the most PS a ``zmqps scale`` may ask for (the wire's bound on ``Scale.ps``)
MAX_SCALE_PS = 1 << 20


def cmd_scale(args: argparse.Namespace) -> int:
    """``zmqps scale``: ask the chief to serve the PS states from the first N PS of the
    cluster spec (``--wait``: until the moves are done)."""
    from zmqps.roles.status import fetch_status, format_elastic
    from zmqps.wire.errors import DeadlineExceeded, InvalidArgument

    _chief_address(args)
    if ended := _ended(args):
        print(f"zmqps scale: {ended}", file=sys.stderr)
        return 1
    if args.ps is not None and not 1 <= args.ps <= MAX_SCALE_PS:
        # (one past 64 bits failed in the message's encoding, with a traceback)
        raise ConfigError(f"--ps must be between 1 and {MAX_SCALE_PS}, got {args.ps}")
    options = socket_options(args, "status", None, serve=False, connect=True)
    body = {} if args.ps is None else {"ps": args.ps}
    try:
        elastic = asyncio.run(fetch_status(args.chief, args.timeout, options, "scale", body))
    except DeadlineExceeded as exc:
        if args.run_dir is not None:
            raise _not_running(args, exc) from None
        raise
    except InvalidArgument as exc:
        # a count the chief cannot serve (more PS than the cluster spec names, fewer
        # than the copies asked for): an operator's mistake, as --ps 0 is (exit 2)
        raise ConfigError(str(exc)) from None
    deadline = time.monotonic() + args.wait
    while args.wait and not _scaled(elastic):
        if time.monotonic() > deadline:
            print(format_elastic(elastic))
            print(f"zmqps scale: the moves are not done after {args.wait:g}s", file=sys.stderr)
            return 1
        time.sleep(0.5)
        elastic = asyncio.run(fetch_status(args.chief, args.timeout, options, "scale", {}))
    print(json.dumps(elastic, indent=2) if args.json else format_elastic(elastic))
    return 0


def _scaled(elastic: dict[str, Any]) -> bool:
    """Every state on a process asked for, nothing moving or left to move, no process
    asked for that does not answer."""
    asked = elastic.get("asked")
    if asked is None:
        return not elastic.get("moving")
    settled = elastic.get("planned") == 0 and not elastic.get("waiting")
    on_asked = set(elastic.get("serving") or []) <= set(asked)
    return settled and on_asked and not elastic.get("moving")


def _chief_address(args: argparse.Namespace) -> None:
    """``args.chief`` checked, or read from ``--run-dir``'s chief task (with the launch's
    CURVE keys, unless ``--keys`` names others): one line when it cannot be."""
    from zmqps.config import split_address

    run_dir = getattr(args, "run_dir", None)
    if run_dir is not None:
        path = Path(run_dir) / "tasks" / "chief.json"
        try:
            task = json.loads(path.read_text())
            args.chief = str(task["chief"]["cluster"]["chief"])
            keys = task.get("keys")
        except FileNotFoundError:
            raise ConfigError(
                f"--run-dir {run_dir}: no zmqps launch run there (no {path}); pass the run's"
                " --run-dir, or the chief's address with --chief"
            ) from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not a chief task's configuration"
            raise ConfigError(f"--run-dir {run_dir}: cannot read {path}: {why}") from None
        if keys and not getattr(args, "keys", None):
            args.keys = str(keys)
        return
    try:
        split_address(args.chief)
    except ConfigError as exc:
        problem = str(exc).removeprefix("bad address: ")
        raise ConfigError(f"--chief: {problem} (expected HOST:PORT, e.g. 127.0.0.1:2222)") from None


def _ended(args: argparse.Namespace) -> str:
    """With ``--run-dir``: "the run in DIR has ended (its summary: ...)" when its chief
    wrote its summary after the launch wrote its task (the run is over: nothing to
    ask), else ''."""
    if getattr(args, "run_dir", None) is None:
        return ""
    run_dir = Path(args.run_dir)
    summary, task = run_dir / "chief-summary.json", run_dir / "tasks" / "chief.json"
    try:
        if summary.stat().st_mtime >= task.stat().st_mtime:
            return f"the run in {run_dir} has ended (its summary: {summary})"
    except OSError:
        pass
    return ""


def _not_running(args: argparse.Namespace, exc: ZmqpsError) -> ZmqpsError:
    """No reply from ``--run-dir``'s chief: what its folder says of the run (ended, with
    its summary; else stopped or gone), not a hint at CURVE keys it was not started with."""
    run_dir = Path(args.run_dir)
    if ended := _ended(args):
        return type(exc)(f"{exc}: {ended}")
    return type(exc)(
        f"{exc}: no chief answers for the run in {run_dir} (stopped, or its launch is gone:"
        f" its logs are there)"
    )


def _add_chief_query_args(p: argparse.ArgumentParser) -> None:
    """``--chief``, ``--json``, ``--timeout`` and the keys: a command that asks a running
    chief (``zmqps status``, ``zmqps scale``)."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--chief", metavar="HOST:PORT", help="the chief's address")
    where.add_argument(
        "--run-dir",
        metavar="DIR",
        help="a zmqps launch run's folder: its chief's address (and CURVE keys, --secure)"
        " as the launch wrote them in DIR/tasks",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--timeout",
        type=positive_seconds,
        default=5.0,
        help="seconds (> 0) to wait for the chief (default: 5)",
    )
    add_security_args(p)


def cmd_keygen(args: argparse.Namespace) -> int:
    from zmqps.transport.security import CLIENT_ROLES, keygen

    if args.workers is not None and args.workers < 1:
        raise ConfigError("--workers must be >= 1")
    check_output_dir("zmqps keygen", args.dir)
    clients = list(CLIENT_ROLES)
    if args.workers:
        clients.remove("worker")
        clients += [f"worker{i}" for i in range(args.workers)]
    written = keygen(args.dir, clients, force=args.force)
    print(
        f"zmqps keygen: {len(written)} key files in {args.dir}: server pair (chief and PS"
        f" need server.key_secret), client pairs {', '.join(clients)},"
        f" allow-list {Path(args.dir) / 'allowed'}; secret keys are mode 0600"
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


_VERBOSE_HELP = "debug logging and tracebacks"


def _common_args(p: argparse.ArgumentParser) -> None:
    """``-v`` and ``--version`` of a program (zmqps, zmqps-server, zmqps-worker)."""
    from zmqps.version import __version__

    p.add_argument("-v", "--verbose", action="count", default=0, help=_VERBOSE_HELP)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


def _sub(sub: Any, name: str, **kw: Any) -> argparse.ArgumentParser:
    """A subcommand's parser: no prefix matching (``--worker`` is not ``--workers``),
    and ``-v`` after the subcommand too. Its count has a dest of its own, added to the
    count given before the subcommand (the subparser's default would overwrite it)."""
    p: argparse.ArgumentParser = sub.add_parser(name, allow_abbrev=False, **kw)
    p.add_argument(
        "-v", "--verbose", action="count", default=0, dest="sub_verbose", help=_VERBOSE_HELP
    )
    return p


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not an option: the
    options before it take no value), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def _build(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; given ``command``, the other subcommands' own
    arguments are left out, and with them their modules' imports (the benchmarks,
    the launcher, the exported models: a tenth of a second of every task's start)."""

    def wanted(name: str) -> bool:
        return command is None or command == name

    parser = Parser(
        prog="zmqps", description="zmqps: a parameter server over ZeroMQ", allow_abbrev=False
    )
    _common_args(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = _sub(sub, "launch", help="run a whole cluster as local processes (the demo)")
    if wanted("launch"):
        from zmqps.cli.launch import add_launch_args

        add_launch_args(p)
    p.set_defaults(func=cmd_launch)
    p = _sub(sub, "server", help="run a chief or PS task (same as zmqps-server)")
    _server_parser(p)
    p.set_defaults(func=cmd_server)
    p = _sub(sub, "worker", help="run a worker task of a built-in job (same as zmqps-worker)")
    _worker_parser(p)
    p.set_defaults(func=cmd_worker)
    p = _sub(sub, "top", help="live view of a running cluster, from its /metrics endpoints")
    p.add_argument(
        "targets",
        nargs="+",
        metavar="URL|FILE",
        help="/metrics URLs, or the file_sd JSON of zmqps launch --prometheus-targets",
    )
    p.add_argument("--interval", type=seconds, default=1.0, help="seconds between redraws")
    p.add_argument(
        "--iterations", type=int, default=0, help="stop after N redraws (default: run until Ctrl-C)"
    )
    p.set_defaults(func=cmd_top)
    p = _sub(sub, "inspect", help="list and verify the checkpoints in a checkpoint root")
    if wanted("inspect"):
        from zmqps.cli.inspect import add_args as add_inspect_args

        add_inspect_args(p)
    p.set_defaults(func=cmd_inspect)
    p = _sub(sub, "status", help="show a running cluster's state, from its chief")
    _add_chief_query_args(p)
    p.set_defaults(func=cmd_status)
    p = _sub(
        sub,
        "cluster",
        help="print the cluster and this task as resolved from the flags, TF_CONFIG or Slurm",
        description="Print, as JSON, the cluster and this task as zmqps resolves them here:"
        " from the cluster flags, else TF_CONFIG, else the Slurm job step (srun) this runs"
        ' in. "source" says which (flags, tf_config or slurm), "ignored" which others were'
        " set too. Exits 2 with one line when they cannot be resolved.",
    )
    add_cluster_args(p)
    p.add_argument("--compact", action="store_true", help="one line of JSON")
    p.set_defaults(func=cmd_cluster)
    p = _sub(
        sub,
        "scale",
        help="serve the PS states from N PS of the cluster spec, moving them while training",
        description="Ask a running cluster's chief to serve its PS states from the first N"
        " PS processes its cluster spec names: states move while training goes on (copied,"
        " caught up, handed over at a new placement epoch), and a PS left without states is"
        " drained and exits 0. Without --ps: print where the states are.",
    )
    p.add_argument("--ps", type=int, metavar="N", help="the number of PS to serve the states")
    p.add_argument(
        "--wait",
        type=seconds,
        default=0.0,
        metavar="SECONDS",
        help="wait until the moves are done, at most this long (exit 1 past it)",
    )
    _add_chief_query_args(p)
    p.set_defaults(func=cmd_scale)
    p = _sub(sub, "keygen", help="make CurveZMQ keys for a cluster (then run it with --keys)")
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
    p = _sub(sub, "task", help="run one task described as data (zmqps launch's children)")
    p.add_argument("--config", required=True, metavar="FILE", help="the task's JSON (TaskConfig)")
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    # the launcher's pipe: output dropped (and counted) rather than the task blocked
    p.add_argument("--nonblocking-output", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_task)
    p = _sub(sub, "predict", help="run an exported model on a file of examples")
    if wanted("predict"):
        from zmqps.cli.predict import add_args as add_predict_args

        add_predict_args(p)
    p.set_defaults(func=cmd_predict)
    p = _sub(sub, "bench", help="benchmarks: zmqps vs raw pyzmq vs torch RPC (BENCHMARKS.md)")
    if wanted("bench"):
        from zmqps.bench.suites import add_bench_args

        add_bench_args(p)
    p.set_defaults(func=cmd_bench)
    return parser


def _run(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    from zmqps.cli.entry import interrupted, started

    if started():  # a Ctrl-C came while it started (one an import swallowed included)
        return interrupted(getattr(args, "prog", "zmqps"))
    if getattr(args, "nonblocking_output", False):
        from zmqps.process import nonblocking_output

        nonblocking_output()
    setup_logging(getattr(args, "verbose", 0), getattr(args, "quiet", False))
    if getattr(args, "parent_pid", None):
        exit_with_parent(args.parent_pid)
    try:
        return func(args)
    except (ConfigError, DeviceError) as exc:  # a device that cannot be used: configuration
        print(f"zmqps: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except RunFailed as exc:
        print(f"zmqps: error: {exc}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except BrokenPipeError:  # stdout's reader closed it early (| head): done, quietly
        drop_stdout()
        return 0
    except (ZmqpsError, OSError) as exc:
        if getattr(args, "verbose", 0):
            raise
        print(f"zmqps: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return interrupted(getattr(args, "prog", "zmqps"))


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:2] == ["bench", "scale-sim"]:
        # simulated workers against a real chief and real PS, with flags of its own
        from zmqps.bench.scale_sim import main as scale_sim
        from zmqps.cli.entry import interrupted, started

        if started():
            return interrupted("zmqps bench scale-sim")
        return scale_sim(given[2:], prog="zmqps bench scale-sim", parser=Parser)
    args = _build(_command(given)).parse_args(given)
    args.verbose += args.sub_verbose
    del args.sub_verbose
    return _run(args.func, args)


def _single(
    prog: str,
    build: Callable[[argparse.ArgumentParser], None],
    func: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None,
) -> int:
    p = Parser(prog=prog, allow_abbrev=False)
    _common_args(p)
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
