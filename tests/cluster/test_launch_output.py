"""``zmqps launch`` whose output nobody reads: training goes on.

The launcher's stderr is a pipe the test does not read for a while, then the launcher
is stopped (SIGSTOP) for a while: the chief's global step advances all along (the
launcher drains its tasks' pipes whatever its own output does, and a task whose pipe
nobody drains drops lines instead of blocking), and the run ends with exit 0.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import Proc, Reaper, chief_address, chief_status, wait_for, zmqps_cmd

#: seconds the output goes unread, and seconds the launcher is stopped
UNREAD_S = 3.0
STOPPED_S = 3.0
#: --epochs 250: about 11,500 global steps, training past both checks (they end by
#: step 6,500 at 500 steps a second, twice this machine's rate under the suite's load)
#: a global step the pipes' buffers cannot hold the log lines of (about 1,500)
PAST_THE_PIPES = 2500


def _step(chief: str) -> int:
    status = chief_status(chief, timeout=2.0)
    assert status is not None, "the chief answers no status mid-run"
    return int(status["global_step"])


def _past(chief: str, run: Path) -> bool:
    """Training is past :data:`PAST_THE_PIPES` (or over)."""
    status = chief_status(chief, timeout=2.0)
    if status is None:  # not up yet, or training over
        return (run / "chief-summary.json").exists()
    return int(status.get("global_step", 0)) >= PAST_THE_PIPES


def _advances(chief: str, wait_s: float, what: str) -> None:
    before = _step(chief)
    time.sleep(wait_s)
    after = _step(chief)
    assert after > before + 10, f"{what}: global step {before} -> {after}"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_unread_output_and_a_stopped_launcher_never_stop_training(
    procs: Reaper, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    argv = zmqps_cmd(
        "launch",
        *("--ps", "1", "--workers", "2", "-v", "--log-every", "1", "--epochs", "250"),
        *("--no-progress", "--timeout", "100", "--run-dir", str(run)),
    )
    out, err = tmp_path / "launch.out", tmp_path / "launch.err"
    out.touch()
    err.touch()
    popen = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    launcher = Proc("launch", argv, popen, out, err)
    procs.procs.append(launcher)  # stopped at teardown if still running
    chief = chief_address(launcher)  # from RUN_DIR/tasks (the output is not read)
    # past what every pipe on the way holds (64 KiB each, a log line per step): a
    # launcher that does not drain its tasks while its own output is unread stops here
    wait_for(
        lambda: _past(chief, run),
        timeout=40,
        what=f"global step {PAST_THE_PIPES} with the output unread",
    )
    _advances(chief, UNREAD_S, "output unread")
    popen.send_signal(signal.SIGSTOP)
    try:
        time.sleep(1.5)
        _advances(chief, STOPPED_S, "launcher stopped")
    finally:
        popen.send_signal(signal.SIGCONT)
    assert popen.stdout is not None
    text = popen.stdout.read().decode(errors="replace")  # to the end: EOF when it exits
    rc = popen.wait(90)
    assert rc == 0, text[-3000:]
    assert "zmqps launch: done in" in text
