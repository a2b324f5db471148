"""Two ``zmqps launch`` on the same folders at once.

A second launch with ``--resume`` on the folder of a run still training went on from
its checkpoints beside it: both clusters wrote the same checkpoints, logs and summary,
each read the other's summary as its own, and both exited 0. A launch now holds
``--run-dir`` and its checkpoint folder (``--checkpoint-dir``, or its default
``RUN_DIR/checkpoints``) while it and its tasks run: a second one is
refused with one line and exit code 1, and leaves the first one's files alone."""

from __future__ import annotations

import signal
from pathlib import Path

from helpers import Reaper, chief_address, launch_run, wait_for, zmqps_cmd


def test_a_second_launch_on_a_running_run_dir_is_refused(procs: Reaper, tmp_path: Path) -> None:
    run = tmp_path / "run"
    ckpts = run / "checkpoints"  # the first run's, by default: another launch may name it
    flags = ["--ps", "1", "--workers", "2", "--epochs", "400", "--checkpoint-steps", "50"]
    first, summary = launch_run(procs, run, *flags)
    chief_address(first)  # the cluster is up
    wait_for(
        lambda: (ckpts / "LATEST").exists() or None,
        60,
        what="the first run's first checkpoint",
    )
    for extra in (["--resume"], []):
        second = procs.spawn(
            zmqps_cmd("launch", "--no-progress", "--run-dir", str(run), *flags, *extra),
            name=f"second{len(extra)}",
        )
        second.expect_exit(1, timeout=30)
        assert second.stderr == (
            f"zmqps: error: --run-dir {run} is in use by another zmqps launch (or its"
            " tasks, still exiting): wait for it to end, or choose another folder\n"
        ), second.stderr
    other = tmp_path / "other"
    third = procs.spawn(
        zmqps_cmd(
            "launch",
            "--no-progress",
            "--run-dir",
            str(other),
            "--checkpoint-dir",
            str(ckpts),
            *flags,
            "--resume",
        ),
        name="third",
    )
    third.expect_exit(1, timeout=30)
    assert third.stderr == (
        f"zmqps: error: --checkpoint-dir {ckpts} is in use by another zmqps launch (or its"
        " tasks, still exiting): wait for it to end, or choose another folder\n"
    ), third.stderr
    assert not other.exists()  # a launch refused leaves no folder behind
    assert first.poll() is None, first.tail()  # the first run trains on, untouched
    first.send(signal.SIGTERM)
    first.wait(timeout=30)
    assert not summary.exists()
    # once it has ended (its tasks too), the folder is free: --resume goes on from it
    resumed = procs.spawn(
        zmqps_cmd(
            "launch",
            "--no-progress",
            "--run-dir",
            str(run),
            *flags[:4],
            "--epochs",
            "1",
            "--resume",
        ),
        name="resumed",
    )
    resumed.expect_exit(0, timeout=100)
    assert "zmqps launch: resuming from ckpt-" in resumed.stderr, resumed.stderr
