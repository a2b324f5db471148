"""The side-car evaluator as a process beside a real cluster: snapshots, checkpoints, the end.

Every task runs as its own process on 127.0.0.1 (chief and PS with zmqps-server,
workers and the evaluator with zmqps-worker); checkpoints for the checkpoint source
are written by the test with the checkpoint library.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import (
    Proc,
    Reaper,
    addresses,
    chief_address,
    chief_status,
    launch_run,
    read_json,
    script,
    stopped_until,
    task_pid,
    wait_for,
)

from zmqps.core.partition import Partitioner, plan
from zmqps.data import load_digits
from zmqps.models import Model
from zmqps.roles.job import JobConfig


def _tf_config(cluster: dict[str, list[str]], task_type: str, index: int = 0) -> dict[str, str]:
    return {
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
    }


def _eval_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _servers(
    procs: Reaper, cluster: dict[str, list[str]], job: list[str], *chief_flags: str
) -> tuple[Proc, list[Proc]]:
    server = script("zmqps-server")
    chief = procs.spawn(
        [server, *job, *chief_flags], name="chief", env=_tf_config(cluster, "chief")
    )
    ps = [
        procs.spawn([server], name=f"ps{i}", env=_tf_config(cluster, "ps", i))
        for i in range(len(cluster["ps"]))
    ]
    return chief, ps


@pytest.mark.timeout(120)
def test_snapshot_evaluator_follows_training_and_exits_0(procs: Reaper, tmp_path: Path) -> None:
    chief_a, ps_a, w0, w1 = addresses(4)
    cluster = {"chief": [chief_a], "ps": [ps_a], "worker": [w0, w1]}
    job = ["--model", "mlp", "--epochs", "40"]
    summary = tmp_path / "summary.json"
    eval_log = tmp_path / "eval.jsonl"
    chief, ps = _servers(procs, cluster, job, "--summary", str(summary))
    evaluator = procs.spawn(
        [script("zmqps-worker"), *job, "--eval-interval", "0.5", "--eval-log", str(eval_log)],
        name="evaluator",
        env=_tf_config(cluster, "evaluator"),  # TF_CONFIG task type "evaluator"
    )
    workers = [
        procs.spawn(
            [script("zmqps-worker"), *job], name=f"worker{i}", env=_tf_config(cluster, "worker", i)
        )
        for i in (0, 1)
    ]
    for task in (*workers, chief, *ps):
        task.expect_exit(0, timeout=100)
    evaluator.expect_exit(0, timeout=20)  # training ended: it ends too, with success

    result = read_json(summary)
    assert result["workers"] == 2  # the evaluator was not counted as a worker
    lines = _eval_lines(eval_log)
    assert len(lines) >= 2, evaluator.tail()
    for line in lines:
        assert 0.0 <= line["accuracy"] <= 1.0
        assert line["loss"] > 0 and line["source"] == "snapshot"
        assert 0 <= line["step"] <= result["global_step"]
    steps = [line["step"] for line in lines]
    assert len(set(steps)) == len(steps)  # one evaluation per global step seen
    assert lines[-1]["accuracy"] > 0.8, lines  # it followed the training
    assert "evaluator: step" in evaluator.stderr
    assert "training finished" in evaluator.stderr


def _trained(test: Any, job: JobConfig, steps: int) -> tuple[Model, dict[str, np.ndarray]]:
    model = job.build_model(test)
    train = load_digits("train")
    params = {v.name: np.zeros(v.shape, v.dtype) for v in model.variables()}
    for i in range(steps):
        rows = np.random.default_rng(i).integers(0, len(train.y), 64)
        _, grads = model.loss_and_grads(params, train.x[rows], train.y[rows])
        for name, g in grads.items():
            params[name] -= 0.5 * g
    return model, params


def _commit(root_dir: Path, model: Model, params: dict[str, np.ndarray], step: int) -> str:
    """Commit ``params`` as checkpoint ``step``, sharded as one PS would hold them."""
    from zmqps.checkpoint import CheckpointRoot, Manifest, write_shard

    opt = {"name": "sgd", "lr": 0.5}
    pl = plan(model.variables(), 1, Partitioner(num_shards=2), optimizer=opt)
    root = CheckpointRoot(root_dir, keep=0)
    temp = root.new_temp(step)
    records = [
        write_shard(
            temp,
            sd,
            np.ascontiguousarray(params[sd.var][sd.row_start : sd.row_start + sd.rows]),
            {},
            version=step,
        )
        for _, sd in pl.shard_defs()
    ]
    manifest = Manifest(
        step=step,
        variables=[v.to_wire() for v in pl.variables],
        optimizer=opt,
        num_ps=1,
        shards=records,
    )
    return root.commit(temp, manifest).name


@pytest.mark.timeout(120)
def test_checkpoint_evaluator_scores_each_new_checkpoint(procs: Reaper, tmp_path: Path) -> None:
    pytest.importorskip("zmqps.checkpoint", reason="the checkpoint library is not available")
    chief_a, ps_a, w0 = addresses(3)
    cluster = {"chief": [chief_a], "ps": [ps_a], "worker": [w0]}
    job = ["--model", "softmax", "--epochs", "2"]
    ckpts, eval_log = tmp_path / "ckpts", tmp_path / "eval.jsonl"
    chief, ps = _servers(procs, cluster, job)
    evaluator = procs.spawn(
        [
            script("zmqps-worker"),
            "--role",
            "evaluator",
            *job,
            "--checkpoint-dir",
            str(ckpts),
            "--eval-interval",
            "0.2",
            "--eval-log",
            str(eval_log),
        ],
        name="evaluator",
        env=_tf_config(cluster, "worker", 0),  # --role wins over the TF_CONFIG task
    )
    test = load_digits("test")
    model, early = _trained(test, JobConfig(model="softmax"), 5)
    _, late = _trained(test, JobConfig(model="softmax"), 200)

    first = _commit(ckpts, model, early, 10)
    wait_for(lambda: len(_eval_lines(eval_log)) == 1, 30, what="the first evaluation")
    bad = _commit(ckpts, model, late, 20)
    shard = sorted((ckpts / bad).glob("shard-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-8] + b"\xff" * 8)  # corrupt its last values
    wait_for(lambda: f"checkpoint {bad} skipped" in evaluator.stderr, 30, what="the skip")
    good = _commit(ckpts, model, late, 30)
    wait_for(lambda: len(_eval_lines(eval_log)) == 2, 30, what="the second evaluation")

    # A worker trains the job to its end: the chief finishes, and the evaluator exits 0.
    worker = procs.spawn(
        [script("zmqps-worker"), *job], name="worker0", env=_tf_config(cluster, "worker", 0)
    )
    for task in (worker, chief, *ps):
        task.expect_exit(0, timeout=60)
    evaluator.expect_exit(0, timeout=30)

    lines = _eval_lines(eval_log)
    assert [(x["step"], x["checkpoint"], x["source"]) for x in lines] == [
        (10, first, "checkpoint"),
        (30, good, "checkpoint"),
    ]
    for line, params in zip(lines, (early, late), strict=True):
        want = model.evaluate(params, test.x, test.y)
        assert line["accuracy"] == pytest.approx(want["accuracy"])
        assert line["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert lines[1]["accuracy"] > lines[0]["accuracy"]


@pytest.mark.timeout(60)
def test_sigterm_exits_0_and_a_lost_chief_exits_1(procs: Reaper, tmp_path: Path) -> None:
    chief_a, ps_a, w0 = addresses(3)
    cluster = {"chief": [chief_a], "ps": [ps_a], "worker": [w0]}
    job = ["--model", "softmax"]
    chief, (ps,) = _servers(procs, cluster, job)
    argv = [script("zmqps-worker"), *job, "--eval-interval", "0.2", "--chief-timeout", "2"]
    logs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    env = _tf_config(cluster, "evaluator")
    a = procs.spawn([*argv, "--eval-log", str(logs[0])], name="evaluator-a", env=env)
    b = procs.spawn([*argv, "--eval-log", str(logs[1])], name="evaluator-b", env=env)
    for log in logs:
        wait_for(lambda log=log: _eval_lines(log), 30, what="an evaluation of step 0")

    a.send(signal.SIGTERM)
    a.expect_exit(0, timeout=10)
    assert "evaluator: stopped after" in a.stderr

    # The chief dies without ending the job; its PS still listens: that is an error.
    chief.send(signal.SIGKILL)
    chief.expect_exit(-signal.SIGKILL, timeout=10)
    b.expect_exit(1, timeout=20)
    assert "has not answered status requests for 2s" in b.stderr
    assert "Traceback" not in b.stderr
    ps.send(signal.SIGKILL)  # (a PS given SIGTERM waits a while for its chief)
    ps.expect_exit(-signal.SIGKILL, timeout=10)


@pytest.mark.timeout(180)
def test_an_evaluator_paused_at_the_end_still_scores_the_final_model(
    procs: Reaper, tmp_path: Path
) -> None:
    """Fault schedule 75 of run 11: the snapshot evaluator was stopped (SIGSTOP) when
    training ended; the chief, hearing nothing from it, shut the PS down at once, and
    the evaluator, resumed, found nothing left to score. An evaluator that has not left
    is waited for while it has been silent less than four heartbeat timeouts.

    The evaluator is stopped near the end of training (most of the planned steps
    done), whatever the machine's speed: the run ends well inside the 8 s (four
    heartbeat timeouts of 2 s) the chief waits for a silent evaluator."""
    run = tmp_path / "run"
    launcher, summary_path = launch_run(
        procs,
        run,
        "-q",
        "--evaluator",
        "--no-checkpoints",  # a snapshot evaluator: it can score only live PS
        "--heartbeat-timeout",
        "2",
        "--epochs",
        "60",
    )
    eval_log = run / "evaluator.jsonl"
    wait_for(lambda: len(_eval_lines(eval_log)) >= 1 or None, 60, what="a first evaluation")
    pid = task_pid(launcher, "evaluator")
    chief = chief_address(launcher)

    def near_the_end() -> bool:
        s = chief_status(chief)
        return s is not None and 0 < s["steps_planned"] * 0.9 <= s["global_step"]

    wait_for(near_the_end, 90, what="90% of the planned steps", interval=0.02)
    chief_log = run / "chief.log"
    stopped_until(
        pid,
        lambda: (
            any(
                said in chief_log.read_text()
                for said in (
                    "has been silent since before the end",  # stopped > 1 timeout before
                    "waiting for the evaluator's last evaluation",  # stopped just before
                )
            )
            or None
        ),
        90,
        what="the chief to wait for the silent evaluator",
    )
    launcher.expect_exit(0, timeout=60)
    summary = read_json(summary_path)
    last = _eval_lines(eval_log)[-1]
    assert last["step"] == summary["global_step"], (last, summary["global_step"])
    assert round(last["accuracy"], 4) == summary["test_accuracy"], (last, summary)
    assert last["source"] == "snapshot"


@pytest.mark.timeout(120)
def test_an_evaluator_up_only_after_a_short_run_ended_scores_the_final_model(
    procs: Reaper, tmp_path: Path
) -> None:
    """Found by a suite run: a 2-epoch launch ended 2 s after the chief began, before
    the evaluator's process (slow to start on a loaded machine) had registered. The
    launch's chief did not know of any evaluator and shut down at once; the evaluator
    waited for it until the launcher stopped it 20 s later, having scored nothing (a
    warning in the launch's summary, exit 0). The evaluator is now a task of the
    chief's cluster, which waits a heartbeat timeout from its start for one it never
    heard. Here it is stopped as its process appears and resumed after the run's end."""
    run = tmp_path / "run"
    launcher, summary_path = launch_run(procs, run, "--evaluator", "--epochs", "1")
    chief_log = run / "chief.log"
    stopped_until(
        task_pid(launcher, "evaluator"),
        lambda: "final model" in chief_log.read_text() or None,
        60,
        what="the run's end (the chief's final model)",
    )
    launcher.expect_exit(0, timeout=60)
    summary = read_json(summary_path)
    assert "still running" not in launcher.stderr, launcher.stderr
    assert "evaluated nothing" not in launcher.stdout, launcher.stdout
    last = _eval_lines(run / "evaluator.jsonl")[-1]
    assert last["step"] == summary["global_step"], (last, summary["global_step"])
    assert round(last["accuracy"], 4) == summary["test_accuracy"], (last, summary)
