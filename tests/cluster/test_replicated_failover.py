"""kill -9 of a PS under ``zmqps launch --replication 2``: a copy of its state takes
over; nothing is restored, nothing acknowledged is lost, the run ends with exit 0.

The launcher restarts the killed PS (empty); the chief sees it silent or restarted,
fences the surviving copies of its state, promotes one, and publishes the new
placement epoch; the workers send their requests in flight again to the new primary
(a push resent is deduplicated there).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import Reaper, chief_address, chief_status, launch_run, read_json, task_pid, wait_for
from safetensors.numpy import load_file

#: long enough for a kill, a copy made again and a second kill (about 15 s)
EPOCHS = "100"


@pytest.mark.timeout(240)
def test_kill9_ps_with_replication_fails_over_without_a_restore(
    procs: Reaper, tmp_path: Path
) -> None:
    run = tmp_path / "failover"
    flags = ("--ps", "3", "--replication", "2", "--epochs", EPOCHS, "--heartbeat-timeout", "2")
    launcher, summary_path = launch_run(procs, run, "-q", *flags, timeout=150)
    chief = chief_address(launcher)

    def training() -> dict[str, Any] | None:
        s = chief_status(chief, timeout=1.0)
        return s if s and s.get("global_step", 0) >= 300 else None

    before = wait_for(training, 60, what="training under way", interval=0.1)
    os.kill(task_pid(launcher, "ps1"), signal.SIGKILL)
    killed_at = time.time()

    def promoted() -> dict[str, Any] | None:
        s = chief_status(chief, timeout=1.0)
        return s if s and s.get("promotions", 0) >= 1 else None

    after = wait_for(promoted, 60, what="a copy promoted", interval=0.05)
    seen_at = time.time()

    def copied() -> dict[str, Any] | None:
        s = chief_status(chief, timeout=1.0)
        rep = (s or {}).get("replication") or {}
        return s if rep.get("copies_made", 0) >= 1 and not rep.get("under_replicated") else None

    # every state is back to 2 copies (one went to the restarted ps 1): the process
    # now serving ps 1's state may die too, and nothing is restored either
    again = wait_for(copied, 60, what="every state copied again", interval=0.1)
    heir = after["failovers"][-1]["promoted"]["1"]
    os.kill(task_pid(launcher, f"ps{heir}"), signal.SIGKILL)

    def promoted_again() -> dict[str, Any] | None:
        s = chief_status(chief, timeout=1.0)
        return s if s and len(s.get("failovers", ())) >= 2 else None

    second = wait_for(promoted_again, 60, what="a second fail-over", interval=0.05)
    launcher.expect_exit(0, timeout=200)
    summary = read_json(summary_path)
    assert summary is not None
    # the PS shut down at the end are no failure: nothing is failed over or restored
    chief_log = (run / "chief.log").read_text()
    assert "every copy" not in chief_log, chief_log[-3000:]

    failover = after["failovers"][-1]
    assert failover["dead"] == [1] and failover["promoted"].keys() == {"1"}, failover
    assert failover["promoted"]["1"] != 1
    assert after["gen"] == 0 and not after["recoveries"], after  # no restore
    assert after["global_step"] >= before["global_step"]
    assert again["replication"]["copies"]["1"]["backups"], again["replication"]
    assert second["failovers"][-1]["dead"] == [heir], second["failovers"]
    assert second["gen"] == 0 and not second["recoveries"], second  # still no restore
    assert summary["replication"]["restores"] == 0, summary
    assert summary["replication"]["copies_made"] >= 2, summary
    # every worker step was one push applied exactly once on each PS state: the global
    # step (updates applied) is the workers' steps, none lost, none applied twice
    assert summary["global_step"] == summary["worker_steps"], summary
    assert summary["test_accuracy"] >= 0.95, summary
    print(
        f"\nps kill with replication 2: promoted ps {failover['promoted']['1']} in"
        f" {failover['seconds']:.3f}s (kill -> seen promoted {seen_at - killed_at:.2f}s),"
        f" global step {summary['global_step']}"
    )


@pytest.mark.timeout(240)
def test_the_last_copy_of_a_state_lost_falls_back_to_a_restore(
    procs: Reaper, tmp_path: Path
) -> None:
    """With 2 copies, the PS that took over ps 1's state dies too, before a new copy of
    that state was made: it has no copy left. The chief restores every PS from the
    checkpoint, the workers train again the batches after it, and the run ends, exit 0."""
    run = tmp_path / "lost"
    flags = ("--ps", "3", "--replication", "2", "--epochs", "60", "--heartbeat-timeout", "2")
    launcher, summary_path = launch_run(procs, run, "-q", *flags, timeout=150)
    chief = chief_address(launcher)

    def checkpointed() -> dict[str, Any] | None:
        s = chief_status(chief, timeout=1.0)
        return s if s and ((s.get("checkpoints") or {}).get("last_step") or 0) > 0 else None

    wait_for(checkpointed, 60, what="a first checkpoint", interval=0.1)
    os.kill(task_pid(launcher, "ps1"), signal.SIGKILL)

    def promoted() -> dict[str, Any] | None:
        s = chief_status(chief, timeout=1.0)
        return s if s and s.get("promotions", 0) >= 1 else None

    heir = wait_for(promoted, 60, what="a copy promoted", interval=0.05)["failovers"][-1]
    # at once: a new copy of that state takes at least a heartbeat interval to start
    os.kill(task_pid(launcher, f"ps{heir['promoted']['1']}"), signal.SIGKILL)

    def restored() -> dict[str, Any] | None:
        s = chief_status(chief, timeout=1.0)
        return s if s and s.get("recoveries") else None

    rec = wait_for(restored, 60, what="a restore", interval=0.1)["recoveries"][-1]
    launcher.expect_exit(0, timeout=200)
    summary = read_json(summary_path)
    assert summary is not None
    assert rec["gen"] == 1, rec
    assert summary["test_accuracy"] >= 0.95, summary
    # the summary says the restore too: why, and to which generation
    assert summary["restores"] == len(summary["recoveries"]) == 1, summary
    said = summary["recoveries"][0]
    assert said["reason"] == rec["reason"] == "every copy of a PS state lost", said
    assert said["gen"] == 1 and said["step"] == rec["step"], said


@pytest.mark.timeout(240)
def test_a_sync_run_with_a_ps_killed_ends_bit_identical_to_the_unfaulted_one(
    procs: Reaper, tmp_path: Path
) -> None:
    """Sync, 2 workers, plain SGD, the same seed: the run in which ps 1 is killed (its
    state promoted on a copy, its pushes in flight sent again) ends with every
    parameter bit-identical to the run with no fault. Two gradients a step add up the
    same in either order, so nothing but a lost, doubled or altered update could make
    them differ. The hidden layers are wide enough that each step's entry goes to the
    backup through the ring of shared memory the two share (this host), not beside."""
    flags = (
        "--ps", "3", "--replication", "2", "--mode", "sync", "--optimizer", "sgd",
        "--lr", "0.1", "--epochs", "12", "--heartbeat-timeout", "2", "--hidden", "256,256",
    )  # fmt: skip

    def model(run: Path, kill_at: int | None) -> dict[str, Any]:
        launcher, summary_path = launch_run(procs, run, "-q", *flags, timeout=150)
        if kill_at is not None:
            chief = chief_address(launcher)

            def training() -> dict[str, Any] | None:
                s = chief_status(chief, timeout=1.0)
                return s if s and s.get("global_step", 0) >= kill_at else None

            wait_for(training, 60, what="training under way", interval=0.05)
            os.kill(task_pid(launcher, "ps1"), signal.SIGKILL)
        launcher.expect_exit(0, timeout=200)
        summary = read_json(summary_path)
        assert summary is not None and summary["replication"]["restores"] == 0, summary
        if kill_at is not None:
            assert summary["replication"]["failovers"] == 1, summary
        logs = "".join((run / f"ps{i}.log").read_text() for i in range(3))
        assert "go through a ring" in logs, logs[-3000:]
        return {"summary": summary, "values": load_file(str(run / "model" / "model.safetensors"))}

    plain = model(tmp_path / "plain", None)
    killed = model(tmp_path / "killed", kill_at=90)
    assert killed["summary"]["global_step"] == plain["summary"]["global_step"]
    assert plain["values"].keys() == killed["values"].keys() and plain["values"]
    for name, value in plain["values"].items():
        assert value.tobytes() == killed["values"][name].tobytes(), name
