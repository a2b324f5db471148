"""The worker: a synchronous API for training loops, and the built-in training program.

Rules of this module:

* :class:`Worker` is what users call from their own training loop. Every call
  hops onto a private asyncio loop (a background thread) that owns the sockets,
  so the loop can heartbeat the chief while the user's code computes.
* One push is one step of this worker; steps, examples and the last loss travel
  to the chief with every heartbeat.
* :meth:`Worker.begin_step` is where the consistency model lives, so one loop
  serves every mode: async returns at once; sync takes a token from the chief
  (long polls, no busy waiting) and tags the step's pushes with its value; ssp
  waits until the slowest live worker is close enough.
* The incarnation identifies this process run: a restarted worker registers
  with a newer one, and the PS fence pushes of the old one.
* Arrays returned by :meth:`Worker.pull` belong to the worker and are refreshed
  in place by the next pull; copy them to keep them.
* ``device="cuda:N"``: :meth:`Worker.pull` returns cupy arrays on that GPU (landed
  in pinned host buffers, then copied on a copy stream) and :meth:`Worker.push`
  takes cupy gradients (copied to pinned buffers, then sent); see
  :mod:`zmqps.device`. :class:`zmqps.roles.overlap.StepPipeline` overlaps those
  copies and the network with compute.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from zmqps.config import ClusterSpec, TaskSpec
from zmqps.core.variables import Placement, VariableDef
from zmqps.data import batches, shard, steps_per_epoch
from zmqps.device import Device
from zmqps.device.staging import Mirror
from zmqps.metrics import Metrics
from zmqps.roles.client import ParameterClient
from zmqps.roles.job import JobConfig
from zmqps.roles.overlap import StepPipeline
from zmqps.transport import Client, LoopThread, SocketOptions, new_context
from zmqps.wire.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    NotReady,
    RolledBack,
    ShutdownError,
)

__all__ = ["Terminated", "Worker", "train"]

log = logging.getLogger("zmqps.worker")

Array = npt.NDArray[Any]
T = TypeVar("T")


class Terminated(BaseException):
    """Raise it (e.g. from a SIGTERM handler) to make ``with Worker(...)`` leave as terminated."""


class Worker:
    """A connection of one worker task to the cluster (chief + every PS).

    >>> w = Worker("127.0.0.1:2222", index=0)                 # doctest: +SKIP
    >>> w.create_variables([VariableDef("w", (13, 1))], optimizer={"name": "sgd", "lr": 0.1})
    >>> params = w.pull(); ...; w.push(grads, loss=loss)       # doctest: +SKIP
    >>> w.close()                                              # doctest: +SKIP
    """

    def __init__(
        self,
        chief: str,
        index: int = 0,
        *,
        role: str = "worker",
        incarnation: int | None = None,
        timeout: float = 30.0,
        connect_timeout: float = 120.0,
        steps_planned: int = 0,
        chunk_bytes: int = 4 << 20,
        shared_memory: bool = True,
        options: SocketOptions | None = None,
        metrics: Metrics | None = None,
        recovery_timeout: float = 300.0,
        device: str | Device | None = None,
    ) -> None:
        #: where the parameters and gradients of :meth:`pull` / :meth:`push` live
        self.device = Device.parse(device).check()
        self.device.use()  # the calling thread computes on it (cupy's current device)
        self._mirror: Mirror | None = None
        self.index = index
        self.metrics = metrics
        self.role = role
        self.name = f"{role}:{index}"
        self.incarnation = time.time_ns() // 1000 if incarnation is None else incarnation
        self.timeout = timeout
        self.step = 0
        self.examples = 0
        self.loss: float | None = None
        self.token: int | None = None  # sync: the step this worker is computing
        self.token_gen = 0  # the generation the token was handed out in
        self._options = options
        self._chunk_bytes = chunk_bytes
        self._shared_memory = shared_memory
        self._io = LoopThread(f"zmqps-{role}-{index}")
        self._ctx = new_context()
        self._closed = False
        self._client: ParameterClient | None = None
        self._heartbeat: asyncio.Future[None] | None = None
        self._steps_planned = steps_planned
        self.recovery_timeout = recovery_timeout
        #: pushes dropped because the cluster was restored meanwhile (their values are gone)
        self.rolled_back = 0
        #: set by a SIGTERM handler: the built-in loop stops after the current step
        self.stop_requested = False
        self._chief = self._io.run(self._connect_chief(chief))
        try:
            info = self._io.run(self._register(connect_timeout, steps_planned))
        except BaseException:
            self._teardown()
            raise
        self.ps_addresses: list[str] = list(info["ps"])
        self.mode: str = info["mode"]
        self.gen = int(info.get("gen", 0))
        #: steps earlier incarnations of this worker did (the built-in loop skips them)
        self.steps_done = int(info.get("steps_done", 0))
        self._heartbeat_interval = float(info["heartbeat_interval"])
        if info["placement"] is not None:
            self._use(Placement.from_wire(info["placement"]))
        if metrics is not None:
            metrics.set_info(role, index, self.mode)
        self._heartbeat = asyncio.run_coroutine_threadsafe(self._heartbeats(), self._io.loop)  # type: ignore[assignment]

    @classmethod
    def from_cluster(cls, cluster: ClusterSpec, task: TaskSpec, **kwargs: Any) -> Worker:
        if cluster.chief is None:
            raise NotReady("the cluster spec has no chief")
        return cls(cluster.chief, task.index, role=task.role, **kwargs)

    # ------------------------------------------------------------------ setup

    async def _connect_chief(self, address: str) -> Client:
        return Client(
            self._ctx,
            address,
            f"{self.name}:{self.incarnation}",
            options=self._options,
            timeout=self.timeout,
            observer=self.metrics,
        )

    async def _register(self, connect_timeout: float, steps_planned: int) -> dict[str, Any]:
        deadline = time.monotonic() + connect_timeout
        body = {
            "role": self.role,
            "index": self.index,
            "incarnation": self.incarnation,
            "steps_planned": steps_planned,
        }
        while True:
            try:
                rep = await self._chief.request("register", body, timeout=2.0)
                return dict(rep.body)
            except DeadlineExceeded:
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        f"chief at {self._chief.endpoint} did not answer"
                        f" within {connect_timeout:g}s"
                    ) from None
                log.info("%s: waiting for the chief at %s", self.name, self._chief.endpoint)

    def _use(self, placement: Placement) -> None:
        async def make() -> ParameterClient:
            # An identity per incarnation (as toward the chief): a paused old incarnation
            # that resumes must not take this one's connections over (ROUTER_HANDOVER).
            identity = f"{self.name}:{self.incarnation}"
            clients = [
                Client(
                    self._ctx,
                    addr,
                    identity,
                    options=self._options,
                    timeout=self.timeout,
                    observer=self.metrics,
                )
                for addr in self.ps_addresses
            ]
            return ParameterClient(
                clients,
                placement,
                worker=self.name,
                incarnation=self.incarnation,
                chunk_bytes=self._chunk_bytes,
                timeout=self.timeout,
                shared_memory=self._shared_memory,
            )

        self._client = self._io.run(make())
        self._client.gen = self.gen
        self._mirror = None

    @property
    def client(self) -> ParameterClient:
        if self._client is None:
            raise NotReady("no variables yet: call create_variables() or wait_for_variables()")
        return self._client

    @property
    def placement(self) -> Placement:
        return self.client.placement

    def create_variables(
        self, variables: Sequence[VariableDef], optimizer: Mapping[str, Any] | None = None
    ) -> Placement:
        """Create the model's variables (idempotent: every worker may call it)."""
        body: dict[str, Any] = {"variables": [v.to_wire() for v in variables]}
        if optimizer is not None:
            body["optimizer"] = dict(optimizer)
        rep = self._io.run(
            self._chief.request("create_vars", body, timeout=max(self.timeout, 130.0))
        )
        placement = Placement.from_wire(rep.body["placement"])
        if self._client is None or self._client.placement != placement:
            self._use(placement)
        return placement

    def wait_for_variables(self, timeout: float = 120.0) -> Placement:
        """Block until some other task created the variables."""
        rep = self._io.run(
            self._chief.request("get_placement", {"wait": timeout}, timeout=timeout + 5.0)
        )
        placement = Placement.from_wire(rep.body["placement"])
        self._use(placement)
        return placement

    # ------------------------------------------------------------------ training

    @property
    def global_step(self) -> int:
        """The global step as last seen: updates applied to the model (async, ssp), or
        the step of this worker's token (sync)."""
        seen = 0 if self._client is None else self._client.global_step
        return max(seen, self.token or 0)

    @property
    def staleness(self) -> int:
        """Staleness (in updates) of this worker's last push, as measured by the PS."""
        return 0 if self._client is None else self._client.last_staleness

    def begin_step(self, poll: float = 10.0) -> int:
        """Wait until this worker may start its next step; returns the step it computes.

        async: returns at once (this worker's local step). sync: takes a token from
        the chief's queue and returns its value (the global step the gradients are
        for). ssp: waits while this worker is more than ``max_staleness`` steps ahead
        of the slowest live worker. Waiting is done by long polls of ``poll`` seconds.
        """
        if self.mode == "sync":
            self._take_token(poll)
            return int(self.token or 0)
        if self.mode == "ssp":
            self._io.run(self._long_poll("ssp_clock", {"completed": self.step}, poll))
        return self.step

    def _take_token(self, poll: float) -> None:
        rep = self._io.run(self._long_poll("take_token", {}, poll))
        self.token = int(rep["step"])
        self.token_gen = int(rep.get("gen", self.gen))

    async def _long_poll(self, op: str, extra: dict[str, Any], poll: float) -> dict[str, Any]:
        body = {"role": self.role, "index": self.index, "incarnation": self.incarnation, **extra}
        body["wait"] = poll
        while True:
            try:
                rep = await self._chief.request(op, body, timeout=poll + 10.0)
                return dict(rep.body)
            except NotReady:
                continue  # nothing yet: ask again (the chief holds each poll open)
            except NotFound:
                await self._reregister()  # a restarted chief does not know this worker
            except DeadlineExceeded:
                log.warning("%s: the chief did not answer %s; retrying", self.name, op)

    async def _reregister(self) -> None:
        log.warning("%s: the chief does not know this worker (restarted?): registering", self.name)
        info = await self._register(self.recovery_timeout, self._steps_planned)
        if int(info.get("gen", self.gen)) != self.gen:
            log.warning("%s: the cluster is at generation %s now", self.name, info.get("gen"))

    async def _chief_state(self) -> dict[str, Any]:
        """A heartbeat round trip: the chief's generation and whether it is restoring."""
        body = {
            "role": self.role,
            "index": self.index,
            "incarnation": self.incarnation,
            "step": self.step,
            "examples": self.examples,
        }
        while True:
            try:
                rep = await self._chief.request("heartbeat", body, timeout=5.0)
                return dict(rep.body)
            except NotFound:
                await self._reregister()
            except DeadlineExceeded:
                log.warning("%s: the chief does not answer; retrying", self.name)

    async def _resync(self, error: Exception) -> None:
        """A PS refused or failed a data request: wait until the chief has restored the
        cluster into a generation newer than this worker's values (or say why not)."""
        old = self.gen
        log.warning("%s: %s; waiting for the cluster to recover", self.name, error)
        deadline = time.monotonic() + self.recovery_timeout
        while True:
            state = await self._chief_state()
            gen = int(state.get("gen", old))
            if gen != old and not state.get("recovering", False):
                break
            if _unreachable_again(error, gen, old, state):
                log.warning("%s: every PS answers the chief again: retrying", self.name)
                return
            if time.monotonic() > deadline:
                raise DeadlineExceeded(
                    f"{self.name}: the cluster did not recover within"
                    f" {self.recovery_timeout:g}s ({error})"
                ) from error
            await asyncio.sleep(0.2)
        self.gen = gen
        if self.token_gen != gen:
            self.token = None  # a token of before the restore is void
        if self._client is not None and self._client.gen != gen:
            self._client.restored(gen)
        log.warning("%s: resuming in generation %d", self.name, gen)

    def _recovering(self, call: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run a data request; through a restore, resync and run it again."""
        while True:
            try:
                return self._io.run(call())
            except (RolledBack, NotReady, DeadlineExceeded) as e:
                self._io.run(self._resync(e))

    def _step_tag(self) -> int | None:
        if self.mode != "sync":
            return None
        if self.token is None:
            raise InvalidArgument("sync mode: call begin_step() before pushing")
        return self.token

    @property
    def mirror(self) -> Mirror:
        """Pinned host buffers and device arrays of the dense variables (a separate device)."""
        if self._mirror is None:
            client = self.client
            variables = [client.placement.variable(n) for n in client.dense_names()]
            self._mirror = Mirror(self.device, variables, slots=1)
        return self._mirror

    def pull(
        self, names: Iterable[str] | None = None, *, out: Mapping[str, Array] | None = None
    ) -> dict[str, Any]:
        """Current values of the dense variables (or ``names``): on the worker's device,
        or landed in the host arrays ``out`` (of the variables' shapes and dtypes)."""
        started = time.perf_counter()
        wanted = None if names is None else list(names)
        staged = out is None and self.device.separate
        dest = self.mirror.host[0] if staged else out
        had_token = self.token is not None
        values = self._recovering(lambda: self.client.pull(wanted, out=dest))
        if had_token and self.token is None and self.mode == "sync":
            # restored meanwhile, and the token was of before: these values are of the
            # restored step; compute for it
            self._take_token(10.0)
        self.record_phase("pull", started)
        if not staged:
            return values
        started = time.perf_counter()
        self.mirror.upload(0, values).wait()
        self.record_phase("h2d", started)
        return {n: self.mirror.dev[0][n] for n in values}

    def _to_host(self, grads: Mapping[str, Any]) -> Mapping[str, Any]:
        """Gradients on the device: copied to pinned host buffers (waited for)."""
        if not self.device.separate:
            return grads
        started = time.perf_counter()
        host, copy = self.mirror.download(grads)
        copy.wait()
        self.record_phase("d2h", started)
        return host

    def record_phase(self, phase: str, started: float) -> None:
        """Time one phase (pull, compute, push) of a step that began at ``started``
        (a :func:`time.perf_counter` value); a no-op without metrics."""
        if self.metrics is not None:
            self.metrics.phase(phase, time.perf_counter() - started)

    def _count(self, loss: float | None, examples: int | None) -> None:
        self.step += 1
        if loss is not None:
            self.loss = float(loss)
        if examples is not None:
            self.examples += int(examples)
        if self.metrics is not None:
            self.metrics.step_done(self.loss if loss is not None else None, examples)

    def push(
        self, grads: Mapping[str, Any], *, loss: float | None = None, examples: int | None = None
    ) -> bool:
        """Push one step's gradients. async / ssp: each PS applies them on arrival; sync:
        they count toward the step of the token taken by :meth:`begin_step`. Returns
        False if they were dropped (sync: stale, the step had already been applied),
        or if this was a retry of a push the PS had already handled (whose first
        outcome this call cannot know)."""
        grads = self._to_host(grads)
        started = time.perf_counter()
        accepted = self._push_or_drop(lambda: self.client.push(grads, step=self._step_tag()))
        self.record_phase("push", started)
        self._count(loss, examples)
        return accepted

    def _push_or_drop(self, call: Callable[[], Coroutine[Any, Any, bool]]) -> bool:
        """Push; if the cluster was restored meanwhile, the gradient is of values that no
        longer exist: drop it (counted) and resync, so the next pull is of the new ones."""
        try:
            return self._io.run(call())
        except (RolledBack, NotReady, DeadlineExceeded) as e:
            self._io.run(self._resync(e))
            self.rolled_back += 1
            return False

    def push_pull(
        self, grads: Mapping[str, Any], *, loss: float | None = None, examples: int | None = None
    ) -> dict[str, Array]:
        """Push gradients and get the updated values back in the same round trip
        (timed as the push phase; on a separate device: a push, then a pull)."""
        if self.device.separate:
            self.push(grads, loss=loss, examples=examples)
            return self.pull()
        gen_before = self.gen
        started = time.perf_counter()
        if (
            not self._push_or_drop(
                lambda: self.client.push(grads, pull=True, step=self._step_tag())
            )
            and self.gen != gen_before
        ):
            self._recovering(lambda: self.client.pull())
        self.record_phase("push", started)
        self._count(loss, examples)
        return self.client.params

    def pull_rows(self, name: str, ids: Any, *, create: bool = True) -> Array:
        """Rows ``ids`` of the embedding variable ``name``; ``create=False`` reads
        without creating or touching rows of a hash-keyed table (evaluation, serving)."""
        return self._recovering(lambda: self.client.pull_rows(name, ids, create=create))

    def pull_rows_async(
        self, lookups: Mapping[str, Any]
    ) -> concurrent.futures.Future[dict[str, Array]]:
        """Start pulling rows of several tables now (``{name: ids}``, all concurrently)
        and return at once, so the pull overlaps with compute; ``.result()`` waits.
        A restore meanwhile surfaces from ``result()``: call :meth:`pull_rows` then."""

        async def pull_all() -> dict[str, Array]:
            names = list(lookups)
            got = await asyncio.gather(*(self.client.pull_rows(n, lookups[n]) for n in names))
            return dict(zip(names, got, strict=True))

        return self._io.submit(pull_all())

    def push_rows(self, name: str, ids: Any, grads: Any) -> bool:
        """Row gradients for the embedding variable ``name`` (duplicate ids are summed)."""
        return self._push_or_drop(
            lambda: self.client.push_rows(name, ids, grads, step=self._step_tag())
        )

    # ------------------------------------------------------------------ liveness

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_interval)
            body: dict[str, Any] = {
                "role": self.role,
                "index": self.index,
                "incarnation": self.incarnation,
                "step": self.step,
                "examples": self.examples,
            }
            if self.loss is not None and np.isfinite(self.loss):
                body["loss"] = self.loss
            try:
                rep = await self._chief.request(
                    "heartbeat", body, timeout=max(2.0, self._heartbeat_interval * 3)
                )
                gen = rep.body.get("gen")
                client = self._client
                if (
                    isinstance(gen, int)
                    and client is not None
                    and gen != client.gen
                    and not rep.body.get("recovering")
                ):
                    log.warning("%s: the cluster was restored (generation %d)", self.name, gen)
                    client.restored(gen)  # requests waiting on a lost PS fail now
            except NotFound:
                await self._reregister()
            except DeadlineExceeded:
                log.warning("%s: chief did not answer a heartbeat", self.name)
            except ShutdownError:
                return

    def close(self, reason: str = "done") -> None:
        """Leave the cluster (``reason`` "done" counts this worker's work as finished)."""
        if self._closed:
            return
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        body = {
            "role": self.role,
            "index": self.index,
            "incarnation": self.incarnation,
            "step": self.step,
            "examples": self.examples,
            "reason": reason,
        }
        try:
            try:
                self._io.run(self._chief.request("leave", body, timeout=10.0, attempts=2))
            except NotFound:
                self._io.run(self._reregister())
                self._io.run(self._chief.request("leave", body, timeout=10.0, attempts=2))
        except DeadlineExceeded:
            log.warning("%s: the chief did not acknowledge leave", self.name)
        finally:
            self._teardown()

    def _teardown(self) -> None:
        async def close_all() -> None:
            if self._client is not None:
                await self._client.close()
            clients = [self._chief] + (self._client.ps if self._client is not None else [])
            for c in clients:
                await c.close()

        try:
            self._io.run(close_all(), timeout=10)
        finally:
            self._io.stop()
            self._ctx.term()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close("done")
        elif issubclass(exc_type, (Terminated, KeyboardInterrupt, SystemExit)):
            self.close("terminated")
        else:
            self.close("error")


def train(
    worker: Worker, job: JobConfig, num_workers: int, *, prefetch: bool = False
) -> dict[str, Any]:
    """The built-in training program: this worker's shard of the data, ``job.epochs``
    epochs, on the worker's device, communication overlapped with compute (see
    :mod:`zmqps.roles.overlap`; ``prefetch`` there)."""
    if job.is_ctr:
        from zmqps.roles.ctr_job import train_ctr

        return train_ctr(worker, job, num_workers)
    data = shard(job.load("train"), worker.index, num_workers)
    model = job.build_model(data)
    worker.create_variables(model.variables(), optimizer=job.optimizer)
    pipe = StepPipeline(worker, prefetch=prefetch)
    device = worker.device
    per_epoch = steps_per_epoch(len(data), job.batch_size)
    log.info(
        "worker %d: %d examples, %d steps per epoch, %d epochs, on %s",
        worker.index,
        len(data),
        per_epoch,
        job.epochs,
        device,
    )
    t_last, s_last = time.perf_counter(), 0
    loss = float("nan")
    skip = worker.steps_done
    if skip:
        log.info("worker %d: resuming after the %d steps of earlier runs", worker.index, skip)
    try:
        for epoch in range(job.epochs):
            for x, y in batches(data, job.batch_size, epoch, seed=job.seed * 1000 + worker.index):
                if skip:
                    skip -= 1
                    continue
                params = pipe.begin()
                started = time.perf_counter()
                loss, grads = model.loss_and_grads(
                    params, device.asarray(x), device.asarray(y), on_ready=pipe.grads_ready
                )
                worker.record_phase("compute", started)
                pipe.end(grads, loss=loss, examples=len(x))
                if worker.stop_requested:
                    raise Terminated()
                if worker.step % job.log_every == 0:
                    now = time.perf_counter()
                    log.info(
                        "worker %d: step %d, global step %d, loss %.4f (%.4f s/batch,"
                        " staleness %d, overlap %.2f)",
                        worker.index,
                        worker.step,
                        worker.global_step,
                        loss,
                        (now - t_last) / max(1, worker.step - s_last),
                        worker.staleness,
                        pipe.stats.overlap,
                    )
                    t_last, s_last = now, worker.step
    finally:
        pipe.close()
    log.info(
        "worker %d: done after %d steps (global step %d, loss %.4f, overlap %.2f)",
        worker.index,
        worker.step,
        worker.global_step,
        loss,
        pipe.stats.overlap,
    )
    return {"steps": worker.step, "loss": loss, "overlap": pipe.stats.as_dict()}


def _unreachable_again(error: Exception, gen: int, old: int, state: Mapping[str, Any]) -> bool:
    """A request timed out, yet the cluster was not restored and the chief hears every
    PS: the PS was cut off (a partition) with its shards intact, not lost. No restore
    will come, so waiting for one would wait forever: retry instead (a retried push
    carries its sequence number, so it is applied at most once)."""
    return (
        isinstance(error, DeadlineExceeded)
        and gen == old
        and not state.get("recovering", False)
        and not state.get("ps_down")
    )
