"""Coordinator mode with real processes: ``zmqps launch --driver coordinator`` trains the
digits MLP while a worker is killed (``kill -9``) in the middle of a function."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio
from helpers import Reaper, read_json, task_pid, wait_for, zmqps_cmd

from zmqps.transport import Client
from zmqps.wire.errors import ZmqpsError

pytestmark = pytest.mark.timeout(420)

HERE = Path(__file__).resolve().parent


def _ping(address: str) -> dict[str, Any] | None:
    async def go() -> dict[str, Any]:
        ctx = zmq.asyncio.Context()
        client = Client(ctx, address, f"test:{uuid.uuid4().hex[:8]}", timeout=2.0)
        try:
            return dict((await client.request("ping")).body)
        finally:
            await client.close()
            ctx.term()

    try:
        return asyncio.run(go())
    except ZmqpsError:
        return None


def _worker_address(pid: int, index: int) -> str:
    """Worker ``index``'s address, from the task config the launcher gave process ``pid``."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    task = json.loads(Path(argv[argv.index(b"--config") + 1].decode()).read_text())
    return str(task["worker"]["cluster"]["worker"][index])


def test_kill_9_a_worker_mid_function_every_function_completes(
    procs: Reaper, tmp_path: Path
) -> None:
    # the job module must be importable by every child
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(HERE)]))}
    summary_path = tmp_path / "summary.json"
    launcher = procs.spawn(
        zmqps_cmd(
            "launch",
            "--no-progress",
            "--timeout",
            "360",
            "--run-dir",
            str(tmp_path / "run"),
            "--summary",
            str(summary_path),
            "--driver",
            "coordinator",
            "--job",
            "coord_slow_job",
            "--ps",
            "1",
            "--workers",
            "2",
            "--heartbeat-timeout",
            "5",
        ),
        name="launch",
        env=env,
    )
    pid = task_pid(launcher, "worker1")
    address = _worker_address(pid, 1)
    wait_for(
        lambda: (p := _ping(address)) is not None and p["running"] >= 0,
        120,
        interval=0.005,
        what="worker 1 running a function",
    )
    os.kill(pid, signal.SIGKILL)
    launcher.expect_exit(0, timeout=360)
    summary = read_json(summary_path)
    coord = summary["coordinator"]
    assert summary["driver"] == "coordinator"
    assert summary["test_accuracy"] >= 0.95, summary
    assert coord["scheduled"] == coord["completed"] == 900, coord  # 20 epochs x 45 steps
    assert coord["retried"] >= 1, coord
    assert coord["failed"] == coord["cancelled"] == 0, coord
    assert coord["worker_restarts"] >= 1, coord
    assert [r["task"] for r in summary["restarts"]] == ["worker1"], summary["restarts"]
    assert "retried" in launcher.stdout


@pytest.mark.timeout(120)
def test_a_driver_that_fails_ends_the_run_at_once_saying_why(procs: Reaper, tmp_path: Path) -> None:
    """A drive() that raised left the chief waiting out its two-minute finish timeout
    with nothing on the console; the launcher then started it again, and the new one
    waited for the PS it had shut down (minutes). Now the error is said at once and
    the run ends, its chief not started again."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(HERE)]))}
    launcher = procs.spawn(
        zmqps_cmd(
            "launch",
            "--no-progress",
            "--run-dir",
            str(tmp_path / "run"),
            "--driver",
            "coordinator",
            "--job",
            "coord_failing_job",
            "--ps",
            "1",
            "--workers",
            "1",
            "--summary",
            str(tmp_path / "summary.json"),
        ),
        name="launch",
        env=env,
    )
    launcher.expect_exit(1, timeout=60)
    # the summary of a failed run says why (it was not written at all)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit_code"] == 1 and summary["run_dir"] == str(tmp_path / "run"), summary
    assert "chief" in summary["launch_failed"] and summary["failed"], summary
    assert "RuntimeError: the job's own bug" in launcher.stderr, launcher.stderr[-3000:]
    assert "after it shut the PS down" in launcher.stderr, launcher.stderr[-3000:]
    assert "restarting it" not in launcher.stderr, launcher.stderr[-3000:]
    log = (tmp_path / "run" / "chief.log").read_text()
    assert "the driver failed (the job's own bug): stopping the chief" in log, log[-3000:]
