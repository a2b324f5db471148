"""Towers against a real chief and 2 PS on loopback.

The oracle: a sync run of 2 workers with 2 towers each (and an async run of one,
whose push_pulls must refresh every tower) is single-process SGD on the global
batch (the workers' batches, 2 tower slices each), step for step, within float
rounding, on emulated devices (every value and gradient through the staging copies
a GPU uses) and on a GPU used twice per worker where there is one (``-m gpu``).
Then the built-in program: ``zmqps-worker --devices cpu,cpu`` trains digits with
``--batch-size`` examples per tower.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import DEVICE_KINDS, Proc, Reaper, addresses, device_of, read_json, script

from zmqps.core.initializers import initialize
from zmqps.core.variables import VariableDef
from zmqps.device import to_numpy
from zmqps.models import MLP
from zmqps.roles.overlap import StepPipeline
from zmqps.roles.worker import Worker

STEPS, PER_TOWER, LR = 12, 16, 0.2


def _batch(worker: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``worker``'s batch of ``step``: 2 towers' worth, fixed by a seed."""
    rng = np.random.default_rng(1000 * worker + step)
    x = rng.normal(size=(2 * PER_TOWER, 20)).astype(np.float32)
    return x, (x[:, :7].argmax(axis=1) + (x[:, 7] > 0)) % 7


def _initial(v: VariableDef) -> np.ndarray:
    return initialize(dict(v.init), v.name, v.shape, v.dtype, 0, v.shape[0])


def _servers(procs: Reaper, workers: int, mode: str = "sync") -> tuple[str, list[Proc]]:
    chief, ps0, ps1, *ws = addresses(3 + workers)
    hosts = ["--ps-hosts", f"{ps0},{ps1}", "--worker-hosts", ",".join(ws), "--chief-host", chief]
    server = script("zmqps-server")
    started = [
        procs.spawn([server, *hosts, "--job-name", "chief", "--mode", mode], name="chief"),
        *(
            procs.spawn([server, *hosts, "--job-name", "ps", "--task-id", str(i)], name=f"ps{i}")
            for i in (0, 1)
        ),
    ]
    return chief, started


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", [p for p in DEVICE_KINDS if p.values[0] != "cpu"])
@pytest.mark.parametrize(("mode", "workers"), [("sync", 2), ("async", 1)])
def test_towers_are_single_process_sgd_on_the_global_batch(
    procs: Reaper, kind: str, mode: str, workers: int
) -> None:
    """async with one worker: each layer's push_pull brings the values of the next
    step, which must reach every tower (the replicas of the back slot)."""
    model = MLP(20, 7, hidden=(32, 16), seed=4)
    chief, servers = _servers(procs, workers, mode)
    finals: dict[int, dict[str, np.ndarray]] = {}
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            devices = [device_of(kind)] * 2
            with Worker(chief, index, devices=devices, timeout=60) as w:
                w.create_variables(model.variables(), optimizer={"name": "sgd", "lr": LR})
                pipe = StepPipeline(w, push_bytes=1)  # each layer pushed when ready
                for step in range(STEPS):
                    pipe.begin()
                    x, y = _batch(index, step)
                    loss, grads = pipe.compute(model.loss_and_grads, x, y)
                    assert pipe.end(grads, loss=loss, examples=len(x))
                pipe.close()
                if mode == "sync":
                    w.begin_step()  # the token of step STEPS: every step before is applied
                finals[index] = {k: to_numpy(v).copy() for k, v in w.pull().items()}
        except BaseException as exc:  # raised in the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not errors, errors
    for p in servers:
        p.expect_exit(0, timeout=60)

    initial = {v.name: _initial(v) for v in model.variables()}
    values = {name: np.asarray(finals[0][name]) for name in initial}
    ref = dict(initial)  # the PS's initial values: the initializers are sharding-free
    for step in range(STEPS):
        xs, ys = zip(*(_batch(i, step) for i in range(workers)), strict=True)
        _, grads = model.loss_and_grads(ref, np.concatenate(xs), np.concatenate(ys))
        for name, g in grads.items():
            ref[name] = ref[name] - LR * g
    for name, expected in ref.items():
        np.testing.assert_array_equal(finals[workers - 1][name], values[name])  # one model
        np.testing.assert_allclose(values[name], expected, rtol=1e-4, atol=1e-5, err_msg=name)
    assert not np.allclose(values["mlp/out/w"], initial["mlp/out/w"])  # it trained


@pytest.mark.timeout(120)
def test_the_built_in_program_on_two_host_towers(procs: Reaper, tmp_path: Path) -> None:
    chief, ps0, ps1, w0, w1 = addresses(5)
    hosts = ["--ps-hosts", f"{ps0},{ps1}", "--worker-hosts", f"{w0},{w1}", "--chief-host", chief]
    job = ["--model", "mlp", "--epochs", "6", "--batch-size", "32", "--mode", "sync"]
    towers = ["--devices", "cpu,cpu"]
    summary = tmp_path / "summary.json"
    server, worker = script("zmqps-server"), script("zmqps-worker")
    tasks = [
        procs.spawn(
            [server, *hosts, "--job-name", "chief", *job, "--summary", str(summary)], name="chief"
        ),
        *(
            procs.spawn([server, *hosts, "--job-name", "ps", "--task-id", str(i)], name=f"ps{i}")
            for i in (0, 1)
        ),
        *(
            procs.spawn(
                [worker, *hosts, "--job-name", "worker", "--task-id", str(i), *job, *towers],
                name=f"worker{i}",
            )
            for i in (0, 1)
        ),
    ]
    for task in tasks:
        task.expect_exit(0, timeout=100)
    result: dict[str, Any] = read_json(summary)
    # 719 examples per worker, 64 a step (2 towers of 32): 12 steps an epoch
    assert result["global_step"] == 6 * 12, result
    assert result["test_accuracy"] >= 0.9, result
    for task in tasks[3:]:
        assert "2 towers (cpu, cpu), 32 examples each" in task.stderr
    bad = procs.spawn(
        [worker, *hosts, "--job-name", "worker", "--task-id", "0", *job, "--devices", "cuda:0,cpu"],
        name="bad",
    )
    bad.expect_exit(2, timeout=30)
    assert "all CUDA GPUs or all the host" in bad.stderr
