"""``zmqps launch --model ctr --evaluator``: the held-out evaluation takes no rows on the
PS, the export carries the tables' live rows and scores the held-out set exactly as the
run reported (in Python and through ``zmqps predict`` on the held-out rows as text), and
the side-car evaluator scores the CTR job's checkpoints by AUC."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import Reaper, launch_run, launched_by, read_json, zmqps_cmd

from zmqps.data.ctr import auc, logloss, write_ctr_text
from zmqps.export import load_model
from zmqps.models.ctr import CTRModel
from zmqps.roles.job import JobConfig

EXAMPLES = 2000  # few training examples: the held-out split names ids training never saw


@pytest.mark.timeout(240)
def test_ctr_export_and_evaluator(procs: Reaper, tmp_path: Path) -> None:
    flags = ("--model", "ctr", "--mode", "sync", "--ps", "2", "--workers", "2")
    flags += ("--epochs", "1", "--batch-size", "256", "--examples", str(EXAMPLES))
    flags += ("--checkpoint-steps", "2", "--evaluator")
    run = tmp_path / "run"
    launcher, summary_path = launch_run(procs, run, *flags, timeout=200)
    launcher.expect_exit(0, timeout=230)
    summary = read_json(summary_path)
    assert (summary["model"], summary["mode"]) == ("ctr", "sync"), summary
    assert not launched_by(launcher.pid)

    job = JobConfig(model="ctr", dataset="synthetic-ctr", examples=EXAMPLES)
    train, test = job.load_ctr("train"), job.load_ctr("test")
    seen = np.unique(train.ids)
    assert np.setdiff1d(np.unique(test.ids), seen).size > 0  # held-out-only ids exist

    # the PS hold rows for the ids training touched, none for held-out-only ids
    for name in (CTRModel.WIDE, CTRModel.EMB):
        assert summary["tables"][name]["rows"] == seen.size, summary["tables"]
        assert summary["tables"][name]["created"] == seen.size, summary["tables"]

    # the export: the same rows, and the run's test_auc / test_logloss to the digit
    assert summary["export_dir"] == str(run / "model")
    model, params, signature = load_model(run / "model")
    assert isinstance(model, CTRModel)
    for t in signature["tables"]:
        assert t["rows"] == seen.size and np.array_equal(params[t["name"]].ids, seen)
    scores = model.predict(params, test.ids, test.dense)
    assert round(auc(test.y, scores), 4) == summary["test_auc"], summary
    assert round(logloss(test.y, scores), 4) == summary["test_logloss"], summary
    assert signature["metrics"]["test_auc"] == summary["test_auc"]

    # zmqps predict on the held-out rows written as text: the same probabilities and AUC
    write_ctr_text(tmp_path / "test.txt", test)
    out = tmp_path / "p.npy"
    argv = ("--model", str(run / "model"), "--input", str(tmp_path / "test.txt"))
    predict = procs.spawn(zmqps_cmd("predict", *argv, "--output", str(out)), name="predict")
    predict.expect_exit(0, timeout=60)
    assert np.array_equal(np.load(out), scores)
    m = re.search(r"auc (\S+), logloss (\S+) \((\d+) examples", predict.stdout)
    assert m is not None, predict.tail()
    assert round(float(m.group(1)), 4) == summary["test_auc"], (m.group(0), summary)
    assert round(float(m.group(2)), 4) == summary["test_logloss"], (m.group(0), summary)
    assert int(m.group(3)) == len(test) == summary["test_examples"]

    # the evaluator scored the checkpoints by AUC under the summary's keys; the last one
    # is the final model, the one the chief evaluated
    lines = [json.loads(x) for x in (run / "evaluator.jsonl").read_text().splitlines()]
    assert lines and all(x["source"] == "checkpoint" for x in lines), lines
    assert all({"test_auc", "test_logloss", "ground_truth_auc"} <= set(x) for x in lines)
    last = lines[-1]
    assert last["step"] == summary["global_step"], (lines, summary["global_step"])
    assert (last["test_auc"], last["test_logloss"]) == (
        summary["test_auc"],
        summary["test_logloss"],
    )
    assert "test AUC" in (run / "evaluator.log").read_text()
