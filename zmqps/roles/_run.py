"""Running one role's server as a process: one event loop, one ZeroMQ context."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import zmq.asyncio

from zmqps.metrics import Metrics, MetricsServer

__all__ = ["run_server", "start_exporter"]

log = logging.getLogger("zmqps")


def run_server(serve: Callable[[zmq.asyncio.Context], Awaitable[Any]]) -> int:
    """Run ``serve(ctx)`` to completion; the context is terminated whatever happens."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            await serve(ctx)
        finally:
            ctx.term()

    asyncio.run(main())
    return 0


def start_exporter(
    metrics: Metrics | None, host: str, port: int | None, who: str
) -> MetricsServer | None:
    """Serve ``metrics`` on ``host:port`` (None: no endpoint); OSError if the port is taken."""
    if metrics is None or port is None:
        return None
    exporter = MetricsServer(metrics, host, port)
    log.info("%s: metrics at %s", who, exporter.url)
    return exporter
