"""A PS task as a process: its server, its metrics endpoint, signals."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from zmqps.metrics import Metrics
from zmqps.roles._run import run_server, start_exporter
from zmqps.roles.configs import PSConfig
from zmqps.roles.ps.replica import Primary
from zmqps.roles.ps.service import PSService
from zmqps.roles.ps.slots import PSSlots
from zmqps.roles.ps.warm import warm_kernels
from zmqps.transport import Client, Server, SocketOptions, ZmqContext
from zmqps.transport.server import MAX_UNREAD, MAX_UNREAD_PER_PEER
from zmqps.transport.unread import UnreadReplies
from zmqps.wire import Message
from zmqps.wire.errors import InvalidArgument

__all__ = ["KernelGate", "ps_slots", "run_ps", "serve_ps"]

#: a PS that holds no variables says so every this many seconds
IDLE_NOTE_S = 60.0

#: ... first after this many (a chief never started: it said nothing for 60 s)
FIRST_IDLE_NOTE_S = 10.0

log = logging.getLogger("zmqps.ps")

#: requests whose handling may run a compiled kernel (a value check, an update, a
#: step's sum, a bfloat16 rounding): held until the kernels are loaded. Not
#: ``sync_config``: the chief's start waits on it, and before any push is applied it
#: has no step to apply
KERNEL_OPS = frozenset(
    {"push", "push_pull", "push_rows", "push_pull_rows", "pull", "pull_rows", "replicate"}
)


class KernelGate:
    """The PS process's handler until its kernels are loaded (:mod:`~zmqps.roles.ps.warm`).

    The process starts loading them in a thread as it starts serving (:meth:`start`:
    a PS restarted after a crash is loading while the chief fails over or restores,
    not after); a request that may need a kernel meanwhile waits for that (a few
    seconds on a loaded machine) off the event loop, which answers everything else
    (``ping``, ``ps_state``, ``status``, the chief's long polls). The held requests
    are then handled in the order they came, and after the last of them every
    request goes straight through. Holding a request is as if it arrived later,
    which every sender must allow for anyway."""

    def __init__(
        self,
        handler: Callable[[Message], Message | Awaitable[Message]],
        warm: Callable[[], float] = warm_kernels,
        index: int = 0,
    ) -> None:
        self._handler = handler
        self._warm = warm
        self._index = index
        self._loading: asyncio.Future[float] | None = None
        self._held = 0
        self.ready = False

    def start(self) -> None:
        """Begin loading the kernels now (in a thread); else the first request that
        may need one does."""
        if self._loading is None:
            loop = asyncio.get_running_loop()
            self._loading = loop.create_future()
            self._loading.add_done_callback(self._loaded)
            # a daemon thread of its own, not the loop's executor: interpreter exit
            # joins the executor's threads, so a PS stopped by a signal while its
            # kernels load (1 to 4 s) would end only after them
            threading.Thread(
                target=self._load, args=(loop, self._loading), name="zmqps-kernels", daemon=True
            ).start()

    def __call__(self, msg: Message) -> Message | Awaitable[Message]:
        if self.ready or msg.op not in KERNEL_OPS:
            return self._handler(msg)
        self.start()
        return self._after_loading(msg)

    async def _after_loading(self, msg: Message) -> Message:
        self._held += 1
        try:
            assert self._loading is not None
            await asyncio.shield(self._loading)
        except Exception:  # then each kernel loads when first used (logged by _loaded)
            pass
        finally:
            self._held -= 1
            if not self._held and self._loading is not None and self._loading.done():
                self.ready = True  # every request held has been handed on, in order
        out = self._handler(msg)
        return await out if inspect.isawaitable(out) else out

    def _load(self, loop: asyncio.AbstractEventLoop, loading: asyncio.Future[float]) -> None:
        """The thread's body: load, then hand the outcome to the loop (if it still runs)."""

        def settle(seconds: float | None, exc: BaseException | None) -> None:
            if loading.done():
                return
            if exc is not None:
                loading.set_exception(exc)
            else:
                loading.set_result(seconds or 0.0)

        try:
            seconds, exc = self._warm(), None
        except Exception as e:  # handed to the loop, logged by _loaded
            seconds, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process stops
            loop.call_soon_threadsafe(settle, seconds, exc)

    def _loaded(self, loading: asyncio.Future[float]) -> None:
        exc = None if loading.cancelled() else loading.exception()
        if exc is not None or loading.cancelled():
            log.warning(
                "ps %d: loading the kernels failed (%s): each loads when used", self._index, exc
            )
        else:
            seconds = loading.result()
            log.info("ps %d: kernels loaded in %.2fs, off the event loop", self._index, seconds)


async def serve_ps(
    cfg: PSConfig, ctx: ZmqContext, options: SocketOptions | None = None
) -> PSService:
    """Serve until the chief's shutdown (or a signal, after a grace period in which the
    chief can still take its final checkpoint)."""
    metrics = Metrics() if cfg.metrics_port is not None else None
    service = PSService(
        cfg.index, chunk_bytes=cfg.chunk_bytes, metrics=metrics, checkpoint_dir=cfg.checkpoint_dir
    )
    store = service.store
    curve = None if options is None else options.curve
    if curve is not None and not curve.connects:
        log.warning(
            "ps %d: %s has no client key pair for a PS (ps.key_secret): this PS cannot"
            " hold copies of other PS's states (--replication); `zmqps keygen` writes one",
            cfg.index,
            curve.source,
        )
    slots = ps_slots(cfg, ctx, service, options)
    if metrics is not None:
        metrics.watch_states(slots.replication_stats)
    gate = KernelGate(slots, index=cfg.index)
    server = Server(
        ctx,
        cfg.bind,
        gate,
        name=f"ps{cfg.index}",
        options=options,
        observer=metrics,
        # a worker's pulls in flight are about one copy of what this PS holds: four
        # per peer and sixteen in all are never reached by peers that read
        unread=UnreadReplies(
            lambda: max(MAX_UNREAD_PER_PEER, 4 * store.nbytes()),
            lambda: max(MAX_UNREAD, 16 * store.nbytes()),
        ),
    )
    # The task's own address first (the cluster spec names it); the metrics port after,
    # so a metrics port picked as 0 can never take it.
    endpoint = server.bind()
    try:
        exporter = start_exporter(metrics, cfg.metrics_host, cfg.metrics_port, f"ps {cfg.index}")
    except OSError:
        await server.stop()
        raise
    loop = asyncio.get_running_loop()
    signalled: list[str] = []
    # Before the "serving on" line: a signal sent as soon as it appears is handled here.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, signalled.append, sig.name)
    log.info("ps %d: serving on %s", cfg.index, endpoint)
    gate.start()
    server.start()
    deaf = server.reader_failed()
    try:
        stop = asyncio.ensure_future(service.shutdown_requested.wait())
        started = loop.time()
        said = started - IDLE_NOTE_S + FIRST_IDLE_NOTE_S  # the first note after 10 s
        either: list[asyncio.Future[Any]] = [stop, deaf]
        while not stop.done() and not signalled:
            await asyncio.wait(either, timeout=0.1, return_when=asyncio.FIRST_COMPLETED)
            if deaf.done():  # nothing is read any more: end, failed, saying why
                stop.cancel()
                raise RuntimeError(
                    f"ps {cfg.index}: its server stopped reading: {deaf.exception()!r}"
                )
            if loop.time() - said < IDLE_NOTE_S:
                continue
            idle = not service.chief_seen and not service.store.stats()["shards"]
            silent = service.chief_silent_for()  # a chief that probed it, gone quiet
            if idle:
                said = loop.time()  # never silent: a PS nobody gave variables says so
                log.warning(
                    "ps %d: no variables after %.0fs: waiting for a chief to create them"
                    " (is `zmqps-server --role chief` running, with this PS in its cluster?)",
                    cfg.index,
                    said - started,
                )
            elif silent is not None and silent >= IDLE_NOTE_S:
                said = loop.time()  # a PS whose chief died serves on, but says so
                log.warning(
                    "ps %d: no word from the chief for %.0fs: serving on (a chief started"
                    " again resumes the run; Ctrl-C or SIGTERM stops this PS)",
                    cfg.index,
                    silent,
                )
        if not service.shutdown_requested.is_set():
            await _grace(cfg, service, stop, signalled)
        stop.cancel()
        await asyncio.sleep(0.05)  # let the shutdown reply leave
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await slots.close()
        await server.stop()
        service.regions.close()
        service.check_threads.close()
        if exporter is not None:
            exporter.close()
    st = service.status()
    # machine-readable, for whoever reads the log afterwards (tests, scripts)
    log.info("ps %d: final state: %s", cfg.index, json.dumps(st, sort_keys=True, default=str))
    for state in slots.slots():  # replicated: each state this process was the primary of
        role = slots.role(state)
        if isinstance(role, Primary) and not role.fenced:
            log.info(
                "ps %d: final state of ps %d's state (primary, term %d): %s",
                cfg.index,
                state,
                role.term,
                json.dumps(slots.service(state).status(), sort_keys=True, default=str),
            )
    why = "the chief shut it down" if service.shutdown_requested.is_set() else signalled[0]
    if not service.shutdown_requested.is_set():
        service.stop_signal = signalled[0]
    log.info(
        "ps %d: stopped (%s): %d shards, %d bytes, %d updates applied, generation %d",
        cfg.index,
        why,
        st.get("shards", 0),
        st.get("bytes", 0),
        st.get("updates_applied", 0),
        st.get("gen", 0),
    )
    return service


def ps_slots(
    cfg: PSConfig, ctx: ZmqContext, service: PSService, options: SocketOptions | None = None
) -> PSSlots:
    """The process's PS states: its own (``service``), and the copies it will hold of
    other PS's states, shipped to over ZeroMQ."""

    def make_copy(slot: int) -> PSService:
        log.info("ps %d: holding a backup of ps %d's state", cfg.index, slot)
        return PSService(slot, chunk_bytes=cfg.chunk_bytes, checkpoint_dir=cfg.checkpoint_dir)

    def link(ps: int, endpoint: str, slot: int) -> Client:
        curve = None if options is None else options.curve
        if curve is not None and not curve.connects:
            # refused, not a configuration error: the chief goes on with fewer copies
            # (under-replicated, shown and alerted on) instead of failing the run
            raise InvalidArgument(
                f"ps {cfg.index} cannot hold copies of other PS's states: CURVE is on and"
                f" {curve.source} has no client key pair for a PS (ps.key_secret); `zmqps"
                " keygen` writes one (a folder made by an older zmqps lacks it)"
            )
        return Client(ctx, endpoint, f"ps{cfg.index}:ship{slot}:{ps}", options=options, slot=slot)

    return PSSlots(service, make_copy=make_copy, link=link)


async def _grace(
    cfg: PSConfig, service: PSService, stop: asyncio.Future[Any], signalled: list[str]
) -> None:
    """After a signal (the whole cluster may be stopping): serve on a little, so the
    workers' last pushes land and the chief can take its final checkpoint, until it
    says shutdown, the grace ends or a second signal comes. A PS without any shard
    holds nothing anyone could still need: it stops at once."""
    if not service.store.stats()["shards"]:
        log.info("ps %d: %s; stopping (no variables here yet)", cfg.index, signalled[0])
        return
    log.info(
        "ps %d: %s; serving until the chief's shutdown (at most %gs; a second signal stops now)",
        cfg.index,
        signalled[0],
        cfg.stop_grace,
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.stop_grace
    while not stop.done() and len(signalled) < 2 and loop.time() < deadline:
        await asyncio.wait([stop], timeout=min(0.1, max(0.0, deadline - loop.time())))
    if len(signalled) > 1 and not stop.done():
        log.info("ps %d: %s again; stopping now", cfg.index, signalled[1])


def run_ps(cfg: PSConfig, options: SocketOptions | None = None) -> int:
    """The PS as a process; its exit code: 0 when the chief shut it down (the run's end,
    or a stop the chief led: its final checkpoint taken), else 128 + the signal that
    stopped it (as a shell says, and as the chief and the workers exit)."""
    served: list[PSService] = []

    async def serve(ctx: ZmqContext) -> None:
        served.append(await serve_ps(cfg, ctx, options))

    run_server(serve)
    stopped_by = served[0].stop_signal if served else None
    return 0 if stopped_by is None else 128 + int(signal.Signals[stopped_by])
