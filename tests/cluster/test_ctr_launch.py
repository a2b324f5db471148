"""``zmqps launch --model ctr``: hash-keyed tables train a wide-and-deep model to within
0.01 AUC of the synthetic task's true model, in sync and in async mode."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import Reaper, launch_run, launched_by, read_json


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_ctr_reaches_the_ground_truth_auc(procs: Reaper, tmp_path: Path, mode: str) -> None:
    flags = ("--model", "ctr", "--mode", mode, "--ps", "2", "--workers", "2")
    flags += ("--epochs", "2", "--batch-size", "256", "--checkpoint-steps", "150")
    launcher, summary_path = launch_run(procs, tmp_path / "run", *flags, timeout=220)
    launcher.expect_exit(0, timeout=230)
    summary = read_json(summary_path)
    assert (summary["model"], summary["mode"], summary["dataset"]) == ("ctr", mode, "synthetic-ctr")
    assert {"test_auc", "test_logloss", "ground_truth_auc"} <= set(summary), summary
    assert 0.8 < summary["ground_truth_auc"] < 0.95, summary
    assert summary["test_auc"] >= summary["ground_truth_auc"] - 0.01, summary
    assert summary["test_logloss"] < summary["ground_truth_logloss"] + 0.02, summary
    assert summary["examples"] == 2 * 100_000
    assert "test AUC" in launcher.stdout
    # every checkpoint of the tables committed (none failed)
    assert "checkpoint of step" not in launcher.stderr or "failed" not in launcher.stderr
    assert not launched_by(launcher.pid)
