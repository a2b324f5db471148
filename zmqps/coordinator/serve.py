"""``zmqps-worker --serve --job package.module``: a worker task as a function server.

The worker registers with the chief like any worker (heartbeats, incarnation,
the placement), then binds its own address from the cluster spec and serves the
coordinator's requests there until the coordinator shuts it down (it then leaves
the cluster with its work done) or it gets SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from zmqps.config import ClusterSpec, TaskSpec, bind_address
from zmqps.coordinator.server import FunctionContext, FunctionServer, load_job_module
from zmqps.metrics import Metrics
from zmqps.roles._run import run_server
from zmqps.roles.job import JobConfig
from zmqps.roles.worker import RunEnded, Worker
from zmqps.transport import Server, SocketOptions, ZmqContext
from zmqps.wire.errors import ConfigError

__all__ = ["run_function_server", "serve_functions"]

log = logging.getLogger("zmqps.coordinator")


async def serve_functions(
    ctx: ZmqContext,
    bind: str,
    handler: FunctionServer,
    *,
    options: SocketOptions | None = None,
    metrics: Metrics | None = None,
) -> str:
    """Serve ``handler`` on ``bind`` until a shutdown request or SIGTERM; returns why."""
    server = Server(
        ctx, bind, handler, name=f"worker-{handler.ctx.index}", options=options, observer=metrics
    )
    endpoint = server.bind()
    server.start()
    log.info(
        "worker %d: serving functions of %s on %s",
        handler.ctx.index,
        handler.module.__name__,
        endpoint,
    )
    terminated = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, terminated.set)
    stop = asyncio.ensure_future(handler.shutdown_requested.wait())
    term = asyncio.ensure_future(terminated.wait())
    try:
        await asyncio.wait([stop, term], return_when=asyncio.FIRST_COMPLETED)
        # let the shutdown reply leave before the socket closes
        await asyncio.sleep(0.05)
    finally:
        stop.cancel()
        term.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await server.stop()
    return "terminated" if terminated.is_set() else "done"


def run_function_server(
    cluster: ClusterSpec,
    task: TaskSpec,
    job_module: str,
    *,
    job: JobConfig | None = None,
    options: SocketOptions | None = None,
    metrics: Metrics | None = None,
    bind: str | None = None,
    **worker_kwargs: Any,
) -> int:
    """The process of a worker in coordinator mode; returns its exit code."""
    module = load_job_module(job_module)
    if task.role != "worker" or task.index >= cluster.num_workers:
        raise ConfigError("--serve runs a worker task named in the cluster spec")
    address = bind or bind_address(cluster.address("worker", task.index))
    try:
        worker = Worker.from_cluster(
            cluster, task, options=options, metrics=metrics, **worker_kwargs
        )
    except RunEnded as ended:
        log.warning("worker %d: %s: nothing to serve", task.index, ended)
        return 0
    reason = "error"
    try:
        if worker.mode != "async":
            raise ConfigError(
                f"coordinator mode trains asynchronously; the chief runs in {worker.mode} mode"
            )
        fctx = FunctionContext(task.index, cluster.num_workers, worker, job)
        handler = FunctionServer(module, fctx, worker.incarnation, metrics=metrics)
        try:
            reason = _serve(address, handler, options, metrics)
        finally:
            handler.close()
    finally:
        worker.close(reason)
    if reason == "terminated":
        log.warning("worker %d: terminated by SIGTERM; left the cluster", task.index)
        return 128 + signal.SIGTERM
    return 0


def _serve(
    address: str, handler: FunctionServer, options: SocketOptions | None, metrics: Metrics | None
) -> str:
    out: list[str] = []

    async def main(ctx: ZmqContext) -> None:
        out.append(await serve_functions(ctx, address, handler, options=options, metrics=metrics))

    run_server(main)
    return out[0]
