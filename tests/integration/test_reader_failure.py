"""A server whose reader stops (a bug: an error nobody planned for while a message is
read) must not leave its process running deaf, every peer then waiting on it for
ever: the PS ends, failed, naming the error, within a bound (loopback, real ZeroMQ)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import zmq.asyncio

from zmqps.cli.launch import free_ports
from zmqps.roles.ps import PSConfig, serve_ps
from zmqps.transport import Client, Server


def test_a_ps_whose_reader_failed_ends_failed_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    dispatch = Server._dispatch
    broken: list[bool] = []

    def reading(self: Server, frames: list[Any]) -> None:
        if broken:
            raise ValueError("a bug while reading")
        dispatch(self, frames)

    monkeypatch.setattr(Server, "_dispatch", reading)

    async def main() -> None:
        (port,) = free_ports(1)
        cfg = PSConfig(index=0, bind=f"127.0.0.1:{port}")
        ctx = zmq.asyncio.Context()
        task = asyncio.ensure_future(serve_ps(cfg, ctx))
        client = Client(ctx, cfg.bind, "w0:0")
        try:
            await client.request("ping", timeout=5.0, attempts=3)  # it serves
            broken.append(True)
            asking = asyncio.ensure_future(client.request("ping", timeout=30.0))
            done, _ = await asyncio.wait([task], timeout=10.0)
            assert done, "the PS went on running, deaf, after its reader failed"
            with pytest.raises(RuntimeError, match="stopped reading.*a bug while reading"):
                task.result()
            asking.cancel()
        finally:
            task.cancel()
            await client.close()
            ctx.term()

    asyncio.run(main())
