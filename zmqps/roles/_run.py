"""Running one role's server as a process: one event loop, one ZeroMQ context."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import zmq.asyncio

__all__ = ["run_server"]


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
