"""kill -9 of a PS and of the chief under ``zmqps launch`` (RELIABILITY.md scenarios 6, 7).

A PS that dies is restarted by the launcher; the chief sees its new boot id, restores
every shard on every PS to the latest committed checkpoint (all at one step, a new
generation) and training resumes. A chief that dies is restarted and adopts the
running PS (global step, placement); no step is applied twice.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    Reaper,
    chief_address,
    chief_status,
    launch_run,
    launched_by,
    read_json,
    task_pid,
    wait_for,
)

from zmqps.checkpoint import CheckpointRoot

CKPT_STEPS = 40
EPOCHS = "40"
SYNC = ("--mode", "sync", "--epochs", EPOCHS, "--checkpoint-steps", str(CKPT_STEPS))


def _wait_for_checkpoint(chief: str, step: int) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        s = chief_status(chief, timeout=1.0)
        ck = (s or {}).get("checkpoints") or {}
        return s if (ck.get("last_step") or 0) >= step else None

    return wait_for(ready, 60, what=f"a checkpoint at step >= {step}", interval=0.1)


def _final_manifest_consistent(run: Path, global_step: int) -> None:
    """The final checkpoint: every shard at the summary's global step (each step applied
    once on every shard: a doubly applied step would put a shard ahead)."""
    ckpt = CheckpointRoot(run / "checkpoints").latest()
    assert ckpt is not None
    versions = {rec.version for rec in ckpt.manifest.shards}
    assert versions == {global_step} == {ckpt.step}, (versions, global_step, ckpt.step)


@pytest.fixture(scope="module")
def unfaulted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same sync job without faults: the accuracy to match."""
    base = tmp_path_factory.mktemp("unfaulted")
    procs = Reaper(base / "logs")
    try:
        launcher, summary_path = launch_run(procs, base / "run", "-q", *SYNC, timeout=150)
        launcher.expect_exit(0, timeout=140)
        summary = read_json(summary_path)
        assert summary is not None
        return dict(summary)
    finally:
        procs.reap()


@pytest.mark.timeout(300)
def test_kill9_ps_in_sync_mode_restores_every_shard(
    procs: Reaper, tmp_path: Path, unfaulted: dict[str, Any]
) -> None:
    run = tmp_path / "ps-kill"
    launcher, summary_path = launch_run(procs, run, "-q", *SYNC, timeout=150)
    chief = chief_address(launcher)
    before = _wait_for_checkpoint(chief, 2 * CKPT_STEPS)
    pid = task_pid(launcher, "ps1")
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()

    def recovered() -> dict[str, Any] | None:
        s = chief_status(chief, timeout=1.0)
        recs = (s or {}).get("recoveries") or []
        return recs[-1] if recs else None

    rec = wait_for(recovered, 90, what="the chief to restore every shard", interval=0.1)
    launcher.expect_exit(0, timeout=200)
    summary = read_json(summary_path)
    assert summary is not None

    # detected, restarted, restored: one restore into generation 1, every shard at the
    # step of a committed checkpoint, lost steps bounded by the checkpoint interval
    # (plus the steps made while the last checkpoint was being written)
    assert [r["task"] for r in summary["restarts"]] == ["ps1"], summary["restarts"]
    assert rec["gen"] == 1 and rec["ps"] == [1], rec
    assert rec["step"] >= before["checkpoints"]["last_step"], (rec, before["checkpoints"])
    assert rec["step"] % CKPT_STEPS == 0, rec
    assert 0 <= rec["lost_steps"] <= 2 * CKPT_STEPS, rec
    kill_to_resume = rec["at"] - killed_at
    assert 0 < kill_to_resume < 30, rec
    print(
        f"\nps kill: restored step {rec['step']}, lost {rec['lost_steps']} steps,"
        f" kill -> resumed {kill_to_resume:.2f}s (detect -> resumed"
        f" {rec['detect_to_resume_s']:.2f}s, restore {rec['restore_s']:.2f}s)"
    )
    # the same accuracy as without the fault (within 0.5 %)
    assert abs(summary["test_accuracy"] - unfaulted["test_accuracy"]) <= 0.005, (
        summary["test_accuracy"],
        unfaulted["test_accuracy"],
    )
    # nothing acknowledged lost: the workers went back to the batches the checkpoint
    # holds and trained the later ones again (every lost step's batches at least), so
    # the run took exactly the unfaulted run's steps
    assert summary["global_step"] == unfaulted["global_step"], (summary, unfaulted)
    assert summary["worker_steps"] == unfaulted["worker_steps"], (summary, unfaulted)
    assert rec["rewound_batches"] >= 2 * rec["lost_steps"], rec
    _final_manifest_consistent(run, summary["global_step"])
    assert not launched_by(launcher.pid)


@pytest.mark.timeout(300)
def test_kill9_chief_resumes_without_going_back(
    procs: Reaper, tmp_path: Path, unfaulted: dict[str, Any]
) -> None:
    run = tmp_path / "chief-kill"
    launcher, summary_path = launch_run(procs, run, "-q", *SYNC, timeout=150)
    chief = chief_address(launcher)
    seen: list[int] = []
    s = _wait_for_checkpoint(chief, CKPT_STEPS)
    seen.append(int(s["global_step"]))
    ckpt_step = int(s["checkpoints"]["last_step"])
    pid = task_pid(launcher, "chief")
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()

    def back() -> dict[str, Any] | None:
        st = chief_status(chief, timeout=1.0)
        # until it learned the step from the PS, a restarted chief says 0 (step_known)
        return st if st is not None and st["step_known"] and st.get("workers_alive") else None

    st = wait_for(back, 60, what="a new chief with workers", interval=0.1)
    back_s = time.time() - killed_at
    seen.append(int(st["global_step"]))
    for _ in range(20):
        st2 = chief_status(chief, timeout=1.0)
        if st2 is None:
            break
        seen.append(int(st2["global_step"]))
        time.sleep(0.05)
    launcher.expect_exit(0, timeout=200)
    summary = read_json(summary_path)
    assert summary is not None
    assert [r["task"] for r in summary["restarts"]] == ["chief"], summary["restarts"]
    # the new chief adopted the running PS: the global step never went back (not even to
    # the checkpoint), and nothing was restored
    assert seen == sorted(seen), seen
    assert seen[1] >= ckpt_step, (seen, ckpt_step)
    assert "restored every shard" not in (run / "chief.log").read_text()
    print(f"\nchief kill: back with workers {back_s:.2f}s after the kill; steps seen {seen}")
    _final_manifest_consistent(run, summary["global_step"])
    # a worker may spend a step on a gradient the PS already had from it (dropped)
    assert unfaulted["global_step"] - 2 <= summary["global_step"] <= unfaulted["global_step"]
    assert abs(summary["test_accuracy"] - unfaulted["test_accuracy"]) <= 0.005
    assert not launched_by(launcher.pid)


@pytest.mark.timeout(300)
def test_a_worker_silent_through_a_chief_restart_holds_no_step(
    procs: Reaper, tmp_path: Path
) -> None:
    """Fault schedule 9 of run 11: a worker stopped (SIGSTOP) while the chief was
    restarted never registered with the new one, which never counted it dead: the sync
    step waited on it for 34 s, until it came back. The new chief knows it from the PS
    (it pushed): dead after the heartbeat timeout, and the others go on without it."""
    run = tmp_path / "silent-worker"
    flags = ("--workers", "3", "--heartbeat-timeout", "2")
    launcher, summary_path = launch_run(procs, run, "-q", *SYNC, *flags, timeout=150)
    chief = chief_address(launcher)
    _wait_for_checkpoint(chief, CKPT_STEPS)
    worker = task_pid(launcher, "worker1")
    os.kill(worker, signal.SIGSTOP)
    try:
        os.kill(task_pid(launcher, "chief"), signal.SIGKILL)
        killed_at = time.time()
        first: list[int] = []

        def going_on() -> dict[str, Any] | None:
            s = chief_status(chief, timeout=1.0)
            if s is None or not s["step_known"]:  # a restarted chief says 0 until it knows
                return None
            if not first:
                first.append(int(s["global_step"]))
            return s if int(s["global_step"]) >= first[0] + 5 else None

        st = wait_for(going_on, 30, what="sync steps without the stopped worker", interval=0.1)
        moving_s = time.time() - killed_at
        assert 1 in st["workers_dead"], st
    finally:
        os.kill(worker, signal.SIGCONT)
    launcher.expect_exit(0, timeout=200)
    summary = read_json(summary_path)
    assert summary is not None
    assert [r["task"] for r in summary["restarts"]] == ["chief"], summary["restarts"]
    log = (run / "chief.log").read_text()
    assert "training before this chief started" in log
    print(f"\nsilent worker: steps went on {moving_s:.2f}s after the chief's kill")
    _final_manifest_consistent(run, summary["global_step"])
    assert not launched_by(launcher.pid)


@pytest.mark.timeout(300)
def test_a_worker_that_finished_trains_again_after_a_restore(procs: Reaper, tmp_path: Path) -> None:
    """Async; worker 1 is stopped, worker 0 finishes its data and waits for the run's end;
    a PS is killed before any checkpoint: the restore goes back to the initial values,
    and worker 0 trains its whole share again (it would have been lost with it)."""
    run = tmp_path / "finished-worker"
    epochs = 40
    flags = ("-q", "--epochs", str(epochs), "--checkpoint-secs", "600")
    launcher, summary_path = launch_run(procs, run, *flags, timeout=200)
    chief = chief_address(launcher)

    def both_training() -> bool:
        s = chief_status(chief, timeout=1.0) or {}
        return sum(1 for w in s.get("workers") or [] if int(w.get("step") or 0) > 0) == 2

    wait_for(both_training, 60, what="both workers training", interval=0.05)
    stopped = task_pid(launcher, "worker1")
    os.kill(stopped, signal.SIGSTOP)
    try:

        def worker0_done() -> bool:
            s = chief_status(chief, timeout=1.0) or {}
            return any(w["index"] == 0 and w["state"] == "done" for w in s.get("workers") or [])

        wait_for(worker0_done, 90, what="worker 0 done", interval=0.1)
        os.kill(task_pid(launcher, "ps0"), signal.SIGKILL)

        def recovered() -> dict[str, Any] | None:
            s = chief_status(chief, timeout=1.0)
            recs = (s or {}).get("recoveries") or []
            return recs[-1] if recs else None

        rec = wait_for(recovered, 90, what="the restore", interval=0.1)
    finally:
        os.kill(stopped, signal.SIGCONT)
    launcher.expect_exit(0, timeout=200)
    summary = read_json(summary_path)
    share = epochs * 23  # batches of each worker: its 719 or 718 digits, every epoch
    assert rec["step"] == 0 and rec["rewound_batches"] >= share, rec
    stats = read_json(run / "worker0-stats.json")
    assert stats["steps_done"] + stats["steps"] - stats["rewound"] == share, stats
    assert stats["rewound"] == share, stats  # every batch of it trained again
    # its log tells the truth: the steps that hold, and how many were trained again
    assert stats["retrained"] == share, stats
    log = (run / "worker0.log").read_text()
    done = re.search(r"worker 0: done after (\d+) steps \(.*\); (\d+) batches trained again", log)
    assert done and done.groups() == (str(share), str(share)), log[-1500:]
    # the final checkpoint holds every batch of each worker, once
    ckpt = CheckpointRoot(run / "checkpoints").latest()
    assert ckpt is not None and ckpt.cursors == {"worker:0": share, "worker:1": share}
    assert summary["worker_steps"] == 2 * share, summary
    assert not launched_by(launcher.pid)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_chief_told_to_stop_under_launch_ends_the_run_resumable(
    procs: Reaper, tmp_path: Path, sig: signal.Signals
) -> None:
    """A chief stopped by a signal to it alone takes a checkpoint and shuts the PS
    down: the launcher started it again, and the new chief waited 120 s for PS that
    were gone, then again (minutes, nothing on the console). The run ends with the
    chief's code, saying how to go on, nothing left running; ``--resume`` goes on."""
    run = tmp_path / "chief-stop"
    launcher, _ = launch_run(procs, run, "-q", *SYNC, timeout=150)
    chief = chief_address(launcher)
    _wait_for_checkpoint(chief, CKPT_STEPS)
    os.kill(task_pid(launcher, "chief"), sig)
    stopped = time.monotonic()
    launcher.expect_exit(128 + sig, timeout=60)
    assert time.monotonic() - stopped < 30
    assert "go on with --resume" in launcher.stderr, launcher.stderr[-2000:]
    assert "restarting it" not in launcher.stderr, launcher.stderr[-2000:]
    assert not launched_by(launcher.pid)
    ckpt = CheckpointRoot(run / "checkpoints").latest()
    assert ckpt is not None and ckpt.step >= CKPT_STEPS
