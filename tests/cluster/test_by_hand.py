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
