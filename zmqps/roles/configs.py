"""Every task's configuration: frozen dataclasses, built once, passed as data.

Rules of this module:

* A task's whole configuration is one frozen dataclass (:class:`PSConfig`,
  :class:`ChiefConfig`, :class:`WorkerConfig`, :class:`EvaluatorConfig`), validated
  when built; nothing downstream reads flags or the environment.
* :class:`TaskConfig` is what a process runs: one of them, plus the process-level
  settings (CURVE keys folder, logging). ``zmqps launch`` builds every child's
  TaskConfig in its own process, checks it, writes it as JSON (:func:`dumps`), and
  the child reads it back (:func:`loads`): children never get a command line
  rebuilt from parsed flags.
* Secrets never travel in a config: keys stay in their 0600 files; a config names
  the folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import cattrs

from zmqps.config import ClusterSpec
from zmqps.core.lowp import WIRE_DTYPES
from zmqps.core.partition import Partitioner, check_replication
from zmqps.core.sync import MODES
from zmqps.roles.job import JobConfig
from zmqps.wire.errors import ConfigError, InvalidArgument

__all__ = [
    "NONFINITE_POLICIES",
    "CheckpointPolicy",
    "ChiefConfig",
    "DriverConfig",
    "EvaluatorConfig",
    "PSConfig",
    "SyncConfig",
    "TaskConfig",
    "WorkerConfig",
    "dumps",
    "loads",
]

#: what a worker does with a step whose loss or gradient is not finite
NONFINITE_POLICIES = ("skip", "skip-silently", "stop")
#: training standing still this long ends a run failed (the chief's --stall-timeout)
STALL_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class SyncConfig:
    mode: str = "async"
    replicas_to_aggregate: int | None = None  # N; default: total replicas
    total_replicas: int | None = None  # M; default: number of workers
    init_tokens: int = 0  # K extra tokens of step 0
    max_staleness: int = 2  # S (ssp)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown --mode {self.mode!r}; expected one of {', '.join(MODES)}")
        for name in ("replicas_to_aggregate", "total_replicas"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        for name in ("init_tokens", "max_staleness"):
            v = getattr(self, name)
            if v < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {v}")
        given = [
            f"--{name.replace('_', '-')}"
            for name in ("replicas_to_aggregate", "total_replicas", "init_tokens")
            if getattr(self, name)
        ]
        if given and self.mode != "sync":
            verb = "applies" if len(given) == 1 else "apply"
            raise ConfigError(
                f"{', '.join(given)} {verb} only to --mode sync (this run is {self.mode})"
            )
        n, m = self.replicas_to_aggregate, self.total_replicas
        if n is not None and m is not None and n > m:
            raise ConfigError(
                f"--replicas-to-aggregate {n} is more than --total-replicas {m}:"
                " a step could never gather its gradients"
            )

    def check_workers(self, workers: int) -> None:
        """Sync: N and M fit the cluster's ``workers`` (else a step could never gather
        its gradients; nothing is clamped silently)."""
        if self.mode != "sync" or workers < 1:
            return
        m = self.total_replicas or workers
        if m > workers:
            raise ConfigError(
                f"--total-replicas {m} is more than the {workers} workers of the cluster"
            )
        n = self.replicas_to_aggregate
        if n is not None and n > m:
            raise ConfigError(
                f"--replicas-to-aggregate {n} is more than the {m} replicas"
                f" ({'--total-replicas' if self.total_replicas else 'the workers'}):"
                " a step could never gather its gradients"
            )


@dataclass(frozen=True)
class CheckpointPolicy:
    directory: str
    steps: int = 0  # every N global steps (0: not by steps)
    secs: float = 0.0  # every T seconds (0: not by time)
    keep: int = 5

    def due(self, step: int, last_step: int, last_time: float, now: float) -> bool:
        if step <= last_step:
            return False
        if self.steps > 0 and step - last_step >= self.steps:
            return True
        return self.secs > 0 and now - last_time >= self.secs


@dataclass(frozen=True)
class PSConfig:
    index: int
    bind: str
    chunk_bytes: int = 4 << 20
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no exporter; 0: a free port
    checkpoint_dir: str | None = None  # the shared checkpoint root this PS writes shards to
    stop_grace: float = 8.0  # SIGTERM: seconds to serve on for the chief's final checkpoint


@dataclass(frozen=True)
class DriverConfig:
    """Coordinator mode: the chief runs ``job_module``'s ``drive()`` and schedules its
    functions onto workers that serve them."""

    job_module: str
    steps_per_execution: int = 1


@dataclass(frozen=True)
class ChiefConfig:
    bind: str
    cluster: ClusterSpec
    job: JobConfig | None = None  # a built-in job: the chief creates and evaluates its model
    optimizer: dict[str, Any] = field(default_factory=lambda: {"name": "sgd", "lr": 0.01})
    partitioner: Partitioner = field(default_factory=Partitioner)
    placement: str = "round_robin"
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    startup_timeout: float = 120.0
    summary_path: str | None = None
    keep_alive: bool = False
    sync: SyncConfig = field(default_factory=SyncConfig)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no exporter; 0: a free port
    checkpoint: CheckpointPolicy | None = None
    export_dir: str | None = None  # where the final model is exported (built-in jobs)
    stop_grace: float = 8.0  # SIGTERM: seconds for the final checkpoint before exiting
    #: at the end, how long the chief keeps the PS up for a side-car evaluator's last
    #: evaluation (it says when it is done; a silent one is not waited for)
    final_eval_timeout: float = 60.0
    driver: DriverConfig | None = None  # coordinator mode
    #: the largest share of the workers' steps whose gradients may have been refused
    #: as not finite (and skipped) for the run to succeed; above it the run ends
    #: failed (exit code 3). 0: the first one stops the run.
    max_nonfinite_share: float = 0.05
    #: TensorBoard: this task's scalars in ``logdir/chief`` (None: none)
    logdir: str | None = None
    #: copies of every PS state (1: none); each on another PS
    replication: int = 1
    #: the dtype the dense float32 variables' values and gradients travel as, unless a
    #: variable says its own (None: as they are; "bfloat16": half the bytes)
    wire_dtype: str | None = None
    #: training standing still this long (seconds) ends the run failed; 0: never
    stall_timeout: float = STALL_TIMEOUT_S
    #: elastic PS: a PS serving more bytes of shards than this makes the chief ask for
    #: the next PS of the spec (None: never)
    add_ps_above: int | None = None

    def __post_init__(self) -> None:
        if not self.stall_timeout >= 0:
            raise ConfigError(f"--stall-timeout must be >= 0, got {self.stall_timeout:g}")
        if self.add_ps_above is not None and self.add_ps_above < 1:
            raise ConfigError(f"--add-ps-above must be > 0 bytes, got {self.add_ps_above}")
        try:
            check_replication(self.replication, self.cluster.num_ps)
        except InvalidArgument as exc:
            raise ConfigError(f"--replication: {exc}") from None
        if self.wire_dtype is not None and self.wire_dtype not in WIRE_DTYPES:
            raise ConfigError(
                f"--wire-dtype {self.wire_dtype!r}: float32 or {', '.join(sorted(WIRE_DTYPES))}"
            )
        share = self.max_nonfinite_share
        if isinstance(share, bool) or not 0.0 <= share <= 1.0:
            raise ConfigError(f"--max-nonfinite-share must be within [0, 1], got {share}")
        if self.driver is None:
            self.sync.check_workers(self.cluster.num_workers)


@dataclass(frozen=True)
class WorkerConfig:
    """A worker task of the built-in training program (or, with ``serve_job``, a
    function server of coordinator mode)."""

    cluster: ClusterSpec
    index: int
    job: JobConfig | None = None
    device: str = "cpu"
    prefetch: bool = False
    shared_memory: bool = True
    connect_timeout: float = 120.0
    #: a chief that answers nothing this long is gone for good: the worker stops
    #: (exit code 1); None: never
    chief_timeout: float | None = 60.0
    stats_path: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    serve_job: str | None = None  # coordinator mode: the module whose functions it serves
    #: a step whose loss or gradient is not finite (the PS refuse such a gradient):
    #: "skip" it and log it (at most one line per 10 s), "skip-silently", or "stop"
    #: the run at the first one (exit code 3)
    on_nonfinite: str = "skip"
    #: TensorBoard: this task's scalars in ``logdir/worker<index>`` (None: none)
    logdir: str | None = None
    #: ``--mode`` as given to this worker (None: not given): the chief's mode is the
    #: run's, and the chief says so when they differ
    mode: str | None = None

    def __post_init__(self) -> None:
        if not self.connect_timeout > 0:  # (NaN too) as the evaluator's
            raise ConfigError(f"--connect-timeout must be > 0, got {self.connect_timeout:g}")
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(
                f"--on-nonfinite must be one of {', '.join(NONFINITE_POLICIES)},"
                f" got {self.on_nonfinite!r}"
            )


@dataclass(frozen=True)
class EvaluatorConfig:
    """The side-car evaluator. ``chief`` None: a lone evaluator (no cluster to follow:
    it evaluates the checkpoints in ``checkpoint_dir`` as they appear)."""

    chief: str | None
    job: JobConfig
    checkpoint_dir: str | None = None  # set: evaluate checkpoints; None: pull snapshots
    interval: float = 2.0  # seconds between evaluations (at most one per interval)
    chief_timeout: float = 30.0  # seconds the chief may stay silent before training ended
    connect_timeout: float = 120.0  # seconds to wait for the chief at start
    eval_log: str | None = None  # append one JSON line per evaluation here
    # A status reply later than this is treated as none: the ports are probed at once
    # (a slow but live chief only costs a probe; it is an error after chief_timeout).
    request_timeout: float = 1.0
    pull_timeout: float = 30.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no exporter; 0: a free port
    #: a lone evaluator ends when no new checkpoint appeared for this long after its
    #: last evaluation (or when it evaluated a run's final checkpoint)
    idle_timeout: float = 30.0
    #: TensorBoard: the evaluations in ``logdir/evaluator`` (None: none)
    logdir: str | None = None

    def __post_init__(self) -> None:
        for name in ("interval", "chief_timeout", "connect_timeout", "idle_timeout"):
            if not getattr(self, name) > 0:
                flag = {"interval": "eval-interval", "idle_timeout": "eval-idle-timeout"}.get(
                    name, name.replace("_", "-")
                )
                raise ConfigError(f"--{flag} must be > 0, got {getattr(self, name)}")
        if self.chief is None and self.checkpoint_dir is None:
            raise ConfigError(
                "an evaluator without a chief in its cluster evaluates checkpoints:"
                " pass --checkpoint-dir"
            )

    @property
    def source(self) -> str:
        return "checkpoint" if self.checkpoint_dir else "snapshot"


@dataclass(frozen=True)
class TaskConfig:
    """One process's task: exactly one of the role configs, and process settings."""

    ps: PSConfig | None = None
    chief: ChiefConfig | None = None
    worker: WorkerConfig | None = None
    evaluator: EvaluatorConfig | None = None
    keys: str | None = None  # the CURVE keys folder (zmqps keygen); None: plaintext
    verbose: int = 0
    quiet: bool = False

    def __post_init__(self) -> None:
        given = [n for n in ("ps", "chief", "worker", "evaluator") if getattr(self, n)]
        if len(given) != 1:
            raise ConfigError(f"a task runs exactly one role, got {given or 'none'}")

    @property
    def role(self) -> str:
        return next(n for n in ("ps", "chief", "worker", "evaluator") if getattr(self, n))


_converter = cattrs.Converter()


def dumps(task: TaskConfig) -> str:
    """The task as JSON (what a child process reads back with :func:`loads`)."""
    return json.dumps(_converter.unstructure(task), indent=1, sort_keys=True)


def loads(text: str, source: str = "task config") -> TaskConfig:
    """A :class:`TaskConfig` from :func:`dumps`' JSON; every config is validated again
    as it is built. A bad one is a :class:`ConfigError` naming ``source``."""
    try:
        return _converter.structure(json.loads(text), TaskConfig)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON ({e.msg})") from None
    except ConfigError:
        raise
    except (cattrs.BaseValidationError, InvalidArgument, TypeError, ValueError) as e:
        detail = "; ".join(str(x) for x in getattr(e, "exceptions", ())) or str(e)
        raise ConfigError(f"{source}: {detail}") from None
