"""The metric catalogue: every zmqps metric, declared once.

Rules of this module:

* :class:`Metrics` owns one :class:`~prometheus_client.CollectorRegistry`
  (a fresh one unless one is injected) and declares every metric on it; the
  process-wide default registry is never touched.
* Roles update metrics through the small methods here, once per request or
  step, never per element; values a role already keeps (global step, alive
  workers, tokens, shard bytes) are read at scrape time through :meth:`watch`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from zmqps.version import __version__

__all__ = [
    "AUTH_FAILURE_REASONS",
    "DROP_REASONS",
    "EVICTION_REASONS",
    "FUNCTION_OUTCOMES",
    "PHASES",
    "SEAL_REFUSAL_REASONS",
    "STALENESS_BUCKETS",
    "Metrics",
]

#: Staleness in steps; exact at small values, coarser beyond.
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
#: Why a PS acknowledged a push without applying it.
DROP_REASONS = ("duplicate", "stale", "fenced", "invalid", "rolled_back", "nonfinite")
#: Why a server refused a client: its key is not on the allow-list (refused), or the
#: CURVE handshake failed (a plaintext client, a wrong server key); on a sealed data
#: connection, credentials no live session has (data_refused) or none (data_handshake).
AUTH_FAILURE_REASONS = ("refused", "handshake", "data_refused", "data_handshake")
#: Why a sealed bulk message is refused (``zmqps.transport.seal.REASONS``).
SEAL_REFUSAL_REASONS = ("malformed", "unknown_key", "tampered", "replayed", "exhausted")
#: The phases of one worker step: pull, host -> device copy, compute, device -> host
#: copy, push. With overlap, a phase's time is how long the step waited for it.
PHASES = ("pull", "h2d", "compute", "d2h", "push")
#: How a function scheduled by the coordinator ended (retries are counted apart).
FUNCTION_OUTCOMES = ("ok", "failed", "cancelled")
#: Why a hash-keyed table dropped a row: over its row budget, or untouched too long.
EVICTION_REASONS = ("budget", "idle")

#: Reads ``{variable: stats}`` of the hash tables a PS holds (``HashShard.stats`` summed
#: over its shards): rows, created, admitted, not_admitted, evicted {reason: n}.
TableStats = Callable[[], Mapping[str, Mapping[str, Any]]]


#: Reads a PS process's replicated states at scrape time: ``{state: {"primary": bool,
#: "lag_seconds": float, "lag_entries": {backup: entries}}}``.
StateStats = Callable[[], Mapping[int, Mapping[str, Any]]]
#: Reads the chief's replication figures at scrape time (``RecoveryController``).
ReplicationStats = Callable[[], Mapping[str, Any]]
#: Reads the chief's elastic PS figures at scrape time (``Mover.figures``).
ElasticStats = Callable[[], Mapping[str, Any]]


class _Read(Collector):
    """Figures a role keeps already, read by ``read`` at scrape time (so nothing is
    counted twice); ``EMPTY`` stands in before a role gives its ``read``."""

    EMPTY: Any = {}

    def __init__(self) -> None:
        self.read: Callable[[], Any] | None = None

    def describe(self) -> list[Metric]:
        return list(self._families(self.EMPTY))

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self.read() if self.read is not None else self.EMPTY)

    @staticmethod
    def _families(figures: Any) -> Iterator[Metric]:
        raise NotImplementedError


class _StatesCollector(_Read):
    """A PS process's part in replication, read from its states at scrape time."""

    @staticmethod
    def _families(states: Mapping[int, Mapping[str, Any]]) -> Iterator[Metric]:
        primary = GaugeMetricFamily(
            "zmqps_state_primary",
            "1 for each PS state this process serves as its primary, 0 for one it backs up.",
            labels=["state"],
        )
        lag_s = GaugeMetricFamily(
            "zmqps_replication_lag_seconds",
            "Age of the oldest update a primary applied that some in-sync backup has not"
            " acknowledged yet (its push waits for it); 0 when every copy has everything.",
            labels=["state"],
        )
        lag_n = GaugeMetricFamily(
            "zmqps_replication_lag_updates",
            "Updates a primary applied that this backup has not acknowledged yet.",
            labels=["state", "backup"],
        )
        for state, st in sorted(states.items()):
            primary.add_metric([str(state)], 1.0 if st.get("primary") else 0.0)
            if st.get("primary"):
                lag_s.add_metric([str(state)], float(st.get("lag_seconds", 0.0)))
                for backup, n in sorted((st.get("lag_entries") or {}).items()):
                    lag_n.add_metric([str(state), str(backup)], float(n))
        yield primary
        yield lag_s
        yield lag_n


#: The chief's replication figures without labels: (kind, name, help, key of the
#: figures :meth:`RecoveryController.replication_figures` returns).
_CHIEF_REPLICATION = (
    (
        "gauge",
        "zmqps_replication_factor",
        "Copies of each PS state the run keeps (--replication).",
        "factor",
    ),
    (
        "gauge",
        "zmqps_states_under_replicated",
        "PS states with fewer copies than --replication (a copy is made again).",
        "under_replicated",
    ),
    (
        "counter",
        "zmqps_failovers",
        "Fail-overs: PS processes found dead or restarted, their states' copies promoted.",
        "failovers",
    ),
    ("counter", "zmqps_promotions", "Copies promoted to primary.", "promotions"),
    (
        "gauge",
        "zmqps_failover_last_seconds",
        "Duration of the last fail-over (fence, promote, new placement).",
        "last_failover_seconds",
    ),
    (
        "counter",
        "zmqps_state_copy_bytes",
        "Bytes of PS states copied to new copies.",
        "copied_bytes",
    ),
    (
        "gauge",
        "zmqps_state_copy_progress_ratio",
        "Share of the copy under way sent so far (0 when none is).",
        "copy_progress",
    ),
)


class _ReplicationCollector(_Read):
    """The chief's replication figures (what it already counts), read at scrape time;
    zeros outside the chief (every process exports the whole catalogue)."""

    EMPTY = {"factor": 0}

    @staticmethod
    def _families(st: Mapping[str, Any]) -> Iterator[Metric]:
        for kind, name, doc, key in _CHIEF_REPLICATION:
            family = (
                GaugeMetricFamily(name, doc) if kind == "gauge" else CounterMetricFamily(name, doc)
            )
            family.add_metric([], float(st.get(key, 0)))
            yield family
        copies = CounterMetricFamily(
            "zmqps_state_copies",
            "Copies of PS states made while training (re-replication), by outcome.",
            labels=["outcome"],
        )
        copies.add_metric(["made"], float(st.get("copies_made", 0)))
        copies.add_metric(["failed"], float(st.get("copies_failed", 0)))
        yield copies


#: The chief's elastic PS figures without labels: (kind, name, help, key of the figures
#: :meth:`Mover.figures` returns).
_CHIEF_ELASTIC = (
    (
        "gauge",
        "zmqps_placement_epoch",
        "The placement's epoch (it rises when PS states change processes: a move, a"
        " fail-over, a copy made).",
        "epoch",
    ),
    ("gauge", "zmqps_ps_serving", "PS processes serving PS states.", "serving"),
    (
        "gauge",
        "zmqps_ps_asked",
        "PS processes asked to serve the PS states (zmqps scale --ps; as started: those serving).",
        "asked",
    ),
    (
        "gauge",
        "zmqps_ps_move_in_progress",
        "1 while a PS state moves between PS processes, else 0.",
        "moving",
    ),
    (
        "gauge",
        "zmqps_ps_move_progress_ratio",
        "Share of the moving PS state's copy sent so far (0 when no state moves).",
        "move_progress",
    ),
    (
        "counter",
        "zmqps_ps_moved_bytes",
        "Bytes of PS states copied to the processes they moved to.",
        "moved_bytes",
    ),
    (
        "gauge",
        "zmqps_ps_drained",
        "PS processes left without states and told to shut down (not started again).",
        "drained",
    ),
)


class _ElasticCollector(_Read):
    """The chief's elastic PS figures (what its mover already counts), read at scrape
    time; zeros outside the chief (every process exports the whole catalogue)."""

    @staticmethod
    def _families(st: Mapping[str, Any]) -> Iterator[Metric]:
        for kind, name, doc, key in _CHIEF_ELASTIC:
            family = (
                GaugeMetricFamily(name, doc) if kind == "gauge" else CounterMetricFamily(name, doc)
            )
            family.add_metric([], float(st.get(key, 0)))
            yield family
        moves = CounterMetricFamily(
            "zmqps_ps_moves",
            "Moves of PS states between PS processes (zmqps scale, a PS joining), by"
            " outcome (done, failed: given up, the state stays where it was).",
            labels=["outcome"],
        )
        moves.add_metric(["done"], float(st.get("moves_done", 0)))
        moves.add_metric(["failed"], float(st.get("moves_failed", 0)))
        yield moves


class _TableCollector(_Read):
    """Hash-table metrics read from the PS's tables at scrape time (counters the
    tables already keep, so nothing is counted twice)."""

    @staticmethod
    def _families(stats: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
        rows = GaugeMetricFamily(
            "zmqps_table_rows", "Rows a hash-keyed table holds on this PS.", labels=["variable"]
        )
        created = CounterMetricFamily(
            "zmqps_table_rows_created",
            "Rows a hash-keyed table created on this PS (first touch or admission).",
            labels=["variable"],
        )
        admitted = CounterMetricFamily(
            "zmqps_table_rows_admitted",
            "Ids admitted after waiting for admit_after sightings.",
            labels=["variable"],
        )
        refused = CounterMetricFamily(
            "zmqps_table_gradients_not_admitted",
            "Row gradients dropped because their id was not admitted (yet).",
            labels=["variable"],
        )
        evicted = CounterMetricFamily(
            "zmqps_table_rows_evicted",
            "Rows a hash-keyed table dropped on this PS, by reason (budget, idle).",
            labels=["variable", "reason"],
        )
        for var, st in sorted(stats.items()):
            rows.add_metric([var], float(st.get("rows", 0)))
            created.add_metric([var], float(st.get("created", 0)))
            admitted.add_metric([var], float(st.get("admitted", 0)))
            refused.add_metric([var], float(st.get("not_admitted", 0)))
            for reason in EVICTION_REASONS:
                evicted.add_metric([var, reason], float(st.get("evicted", {}).get(reason, 0)))
        yield from (rows, created, admitted, refused, evicted)


_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """The zmqps metrics on one registry (``registry`` or a fresh one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.info = Info("zmqps", "The task this process runs.", registry=r)
        # -- transport (every role) ------------------------------------------------
        self.requests = Counter(
            "zmqps_requests_total",
            "Requests served, by op and status (ok or the error code).",
            ["op", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "zmqps_request_duration_seconds",
            "Time to serve a request, by op.",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.bytes_sent = Counter(
            "zmqps_bytes_sent_total", "Bytes of replies sent (frames).", registry=r
        )
        self.bytes_received = Counter(
            "zmqps_bytes_received_total", "Bytes of requests received (frames).", registry=r
        )
        self.auth_failures = Counter(
            "zmqps_auth_failures_total",
            "Clients a CURVE server refused, by reason (refused: key not allowed;"
            " handshake: plaintext client or wrong server key; data_refused: a data"
            " connection with no live session's credentials; data_handshake: one with"
            " none at all).",
            ["reason"],
            registry=r,
        )
        for reason in AUTH_FAILURE_REASONS:
            self.auth_failures.labels(reason)
        self.seal_refusals = Counter(
            "zmqps_seal_refusals_total",
            "Sealed bulk messages refused under CURVE, by reason (malformed, unknown_key,"
            " tampered, replayed: a replay or a reordering, exhausted: a key used up).",
            ["reason"],
            registry=r,
        )
        for reason in SEAL_REFUSAL_REASONS:
            self.seal_refusals.labels(reason)
        self.connections_refused = Counter(
            "zmqps_connections_refused_total",
            "Connections a server shut down at once because its socket held its bound"
            " of connections (ZMQPS_MAX_CONNECTIONS).",
            registry=r,
        )
        # -- parameter server ------------------------------------------------------
        self.staleness = Histogram(
            "zmqps_gradient_staleness",
            "Staleness (in updates of the shard) of a gradient when applied, by variable.",
            ["variable"],
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        self.dropped = Counter(
            "zmqps_gradients_dropped_total",
            "Pushes acknowledged or refused without being applied, by reason.",
            ["reason"],
            registry=r,
        )
        self.updates_applied = Counter(
            "zmqps_updates_applied_total",
            "Optimizer applications to a shard on this PS.",
            registry=r,
        )
        self.sparse_rows = Counter(
            "zmqps_sparse_rows",
            "Rows of row-sparse variables served (op=pull) or received (op=push) by a PS.",
            ["variable", "op"],
            registry=r,
        )
        self._tables = _TableCollector()
        r.register(self._tables)
        self._states = _StatesCollector()
        r.register(self._states)
        self.shard_bytes = Gauge(
            "zmqps_shard_bytes", "Bytes held by this PS's shards (values and slots).", registry=r
        )
        # -- chief -----------------------------------------------------------------
        self.global_step = Gauge("zmqps_global_step", "The chief's global step.", registry=r)
        self._replication = _ReplicationCollector()
        r.register(self._replication)
        self._elastic = _ElasticCollector()
        r.register(self._elastic)
        self.tokens_available = Gauge(
            "zmqps_sync_tokens_available", "Tokens waiting in the sync token queue.", registry=r
        )
        self.token_wait = Histogram(
            "zmqps_sync_token_wait_seconds",
            "Time a worker's take_token request waited for a token.",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.workers_alive = Gauge(
            "zmqps_workers_alive", "Workers the chief has heard from recently.", registry=r
        )
        self.cluster_examples = Gauge(
            "zmqps_cluster_examples",
            "Training examples of the run, as the workers reported them to the chief in"
            " their heartbeats (every worker, every incarnation).",
            registry=r,
        )
        self.cluster_loss = Gauge(
            "zmqps_cluster_loss",
            "Mean of the last training loss each live worker reported to the chief.",
            registry=r,
        )
        # -- worker ----------------------------------------------------------------
        self.examples = Counter(
            "zmqps_worker_examples_total", "Training examples processed by this worker.", registry=r
        )
        self.step_seconds = Histogram(
            "zmqps_worker_step_seconds",
            "Time a worker step spent in (or, overlapped, waiting for) one phase:"
            " pull, h2d, compute, d2h, push.",
            ["phase"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.train_loss = Gauge("zmqps_train_loss", "The last training loss seen.", registry=r)
        self.overlap_ratio = Gauge(
            "zmqps_worker_overlap_ratio",
            "Share of the worker's communication time (pull, push, host <-> device copies)"
            " hidden behind compute, over its last steps.",
            registry=r,
        )
        # -- checkpoints -----------------------------------------------------------
        self.checkpoint_duration = Histogram(
            "zmqps_checkpoint_duration_seconds",
            "Time to write one checkpoint.",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.checkpoint_last_step = Gauge(
            "zmqps_checkpoint_last_step", "Global step of the last checkpoint written.", registry=r
        )
        self.checkpoints = Counter(
            "zmqps_checkpoints_total",
            "Checkpoints attempted, by status (committed, failed).",
            ["status"],
            registry=r,
        )
        for status in ("committed", "failed"):
            self.checkpoints.labels(status)
        # -- recovery --------------------------------------------------------------
        self.restores = Counter(
            "zmqps_restores_total",
            "Cluster-wide restores of every shard to a committed checkpoint, by reason.",
            ["reason"],
            registry=r,
        )
        self.recovery_seconds = Histogram(
            "zmqps_recovery_seconds",
            "From detecting a lost PS to training resumed on restored shards.",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.generation = Gauge(
            "zmqps_generation", "Restores so far: the cluster's generation number.", registry=r
        )
        self.ps_down = Gauge(
            "zmqps_ps_down",
            "PS tasks that have not answered the chief for longer than the heartbeat timeout.",
            registry=r,
        )
        # -- evaluator -------------------------------------------------------------
        self.eval_accuracy = Gauge(
            "zmqps_eval_accuracy", "Accuracy of the last evaluated model.", registry=r
        )
        self.eval_loss = Gauge("zmqps_eval_loss", "Loss of the last evaluated model.", registry=r)
        self.eval_auc = Gauge(
            "zmqps_eval_auc",
            "AUC of the last evaluated click-through-rate model (its loss: the log loss).",
            registry=r,
        )
        self.eval_step = Gauge(
            "zmqps_eval_step", "Global step of the last evaluated model.", registry=r
        )
        self.evaluations = Counter(
            "zmqps_evaluations_total", "Models evaluated by the evaluator.", registry=r
        )
        # -- coordinator mode ------------------------------------------------------
        self.coordinator_scheduled = Counter(
            "zmqps_coordinator_scheduled_total",
            "Functions the coordinator scheduled onto workers.",
            registry=r,
        )
        self.coordinator_functions = Counter(
            "zmqps_coordinator_functions_total",
            "Scheduled functions finished, by outcome (ok, failed: the function raised,"
            " cancelled: never ran because an earlier one failed).",
            ["outcome"],
            registry=r,
        )
        for outcome in FUNCTION_OUTCOMES:
            self.coordinator_functions.labels(outcome)
        self.coordinator_retries = Counter(
            "zmqps_coordinator_retries_total",
            "Scheduled functions sent again to a worker because theirs died or restarted"
            " while running them (they run at least once).",
            registry=r,
        )
        self.coordinator_queue_depth = Gauge(
            "zmqps_coordinator_queue_depth",
            "Scheduled functions waiting for a worker.",
            registry=r,
        )
        self.coordinator_inflight = Gauge(
            "zmqps_coordinator_inflight",
            "Scheduled functions running on a worker now.",
            registry=r,
        )
        self.coordinator_workers_available = Gauge(
            "zmqps_coordinator_workers_available",
            "Worker servers answering the coordinator's pings.",
            registry=r,
        )
        self.coordinator_dispatch = Histogram(
            "zmqps_coordinator_dispatch_seconds",
            "Dispatch overhead of one scheduled function: the run request's round trip"
            " minus the function's execution time on the worker.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.worker_functions = Counter(
            "zmqps_worker_functions_total",
            "Scheduled functions (and per-worker dataset makers) a worker server ran,"
            " by status (ok, failed).",
            ["status"],
            registry=r,
        )
        self.worker_function_seconds = Histogram(
            "zmqps_worker_function_seconds",
            "Execution time of one scheduled function on a worker server (all its steps).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._counts: dict[tuple[str, str], Counter] = {}
        self._timers: dict[str, Histogram] = {}
        self._staleness: dict[str, Histogram] = {}
        self._rows: dict[tuple[str, str], Counter] = {}

    # -- identity ------------------------------------------------------------------

    def set_info(self, role: str, index: int, mode: str = "") -> None:
        self.info.info({"role": role, "index": str(index), "mode": mode, "version": __version__})

    def watch(self, gauge: Gauge, read: Callable[[], float]) -> None:
        """Make ``gauge`` read its value from ``read`` at scrape time."""
        gauge.set_function(read)

    # -- transport observer (zmqps.transport.base.TransportObserver) ------------------

    def request_done(self, op: str, status: str, seconds: float) -> None:
        # Label children are cached: .labels() costs more than the update itself.
        key = (op, status)
        count = self._counts.get(key)
        if count is None:
            count = self._counts[key] = self.requests.labels(op, status)
        count.inc()
        if status == "expired":  # dropped unserved: no latency to tell
            return
        timer = self._timers.get(op)
        if timer is None:
            timer = self._timers[op] = self.request_duration.labels(op)
        timer.observe(seconds)

    def bytes_in(self, n: int) -> None:
        self.bytes_received.inc(n)

    def bytes_out(self, n: int) -> None:
        self.bytes_sent.inc(n)

    def auth_failure(self, reason: str) -> None:
        self.auth_failures.labels(reason).inc()

    def seal_refused(self, reason: str) -> None:
        self.seal_refusals.labels(reason).inc()

    def connection_refused(self) -> None:
        self.connections_refused.inc()

    # -- parameter server ----------------------------------------------------------

    def applied(self, variable: str, staleness: int) -> None:
        self.updates_applied.inc()
        hist = self._staleness.get(variable)
        if hist is None:
            hist = self._staleness[variable] = self.staleness.labels(variable)
        hist.observe(staleness)

    def drop(self, reason: str) -> None:
        self.dropped.labels(reason).inc()

    def rows(self, variable: str, op: str, n: int) -> None:
        """``n`` rows of ``variable`` pulled or pushed (``op``)."""
        key = (variable, op)
        child = self._rows.get(key)
        if child is None:
            child = self._rows[key] = self.sparse_rows.labels(variable, op)
        child.inc(n)

    def watch_tables(self, read: TableStats) -> None:
        """Read the hash-table metrics from ``read`` at scrape time."""
        self._tables.read = read

    def watch_states(self, read: StateStats) -> None:
        """PS: read the replicated states' metrics from ``read`` at scrape time."""
        self._states.read = read

    def watch_replication(self, read: ReplicationStats) -> None:
        """Chief: read the replication figures from ``read`` at scrape time."""
        self._replication.read = read

    def watch_elastic(self, read: ElasticStats) -> None:
        """Chief: read the elastic PS figures (``Mover.figures``) at scrape time."""
        self._elastic.read = read

    # -- worker --------------------------------------------------------------------

    def phase(self, phase: str, seconds: float) -> None:
        self.step_seconds.labels(phase).observe(seconds)

    def step_done(self, loss: float | None, examples: int | None) -> None:
        if loss is not None:
            self.train_loss.set(loss)
        if examples:
            self.examples.inc(examples)

    # -- coordinator mode ----------------------------------------------------------

    def function_done(self, status: str, seconds: float) -> None:
        self.worker_functions.labels(status).inc()
        self.worker_function_seconds.observe(seconds)
