"""A whole cluster started again on a run that already finished (`docker compose up`
a second time, the checkpoint volume kept): every task ends, exit code 0, saying so.

The chief finds the run's final checkpoint and the summary of its step and ends; the
workers and the evaluator, started with it or just after, waited for it for their
whole ``--connect-timeout``, exited 1, and a ``restart: on-failure`` policy started
them again for ever. The chief now stays to tell each task of the cluster spec that
registers that the run ended (a bounded grace), and they exit 0 with one line naming
the run's final checkpoint.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers import Proc, Reaper, addresses, read_json, script, wait_for

JOB = ["--model", "softmax", "--epochs", "2"]


def _env(cluster: dict[str, list[str]], role: str, index: int) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": role, "index": index}})}


def _start(procs: Reaper, cluster: dict[str, list[str]], run: Path, tag: str) -> dict[str, Proc]:
    """The chief and the PS of a cluster (the compose file's flags, on ``run``)."""
    ckpt = ["--checkpoint-dir", str(run / "checkpoints")]
    server = script("zmqps-server")
    tasks = {
        "chief": procs.spawn(
            [server, *JOB, *ckpt, "--checkpoint-steps", "20", "--summary", str(run / "s.json")],
            name=f"chief-{tag}",
            env=_env(cluster, "chief", 0),
        )
    }
    for i in range(len(cluster["ps"])):
        tasks[f"ps{i}"] = procs.spawn(
            [server, *ckpt], name=f"ps{i}-{tag}", env=_env(cluster, "ps", i)
        )
    return tasks


def _clients(procs: Reaper, cluster: dict[str, list[str]], run: Path, tag: str) -> dict[str, Proc]:
    """The workers and the evaluator (they give up on a silent chief after 30 s)."""
    worker = [script("zmqps-worker"), "--connect-timeout", "30"]
    tasks = {
        f"worker{i}": procs.spawn(
            [*worker, *JOB], name=f"worker{i}-{tag}", env=_env(cluster, "worker", i)
        )
        for i in range(len(cluster["worker"]))
    }
    tasks["evaluator"] = procs.spawn(
        [*worker, "--role", "evaluator", *JOB, "--checkpoint-dir", str(run / "checkpoints")],
        name=f"evaluator-{tag}",
        env=_env(cluster, "evaluator", 0),
    )
    return tasks


@pytest.mark.timeout(240)
def test_a_finished_runs_cluster_started_again_ends_every_task_with_0(
    procs: Reaper, tmp_path: Path
) -> None:
    chief, ps0, ps1, w0, w1, ev = addresses(6)
    cluster = {"chief": [chief], "ps": [ps0, ps1], "worker": [w0, w1], "evaluator": [ev]}
    run = tmp_path / "run"
    first = {**_start(procs, cluster, run, "1"), **_clients(procs, cluster, run, "1")}
    for task in first.values():
        task.expect_exit(0, timeout=100)
    summary = read_json(run / "s.json")
    final = max(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("ckpt-"))

    # Again, as `docker compose up` does on the kept volume: the chief and the PS, and
    # the workers and the evaluator once the chief has decided that the run is over
    # (slower to start, as containers are), so that none of them meets it starting.
    started = time.monotonic()
    again = _start(procs, cluster, run, "2")
    wait_for(
        lambda: "the run already finished" in again["chief"].stderr,
        30,
        what="the chief to find the run over",
    )
    again.update(_clients(procs, cluster, run, "2"))
    for name, task in again.items():
        task.expect_exit(0, timeout=60)
        if name.startswith(("worker", "evaluator")):
            lines = [ln for ln in task.stderr.splitlines() if "the run already finished" in ln]
            assert len(lines) == 1, task.tail()
            assert f"({final}, step {summary['global_step']})" in lines[0], task.tail()
    # every task of the cluster was told: the chief did not wait out its grace
    assert time.monotonic() - started < 40, again["chief"].tail()
    assert read_json(run / "s.json") == summary  # the run's own summary stays
