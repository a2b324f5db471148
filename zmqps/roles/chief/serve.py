"""The chief as a process: server, watchers, signals, and the end of the run.

The order of the end matters and is kept here, in one place:

1. every worker has left with its work done (the leaves' changes of N reached the
   PS, so no step will be applied after this);
2. the final checkpoint (labelled with the step every PS reports);
3. the final model's evaluation, export and the summary; status says ``finished``;
4. the PS stay up until every live side-car evaluator took its last evaluation of
   that model and left (at most ``final_eval_timeout`` seconds; the cluster's
   evaluator never heard, until a heartbeat timeout after the chief began);
5. the PS are shut down, the chief exits.

A shutdown (SIGTERM, SIGINT, the ``shutdown`` op) instead hears the workers leave
(half the grace period at most), takes a last checkpoint within the grace period,
and shuts the PS down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import time
from collections.abc import Awaitable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from zmqps.core.recovery import Event, Phase
from zmqps.core.variables import Placement
from zmqps.metrics import Metrics
from zmqps.metrics.summaries import open_summaries
from zmqps.process import write_text_whole
from zmqps.roles._run import run_server, start_exporter
from zmqps.roles.chief.finish import summarize
from zmqps.roles.chief.recovery import RunFinished, WorkLost
from zmqps.roles.chief.service import ChiefService
from zmqps.roles.configs import ChiefConfig
from zmqps.roles.homes import Homes
from zmqps.transport import Client, Requester, Server, SocketOptions, ZmqContext
from zmqps.transport.base import unless_set, within
from zmqps.wire import ops as o
from zmqps.wire.errors import (
    DeadlineExceeded,
    ModelMismatch,
    NotReady,
    RolledBack,
    RunFailed,
    ZmqpsError,
)

__all__ = ["run_chief", "serve_chief"]

T = TypeVar("T")

log = logging.getLogger("zmqps.chief")


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class _Watchers:
    """The chief's background tasks (watching workers and PS, re-replicating, writing
    summaries). One that fails is a bug, and the run must not go on without it (a
    chief that no longer watches its PS waits for ever on one that died): the chief
    ends with the error, exit code 1, leaving the PS as they are, so that a chief
    started again (the launcher restarts it) adopts them."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []
        self.failed = asyncio.Event()
        self.error: BaseException | None = None

    def start(self, name: str, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        task.add_done_callback(lambda t: self._ended(name, t))
        self.tasks.append(task)

    def _ended(self, name: str, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("chief: its %s failed: the chief ends", name, exc_info=exc)
        if self.error is None:
            self.error = exc
        self.failed.set()

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()

    async def unless_one_fails(self, run: Awaitable[bool]) -> bool:
        """``run``'s result; the first watcher's error instead, should one fail first."""
        done, result = await unless_set(self.failed, run)
        if not done:
            assert self.error is not None
            raise self.error
        return bool(result)


async def serve_chief(
    cfg: ChiefConfig,
    ctx: ZmqContext,
    options: SocketOptions | None = None,
    metrics: Metrics | None = None,
) -> dict[str, Any]:
    """Serve the chief until training ends; ``metrics``: a catalogue to fill and export
    (e.g. shared with a coordinator in this process; default: a fresh one when
    ``cfg.metrics_port`` is set)."""
    result, _ = await _serve(cfg, ctx, options, metrics)
    return result


async def _serve(
    cfg: ChiefConfig,
    ctx: ZmqContext,
    options: SocketOptions | None,
    metrics: Metrics | None,
) -> tuple[dict[str, Any], int]:
    """The chief's whole life: its result and the process's exit code (0, or 128 + the
    signal that stopped the run before its end)."""
    if metrics is None and cfg.metrics_port is not None:
        metrics = Metrics()
    # before any socket: a failure here (a --logdir it cannot create) is raised with
    # nothing to close (it came after the server started: the context's termination
    # waited for its sockets for ever, and the chief hung, serving, until stopped)
    summaries = open_summaries(cfg.logdir, "chief")
    ps_clients = [
        Client(ctx, addr, "chief:0", options=options, timeout=30.0) for addr in cfg.cluster.ps
    ]
    # the chief speaks to PS *states*: each link goes to the process serving its state
    # (the same one, until a fail-over moves it)
    homes = Homes(ps_clients)
    service = ChiefService(cfg, homes.links(), metrics=metrics, homes=homes)
    server = Server(ctx, cfg.bind, service, name="chief", options=options, observer=metrics)
    # The task's own address first (the cluster spec names it); the metrics port after,
    # so a metrics port picked as 0 can never take it.
    try:
        endpoint = server.bind()
        exporter = start_exporter(metrics, cfg.metrics_host, cfg.metrics_port, "chief")
    except OSError:
        await server.stop()
        for c in ps_clients:
            await c.close()
        if summaries is not None:
            summaries.close()
        raise
    log.info(
        "chief: serving on %s (%d PS, %d workers)",
        endpoint,
        cfg.cluster.num_ps,
        cfg.cluster.num_workers,
    )
    # Its start (adopt, restore, fresh) comes first: a worker registering before it
    # began would be told to resume where no PS yet knows (a resumed run's worker
    # then trained its checkpointed batches again). The start's task clears it.
    service.recovery.starting = True
    server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, _stop_on, service, sig)
    service.summaries = summaries
    watchers = _Watchers()
    # a server that stopped reading (a bug) leaves the chief deaf: it ends instead
    watchers.start("server's reader", server.reader_failed())
    watchers.start("worker watch", service.recovery.watch_workers())
    watchers.start("wait reports", service.report_waits())
    if service.summaries is not None:
        watchers.start("summary writer", service.write_summaries())
    failed: list[str] = []  # shutdown steps that failed (each logged with its traceback)
    try:
        ran = await _unless_forced(service, watchers.unless_one_fails(_run(service, watchers)))
        if ran:
            service.recovery.ps_shutting_down = True
            mover = service.recovery.mover
            await _unless_forced(
                service,
                _shutdown_ps(
                    ps_clients,
                    cfg.heartbeat_timeout,
                    service.recovery.silent_ps(),
                    drained=() if mover is None else mover.drained,
                    idle=()
                    if mover is None
                    else _serving_nothing(mover.homes, service.recovery.variables.placement),
                    # stopped by a signal: a PS that does not answer at once is not
                    # waited for (the window is for the end of a run, not a stop)
                    budget=None if service.stop_signal is None else SIGNAL_SHUTDOWN_S,
                ),
            )
        if service.recovery.lifecycle.can(Event.FINISHED):
            service.recovery.handle(Event.FINISHED)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        watchers.cancel()
        # every step runs whatever the one before did: a socket left open would hang
        # the context's termination (the process would never exit)
        await _cleanly("recovery", service.recovery.close(), failed)
        await _cleanly("server", server.stop(), failed)
        if exporter is not None:
            exporter.close()
        if service.summaries is not None:
            service.summarize(force=True)
            service.summaries.close()
        for c in ps_clients:
            await _cleanly(f"client of {c.endpoint}", c.close(), failed)
    if service.failure:  # ended in order, and failed a check: never retried
        raise RunFailed(service.failure)
    if failed:  # the run itself ended well: its exit code must still tell the truth
        raise ZmqpsError(f"chief: shutdown steps failed: {', '.join(failed)} (see the log)")
    stopped_by = service.stop_signal
    if stopped_by is not None and not service.finished:
        last = service.checkpoints.ck.last_committed if service.checkpoints else None
        # the final checkpoint's step when it is past the step last heard (async: the
        # workers' last heartbeats lag the pushes the checkpoint holds)
        step = max(service.global_step, last.step if last is not None else 0)
        log.warning(
            "chief: stopped by %s before the end of the run (global step %d)%s",
            stopped_by.name,
            step,
            f"; its last checkpoint is {last.name} (step {last.step}) in {last.path.parent}:"
            " a chief started again on it goes on from there (zmqps launch: --resume)"
            if last is not None
            else "",
        )
        return service.result, 128 + int(stopped_by)
    if service.finished:
        # the run's (a chief started after its end restored nothing: its own step is 0)
        step = service.result.get("global_step", service.global_step)
        log.info(
            "chief: the run is over (global step %s)%s",
            step,
            f"; summary in {cfg.summary_path}" if cfg.summary_path else "",
        )
    return service.result, 0


def _stop_on(service: ChiefService, sig: signal.Signals) -> None:
    """SIGTERM or SIGINT: the run stops (workers told by their heartbeats' replies); a
    second one: the chief stops waiting for anything and exits."""
    if service.stop_signal is None:
        log.warning("chief: %s: stopping the run (a second signal stops it at once)", sig.name)
        service.stop_signal = sig
    elif service.shutdown_requested.is_set() and not service.forced.is_set():
        log.warning("chief: %s again: stopping at once, waiting for nothing more", sig.name)
        service.forced.set()
    service.shutdown_requested.set()


async def _unless_forced(service: ChiefService, step: Awaitable[T]) -> T | None:
    """``step``'s result; None, the step cancelled, once a second signal came."""
    return (await unless_set(service.forced, step))[1]


async def _cleanly(name: str, step: Awaitable[Any], failed: list[str]) -> None:
    """Run one step of the shutdown. Any failure is logged and recorded, never raised
    here: every later step must still run, or a socket left open would hang the
    context's termination (the process would never exit)."""
    try:
        await step
    except Exception:  # logged with its traceback, recorded, reported after the shutdown
        log.exception("chief: closing the %s failed (the other steps go on)", name)
        failed.append(name)


async def _run(service: ChiefService, watchers: _Watchers) -> bool:
    """The run, from the start to its end or a shutdown. False when it never started
    (there are no PS to shut down: none answered a chief started after the end)."""
    cfg = service.cfg
    recovery = service.recovery
    starting = asyncio.ensure_future(service.start())
    stop = asyncio.ensure_future(service.shutdown_requested.wait())
    await asyncio.wait([starting, stop], return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if not starting.done():  # a shutdown before the PS ever answered
        starting.cancel()
        log.info("chief: shutdown before the cluster started")
        return True  # those PS that came up meanwhile are shut down
    try:
        starting.result()
    except RunFinished as e:
        _ended_before(service, e)
        # the cluster's other tasks, started again with it (`docker compose up` on the
        # kept volume), hear that it ended instead of waiting for a chief that is gone
        await _late_tasks_told(service)
        return e.ps_up  # PS started again after the end are shut down
    except WorkLost as e:
        # nothing to train or to finish: the PS are shut down, the run ends failed, and
        # the summary says why (a chief started again here reads it: it fails too)
        service.failure = str(e)
        log.error("%s", e)
        service.result = {"failed": str(e), "work_lost": True, "checkpoint": e.checkpoint}
        _write_summary(service)
        return e.ps_up
    watchers.start("PS watch", recovery.watch_ps())
    if recovery.rereplicator is not None:
        watchers.start("re-replication", recovery.rereplicator.run())
    if recovery.mover is not None:
        watchers.start("state moves", recovery.mover.run())
    await _create_job_variables(service)
    while True:
        await _first(service.all_done, service.shutdown_requested, recovery.training_failed)
        if recovery.training_error is not None:
            raise recovery.training_error
        if not service.all_done.is_set() or service.shutdown_requested.is_set():
            break
        if await _finish(service):
            if cfg.keep_alive:
                await service.shutdown_requested.wait()
            return True
        service.all_done.clear()  # a restore sent finished workers back to work
    # a shutdown: one last checkpoint, within the grace period
    recovery.handle(Event.SHUTDOWN)
    grace_ends = time.monotonic() + cfg.stop_grace
    # The workers were signalled too: they end their step and leave. Hear them first
    # (half the grace at most), so their last updates are in the final checkpoint and
    # their leave is answered.
    await _workers_gone(service, cfg.stop_grace / 2)
    recovery.stop_training()
    if service.checkpoints is not None:
        try:
            await within(service.checkpoints.final(), max(0.1, grace_ends - time.monotonic()))
        except asyncio.TimeoutError:
            log.error("final checkpoint not committed within %.0fs", cfg.stop_grace)
    if service.work_lost:
        # the summary says why and what the run goes on from, as a start that found the
        # work lost writes it: a chief started again fails the same way at once
        # (``RecoveryController._failed_before``)
        ck = recovery.checkpointer
        latest = None if ck is None else await asyncio.to_thread(ck.latest)
        service.result = {
            "failed": service.failure,
            "work_lost": True,
            "checkpoint": None if latest is None else latest.name,
        }
        _write_summary(service)
    return True


def _ended_before(service: ChiefService, finished: RunFinished) -> None:
    """A chief started after the end of its run (its PS shut down, or started again
    holding nothing): it ends at once, as the run did, with the summary the run wrote
    (left as it is)."""
    log.warning("%s; this chief ends", finished)
    service.ended_before = finished
    service.finished = True
    service.result = finished.summary
    failed = finished.summary.get("failed")
    if failed:  # it ended failed (exit code 3): so does this chief, not with 0
        service.failure = str(failed)
        log.error("the run failed: %s", service.failure)


#: a chief started after the end of its run answers the cluster's workers and evaluator
#: that register for this many heartbeat timeouts (at most its --startup-timeout) before
#: it ends: tasks started with it (`docker compose up` again) hear that the run ended
ENDED_GRACE_TIMEOUTS = 2


def ended_grace(cfg: ChiefConfig) -> float:
    """Seconds a chief started after its run ended waits for the cluster's tasks to
    register (each is told the run ended) before it ends."""
    return min(cfg.startup_timeout, ENDED_GRACE_TIMEOUTS * cfg.heartbeat_timeout)


async def _late_tasks_told(service: ChiefService) -> None:
    """A chief started after the end of its run: keep answering until every worker and
    evaluator of the cluster spec registered and heard that the run ended, for
    :func:`ended_grace` seconds at most (``--keep-alive``: until stopped), or a
    signal. A task started later finds no chief and exits 1 after its
    ``--connect-timeout``."""
    cfg = service.cfg
    if cfg.keep_alive:
        await service.shutdown_requested.wait()
        return
    tasks = {("worker", i) for i in range(cfg.cluster.num_workers)}
    tasks.update(("evaluator", i) for i in range(len(cfg.cluster.evaluator)))
    if not tasks - service.told_ended:
        return
    grace = ended_grace(cfg)
    log.info(
        "chief: telling the cluster's tasks that register within %.0fs that the run ended",
        grace,
    )
    deadline = time.monotonic() + grace
    while tasks - service.told_ended and not service.shutdown_requested.is_set():
        if time.monotonic() >= deadline:
            log.info(
                "chief: not heard within %.0fs: %s",
                grace,
                ", ".join(f"{r} {i}" for r, i in sorted(tasks - service.told_ended)),
            )
            return
        await asyncio.sleep(0.05)


def _write_summary(service: ChiefService) -> None:
    """The run's summary (``service.result``) to the chief's ``--summary`` file. One
    that cannot be written (a full disk) fails the run, said in one line; the run's end
    goes on (its PS shut down, its evaluators told): the chief exiting 1 there left its
    PS serving, and was started again for a summary it could not write either."""
    if not service.cfg.summary_path:
        return
    path = Path(service.cfg.summary_path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # checked at the start
        write_text_whole(path, json.dumps(service.result, indent=2) + "\n", "the run's summary")
        return
    except OSError as exc:
        why = f"cannot write the run's summary {path}: {exc.strerror}"
    except ZmqpsError as exc:
        why = str(exc)
    log.error("%s", why)
    service.result.setdefault("failed", why)
    if not service.failure:
        service.failure = why


async def _create_job_variables(service: ChiefService) -> None:
    """A built-in job: the chief creates its model's variables itself."""
    job = service.cfg.job
    if job is None:
        return

    def build() -> Any:
        if job.is_ctr:
            return job.build_ctr_model(job.load_ctr("train"))
        return job.build_model(job.load("train"))

    # in a thread: loading the data set takes seconds, and a restarted chief must go on
    # answering the workers' heartbeats meanwhile
    model = await asyncio.to_thread(build)
    try:
        await service.create_variables(model.variables(), dict(job.optimizer))
    except ModelMismatch as exc:
        raise job.not_the_model(exc) from None


async def _finish(service: ChiefService) -> bool:
    """The end of a run: the final checkpoint, the summary, ``finished``. False when a
    restore meanwhile sent finished workers back to train again (they wait for the
    end of the run until ``finished``): the run goes on."""
    cfg = service.cfg
    recovery = service.recovery
    deadline = time.monotonic() + cfg.startup_timeout
    while True:
        # a restore in progress ends first
        while not (recovery.lifecycle.can(Event.ALL_DONE) or recovery.phase is Phase.FINISHING):
            await asyncio.sleep(0.05)
        if service.failure:
            return False  # a restore took back the work of workers that left: it stops
        if not service.members.all_done():
            log.warning("a restore sent finished workers back to train again: the run goes on")
            return False
        if recovery.phase is not Phase.FINISHING:
            recovery.handle(Event.ALL_DONE)
        recovery.stop_training()  # no step comes any more: nothing may start a checkpoint now
        gen = recovery.gen
        lost = ""
        try:
            if service.checkpoints is not None:
                lost = await _final_checkpoint(service)
            result = await summarize(service)
        except (RolledBack, NotReady, DeadlineExceeded) as e:
            # a PS restarted (or was cut off) at the end of the run: the final checkpoint
            # and the summary are taken once it is restored (or answers again)
            if time.monotonic() > deadline:
                raise
            log.warning("the end of the run waits for the PS (%s)", e)
            await _recovered(service, gen, deadline)
            continue
        if recovery.gen == gen:
            if lost:  # first: a --resume goes on from the checkpoint it names
                failed = result.get("failed")
                result["failed"] = f"{lost}; {failed}" if failed else lost
            service.result = result
            break
        # restored while the summary was made: it may be of values that are gone
    _write_summary(service)
    # ended in order: a chief started again here is a new run (or finds it ended)
    await recovery.forget_done()
    if service.result.get("failed"):
        service.failure = str(service.result["failed"])
        log.error("the run failed: %s", service.failure)
    service.finished = True
    await _evaluators_done(service)
    await _waiting_told(service)
    return True


async def _final_checkpoint(service: ChiefService) -> str:
    """Take the run's final checkpoint; why it failed (the disk full, say), or "".
    A final checkpoint that could not be written fails the run (exit code 3): it ended
    otherwise in order, but what it trained since its latest checkpoint is in no
    checkpoint, and a ``--resume`` would not find where it ended."""
    assert service.checkpoints is not None
    ck = service.checkpoints.ck
    failed_before = ck.failed
    ckpt = await service.checkpoints.final(finished=True)
    last = ck.last_committed
    if ckpt is not None or ck.last_transient:
        return ""
    if ck.failed == failed_before and (last is not None and last.step >= ck.last_step):
        return ""  # nothing since the latest checkpoint, which holds the end
    # failed now, or the checkpoint of the last step was tried just before the end and
    # failed (the final one then had nothing new to take: the run failed only for its
    # export, and the checkpoint's failure went unsaid)
    return f"the final checkpoint could not be written ({ck.last_error}); " + (
        f"{last.name} (step {last.step}) stays the latest"
        if last is not None
        else "no checkpoint of this run is committed"
    )


async def _waiting_told(service: ChiefService) -> None:
    """Finished workers that wait for the run's end hear that it finished with their
    next heartbeat: keep answering until they did (three heartbeat intervals at most),
    so they leave at once instead of waiting out a silent chief."""
    deadline = time.monotonic() + 3 * service.cfg.heartbeat_interval
    while service.members.waiting(service.clock()) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def _recovered(service: ChiefService, gen: int, deadline: float) -> None:
    """Wait until the cluster left generation ``gen`` (a restore) or every PS answers
    again with no restore under way (a partition healed), or ``deadline``."""
    recovery = service.recovery
    await asyncio.sleep(service.cfg.heartbeat_interval)  # a PS lost is found meanwhile
    while time.monotonic() < deadline:
        if not recovery.recovering and (recovery.gen != gen or not recovery.ps_down):
            return
        await asyncio.sleep(0.05)


#: At the end of the run, an evaluator silent for less than this many heartbeat
#: timeouts (paused, say) is still waited for: it scores the final model when it
#: resumes. One silent longer is taken as gone.
FINAL_EVAL_SILENCE_TIMEOUTS = 4


async def _evaluators_done(service: ChiefService) -> None:
    """Keep the PS up until every side-car evaluator scored the final model and left
    (it says so), at most ``final_eval_timeout`` seconds. An evaluator silent for a
    while (paused: it has not left) is waited for until it has been silent for
    ``FINAL_EVAL_SILENCE_TIMEOUTS`` heartbeat timeouts. A chief that never heard the
    cluster's evaluator waits for it to register first: until it has been silent a
    heartbeat timeout since this chief began (its process may still be starting: a
    short run on a loaded machine ended before it was up, and it then waited for a
    chief that was gone and scored nothing), and three heartbeat intervals at least (a
    chief restarted at the end of the run: the evaluator registers again)."""
    cfg = service.cfg
    if cfg.cluster.evaluator and not service.evaluator_heard:
        until = max(
            time.monotonic() + 3 * cfg.heartbeat_interval,
            service.began + cfg.heartbeat_timeout,
        )
        while not service.evaluator_heard and time.monotonic() < until:
            await asyncio.sleep(0.05)
    silence = min(cfg.final_eval_timeout, FINAL_EVAL_SILENCE_TIMEOUTS * cfg.heartbeat_timeout)
    if not service.live_evaluators(silence):
        return
    deadline = time.monotonic() + cfg.final_eval_timeout
    if service.live_evaluators():
        log.info("waiting for the evaluator's last evaluation before shutting the PS down")
    else:
        log.warning(
            "the evaluator has been silent since before the end of the run: waiting for its"
            " last evaluation until it has been silent %.0fs",
            silence,
        )
    while service.live_evaluators(silence) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if service.live_evaluators(silence):
        log.warning(
            "the evaluator did not finish within %.0fs; shutting the PS down",
            cfg.final_eval_timeout,
        )


async def _workers_gone(service: ChiefService, timeout: float) -> None:
    """Wait up to ``timeout`` s until no worker is alive (each left, or is dead)."""
    deadline = service.clock() + timeout
    while service.members.alive(service.clock()) and service.clock() < deadline:
        await asyncio.sleep(0.05)


#: each attempt of the shutdown of a PS waits this long for its acknowledgement
SHUTDOWN_ATTEMPT_S = 5.0


def shutdown_attempts(heartbeat_timeout: float) -> int:
    """Attempts at shutting a PS down at the end of a run: for three heartbeat
    timeouts (a PS cut off by a partition then is told once it heals, and does not
    serve an ended run for ever), at least one, at most 30 s in all."""
    window = min(30.0, 3 * heartbeat_timeout)
    return max(1, math.ceil(window / SHUTDOWN_ATTEMPT_S))


#: seconds a drained PS is given to answer at the end (one started again since)
DRAINED_PROBE_S = 2.0

#: a chief stopped by a signal waits this long for each PS to acknowledge its
#: shutdown (one that does not, down or cut off, is not waited for: the stop is the
#: user's, and every role obeys a signal within about two seconds)
SIGNAL_SHUTDOWN_S = 2.0


def _serving_nothing(homes: Homes, placement: Placement | None) -> set[int]:
    """The PS processes that neither serve a state nor hold a copy of one (drained, or
    never asked for)."""
    holding = set(homes.of)
    if placement is not None:
        holding.update(b for s in placement.shards for b in s.backups)
    return set(range(len(homes.processes))) - holding


async def _shutdown_ps(
    ps_clients: Sequence[Requester],
    heartbeat_timeout: float,
    silent: Collection[int] = (),
    drained: Collection[int] | Mapping[int, str] = (),
    budget: float | None = None,
    idle: Collection[int] = (),
) -> None:
    """Tell every PS process the run is over; one known ``silent`` (stopped or cut off
    past the heartbeat timeout, its states failed over or restored elsewhere) gets one
    attempt, not the whole window; one ``drained`` (it left the run, told to shut down
    then, and acknowledged it) none, unless another process answers at its address
    (``drained`` maps each to the boot id it had): one started again (a supervisor, a
    PS schedule) as the run ended, which no look of the chief saw, and which would
    otherwise wait for a chief for ever. One ``idle`` (serving no state: drained
    before this chief started, which does not know it left) is asked once whether it
    runs, and told only if it does (a chief started again after a scale down spent 30 s
    of the run's end on a PS long gone). ``budget``: one attempt of that many seconds
    each, whatever else (the chief was stopped by a signal)."""
    body = o.Shutdown("training finished").to_wire()
    window = shutdown_attempts(heartbeat_timeout)

    async def runs(c: Requester) -> dict[str, Any] | None:
        """The ``ps_state`` of the process at ``c``'s address, asked again while one
        accepts connections there (started again as the run ended, it may take
        seconds to answer: a fault schedule left one, slow to load its kernels, waiting
        for a chief for ever), within the shutdown window (one look under a
        ``budget``); None: none listens, or none answered."""
        listening = getattr(c, "listening", None) if budget is None else None
        deadline = time.monotonic() + window * SHUTDOWN_ATTEMPT_S
        while True:
            try:
                rep = await c.request("ps_state", None, timeout=DRAINED_PROBE_S, attempts=1)
                return dict(rep.body)
            except ZmqpsError:
                if listening is None or time.monotonic() >= deadline or not await listening():
                    return None

    async def one(q: int, c: Requester) -> None:
        attempts = 1 if q in silent or budget is not None else window
        timeout = SHUTDOWN_ATTEMPT_S if budget is None else budget
        if q in drained:
            boot = drained.get(q) if isinstance(drained, Mapping) else None
            state = await runs(c)
            if state is None:
                return  # gone, as drained
            if boot is None or state.get("boot") == boot:
                return  # the process drained, shutting down
            log.info("ps at %s was drained and started again: shutting it down", c.endpoint)
        elif q in idle and await runs(c) is None:
            log.info("ps at %s serves no state and does not answer: gone", c.endpoint)
            return
        try:
            # sent again on each deadline, and at once when the connection comes back
            await c.request("shutdown", body, timeout=timeout, attempts=attempts)
        except DeadlineExceeded:
            log.warning(
                "ps at %s did not acknowledge shutdown in %.0fs",
                c.endpoint,
                attempts * timeout,
            )
        except ZmqpsError as e:
            log.warning("ps at %s refused shutdown: %s", c.endpoint, e)

    await asyncio.gather(*(one(q, c) for q, c in enumerate(ps_clients)))


def run_chief(cfg: ChiefConfig, options: SocketOptions | None = None) -> int:
    """The chief as a process; returns its exit code."""
    code = 0

    async def serve(ctx: ZmqContext) -> None:
        nonlocal code
        _, code = await _serve(cfg, ctx, options, None)

    run_server(serve)
    return code
