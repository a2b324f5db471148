"""Regression tests of recovery defects found by independent fault runs, with real processes.

1. Sync: a worker stopped (SIGSTOP) past the heartbeat timeout, counted dead while the
   other finished its data, comes back (SIGCONT): it must be re-admitted and get
   tokens whatever M fell to, and the run must end.
2. ``kill -9`` of the chief in sync mode: the workers' token requests to the dead
   chief are resent to the restarted one at once, not after their deadline.
3. A sync worker killed with ``kill -9`` and restarted resumes after the batches it
   really pushed: no batch is trained twice and the run ends at its planned step.
4. The side-car evaluator (snapshots from the PS) scores the final model: the chief
   keeps the PS up until its last evaluation.
5. A lone evaluator (a TF_CONFIG whose cluster holds only the evaluator, TF2's
   side-car evaluation job) evaluates a finished run's checkpoints and exits 0.
6. A chief started again after the end of its run (a supervisor restarting a chief
   killed while it shut the cluster down) finds the PS gone and ends, exit 0, after
   its short grace for the cluster's tasks (``ended_grace``: they are told the run
   ended), instead of waiting the whole start-up timeout for the PS.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    Proc,
    Reaper,
    addresses,
    chief_address,
    chief_status,
    launch_run,
    launched_by,
    read_json,
    script,
    task_pid,
    wait_for,
    zmqps_cmd,
)

# digits, batch 32: 23 steps per epoch for each of 2 workers
STEPS_PER_EPOCH = 23


def _sync_run_under_way(
    procs: Reaper, tmp_path: Path, epochs: int, *flags: str
) -> tuple[Proc, Path, str, int]:
    """A sync launch of 2 workers (heartbeat timeout 2 s, no checkpoints, ``flags``)
    once half its global steps are done: ``(launcher, summary path, chief, steps
    planned per worker)``."""
    launcher, summary_path = launch_run(
        procs,
        tmp_path / "run",
        "--mode",
        "sync",
        "--epochs",
        str(epochs),
        "--heartbeat-timeout",
        "2",
        "--no-checkpoints",
        *flags,
        timeout=120,
    )
    chief = chief_address(launcher)
    planned = epochs * STEPS_PER_EPOCH
    wait_for(
        lambda: (s := chief_status(chief)) and s["global_step"] >= planned // 2,
        60,
        what="training to be under way",
    )
    return launcher, summary_path, chief, planned


def _worker(status: dict[str, Any], index: int) -> dict[str, Any] | None:
    return next((w for w in status["workers"] if w["index"] == index), None)


@pytest.mark.timeout(150)
def test_a_sync_worker_counted_dead_while_the_other_finished_is_readmitted(
    procs: Reaper, tmp_path: Path
) -> None:
    launcher, summary_path, chief, planned = _sync_run_under_way(procs, tmp_path, epochs=20)
    victim = task_pid(launcher, "worker1")
    os.kill(victim, signal.SIGSTOP)
    try:
        # worker 1 is counted dead, N shrinks, worker 0 runs out of data and leaves
        wait_for(
            lambda: (
                (s := chief_status(chief))
                and (w := _worker(s, 0)) is not None
                and w["state"] == "done"
            ),
            60,
            what="worker 0 to finish its data while worker 1 is stopped",
        )
    finally:
        os.kill(victim, signal.SIGCONT)
    # worker 1 comes back: re-admitted, it gets tokens again and finishes its data
    launcher.expect_exit(0, timeout=60)
    summary = read_json(summary_path)
    assert summary["worker_steps"] == 2 * planned, summary
    assert summary["test_accuracy"] >= 0.9, summary


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("task", "said"),
    [
        ("worker1", "worker1 runs, yet the chief has counted it dead"),
        ("chief", "chief has answered no status for"),
    ],
)
def test_a_task_stopped_for_ever_is_killed_and_restarted_and_the_run_ends(
    procs: Reaper, tmp_path: Path, task: str, said: str
) -> None:
    """A task stopped (SIGSTOP) and never resumed: a worker the chief counts dead, or a
    chief that answers nothing. The launcher kills it after a bound (``--hung-after``
    8 s here; 15 s by default) and the restart policy starts it again (a worker resumes
    after the batches it pushed, a chief adopts the PS state); the run ends, exit 0,
    every planned batch trained once."""
    launcher, summary_path, _, planned = _sync_run_under_way(
        procs, tmp_path, 12, "--hung-after", "8"
    )
    os.kill(task_pid(launcher, task), signal.SIGSTOP)  # never resumed
    launcher.expect_exit(0, timeout=90)
    assert said in launcher.stderr
    summary = read_json(summary_path)
    assert summary["worker_steps"] == 2 * planned, summary
    assert [r["task"] for r in summary["restarts"]] == [task], summary["restarts"]


@pytest.mark.timeout(150)
def test_sync_resumes_at_once_after_a_chief_restart(procs: Reaper, tmp_path: Path) -> None:
    """After ``kill -9`` of the chief the workers' pending token requests reach the
    restarted chief as soon as it listens: training pauses for about a chief restart
    (1-2 s here), not the 20 s deadline of a token request lost with the old chief."""
    epochs = 30  # 690 steps: the chief is killed at step 100
    launcher, summary_path = launch_run(
        procs, tmp_path / "run", "--mode", "sync", "--epochs", str(epochs), timeout=120
    )
    chief = chief_address(launcher)
    wait_for(lambda: (s := chief_status(chief)) and s["global_step"] >= 100, 60, what="training")
    os.kill(task_pid(launcher, "chief"), signal.SIGKILL)
    killed = time.monotonic()
    before = None

    def moving() -> int | None:
        nonlocal before
        s = chief_status(chief, timeout=0.5)
        if s is None or not s.get("step_known", True):
            return None  # no answer, or the restarted chief not started yet
        if before is None:
            before = s["global_step"]
            return None
        return s["global_step"] if s["global_step"] > before else None

    wait_for(moving, 60, what="the global step to move again", interval=0.05)
    pause = time.monotonic() - killed
    # a restart of the chief costs ~1-2 s on an idle 2-core machine; a lost token request
    # waited out its deadline (poll 10 s + 10 s) before: 10 s separates the two
    assert pause < 10.0, f"sync training paused {pause:.1f}s after the chief's restart"
    launcher.expect_exit(0, timeout=100)
    summary = read_json(summary_path)
    assert summary["global_step"] == epochs * STEPS_PER_EPOCH, summary


@pytest.mark.timeout(150)
def test_a_restarted_sync_worker_resumes_after_the_batches_it_pushed(
    procs: Reaper, tmp_path: Path
) -> None:
    epochs = 40
    run = tmp_path / "run"
    launcher, summary_path = launch_run(
        procs, run, "--mode", "sync", "--epochs", str(epochs), "--no-checkpoints", timeout=120
    )
    chief = chief_address(launcher)
    wait_for(lambda: (s := chief_status(chief)) and s["global_step"] >= 300, 60, what="training")
    os.kill(task_pid(launcher, "worker1"), signal.SIGKILL)
    launcher.expect_exit(0, timeout=100)
    summary = read_json(summary_path)
    planned = epochs * STEPS_PER_EPOCH
    assert [r["task"] for r in summary["restarts"]] == ["worker1"], summary["restarts"]
    # every batch of each worker trained once, in step: exactly the planned global steps
    # (a batch done twice made extra steps, the last ones with N = 1)
    assert summary["global_step"] == planned, summary
    assert summary["worker_steps"] == 2 * planned, summary
    log = (run / "worker1.log").read_text()
    assert "resuming after the" in log, log[-2000:]


@pytest.mark.timeout(150)
def test_the_snapshot_evaluator_scores_the_final_model(procs: Reaper, tmp_path: Path) -> None:
    run = tmp_path / "run"
    launcher, summary_path = launch_run(
        procs, run, "--epochs", "10", "--evaluator", "--no-checkpoints", timeout=120
    )
    launcher.expect_exit(0, timeout=110)
    summary = read_json(summary_path)
    lines = [json.loads(x) for x in (run / "evaluator.jsonl").read_text().splitlines()]
    assert lines, "no evaluation"
    last = lines[-1]
    assert last["source"] == "snapshot"
    assert last["step"] == summary["global_step"], (last, summary["global_step"])
    assert round(last["accuracy"], 4) == summary["test_accuracy"], (last, summary)
    assert not launched_by(launcher.pid)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A run of 5 epochs, a checkpoint every 40 steps, ended well: its folder and the
    launch's summary. The tests that use it only read it (a chief started again there
    leaves it as it was, which its test checks)."""
    base = tmp_path_factory.mktemp("finished")
    procs = Reaper(base / "logs")
    try:
        launcher, summary_path = launch_run(
            procs, base / "run", "--epochs", "5", "--checkpoint-steps", "40", timeout=100
        )
        launcher.expect_exit(0, timeout=100)
        summary = read_json(summary_path)
        assert summary is not None
        return base / "run", dict(summary)
    finally:
        procs.reap()


@pytest.mark.timeout(150)
def test_a_lone_evaluator_evaluates_a_finished_runs_checkpoints(
    procs: Reaper, tmp_path: Path, finished_run: tuple[Path, dict[str, Any]]
) -> None:
    run, summary = finished_run
    (address,) = addresses(1)
    tf_config = {"cluster": {"evaluator": [address]}, "task": {"type": "evaluator", "index": 0}}
    log_path = tmp_path / "eval.jsonl"
    evaluator = procs.spawn(
        [
            script("zmqps-worker"),
            "--checkpoint-dir",
            str(run / "checkpoints"),
            "--eval-log",
            str(log_path),
            "--eval-idle-timeout",
            "5",
        ],
        name="evaluator",
        env={"TF_CONFIG": json.dumps(tf_config)},
    )
    evaluator.expect_exit(0, timeout=60)
    lines = [json.loads(x) for x in log_path.read_text().splitlines()]
    assert lines and all(x["source"] == "checkpoint" for x in lines), lines
    # the last one is the run's final checkpoint: the model the run ended with
    assert lines[-1]["step"] == summary["global_step"], (lines[-1], summary["global_step"])
    assert round(lines[-1]["accuracy"], 4) == summary["test_accuracy"], (lines[-1], summary)
    assert "final checkpoint" in evaluator.stderr, evaluator.tail()


@pytest.mark.timeout(150)
def test_a_chief_started_after_the_end_of_its_run_ends_at_once(
    procs: Reaper, finished_run: tuple[Path, dict[str, Any]]
) -> None:
    run, _ = finished_run
    summary = read_json(run / "chief-summary.json")
    config = run / "tasks" / "chief.json"
    assert json.loads(config.read_text())["chief"]["startup_timeout"] >= 60  # waited before
    started = time.monotonic()
    chief = procs.spawn(zmqps_cmd("task", "--config", str(config)), name="chief-again")
    chief.expect_exit(0, timeout=60)
    # the PS probe (5 s) and the grace for the workers (2 heartbeat timeouts: 20 s;
    # they exited with the run and do not come), not the start-up timeout (120 s)
    assert time.monotonic() - started < 45, chief.tail()
    assert "the run already finished" in chief.stderr, chief.tail()
    assert "not heard within 20s: worker 0, worker 1" in chief.stderr, chief.tail()
    assert read_json(run / "chief-summary.json") == summary  # the run's own summary stays


@pytest.mark.timeout(150)
def test_a_chief_started_after_the_end_with_its_ps_started_again_ends_them_and_itself(
    procs: Reaper, finished_run: tuple[Path, dict[str, Any]]
) -> None:
    """Fault schedule 814: the chief was killed as it shut the PS down at the end, and
    a supervisor started the PS again (they had exited 0). The new chief restored the
    final checkpoint and waited for workers that had finished, to its stall timeout.
    Now it ends the run at once, the summary left as the run wrote it, and shuts the
    PS down: every process exits 0."""
    run, _ = finished_run
    summary = read_json(run / "chief-summary.json")
    tasks = sorted((run / "tasks").glob("ps*.json"))
    assert tasks
    ps = [procs.spawn(zmqps_cmd("task", "--config", str(t)), name=t.stem) for t in tasks]
    started = time.monotonic()
    chief = procs.spawn(
        zmqps_cmd("task", "--config", str(run / "tasks" / "chief.json")), name="chief-again"
    )
    chief.expect_exit(0, timeout=60)
    assert time.monotonic() - started < 45, chief.tail()
    assert "the PS that answer were started after it ended" in chief.stderr, chief.tail()
    for p in ps:
        p.expect_exit(0, timeout=30)
    assert read_json(run / "chief-summary.json") == summary
