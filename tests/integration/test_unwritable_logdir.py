"""A chief or an evaluator whose ``--logdir`` cannot be made (a file in the way, a
read-only mount) fails at once, saying so, with no socket left open: the summaries
were opened after the chief's server started (the evaluator's clients were made), the
error left them open, and the context's termination waited for them for ever: the
chief hung, serving, until it was stopped; the evaluator hung, silent (loopback, real
ZeroMQ; ``zmqps-server`` / ``zmqps-worker`` now refuse such a flag before anything,
tests/cluster/test_newcomer.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio

from zmqps.cli.launch import free_ports
from zmqps.config import ClusterSpec
from zmqps.roles.chief.serve import serve_chief
from zmqps.roles.configs import ChiefConfig, EvaluatorConfig
from zmqps.roles.evaluator import serve_evaluator
from zmqps.roles.job import JobConfig

pytestmark = pytest.mark.timeout(60)


def _chief(ctx: zmq.asyncio.Context, logdir: str) -> Awaitable[Any]:
    chief, ps, worker = (f"127.0.0.1:{p}" for p in free_ports(3))
    cfg = ChiefConfig(bind=chief, cluster=ClusterSpec(chief, (ps,), (worker,)), logdir=logdir)
    return serve_chief(cfg, ctx)


def _evaluator(ctx: zmq.asyncio.Context, logdir: str) -> Awaitable[Any]:
    (chief,) = (f"127.0.0.1:{p}" for p in free_ports(1))
    cfg = EvaluatorConfig(chief=chief, job=JobConfig(), logdir=logdir, connect_timeout=5.0)
    return serve_evaluator(cfg, ctx)


@pytest.mark.parametrize("start", [_chief, _evaluator], ids=["chief", "evaluator"])
def test_a_logdir_that_cannot_be_made_fails_with_no_socket_left_open(
    tmp_path: Path, start: Callable[[zmq.asyncio.Context, str], Awaitable[Any]]
) -> None:
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    ctx = zmq.asyncio.Context()

    async def main() -> None:
        with pytest.raises(OSError):
            await asyncio.wait_for(start(ctx, str(in_the_way / "tb")), 20.0)

    asyncio.run(main())
    # every socket closed: the context terminates at once (a daemon thread, so that a
    # socket left open fails the test instead of hanging it)
    done = threading.Event()

    def term() -> None:
        ctx.term()
        done.set()

    threading.Thread(target=term, daemon=True).start()
    assert done.wait(10.0), "a socket was left open: the context's termination waits for it"
