"""Non-finite gradients in a real cluster: refused by the PS, skipped by the worker,
judged at the end of the run (``--max-nonfinite-share``), or stopping it at once.

The worker of ``nan_worker.py`` is the real ``zmqps-worker`` whose model spoils one
gradient element (and the loss) every N-th step.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from helpers import Proc, Reaper, addresses, read_json, script

NAN_WORKER = str(Path(__file__).with_name("nan_worker.py"))
STEPS_PER_EPOCH = 23  # digits, batch 32, 2 workers


def _tf_config(cluster: dict[str, list[str]], task_type: str, index: int) -> dict[str, str]:
    spec = {"cluster": cluster, "task": {"type": task_type, "index": index}}
    return {"TF_CONFIG": json.dumps(spec)}


def _ps_refused(log: str) -> int:
    """Pushes the PS refused as not finite, from the status it logged when it stopped."""
    m = re.search(r"final state: (\{.*\})$", log, re.MULTILINE)
    assert m, log[-2000:]
    return int(json.loads(m.group(1))["dropped"].get("nonfinite", 0))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_nan_every_50_steps_is_refused_skipped_and_reported(
    procs: Reaper, tmp_path: Path, mode: str
) -> None:
    epochs, every = 20, 50
    chief, ps0, ps1, w0, w1 = addresses(5)
    cluster = {"chief": [chief], "ps": [ps0, ps1], "worker": [w0, w1]}
    summary = tmp_path / "summary.json"
    job = ["--model", "mlp", "--epochs", str(epochs)]
    server = script("zmqps-server")
    chief_p = procs.spawn(
        [server, *job, "--mode", mode, "--summary", str(summary)],
        name="chief",
        env=_tf_config(cluster, "chief", 0),
    )
    ps = [procs.spawn([server], name=f"ps{i}", env=_tf_config(cluster, "ps", i)) for i in (0, 1)]
    good = procs.spawn(
        [script("zmqps-worker"), *job], name="worker0", env=_tf_config(cluster, "worker", 0)
    )
    bad = procs.spawn(
        [sys.executable, NAN_WORKER, *job],
        name="worker1",
        env={**_tf_config(cluster, "worker", 1), "ZMQPS_TEST_NAN_EVERY": str(every)},
    )
    for p in (chief_p, *ps, good, bad):
        p.expect_exit(0, timeout=120)
    result = read_json(summary)
    steps = epochs * STEPS_PER_EPOCH
    spoiled = steps // every
    assert result["nonfinite_steps"] == spoiled, result
    assert "failed" not in result
    assert result["test_accuracy"] >= 0.95, result  # nothing non-finite was applied
    assert result["worker_steps"] == 2 * steps
    if mode == "sync":  # each refused gradient counted toward its step: none waited
        assert result["global_step"] == steps, result
    # one PS holds the spoiled variable: it refused every spoiled push, the other none
    assert sorted(_ps_refused(p.stderr) for p in ps) == [0, spoiled]
    # the worker says so, the step and its loss, without a line per step
    lines = [x for x in bad.stderr.splitlines() if "refused by the PS" in x]
    assert lines and "step 50, loss nan" in lines[0], bad.tail()
    assert len(lines) <= 3, lines
    assert f"{spoiled} skipped: gradients not finite" in bad.stderr, bad.tail()
    assert "had non-finite gradients" in chief_p.stderr, chief_p.tail()


@pytest.mark.timeout(120)
def test_too_many_nonfinite_steps_fail_the_run(procs: Reaper, tmp_path: Path) -> None:
    # one step in 10 (10 %) is above the default share (5 %): the run ends, in order,
    # and fails: exit code 3, and the summary says why
    chief, ps0, w0 = addresses(3)
    cluster = {"chief": [chief], "ps": [ps0], "worker": [w0]}
    summary = tmp_path / "summary.json"
    job = ["--model", "mlp", "--epochs", "2"]
    server = script("zmqps-server")
    ckpts = ["--checkpoint-dir", str(tmp_path / "checkpoints")]
    chief_argv = [server, *job, *ckpts, "--summary", str(summary)]
    chief_p = procs.spawn(chief_argv, name="chief", env=_tf_config(cluster, "chief", 0))
    ps = procs.spawn([server, *ckpts], name="ps0", env=_tf_config(cluster, "ps", 0))
    worker = procs.spawn(
        [sys.executable, NAN_WORKER, *job],
        name="worker0",
        env={**_tf_config(cluster, "worker", 0), "ZMQPS_TEST_NAN_EVERY": "10"},
    )
    worker.expect_exit(0, timeout=90)
    ps.expect_exit(0, timeout=30)
    chief_p.expect_exit(3, timeout=30)
    result = read_json(summary)
    assert result["nonfinite_steps"] == 9  # 2 epochs of 45 steps, one worker
    assert "more than --max-nonfinite-share 0.05" in result["failed"], result
    assert "zmqps: error: 9 of 90 steps (10.0%) had non-finite gradients" in chief_p.stderr
    # A chief started again after the end (compose's restart: on-failure restarts
    # whatever exits non-zero) finds the run over, failed: it exits 3 too. It used to
    # exit 0, as if the run had ended well.
    again = procs.spawn(chief_argv, name="chief-again", env=_tf_config(cluster, "chief", 0))
    again.expect_exit(3, timeout=60)
    assert "the run already finished" in again.stderr, again.tail()
    assert "more than --max-nonfinite-share 0.05" in again.stderr, again.tail()
    assert read_json(summary) == result  # the run's own summary stays


@pytest.mark.timeout(120)
def test_no_share_allowed_stops_the_run_at_the_first_one(procs: Reaper) -> None:
    chief_p, ps, worker, _ = _share_zero(procs, 1, "--on-nonfinite", "stop")
    worker.expect_exit(3, timeout=60)
    first = worker.stderr.strip().splitlines()[-1]
    assert first.startswith("zmqps: error: worker:0: step 30: the loss is nan; stopping"), first
    chief_p.expect_exit(3, timeout=30)
    ps.expect_exit(0, timeout=30)
    assert "worker 0 met a non-finite loss or gradient after 29 steps" in chief_p.stderr


@pytest.mark.timeout(120)
def test_no_share_allowed_stops_the_workers_that_skip(procs: Reaper) -> None:
    """A worker that skips non-finite steps (the default) is told to stop when the
    first one stops the run: it used to go on asking a chief that was gone."""
    chief_p, ps, spoiler, cluster = _share_zero(procs, 2)
    clean = procs.spawn(
        [script("zmqps-worker"), *SHARE_ZERO_JOB],
        name="worker1",
        env=_tf_config(cluster, "worker", 1),
    )
    chief_p.expect_exit(3, timeout=60)
    ps.expect_exit(0, timeout=30)
    for w in (spoiler, clean):
        w.expect_exit(0, timeout=30)
        assert "the chief is stopping the run; left after" in w.stderr, w.tail()


def _share_zero(
    procs: Reaper, workers: int, *spoiler_flags: str
) -> tuple[Proc, Proc, Proc, dict[str, list[str]]]:
    """A chief allowing no non-finite step (--max-nonfinite-share 0), one PS, and worker
    0 spoiling every 30th gradient; ``(chief, ps, worker 0, the cluster)``."""
    chief, ps0, *ws = addresses(2 + workers)
    cluster = {"chief": [chief], "ps": [ps0], "worker": ws}
    server = script("zmqps-server")
    chief_p = procs.spawn(
        [server, *SHARE_ZERO_JOB, "--max-nonfinite-share", "0"],
        name="chief",
        env=_tf_config(cluster, "chief", 0),
    )
    ps = procs.spawn([server], name="ps0", env=_tf_config(cluster, "ps", 0))
    spoiler = procs.spawn(
        [sys.executable, NAN_WORKER, *SHARE_ZERO_JOB, *spoiler_flags],
        name="worker0",
        env={**_tf_config(cluster, "worker", 0), "ZMQPS_TEST_NAN_EVERY": "30"},
    )
    return chief_p, ps, spoiler, cluster


#: long enough that no worker finishes before the 30th step stops the run
SHARE_ZERO_JOB = ["--model", "mlp", "--epochs", "200"]
