"""The coordinator: the training loop lives in the chief process and schedules functions
onto worker servers (the shape of TensorFlow's ``ClusterCoordinator``).

Rules of this module:

* :meth:`Coordinator.schedule` queues a *closure* (a function name of the workers'
  job module, its arguments encoded at once, a step count) and returns a
  :class:`RemoteValue`. Any available worker takes the next closure; one closure
  runs at a time per worker.
* **Exactly once, or reported failed.** A closure whose worker dies (no answer to
  pings for ``heartbeat_timeout`` s) or restarts (a new incarnation answers) while
  it runs is put back at the front of the queue and runs again on another worker
  (or on the same one once it is back). Its pushes carry the closure's key and
  their place among its pushes to each PS, and the PS apply each at most once: the
  run again brings the pushes its lost run did not, and its result is the one
  returned. Retries are counted; a closure lost ``max_attempts`` times fails with
  :class:`WorkerLost`.
* **Errors.** A function that raises (``FunctionError``), or a request the worker
  refuses as invalid, fails its RemoteValue and cancels every closure still queued
  (their RemoteValues raise :class:`FunctionCancelled`); closures already running
  finish. The first error is raised by the next :meth:`join`, :meth:`done` or
  :meth:`schedule` (and then cleared, so the coordinator can be used again).
* Per-worker resources (datasets' iterators) are made on a worker before it runs
  its first closure, and made again after it restarts.
* All sockets and the queue belong to one private event loop thread; the user's
  thread only hands closures over and waits on conditions.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from zmqps.config import ClusterSpec
from zmqps.transport import Client, LoopThread, SocketOptions, new_context
from zmqps.transport.base import unless_set
from zmqps.wire import Tensor
from zmqps.wire.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotReady,
    ShutdownError,
    ZmqpsError,
)
from zmqps.wire.ops import MAX_WAIT_S
from zmqps.wire.values import ResourceRef, decode_value, encode_value

if TYPE_CHECKING:
    from zmqps.core.variables import Placement, VariableDef
    from zmqps.metrics import Metrics

__all__ = [
    "Coordinator",
    "FunctionCancelled",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "RemoteValue",
    "WorkerLost",
]

log = logging.getLogger("zmqps.coordinator")

#: Errors after which a closure runs again elsewhere: the worker went away or
#: restarted, not the function's fault.
_RETRYABLE = (DeadlineExceeded, ShutdownError, NotReady)


class FunctionCancelled(ZmqpsError):
    """The closure never ran: an earlier function failed (or the coordinator closed)."""

    code = "cancelled"


class WorkerLost(ZmqpsError):
    """The closure's workers died ``max_attempts`` times while running it."""

    code = "worker_lost"


class RemoteValue:
    """The future result of a scheduled function."""

    def __init__(self, closure_id: int, fn: str) -> None:
        self.closure_id = closure_id
        self.fn = fn
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        #: how many times the closure was sent to a worker (> 1: retried)
        self.attempts = 0
        #: the worker that produced the value
        self.worker: int | None = None

    def done(self) -> bool:
        """Whether the function finished (or failed, or was cancelled)."""
        return self._event.is_set()

    def fetch(self, timeout: float | None = None) -> Any:
        """Wait for the result; raises the function's error (FunctionError),
        FunctionCancelled or WorkerLost, or DeadlineExceeded after ``timeout`` s."""
        if not self._event.wait(timeout):
            raise DeadlineExceeded(f"{self.fn} (closure {self.closure_id}) not done in {timeout}s")
        if self._error is not None:
            raise self._error
        return self._value

    def _resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._event.set()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"RemoteValue({self.fn}#{self.closure_id}, {state})"


class PerWorkerIterator(ResourceRef):
    """A per-worker iterator: pass it to scheduled functions; each worker gives them
    its own iterator over its own dataset."""

    def __next__(self) -> Any:
        raise TypeError("a per-worker iterator is advanced on the workers: pass it to schedule()")

    def __iter__(self) -> PerWorkerIterator:
        return self


class PerWorkerDataset:
    """A dataset made on every worker by a function of the job module; ``iter()`` of it
    is a :class:`PerWorkerIterator` (a fresh iterator on each worker)."""

    def __init__(self, coordinator: Coordinator, fn: str, args: tuple[Any, ...], kwargs: Any):
        self._coordinator = coordinator
        self.fn = fn
        self.args = args
        self.kwargs = kwargs

    def __iter__(self) -> PerWorkerIterator:
        return self._coordinator._new_resource(self.fn, self.args, self.kwargs)


class _Closure:
    __slots__ = ("args", "fn", "id", "kwargs", "remote", "steps", "tensors")

    def __init__(
        self, cid: int, fn: str, args: Any, kwargs: Any, tensors: list[Tensor], steps: int
    ) -> None:
        self.id = cid
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.tensors = tensors
        self.steps = steps
        self.remote = RemoteValue(cid, fn)


class _RemoteWorker:
    """The coordinator's view of one worker server."""

    def __init__(self, index: int, client: Client) -> None:
        self.index = index
        self.client = client
        self.incarnation: int | None = None
        self.available = asyncio.Event()
        self.lost = asyncio.Event()  # set when the current incarnation is gone
        self.last_ok = time.monotonic()
        self.made: set[int] = set()  # resources made on the current incarnation
        self.running: _Closure | None = None
        self.restarts = 0

    def up(self, incarnation: int) -> None:
        if self.incarnation is not None and incarnation != self.incarnation:
            self.down("restarted")
            self.restarts += 1
        if incarnation != self.incarnation:
            self.made.clear()
        self.incarnation = incarnation
        if not self.available.is_set():
            self.lost = asyncio.Event()
            self.available.set()
            log.info("worker %d available (incarnation %d)", self.index, incarnation)

    def down(self, why: str) -> None:
        if self.available.is_set():
            log.warning("worker %d lost (%s)", self.index, why)
        self.available.clear()
        self.lost.set()


def _function_name(fn: str | Callable[..., Any]) -> str:
    name = fn if isinstance(fn, str) else getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise InvalidArgument(
            f"schedule: {fn!r} is not a function of the job module (pass its name or a"
            " module-level function of it)"
        )
    return name


class Coordinator:
    """Schedules functions of the workers' job module onto worker servers.

    >>> coord = Coordinator(cluster)                               # doctest: +SKIP
    >>> it = iter(coord.create_per_worker_dataset("dataset", 32))  # doctest: +SKIP
    >>> losses = [coord.schedule("train_step", it) for _ in range(100)]  # doctest: +SKIP
    >>> coord.join(); print(losses[-1].fetch())                     # doctest: +SKIP
    """

    def __init__(
        self,
        cluster: ClusterSpec | Sequence[str],
        *,
        steps_per_execution: int = 1,
        options: SocketOptions | None = None,
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = 10.0,
        max_attempts: int = 10,
        run_timeout: float = 3600.0,
        metrics: Metrics | None = None,
    ) -> None:
        if steps_per_execution < 1:
            raise InvalidArgument(f"steps_per_execution must be >= 1, got {steps_per_execution}")
        self.chief_address: str | None = None
        if isinstance(cluster, ClusterSpec):
            addresses = list(cluster.worker)
            self.chief_address = cluster.chief
        else:
            addresses = list(cluster)
        if not addresses:
            raise InvalidArgument("the cluster has no workers to schedule onto")
        self.steps_per_execution = steps_per_execution
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.max_attempts = max_attempts
        self.run_timeout = run_timeout
        self.metrics = metrics
        self._options = options
        self._ids = itertools.count(1)
        #: closures are keyed on the wire by base + id: the PS deduplicate a closure's
        #: pushes by key, so keys of a later coordinator (a restarted chief) never meet
        #: an earlier one's
        self._key_base = secrets.randbits(39) << 23
        self._resource_ids = itertools.count(1)
        self._resources: dict[int, tuple[str, Any, Any, list[Tensor]]] = {}
        self._cond = threading.Condition()
        self._outstanding = 0
        self._error: BaseException | None = None
        self._closed = False
        #: functions pending when the coordinator closed (they never finish)
        self._closed_pending = 0
        #: counters (also in :meth:`stats` and the metrics)
        self.scheduled = 0
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        self.retried = 0
        #: the restores' taken-back steps a training loop (``fit``) has trained again,
        #: as of its last look (None: no such loop ran); see :meth:`rewound_steps`
        self.rewind_accounted: int | None = None
        self._dispatch_s = 0.0  # round trip minus execution, summed over runs
        self._runs = 0
        self._io = LoopThread("zmqps-coordinator")
        self._ctx = new_context()
        self._chief: Client | None = None
        self.workers: list[_RemoteWorker] = self._io.run(self._start(addresses))
        if metrics is not None:
            metrics.watch(metrics.coordinator_queue_depth, lambda: len(self._queue))
            metrics.watch(metrics.coordinator_workers_available, self._available_count)
            metrics.watch(
                metrics.coordinator_inflight,
                lambda: sum(1 for w in self.workers if w.running is not None),
            )

    async def _start(self, addresses: list[str]) -> list[_RemoteWorker]:
        self._queue: collections.deque[_Closure] = collections.deque()
        self._has_work = asyncio.Event()
        workers = [
            _RemoteWorker(
                i, Client(self._ctx, addr, "coordinator:0", options=self._options, timeout=30.0)
            )
            for i, addr in enumerate(addresses)
        ]
        if self.chief_address is not None:
            self._chief = Client(
                self._ctx, self.chief_address, "coordinator:0", options=self._options
            )
        self._tasks = [asyncio.ensure_future(self._watch(w)) for w in workers]
        self._tasks += [asyncio.ensure_future(self._dispatch(w)) for w in workers]
        return workers

    def _available_count(self) -> float:
        return float(sum(1 for w in self.workers if w.available.is_set()))

    # ------------------------------------------------------------------ user API

    def schedule(
        self,
        fn: str | Callable[..., Any],
        *args: Any,
        kwargs: Mapping[str, Any] | None = None,
        steps: int | None = None,
    ) -> RemoteValue:
        """Queue ``fn(ctx, *args, **kwargs)`` to run on some worker ``steps`` times (default:
        ``steps_per_execution``); returns its RemoteValue (the last run's result).
        Raises the error of an earlier failed function, if one is not yet reported."""
        name = _function_name(fn)
        steps = self.steps_per_execution if steps is None else int(steps)
        if steps < 1:
            raise InvalidArgument(f"steps must be >= 1, got {steps}")
        for a in args:
            if isinstance(a, PerWorkerDataset):
                raise InvalidArgument("pass iter(per_worker_dataset), not the dataset itself")
        args_tree, tensors = encode_value(tuple(args))
        kw_tree, kw_tensors = encode_value(dict(kwargs or {}))
        kw_tree = _shift(kw_tree, len(tensors))
        closure = _Closure(next(self._ids), name, args_tree, kw_tree, tensors + kw_tensors, steps)
        with self._cond:
            if self._closed:
                raise ShutdownError("the coordinator is closed")
            self._raise_error()
            self._outstanding += 1
            self.scheduled += 1
        if self.metrics is not None:
            self.metrics.coordinator_scheduled.inc()
        self._io.loop.call_soon_threadsafe(self._enqueue, closure)
        return closure.remote

    def join(self, timeout: float | None = None) -> None:
        """Wait until every scheduled function has finished; raises the first error of a
        function (and clears it), or DeadlineExceeded after ``timeout`` s."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._outstanding == 0 or self._closed, timeout):
                raise DeadlineExceeded(
                    f"join: {self._outstanding} functions still pending after {timeout}s"
                )
            self._raise_error()
            # closed meanwhile: they will never all finish. Counted at the close, not
            # now: the close cancels them (the count falls to 0), and a join woken after
            # that returned as if they had all finished
            pending = max(self._outstanding, self._closed_pending)
            if self._closed and pending:
                raise ShutdownError(
                    f"join: the coordinator closed with {pending} functions pending"
                )

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises a pending error)."""
        with self._cond:
            self._raise_error()
            return self._outstanding == 0

    def fetch(self, values: Any) -> Any:
        """The results of RemoteValues, in the same structure (lists, tuples, dicts)."""
        if isinstance(values, RemoteValue):
            return values.fetch()
        if isinstance(values, (list, tuple)):
            return type(values)(self.fetch(v) for v in values)
        if isinstance(values, dict):
            return {k: self.fetch(v) for k, v in values.items()}
        return values

    def create_per_worker_dataset(
        self, fn: str | Callable[..., Any], *args: Any, kwargs: Mapping[str, Any] | None = None
    ) -> PerWorkerDataset:
        """A dataset each worker makes with ``fn(ctx, *args, **kwargs)`` from its job
        module (made again when a worker restarts); schedule with ``iter()`` of it."""
        name = _function_name(fn)
        encode_value((args, dict(kwargs or {})))  # fail now, in the caller, if they cannot
        return PerWorkerDataset(self, name, tuple(args), dict(kwargs or {}))

    def _new_resource(self, fn: str, args: tuple[Any, ...], kwargs: Any) -> PerWorkerIterator:
        rid = next(self._resource_ids)
        args_tree, tensors = encode_value(args)
        kw_tree, kw_tensors = encode_value(kwargs)
        self._resources[rid] = (fn, args_tree, _shift(kw_tree, len(tensors)), tensors + kw_tensors)
        return PerWorkerIterator(rid)

    def stats(self) -> dict[str, Any]:
        """Counters of this coordinator: scheduled, completed, failed, cancelled and
        retried functions, worker restarts seen, mean dispatch overhead."""
        return {
            "scheduled": self.scheduled,
            "completed": self.completed,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "retried": self.retried,
            "worker_restarts": sum(w.restarts for w in self.workers),
            "steps_per_execution": self.steps_per_execution,
            "dispatch_overhead_ms": (
                round(1000 * self._dispatch_s / self._runs, 4) if self._runs else None
            ),
            "dispatch_runs": self._runs,
            "dispatch_seconds": self._dispatch_s,
            "workers_available": int(self._available_count()),
        }

    # ------------------------------------------------------------------ the chief

    def _chief_client(self) -> Client:
        if self._chief is None:
            raise InvalidArgument("this coordinator was given no chief address")
        return self._chief

    def create_variables(
        self,
        variables: Sequence[VariableDef],
        optimizer: Mapping[str, Any] | None = None,
        timeout: float = 120.0,
    ) -> Placement:
        """Create the model's variables through the chief (idempotent)."""
        from zmqps.core.variables import Placement

        body: dict[str, Any] = {"variables": [v.to_wire() for v in variables]}
        if optimizer is not None:
            body["optimizer"] = dict(optimizer)
        rep = self._io.run(self._ask_chief("create_vars", body, timeout))
        return Placement.from_wire(rep["placement"])

    def checkpoint(self, timeout: float = 120.0) -> dict[str, Any]:
        """Have the chief take a checkpoint now (its checkpoint machinery and root);
        returns its name and step."""
        wait = min(timeout, MAX_WAIT_S)  # the chief's wait for a step boundary
        return self._io.run(self._ask_chief("checkpoint", {"wait": wait}, timeout))

    def chief_status(self, timeout: float = 10.0) -> dict[str, Any]:
        return self._io.run(self._ask_chief("status", {}, timeout))

    def rewound_steps(self, timeout: float = 120.0) -> int:
        """Steps whose updates restores took back so far (the chief counts, per restore
        that went back to a checkpoint, the batches each worker pushed after it), once
        no restore is under way; 0 without a chief."""
        if self.chief_address is None:
            return 0
        deadline = time.monotonic() + timeout
        while True:
            st = self.chief_status(timeout)
            if not st.get("recovering") or time.monotonic() > deadline:
                return int(st.get("rewound_batches") or 0)
            time.sleep(0.2)

    async def _ask_chief(self, op: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        chief = self._chief_client()
        deadline = time.monotonic() + timeout
        while True:
            try:
                rep = await chief.request(op, body, timeout=max(timeout, 5.0))
                return dict(rep.body)
            except DeadlineExceeded:
                if time.monotonic() > deadline:
                    raise
                log.info("waiting for the chief at %s (%s)", chief.endpoint, op)
            except NotReady as exc:  # e.g. a checkpoint while a restarted PS is restored
                if time.monotonic() > deadline:
                    raise
                log.info("%s: %s; asking again", op, exc)
                await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ closing

    def close(self, shutdown_workers: bool = False) -> None:
        """Stop: closures still queued are cancelled; ``shutdown_workers`` also tells
        every worker server to leave the cluster (their work is done)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._closed_pending = self._outstanding  # what join() then reports
            self._cond.notify_all()  # a join() waiting returns (ShutdownError)
        try:
            self._io.run(self._close(shutdown_workers), timeout=60)
        finally:
            self._io.stop()
            self._ctx.term()

    async def _close(self, shutdown_workers: bool) -> None:
        self._cancel_queued(ShutdownError("the coordinator closed"))
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self.workers:
            if w.running is not None:
                self._finish(w.running, error=ShutdownError("the coordinator closed"))
                w.running = None
        if shutdown_workers:
            await asyncio.gather(*(self._shutdown(w) for w in self.workers))
        for c in [w.client for w in self.workers] + ([self._chief] if self._chief else []):
            await c.close()

    async def _shutdown(self, w: _RemoteWorker) -> None:
        try:
            await w.client.request("shutdown", {"reason": "done"}, timeout=5.0, attempts=2)
        except ZmqpsError as e:
            log.warning("worker %d did not acknowledge shutdown: %s", w.index, e)

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop

    def _raise_error(self) -> None:
        """With self._cond held: raise (and clear) the first unreported error."""
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _enqueue(self, closure: _Closure, front: bool = False) -> None:
        if front:
            self._queue.appendleft(closure)
        else:
            self._queue.append(closure)
        self._has_work.set()

    def _finish(self, c: _Closure, value: Any = None, error: BaseException | None = None) -> None:
        with self._cond:
            self._outstanding -= 1
            if error is None:
                self.completed += 1
            elif isinstance(error, FunctionCancelled | ShutdownError):
                self.cancelled += 1
            else:
                self.failed += 1
            self._cond.notify_all()
        c.remote._resolve(value, error)
        if self.metrics is not None:
            outcome = (
                "ok"
                if error is None
                else "cancelled"
                if isinstance(error, FunctionCancelled | ShutdownError)
                else "failed"
            )
            self.metrics.coordinator_functions.labels(outcome).inc()

    def _fail(self, c: _Closure, error: BaseException) -> None:
        """An application error: fail ``c``, cancel every queued closure, keep the error
        for join()."""
        log.error("%s (closure %d) failed: %s", c.fn, c.id, str(error).split("\n", 1)[0])
        with self._cond:
            if self._error is None:
                self._error = error
        self._finish(c, error=error)
        self._cancel_queued(FunctionCancelled(f"cancelled: an earlier function failed ({c.fn})"))

    def _cancel_queued(self, error: ZmqpsError) -> None:
        while self._queue:
            self._finish(self._queue.popleft(), error=type(error)(str(error)))

    async def _next(self) -> _Closure:
        while not self._queue:
            self._has_work.clear()
            await self._has_work.wait()
        return self._queue.popleft()

    async def _dispatch(self, w: _RemoteWorker) -> None:
        """Feed worker ``w`` one closure at a time while it is available."""
        while True:
            await w.available.wait()
            c = await self._next()
            if not w.available.is_set():
                self._enqueue(c, front=True)  # lost meanwhile: someone else takes it
                continue
            w.running = c
            try:
                await self._run(w, c)
            finally:
                w.running = None

    async def _run(self, w: _RemoteWorker, c: _Closure) -> None:
        c.remote.attempts += 1
        lost = w.lost
        try:
            await self._make_resources(w)
            body = {
                "fn": c.fn,
                "args": c.args,
                "kwargs": c.kwargs,
                "steps": c.steps,
                "closure": self._key_base + c.id,
            }
            if w.incarnation is not None:
                body["inc"] = w.incarnation
            started = time.perf_counter()
            rep = await self._unless_lost(
                w.client.request("run", body, c.tensors, timeout=self.run_timeout), lost
            )
            rtt = time.perf_counter() - started
        except _RETRYABLE as e:
            self._retry(w, c, e)
            return
        except ZmqpsError as e:  # the function's error, or a request the worker refused
            self._fail(c, e)
            return
        try:
            value = decode_value(rep.body["result"], rep.tensors)
        except (ZmqpsError, KeyError, ValueError, TypeError) as e:
            self._fail(c, InvalidArgument(f"{c.fn}: undecodable result ({e})"))
            return
        overhead = max(0.0, rtt - float(rep.body.get("exec_s", 0.0)))
        self._dispatch_s += overhead
        self._runs += 1
        if self.metrics is not None:
            self.metrics.coordinator_dispatch.observe(overhead)
        c.remote.worker = w.index
        self._finish(c, value)

    async def _unless_lost(self, request: Any, lost: asyncio.Event) -> Any:
        """Await ``request`` unless the worker is declared lost first (NotReady)."""
        done, value = await unless_set(lost, request, Exception)
        if not done:
            raise NotReady("the worker was lost while running it")
        return value

    async def _make_resources(self, w: _RemoteWorker) -> None:
        for rid, (fn, args, kwargs, tensors) in list(self._resources.items()):
            if rid in w.made:
                continue
            body = {"id": rid, "fn": fn, "args": args, "kwargs": kwargs}
            if w.incarnation is not None:
                body["inc"] = w.incarnation
            await self._unless_lost(
                w.client.request("make_resource", body, tensors, timeout=self.run_timeout),
                w.lost,
            )
            w.made.add(rid)

    def _retry(self, w: _RemoteWorker, c: _Closure, error: BaseException) -> None:
        if isinstance(error, ShutdownError) and self._closed:
            self._finish(c, error=error)
            return
        # The worker may be gone: stop feeding it until a ping says otherwise.
        w.down(f"{type(error).__name__}: {error}")
        if c.remote.attempts >= self.max_attempts:
            self._fail(c, WorkerLost(f"{c.fn} lost its worker {c.remote.attempts} times"))
            return
        with self._cond:
            self.retried += 1
        if self.metrics is not None:
            self.metrics.coordinator_retries.inc()
        log.warning(
            "%s (closure %d) did not finish on worker %d (%s): retrying",
            c.fn,
            c.id,
            w.index,
            error,
        )
        self._enqueue(c, front=True)

    async def _watch(self, w: _RemoteWorker) -> None:
        """Ping ``w``: an answer makes it available (a new incarnation: a restart, its
        running closure is lost); silence for heartbeat_timeout makes it lost."""
        while True:
            try:
                rep = await w.client.request(
                    "ping", {}, timeout=max(0.5, min(2.0, self.heartbeat_timeout / 2))
                )
                inc = rep.body.get("incarnation")
                if isinstance(inc, int):
                    w.last_ok = time.monotonic()
                    w.up(inc)
            except ZmqpsError:
                if w.available.is_set() and time.monotonic() - w.last_ok > self.heartbeat_timeout:
                    w.down(f"no answer for {self.heartbeat_timeout:g}s")
            await asyncio.sleep(self.heartbeat_interval)


def _shift(tree: Any, by: int) -> Any:
    """``tree`` with its buffer indices moved by ``by`` (to join two encoded values)."""
    if by == 0 or tree is None or type(tree) in (bool, int, float, str):
        return tree
    tag, payload = tree
    if tag in ("a", "s"):
        return [tag, payload + by]
    if tag in ("l", "t"):
        return [tag, [_shift(x, by) for x in payload]]
    if tag == "d":
        return [tag, {k: _shift(x, by) for k, x in payload.items()}]
    return tree
