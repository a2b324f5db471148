"""The README's "by hand" flow: one process per task, started with zmqps-server / zmqps-worker."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from helpers import Reaper, addresses, read_json, script, wait_for, zmqps_cmd


def _tf_config(cluster: dict[str, list[str]], task_type: str, index: int) -> dict[str, str]:
    """The TF_CONFIG a Kubeflow TFJob gives the pod of one task."""
    spec = {"cluster": cluster, "task": {"type": task_type, "index": index}, "environment": "cloud"}
    return {"TF_CONFIG": json.dumps(spec)}


@pytest.mark.timeout(90)
def test_tf_config_per_process(procs: Reaper, tmp_path: Path) -> None:
    chief, ps0, ps1, w0, w1 = addresses(5)
    cluster = {"chief": [chief], "ps": [ps0, ps1], "worker": [w0, w1]}
    summary = tmp_path / "summary.json"
    job = ["--model", "mlp", "--epochs", "5"]
    server, worker = script("zmqps-server"), script("zmqps-worker")
    tasks = [
        procs.spawn(
            [server, *job, "--summary", str(summary)],
            name="chief",
            env=_tf_config(cluster, "chief", 0),
        ),
        *(procs.spawn([server], name=f"ps{i}", env=_tf_config(cluster, "ps", i)) for i in (0, 1)),
        *(
            procs.spawn([worker, *job], name=f"worker{i}", env=_tf_config(cluster, "worker", i))
            for i in (0, 1)
        ),
    ]
    # Workers finish, the chief evaluates and shuts the PS down: everyone exits 0.
    for task in tasks:
        task.expect_exit(0, timeout=80)
    result = read_json(summary)
    assert (result["model"], result["ps"], result["workers"]) == ("mlp", 2, 2)
    assert result["global_step"] > 0
    assert result["test_accuracy"] >= 0.9, result
    assert "chief: serving on tcp://" + chief in tasks[0].stderr


@pytest.mark.timeout(60)
def test_classic_flags_keep_alive_and_status(procs: Reaper, tmp_path: Path) -> None:
    chief, ps, w0, w1 = addresses(4)
    hosts = ["--ps-hosts", ps, "--worker-hosts", f"{w0},{w1}", "--chief-host", chief]
    job = ["--model", "softmax", "--epochs", "1"]
    summary = tmp_path / "summary.json"
    server, worker = script("zmqps-server"), script("zmqps-worker")
    chief_p = procs.spawn(
        [server, *hosts, "--job-name", "chief", *job, "--keep-alive", "--summary", str(summary)],
        name="chief",
    )
    ps_p = procs.spawn([server, *hosts, "--job-name", "ps", "--task-id", "0"], name="ps0")
    workers = [
        procs.spawn(
            [worker, *hosts, "--job-name", "worker", "--task-id", str(i), *job], name=f"w{i}"
        )
        for i in (0, 1)
    ]
    for w in workers:
        w.expect_exit(0, timeout=50)
    result = wait_for(lambda: read_json(summary), timeout=30, what="the chief's summary")

    # Training is over, but --keep-alive keeps the chief (and so the PS) serving.
    status_p = procs.spawn(zmqps_cmd("status", "--chief", chief, "--json"), name="status")
    status_p.expect_exit(0, timeout=20)
    status = json.loads(status_p.stdout)
    assert status["mode"] == "async"
    assert status["global_step"] == result["global_step"] > 0
    assert status["workers_alive"] == []
    assert [w["state"] for w in status["workers"]] == ["done", "done"]
    assert chief_p.poll() is None and ps_p.poll() is None

    chief_p.send(signal.SIGTERM)
    chief_p.expect_exit(0, timeout=20)
    ps_p.expect_exit(0, timeout=20)


@pytest.mark.timeout(120)
def test_mismatched_job_flags_are_refused_or_said_once(procs: Reaper) -> None:
    """A chief started with --epochs 1 and workers with other flags ran without a word.
    A worker of another cluster layout (2 PS where the chief has 1) is refused with one
    line naming both lists (exit 2); one with other --epochs runs, and the chief's log
    says so once, naming the winner."""
    chief, ps, w0, w1, other_ps = addresses(5)
    hosts = ["--worker-hosts", f"{w0},{w1}", "--chief-host", chief]
    job = ["--model", "softmax"]
    server, worker = script("zmqps-server"), script("zmqps-worker")
    chief_p = procs.spawn(
        [server, *hosts, "--ps-hosts", ps, "--job-name", "chief", *job, "--epochs", "1"],
        name="chief",
    )
    ps_p = procs.spawn([server, *hosts, "--ps-hosts", ps, "--job-name", "ps"], name="ps0")
    w1_task = ["--job-name", "worker", "--task-id", "1"]
    wrong = procs.spawn(
        [worker, *hosts, "--ps-hosts", f"{ps},{other_ps}", *w1_task, *job, "--epochs", "1"],
        name="wrong",
    )
    wrong.expect_exit(2, timeout=60)
    assert wrong.stderr.splitlines()[-1] == (
        f"zmqps: error: the chief refuses worker 1, started for another run: --ps-hosts: the"
        f" chief's is {ps}, this worker's {ps},{other_ps} (every task of a run takes the same"
        " cluster spec)"
    ), wrong.tail()
    workers = []
    for i, epochs in ((0, "2"), (1, "1")):
        task = ["--job-name", "worker", "--task-id", str(i)]
        argv = [worker, *hosts, "--ps-hosts", ps, *task, *job, "--epochs", epochs]
        workers.append(procs.spawn(argv, name=f"w{i}"))
    for proc in (*workers, chief_p, ps_p):
        proc.expect_exit(0, timeout=80)
    said = [ln for ln in chief_p.stderr.splitlines() if "runs with --" in ln]
    assert len(said) == 1, chief_p.tail()
    assert said[0].endswith(
        "W zmqps.chief: worker 0 runs with --epochs 2, the chief with --epochs 1: the worker's"
        " wins (it trains that many passes over its own data)"
    ), said
    assert "the chief refuses worker 1" in chief_p.stderr


@pytest.mark.timeout(120)
def test_top_given_the_chief_alone_shows_the_throughput(procs: Reaper) -> None:
    """``zmqps top CHIEF_METRICS_URL`` (the README's first hour) said "examples/s 0" and
    loss "-" while the run trained: it read examples from the workers' endpoints only."""
    from helpers import chief_status, free_ports

    chief, ps, w0, w1 = addresses(4)
    (port,) = free_ports(1)
    hosts = ["--ps-hosts", ps, "--worker-hosts", f"{w0},{w1}", "--chief-host", chief]
    job = ["--model", "mlp", "--epochs", "500"]
    server, worker = script("zmqps-server"), script("zmqps-worker")
    metrics = ["--metrics-port", str(port)]
    tasks = [
        procs.spawn([server, *hosts, "--job-name", "chief", *job, *metrics], name="chief"),
        procs.spawn([server, *hosts, "--job-name", "ps", "--task-id", "0"], name="ps"),
        *(
            procs.spawn(
                [worker, *hosts, "--job-name", "worker", "--task-id", str(i), *job],
                name=f"worker{i}",
            )
            for i in (0, 1)
        ),
    ]
    wait_for(
        lambda: (s := chief_status(chief)) and s.get("global_step", 0) > 100,
        timeout=60,
        what="training under way",
    )
    url = f"http://127.0.0.1:{port}/metrics"
    top = procs.spawn(zmqps_cmd("top", url, "--iterations", "3", "--interval", "1"), name="top")
    top.expect_exit(0, timeout=30)
    lines = [ln for ln in top.stdout.splitlines() if ln.startswith("examples/s ")]
    assert len(lines) == 3, top.tail()
    for line in lines:
        rate = float(line.split()[1].replace(",", ""))
        assert rate > 0, top.tail()
        assert "(from the chief: the workers' heartbeats)" in line, line
    assert "loss (mean of workers) -" not in lines[-1], top.tail()
    chief_p = tasks[0]
    chief_p.send(signal.SIGTERM)
    chief_p.expect_exit(143, timeout=30)
    for t in tasks[1:]:
        t.expect_exit(0, timeout=30)
