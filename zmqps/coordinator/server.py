"""The worker side of coordinator mode: a worker task serving scheduled functions.

Rules of this module:

* Functions are looked up by name in the job module the worker was started with
  (``zmqps-worker --serve --job package.module``); code never crosses the wire.
  A name must be a public identifier of that module and a callable.
* Every function is called as ``fn(ctx, *args, **kwargs)`` with the worker's
  :class:`FunctionContext` (the :class:`~zmqps.roles.worker.Worker` connected to the
  chief and the PS, a per-worker ``state`` dict). One function runs at a time, in
  one thread; the event loop keeps answering pings meanwhile, so the coordinator
  tells a busy worker from a dead one.
* ``steps`` > 1 runs the function that many times in one dispatch and returns the
  last result (``steps_per_execution``).
* An exception raised by a function is an application error: the reply is a
  ``function_error`` carrying its type, text and traceback tail. Errors of the
  request itself (unknown function, bad arguments) keep their own codes.
* Per-worker resources (``make_resource``) are ``iter(fn(ctx, ...))`` kept by id;
  every request carries the incarnation it was meant for, and a restarted worker
  refuses the requests of its predecessor's (NotReady) so the coordinator re-creates
  its resources first.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from zmqps.roles.optable import OpTable
from zmqps.wire import Message, reply
from zmqps.wire import ops as o
from zmqps.wire.errors import (
    ConfigError,
    FunctionError,
    InvalidArgument,
    NotFound,
    NotReady,
    ShutdownError,
)
from zmqps.wire.values import decode_value, encode_value

if TYPE_CHECKING:
    from zmqps.metrics import Metrics
    from zmqps.roles.job import JobConfig
    from zmqps.roles.worker import Worker

__all__ = ["FunctionContext", "FunctionServer", "load_job_module", "lookup"]

log = logging.getLogger("zmqps.coordinator")

#: How much of a function's traceback travels back with its error.
_TRACEBACK_CHARS = 1200


def load_job_module(name: str) -> ModuleType:
    """Import the job module ``package.module``; ConfigError if it cannot be imported."""
    parts = name.split(".")
    if not name or not all(p.isidentifier() for p in parts):
        raise ConfigError(f"--job {name!r}: expected a module path like package.module")
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError(f"--job {name}: cannot import it ({exc})") from exc


def lookup(module: ModuleType, name: str) -> Callable[..., Any]:
    """The public callable ``name`` of ``module`` (NotFound / InvalidArgument otherwise)."""
    if not name.isidentifier() or name.startswith("_"):
        raise InvalidArgument(f"{name!r} is not the name of a public function")
    fn = getattr(module, name, None)
    if fn is None:
        raise NotFound(f"the job module {module.__name__} has no function {name!r}")
    if not callable(fn) or isinstance(fn, type):
        raise InvalidArgument(f"{module.__name__}.{name} is not a function")
    return fn  # type: ignore[no-any-return]


@dataclass
class FunctionContext:
    """What a scheduled function gets as its first argument on a worker."""

    index: int
    num_workers: int
    worker_or_none: Worker | None = None
    job: JobConfig | None = None
    #: anything a function wants to keep between calls on this worker (a built model,
    #: the last pulled parameters); gone when the worker restarts
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def worker(self) -> Worker:
        """The worker's connection to the cluster (pull / push)."""
        if self.worker_or_none is None:
            raise NotReady("this function server has no cluster connection")
        return self.worker_or_none

    def tag(self, closure: int | None) -> None:
        """The pushes the worker makes from now on belong to scheduled function
        ``closure`` (each is applied once, whichever worker runs the function)."""
        if self.worker_or_none is not None:
            self.worker_or_none.tag(closure)

    def take_rewind(self) -> None:
        """After a restore that went back to a checkpoint: this worker's batch count goes
        back to what the checkpoint holds, so its pushes' cursors go on from there (the
        coordinator schedules the steps taken back again, see :func:`fit`)."""
        if self.worker_or_none is not None:
            self.worker_or_none.take_rewind()

    def ensure_variables(self, timeout: float = 120.0) -> None:
        """Wait until the model's variables exist (created by the coordinator or the
        chief) and this worker knows where they are."""
        try:
            self.worker.placement  # noqa: B018 - raises NotReady without variables
        except NotReady:
            self.worker.wait_for_variables(timeout)


#: per-worker resources (datasets) one function server keeps: a program makes a few
MAX_RESOURCES = 256


class FunctionServer:
    """The request handler of a worker in coordinator mode (ping, status, run,
    make_resource, shutdown)."""

    def __init__(
        self,
        module: ModuleType,
        ctx: FunctionContext,
        incarnation: int,
        *,
        metrics: Metrics | None = None,
    ) -> None:
        self.module = module
        self.ctx = ctx
        self.incarnation = incarnation
        self.metrics = metrics
        self.resources: dict[int, Any] = {}
        self.running: int | None = None  # the closure id being run
        self.completed = 0
        self.failed = 0
        self.shutdown_requested = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"zmqps-fn-{ctx.index}")
        self._lock = threading.Lock()
        self._ops = OpTable("a worker server", self.ops())

    def ops(self) -> dict[str, tuple[type[o.Body], Callable[[Message, Any], Any]]]:
        """The op table: every op a function server serves, its typed body, its handler."""
        return {
            "ping": (o.Ping, self._op_ping),
            "status": (o.Status, self._op_status),
            "shutdown": (o.Shutdown, self._op_shutdown),
            "run": (o.Run, self._op_run),
            "make_resource": (o.MakeResource, self._op_make_resource),
        }

    def __call__(self, msg: Message) -> Any:
        return self._ops(msg)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _op_ping(self, msg: Message, req: o.Ping) -> Message:
        return reply(
            msg,
            {
                "role": "worker",
                "index": self.ctx.index,
                "incarnation": self.incarnation,
                "running": -1 if self.running is None else self.running,
            },
        )

    def _op_status(self, msg: Message, req: o.Status) -> Message:
        return reply(
            msg,
            {
                "role": "worker",
                "index": self.ctx.index,
                "incarnation": self.incarnation,
                "job": self.module.__name__,
                "resources": sorted(self.resources),
                "completed": self.completed,
                "failed": self.failed,
            },
        )

    def _op_shutdown(self, msg: Message, req: o.Shutdown) -> Message:
        log.info("worker %d: shutdown requested by %s", self.ctx.index, msg.sender or "?")
        self.shutdown_requested.set()
        return reply(msg)

    def _check_incarnation(self, inc: int | None) -> None:
        if inc is not None and inc != self.incarnation:
            raise NotReady(
                f"worker {self.ctx.index} restarted (incarnation {self.incarnation}, the"
                f" request was for {inc})"
            )
        if self.shutdown_requested.is_set():
            raise ShutdownError(f"worker {self.ctx.index} is shutting down")

    async def _op_make_resource(self, msg: Message, req: o.MakeResource) -> Message:
        self._check_incarnation(req.inc)
        fn = lookup(self.module, req.fn)
        args = decode_value(req.args, msg.tensors)
        kwargs = decode_value(req.kwargs, msg.tensors)
        _check_call(args, kwargs)
        rid = req.id
        if rid not in self.resources and len(self.resources) >= MAX_RESOURCES:
            raise InvalidArgument(
                f"worker {self.ctx.index} holds {len(self.resources)} per-worker resources"
                " (the bound): no more"
            )

        def make() -> Any:
            return iter(fn(self.ctx, *args, **kwargs))

        self.resources[rid] = await self._in_thread(make, f"{req.fn} (resource {rid})")
        return reply(msg, o.ResourceMade(rid).to_wire())

    async def _op_run(self, msg: Message, req: o.Run) -> Message:
        self._check_incarnation(req.inc)
        fn = lookup(self.module, req.fn)
        args = decode_value(req.args, msg.tensors, self._resource)
        kwargs = decode_value(req.kwargs, msg.tensors, self._resource)
        _check_call(args, kwargs)
        steps, closure = req.steps, req.closure

        def call() -> Any:
            out = None
            self.ctx.tag(closure)
            try:
                for _ in range(steps):
                    self.ctx.take_rewind()
                    out = fn(self.ctx, *args, **kwargs)
            finally:
                self.ctx.tag(None)
            return out

        self.running = closure or 0
        started = time.perf_counter()
        try:
            result = await self._in_thread(call, req.fn)
        finally:
            self.running = None
        seconds = time.perf_counter() - started
        try:
            tree, tensors = encode_value(result)
        except InvalidArgument as exc:
            raise FunctionError(f"TypeError: the result of {req.fn}: {exc}") from None
        return reply(msg, o.Ran(tree, steps, seconds).to_wire(), tensors)

    def _resource(self, rid: int) -> Any:
        try:
            return self.resources[rid]
        except KeyError:
            raise NotReady(f"worker {self.ctx.index} has no resource {rid}") from None

    async def _in_thread(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` in the function thread; its exception becomes a FunctionError."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            out = await loop.run_in_executor(self._executor, fn)
        except Exception as exc:  # the function's own error: an application error
            self.failed += 1
            self._observe("failed", time.perf_counter() - started)
            tb = "".join(traceback.format_exception(exc))[-_TRACEBACK_CHARS:]
            log.warning(
                "worker %d: %s raised %s: %s", self.ctx.index, what, type(exc).__name__, exc
            )
            raise FunctionError(f"{type(exc).__name__}: {exc}\n{tb}") from exc
        self.completed += 1
        self._observe("ok", time.perf_counter() - started)
        return out

    def _observe(self, status: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.function_done(status, seconds)


def _check_call(args: Any, kwargs: Any) -> None:
    if not isinstance(args, tuple):
        raise InvalidArgument("args must be a tuple")
    if not isinstance(kwargs, dict):
        raise InvalidArgument("kwargs must be a dict")
