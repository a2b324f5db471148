"""A PS started by hand with no chief to give it variables is never silent: it says
what it waits for, again and again, until variables come or it is stopped."""

from __future__ import annotations

import asyncio
import logging

import pytest
import zmq.asyncio

import zmqps.roles.ps.serve as serve_module
from zmqps.roles.ps import PSConfig, serve_ps
from zmqps.transport import Client, SocketOptions, free_ports

pytestmark = pytest.mark.timeout(30)

OPTS = SocketOptions(linger_ms=0)


def test_a_ps_without_variables_says_what_it_waits_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(serve_module, "IDLE_NOTE_S", 0.3)
    caplog.set_level(logging.WARNING, "zmqps.ps")

    async def main() -> None:
        (port,) = free_ports(1)
        ctx = zmq.asyncio.Context()
        task = asyncio.ensure_future(serve_ps(PSConfig(index=0, bind=f"127.0.0.1:{port}"), ctx))
        client = Client(ctx, f"127.0.0.1:{port}", "w0:0", options=OPTS)
        try:
            await client.request("ping", timeout=5.0, attempts=3)
            await asyncio.sleep(1.0)
            await client.request("shutdown", timeout=5.0)
            await asyncio.wait_for(task, 10.0)
        finally:
            task.cancel()
            await client.close()
            ctx.term()

    asyncio.run(main())
    notes = [r.getMessage() for r in caplog.records if "no variables after" in r.getMessage()]
    assert 2 <= len(notes) <= 5, notes
    assert "waiting for a chief to create them" in notes[0]
    assert "zmqps-server --role chief" in notes[0]
