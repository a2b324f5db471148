"""Training steps with communication overlapped with compute, on any device.

    pipe = StepPipeline(worker)                    # after create_variables()
    params = pipe.begin()                          # this step's values, on the device
    loss, grads = model.loss_and_grads(params, x, y, on_ready=pipe.grads_ready)
    pipe.end(grads, loss=loss, examples=len(x))

    # or, on every tower of the worker (Worker(devices=...)); the same with one device:
    pipe.begin()
    loss, grads = pipe.compute(model.loss_and_grads, x, y)
    pipe.end(grads, loss=loss, examples=len(x))

Rules of this module:

* Pushes leave per layer: when backpropagation has finished a layer
  (``on_ready``), its gradients are queued device -> pinned host on the copy stream
  and their shards are pushed, one message per PS, while the earlier layers still
  compute. Layers smaller than ``push_bytes`` wait for the next ones (a message
  costs about 100 us whatever its size, so tiny ones are not worth sending alone).
  By default that is 1 MiB on a GPU (or emulated) device, and everything at once
  on the CPU: there the PS, the network code and the worker's compute share the
  cores, and per-layer pushes measured 0.86x the examples/s of one push after
  backprop on 2 cores (compute slowed by the work they overlap; BENCHMARKS.md).
  :meth:`StepPipeline.end` sends what was not handed over and waits for
  every push of the step, so a step's pushes are all acknowledged before the next
  step begins (its pinned gradient buffers are reused).
* async: the values for step t+1 travel while step t computes, into the other slot
  of a double-buffered :class:`~zmqps.device.staging.Mirror`, and are copied to the
  device as soon as they land.

  - ``prefetch=False`` (the default): each push is a push_pull; a layer's values
    come back with this worker's own step-t gradient applied, while earlier layers
    still compute. Staleness is what it is without overlap.
  - ``prefetch=True``: the pull for step t+1 is sent when step t begins, before any
    of its pushes, so it overlaps the whole step; its values lack this worker's own
    step-t gradient (one more step of staleness, measured by the PS and exported).

* sync and ssp pull after :meth:`Worker.begin_step`: sync needs the token step's
  values, which exist only once every replica pushed the step before; ssp's clock
  wait is what bounds staleness, so a pull sent before it would break the bound.
  Pushes and device copies still overlap compute there.
* sync: the step's last push (the one :meth:`StepPipeline.end` sends) asks the PS
  that handed the token for the next one, and, where it pushes every dense variable
  (all gradients at once, as on the CPU), for the values of after its step, landed
  in the host buffers the next pull would fill (:mod:`zmqps.roles.worker.fresh`):
  the next :meth:`StepPipeline.begin` then sends nothing when they are of its
  token's step and generation, and pulls as before otherwise.
* Towers (``Worker(devices=...)``): the pulled values land once in the host
  buffers and are copied to every tower's device; :meth:`StepPipeline.compute`
  runs the towers (:class:`~zmqps.device.towers.Towers`) and hands each averaged
  gradient over as soon as every tower has it, so pushes overlap as with one
  device. A step is still one push of the worker.
* Failures are those of :meth:`Worker.pull` / :meth:`Worker.push`: a push whose PS
  state moved (a fail-over) or whose PS was cut off is sent again
  (:meth:`~zmqps.roles.worker.session.Session.delivering`) while compute goes on;
  through a restore it is dropped (counted in ``worker.rolled_back``, once per step)
  and the next step pulls afresh; a failed prefetch is pulled again.
* Each phase's time in ``zmqps_worker_step_seconds{phase}`` is what the step waited
  for it; :class:`OverlapStats` also sums how long each transfer took wherever it
  ran, and the overlap ratio is ``1 - waited / took`` over communication.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import heapq
import threading
import time
from collections.abc import Awaitable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from zmqps.device.staging import Copy
from zmqps.device.towers import LossAndGrads, Towers
from zmqps.roles.channels import RECOVERABLE, Delivery
from zmqps.transport.loop import result
from zmqps.wire.errors import NonFiniteGradient

if TYPE_CHECKING:
    from zmqps.roles.worker import Worker

__all__ = ["COMM_PHASES", "OverlapStats", "StepPipeline"]

#: The longest steps a worker's statistics keep, with when each ended.
KEEP_LONGEST = 32
#: The phases that move data (everything but compute).
COMM_PHASES = ("pull", "h2d", "d2h", "push")
T = TypeVar("T")


@dataclass
class OverlapStats:
    """Per-phase seconds over a run: ``waited`` (the step was blocked on the phase)
    and ``took`` (the transfer's own duration, wherever it ran)."""

    steps: int = 0
    wall: float = 0.0
    waited: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMM_PHASES, 0.0))
    took: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMM_PHASES, 0.0))
    compute: float = 0.0
    #: the longest steps (at most :data:`KEEP_LONGEST`): (seconds, wall-clock end)
    longest: list[tuple[float, float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _recent: collections.deque[tuple[float, float]] = field(
        default_factory=lambda: collections.deque(maxlen=100), repr=False
    )

    def add_took(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.took[phase] += seconds

    def add_waited(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.waited[phase] += seconds

    @staticmethod
    def ratio(waited: float, took: float) -> float:
        return 0.0 if took <= 0 else min(1.0, max(0.0, 1.0 - waited / took))

    @property
    def overlap(self) -> float:
        """Share of communication time hidden behind compute, over the whole run."""
        return self.ratio(sum(self.waited.values()), sum(self.took.values()))

    def step_took(self, seconds: float) -> None:
        """One step's wall time: kept among the longest (when a step paused, and for
        how long: a PS state moving, a fail-over)."""
        with self._lock:
            self.wall += seconds
            item = (round(seconds, 6), round(time.time(), 3))
            if len(self.longest) < KEEP_LONGEST:
                heapq.heappush(self.longest, item)
            elif item > self.longest[0]:
                heapq.heapreplace(self.longest, item)

    def step_done(self, waited: float, took: float) -> float:
        """Record one step's communication; returns the overlap over the recent steps."""
        with self._lock:
            self.steps += 1
            self._recent.append((waited, took))
            return self.ratio(sum(w for w, _ in self._recent), sum(t for _, t in self._recent))

    def as_dict(self) -> dict[str, Any]:
        """Seconds per step by phase (waited and took), and the overlap ratio."""
        n = max(1, self.steps)
        return {
            "steps": self.steps,
            "step_seconds": round(self.wall / n, 6),
            "compute_seconds": round(self.compute / n, 6),
            "waited_seconds": {p: round(s / n, 6) for p, s in self.waited.items()},
            "took_seconds": {p: round(s / n, 6) for p, s in self.took.items()},
            "overlap": round(self.overlap, 4),
            "longest_steps": sorted(self.longest, reverse=True),
        }


class StepPipeline:
    """One worker's steps with pulls, pushes and device copies overlapping compute."""

    def __init__(
        self, worker: Worker, *, prefetch: bool = False, push_bytes: int | None = None
    ) -> None:
        from zmqps.device.staging import Mirror

        self.worker = worker
        client = worker.client
        self.names = client.dense_names()
        variables = [client.placement.variable(n) for n in self.names]
        self.mirror = Mirror(worker.device, variables, slots=2, replicas=worker.devices[1:])
        self.towers = Towers(worker.devices)
        self.front = 0
        #: async only: pushes bring the next step's values back (push_pull)
        self.push_pull = worker.steps.pulls_ahead and not prefetch
        self.prefetch = worker.steps.pulls_ahead and prefetch
        #: sync: the last push of a step asks for the next token and the next values
        #: (what it brought is kept here until :meth:`end` reads it)
        self.fresh = worker.fresh_values() if worker.mode == "sync" else None
        #: sync: the step's last push, what it asked for and what it brought
        self._asks: Delivery | None = None
        self.stats = OverlapStats()
        #: gradients wait until this many bytes are ready before they are pushed
        if push_bytes is None:
            push_bytes = 1 << 20 if worker.device.separate else 1 << 62
        self.push_bytes = push_bytes
        self._ready: dict[str, Any] = {}
        self._ready_bytes = 0
        self._next: concurrent.futures.Future[Copy] | None = None
        self._pending: list[concurrent.futures.Future[tuple[bool | None, Copy | None]]] = []
        self._uploads: list[Copy] = []
        self._later: list[Copy] = []  # device copies whose duration is read at end()
        self._sent: set[str] = set()
        #: per slot: the shard versions its values are of (sent with the gradients),
        #: and the generation they are of (a push is stamped with it)
        self._versions: list[dict[int, int]] = [{}, {}]
        self._vgens = [0, 0]
        self._need_pull = True
        self._gen = 0  # the generation this step's requests are made in
        self._began = 0.0
        self._took_before = 0.0
        self._computing = 0.0
        self._step_waited = 0.0
        self._step_took = 0.0

    @property
    def back(self) -> int:
        return 1 - self.front

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return self.worker.io.submit(coro)

    def _waited(self, phase: str, seconds: float) -> None:
        self.stats.add_waited(phase, seconds)
        self._step_waited += seconds
        if self.worker.metrics is not None:
            self.worker.metrics.phase(phase, seconds)

    def _took(self, phase: str, seconds: float) -> None:
        self.stats.add_took(phase, seconds)

    # ------------------------------------------------------------------ steps

    def begin(self) -> dict[str, Any]:
        """Wait until this worker may compute its next step (:meth:`Worker.begin_step`);
        returns the parameters to compute it with, on the worker's device."""
        self._began = time.perf_counter()
        self._step_waited = 0.0
        took_before = sum(self.stats.took.values())
        self.worker.begin_step()
        if self.worker.gen != self._gen:
            # restored since the last step (a heartbeat said so; no request failed):
            # the values pulled ahead are of before the restore, pull afresh
            self._need_pull = True
            self._drop_prefetch()
        self._gen = self.worker.gen
        if self.prefetch and self._next is not None and not self._need_pull:
            started = time.perf_counter()
            try:
                upload = result(self._next)
            except RECOVERABLE as exc:
                self.worker.recover(exc, made_in=self._gen)
                self._need_pull = True
            else:
                self._waited("pull", time.perf_counter() - started)
                self.front = self.back
                upload.before_compute()
            self._next = None
        elif self.push_pull and not self._need_pull:
            self.front = self.back
            for upload in self._uploads:
                upload.before_compute()
        self._uploads = []
        if self._need_pull or not (self.prefetch or self.push_pull):
            self._pull_now()
        if self.prefetch:
            self._next = self._submit(self._fetch(self.back))
        self._sent = set()
        self._ready, self._ready_bytes = {}, 0
        self._pending = []
        self._took_before = took_before
        self._computing = time.perf_counter()
        return self.mirror.dev[self.front]

    @property
    def params(self) -> list[dict[str, Any]]:
        """This step's values on every tower's device (what :meth:`begin` returned first)."""
        return self.mirror.towers(self.front)

    def compute(self, fn: LossAndGrads, x: Any, y: Any) -> tuple[float, dict[str, Any]]:
        """``fn`` (a model's ``loss_and_grads``) on this step's values and the batch
        ``(x, y)`` (host arrays), on every tower, each gradient handed over for its
        push as soon as it is ready; returns the loss and the averaged gradients."""
        return self.towers.loss_and_grads(fn, self.params, x, y, on_ready=self.grads_ready)

    def _pull_now(self) -> None:
        slot = self.front
        started = time.perf_counter()
        if self._serve_fresh():  # sync: the last push brought them into this slot
            self.worker.record_phase("pull", started)
        else:
            self.worker.pull(out=self.mirror.host[slot])  # with recovery; records "pull"
            if self.fresh is not None:
                self.fresh.pulled_whole()
        self._keep_versions(slot)
        took = time.perf_counter() - started
        self.stats.add_waited("pull", took)
        self._step_waited += took
        self._took("pull", took)
        upload = self.mirror.upload(slot)
        if upload.done:  # host copies run at once: the step waited for them
            self._waited("h2d", upload.seconds())
            self._took("h2d", upload.seconds())
        else:  # the compute stream waits for it, not the host
            upload.before_compute()
            self._later.append(upload)
        self._need_pull = False

    def _serve_fresh(self) -> bool:
        """sync: whether the step's last push brought the values of the token's step,
        of this generation, into the front buffers (then no pull is sent)."""
        if self.fresh is None or self._need_pull:
            return False
        return self.worker.serve_fresh(self.fresh, None, self.names)

    async def _fetch(self, slot: int) -> Copy:
        started = time.perf_counter()
        await self.worker.client.pull(out=self.mirror.host[slot])
        self._keep_versions(slot)
        self._took("pull", time.perf_counter() - started)
        upload = self.mirror.upload(slot)
        await upload.wait_async()
        self._took("h2d", upload.seconds())
        return upload

    def _keep_versions(self, slot: int) -> None:
        client = self.worker.client
        self._versions[slot] = dict(client.versions)
        self._vgens[slot] = client.values_gen()

    def _drop_prefetch(self) -> None:
        if self._next is not None:
            with contextlib.suppress(Exception):  # its values are not used
                result(self._next, self.worker.timeout)
            self._next = None

    def grads_ready(self, grads: Mapping[str, Any]) -> None:
        """Hand over finished gradients (a model's ``on_ready``): copied to the host and
        pushed while the step goes on computing."""
        for name, g in grads.items():
            if name not in self._sent and name not in self._ready:
                self._ready[name] = g
                self._ready_bytes += int(g.nbytes)
        if self._ready and self._ready_bytes >= self.push_bytes:
            self._flush()

    def _flush(self, last: bool = False) -> None:
        ready, self._ready, self._ready_bytes = self._ready, {}, 0
        if not ready:
            return
        host, copy = self.mirror.download(ready)
        self._sent.update(ready)
        step, cursor = self.worker.steps.tag(), self.worker.cursor
        versions = self._versions[self.front], self._vgens[self.front]
        asks = Delivery()
        if last and self.fresh is not None:  # the step's last push (sync)
            asks = self._asks = self.worker.sync_asks(self.fresh, ready, self.names)
        # push_pull (async) brings values into the other slot; fresh (sync) into the
        # one the next pull would fill
        slot = self.front if asks.fresh else self.back
        self._pending.append(
            self._submit(self._push(host, copy, step, cursor, versions, slot, asks))
        )

    async def _push(
        self,
        host: dict[str, Any],
        copy: Copy,
        step: int | None,
        cursor: int,
        versions: tuple[dict[int, int], int],
        slot: int,
        asks: Delivery,
    ) -> tuple[bool | None, Copy | None]:
        """One push of the step (sent again through a fail-over): whether it was
        applied (None: a restore dropped it), and its values' upload (push_pull).
        sync: what it asks for beyond applying (:meth:`Worker.sync_asks`); the values
        of after the step land in ``slot``."""
        fresh = asks.fresh
        await copy.wait_async()
        self._took("d2h", copy.seconds())
        client = self.worker.client
        started = time.perf_counter()
        kept, gen = versions
        out = self.mirror.host[slot] if self.push_pull or fresh else None

        def push(delivery: Delivery) -> Awaitable[bool]:
            return client.push(
                host,
                pull=self.push_pull or fresh,
                step=step,
                out=out,
                versions=kept,
                cursor=cursor,
                versions_gen=gen,
                delivery=delivery,
            )

        try:
            accepted = await self.worker.session.delivering(push, gen, asks)
        finally:
            if self.fresh is not None:  # end() waits for this before it reads them
                self.worker.sync_brought(self.fresh, asks, host)
        self._took("push", time.perf_counter() - started)
        if fresh:
            return accepted, None  # the values wait in their slot for the next begin()
        if not self.push_pull or accepted is None:
            return accepted, None
        upload = self.mirror.upload(slot, host)
        await upload.wait_async()
        self._took("h2d", upload.seconds())
        return accepted, upload

    def end(
        self,
        grads: Mapping[str, Any],
        *,
        loss: float | None = None,
        examples: int | None = None,
    ) -> bool:
        """Finish the step: push the gradients not handed over yet, wait for every push
        of the step. Returns False if some push was dropped (see :meth:`Worker.push`)."""
        computed = time.perf_counter()
        self.stats.compute += computed - self._computing
        loss = self.worker.step_args(loss, examples)  # refused before anything more is sent
        self.worker.check_loss(loss)  # on_nonfinite="stop": before anything more is sent
        self.grads_ready(grads)
        self._asks = None
        self._flush(last=True)
        accepted = True
        dropped = False
        failure: BaseException | None = None
        refused: NonFiniteGradient | None = None
        for fut in self._pending:  # every push of the step ends before the next step
            try:
                ok, upload = result(fut)
            except NonFiniteGradient as exc:  # nothing of it applied on that PS
                refused = exc
                continue
            except Exception as exc:  # not delivered within the recovery timeout
                failure = failure or exc
                continue
            if ok is None:  # a restore dropped it
                dropped = True
                continue
            accepted = accepted and ok
            if upload is not None:
                self._uploads.append(upload)
        self._pending = []
        if self.fresh is not None:  # the next token: used only if it still holds
            self.worker.steps.offered(None if self._asks is None else self._asks.offered)
        if failure is not None:
            raise failure
        self._waited("push", time.perf_counter() - computed)
        for copy in self._later:
            self._took("h2d", copy.seconds())
        self._later = []
        if refused is not None:
            accepted = self.worker.refused(loss, refused)  # skipped (or NonFiniteStop)
            self._need_pull = True  # a refused push_pull brought no values back
            self._uploads = []
        if dropped:
            self.worker.session.dropped()
            accepted = False
            self._need_pull = True
            self._uploads = []
        elif self.push_pull and refused is None:
            if set(self.names) - self._sent:
                self._need_pull = True  # values of variables without a gradient: not back
            self._keep_versions(self.back)
        self.worker.count_step(loss, examples)
        self.stats.step_took(time.perf_counter() - self._began)
        took = sum(self.stats.took.values()) - self._took_before
        ratio = self.stats.step_done(self._step_waited, took)
        if self.worker.metrics is not None:
            self.worker.metrics.overlap_ratio.set(ratio)
        return accepted

    def close(self) -> None:
        """Wait for a prefetch still in flight (its values are not used); stop the
        towers' threads."""
        self._drop_prefetch()
        self.towers.close()
