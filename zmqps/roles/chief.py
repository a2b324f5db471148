"""The chief: membership, variable creation and placement, global step, end of training.

Rules of this module:

* The placement is computed once, here, and handed to every worker; creating
  variables is idempotent (same definitions: same placement; different: error).
* Shards are created on the PS before any worker learns the placement, so a
  worker that has a placement can always pull.
* When every worker has left with its work done, the chief evaluates the final
  model (built-in jobs), writes the summary, shuts the PS down and exits.
* :class:`ChiefService` is the request handler; IO (sockets, signals, timers)
  lives in :func:`serve_chief`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq.asyncio

from zmqps.config import ClusterSpec
from zmqps.core.initializers import validate_init
from zmqps.core.membership import Membership
from zmqps.core.optimizers import make_optimizer
from zmqps.core.partition import Partitioner, plan
from zmqps.core.variables import Placement, VariableDef
from zmqps.metrics import Metrics
from zmqps.roles._run import run_server, start_exporter
from zmqps.roles.client import ParameterClient
from zmqps.roles.job import JobConfig
from zmqps.roles.sync import SyncConfig, SyncDriver
from zmqps.transport import Client, Requester, Server, SocketOptions
from zmqps.wire import Message, reply
from zmqps.wire.errors import DeadlineExceeded, InvalidArgument, NotReady, ProtocolError

__all__ = ["ChiefConfig", "ChiefService", "run_chief", "serve_chief"]

log = logging.getLogger("zmqps.chief")


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


class ChiefService:
    def __init__(
        self,
        cfg: ChiefConfig,
        ps_clients: Sequence[Requester],
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.ps = list(ps_clients)
        self.clock = clock
        self.members = Membership(cfg.cluster.num_workers, cfg.heartbeat_timeout)
        self.sync = SyncDriver(cfg.sync, self.members, self.ps, clock)
        self.placement: Placement | None = None
        self._creating: asyncio.Task[Placement] | None = None
        self.placement_ready = asyncio.Event()
        self.all_done = asyncio.Event()
        self.shutdown_requested = asyncio.Event()
        self.started = time.time()
        self.result: dict[str, Any] = {}
        if metrics is not None:
            self._watch(metrics)

    def _watch(self, m: Metrics) -> None:
        """The chief's gauges read its state at scrape time (no per-event updates)."""
        m.set_info("chief", 0, self.mode)
        m.watch(m.global_step, lambda: self.global_step)
        m.watch(m.workers_alive, self._alive_count)
        m.watch(m.tokens_available, lambda: len(self.sync.tokens))

    def __call__(self, msg: Message) -> Any:
        handler = getattr(self, f"_op_{msg.op}", None)
        if handler is None:
            raise ProtocolError(f"the chief does not serve {msg.op!r}")
        return handler(msg)

    def _alive_count(self) -> float:
        # Runs in the exporter's thread: a worker registering meanwhile can change the
        # membership dict under the iteration; read again rather than fail the scrape.
        for _ in range(3):
            try:
                return len(self.members.alive(self.clock()))
            except RuntimeError:
                continue
        return float("nan")

    # ---------------------------------------------------------------- membership

    def _op_ping(self, msg: Message) -> Message:
        return reply(msg, {"role": "chief", "index": 0})

    @property
    def mode(self) -> str:
        return self.cfg.sync.mode

    @property
    def global_step(self) -> int:
        return self.sync.global_step if self.mode == "sync" else self.members.global_step

    async def _op_register(self, msg: Message) -> Message:
        b = msg.body
        if b["role"] != "worker":
            return reply(msg, self._cluster_info())
        rejoin = self.members.register(
            b["index"], b["incarnation"], self.clock(), b.get("steps_planned", 0)
        )
        log.info(
            "worker %d (incarnation %d) %s",
            b["index"],
            b["incarnation"],
            "rejoined" if rejoin else "registered",
        )
        await self.sync.membership_changed(rejoined=rejoin)
        return reply(msg, self._cluster_info())

    def _cluster_info(self) -> dict[str, Any]:
        return {
            "ps": list(self.cfg.cluster.ps),
            "placement": None if self.placement is None else self.placement.to_wire(),
            "global_step": self.global_step,
            "mode": self.mode,
            "heartbeat_interval": self.cfg.heartbeat_interval,
        }

    def _op_heartbeat(self, msg: Message) -> Message:
        b = msg.body
        self.members.heartbeat(
            b["index"], b["incarnation"], b["step"], self.clock(), b.get("loss"), b.get("examples")
        )
        return reply(msg, {"global_step": self.global_step, "stop": False})

    async def _op_take_token(self, msg: Message) -> Message:
        b = msg.body
        self.members.heartbeat(b["index"], b["incarnation"], 0, self.clock())
        if self.mode != "sync":
            raise InvalidArgument(f"take_token: the job runs in {self.mode} mode")
        taker = f"{b['index']}:{b['incarnation']}"
        started = time.perf_counter()
        try:
            step = await self.sync.take_token(taker, float(b.get("wait", 10.0)))
        finally:
            if self.metrics is not None:
                self.metrics.token_wait.observe(time.perf_counter() - started)
        return reply(msg, {"step": step})

    async def _op_ssp_clock(self, msg: Message) -> Message:
        b = msg.body
        self.members.heartbeat(b["index"], b["incarnation"], b["completed"], self.clock())
        if self.mode != "ssp":
            raise InvalidArgument(f"ssp_clock: the job runs in {self.mode} mode")
        slowest = await self.sync.ssp_clock(b["index"], b["completed"], float(b.get("wait", 10.0)))
        return reply(msg, {"slowest": slowest})

    async def _op_leave(self, msg: Message) -> Message:
        b = msg.body
        reason = b.get("reason", "done")
        self.members.leave(
            b["index"], b["incarnation"], b["step"], self.clock(), reason, b.get("examples")
        )
        log.info("worker %d left (%s) after %d steps", b["index"], reason, b["step"])
        if self.members.all_done():
            self.all_done.set()
        await self.sync.membership_changed(gone=[b["index"]])
        return reply(msg, {"global_step": self.global_step})

    # ---------------------------------------------------------------- variables

    async def _op_create_vars(self, msg: Message) -> Message:
        variables = tuple(VariableDef.from_wire(v) for v in msg.body["variables"])
        optimizer = dict(msg.body.get("optimizer") or self.cfg.optimizer)
        placement = await self.create_variables(variables, optimizer)
        return reply(msg, {"placement": placement.to_wire()})

    async def create_variables(
        self, variables: Sequence[VariableDef], optimizer: dict[str, Any]
    ) -> Placement:
        variables = tuple(variables)
        make_optimizer(optimizer)
        for v in variables:
            validate_init(v.init)
            if v.optimizer is not None:
                make_optimizer(v.optimizer)
        if self._creating is None:
            self._creating = asyncio.ensure_future(self._create(variables, optimizer))
        placement = await asyncio.shield(self._creating)
        if placement.variables != variables or dict(placement.optimizer) != optimizer:
            raise InvalidArgument(
                "variables were already created with different definitions"
                f" ({', '.join(v.name for v in placement.variables)})"
            )
        return placement

    async def _create(
        self, variables: tuple[VariableDef, ...], optimizer: dict[str, Any]
    ) -> Placement:
        try:
            placement = plan(
                variables, len(self.ps), self.cfg.partitioner, self.cfg.placement, optimizer
            )
        except InvalidArgument:
            self._creating = None
            raise
        by_ps: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(self.ps))}
        for ps, d in placement.shard_defs():
            by_ps[ps].append(d.to_wire())
        deadline = time.monotonic() + self.cfg.startup_timeout
        try:
            await asyncio.gather(
                *(self._create_on(i, defs, deadline) for i, defs in by_ps.items() if defs)
            )
        except BaseException:
            self._creating = None
            raise
        self.placement = placement
        self.placement_ready.set()
        log.info(
            "created %d variables in %d shards on %d PS (%s placement)",
            len(variables),
            len(placement.shards),
            len(self.ps),
            self.cfg.placement,
        )
        return placement

    async def _create_on(self, ps: int, defs: list[dict[str, Any]], deadline: float) -> None:
        while True:
            # never wait past the deadline: a short startup_timeout must be honored
            timeout = min(2.0, max(0.01, deadline - time.monotonic()))
            try:
                await self.ps[ps].request("create_shards", {"shards": defs}, timeout=timeout)
                return
            except DeadlineExceeded:
                if time.monotonic() > deadline:
                    raise NotReady(
                        f"ps {ps} ({self.ps[ps].endpoint}) did not answer within"
                        f" {self.cfg.startup_timeout:g}s"
                    ) from None
                log.info("waiting for ps %d at %s", ps, self.ps[ps].endpoint)

    async def _op_get_placement(self, msg: Message) -> Message:
        wait = float(msg.body.get("wait", 0.0))
        if self.placement is None and wait > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.placement_ready.wait(), wait)
        if self.placement is None:
            raise NotReady("variables have not been created yet")
        return reply(msg, {"placement": self.placement.to_wire()})

    # ---------------------------------------------------------------- status

    def status(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "role": "chief",
            **self.sync.status(),
            "global_step": self.global_step,
            "steps_planned": (
                self.members.max_steps_planned
                if self.mode == "sync"
                else self.members.steps_planned
            ),
            "examples": self.members.examples,
            "workers_expected": self.members.num_workers,
            "workers_alive": self.members.alive(now),
            "workers_dead": self.members.dead(now),
            "workers": self.members.snapshot(now),
            "ps": list(self.cfg.cluster.ps),
            "variables": 0 if self.placement is None else len(self.placement.variables),
            "shards": 0 if self.placement is None else len(self.placement.shards),
            "uptime_s": round(time.time() - self.started, 3),
        }

    async def _op_status(self, msg: Message) -> Message:
        out = self.status()
        if self.mode == "sync":
            out["waiting_on"] = await self.sync.waiting_on(out["workers_alive"])
        return reply(msg, out)

    def _op_shutdown(self, msg: Message) -> Message:
        log.info("shutdown requested by %s", msg.sender or "?")
        self.shutdown_requested.set()
        return reply(msg)


async def _finish(service: ChiefService, ctx: zmq.asyncio.Context) -> dict[str, Any]:
    """Evaluate the final model (built-in jobs) and build the summary."""
    cfg = service.cfg
    m = service.members
    first = m.first_registration or service.clock()
    train_s = max(1e-9, (m.all_done_at or service.clock()) - first)
    sync = service.mode == "sync"
    summary: dict[str, Any] = {
        "mode": service.mode,
        "ps": cfg.cluster.num_ps,
        "workers": cfg.cluster.num_workers,
        "global_step": await service.sync.applied_step() if sync else service.global_step,
        "worker_steps": m.global_step,
        "examples": m.examples,
        "train_seconds": round(train_s, 3),
        "examples_per_second": round(m.examples / train_s, 1),
    }
    if cfg.job is not None and service.placement is not None:
        test = cfg.job.load("test")
        model = cfg.job.build_model(test)
        client = ParameterClient(
            service.ps, service.placement, worker="chief", incarnation=0, shared_memory=False
        )
        params = await client.pull()
        metrics = model.evaluate(params, test.x, test.y)
        summary.update(
            model=cfg.job.model,
            dataset=cfg.job.dataset,
            test_accuracy=round(float(metrics["accuracy"]), 4),
            test_loss=round(float(metrics["loss"]), 4),
        )
        log.info(
            "final model: test accuracy %.4f, test loss %.4f (global step %d)",
            summary["test_accuracy"],
            summary["test_loss"],
            service.global_step,
        )
    return summary


async def serve_chief(
    cfg: ChiefConfig, ctx: zmq.asyncio.Context, options: SocketOptions | None = None
) -> dict[str, Any]:
    metrics = Metrics() if cfg.metrics_port is not None else None
    ps_clients = [
        Client(ctx, addr, "chief:0", options=options, timeout=30.0) for addr in cfg.cluster.ps
    ]
    service = ChiefService(cfg, ps_clients, metrics=metrics)
    server = Server(ctx, cfg.bind, service, name="chief", options=options, observer=metrics)
    # The task's own address first (the cluster spec names it); the metrics port after,
    # so a metrics port picked as 0 can never take it.
    endpoint = server.bind()
    try:
        exporter = start_exporter(metrics, cfg.metrics_host, cfg.metrics_port, "chief")
    except OSError:
        await server.stop()
        for c in ps_clients:
            await c.close()
        raise
    log.info(
        "chief: serving on %s (%d PS, %d workers)",
        endpoint,
        cfg.cluster.num_ps,
        cfg.cluster.num_workers,
    )
    server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.shutdown_requested.set)
    watcher = asyncio.ensure_future(_watch_workers(service))
    driver = asyncio.ensure_future(_drive(service))
    try:
        if cfg.job is not None:
            train = cfg.job.load("train")
            model = cfg.job.build_model(train)
            await service.create_variables(model.variables(), dict(cfg.job.optimizer))
        done = asyncio.ensure_future(service.all_done.wait())
        stop = asyncio.ensure_future(service.shutdown_requested.wait())
        await asyncio.wait([done, stop, driver], return_when=asyncio.FIRST_COMPLETED)
        for t in (done, stop):
            t.cancel()
        if driver.done() and not driver.cancelled() and driver.exception() is not None:
            raise driver.exception()  # type: ignore[misc]
        if service.all_done.is_set():
            service.result = await _finish(service, ctx)
            if cfg.summary_path:
                Path(cfg.summary_path).write_text(json.dumps(service.result, indent=2) + "\n")
            if cfg.keep_alive:
                await service.shutdown_requested.wait()
        await _shutdown_ps(ps_clients)
    finally:
        watcher.cancel()
        driver.cancel()
        await server.stop()
        if exporter is not None:
            exporter.close()
        for c in ps_clients:
            await c.close()
    return service.result


async def _shutdown_ps(ps_clients: Sequence[Requester]) -> None:
    async def one(c: Requester) -> None:
        try:
            await c.request("shutdown", {"reason": "training finished"}, timeout=5.0)
        except DeadlineExceeded:
            log.warning("ps at %s did not acknowledge shutdown", c.endpoint)

    await asyncio.gather(*(one(c) for c in ps_clients))


async def _drive(service: ChiefService) -> None:
    """Once the variables exist (so the PS are up), run the sync / SSP driver."""
    await service.placement_ready.wait()
    assert service.placement is not None
    await service.sync.run(sorted({s.ps for s in service.placement.shards}))
    await asyncio.Future()  # async / ssp: nothing more to drive; wait to be cancelled


async def _watch_workers(service: ChiefService) -> None:
    """Log every worker that stops heartbeating (and every one that comes back); a death
    shrinks M (and N if needed) so no step waits for a dead worker."""
    dead: set[int] = set()
    while True:
        await asyncio.sleep(min(service.cfg.heartbeat_interval, service.cfg.heartbeat_timeout / 4))
        now_dead = set(service.members.dead(service.clock()))
        for i in sorted(now_dead - dead):
            log.warning(
                "worker %d missed heartbeats for %.0fs: considered dead",
                i,
                service.cfg.heartbeat_timeout,
            )
        for i in sorted(dead - now_dead):
            log.info("worker %d is back", i)
        if now_dead != dead:
            await service.sync.membership_changed(gone=sorted(now_dead - dead))
        dead = now_dead


def run_chief(cfg: ChiefConfig) -> int:
    return run_server(lambda ctx: serve_chief(cfg, ctx))
