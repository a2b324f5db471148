"""``zmqps launch`` with its checkpoints on a full disk (a real one: a small tmpfs).

The run's final checkpoint failed (no space left on device), the chief logged it, and
the launch still said ``done`` and exited 0 with no checkpoint committed: a
``--resume`` then found nothing to go on from. A final checkpoint that cannot be
written now fails the run: the chief exits 3 naming the disk error, and so does the
launch, within its bound."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import Reaper, launch_run, tmpfs, wait_for


def test_a_final_checkpoint_on_a_full_disk_fails_the_launch(procs: Reaper, tmp_path: Path) -> None:
    # a checkpoint of 512x512 float32 weights (1 MiB) and the rest does not fit in 1 MiB
    with tmpfs(tmp_path / "disk", "1m") as disk:
        flags = ("--ps", "1", "--workers", "2", "--epochs", "1", "--hidden", "512,512")
        flags += ("--checkpoint-dir", str(disk / "ckpts"), "--checkpoint-steps", "1000")
        launcher, summary = launch_run(procs, tmp_path / "run", *flags, timeout=90)
        launcher.expect_exit(3, timeout=100)  # the chief's: the run failed a check
        err = launcher.stderr
        assert "the final checkpoint could not be written" in err, err
        assert "no space left on device" in err, err
        assert "no checkpoint of this run is committed" in err, err
        assert "zmqps launch: failed: chief exited with code 3" in err, err
        assert "zmqps launch: done" not in err, err
        # the failed run's summary says why (the chief's own, with the launch's end)
        said = json.loads(summary.read_text())
        assert said["exit_code"] == 3 and "no space left on device" in said["failed"], said
        assert not (disk / "ckpts" / "LATEST").exists()


def test_a_logdir_on_a_full_disk_costs_the_summaries_not_the_run(
    procs: Reaper, tmp_path: Path
) -> None:
    """TensorBoard summaries on a disk that fills up: each task says so in one line and
    writes no more of them; the run ends as it would without them (tensorboardX's own
    writer left tracebacks from its flush thread, and a chief that hung closing it was
    killed by the launcher again and again)."""
    with tmpfs(tmp_path / "disk", "64k") as disk:
        (disk / "fill").write_bytes(b"\0" * (52 * 1024))  # a few KiB are left
        run = tmp_path / "run"
        flags = ("--workers", "2", "--epochs", "2", "--evaluator", "--logdir", str(disk))
        launcher, summary = launch_run(procs, run, *flags, timeout=90)
        launcher.expect_exit(0, timeout=100)
        assert summary.exists()
        assert "zmqps launch: done" in launcher.stdout, launcher.stdout
        err = launcher.stderr
        assert "No space left on device; no more summaries" in err, err
        assert "Traceback" not in err, err
        for log in run.glob("*.log"):
            assert "Traceback" not in log.read_text(), log
        # no task restarted or killed as hung (the launcher's own record and lines: a task's
        # log line may say "restarting" of something else, as a late message's drop does)
        assert json.loads(summary.read_text())["restarts"] == [], err
        assert "; restarting it" not in err and ": killing it" not in err, err


def test_a_run_dir_that_fills_during_the_run_fails_it_in_order_and_resumes(
    procs: Reaper, tmp_path: Path
) -> None:
    """The disk under ``--run-dir`` (logs, checkpoints, summaries, export) filled after
    the first checkpoint: the chief, unable to write its summary, exited 1 and was
    started again twice for it; the launcher died of its own log writes with a
    traceback, its PS serving on for 40 s (a ``--resume`` was refused meanwhile: the
    folder in use). Now the run fails in order (the chief's exit code 3, one line),
    nothing is left running, and once there is room ``--resume`` trains it to the
    end."""
    with tmpfs(tmp_path / "disk", "3m") as disk:
        run = disk / "run"
        flags = ("--ps", "2", "--workers", "2", "--epochs", "40", "--checkpoint-steps", "100")
        launcher, summary = launch_run(procs, run, *flags, timeout=120)
        wait_for(lambda: any((run / "checkpoints").glob("ckpt-*")), 60, what="a checkpoint")
        filler = disk / "filler"
        with filler.open("wb") as f:  # every byte left
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        launcher.expect_exit(3, timeout=100)
        err = launcher.stderr
        assert "Traceback" not in err and "never retrieved" not in err, err
        assert "zmqps launch: failed: chief exited with code 3" in err, err
        assert "; restarting it" not in err, err
        assert "no space left on device" in err.lower(), err
        filler.unlink()
        again, summary = launch_run(procs, run, *flags, "--resume", timeout=120)
        again.expect_exit(0, timeout=130)
        said = json.loads(summary.read_text())
        assert (said["global_step"], said["worker_steps"]) == (1840, 1840), said
