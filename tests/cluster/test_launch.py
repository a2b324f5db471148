"""``zmqps launch``: a whole local cluster trains, fails as one, and stops on Ctrl-C."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import Proc, Reaper, launched_by, read_json, sigint_ignored, wait_for, zmqps_cmd

from zmqps.data import write_idx

SUMMARY_KEYS = {
    "mode",
    "ps",
    "workers",
    "global_step",
    "test_accuracy",
    "wall_seconds",
    "examples_per_second",
}


def _launch(procs: Reaper, tmp_path: Path, *flags: str, **spawn: Any) -> tuple[Proc, Path]:
    summary = tmp_path / "summary.json"
    argv = zmqps_cmd(
        "launch",
        "--no-progress",
        "--timeout",
        "120",
        "--run-dir",
        str(tmp_path / "run"),
        "--summary",
        str(summary),
        *flags,
    )
    return procs.spawn(argv, name="launch", **spawn), summary


def _expect_no_children(launcher: Proc) -> None:
    left = launched_by(launcher.pid)
    assert not left, f"children of the launcher still running: {left}"


@pytest.mark.timeout(90)
def test_defaults_train_the_mlp(procs: Reaper, tmp_path: Path) -> None:
    launcher, summary_path = _launch(procs, tmp_path)
    launcher.expect_exit(0, timeout=80)
    summary = read_json(summary_path)
    assert set(summary) >= SUMMARY_KEYS, summary
    assert (summary["mode"], summary["ps"], summary["workers"]) == ("async", 2, 2)
    assert summary["global_step"] > 0
    assert summary["test_accuracy"] >= 0.95, summary
    assert "test accuracy" in launcher.stdout
    for task in ("chief", "ps0", "ps1", "worker0", "worker1"):
        assert (tmp_path / "run" / f"{task}.log").stat().st_size > 0
    _expect_no_children(launcher)


@pytest.mark.timeout(90)
def test_softmax_one_ps_three_workers(procs: Reaper, tmp_path: Path) -> None:
    """A TF_CONFIG of another cluster in the environment is ignored, and said so."""
    flags = ("--model", "softmax", "--ps", "1", "--workers", "3", "--epochs", "3")
    other = {"cluster": {"chief": ["10.9.9.9:2222"]}, "task": {"type": "chief", "index": 0}}
    launcher, summary_path = _launch(procs, tmp_path, *flags, env={"TF_CONFIG": json.dumps(other)})
    launcher.expect_exit(0, timeout=80)
    summary = read_json(summary_path)
    assert (summary["model"], summary["ps"], summary["workers"]) == ("softmax", 1, 3)
    assert summary["test_accuracy"] > 0.8, summary
    assert "zmqps launch: TF_CONFIG in the environment ignored" in launcher.stderr
    _expect_no_children(launcher)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["not-idx", "labels", "negative-labels", "not-gzip"])
def test_a_corrupt_data_set_is_refused_before_the_cluster_starts(
    procs: Reaper, tmp_path: Path, bad: str
) -> None:
    """The files are there but not MNIST's: the tasks found it after the cluster
    started (exit 1 after a start, a temporary folder left behind). The launcher reads
    them first: one line naming the file, exit 2, nothing started."""
    from zmqps.data.mnist import write_idx

    corrupt = tmp_path / "corrupt-mnist"
    corrupt.mkdir()
    for split, n in (("train", 20), ("t10k", 10)):
        write_idx(corrupt / f"{split}-images-idx3-ubyte", np.zeros((n, 28, 28), np.uint8))
        labels = np.full(n, 12 if bad == "labels" else 3, np.uint8)
        if bad == "negative-labels":
            labels = np.full(n, -1, np.int8)
        write_idx(corrupt / f"{split}-labels-idx1-ubyte", labels)
    if bad == "not-idx":
        (corrupt / "train-images-idx3-ubyte").write_bytes(b"not an IDX file")
        expected = "not an IDX file"
    elif bad == "labels":
        expected = "label 12 is not a digit 0-9"
    elif bad == "negative-labels":
        expected = "label -1 is not a digit 0-9"
    else:
        (corrupt / "train-images-idx3-ubyte").rename(corrupt / "train-images-idx3-ubyte.gz")
        (corrupt / "train-images-idx3-ubyte.gz").write_bytes(b"plain text, not gzip")
        expected = "not gzip data"
    launcher, summary_path = _launch(
        procs, tmp_path, "--dataset", "mnist", "--data-dir", str(corrupt)
    )
    launcher.expect_exit(2, timeout=50)
    lines = [line for line in launcher.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "--data-dir:" in lines[0] and expected in lines[0], launcher.stderr
    assert "zmqps launch: chief" not in launcher.stderr  # nothing was started
    assert not summary_path.exists()
    _expect_no_children(launcher)


@pytest.mark.timeout(60)
def test_sigint_stops_everything_with_130(procs: Reaper, tmp_path: Path) -> None:
    # started as a script's background job would be (SIGINT ignored): it still stops
    launcher, _ = _launch(
        procs, tmp_path, "-v", "--epochs", "1000", "--log-every", "5", preexec_fn=sigint_ignored
    )
    # Mid-training: a worker has logged a step (relayed by the launcher).
    wait_for(
        lambda: re.search(r"\[worker\d\] .*worker \d: step \d+", launcher.stderr),
        timeout=40,
        what="a training step in the launcher's output",
    )
    children = launched_by(launcher.pid)
    assert len(children) == 5, children
    launcher.send(signal.SIGINT)
    launcher.expect_exit(130, timeout=30)
    assert "zmqps launch: interrupted; stopping the cluster" in launcher.stderr
    _expect_no_children(launcher)


@pytest.mark.timeout(60)
def test_a_stop_while_the_tasks_start_stops_at_once(procs: Reaper, tmp_path: Path) -> None:
    """The tasks were all started before anything heard a signal or the timeout, their
    output unread meanwhile: a launch of thousands of workers went on starting them for
    17 minutes, deaf to Ctrl-C and to --timeout. Both are heard between two starts."""
    argv = zmqps_cmd(
        "launch", "--no-progress", "--workers", "40", "--timeout", "0.05",
        "--run-dir", str(tmp_path / "run"),
    )  # fmt: skip
    launcher = procs.spawn(argv, name="launch")
    launcher.expect_exit(1, timeout=40)
    assert "zmqps launch: timed out after 0.05s; stopping the cluster" in launcher.stderr
    started = len(list((tmp_path / "run").glob("worker*.log")))
    assert started < 40, started  # stopped between two starts
    _expect_no_children(launcher)


def _write_blocks_mnist(folder: Path, n_train: int = 600, n_test: int = 100) -> None:
    """A learnable MNIST stand-in: digit ``k`` lights a 7x7 block at a place of its own."""
    rng = np.random.default_rng(0)
    folder.mkdir()
    for split, n, suffix in (("train", n_train, ".gz"), ("t10k", n_test, "")):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        images = rng.integers(0, 60, size=(n, 28, 28)).astype(np.uint8)
        for i, k in enumerate(labels):
            r, c = 7 * (k // 4), 7 * (k % 4)
            images[i, r : r + 7, c : c + 7] = rng.integers(180, 256, size=(7, 7))
        write_idx(folder / f"{split}-images-idx3-ubyte{suffix}", images)
        write_idx(folder / f"{split}-labels-idx1-ubyte{suffix}", labels)


@pytest.mark.timeout(90)
def test_mnist_from_idx_files(procs: Reaper, tmp_path: Path) -> None:
    data = tmp_path / "mnist"
    _write_blocks_mnist(data)
    flags = ("--dataset", "mnist", "--data-dir", str(data), "--epochs", "5")
    launcher, summary_path = _launch(procs, tmp_path, *flags)
    launcher.expect_exit(0, timeout=80)
    summary = read_json(summary_path)
    assert summary["dataset"] == "mnist"
    assert summary["examples"] == 5 * 600
    assert summary["test_accuracy"] >= 0.95, summary
    _expect_no_children(launcher)


@pytest.mark.timeout(120)
def test_secure_cluster_trains_on_curve(procs: Reaper, tmp_path: Path) -> None:
    """Every task on CURVE, two copies of each PS state: the PS reach each other with
    their own client pair (without one no copy was ever made, and the chief exited)."""
    launcher, summary_path = _launch(
        procs,
        tmp_path,
        *("--secure", "--evaluator", "--ps", "2", "--replication", "2", "--epochs", "30"),
    )
    run = tmp_path / "run"
    # ``zmqps status --run-dir``: the chief's address and the launch's keys from the
    # folder (on CURVE, a status without them would hear nothing)
    status = zmqps_cmd("status", "--run-dir", str(run), "--json", "--timeout", "2")

    def answered() -> dict[str, Any] | None:
        if not (run / "tasks" / "chief.json").exists():
            return None
        p = subprocess.run(status, capture_output=True, text=True, timeout=30)
        return json.loads(p.stdout) if p.returncode == 0 else None

    seen = wait_for(answered, timeout=60, what="zmqps status --run-dir to answer")
    assert seen["role"] == "chief" and seen["ps"], seen
    launcher.expect_exit(0, timeout=110)
    summary = read_json(summary_path)
    assert summary["test_accuracy"] >= 0.95, summary
    ended = subprocess.run(status, capture_output=True, text=True, timeout=30)
    assert ended.returncode == 1, ended
    assert ended.stderr == (
        f"zmqps status: the run in {run} has ended (its summary: {run}/chief-summary.json)\n"
    )
    assert summary["restarts"] == [], summary["restarts"]
    assert summary["replication"]["copies_failed"] == 0, summary["replication"]
    for ps, other in ((0, 1), (1, 0)):
        text = (tmp_path / "run" / f"ps{ps}.log").read_text()
        assert f"holding a backup of ps {other}'s state" in text, ps
    keys = run / "keys"
    assert (keys / "server.key_secret").stat().st_mode & 0o777 == 0o600
    for task in ("chief", "ps0", "ps1"):
        assert "CURVE on tcp://127.0.0.1:" in (run / f"{task}.log").read_text(), task
    for task in ("chief", "ps0", "ps1", "worker0", "worker1", "evaluator"):
        text = (run / f"{task}.log").read_text()
        assert "refused a" not in text and "handshake failed" not in text, task
    _expect_no_children(launcher)
