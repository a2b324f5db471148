"""SIGHUP stops ``zmqps launch`` like SIGTERM; Ctrl-C at any moment of a command's
start (even inside its imports) prints one line and exits 130, no traceback."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import Reaper, _argv, launched_by, script, wait_for, zmqps_cmd


def _training(procs: Reaper, *flags: str) -> Any:
    """``zmqps launch`` of 1 PS and 2 workers for 1,000 epochs with ``flags``, once
    both workers said a training step in its output."""
    argv = zmqps_cmd(
        "launch",
        *("--ps", "1", "--workers", "2", "-v", "--epochs", "1000", "--log-every", "5"),
        "--no-progress",
        *flags,
    )
    launcher = procs.spawn(argv, name="launch")
    for i in (0, 1):
        wait_for(
            lambda i=i: re.search(rf"\[worker{i}\] .*worker {i}: step \d+", launcher.stderr),
            timeout=40,
            what=f"a training step of worker {i} in the launcher's output",
        )
    return launcher


@pytest.mark.timeout(60)
def test_sighup_stops_the_run_like_sigterm(procs: Reaper, tmp_path: Path) -> None:
    launcher = _training(procs, "--timeout", "50", "--run-dir", str(tmp_path / "run"))
    launcher.send(signal.SIGHUP)
    launcher.expect_exit(129, timeout=30)
    assert "zmqps launch: interrupted; stopping the cluster" in launcher.stderr
    assert "Traceback" not in launcher.stderr
    chief = (tmp_path / "run" / "chief.log").read_text()
    assert "SIGTERM: stopping the run" in chief  # the launcher's graceful stop
    assert not launched_by(launcher.pid)


def startup_cpu(argv: list[str]) -> float:
    """CPU seconds (user and system) ``argv --help`` takes to its end: the program's
    start, its imports and its arguments."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([*argv, "--help"], capture_output=True, timeout=60, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv",
    [
        ["zmqps", "launch", "--ps", "1", "--workers", "1", "--epochs", "1"],
        ["zmqps-server", "--help"],
        ["zmqps-worker", "--help"],
    ],
    ids=["zmqps", "zmqps-server", "zmqps-worker"],
)
def test_ctrl_c_early_is_one_line_and_130(procs: Reaper, tmp_path: Path, argv: list[str]) -> None:
    # The moments are the program's CPU time, not the wall time since its spawn: on a
    # loaded machine a wall delay can land in the interpreter's own start (before any
    # of the program's code runs, ~0.05 s of CPU: a Ctrl-C there ends it as Python
    # does). They are parts of what its start costs here (0.3 to 0.5 s of CPU on 2
    # cores, less where its modules are compiled already), inside its imports and
    # arguments. A launcher's whole run can take less CPU of its own than the last
    # of them (its children do the work): a run that had said it was done exits 0.
    start = startup_cpu([script(argv[0]), *argv[1:2]] if argv[1] == "launch" else [script(argv[0])])
    stopped = 0
    for i, part in enumerate((0.3, 0.5, 0.65, 0.8)):
        cpu = round(max(0.08, part * start), 3)
        args = [*argv, "--run-dir", str(tmp_path / f"run{i}")] if argv[1] == "launch" else argv
        proc = procs.spawn([script(args[0]), *args[1:]], name=f"{args[0]}-{i}")
        proc.wait_cpu(cpu, timeout=20)
        proc.send(signal.SIGINT)
        rc = proc.wait(30)
        done = "usage:" in proc.stdout or "zmqps launch: done" in proc.stdout
        if done and rc == 0:
            continue  # it was done before the signal came: exiting, with its own code
        assert rc == 130, f"after {cpu}s of CPU: exit {rc}\n{proc.tail()}"
        assert "Traceback" not in proc.stderr, f"after {cpu}s of CPU:\n{proc.stderr}"
        assert "interrupted" in proc.stderr, f"after {cpu}s of CPU:\n{proc.stderr}"
        stopped += not done
    assert stopped >= 2, "the signals came too late to stop the start they test"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("command", ["launch", "zmqps-server --help"])
def test_a_stop_signal_once_the_command_is_done_leaves_the_exit_code_alone(
    procs: Reaper, tmp_path: Path, sig: int, command: str
) -> None:
    # Once a command has said it is done (a run's summary, a help text), signals every
    # millisecond until it has exited: the interpreter's own shutdown puts the default
    # actions back, and one landing there killed it by the signal (exit -2, -15).
    for i in range(3):
        if command == "launch":
            argv = zmqps_cmd(
                *("launch", "--ps", "1", "--workers", "1", "--epochs", "1", "--no-progress"),
                *("--run-dir", str(tmp_path / f"run{i}")),
            )
            done = "zmqps launch: done"
        else:
            argv, done = [script("zmqps-server"), "--help"], "usage:"
        proc = procs.spawn(argv, name=f"{Path(argv[0]).name}-{i}")
        wait_for(lambda p=proc, d=done: d in p.stdout or p.poll() is not None, 60)
        while proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send(sig)
            time.sleep(0.001)
        rc = proc.wait(10)
        assert rc in (0, 128 + sig), f"exit {rc}\n{proc.tail()}"
        assert "Traceback" not in proc.stderr, proc.stderr
        assert done in proc.stdout, proc.tail()


@pytest.mark.timeout(60)
def test_a_worker_signalled_past_its_restarts_fails_the_run_with_a_summary(
    procs: Reaper, tmp_path: Path
) -> None:
    """A worker that exits 143 (SIGTERM) once more than ``--max-restarts`` allow fails
    the run: exit code 1 and the ``--summary`` of a failed launch. The launch took the
    worker's 143 for its own stop: exit 143, no summary written."""
    import json

    run, summary = tmp_path / "run", tmp_path / "summary.json"
    launcher = _training(
        procs, "--max-restarts", "0", "--run-dir", str(run), "--summary", str(summary)
    )
    task = str(run / "tasks" / "worker0.json")
    (worker0,) = [p for p in launched_by(launcher.pid) if task in _argv(p)]
    os.kill(worker0, signal.SIGTERM)
    launcher.expect_exit(1, timeout=30)
    said = json.loads(summary.read_text())
    assert said["exit_code"] == 1 and "worker0" in said["launch_failed"], said
    assert not launched_by(launcher.pid)
