"""SIGHUP stops ``zmqps launch`` like SIGTERM."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from helpers import Reaper, launched_by, wait_for, zmqps_cmd


@pytest.mark.timeout(60)
def test_sighup_stops_the_run_like_sigterm(procs: Reaper, tmp_path: Path) -> None:
    argv = zmqps_cmd(
        "launch",
        *("--ps", "1", "--workers", "2", "-v", "--epochs", "1000", "--log-every", "5"),
        *("--no-progress", "--timeout", "50", "--run-dir", str(tmp_path / "run")),
    )
    launcher = procs.spawn(argv, name="launch")
    wait_for(
        lambda: re.search(r"\[worker\d\] .*worker \d: step \d+", launcher.stderr),
        timeout=40,
        what="a training step in the launcher's output",
    )
    launcher.send(signal.SIGHUP)
    launcher.expect_exit(129, timeout=30)
    assert "zmqps launch: interrupted; stopping the cluster" in launcher.stderr
    assert "Traceback" not in launcher.stderr
    chief = (tmp_path / "run" / "chief.log").read_text()
    assert "SIGTERM: stopping the run" in chief  # the launcher's graceful stop
    assert not launched_by(launcher.pid)
