"""Elastic PS with real processes on loopback: PS states move between PS processes while
training goes on, asked for with ``zmqps scale`` or ``zmqps launch --ps-schedule``.

* Sync, softmax regression on a fixed global batch (``sync_worker.py``): the
  parameters after 60 steps, during which the run goes 2 -> 1 -> 2 PS, equal those of
  60 single-process steps (the oracle of ``test_sync_cluster.py``). A PS asked to leave
  exits 0 once its states moved; started again by hand, it takes states back.
* Async digits through ``zmqps launch --ps 3 --ps-schedule ...`` (3 -> 2 -> 3 -> 1 -> 2):
  the run ends with exit 0, every scale was made, no restore, accuracy as usual.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers import Reaper, chief_status, launch_run, read_json, wait_for, zmqps_cmd
from safetensors.numpy import load_file
from test_sync_cluster import assert_single_process, start_cluster


def scale(chief: str, n: int | None = None, wait: float = 0.0) -> dict[str, Any]:
    """``zmqps scale --json`` as a user runs it; its account of the moves."""
    argv = zmqps_cmd("scale", "--chief", chief, "--json", "--timeout", "10")
    if n is not None:
        argv += ["--ps", str(n)]
    if wait:
        argv += ["--wait", f"{wait:g}"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=wait + 30)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def global_step(chief: str) -> int:
    st = chief_status(chief)
    return -1 if st is None else int(st.get("global_step") or 0)


@pytest.mark.timeout(150)
def test_sync_steps_stay_exact_while_the_ps_go_two_one_two(procs: Reaper, tmp_path: Path) -> None:
    # room for the PS's restart and the move back before the end, on a loaded machine
    # (60 steps: the run ended 2 s into the move back, ps 1 having taken 10 s to start)
    steps = 90
    cluster = start_cluster(procs, tmp_path, "--mode", "sync", "--num-shards", "2")
    finals = [tmp_path / f"final{i}.npz" for i in range(2)]
    flags = ["--steps", str(steps), "--optimizer", "adam", "--sleep", "0.3"]
    workers = [cluster.worker(i, *flags, "--final", str(finals[i])) for i in (0, 1)]
    workers.append(cluster.worker(2, *flags))
    wait_for(lambda: global_step(cluster.chief) >= 8, 60, what="step 8")
    one = scale(cluster.chief, 1, wait=30)
    assert one["serving"] == [0] and one["moves_done"] == 1, one
    # ps 1 left: it was told to shut down once its state moved, and exits 0
    cluster.ps_p[1].expect_exit(0, timeout=30)
    assert global_step(cluster.chief) < steps - 40, "the run ended before it could scale back"
    again = cluster.procs.spawn(cluster.ps_p[1].argv, name="ps1-again")
    two = scale(cluster.chief, 2, wait=30)
    assert two["serving"] == [0, 1] and two["moves_done"] == 2, two
    for w in workers:
        w.expect_exit(0, timeout=60)
    cluster.chief_p.expect_exit(0, timeout=30)
    cluster.ps_p[0].expect_exit(0, timeout=30)
    again.expect_exit(0, timeout=30)
    for i in range(3):
        rec = cluster.record(f"worker{i}")
        assert [p["step"] for p in rec["pushes"]] == list(range(steps))
    assert_single_process(finals, "adam", steps)
    summary = read_json(cluster.summary)
    assert (summary["mode"], summary["global_step"]) == ("sync", steps)
    assert summary.get("restores", 0) == 0, summary
    # the moves were made at step boundaries, not by a restore
    assert "moved from ps 1 to ps 0" in cluster.chief_p.stderr
    assert "moved from ps 0 to ps 1" in cluster.chief_p.stderr
    assert "restoring" not in cluster.chief_p.stderr


@pytest.mark.timeout(180)
def test_a_launch_with_a_ps_schedule_ends_well(procs: Reaper, tmp_path: Path) -> None:
    launcher, summary_path = launch_run(
        procs,
        tmp_path / "run",
        "--ps",
        "3",
        "--ps-schedule",
        "0:2,1500:3,3000:1,4500:2",
        "--epochs",
        "150",
        timeout=150,
    )
    launcher.expect_exit(0, timeout=170)
    summary = read_json(summary_path)
    assert [s["ps"] for s in summary["ps_schedule"]] == [2, 3, 1, 2], summary
    assert summary["test_accuracy"] >= 0.9, summary
    assert not summary.get("restores"), summary
    chief_log = (tmp_path / "run" / "chief.log").read_text()
    assert "drained" in chief_log and "state moved" in chief_log
    assert "restoring every" not in chief_log
    # the PS that left was started again for the next scale up
    assert "starting it again" in launcher.stderr


@pytest.mark.timeout(300)
def test_a_sync_run_through_moves_ends_bit_identical_to_one_at_a_fixed_ps_count(
    procs: Reaper, tmp_path: Path
) -> None:
    """Sync, 2 workers, plain SGD, the same seed: the run whose states move 3 -> 2 ->
    3 -> 1 -> 2 PS ends with every parameter bit-identical to the run that keeps 3 PS
    (the states are the same; two gradients a step add up the same in either order, so
    only a lost, doubled or altered update, or a step summed across a hand-over, could
    make them differ)."""
    flags = (
        "--ps", "3", "--mode", "sync", "--optimizer", "sgd", "--lr", "0.1", "--epochs", "40",
    )  # fmt: skip

    def model(run: Path, *more: str) -> dict[str, Any]:
        launcher, summary_path = launch_run(procs, run, "-q", *flags, *more, timeout=200)
        launcher.expect_exit(0, timeout=250)
        summary = read_json(summary_path)
        assert summary is not None and not summary.get("restores"), summary
        return {"summary": summary, "values": load_file(str(run / "model" / "model.safetensors"))}

    plain = model(tmp_path / "plain")
    steps = int(plain["summary"]["global_step"])
    schedule = f"0:2,{steps // 4}:3,{steps // 2}:1,{3 * steps // 4}:2"
    moved = model(tmp_path / "moved", "--ps-schedule", schedule)
    assert moved["summary"]["global_step"] == steps
    assert moved["summary"]["elastic"]["moves"] >= 3, moved["summary"]["elastic"]
    assert plain["values"].keys() == moved["values"].keys() and plain["values"]
    for name, value in plain["values"].items():
        assert value.tobytes() == moved["values"][name].tobytes(), name
