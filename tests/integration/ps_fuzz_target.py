"""A PS in its own process, for the fuzz test (its memory is measured from outside).

Usage: ``python ps_fuzz_target.py STATS_JSON [MAX_MSG_SIZE]``. Serves a PSService
(no shards until someone creates them) on a ROUTER bound to 127.0.0.1:0 and prints
``serving ENDPOINT``. On a ``shutdown`` request it writes its transport counters
(``Server.stats``) and ``PSService.status()`` to STATS_JSON and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import zmq.asyncio

from zmqps.roles.ps import PSService
from zmqps.transport import Server, SocketOptions


async def main(stats_path: Path, max_msg_size: int) -> None:
    ctx = zmq.asyncio.Context()
    service = PSService(0)
    options = SocketOptions(linger_ms=1000, max_msg_size=max_msg_size)
    server = Server(ctx, "127.0.0.1:0", service, name="ps0", options=options)
    try:
        server.bind()
        server.start()
        print(f"serving {server.endpoint}", flush=True)
        await service.shutdown_requested.wait()
        await asyncio.sleep(0.1)  # let the shutdown reply leave
        stats = {"transport": server.stats.as_dict(), "service": service.status()}
        tmp = stats_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(stats))
        tmp.replace(stats_path)
    finally:
        await server.stop()
        ctx.term()


if __name__ == "__main__":
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else SocketOptions().max_msg_size
    asyncio.run(main(Path(sys.argv[1]), limit))
