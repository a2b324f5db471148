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

from zmqps.checkpoint import Checkpoint
from zmqps.config import ClusterSpec
from zmqps.core.initializers import validate_init
from zmqps.core.membership import Membership
from zmqps.core.optimizers import make_optimizer
from zmqps.core.partition import Partitioner, plan
from zmqps.core.variables import Placement, VariableDef
from zmqps.metrics import Metrics
from zmqps.roles._run import run_server, start_exporter
from zmqps.roles.checkpointer import Checkpointer, CheckpointPolicy
from zmqps.roles.client import ParameterClient
from zmqps.roles.job import JobConfig
from zmqps.roles.sync import SyncConfig, SyncDriver
from zmqps.transport import Client, Requester, Server, SocketOptions, ZmqContext
from zmqps.wire import Message, reply
from zmqps.wire.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotReady,
    ProtocolError,
    ZmqpsError,
)

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
    checkpoint: CheckpointPolicy | None = None
    export_dir: str | None = None  # where the final model is exported (built-in jobs)
    stop_grace: float = 8.0  # SIGTERM: seconds for the final checkpoint before exiting


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
        self._creating: asyncio.Future[Placement] | None = None
        self.placement_ready = asyncio.Event()
        self.all_done = asyncio.Event()
        self.shutdown_requested = asyncio.Event()
        self.started = time.time()
        self.result: dict[str, Any] = {}
        #: restores so far; data requests of another generation are refused by the PS
        self.gen = 0
        #: while True, every PS is being restored: no tokens, workers wait
        self.recovering = False
        self.recoveries: list[dict[str, Any]] = []
        self.step_offset = 0  # async / ssp: steps of the run a checkpoint was taken in
        self.ps_boots: dict[int, str] = {}
        #: PS that have not answered ps_state for longer than the heartbeat timeout
        #: (dead, or cut off by a partition), by index: seconds of silence when found
        self.ps_down: dict[int, float] = {}
        self.checkpointer = (
            Checkpointer(cfg.checkpoint, self.ps, metrics, clock) if cfg.checkpoint else None
        )
        self.driver: asyncio.Task[None] | None = None
        self.driver_failed = asyncio.Event()
        self.driver_error: BaseException | None = None
        if metrics is not None:
            self._watch(metrics)

    def _watch(self, m: Metrics) -> None:
        """The chief's gauges read its state at scrape time (no per-event updates)."""
        m.set_info("chief", 0, self.mode)
        m.watch(m.global_step, lambda: self.global_step)
        m.watch(m.workers_alive, self._alive_count)
        m.watch(m.tokens_available, lambda: len(self.sync.tokens))
        m.watch(m.generation, lambda: self.gen)
        m.watch(m.ps_down, lambda: len(self.ps_down))

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
        if self.mode == "sync":
            return self.sync.global_step
        return self.step_offset + self.members.global_step

    @property
    def finished(self) -> bool:
        return self.all_done.is_set()

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
        if rejoin:
            await self._fence(f"worker:{b['index']}", b["incarnation"])
        await self.sync.membership_changed(rejoined=rejoin)
        info = self._cluster_info()
        # a new incarnation resumes its work where the earlier ones stopped
        info["steps_done"] = self.members.workers[b["index"]].steps_before
        return reply(msg, info)

    async def _fence(self, worker: str, incarnation: int) -> None:
        """Tell every PS that ``worker``'s incarnations before ``incarnation`` are gone,
        before the new one gets an answer: a late push of the old one is refused even if
        it comes first. A PS that cannot be told fences at the new one's first push."""

        async def one(c: Requester) -> None:
            try:
                await c.request("fence", {"worker": worker, "inc": incarnation}, timeout=2.0)
            except ZmqpsError as e:
                log.warning("could not fence %s on ps %s: %s", worker, c.endpoint, e)

        await asyncio.gather(*(one(c) for c in self.ps))

    def _cluster_info(self) -> dict[str, Any]:
        return {
            "ps": list(self.cfg.cluster.ps),
            "placement": None if self.placement is None else self.placement.to_wire(),
            "global_step": self.global_step,
            "mode": self.mode,
            "heartbeat_interval": self.cfg.heartbeat_interval,
            "gen": self.gen,
            "recovering": self.recovering,
        }

    def _op_heartbeat(self, msg: Message) -> Message:
        b = msg.body
        self.members.heartbeat(
            b["index"], b["incarnation"], b["step"], self.clock(), b.get("loss"), b.get("examples")
        )
        return reply(
            msg,
            {
                "global_step": self.global_step,
                "stop": False,
                "gen": self.gen,
                "recovering": self.recovering,
                "finished": self.finished,
                "ps_down": sorted(self.ps_down),
            },
        )

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
        return reply(msg, {"step": step, "gen": self.gen})

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
        wire = placement.to_wire()
        try:
            await asyncio.gather(
                *(self._create_on(i, defs, wire, deadline) for i, defs in by_ps.items() if defs)
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

    async def _create_on(
        self, ps: int, defs: list[dict[str, Any]], placement: dict[str, Any], deadline: float
    ) -> None:
        while True:
            # never wait past the deadline: a short startup_timeout must be honored
            timeout = min(2.0, max(0.01, deadline - time.monotonic()))
            body = {"shards": defs, "placement": placement}
            try:
                await self.ps[ps].request("create_shards", body, timeout=timeout)
                return
            except DeadlineExceeded:
                if time.monotonic() > deadline:
                    raise NotReady(
                        f"ps {ps} ({self.ps[ps].endpoint}) did not answer within"
                        f" {self.cfg.startup_timeout:g}s"
                    ) from None
                log.info("waiting for ps %d at %s", ps, self.ps[ps].endpoint)

    def _use_placement(self, placement: Placement) -> None:
        self.placement = placement
        done: asyncio.Future[Placement] = asyncio.get_running_loop().create_future()
        done.set_result(placement)
        self._creating = done
        self.placement_ready.set()

    # ---------------------------------------------------------------- recovery

    async def ps_states(self, timeout: float) -> list[dict[str, Any]]:
        """``ps_state`` of every PS, waiting up to ``timeout`` s for each to answer."""
        deadline = self.clock() + timeout

        async def one(i: int) -> dict[str, Any]:
            while True:
                left = deadline - self.clock()
                try:
                    rep = await self.ps[i].request("ps_state", timeout=max(0.05, min(2.0, left)))
                    return dict(rep.body)
                except DeadlineExceeded:
                    if self.clock() >= deadline:
                        raise NotReady(
                            f"ps {i} ({self.ps[i].endpoint}) did not answer within {timeout:g}s"
                        ) from None
                    log.info("waiting for ps %d at %s", i, self.ps[i].endpoint)

        return list(await asyncio.gather(*(one(i) for i in range(len(self.ps)))))

    async def resume(self) -> None:
        """At start: adopt the state of PS that already hold shards (this chief was
        restarted), or restore every PS from the latest checkpoint, or start fresh."""
        if self.checkpointer is not None:
            await asyncio.to_thread(self.checkpointer.clean)
        states = await self.ps_states(self.cfg.startup_timeout)
        self.ps_boots = {i: st["boot"] for i, st in enumerate(states)}
        self.gen = max(int(st["gen"]) for st in states)
        held = [st for st in states if st["shards"]]
        known = [st["placement"] for st in held if "placement" in st]
        if held and known:
            placement = Placement.from_wire(known[0])
            problem = self._inconsistency(states, placement)
            if problem is None:
                self._adopt(states, placement)
                return
            log.warning("the PS do not agree (%s): restoring every shard", problem)
            self._use_placement(placement)
            await self.restore_all("chief restart with PS in disagreement")
            return
        ckpt = None if self.checkpointer is None else self.checkpointer.latest()
        if ckpt is None:
            return  # a fresh start
        variables = tuple(ckpt.variable_defs())
        optimizer = dict(ckpt.manifest.optimizer)
        placement = plan(
            variables, len(self.ps), self.cfg.partitioner, self.cfg.placement, optimizer
        )
        self._use_placement(placement)
        if self.mode != "sync":
            self.step_offset = ckpt.step
        self.gen = max(self.gen, ckpt.manifest.generation)
        await self.restore_all("start", ckpt=ckpt)

    def _inconsistency(self, states: Sequence[dict[str, Any]], placement: Placement) -> str | None:
        gens = {int(st["gen"]) for st in states}
        if len(gens) > 1:
            return f"generations {sorted(gens)}"
        for i, st in enumerate(states):
            want = {s.id for s in placement.shards if s.ps == i}
            have = {int(sid) for sid, _ in st["shards"]}
            if want != have:
                return (
                    f"ps {i} holds shards {sorted(have)[:8]}, the placement says {sorted(want)[:8]}"
                )
        if self.mode == "sync":
            holders = sorted({s.ps for s in placement.shards})
            steps = {int(states[i]["step"]) for i in holders}
            if len(steps) > 1 and max(steps) - min(steps) > 1:
                return f"sync steps {sorted(steps)}"
        return None

    def _adopt(self, states: Sequence[dict[str, Any]], placement: Placement) -> None:
        self._use_placement(placement)
        holders = sorted({s.ps for s in placement.shards})
        step = min(int(states[i]["step"]) for i in holders)
        if self.mode == "sync":
            self.sync.global_step = step
        log.info(
            "adopted the running PS: %d variables, generation %d%s",
            len(placement.variables),
            self.gen,
            f", global step {step}" if self.mode == "sync" else "",
        )

    def _defs_by_ps(self, placement: Placement) -> dict[int, list[dict[str, Any]]]:
        by_ps: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(self.ps))}
        for ps, d in placement.shard_defs():
            by_ps[ps].append(d.to_wire())
        return by_ps

    async def restore_all(self, reason: str, ckpt: Checkpoint | None = None) -> int:
        """Restore every shard on every PS to ``ckpt`` (default: the latest committed
        checkpoint, or the initial values if there is none), all PS to one step, in a
        new generation. Returns the step restored."""
        placement = self.placement
        assert placement is not None
        if ckpt is None and self.checkpointer is not None:
            await self.checkpointer.cancel()
            ckpt = await asyncio.to_thread(self.checkpointer.latest)
        step = 0 if ckpt is None else ckpt.step
        sync_step = step if self.mode == "sync" else 0
        self.gen += 1
        body_base: dict[str, Any] = {
            "gen": self.gen,
            "step": sync_step,
            "placement": placement.to_wire(),
        }
        if ckpt is not None:
            body_base["name"] = ckpt.name
        if ckpt is None:
            log.warning("no committed checkpoint: every shard restarts from its initial values")
        await asyncio.gather(
            *(
                self.ps[i].request(
                    "restore", {**body_base, "shards": defs}, timeout=self.cfg.startup_timeout
                )
                for i, defs in self._defs_by_ps(placement).items()
            )
        )
        if self.mode == "sync":
            self.sync.global_step = sync_step
        if self.metrics is not None:
            self.metrics.restores.labels(reason.split()[0]).inc()
        log.info(
            "restored every shard to %s (step %d, generation %d): %s",
            "initial values" if ckpt is None else ckpt.name,
            step,
            self.gen,
            reason,
        )
        return step

    async def recover(self, lost: Sequence[int], detected_at: float, reason: str) -> None:
        """A PS lost its shards: stop handing out tokens, wait for every PS, restore every
        shard to the latest committed checkpoint, restart the sync driver."""
        if self.placement is None:
            return
        self.recovering = True
        started = self.clock()
        try:
            self._stop_driver()
            states = await self.ps_states(self.cfg.startup_timeout)
            self.ps_boots = {i: st["boot"] for i, st in enumerate(states)}
            self.gen = max([self.gen, *(int(st["gen"]) for st in states)])
            before = self.global_step
            step = await self.restore_all(reason)
            self._start_driver()
        finally:
            self.recovering = False
            async with self.sync.changed:
                self.sync.changed.notify_all()
        now = self.clock()
        record = {
            "reason": reason,
            "ps": list(lost),
            "step": step,
            "lost_steps": max(0, before - step) if self.mode == "sync" else None,
            "gen": self.gen,
            "detect_to_resume_s": round(now - detected_at, 3),
            "restore_s": round(now - started, 3),
            "at": time.time(),
        }
        self.recoveries.append(record)
        if self.metrics is not None:
            self.metrics.recovery_seconds.observe(now - detected_at)
        log.warning(
            "recovered from %s: every shard at step %d (generation %d), %.2fs after detection",
            reason,
            step,
            self.gen,
            now - detected_at,
        )

    # ---------------------------------------------------------------- driver

    def _start_driver(self) -> None:
        assert self.placement is not None
        holders = sorted({s.ps for s in self.placement.shards})

        async def drive() -> None:
            await self.sync.run(holders, start_step=self.sync.global_step)
            await self._checkpoint_loop()

        self.driver = asyncio.ensure_future(drive())
        self.driver.add_done_callback(self._driver_done)

    def _driver_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self.driver_error = task.exception()
        self.driver_failed.set()

    def _stop_driver(self) -> None:
        if self.driver is not None:
            self.driver.cancel()
            self.driver = None
        self.sync.started = False

    # ---------------------------------------------------------------- checkpoints

    def _extra(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "workers": {str(w.index): w.total_steps for w in self.members.workers.values()},
            "examples": self.members.examples,
        }

    async def sync_boundary(self, step: int) -> None:
        """Sync: called with every new global step, before its tokens are put; the PS
        are idle, so a snapshot here is one step everywhere."""
        ck = self.checkpointer
        if ck is None or self.placement is None or not ck.due(step):
            return
        snap = await ck.snapshot(step, self.placement)
        if snap is not None:
            ck.write(snap, self.placement, self.mode, self.gen, self._extra())

    async def _checkpoint_loop(self) -> None:
        """Async / SSP: checkpoint every N global steps or T seconds."""
        ck = self.checkpointer
        if ck is None or self.mode == "sync":
            await asyncio.Future()  # nothing to do; wait to be cancelled
            return
        while True:
            await asyncio.sleep(0.2)
            step = self.global_step
            if self.placement is not None and not self.recovering and ck.due(step):
                snap = await ck.snapshot(step, self.placement)
                if snap is not None:
                    ck.write(snap, self.placement, self.mode, self.gen, self._extra())

    async def workers_gone(self, timeout: float) -> None:
        """Wait up to ``timeout`` s until no worker is alive (each left, or is dead)."""
        deadline = self.clock() + timeout
        while self.members.alive(self.clock()) and self.clock() < deadline:
            await asyncio.sleep(0.05)

    async def final_checkpoint(self) -> None:
        """At the end (all done, or SIGTERM): one more checkpoint if anything changed."""
        ck = self.checkpointer
        if ck is None or self.placement is None or self.recovering:
            return
        await ck.wait()
        step = self.global_step
        if self.mode == "sync":
            step = await self.sync.applied_step()
            holders = sorted({s.ps for s in self.placement.shards})
            steps = {
                int(st["step"]) for i, st in enumerate(await self.ps_states(5.0)) if i in holders
            }
            if len(steps) > 1:
                log.warning(
                    "final checkpoint skipped: the PS are at different steps %s (a step was"
                    " cut short); %s stays the latest",
                    sorted(steps),
                    ck.last_committed.name if ck.last_committed else "nothing",
                )
                return
        if step <= ck.last_step:
            return
        await ck.take(step, self.placement, self.mode, self.gen, self._extra())

    async def _op_checkpoint(self, msg: Message) -> Message:
        """Take a checkpoint now (``zmqps`` tools and tests)."""
        ck = self.checkpointer
        if ck is None:
            raise InvalidArgument("the chief runs without --checkpoint-dir")
        if self.placement is None:
            raise NotReady("no variables yet")
        if self.mode != "sync":
            ckpt = await ck.take(
                self.global_step, self.placement, self.mode, self.gen, self._extra()
            )
        else:  # at the next step boundary
            before, ck.forced = ck.committed + ck.failed, True
            deadline = self.clock() + float(msg.body.get("wait", 60.0))
            while ck.committed + ck.failed == before or ck.busy:
                if self.clock() > deadline:
                    raise NotReady("no step boundary came in time for a checkpoint")
                await asyncio.sleep(0.05)
            ckpt = ck.last_committed if ck.committed + ck.failed > before else None
        if ckpt is None:
            raise InvalidArgument(f"checkpoint failed: {ck.last_error}")
        return reply(msg, {"name": ckpt.name, "step": ckpt.step})

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
            "ps_down": {str(i): s for i, s in sorted(self.ps_down.items())},
            "variables": 0 if self.placement is None else len(self.placement.variables),
            "shards": 0 if self.placement is None else len(self.placement.shards),
            "uptime_s": round(time.time() - self.started, 3),
            "finished": self.finished,
            "gen": self.gen,
            "recovering": self.recovering,
            "recoveries": self.recoveries[-5:],
            "checkpoints": None if self.checkpointer is None else self.checkpointer.status(),
        }

    async def _op_status(self, msg: Message) -> Message:
        out = self.status()
        if self.mode == "sync":
            down = [self.ps[i] for i in self.ps_down]
            out["waiting_on"] = await self.sync.waiting_on(out["workers_alive"], skip=down)
        return reply(msg, out)

    def _op_shutdown(self, msg: Message) -> Message:
        log.info("shutdown requested by %s", msg.sender or "?")
        self.shutdown_requested.set()
        return reply(msg)


async def _finish(service: ChiefService, ctx: ZmqContext) -> dict[str, Any]:
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
    if cfg.job is not None and cfg.job.is_ctr and service.placement is not None:
        from zmqps.roles.ctr_job import evaluate_ctr, export_ctr, table_summary

        client = ParameterClient(
            service.ps, service.placement, worker="chief", incarnation=0, shared_memory=False
        )
        client.gen = service.gen
        summary.update(await evaluate_ctr(client, cfg.job))
        summary["tables"] = await table_summary(service.ps)
        if cfg.export_dir:
            path = await export_ctr(client, cfg.job, cfg.export_dir, summary)
            summary["export_dir"] = str(path)
            log.info("exported the model (its tables' live rows) to %s", path)
        log.info("final model: %s", {k: v for k, v in summary.items() if "auc" in k})
    elif cfg.job is not None and service.placement is not None:
        test = cfg.job.load("test")
        model = cfg.job.build_model(test)
        client = ParameterClient(
            service.ps, service.placement, worker="chief", incarnation=0, shared_memory=False
        )
        client.gen = service.gen
        params = await client.pull()
        metrics = model.evaluate(params, test.x, test.y)
        summary.update(
            model=cfg.job.model,
            dataset=cfg.job.dataset,
            test_accuracy=round(float(metrics["accuracy"]), 4),
            test_loss=round(float(metrics["loss"]), 4),
        )
        if cfg.export_dir:
            from zmqps.export import export_model

            path = await asyncio.to_thread(
                export_model, cfg.export_dir, model.signature(), params, metrics=summary
            )
            summary["export_dir"] = str(path)
            log.info("exported the model to %s", path)
        log.info(
            "final model: test accuracy %.4f, test loss %.4f (global step %d)",
            summary["test_accuracy"],
            summary["test_loss"],
            service.global_step,
        )
    return summary


async def serve_chief(
    cfg: ChiefConfig,
    ctx: ZmqContext,
    options: SocketOptions | None = None,
    metrics: Metrics | None = None,
) -> dict[str, Any]:
    """Serve the chief until training ends; ``metrics``: a catalogue to fill and export
    (e.g. shared with a coordinator in this process; default: a fresh one when
    ``cfg.metrics_port`` is set)."""
    if metrics is None and cfg.metrics_port is not None:
        metrics = Metrics()
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
    service.sync.on_step = service.sync_boundary
    watcher = asyncio.ensure_future(_watch_workers(service))
    ps_watcher: asyncio.Future[None] | None = None
    starter = asyncio.ensure_future(_drive(service))
    try:
        await service.resume()
        ps_watcher = asyncio.ensure_future(_watch_ps(service))
        if cfg.job is not None and cfg.job.is_ctr:
            ctr = cfg.job.build_ctr_model(cfg.job.load_ctr("train"))
            await service.create_variables(ctr.variables(), dict(cfg.job.optimizer))
        elif cfg.job is not None:
            train = cfg.job.load("train")
            model = cfg.job.build_model(train)
            await service.create_variables(model.variables(), dict(cfg.job.optimizer))
        done = asyncio.ensure_future(service.all_done.wait())
        stop = asyncio.ensure_future(service.shutdown_requested.wait())
        failed = asyncio.ensure_future(service.driver_failed.wait())
        await asyncio.wait([done, stop, failed], return_when=asyncio.FIRST_COMPLETED)
        for t in (done, stop, failed):
            t.cancel()
        if service.driver_error is not None:
            raise service.driver_error
        if service.all_done.is_set():
            await service.final_checkpoint()
            service.result = await _finish(service, ctx)
            if cfg.summary_path:
                Path(cfg.summary_path).write_text(json.dumps(service.result, indent=2) + "\n")
            if cfg.keep_alive:
                await service.shutdown_requested.wait()
        else:  # SIGTERM / shutdown: one last checkpoint, within the grace period
            grace_ends = time.monotonic() + cfg.stop_grace
            # The workers were signalled too: they end their step and leave. Hear them
            # first (half the grace at most), so their last updates are in the final
            # checkpoint and their leave is answered.
            await service.workers_gone(cfg.stop_grace / 2)
            try:
                await asyncio.wait_for(
                    service.final_checkpoint(), max(0.1, grace_ends - time.monotonic())
                )
            except asyncio.TimeoutError:
                log.error("final checkpoint not committed within %.0fs", cfg.stop_grace)
        await _shutdown_ps(ps_clients)
    finally:
        watcher.cancel()
        starter.cancel()
        if ps_watcher is not None:
            ps_watcher.cancel()
        service._stop_driver()
        if service.checkpointer is not None:
            await service.checkpointer.cancel()
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
    """Once the variables exist (so the PS are up), start the sync / SSP driver and the
    checkpoint schedule."""
    await service.placement_ready.wait()
    service._start_driver()
    try:
        await asyncio.Future()  # a restore restarts the driver; cancel this to stop it
    finally:
        service._stop_driver()


async def _watch_ps(service: ChiefService) -> None:
    """Probe every PS each heartbeat interval. A PS that answers with another boot id
    (restarted) or another generation has lost its shards: restore every PS from the
    latest checkpoint. A PS that stops answering is reported down (``ps_down``; training
    waits for it: its shards exist nowhere else) until it is back.

    A probe still in flight when the interval ends counts as no answer yet, and the next
    probe of that PS waits for it: a silent PS is found within an interval of the
    heartbeat timeout, not after its probe's own timeout on top."""
    cfg = service.cfg
    interval = min(cfg.heartbeat_interval, cfg.heartbeat_timeout / 4)
    last_ok = {i: service.clock() for i in range(len(service.ps))}
    first_fail: dict[int, float] = {}
    down = service.ps_down
    inflight: dict[int, asyncio.Task[tuple[int, dict[str, Any] | None]]] = {}

    async def probe(i: int, gen: int) -> tuple[int, dict[str, Any] | None]:
        try:
            # attempts=2: a read, so it may be sent again, and is, at once, when the
            # connection comes back after a partition (the PS is heard without delay)
            rep = await service.ps[i].request(
                "ps_state", timeout=max(0.5, 2 * interval), attempts=2
            )
            return gen, dict(rep.body)
        except ZmqpsError:
            return gen, None

    def forget_probes() -> None:
        for t in inflight.values():
            t.cancel()
        inflight.clear()

    def answer(i: int) -> dict[str, Any] | None:
        task = inflight.get(i)
        if task is None or not task.done():
            return None
        del inflight[i]
        gen, st = task.result()
        # an answer to a probe sent before a restore describes the old generation
        return st if gen == service.gen else None

    try:
        while True:
            if service.placement is None or service.recovering:
                forget_probes()
            else:
                for i in range(len(service.ps)):
                    if i not in inflight:
                        inflight[i] = asyncio.ensure_future(probe(i, service.gen))
            await asyncio.sleep(interval)
            if not inflight or service.placement is None or service.recovering:
                continue
            now = service.clock()
            lost = []
            for i in range(len(service.ps)):
                st = answer(i)
                if st is None:
                    first_fail.setdefault(i, now)
                    if i not in down and now - last_ok[i] > cfg.heartbeat_timeout:
                        down[i] = round(now - last_ok[i], 3)
                        log.warning(
                            "ps %d (%s) has not answered for %.0fs: down;"
                            " waiting for it to come back",
                            i,
                            service.ps[i].endpoint,
                            now - last_ok[i],
                        )
                    continue
                last_ok[i] = now
                if i in down:
                    del down[i]
                    log.info("ps %d answers again", i)
                if st["boot"] != service.ps_boots.get(i) or int(st["gen"]) != service.gen:
                    lost.append(i)
                else:
                    first_fail.pop(i, None)
            if lost:
                forget_probes()
                detected = min(first_fail.get(i, now) for i in lost)
                log.warning("ps %s restarted without its shards: restoring every PS", lost)
                await service.recover(lost, detected, f"ps {','.join(map(str, lost))} restarted")
                for i in lost:
                    first_fail.pop(i, None)
    finally:
        forget_probes()


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


def run_chief(cfg: ChiefConfig, options: SocketOptions | None = None) -> int:
    return run_server(lambda ctx: serve_chief(cfg, ctx, options))
