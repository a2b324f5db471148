"""``zmqps bench``: the coordinator — arguments, the suites, tables and JSON.

Rules of this module:

* A case is one suite with one worker count. All of its sides are started
  (zmqps first: its placement is the one the others then move), set up and
  warmed up; then each of the R timed repeats runs every variant on every side
  in turn, the side order rotating per repeat, so slow drifts of a shared
  machine hit every side alike and ratios come from one run.
* The figure of a repeat is aggregate throughput: total work of all workers /
  (last worker's end - first worker's start); a side's figure is the median of
  its repeats (min and max beside it); ratios are of medians.
* A side that fails is stopped and reported, the others go on; the exit code is
  1 when any side failed or any process ended badly, 2 for bad arguments.
* Children are stopped whatever happens: Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from zmqps.bench import raw_zmq, torch_rpc, zmqps_side
from zmqps.bench.common import (
    BenchError,
    Side,
    SideContext,
    int_list,
    machine_info,
    stop_all,
    summarize,
)
from zmqps.bench.workload import (
    DEFAULT_ROW_BUDGET,
    SUITES,
    VARIANTS,
    Workload,
    dense,
    small,
    sparse,
)
from zmqps.core.variables import ShardInfo
from zmqps.wire.errors import ConfigError, did_you_mean

__all__ = ["add_bench_args", "run_bench"]

SIDES = (
    "zmqps",
    "zmqps-tcp",
    "zmqps-curve",
    "zmqps-metrics",
    "zmqps-hash",
    "zmqps-r2",
    "zmqps-hash-r2",
    "zmqps-bf16",
    "raw",
    "torch",
)
#: zmqps-curve (CURVE on every socket), zmqps-metrics (every process serving
#: Prometheus metrics), zmqps-r2 and zmqps-hash-r2 (two copies of each PS state) and
#: zmqps-bf16 (a bfloat16 wire) run only when asked for
DEFAULT_SIDES = ("zmqps", "zmqps-tcp", "zmqps-hash", "raw", "torch")
#: sides that exist for some suites only (a hash-keyed table is an embedding table)
SIDE_SUITES = {"zmqps-hash": ("sparse",), "zmqps-hash-r2": ("sparse",)}
#: sides whose table is hash-keyed (its shards are hash buckets)
HASHED_SIDES = ("zmqps-hash", "zmqps-hash-r2")
#: sides that keep two copies of each PS state
REPLICATED_SIDES = ("zmqps-r2", "zmqps-hash-r2")
#: suites that are not "the same workload on every side": see their modules.
EXTRA_SUITES = ("optimizer", "sync", "checkpoint", "overlap", "coordinator", "scale")
ZMQPS_SIDES = tuple(side for side in SIDES if side.startswith("zmqps"))
#: ratios of zmqps sides to each other: what CURVE costs on the wire, what a
#: hash-keyed table costs against a fixed-size one, what a second copy of every PS
#: state costs, what a bfloat16 wire gains (the last three by TCP)
OWN_RATIOS = (
    ("zmqps-curve", "zmqps-tcp"),
    ("zmqps-hash", "zmqps"),
    ("zmqps-r2", "zmqps-tcp"),
    ("zmqps-hash-r2", "zmqps-hash"),
    ("zmqps-bf16", "zmqps-tcp"),
)
OTHER_SIDES = ("raw", "torch")
SPAWN: dict[str, Callable[[Workload, SideContext], Side]] = {
    "zmqps": zmqps_side.spawn,
    "zmqps-tcp": functools.partial(zmqps_side.spawn, tcp_only=True),
    "zmqps-curve": functools.partial(zmqps_side.spawn, tcp_only=True, curve=True),
    "zmqps-metrics": functools.partial(zmqps_side.spawn, metrics=True),
    "zmqps-hash": functools.partial(zmqps_side.spawn, hashed=True),
    "zmqps-r2": functools.partial(zmqps_side.spawn, tcp_only=True, replication=2),
    "zmqps-hash-r2": functools.partial(zmqps_side.spawn, hashed=True, replication=2),
    "zmqps-bf16": functools.partial(zmqps_side.spawn, tcp_only=True, wire="bfloat16"),
    "raw": raw_zmq.spawn,
    "torch": torch_rpc.spawn,
}
DEFAULT_WORKERS = {"dense": (1, 2), "sparse": (1,), "small": (1,)}
DEFAULT_STEPS = {"dense": 10, "sparse": 50, "small": 50}
DEFAULT_SHARD_MB = {"dense": 16.0, "sparse": 64.0, "small": 64.0}
#: the issue's acceptance ratios (medians, same run): zmqps' TCP path against raw
#: pyzmq over TCP, zmqps as it runs by default against torch RPC as it runs by default.
TARGETS: dict[tuple[str, str], dict[str, float]] = {
    ("dense", "pull+push"): {"zmqps-tcp/raw": 0.9, "zmqps/torch": 1.5},
    ("sparse", "rows"): {"zmqps/torch": 2.0},
}
#: The sizes the targets were set at (the defaults): a smaller workload (a smoke run)
#: measures per-message overheads, not the data path, so its targets are not judged.
FULL_SIZES: dict[str, dict[str, float]] = {
    "dense": {"size_mb": 100.0},
    "sparse": {"rows": 1_000_000, "dim": 64, "batch_rows": 4096},
}


def _names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "suites",
        nargs="*",
        metavar="SUITE",
        help=f"suites to run: {', '.join(SUITES + EXTRA_SUITES)} (default: all); and"
        " scale-sim, on its own with flags of its own (zmqps bench scale-sim --help)",
    )
    g = p.add_argument_group("what runs")
    g.add_argument(
        "--sides",
        type=_names,
        default=DEFAULT_SIDES,
        help="comma-separated sides among zmqps (as it runs by default), zmqps-tcp (its"
        " same-host fast path off), zmqps-curve (zmqps-tcp under CURVE keys:"
        " every tensor byte encrypted, bulk frames sealed on a data connection),"
        " zmqps-r2 (zmqps-tcp with two copies of every PS"
        " state: --replication 2, needs --ps 2 or more), zmqps-bf16 (zmqps-tcp with its"
        " dense variables travelling as bfloat16: --wire-dtype bfloat16), zmqps-metrics"
        " (zmqps with every process serving Prometheus metrics), zmqps-hash (sparse: zmqps"
        " with the table hash-keyed), zmqps-hash-r2 (sparse: zmqps-hash with two copies"
        " of every PS state), raw (pyzmq), torch (RPC) (default: all but zmqps-curve,"
        " zmqps-r2, zmqps-hash-r2, zmqps-bf16 and zmqps-metrics; torch is skipped with a"
        " note when it is not installed)",
    )
    g.add_argument(
        "--workers",
        type=int_list,
        help="worker counts, comma-separated, each a separate case"
        " (default: 1,2 for dense, 1 for sparse and small; overlap: the first, default 2)",
    )
    g.add_argument("--ps", type=int, default=1, help="PS tasks (raw: servers) (default: 1)")
    g.add_argument(
        "--scale-ps",
        type=int_list,
        default=(1, 2, 4),
        help="scale: the PS counts, comma-separated (default: 1,2,4; its worker counts:"
        " --workers, default 1,2,4,8)",
    )
    g.add_argument(
        "--device",
        default="cpu",
        help="overlap: where the workers compute, cpu or cuda[:N] (default: cpu)",
    )
    g.add_argument(
        "--hidden",
        type=int_list,
        default=(1024, 1024, 1024),
        help="overlap: the MLP's hidden layer sizes, comma-separated (default: 1024,1024,1024)",
    )
    g.add_argument(
        "--variants",
        type=_names,
        help="step variants: pull+push, push_pull (dense, small); rows (sparse: ids from a"
        " pool of 32 batches), fresh (sparse: new ids every step)"
        " (default: all of the suite's)",
    )
    g = p.add_argument_group("timing")
    g.add_argument(
        "--steps",
        type=int,
        help="steps per worker per repeat (default: dense 10, sparse 50, small 50)",
    )
    g.add_argument("--repeat", type=int, default=5, help="timed repeats (default: 5)")
    g.add_argument(
        "--warmup", type=int, default=3, help="untimed steps per variant first (default: 3)"
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds a side may take to set up or to finish one run (default: 120)",
    )
    g = p.add_argument_group("sizes")
    g.add_argument(
        "--size-mb",
        type=float,
        help="dense model MiB (default: 100; scale: 16)",
    )
    g.add_argument(
        "--shard-mb",
        type=float,
        help="max shard MiB, the chief's --max-shard-bytes (default: dense 16, sparse 64)",
    )
    g.add_argument("--num-shards", type=int, help="fixed shards per variable (dense, sparse)")
    g.add_argument(
        "--rows", type=int, default=1_000_000, help="sparse table rows (default: 1000000)"
    )
    g.add_argument("--dim", type=int, default=64, help="sparse row width (default: 64)")
    g.add_argument(
        "--batch-rows", type=int, default=4096, help="sparse ids per step (default: 4096)"
    )
    g.add_argument(
        "--variables", type=int, default=300, help="small: number of variables (default: 300)"
    )
    g.add_argument(
        "--row-budget",
        type=int,
        default=DEFAULT_ROW_BUDGET,
        help="sparse, zmqps-hash: rows per PS shard of the hash-keyed table"
        f" (default: {DEFAULT_ROW_BUDGET})",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the sparse ids (default: 0)")
    g.add_argument(
        "--rows-wait",
        action="store_true",
        help="sparse, zmqps sides: a step is a pull_rows, then a push_rows waited for"
        " (by default a step is one request: the last step's push and this step's pull,"
        " Worker.push_pull_rows)",
    )
    g.add_argument(
        "--rows-two",
        action="store_true",
        help="sparse, zmqps sides: a step is two requests, a pull_rows and a push_rows that"
        " travels while the next step's pull goes out (Worker.push_rows_async), as before"
        " push_pull_rows",
    )
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="FILE", help="write every figure (per repeat) as JSON here")
    g.add_argument(
        "--keep-logs",
        metavar="DIR",
        help="keep every process' log here (default: a temporary folder, kept only on failure)",
    )
    g.add_argument(
        "--zmqps-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the zmqps processes (repeatable), e.g. to switch a data path",
    )
    g.add_argument(
        "--no-pause",
        action="store_true",
        help="keep the torch side running between its runs (its idle threads then take"
        " CPU from the side being measured)",
    )
    g.add_argument("-q", "--quiet", action="store_true", help="tables only, no progress lines")


# ---------------------------------------------------------------------- config


@dataclass(frozen=True)
class BenchConfig:
    suites: tuple[str, ...]
    extras: tuple[str, ...]
    sides: tuple[str, ...]
    workers: tuple[int, ...] | None
    variants: tuple[str, ...] | None
    ps: int
    steps: int | None
    repeat: int
    warmup: int
    timeout: float
    size_mb: float
    #: scale: the model's MiB (16 unless --size-mb) and the PS counts
    scale_mb: float
    scale_ps: tuple[int, ...]
    shard_mb: float | None
    num_shards: int | None
    rows: int
    dim: int
    batch_rows: int
    variables: int
    row_budget: int
    seed: int
    rows_wait: bool = False
    rows_two: bool = False
    zmqps_env: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    hidden: tuple[int, ...] = (1024, 1024, 1024)
    pause_idle: bool = True
    quiet: bool = False

    def workload(self, suite: str) -> Workload:
        shard_mb = self.shard_mb or DEFAULT_SHARD_MB[suite]
        if suite == "dense":
            return dense(self.size_mb, self.ps, shard_mb, self.num_shards)
        if suite == "sparse":
            return sparse(
                self.rows,
                self.dim,
                self.batch_rows,
                self.ps,
                shard_mb,
                self.num_shards,
                self.row_budget,
                self.rows_wait,
                self.rows_two,
            )
        return small(self.variables, self.ps)

    def sides_for(self, suite: str) -> tuple[str, ...]:
        return tuple(s for s in self.sides if suite in SIDE_SUITES.get(s, (suite,)))

    def steps_for(self, suite: str) -> int:
        return self.steps or DEFAULT_STEPS[suite]

    def workers_for(self, suite: str) -> tuple[int, ...]:
        return self.workers or DEFAULT_WORKERS[suite]

    def below_full_size(self, suite: str) -> list[str]:
        """The sizes of ``suite`` below those its targets were set at ("--size-mb 1 < 100")."""
        return [
            f"--{key.replace('_', '-')} {getattr(self, key):.10g} < {full:.10g}"
            for key, full in FULL_SIZES.get(suite, {}).items()
            if getattr(self, key) < full
        ]

    def variants_for(self, suite: str) -> tuple[str, ...]:
        if self.variants is None:
            return VARIANTS[suite]
        return tuple(v for v in VARIANTS[suite] if v in self.variants) or VARIANTS[suite][:1]


def _config(args: argparse.Namespace) -> BenchConfig:
    requested = tuple(args.suites) or SUITES + EXTRA_SUITES
    for s in requested:
        if s not in SUITES + EXTRA_SUITES:
            hint = did_you_mean(s, SUITES + EXTRA_SUITES + ("scale-sim",), quote=True)
            raise ConfigError(
                f"unknown suite {s!r} (expected {', '.join(SUITES + EXTRA_SUITES)}{hint})"
            )
    suites = tuple(s for s in requested if s in SUITES)
    extras = tuple(s for s in requested if s in EXTRA_SUITES)
    for s in args.sides:
        if s not in SIDES:
            hint = did_you_mean(s, SIDES, quote=True)
            raise ConfigError(f"unknown side {s!r} (expected {', '.join(SIDES)}{hint})")
    known = {v for vs in VARIANTS.values() for v in vs}
    for v in args.variants or ():
        if v not in known:
            hint = did_you_mean(v, sorted(known), quote=True)
            raise ConfigError(f"unknown variant {v!r} (expected {', '.join(sorted(known))}{hint})")
    for flag in ("ps", "repeat", "rows", "dim", "batch_rows", "variables", "row_budget"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1")
    for side in REPLICATED_SIDES:
        if side in args.sides and args.ps < 2:
            raise ConfigError(f"side {side} keeps two copies of each PS state: give --ps 2 or more")
    hashed = any(side in args.sides for side in HASHED_SIDES)
    if "sparse" in requested and hashed and args.row_budget < args.batch_rows:
        raise ConfigError(
            f"--row-budget {args.row_budget} is below --batch-rows {args.batch_rows}: a PS"
            " refuses a request naming more new ids than its table may hold"
        )
    if args.steps is not None and args.steps < 1:
        raise ConfigError("--steps must be >= 1")
    if args.warmup < 0 or args.timeout <= 0 or (args.size_mb is not None and args.size_mb <= 0):
        raise ConfigError("--warmup must be >= 0, --timeout and --size-mb > 0")
    env = {}
    for item in args.zmqps_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--zmqps-env {item!r}: expected KEY=VALUE")
        env[key] = value
    return BenchConfig(
        suites=suites,
        extras=extras,
        sides=tuple(dict.fromkeys(args.sides)),
        workers=args.workers,
        variants=args.variants,
        ps=args.ps,
        steps=args.steps,
        repeat=args.repeat,
        warmup=args.warmup,
        timeout=args.timeout,
        size_mb=100.0 if args.size_mb is None else args.size_mb,
        scale_mb=16.0 if args.size_mb is None else args.size_mb,
        scale_ps=tuple(args.scale_ps),
        shard_mb=args.shard_mb,
        num_shards=args.num_shards,
        rows=args.rows,
        dim=args.dim,
        batch_rows=args.batch_rows,
        variables=args.variables,
        row_budget=args.row_budget,
        seed=args.seed,
        rows_wait=args.rows_wait,
        rows_two=args.rows_two,
        zmqps_env=env,
        device=args.device,
        hidden=tuple(args.hidden),
        pause_idle=not args.no_pause,
        quiet=args.quiet,
    )


# ---------------------------------------------------------------------- one case


@dataclass
class Case:
    """One suite with one worker count: its sides and their repeats."""

    suite: str
    workers: int
    cfg: BenchConfig
    run_dir: Path
    workload: Workload
    sides: dict[str, Side] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    results: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)
    setup_s: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tables: dict[str, Any] = field(default_factory=dict)
    #: the hash-keyed side the table figures are of
    tables_side: str | None = None

    def say(self, text: str) -> None:
        if not self.cfg.quiet:
            print(f"[{self.suite} x{self.workers}] {text}", file=sys.stderr, flush=True)

    def live(self) -> list[Side]:
        return [s for s in self.sides.values() if s.error is None]

    def start(self, name: str) -> None:
        if name == "torch":
            why = torch_rpc.available()
            if why is not None:
                self.skipped[name] = why
                self.say(f"torch side skipped: {why}")
                return
        ctx = SideContext(
            self.workers,
            self.run_dir,
            self.cfg.timeout,
            self.cfg.seed,
            self.cfg.zmqps_env,
            self.cfg.pause_idle,
        )
        t = time.monotonic()
        side = SPAWN[name](self.workload, ctx)
        self.sides[name] = side
        try:
            side.wait_ready()
            if name in ZMQPS_SIDES and name not in HASHED_SIDES:  # its shards are hash buckets
                self._adopt_placement(side)
            for variant in self.cfg.variants_for(self.suite):
                if self.cfg.warmup:
                    side.run(variant, self.cfg.warmup)
        except BenchError as exc:
            self.say(f"{name} failed to start: {exc}")
            side.fail(exc)
            return
        side.pause()
        self.setup_s[name] = time.monotonic() - t
        self.say(f"{name} ready and warm ({self.setup_s[name]:.1f}s)")

    def _adopt_placement(self, side: Side) -> None:
        """Make the other sides move exactly the shards zmqps' chief placed."""
        got = tuple(ShardInfo.from_wire(s) for s in side.info[0].get("shards", []))
        if got and got != self.workload.shards:
            self.notes.append(
                f"zmqps placed {len(got)} shards where the bench planned"
                f" {len(self.workload.shards)}; the other sides use zmqps' placement"
            )
            self.workload = self.workload.with_shards(got)

    def measure(self) -> None:
        steps = self.cfg.steps_for(self.suite)
        for r in range(self.cfg.repeat):
            for variant in self.cfg.variants_for(self.suite):
                live = self.live()
                k = r % max(1, len(live))
                for side in live[k:] + live[:k]:
                    try:
                        res = side.run(variant, steps)
                    except BenchError as exc:
                        self.say(f"{side.name} failed: {exc}")
                        side.fail(exc)
                        continue
                    self.results.setdefault((variant, side.name), []).append(res)
            self.say(
                f"repeat {r + 1}/{self.cfg.repeat}: "
                + ", ".join(
                    f"{name} {_fmt(vals[-1]['value'])}"
                    for (v, name), vals in self.results.items()
                    if v == self.cfg.variants_for(self.suite)[0] and len(vals) == r + 1
                )
            )

    def read_tables(self) -> None:
        """The hash-keyed side's table figures after the runs (rows, created, evicted)."""
        name = next((n for n in HASHED_SIDES if n in self.sides), None)
        side = None if name is None else self.sides[name]
        if side is None or side.error is not None:
            return
        try:
            self.tables = zmqps_side.table_stats(side)
            self.tables_side = name
        except Exception as exc:  # a figure beside the results: say so, keep the results
            side.warnings.append(f"could not read its tables: {exc}")

    def close(self) -> None:
        for side in self.sides.values():
            side.close()
            for w in side.warnings:
                self.say(f"warning: {w}")

    def kill(self) -> None:
        stop_all([c for s in self.sides.values() for c in s.children], grace=2.0)

    # ------------------------------------------------------------------ report

    def report(self) -> list[dict[str, Any]]:
        wl = self.workload
        runs = []
        for variant in self.cfg.variants_for(self.suite):
            sides: dict[str, Any] = {}
            for name in self.cfg.sides_for(self.suite):
                sides[name] = self._side_report(name, variant)
            ratios = {
                f"{z}/{other}": _ratio(sides[z], sides[other])
                for z in ZMQPS_SIDES
                for other in OTHER_SIDES
                if z in sides and other in sides
            }
            ratios.update(
                {
                    f"{a}/{b}": _ratio(sides[a], sides[b])
                    for a, b in OWN_RATIOS
                    if a in sides and b in sides
                }
            )
            targets = judge_targets(
                self.suite, variant, ratios, self.cfg.below_full_size(self.suite)
            )
            runs.append(
                {
                    "suite": self.suite,
                    "workers": self.workers,
                    "variant": variant,
                    "unit": wl.unit,
                    "steps_per_repeat": self.cfg.steps_for(self.suite),
                    "repeats": self.cfg.repeat,
                    "warmup_steps": self.cfg.warmup,
                    "workload": wl.summary(),
                    "sides": sides,
                    "ratios": ratios,
                    "targets": targets,
                    "notes": list(self.notes),
                }
            )
        return runs

    def _side_report(self, name: str, variant: str) -> dict[str, Any]:
        if name in self.skipped:
            return {"status": "skipped", "reason": self.skipped[name]}
        side = self.sides.get(name)
        reps = self.results.get((variant, name), [])
        out: dict[str, Any] = {
            "status": "ok",
            "values": [r["value"] for r in reps],
            "runs": reps,
            "setup_seconds": self.setup_s.get(name),
            "warnings": [] if side is None else list(side.warnings),
        }
        if side is not None and side.info and "transport" in side.info[0]:
            out["transport"] = side.info[0]["transport"]
        if name == self.tables_side and self.tables:
            out["tables"] = self.tables
        if side is not None and side.error is not None:
            out.update(status="failed", error=side.error)
        elif len(reps) < self.cfg.repeat:
            out.update(status="failed", error="missing repeats")
        if reps:
            out.update(summarize(out["values"]))
            out["mb_per_s_median"] = out["median"] * self.workload.bytes_per_unit() / 1e6
        return out


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if not a or not b or a.get("status") != "ok" or b.get("status") != "ok":
        return None
    return float(a["median"] / b["median"]) if b.get("median") else None


def _met(ratio: float | None, target: float) -> bool | None:
    return None if ratio is None else ratio >= target


def judge_targets(
    suite: str, variant: str, ratios: dict[str, float | None], below: list[str]
) -> dict[str, dict[str, Any]]:
    """The targets of a suite's variant with their verdicts; ``below`` (the sizes under
    the full ones) non-empty: ``met`` is None and ``not_judged`` says why."""
    out: dict[str, dict[str, Any]] = {}
    for key, t in TARGETS.get((suite, variant), {}).items():
        entry: dict[str, Any] = {"min": t, "ratio": ratios.get(key)}
        if below:
            entry.update(met=None, not_judged=", ".join(below))
        else:
            entry["met"] = _met(ratios.get(key), t)
        out[key] = entry
    return out


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if v >= 1000 else f"{v:.2f}"


def run_case(suite: str, workers: int, cfg: BenchConfig, run_dir: Path) -> list[dict[str, Any]]:
    run_dir.mkdir(parents=True, exist_ok=True)
    case = Case(suite, workers, cfg, run_dir, cfg.workload(suite))
    case.say(case.workload.describe())
    try:
        for name in cfg.sides_for(suite):
            case.start(name)
        if case.live():
            case.measure()
            case.read_tables()
    except BaseException:
        case.kill()
        raise
    case.close()
    return case.report()


# ---------------------------------------------------------------------- output


def _ratio_lines(run: dict[str, Any]) -> list[str]:
    by_side: dict[str, list[str]] = {}
    for key, value in run["ratios"].items():
        text = f"{key} {'n/a' if value is None else f'{value:.2f}'}"
        t = run["targets"].get(key)
        if t is not None and t.get("not_judged"):
            text += f" (target >= {t['min']:g}: not judged below full size, {t['not_judged']})"
        elif t is not None:
            verdict = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
            text += f" (target >= {t['min']:g}: {verdict})"
        by_side.setdefault(key.split("/")[0], []).append(text)
    return [", ".join(parts) for parts in by_side.values()]


def format_runs(runs: Sequence[dict[str, Any]]) -> str:
    """One suite case as a table: a row per variant and side, then the ratios."""
    if not runs:
        return ""
    first = runs[0]
    w = first["workers"]
    lines = [
        f"{first['suite']}, {w} worker{'s' if w > 1 else ''}: {first['workload']['description']}",
        f"  {first['steps_per_repeat']} steps per worker x {first['repeats']} repeats"
        f" (after {first['warmup_steps']} warm-up steps); aggregate over all workers",
        f"  {'variant':<10} {'side':<13} {'median ' + first['unit']:>16} {'min .. max':>22}"
        f" {'MB/s':>7}",
    ]
    for run in runs:
        label = run["variant"]
        for name, s in run["sides"].items():
            head = f"  {label:<10} {name:<13}"
            if s["status"] == "skipped":
                lines.append(f"{head} skipped: {s['reason']}")
            elif "median" not in s:
                lines.append(f"{head} FAILED: {s['error'].splitlines()[0]}")
            else:
                span = f"{_fmt(s['min'])} .. {_fmt(s['max'])}"
                flag = "" if s["status"] == "ok" else "  (FAILED: incomplete)"
                lines.append(
                    f"{head} {_fmt(s['median']):>16} {span:>22} {s['mb_per_s_median']:>7.0f}{flag}"
                )
            label = ""
        lines += [f"  {'':<10} {text}" for text in _ratio_lines(run)]
        hashed = next((n for n in HASHED_SIDES if run["sides"].get(n, {}).get("tables")), None)
        tables = {} if hashed is None else run["sides"][hashed]["tables"]
        for name, t in tables.items() if run is runs[-1] else ():
            lines.append(
                f"  {hashed} table {name} after all runs: {t['rows']:,} rows (capacity"
                f" {t['capacity']:,}), {t['created']:,} created, {t.get('evicted_budget', 0):,}"
                " evicted to keep the row budget"
            )
        lines += [f"  note: {note}" for note in run["notes"]]
    return "\n".join(lines)


def _failed(runs: Sequence[dict[str, Any]]) -> list[str]:
    out = []
    for run in runs:
        for name, s in run["sides"].items():
            if s["status"] == "failed":
                out.append(f"{run['suite']} x{run['workers']} {run['variant']} {name}")
            elif s.get("warnings"):
                out.append(f"{run['suite']} x{run['workers']} {name}: bad exit")
    return sorted(set(out))


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt, whatever the bench inherited.

    A program started in the background by a non-interactive shell inherits SIGINT
    ignored, and Python then installs no KeyboardInterrupt for it: a Ctrl-C sent to the
    bench (or a harness's SIGINT) would be dropped and the run go on. The launcher
    handles both signals itself for the same reason.
    """

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def run_bench(args: argparse.Namespace) -> int:
    cfg = _config(args)
    keep = args.keep_logs is not None
    run_dir = Path(args.keep_logs) if keep else Path(tempfile.mkdtemp(prefix="zmqps-bench-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": list(sys.argv),
        "machine": machine_info(),
        "config": {k: v for k, v in cfg.__dict__.items() if k != "quiet"},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "runs": [],
    }
    failures: list[str] = []
    with _signals_interrupt():
        if "optimizer" in cfg.extras:
            from zmqps.bench.optimizer import format_optimizer, run_optimizer

            run = run_optimizer(size_mb=cfg.size_mb, repeat=max(cfg.repeat, 3))
            report["runs"].append(run)
            print(format_optimizer(run) + "\n", flush=True)
        if "sync" in cfg.extras:
            from zmqps.bench.sync_overhead import format_sync, run_sync

            run = run_sync(steps=cfg.steps or 200, repeat=min(cfg.repeat, 3), timeout=cfg.timeout)
            report["runs"].append(run)
            print(format_sync(run) + "\n", flush=True)
        if "checkpoint" in cfg.extras:
            from zmqps.bench.checkpoint import format_checkpoint, run_checkpoint

            run = run_checkpoint(size_mb=cfg.size_mb, repeat=min(max(cfg.repeat, 3), 5))
            report["runs"].append(run)
            print(format_checkpoint(run) + "\n", flush=True)
        if "overlap" in cfg.extras:
            from zmqps.bench.overlap import format_overlap, run_overlap

            run = run_overlap(
                cfg.device,
                steps=cfg.steps or 100,
                repeat=min(cfg.repeat, 3),
                hidden=cfg.hidden,
                workers=cfg.workers[0] if cfg.workers else 2,
                timeout=cfg.timeout,
            )
            report["runs"].append(run)
            print(format_overlap(run) + "\n", flush=True)
        if "coordinator" in cfg.extras:
            from zmqps.bench.coordinator import format_coordinator, run_coordinator

            run = run_coordinator(
                workers=cfg.workers or (1, 2),
                functions=cfg.steps or 1000,
                repeat=min(cfg.repeat, 5),
                timeout=cfg.timeout,
            )
            report["runs"].append(run)
            print(format_coordinator(run) + "\n", flush=True)
        if "scale" in cfg.extras:
            from zmqps.bench.scale import SCALE_WORKERS, format_scale, run_scale

            run = run_scale(
                replace(cfg, size_mb=cfg.scale_mb),
                run_dir,
                cfg.scale_ps,
                cfg.workers or SCALE_WORKERS,
            )
            report["runs"].append(run)
            if not run["ok"]:
                failures.append("scale")
            print(format_scale(run) + "\n", flush=True)
        for suite in cfg.suites:
            for workers in cfg.workers_for(suite):
                runs = run_case(suite, workers, cfg, run_dir / f"{suite}-x{workers}")
                report["runs"].extend(runs)
                failures += _failed(runs)
                print(format_runs(runs) + "\n", flush=True)
                if args.json:
                    _write_json(Path(args.json), report)
    report["failures"] = failures
    report["ok"] = not failures
    if args.json:
        _write_json(Path(args.json), report)
    if failures:
        print(f"zmqps bench: failed: {', '.join(failures)}; logs in {run_dir}", file=sys.stderr)
        return 1
    if not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def _write_json(path: Path, report: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)
