"""The worker: a synchronous API for training loops.

Rules of this module:

* :class:`Worker` is what users call from their own training loop. Every call hops
  onto a private asyncio loop (a background thread, :attr:`Worker.io`) that owns the
  sockets, so the loop can heartbeat the chief while the user's code computes.
* The membership (chief connection, incarnation, generation, heartbeats, recovery)
  is the :class:`~zmqps.roles.worker.session.Session`'s; the consistency mode
  (tokens, the ssp clock) is a :mod:`~zmqps.roles.worker.modes` strategy chosen once
  at registration; the data path is the
  :class:`~zmqps.roles.client.ParameterClient`'s. The Worker composes them.
* One push is one step of this worker; steps, examples and the last loss travel to
  the chief with every heartbeat. Each push carries its batch cursor (the batches
  this worker, all incarnations, has pushed, this one included): a restarted worker
  resumes after the batches that really reached the PS (``steps_done``).
* The incarnation identifies this process run: a restarted worker registers with a
  newer one, and the PS fence pushes of the old one.
* Arrays returned by :meth:`Worker.pull` belong to the worker and are refreshed in
  place by the next pull (sync: by the next push, whose reply brings the next step's
  values for that pull, :mod:`~zmqps.roles.worker.fresh`); copy them to keep them.
* ``device="cuda:N"``: :meth:`Worker.pull` returns cupy arrays on that GPU (landed in
  pinned host buffers, then copied on a copy stream) and :meth:`Worker.push` takes
  cupy gradients (copied to pinned buffers, then sent); see :mod:`zmqps.device`.
  :class:`zmqps.roles.overlap.StepPipeline` overlaps those copies and the network
  with compute.
* ``devices=["cuda:0", "cuda:1", ...]``: towers (:mod:`zmqps.device.towers`). The
  worker is one replica whose step is computed on every device, each on its slice
  of the batch; :attr:`Worker.device` is the first one, where :meth:`pull` returns
  values and the towers' gradients are averaged. Sync, async and staleness see one
  worker with a K-times batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.config import ClusterSpec, TaskSpec
from zmqps.core.held import HeldExamples
from zmqps.core.optimizers import make_optimizer
from zmqps.core.segments import load_kernels
from zmqps.core.variables import Placement, VariableDef
from zmqps.device import Device, choose_devices
from zmqps.device.staging import Mirror
from zmqps.logs import RateLimitedLog
from zmqps.metrics import Metrics
from zmqps.metrics.summaries import Summaries, Window
from zmqps.roles.client import Delivery, ParameterClient
from zmqps.roles.configs import NONFINITE_POLICIES
from zmqps.roles.homes import Homes
from zmqps.roles.worker.fresh import FreshValues
from zmqps.roles.worker.modes import StepMode, make_step_mode
from zmqps.roles.worker.session import Session
from zmqps.transport import Client, LoopThread, Requester, SocketOptions, new_context
from zmqps.transport.loop import result
from zmqps.wire import ops as o
from zmqps.wire.errors import ConfigError, InvalidArgument, NonFiniteGradient, NotReady, RunFailed
from zmqps.wire.schema import MAX_FRAME_BYTES, MAX_TALLY, MIN_CHUNK_BYTES

__all__ = ["NonFiniteStop", "RowPushing", "Terminated", "Worker", "WorkerOptions"]

#: at most one log line per this many seconds for steps skipped as not finite
NONFINITE_LOG_INTERVAL_S = 10.0

log = logging.getLogger("zmqps.worker")

Array = npt.NDArray[Any]


class NonFiniteStop(RunFailed):
    """A step's loss or gradient was not finite and the worker runs with
    ``on_nonfinite="stop"``: it leaves (reason ``nonfinite``, which stops the run) and
    exits with code 3."""


def _loss_text(loss: Any) -> str:
    return "unknown" if loss is None else f"{float(loss):.4g}"


class Terminated(BaseException):
    """Raise it (e.g. from a SIGTERM handler) to make ``with Worker(...)`` leave as terminated."""


class RowPushing:
    """A row push on its way (:meth:`Worker.push_rows_async`)."""

    def __init__(self, worker: Worker, fut: concurrent.futures.Future[bool]) -> None:
        self._worker = worker
        self._fut = fut

    def done(self) -> bool:
        return self._fut.done()

    def result(self, timeout: float | None = None) -> bool:
        """Whether the push was applied (waits for it). A refusal as not finite is
        counted and skipped as :meth:`Worker.push_rows` does it (or stops, under
        ``on_nonfinite="stop"``)."""
        try:
            return result(self._fut, timeout)
        except NonFiniteGradient as exc:
            return self._worker.refused(None, exc)


@dataclass(frozen=True)
class WorkerOptions:
    """How a :class:`Worker` connects (the keyword arguments of its constructor)."""

    chief: str
    index: int = 0
    role: str = "worker"
    incarnation: int | None = None
    timeout: float = 30.0
    connect_timeout: float = 120.0
    steps_planned: int = 0
    chunk_bytes: int = 4 << 20
    shared_memory: bool = True
    recovery_timeout: float = 300.0
    #: a chief silent this long (no heartbeat answered) is gone for good: the worker
    #: stops (:attr:`Worker.stop_reason`); None: never
    chief_timeout: float | None = 60.0

    def __post_init__(self) -> None:
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_FRAME_BYTES:
            raise ConfigError(
                f"chunk_bytes {self.chunk_bytes}: a PS takes chunks of {MIN_CHUNK_BYTES}"
                f" to {MAX_FRAME_BYTES} bytes (default {4 << 20})"
            )


class Worker:
    """A connection of one worker task to the cluster (chief + every PS).

    >>> w = Worker("127.0.0.1:2222", index=0)                 # doctest: +SKIP
    >>> w.create_variables([VariableDef("w", (13, 1))], optimizer={"name": "sgd", "lr": 0.1})
    >>> params = w.pull(); ...; w.push(grads, loss=loss)       # doctest: +SKIP
    >>> w.close()                                              # doctest: +SKIP

    ``job_flags``: the job flags the worker runs with
    (:func:`zmqps.roles.agreement.job_flags`), sent when it registers: the chief
    refuses a worker of another cluster layout or model (:class:`ConfigError`) and
    logs the other differences.
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
        recovery_timeout: float = 300.0,
        chief_timeout: float | None = 60.0,
        options: SocketOptions | None = None,
        metrics: Metrics | None = None,
        device: str | Device | None = None,
        devices: str | Sequence[str | Device] | None = None,
        on_nonfinite: str = "skip",
        summaries: Summaries | None = None,
        job_flags: Mapping[str, str] | None = None,
    ) -> None:
        #: how this worker connects (role, timeouts, ...), as given
        self.settings = WorkerOptions(
            chief,
            index,
            role,
            incarnation,
            timeout,
            connect_timeout,
            steps_planned,
            chunk_bytes,
            shared_memory,
            recovery_timeout,
            chief_timeout,
        )
        s = self.settings
        #: the towers' devices (one, unless ``devices`` names several)
        self.devices = [d.check() for d in choose_devices(device, devices)]
        #: where the parameters and gradients of :meth:`pull` / :meth:`push` live
        self.device = self.devices[0]
        self.device.use()  # the calling thread computes on it (cupy's current device)
        self.index, self.role, self.name = index, s.role, f"{s.role}:{index}"
        self.incarnation = time.time_ns() // 1000 if s.incarnation is None else s.incarnation
        self.timeout = s.timeout
        self.metrics = metrics
        #: TensorBoard scalars of this worker (``--logdir``), written a window at a
        #: time (the caller opens and closes them)
        self.summaries = summaries
        self._window = Window()
        self.step = 0
        #: batches given back to restores (trained again): the position is
        #: ``steps_done + step - rewound``
        self.rewound = 0
        #: steps of this incarnation that trained a batch again: one its data had got
        #: past before a restore went back (their first pushes were taken back)
        self.retrained = 0
        #: the furthest position this incarnation's data got to (past it: new batches)
        self._furthest = 0
        #: examples of this incarnation's steps, every push counted (batches trained
        #: again too): the work done, for its metrics
        self.examples = 0
        #: the examples of this incarnation's batches that hold, by position (a restore
        #: that went back takes theirs off): what heartbeats and leave say
        self._held = HeldExamples()
        #: ``examples_of(c)``: the examples of the first ``c`` batches of this worker's
        #: data (every epoch), when the training loop knows its data
        #: (:meth:`count_examples_by`); then the examples it reports are exact over
        #: every incarnation, the batches it resumed after included
        self.examples_of: Callable[[int], int] | None = None
        self.loss: float | None = None
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(
                f"on_nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {on_nonfinite!r}"
            )
        #: a step whose gradients the PS refused as not finite: "skip" it (logged),
        #: "skip-silently", or "stop" (:class:`NonFiniteStop`)
        self.on_nonfinite = on_nonfinite
        #: steps of this incarnation whose gradients were refused as not finite
        self.nonfinite = 0
        self._nonfinite_log = RateLimitedLog(log, NONFINITE_LOG_INTERVAL_S)
        self._refused_step = -1
        #: sync: the step (token) of the last row pushes, the tables they carried and
        #: the session's generation then (:meth:`_check_whole_step`)
        self._step_rows: tuple[int, set[str], int] | None = None
        #: sync: the values a push brought for the next pull (:mod:`.fresh`)
        self._fresh = FreshValues()
        #: a step pipeline's (fresh_values), and the hits and misses of those before it
        self._fresh_loop: FreshValues | None = None
        self._fresh_done = (0, 0)
        #: steps whose push a restore dropped before any PS kept it (values of before
        #: the restore): their update is gone, a caller counting steps trains them again
        self.lost_steps = 0
        #: the built-in loop stops after the current step (:meth:`request_stop`)
        self.stop_requested = False
        #: why it stops, and the exit code that says so (a process running this worker)
        self.stop_reason = ""
        self.stop_code = 0
        #: called once (from any thread) when a stop is requested, e.g. to bound the
        #: time the current step may still take
        self.on_stop: Callable[[], None] | None = None
        self._options = options
        self._mirror: Mirror | None = None
        self._client: ParameterClient | None = None
        self._homes: Homes | None = None
        self._closure: int | None = None
        self._closed = False
        self._left = False  # left with the work done (finish), waiting for the run's end
        #: the worker's private event loop (a thread); everything on the wire runs there
        self.io = LoopThread(f"zmqps-{s.role}-{index}")
        self._ctx = new_context()
        who = o.Who(s.role, index, self.incarnation)
        chief_client = self.io.run(self._connect(chief))
        self.session = Session(
            chief_client,
            who,
            steps_planned=s.steps_planned,
            recovery_timeout=s.recovery_timeout,
            chief_timeout=s.chief_timeout,
            on_stop=self.request_stop,
            job=job_flags,
            # the batches of this incarnation that hold (those given back to a
            # restore are not counted until trained again)
            progress=lambda: (
                self.net_steps,
                self.held_examples,
                self.loss,
                self.nonfinite,
            ),
        )
        self.session.examples_before = self.examples_resumed_after
        self.session.on_placement = self._placement_moved
        try:
            info = self.io.run(self.session.open(s.connect_timeout))
        except BaseException:
            self._teardown()
            raise
        self.ps_addresses: list[str] = list(info.ps)
        #: the consistency mode (async, ssp, sync): how a step begins, how pushes are tagged
        self.steps: StepMode = make_step_mode(
            info.mode, self.session, info.last_step, self._ps_link
        )
        #: batches earlier incarnations of this worker really pushed (the built-in loop
        #: skips them)
        self.steps_done = info.steps_done
        self._furthest = info.steps_done
        self._held = HeldExamples(info.steps_done)
        if info.placement is not None:
            self._use(Placement.from_wire(info.placement))
        if metrics is not None:
            metrics.set_info(s.role, index, self.mode)
        self.session.on_restored(self._restored)
        self.io.run(self._start_heartbeats(info.heartbeat_interval))

    @classmethod
    def from_cluster(cls, cluster: ClusterSpec, task: TaskSpec, **kwargs: Any) -> Worker:
        if cluster.chief is None:
            raise NotReady("the cluster spec has no chief")
        return cls(cluster.chief, task.index, role=task.role, **kwargs)

    # ------------------------------------------------------------------ setup

    async def _connect(self, address: str) -> Client:
        return Client(
            self._ctx,
            address,
            f"{self.name}:{self.incarnation}",
            options=self._options,
            timeout=self.timeout,
            observer=self.metrics,
        )

    def _ps_link(self, k: int) -> Requester | None:
        """The link to PS state ``k`` (it follows the state to its home), or None."""
        client = self._client
        if client is None or not 0 <= k < len(client.ps):
            return None
        link: Requester = client.ps[k]
        return link

    async def _start_heartbeats(self, interval: float) -> None:
        self.session.start_heartbeats(interval)

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
            # the client speaks to PS *states*; a fail-over moves a state to another
            # process (the placement's epoch says), and the links follow it
            self._homes = Homes(clients)
            self._homes.update(placement)
            return ParameterClient(
                self._homes.links(),
                placement,
                worker=self.name,
                incarnation=self.incarnation,
                chunk_bytes=self.settings.chunk_bytes,
                timeout=self.timeout,
                shared_memory=self.settings.shared_memory,
                generation=lambda: self.session.gen,
            )

        self._client = self.io.run(make())
        self._client.tag(self._closure)
        self._mirror = None

    async def _placement_moved(self) -> None:
        """A heartbeat named a newer placement epoch: PS states moved (a fail-over, a move).
        Requests in flight to their old processes are sent again to the new ones."""
        rep = await self.session.call(
            "get_placement", o.GetPlacement(0.0), o.PlacementReply, timeout=5.0
        )
        placement = Placement.from_wire(rep.placement)
        if self._homes is None or self._client is None:
            return
        moved = self._homes.update(placement)
        if moved:
            self._client.moved(moved)
            log.warning(
                "%s: ps %s now served elsewhere (placement epoch %d)",
                self.name,
                ", ".join(map(str, moved)),
                placement.epoch,
            )

    def _restored(self, gen: int) -> None:
        if self._client is not None:
            self._client.restored(gen)  # requests waiting on a lost PS fail now

    @property
    def client(self) -> ParameterClient:
        if self._client is None:
            raise NotReady("no variables yet: call create_variables() or wait_for_variables()")
        return self._client

    @property
    def placement(self) -> Placement:
        return self.client.placement

    @property
    def mode(self) -> str:
        """The cluster's consistency mode: async, sync or ssp."""
        return self.steps.name

    @property
    def gen(self) -> int:
        """The cluster generation (restores so far) as this worker knows it."""
        return self.session.gen

    @property
    def rolled_back(self) -> int:
        """Pushes dropped because the cluster was restored meanwhile (their values are gone)."""
        return self.session.rolled_back

    def create_variables(
        self, variables: Sequence[VariableDef], optimizer: Mapping[str, Any] | None = None
    ) -> Placement:
        """Create the model's variables (idempotent: every worker may call it)."""
        if optimizer is not None:
            # what is wrong with it, named here (the wire's schema said only "missing
            # field 'lr'" of an unknown optimizer's name)
            make_optimizer(optimizer)
        body = o.CreateVars(
            tuple(v.to_wire() for v in variables), None if optimizer is None else dict(optimizer)
        )
        rep = self.io.run(
            self.session.call(
                "create_vars",
                body,
                o.PlacementReply,
                timeout=max(self.timeout, 130.0),
                # sent again when the connection comes back (it creates the variables
                # once, then answers their placement): one in flight to a chief killed
                # was never answered by the one started in its place, and the worker
                # waited 130 s, then exited 1
                attempts=2,
            )
        )
        placement = Placement.from_wire(rep.placement)
        if self._client is None or self._client.placement != placement:
            self._use(placement)
        return placement

    def wait_for_variables(self, timeout: float = 120.0) -> Placement:
        """Block until some other task created the variables (NotReady after
        ``timeout`` seconds). Each wait at the chief is at most ``o.MAX_WAIT_S``."""
        deadline = time.monotonic() + timeout
        while True:
            wait = min(max(0.0, deadline - time.monotonic()), o.MAX_WAIT_S)
            try:
                rep = self.io.run(
                    self.session.call(
                        "get_placement", o.GetPlacement(wait), o.PlacementReply, timeout=wait + 5.0
                    )
                )
                break
            except NotReady:
                if time.monotonic() >= deadline:
                    raise
        placement = Placement.from_wire(rep.placement)
        self._use(placement)
        return placement

    # ------------------------------------------------------------------ training

    @property
    def global_step(self) -> int:
        """The global step as last seen: updates applied to the model (async, ssp), or
        the step of this worker's token (sync)."""
        seen = 0 if self._client is None else self._client.global_step
        token = getattr(self.steps, "token", None)
        return max(seen, token or 0)

    @property
    def staleness(self) -> int:
        """Staleness (in updates) of this worker's last push, as measured by the PS."""
        return 0 if self._client is None else self._client.last_staleness

    @property
    def position(self) -> int:
        """The batches of this worker's data done so far (every incarnation; after a
        restore, those the checkpoint restored holds): the next one is at this index."""
        return self.steps_done + self.step - self.rewound

    @property
    def cursor(self) -> int:
        """The batch the step being computed is (1-based, over every incarnation)."""
        return self.position + 1

    def take_rewind(self) -> int | None:
        """After a restore that went back to a checkpoint: the position (batches done)
        this worker's data goes back to, once (None: no restore since the last call).
        The training loop must take its next batch from there, so that the batches
        whose pushes the restore took back are trained again (the built-in loop does).
        Call it after :meth:`begin_step` and the step's pull, before choosing the batch."""
        back = self.session.take_rewind()
        if back is None:
            return None
        again = self.position - back
        self.rewound += again
        self._held.back(back)
        if not again:  # the checkpoint holds every batch it did: nothing to say but that
            log.info(
                "%s: the cluster was restored to a checkpoint holding all its %d batches",
                self.name,
                back,
            )
            return back
        log.warning(
            "%s: the cluster went back to a checkpoint holding its first %d batches: %s",
            self.name,
            back,
            f"training {again} again" if again >= 0 else f"skipping {-again} it holds",
        )
        return back

    def begin_step(self, poll: float = 10.0) -> int:
        """Wait until this worker may start its next step; returns the step it computes.

        async: returns at once (this worker's local step). sync: takes a token from
        the chief's queue and returns its value (the global step the gradients are
        for). ssp: waits while this worker is more than ``max_staleness`` steps ahead
        of the slowest live worker. Waiting is done by long polls of ``poll`` seconds.
        """
        # steps done that hold (those a restore took back do not count: ssp clocks, like
        # heartbeats, say how far the worker's data got)
        self._check_whole_step()
        started = time.perf_counter()
        step = self.steps.ready()  # sync: the token the last push's reply brought
        if step is None:
            step = self.io.run(self.steps.begin(self.net_steps, poll))
        if self.summaries is not None and self.mode != "async":
            wait = "token_wait_seconds" if self.mode == "sync" else "ssp_wait_seconds"
            self._window.observe(wait, time.perf_counter() - started)
        return step

    def _dense_whole(self, grads: Mapping[str, Any]) -> None:
        """Sync: a step's dense push carries every dense variable's gradient. Each shard
        applies a step once N workers pushed to it: a variable left out (or pushed in a
        second call, which counts as another step) held that step, and every worker
        with it, for ever, the push reported as applied."""
        if self.mode != "sync":
            return
        missing = [n for n in self.client.dense_names() if n not in grads]
        if missing:
            raise InvalidArgument(
                f"sync mode: a step's push carries a gradient for every dense variable in one"
                f" call; this one lacks {_names(missing)} (each shard waits for N gradients of"
                " the step: push zeros for a variable the step leaves unchanged)"
            )

    def _rows_pushed(self, step: int | None, name: str | None) -> None:
        """Sync: table ``name`` has this worker's row push of ``step`` (None: a dense
        push of ``step``, which the step's row pushes must go with)."""
        if self.mode != "sync" or step is None:
            return
        gen = self.session.gen
        if self._step_rows is None or self._step_rows[0] != step or self._step_rows[2] != gen:
            self._step_rows = (step, set(), gen)
        if name is not None:
            self._step_rows[1].add(name)

    def _check_whole_step(self) -> None:
        """Sync, before the next step: the step this worker pushed (rows or dense) had
        a row push for every table (an empty one for a table the batch did not touch),
        as a dense push has every dense variable (:meth:`_dense_whole`); else the step
        waits for this worker for ever. A step a restore voided since is not judged."""
        last = self._step_rows
        if last is None or self.mode != "sync" or last[2] != self.session.gen:
            self._step_rows = None
            return
        step, pushed, _ = last
        missing = [
            v.name for v in self.client.placement.variables if v.sparse and v.name not in pushed
        ]
        if missing:
            raise InvalidArgument(
                f"sync mode: step {step}'s pushes left out {_names(missing)}: every table"
                " takes this worker's row push each step, before its dense push (ids and grads"
                " of no rows for one the batch did not touch), or the step waits for it for"
                " ever; this worker cannot go on (its leave lets the others)"
            )
        self._step_rows = None

    def count_examples_by(self, examples_of: Callable[[int], int]) -> None:
        """The training loop knows its data: ``examples_of(c)`` is the examples of the
        first ``c`` batches of it (every epoch; :func:`zmqps.data.examples_in`). The
        examples this worker reports are then exact over every incarnation: the batches
        it resumed after count as their data says (not at the run's mean), and a
        restore that goes back takes off exactly the examples of the batches it took."""
        self.examples_of = examples_of

    @property
    def held_examples(self) -> int:
        """The examples of this incarnation's batches that hold (those of the batches a
        restore took back do not count until trained again; never less than 0)."""
        if self.examples_of is not None:
            return max(0, self.examples_of(self.position) - self.examples_of(self.steps_done))
        return self._held.total

    def examples_resumed_after(self) -> int | None:
        """The examples of the batches this incarnation resumed after (its earlier
        incarnations' or a stopped run's), when its data says them
        (:meth:`count_examples_by`); None: the chief counts them."""
        if self.examples_of is None:
            return None
        return self.examples_of(self.steps_done)

    @property
    def net_steps(self) -> int:
        """This incarnation's steps that hold: those a restore took back do not count,
        and a restore that took back batches of an earlier incarnation too makes it 0,
        never less (what heartbeats, leave and ssp clocks say)."""
        return max(0, self.step - self.rewound)

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
        """Current values of the dense variables (or ``names``, only those): on the
        worker's device, or landed in the host arrays ``out`` (of the variables' shapes
        and dtypes)."""
        started = time.perf_counter()
        # one name as a string: that variable (its characters were taken for names)
        wanted = None if names is None else [names] if isinstance(names, str) else list(names)
        if wanted is not None:
            self.client.check_names(wanted)  # unknown ones: refused before any request
        staged = out is None and self.device.separate
        if out is not None or staged:
            self._fresh.pulled_elsewhere()
        elif self.serve_fresh(self._fresh, wanted, self.client.dense_names()):
            # sync: the values of this token's step came with the last push's reply
            self.record_phase("pull", started)
            return _only(self.client.params, wanted)
        dest = self.mirror.host[0] if staged else out
        values = self.io.run(self.session.retrying(lambda: self.client.pull(wanted, out=dest)))
        if self.steps.voided:
            # restored meanwhile, and the token was of before: these values are of the
            # restored step; compute for it
            self.begin_step()
        self.record_phase("pull", started)
        if not staged:
            # the client's arrays hold every variable pulled so far: those asked for
            return _only(values, wanted)
        started = time.perf_counter()
        self.mirror.upload(0, values).wait()
        self.record_phase("h2d", started)
        return {n: self.mirror.dev[0][n] for n in _only(values, wanted)}

    # -- sync: the next token and the next step's values with a step's last push -------

    def sync_asks(
        self, fresh: FreshValues, pushed: Collection[str], dense: Iterable[str]
    ) -> Delivery:
        """What a step's last push asks for beyond applying its gradients (sync; none
        elsewhere): the PS that handed this step's token is asked for the next one (its
        reply brings it once released: no token request of its own), and, where the
        next pull would take them (``fresh``, given what it pushes of ``dense``), every
        PS for the values of after the step."""
        allowed = self.mode == "sync" and self.client.takes_fresh(pushed)
        wants = fresh.ask(pushed, dense, allowed=allowed)
        return Delivery(token_ps=self.steps.push_asks(), fresh=wants)

    def sync_brought(self, fresh: FreshValues, asks: Delivery, pushed: Iterable[str]) -> None:
        """Once the push of :meth:`sync_asks` is answered (before any later restore is
        heard of): what it brought, into ``fresh``."""
        if asks.fresh:
            fresh.brought(self.client.fresh_step(pushed, asks), self.client.values_gen())

    def serve_fresh(
        self, fresh: FreshValues, wanted: Collection[str] | None, dense: Collection[str]
    ) -> bool:
        """Whether a pull of ``wanted`` (None: all of ``dense``) is served by the values
        the last push brought (``fresh``), for the token held now (none before the first
        :meth:`begin_step`: never served) in this generation."""
        return fresh.serve(getattr(self.steps, "token", None), self.session.gen, wanted, dense)

    def fresh_values(self) -> FreshValues:
        """Sync: a record of the next step's values its pushes bring, for a step loop
        that pulls into buffers of its own (:class:`~zmqps.roles.overlap.StepPipeline`;
        the values land there, never in the arrays :meth:`pull` returns). Its counts
        are in :meth:`stats`."""
        done = self._fresh_loop  # a loop's that ended (one loop at a time): its counts
        if done is not None:
            self._fresh_done = (self._fresh_done[0] + done.hits, self._fresh_done[1] + done.misses)
        self._fresh_loop = FreshValues()
        return self._fresh_loop

    def to_host(self, grads: Mapping[str, Any]) -> Mapping[str, Any]:
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

    def step_args(self, loss: Any, examples: Any) -> float | None:
        """A step's ``loss`` and ``examples``, checked before anything of the step is
        sent (:class:`InvalidArgument` naming the argument; a loss that was not a number
        failed after the push was applied, and a retry applied it twice): the loss as a
        float (None: none)."""
        _check_examples(examples)
        if examples is not None and self.held_examples + int(examples) > MAX_TALLY:
            # the wire carries this worker's examples up to MAX_TALLY: past it the chief
            # refused its heartbeats (it looked dead) and its leave
            raise InvalidArgument(
                f"examples: this worker's examples would pass {MAX_TALLY} (the most the"
                f" wire carries) with {int(examples)} more, after {self.held_examples}"
            )
        return _check_loss(loss)

    def count_step(self, loss: float | None, examples: int | None) -> None:
        """One step done (its gradients pushed): counted for heartbeats and metrics; a
        batch before the furthest position reached is counted as trained again."""
        before = self.position
        self.step += 1
        if before < self._furthest:
            self.retrained += 1
        else:
            self._furthest = before + 1
        self.steps.step_done()
        if loss is not None:
            self.loss = float(loss)
        if examples is not None:
            self.examples += int(examples)
            self._held.add(before, int(examples))
        if self.metrics is not None:
            self.metrics.step_done(self.loss if loss is not None else None, examples)
        if self.summaries is not None:
            window = self._window
            window.count("steps")
            if examples is not None:
                window.count("examples", examples)
            if loss is not None:
                window.last("loss", float(loss))
            window.observe("staleness", self.staleness)
            window.last("nonfinite_steps", self.nonfinite)
            self._write_window()

    def _write_window(self, force: bool = False) -> None:
        """The window's figures as TensorBoard scalars once it ended (``force``: now)."""
        figures = self._window.take(force)
        if figures is not None and self.summaries is not None:
            self.summaries.scalars(self.global_step, {f"train/{k}": v for k, v in figures.items()})

    def push(
        self, grads: Mapping[str, Any], *, loss: float | None = None, examples: int | None = None
    ) -> bool:
        """Push one step's gradients. async / ssp: each PS applies them on arrival; sync:
        they count toward the step of the token taken by :meth:`begin_step`. Returns
        False if they were dropped (sync: stale, the step had already been applied),
        or if this was a retry of a push the PS had already handled (whose first
        outcome this call cannot know)."""
        _check_grads(grads)
        loss = self.step_args(loss, examples)
        grads = self.to_host(grads)
        self._dense_whole(grads)
        started = time.perf_counter()
        step, cursor = self.steps.tag(), self.cursor
        self._rows_pushed(step, None)
        client = self.client
        asks = self.sync_asks(self._fresh, grads, client.dense_names())
        accepted = self._send(
            lambda d: client.push(grads, pull=asks.fresh, step=step, cursor=cursor, delivery=d),
            loss,
            asks,
        )
        self.sync_brought(self._fresh, asks, grads)
        self.record_phase("push", started)
        self.count_step(loss, examples)
        self.steps.offered(asks.offered)
        return accepted

    def push_pull(
        self, grads: Mapping[str, Any], *, loss: float | None = None, examples: int | None = None
    ) -> dict[str, Array]:
        """Push gradients and get the updated values back in the same round trip
        (timed as the push phase; on a separate device: a push, then a pull)."""
        _check_grads(grads)
        loss = self.step_args(loss, examples)
        if self.device.separate:
            self.push(grads, loss=loss, examples=examples)
            return self.pull()
        self._dense_whole(grads)
        started = time.perf_counter()
        step, cursor = self.steps.tag(), self.cursor
        self._rows_pushed(step, None)
        pushed = self._send(
            lambda d: self.client.push_pull(grads, step=step, cursor=cursor, delivery=d), loss
        )
        if not pushed and (
            self._refused_step == self.step or self.client.values_gen() != self.session.gen
        ):
            # refused (no values came back), or values of before a restore: pull anew
            self.io.run(self.session.retrying(lambda: self.client.pull()))
        self.record_phase("push", started)
        self.count_step(loss, examples)
        return self.client.params

    def _send(
        self,
        push: Callable[[Delivery], Awaitable[bool]],
        loss: Any,
        delivery: Delivery | None = None,
    ) -> bool:
        """One step's push (or push_pull): a non-finite loss stops first under
        ``on_nonfinite="stop"``; the values' generation goes with it (a restore heard of
        since means they are gone: dropped at once); a refusal as not finite is skipped
        (:meth:`refused`); ``delivery``: see :meth:`WorkerSession.delivering`. True if
        applied."""
        self.check_loss(loss)
        made_in = self.client.values_gen()
        dropped = self.session.rolled_back
        try:
            applied = self.io.run(self.session.dropping(push, made_in, delivery))
        except NonFiniteGradient as exc:
            return self.refused(loss, exc)
        if self.session.rolled_back > dropped:
            # the cluster was restored before any PS kept this step's update
            self.lost_steps += 1
        return applied

    def pull_rows(self, name: str, ids: Any, *, create: bool = True) -> Array:
        """Rows ``ids`` of the embedding variable ``name``; ``create=False`` reads
        without creating or touching rows of a hash-keyed table (evaluation, serving)."""
        return self.io.run(
            self.session.retrying(lambda: self.client.pull_rows(name, ids, create=create))
        )

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

        return self.io.submit(pull_all())

    def push_rows(self, name: str, ids: Any, grads: Any) -> bool:
        """Row gradients for the embedding variable ``name`` (duplicate ids are summed)."""
        return self.push_rows_async(name, ids, grads).result()

    def push_rows_async(self, name: str, ids: Any, grads: Any) -> RowPushing:
        """:meth:`push_rows`, returning as soon as the push is on its way: the caller
        goes on (pulls the next batch's rows, computes) while it travels and is
        applied; ``.result()`` is what :meth:`push_rows` returns. ``ids`` and
        ``grads`` are read before this returns (the caller may refill them). Requests
        to a PS leave in the order they are made: a ``pull_rows`` made after this call
        reads the rows this push updated (async mode), as it would after
        :meth:`push_rows` returned; the next push should wait for this one's result
        (one push in flight, as :meth:`push_rows` keeps it)."""
        load_kernels()  # here, not in the I/O loop: its first call may take seconds
        step, cursor = self.steps.tag(), self.cursor
        rows = self.client.rows_push(name, ids, grads, load=True)
        self._rows_pushed(step, name)
        fut = self.io.submit(
            self.session.dropping(
                lambda d: self.client.send_rows(rows, step=step, cursor=cursor, delivery=d)
            )
        )
        return RowPushing(self, fut)

    def push_pull_rows(
        self, name: str, ids: Any, grads: Any, next_ids: Any, *, create: bool = True
    ) -> Array:
        """:meth:`push_rows` of ``(ids, grads)``, then :meth:`pull_rows` of
        ``next_ids`` (the next batch's), in one round trip to each PS (one
        ``push_pull_rows`` message, to a PS that takes it): the rows of ``next_ids``,
        which read the push's update as after :meth:`push_rows`. The push is delivered
        as :meth:`push_rows` delivers it (sent again through a fail-over, applied once);
        refused as not finite, it is counted and skipped as there (or stops, under
        ``on_nonfinite="stop"``) and the rows are pulled on their own, as they are
        when a restore dropped the push."""
        load_kernels()  # here, not in the I/O loop: its first call may take seconds
        step, cursor = self.steps.tag(), self.cursor
        client = self.client
        # summed as it is sent (into the push region): this call returns only once the
        # push is answered, and ``grads`` is not the caller's to change until then
        rows = client.rows_push(name, ids, grads, load=True, later=True)
        self._rows_pushed(step, name)
        pulled: list[Array] = []

        async def send(delivery: Delivery) -> bool:
            applied, got = await client.send_pull_rows(
                rows, next_ids, create=create, step=step, cursor=cursor, delivery=delivery
            )
            pulled.append(got)
            return applied

        async def both() -> Array | NonFiniteGradient:
            try:
                await self.session.dropping(send)
            except NonFiniteGradient as exc:
                return exc
            if pulled:
                return pulled[-1]
            # dropped by a restore: the rows are read anew, of the restored values
            return await self.session.retrying(
                lambda: client.pull_rows(name, next_ids, create=create)
            )

        got = self.io.run(both())
        if isinstance(got, NonFiniteGradient):
            self.refused(None, got)  # nothing of the message was applied nor read
            return self.pull_rows(name, next_ids, create=create)
        return got

    def tag(self, closure: int | None) -> None:
        """Coordinator mode: the pushes from now on belong to scheduled function
        ``closure`` (None: to none); the PS apply each of them once, whichever worker
        runs the function."""
        self._closure = closure
        if self._client is not None:
            self._client.tag(closure)

    # ------------------------------------------------------------ non-finite values

    def check_loss(self, loss: Any) -> None:
        """``on_nonfinite="stop"``: a loss that is not finite stops here, before its
        gradients are pushed (:class:`NonFiniteStop`)."""
        if self.on_nonfinite == "stop" and loss is not None and not math.isfinite(float(loss)):
            raise NonFiniteStop(
                f"{self.name}: step {self.position + 1}: the loss is {float(loss)}; stopping"
                " (--on-nonfinite stop): nothing of it was pushed"
            )

    def refused(self, loss: Any, error: NonFiniteGradient) -> bool:
        """A PS refused this step's gradient as not finite or out of range (nothing of
        it applied there): counted, logged (at most one line per interval, with a
        count) and skipped, or :class:`NonFiniteStop` (``on_nonfinite="stop"``).
        Returns False (not applied)."""
        if self._refused_step != self.step:  # a step's pushes count once together
            self._refused_step = self.step
            self.nonfinite += 1
        where = f"step {self.position + 1}, loss {_loss_text(loss)}"
        if self.on_nonfinite == "stop":
            raise NonFiniteStop(
                f"{self.name}: {where}: a gradient was refused ({error}); stopping"
                " (--on-nonfinite stop)"
            )
        if self.on_nonfinite == "skip":
            self._nonfinite_log.warning(
                "%s: %s: the gradient was refused by the PS (%s); the step is skipped (%d so far)",
                self.name,
                where,
                error,
                self.nonfinite,
            )
        return False

    def recover(self, error: Exception, *, made_in: int | None = None) -> None:
        """A data request made in generation ``made_in`` (default: the current one)
        failed with ``error``: wait for the cluster to recover (see
        :meth:`Session.recover`)."""
        self.io.run(self.session.recover(error, made_in))

    def stats(self) -> dict[str, Any]:
        """This incarnation: the batches it resumed after (``steps_done``), the steps it
        did, the batches restores gave back (``rewound``) and the steps that trained
        such a batch again (``retrained``, among ``steps``), the pulls the
        pushes before answered (sync, ``fresh_pulls``), and its pushes by
        "ps/generation" (sent, acknowledged applied, dropped)."""
        pushes = {} if self._client is None else self._client.push_counts
        loop = self._fresh_loop
        return {
            "incarnation": self.incarnation,
            "steps_done": self.steps_done,
            "steps": self.step,
            "rewound": self.rewound,
            "retrained": self.retrained,
            "rolled_back": self.rolled_back,
            "resent": self.session.resent,
            "nonfinite": self.nonfinite,
            # sync: pulls answered by the values the push before brought, and pushes
            # that asked for them in vain (the next pull went to the PS)
            "fresh_pulls": self._fresh.hits + self._fresh_done[0] + (loop.hits if loop else 0),
            "fresh_misses": (
                self._fresh.misses + self._fresh_done[1] + (loop.misses if loop else 0)
            ),
            "pushes": {k: dict(v) for k, v in pushes.items()},
        }

    # ------------------------------------------------------------------ the end

    def finish(self) -> int | None:
        """This worker's data is done: leave with the work done, then wait for the run's
        end (the chief's final checkpoint). A restore meanwhile may take this worker's
        last batches back (a PS lost before the final checkpoint): then it is a member
        at work again and this returns the position its data goes back to (the built-in
        loop trains on from there, then calls this again). None: the run ended (or the
        chief is gone, or a SIGTERM came); close the worker."""
        if not self._left:
            back = self._taken_back()
            if back is not None:
                return back
            acked = self.io.run(self.session.leave("done", waits=True))
            if acked is None:  # refused: a restore since its last push (now heard of)
                return self.finish()
            if not acked and self._client is not None:
                # a chief stopped or gone: every PS keeps that this worker finished, so
                # that the chief restarted after it learns it there (else it would wait
                # for ever for a worker whose work is done)
                self.io.run(self._client.tell_left(self.position))
            self._left = True
        back = self.io.run(self.session.linger(self.position, lambda: self.stop_requested))
        if back is None:
            return None
        self._left = False
        self.take_rewind()
        return self.position

    def _taken_back(self) -> int | None:
        """A restore heard of while the last batches were pushed (their pushes were
        dropped: the cluster went back) took some of them back: the position to train
        on from (the rewind taken); else None."""
        pending = self.session.rewind
        if pending is None or pending >= self.position:
            return None
        self.take_rewind()
        return self.position

    def request_stop(self, reason: str, code: int = 0) -> None:
        """Stop after the current step (the built-in loop checks :attr:`stop_requested`):
        a signal, the chief's shutdown, or a chief gone for good. The first reason and
        ``code`` (the process's exit code) stay; :attr:`on_stop` hears of it once."""
        if self.stop_requested:
            return
        self.stop_reason, self.stop_code = reason, code
        self.stop_requested = True
        if self.on_stop is not None:
            self.on_stop()

    def close(self, reason: str = "done") -> None:
        """Leave the cluster: ``reason`` "done" counts this worker's work as finished;
        any other ("terminated", "error", "nonfinite") leaves it unfinished."""
        if self._closed:
            return
        self._closed = True
        pending = self.session.rewind if hasattr(self, "session") else None
        if reason == "done" and not self._left and pending is not None and pending < self.position:
            # a loop of its own that never took the rewind: those batches are lost
            log.warning(
                "%s: leaves done though a restore took back its batches after %d (%d of"
                " them): call take_rewind() after each step's pull, and finish() at the"
                " end, to train them again",
                self.name,
                pending,
                self.position - pending,
            )
        self._write_window(force=True)  # the last window, however short
        try:
            if self.session.chief_gone:
                log.warning("%s: not telling the chief (gone) that it leaves", self.name)
            elif not (self._left and reason == "done"):
                # a stop must not wait long for a chief that may be stopping too
                quick = reason != "done" or self.stop_requested
                timeout = 1.0 if quick else 10.0
                if self.io.run(self.session.leave(reason, timeout=timeout)) is None:
                    back = self.session.take_rewind()
                    log.warning(
                        "%s: closes though a restore took back its batches after %s"
                        " (Worker.finish() trains them again)",
                        self.name,
                        back,
                    )
                    self.io.run(self.session.leave(reason, timeout=timeout))
        finally:
            self._teardown()

    def _teardown(self) -> None:
        async def close_all() -> None:
            if self._client is not None:
                await self._client.close()
                for c in self._client.ps:
                    await c.close()
            session = getattr(self, "session", None)
            if session is not None:
                await session.close()

        try:
            self.io.run(close_all(), timeout=10)
        except BaseException:
            # sockets may still be open (a peer that never answered): term() would wait
            # for them for ever; drop what is queued instead
            self.io.stop()
            self._ctx.destroy(linger=0)
            raise
        self.io.stop()
        self._ctx.term()

    def __enter__(self) -> Worker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, *_: object
    ) -> None:
        if exc_type is None:
            self.close("done")
        elif issubclass(exc_type, SystemExit):
            # sys.exit() in the block: 0 (or none) is a script that ended well, its work
            # done (it left as terminated, and the run waited for it for ever); else it
            # failed
            code = getattr(exc, "code", None)
            self.close("done" if code is None or code == 0 else "error")
        elif issubclass(exc_type, (Terminated, KeyboardInterrupt)):
            self.close("terminated")
        elif issubclass(exc_type, NonFiniteStop):
            self.close("nonfinite")
        else:
            self.close("error")


def _names(names: Sequence[str], shown: int = 5) -> str:
    """``a, b, c`` (the first ``shown``, then how many more)."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _only(values: dict[str, Any], wanted: Sequence[str] | None) -> dict[str, Any]:
    """``values`` of the names ``wanted`` (None: all of them)."""
    return values if wanted is None else {n: values[n] for n in wanted}


def _check_examples(examples: Any) -> None:
    """A step's ``examples``: a count (a negative one lowered the run's examples), at
    most what the wire carries."""
    if examples is None:
        return
    if (
        isinstance(examples, bool)
        or not isinstance(examples, (int, np.integer))
        or not 0 <= examples <= MAX_TALLY
    ):
        raise InvalidArgument(
            f"examples: a count of the step's examples in [0, {MAX_TALLY}], got {examples!r}"
        )


def _check_grads(grads: Any) -> None:
    """A step's gradients: a mapping of variable names to arrays (a list or None failed
    with an AttributeError of the code that reads them)."""
    if not isinstance(grads, Mapping):
        raise InvalidArgument(
            f"grads: a mapping of variable names to gradients, got {type(grads).__name__}"
        )


def _check_loss(loss: Any) -> float | None:
    """A step's ``loss``: a number (NaN and infinities too; a numpy or torch scalar),
    as a float; not a string or a bool, nothing float() refuses."""
    if loss is None:
        return None
    if isinstance(loss, (str, bytes, bytearray, bool, np.bool_)):
        raise InvalidArgument(f"loss: a number (the step's loss), got {loss!r}")
    try:
        return float(loss)
    except (TypeError, ValueError, OverflowError) as exc:
        shown = repr(loss) if len(repr(loss)) <= 60 else repr(loss)[:57] + "..."
        raise InvalidArgument(f"loss: a number (the step's loss), got {shown} ({exc})") from None
