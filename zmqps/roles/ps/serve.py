"""A PS task as a process: its server, its metrics endpoint, signals."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from zmqps.metrics import Metrics
from zmqps.roles._run import run_server, start_exporter
from zmqps.roles.configs import PSConfig
from zmqps.roles.ps.service import PSService
from zmqps.transport import Server, SocketOptions, ZmqContext

__all__ = ["run_ps", "serve_ps"]

log = logging.getLogger("zmqps.ps")


async def serve_ps(
    cfg: PSConfig, ctx: ZmqContext, options: SocketOptions | None = None
) -> PSService:
    """Serve until the chief's shutdown (or a signal, after a grace period in which the
    chief can still take its final checkpoint)."""
    metrics = Metrics() if cfg.metrics_port is not None else None
    service = PSService(
        cfg.index, chunk_bytes=cfg.chunk_bytes, metrics=metrics, checkpoint_dir=cfg.checkpoint_dir
    )
    server = Server(
        ctx, cfg.bind, service, name=f"ps{cfg.index}", options=options, observer=metrics
    )
    # The task's own address first (the cluster spec names it); the metrics port after,
    # so a metrics port picked as 0 can never take it.
    endpoint = server.bind()
    try:
        exporter = start_exporter(metrics, cfg.metrics_host, cfg.metrics_port, f"ps {cfg.index}")
    except OSError:
        await server.stop()
        raise
    log.info("ps %d: serving on %s", cfg.index, endpoint)
    server.start()
    loop = asyncio.get_running_loop()
    signalled: list[str] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled.append, sig.name)
    try:
        stop = asyncio.ensure_future(service.shutdown_requested.wait())
        while not stop.done() and not signalled:
            await asyncio.wait([stop], timeout=0.1)
        if not service.shutdown_requested.is_set():
            # A signal (the whole cluster is stopping): serve on a little, so the chief
            # can take its final checkpoint, until it says shutdown or the grace ends.
            log.info("ps %d: %s; serving until the chief's shutdown", cfg.index, signalled[0])
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(stop), cfg.stop_grace)
        stop.cancel()
        await asyncio.sleep(0.05)  # let the shutdown reply leave
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await server.stop()
        service.regions.close()
        if exporter is not None:
            exporter.close()
    log.info("ps %d: stopped (%s)", cfg.index, service.status())
    return service


def run_ps(cfg: PSConfig, options: SocketOptions | None = None) -> int:
    return run_server(lambda ctx: serve_ps(cfg, ctx, options))
