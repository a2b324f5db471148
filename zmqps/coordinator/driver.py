"""``zmqps-server --role chief --driver coordinator --job package.module``: the chief
serves as usual and, in the same process, runs the job module's ``drive(coordinator,
job, callbacks)`` with a :class:`Coordinator` over the cluster's worker servers.

Rules of this module:

* The chief's server runs on the process's event loop; the driver runs in a thread
  (user code blocks in ``join()``), its coordinator on its own loop thread.
* When the driver returns, the worker servers are told to shut down: they leave
  the cluster with their work done, so the chief finishes as in the worker-driven
  mode (final checkpoint, evaluation, summary, PS shut down). The summary gets the
  coordinator's counters (``"coordinator"``: scheduled, retried, ...).
* When the driver fails, the same happens and the process then exits with the
  driver's error; when the chief stops first (SIGTERM), the coordinator is closed
  (pending functions cancelled) and the driver's error is not reported.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from zmqps.coordinator.coordinator import Coordinator
from zmqps.coordinator.fit import BackupAndRestore, Callback
from zmqps.coordinator.server import load_job_module, lookup
from zmqps.metrics import Metrics
from zmqps.roles._run import run_server
from zmqps.roles.chief import ChiefConfig, serve_chief
from zmqps.transport import Client, SocketOptions, ZmqContext
from zmqps.transport.base import waited, within
from zmqps.wire.errors import ConfigError, NotFound, RunFailed, ZmqpsError

__all__ = ["run_chief_driver"]

log = logging.getLogger("zmqps.coordinator")

#: Seconds the chief gets to finish after the driver is done before it is told to stop.
FINISH_TIMEOUT = 120.0


def run_chief_driver(
    cfg: ChiefConfig,
    job_module: str,
    *,
    steps_per_execution: int = 1,
    options: SocketOptions | None = None,
) -> int:
    """The chief's process in coordinator mode; returns its exit code."""
    module = load_job_module(job_module)
    try:
        drive = lookup(module, "drive")
    except (NotFound, ZmqpsError) as exc:
        raise ConfigError(f"--job {job_module}: the chief needs its drive() function") from exc
    if cfg.job is None:
        raise ConfigError("--driver coordinator runs a built-in --model")
    if cfg.sync.mode != "async":
        raise ConfigError("--driver coordinator trains asynchronously (--mode async)")
    if steps_per_execution < 1:
        raise ConfigError("--steps-per-execution must be >= 1")
    metrics = Metrics() if cfg.metrics_port is not None else None
    outcome: dict[str, Any] = {}

    def run_driver(holder: dict[str, Coordinator]) -> None:
        coord = Coordinator(
            cfg.cluster,
            steps_per_execution=steps_per_execution,
            options=options,
            heartbeat_timeout=cfg.heartbeat_timeout,
            metrics=metrics,
        )
        holder["coord"] = coord
        callbacks: list[Callback] = []
        if cfg.checkpoint is not None:
            # kept until the run has ended (_forget_backup): a chief restarted after its
            # last epoch resumes after it and trains nothing again
            backup = Path(cfg.checkpoint.directory) / "fit-backup"
            callbacks.append(BackupAndRestore(backup, delete_on_end=False))
        finished = False
        try:
            outcome["result"] = drive(coord, cfg.job, callbacks)
            finished = True
        finally:
            outcome["stats"] = coord.stats()
            # the restores' taken-back steps the training loop trained again: the run's
            # end compares them with the chief's count (_annotate)
            outcome["rewind_accounted"] = coord.rewind_accounted
            if finished:
                # before the workers are told to leave (then the run may end at once):
                # a chief restarted from here on finds the run over and writes these
                _write_record(cfg, outcome)
            # The workers leave only when the work is done: after a failure they stay,
            # so that a restarted chief (a supervisor's restart) finds them to go on with
            coord.close(shutdown_workers=finished)

    async def main(ctx: ZmqContext) -> None:
        holder: dict[str, Coordinator] = {}
        chief = asyncio.ensure_future(serve_chief(cfg, ctx, options, metrics))
        driver = asyncio.ensure_future(asyncio.to_thread(run_driver, holder))
        await asyncio.wait([chief, driver], return_when=asyncio.FIRST_COMPLETED)
        if not driver.done() and "result" in outcome:
            # the driver's training is done and the run ended while it was still closing
            # (waiting for its workers to acknowledge their shutdown): it ends too, and
            # its counters go into the summary
            await waited(asyncio.shield(driver), FINISH_TIMEOUT)
        if not driver.done():  # the chief stopped first (SIGTERM, or it failed)
            if "coord" in holder:
                await asyncio.to_thread(holder["coord"].close)
            await asyncio.gather(driver, return_exceptions=True)
            await chief  # its own error, if any
            # it ended well at once: a chief restarted after an earlier one's driver had
            # finished (its workers then left); that driver's counters go in the summary
            earlier = _read_record(cfg)
            if earlier is not None and "result" not in outcome:
                log.info("the driver of an earlier chief of this run had finished: its counters")
                if _annotate(cfg, earlier):
                    _forget_backup(cfg)
            return
        failed = driver.exception()
        if failed is not None:
            # nothing will train: said now, and the chief stopped (it waited out the
            # whole finish timeout before, two minutes with nothing on the console)
            log.error("the driver failed (%s): stopping the chief", failed)
            await _stop_chief(ctx, cfg, options)
            await waited(asyncio.shield(chief), FINISH_TIMEOUT)
            driver.result()  # the driver's error
        try:
            await within(asyncio.shield(chief), FINISH_TIMEOUT)
        except asyncio.TimeoutError:
            log.error(
                "the chief did not finish %.0fs after the driver: stopping it", FINISH_TIMEOUT
            )
            await _stop_chief(ctx, cfg, options)
            await chief
        if _annotate(cfg, outcome):
            _forget_backup(cfg)

    return run_server(main)


async def _stop_chief(ctx: ZmqContext, cfg: ChiefConfig, options: SocketOptions | None) -> None:
    assert cfg.cluster.chief is not None
    client = Client(ctx, cfg.cluster.chief, "coordinator:driver", options=options)
    try:
        await client.request("shutdown", {"reason": "driver finished"}, timeout=5.0)
    except ZmqpsError as exc:
        log.warning("the chief did not acknowledge shutdown: %s", exc)
    finally:
        await client.close()


#: the driver's outcome once its training finished, kept beside the fit backup
RECORD = "driver-final.json"


def _record_path(cfg: ChiefConfig) -> Path | None:
    if cfg.checkpoint is None:
        return None
    return Path(cfg.checkpoint.directory) / "fit-backup" / RECORD


def _write_record(cfg: ChiefConfig, outcome: dict[str, Any]) -> None:
    """Keep the finished driver's outcome (atomically) for a chief restarted before the
    summary has it. Best effort: without it such a summary lacks the counters."""
    path = _record_path(cfg)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(outcome, default=str) + "\n")
        tmp.replace(path)
    except (OSError, TypeError, ValueError) as exc:
        log.warning("could not keep the driver's outcome in %s: %s", path, exc)


def _forget_backup(cfg: ChiefConfig) -> None:
    """The run has ended (its summary written): the fit backup and the driver's record
    go, so that a new run on its checkpoints (``--resume``) trains its epochs again."""
    path = _record_path(cfg)
    if path is None:
        return
    for done in (path, path.with_name("fit.json")):
        try:
            done.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove %s: %s", done, exc)


def _read_record(cfg: ChiefConfig) -> dict[str, Any] | None:
    """A finished driver's outcome, as :func:`_write_record` kept it (None: none, or
    unreadable)."""
    path = _record_path(cfg)
    if path is None:
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("stats"), dict):
        return None
    return raw


def _annotate(cfg: ChiefConfig, outcome: dict[str, Any]) -> bool:
    """Add the driver's result and the coordinator's counters to the chief's summary;
    whether there was one (the run ended)."""
    stats = outcome.get("stats", {})
    log.info(
        "coordinator: %d functions scheduled, %d completed, %d retried, %d failed",
        stats.get("scheduled", 0),
        stats.get("completed", 0),
        stats.get("retried", 0),
        stats.get("failed", 0),
    )
    if not cfg.summary_path:
        return True  # nowhere to write them; the run ended all the same
    path = Path(cfg.summary_path)
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return False  # the chief wrote none (it stopped before the end)
    summary["driver"] = "coordinator"
    summary["coordinator"] = {**stats, **outcome.get("result", {})}
    # a restore after the training loop's last look (a PS lost while the run ended)
    # took back steps nobody trained again: the final model lacks them, and the run
    # says so and fails rather than end well
    accounted = outcome.get("rewind_accounted")
    lost = int(summary.get("rewound_batches") or 0) - (accounted or 0)
    failure = None
    if accounted is not None and lost > 0:
        failure = (
            f"a restore after training ended took back {lost} steps that were not trained"
            " again (a PS lost at the run's end): the final model lacks them"
        )
        summary["failed"] = failure
        log.error("%s", failure)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)
    if failure is not None:
        raise RunFailed(failure)
    return True
