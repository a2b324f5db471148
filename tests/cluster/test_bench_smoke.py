"""``zmqps bench`` at tiny sizes: every suite runs, reports figures and ratios, cleans up.

No timing assertions: figures on a shared machine say nothing about correctness.
"""

from __future__ import annotations

import importlib.util
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import Proc, Reaper, read_json, sigint_ignored, wait_for, zmqps_cmd

TINY = [
    "--size-mb",
    "1",
    "--rows",
    "20000",
    "--batch-rows",
    "256",
    "--variables",
    "20",
    "--steps",
    "3",
    "--repeat",
    "1",
    "--warmup",
    "1",
    "--workers",
    "1",
]


def _bench(procs: Reaper, tmp_path: Path, *flags: str, **spawn: Any) -> tuple[Proc, Path, Path]:
    out, logs = tmp_path / "bench.json", tmp_path / "logs"
    argv = zmqps_cmd("bench", *flags, "--json", str(out), "--keep-logs", str(logs))
    return procs.spawn(argv, name="bench", **spawn), out, logs


def _children_of(logs: Path) -> list[int]:
    """Live processes whose command line names a file of the bench's log folder."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(logs) in argv:
            found.append(int(p.name))
    return found


def _runs(report: dict[str, Any], suite: str) -> list[dict[str, Any]]:
    return [r for r in report["runs"] if r["suite"] == suite]


@pytest.mark.timeout(100)
def test_every_suite_reports_medians_and_ratios(procs: Reaper, tmp_path: Path) -> None:
    bench, out, logs = _bench(
        procs,
        tmp_path,
        "dense",
        "sparse",
        "small",
        "--sides",
        "zmqps,zmqps-tcp,zmqps-hash,raw",
        "--row-budget",
        "300",
        *TINY,
    )
    bench.expect_exit(0, timeout=90)
    report = read_json(out)
    assert report["ok"] is True and report["failures"] == []
    assert report["machine"]["nproc"] >= 1 and report["machine"]["pyzmq"]
    for suite, variants in (
        ("dense", {"pull+push", "push_pull"}),
        ("sparse", {"rows", "fresh"}),
        ("small", {"pull+push", "push_pull"}),
    ):
        runs = _runs(report, suite)
        assert {r["variant"] for r in runs} == variants, runs
        for run in runs:
            for side in ("zmqps", "zmqps-tcp", "raw"):
                s = run["sides"][side]
                assert s["status"] == "ok", s
                assert s["median"] > 0 and s["min"] <= s["median"] <= s["max"]
                assert len(s["values"]) == 1 and len(s["runs"]) == 1
            assert run["ratios"]["zmqps/raw"] > 0
            assert run["ratios"]["zmqps-tcp/raw"] > 0
            # the hash-keyed table is a sparse-suite side only
            assert ("zmqps-hash" in run["sides"]) == (suite == "sparse"), run["sides"].keys()
    for run in _runs(report, "sparse"):
        h = run["sides"]["zmqps-hash"]
        assert h["status"] == "ok" and h["median"] > 0, h
        assert run["ratios"]["zmqps-hash/zmqps"] > 0 and run["ratios"]["zmqps-hash/raw"] > 0
        # its tables, read from the PS after the runs: 256 new ids per fresh step
        # against a budget of 300 rows, so rows were evicted to keep it
        t = h["tables"]["emb_fresh"]
        assert t["rows"] <= 300 and t["capacity"] <= 300, t
        assert t["created"] >= 256 * 4 and t["evicted_budget"] > 0, t
        pool = h["tables"]["emb"]  # the rows variant's: 8 batches of the pool, 256 ids
        assert 0 < pool["rows"] <= 300 and pool["created"] >= 256, pool
    assert _runs(report, "dense")[0]["sides"]["zmqps-tcp"]["transport"] == ["tcp"]
    assert "zmqps/raw" in bench.stdout and "median steps/s" in bench.stdout
    assert not _children_of(logs)


@pytest.mark.timeout(60)
def test_curve_side(procs: Reaper, tmp_path: Path) -> None:
    bench, out, logs = _bench(procs, tmp_path, "dense", "--sides", "zmqps-tcp,zmqps-curve", *TINY)
    bench.expect_exit(0, timeout=50)
    for run in read_json(out)["runs"]:
        curve = run["sides"]["zmqps-curve"]
        assert curve["status"] == "ok" and curve["median"] > 0, curve
        assert curve["transport"] == ["tcp"]  # every tensor byte encrypted (sealed)
        assert run["ratios"]["zmqps-curve/zmqps-tcp"] > 0
    assert not _children_of(logs)


@pytest.mark.timeout(90)
def test_replicated_sides(procs: Reaper, tmp_path: Path) -> None:
    """zmqps-r2 and zmqps-hash-r2 run two copies of every PS state, and the report
    prices them against the same side with one copy."""
    bench, out, logs = _bench(
        procs,
        tmp_path,
        "dense",
        "sparse",
        "--sides",
        "zmqps-tcp,zmqps-r2,zmqps-hash,zmqps-hash-r2",
        "--ps",
        "2",
        "--row-budget",
        "300",
        *TINY,
    )
    bench.expect_exit(0, timeout=80)
    report = read_json(out)
    assert report["ok"] is True and report["failures"] == []
    for run in report["runs"]:
        assert run["sides"]["zmqps-r2"]["status"] == "ok", run["sides"]["zmqps-r2"]
        assert run["ratios"]["zmqps-r2/zmqps-tcp"] > 0
        if run["suite"] == "sparse":
            assert run["sides"]["zmqps-hash-r2"]["status"] == "ok"
            assert run["ratios"]["zmqps-hash-r2/zmqps-hash"] > 0
        else:  # a hash-keyed table is a sparse-suite side only
            assert "zmqps-hash-r2" not in run["sides"], run["sides"].keys()
    assert not _children_of(logs)


@pytest.mark.timeout(60)
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_side(procs: Reaper, tmp_path: Path) -> None:
    bench, out, logs = _bench(
        procs, tmp_path, "sparse", "--sides", "zmqps,zmqps-hash,torch", "--row-budget", "300", *TINY
    )
    bench.expect_exit(0, timeout=50)
    runs = {r["variant"]: r for r in read_json(out)["runs"]}
    assert set(runs) == {"rows", "fresh"}
    for run in runs.values():
        assert run["sides"]["torch"]["status"] == "ok" and run["sides"]["torch"]["median"] > 0
        assert run["ratios"]["zmqps/torch"] > 0 and run["ratios"]["zmqps-hash/torch"] > 0
    assert runs["rows"]["targets"]["zmqps/torch"]["min"] == 2.0
    assert not _children_of(logs)


@pytest.mark.timeout(40)
def test_a_side_that_misses_its_deadline_fails_the_bench_and_is_stopped(
    procs: Reaper, tmp_path: Path
) -> None:
    # No worker can connect, create variables and warm up in 50 ms.
    bench, out, logs = _bench(
        procs, tmp_path, "dense", "--sides", "zmqps,raw", *TINY, "--timeout", "0.05"
    )
    bench.expect_exit(1, timeout=30)
    (run, *_) = read_json(out)["runs"]
    assert run["sides"]["zmqps"]["status"] == "failed"
    assert "no answer within" in run["sides"]["zmqps"]["error"]
    assert "failed" in bench.stderr
    assert not _children_of(logs)


@pytest.mark.timeout(40)
def test_ctrl_c_stops_every_child(procs: Reaper, tmp_path: Path) -> None:
    flags = [*TINY, "--steps", "100000", "--sides", "zmqps,raw"]
    # started as a script's background job would be (SIGINT ignored): it still stops
    bench, _, logs = _bench(procs, tmp_path, "dense", *flags, preexec_fn=sigint_ignored)
    wait_for(lambda: "raw ready" in bench.stderr, 25, what="both sides to be ready")
    bench.send(signal.SIGINT)
    bench.expect_exit(130, timeout=20)
    assert not _children_of(logs)


@pytest.mark.timeout(60)
def test_checkpoint_suite(procs: Reaper, tmp_path: Path) -> None:
    bench, out, _ = _bench(procs, tmp_path, "checkpoint", "--size-mb", "2", "--repeat", "1")
    bench.expect_exit(0, timeout=50)
    (run,) = _runs(read_json(out), "checkpoint")
    assert run["state_mb"] > 2  # values and both adam slots
    assert run["restore_shards"] != run["shards"] or run["shards"] == 1
    for phase in ("snapshot", "write", "commit", "verify", "restore"):
        s = run["seconds"][phase]
        assert 0 < s["min"] <= s["median"] <= s["max"], (phase, s)
    assert "checkpoint:" in bench.stdout


@pytest.mark.timeout(90)
def test_scale_suite_crosses_ps_and_worker_counts(procs: Reaper, tmp_path: Path) -> None:
    flags = ["--scale-ps", "1,2", "--workers", "1,2", "--size-mb", "1", "--steps", "3"]
    # one side (each case is a cluster started and warmed: two sides took 43-50 s of
    # the 80 in the suite, and past 80 with one more cluster beside it)
    flags += ["--repeat", "1", "--warmup", "1", "--sides", "zmqps-tcp,raw"]
    bench, out, logs = _bench(procs, tmp_path, "scale", *flags)
    bench.expect_exit(0, timeout=80)
    report = read_json(out)
    assert report["ok"] is True
    (run,) = _runs(report, "scale")
    assert run["sides"] == ["zmqps-tcp"]  # the sides it can measure (raw: not)
    cases = {(c["ps"], c["workers"], c["side"]): c for c in run["cases"]}
    assert set(cases) == {(p, w, s) for p in (1, 2) for w in (1, 2) for s in run["sides"]}
    for (p, w, side), c in cases.items():
        assert c["status"] == "ok" and c["steps_per_s"] > 0, c
        assert c["step_ms"] == pytest.approx(1000 * w / c["steps_per_s"])
        # a push_pull moves the model's gradients in and its values out, split over the PS
        assert c["bytes_per_step"] == 2 * c["model_bytes"] == 2 * (1 << 20)
        assert c["bytes_per_step_per_ps"] == -(-2 * c["model_bytes"] // p)
        base = cases[(1, 1, side)]["steps_per_s"]
        assert c["vs_1x1"] == pytest.approx(c["steps_per_s"] / base)
    assert "scale: 1 MiB float32 model" in bench.stdout and "2 PS" in bench.stdout
    assert not _children_of(logs)


@pytest.mark.timeout(120)
def test_overlap_suite(procs: Reaper, tmp_path: Path) -> None:
    flags = ["--steps", "4", "--repeat", "1", "--hidden", "64,32"]
    bench, out, logs = _bench(procs, tmp_path, "overlap", *flags)
    bench.expect_exit(0, timeout=110)
    (run,) = _runs(read_json(out), "overlap")
    assert run["device"] == "cpu" and run["hidden"] == [64, 32]
    assert set(run["examples_per_second"]) == {"serial", "layers", "prefetch"}
    assert run["ratio_to_serial"]["serial"] == 1.0
    for schedule, rec in run["split"].items():
        assert rec["steps"] == 4, schedule
        assert 0.0 <= rec["overlap"] <= 1.0
        assert rec["took_seconds"]["push"] > 0
    # serial waits for every push it makes, from before it is sent: nothing is hidden
    assert run["split"]["serial"]["overlap"] == 0.0
    assert "overlap:" in bench.stdout
    assert not _children_of(logs)


@pytest.mark.timeout(90)
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_gpu_bench_on_the_host(procs: Reaper, tmp_path: Path) -> None:
    """``python -m zmqps.bench.gpu`` (bin/gpu-measure's core) at tiny sizes on the host:
    two workers at once, each with its time split, against the PyTorch loop and the
    model alone."""
    out = tmp_path / "gpu.json"
    flags = ["--workers", "cpu,cpu", "--hidden", "32,16", "--batch", "8", "--steps", "20"]
    flags += ["--seconds", "5", "--baseline-steps", "20", "--baseline-seconds", "2"]
    bench = procs.spawn(
        [sys.executable, "-m", "zmqps.bench.gpu", *flags, "--json", str(out)], name="gpu"
    )
    bench.expect_exit(0, timeout=80)
    run = read_json(out)
    assert [r["device"] for r in run["per_worker"]] == ["cpu", "cpu"]
    for r in run["per_worker"]:
        assert r["steps"] >= 1 and r["examples_per_second"] > 0
        assert r["took_seconds"]["push"] > 0 and 0.0 <= r["overlap"] <= 1.0
    assert run["native"]["cpu"]["examples_per_second"] > 0
    assert run["local"]["cpu"]["examples_per_second"] > 0
    assert run["ratios"]["cpu_worker/native_cpu"] > 0
    assert "torch loop" in bench.stdout


HEARTBEAT_TIMEOUT = 4.0


@pytest.mark.timeout(90)
def test_scale_sim_steps_simulated_workers_exactly(procs: Reaper, tmp_path: Path) -> None:
    """The load simulator against a real chief and two real PS: 30 simulated workers,
    N = 28 of them per step (two backup workers), 6 steps. Every step is the mean of
    exactly N gradients applied once, nobody is declared dead but the worker that goes
    silent on purpose, within the heartbeat timeout and one check, and every server
    exits 0. The heartbeat timeout is 4 s: a simulator process holds 15 workers, and
    one that a loaded 2-core machine left unscheduled past 2 s had all 15 called dead
    (the steps meanwhile went on with the other 15, as they must: not exact)."""
    out = tmp_path / "sim.json"
    argv = zmqps_cmd("bench", "scale-sim", "--workers", "30")
    argv += [
        "--backup-workers",
        "2",
        "--ps",
        "2",
        "--steps",
        "6",
        "--procs",
        "2",
        "--heartbeat-timeout",
        str(HEARTBEAT_TIMEOUT),
    ]
    argv += ["--idle-s", "1"]
    sim = procs.spawn([*argv, "--json", str(out)], name="scale-sim")
    sim.expect_exit(0, timeout=80)
    (run,) = read_json(out)
    assert run["N"] == 28
    assert run["exact"] == {"ok": True, "problems": []}
    assert run["false_deaths"] == [] and run["errors"] == []
    # 30 workers x 6 steps x 2 PS: each step applies 28 pushes per PS, two come late
    assert sum(run["outcomes"].values()) == 30 * 6 * 2
    assert run["outcomes"]["applied"] >= 28 * 6 * 2
    assert run["global_step"] == 6
    # silent after its last heartbeat (at most an interval before it stopped)
    interval = run["heartbeat_interval"]
    assert HEARTBEAT_TIMEOUT - interval - 0.1 <= run["detect_s"] <= HEARTBEAT_TIMEOUT + 2.5
    assert run["exit_codes"] == [0, 0, 0] and run["sim_exit_codes"] == [0, 0]
    assert run["chief_cpu_us_per_worker_step"] > 0 and run["status_bytes"] > 0
    assert not _children_of(Path(run["logs"]))
