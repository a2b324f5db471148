"""Overlapped steps (zmqps.roles.overlap) against a real chief and 2 PS on loopback.

The oracle: with one worker, every schedule that keeps values fresh (sync; async
with push_pull per layer) on every device (host arrays, emulated device copies)
must end on exactly the parameters of the plain pull / compute / push loop. The
emulated device moves every value through pinned-buffer staging and copies, as a
GPU worker does, so this covers the GPU code path without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from helpers import DEVICE_KINDS, Proc, Reaper, addresses, device_of, script

from zmqps.data import batches
from zmqps.device import Device, to_numpy
from zmqps.roles.job import JobConfig
from zmqps.roles.overlap import COMM_PHASES, StepPipeline
from zmqps.roles.worker import Worker

JOB = JobConfig(
    model="mlp",
    hidden=(16, 8),
    batch_size=64,
    epochs=1,
    optimizer={"name": "momentum", "lr": 0.05, "momentum": 0.9},
    seed=5,
)
FLAGS = ["--model", "mlp", "--hidden", "16,8", "--batch-size", "64", "--epochs", "1", "--seed", "5"]


@contextmanager
def cluster(procs: Reaper, mode: str) -> Iterator[str]:
    """A chief and 2 PS for one worker; yields the chief's address, then checks that
    every server exited 0 once the worker left."""
    chief, ps0, ps1, w0 = addresses(4)
    hosts = ["--ps-hosts", f"{ps0},{ps1}", "--worker-hosts", w0, "--chief-host", chief]
    server = script("zmqps-server")
    started: list[Proc] = [
        procs.spawn([server, *hosts, "--job-name", "chief", "--mode", mode, *FLAGS], name="chief")
    ]
    started += [
        procs.spawn([server, *hosts, "--job-name", "ps", "--task-id", str(i)], name=f"ps{i}")
        for i in (0, 1)
    ]
    yield chief
    for p in started:
        p.expect_exit(0, timeout=60)


def train_plain(worker: Worker) -> None:
    """The reference loop: pull, compute, push, one step at a time."""
    data = JOB.load("train")
    model = JOB.build_model(data)
    worker.create_variables(model.variables(), optimizer=JOB.optimizer)
    for x, y in batches(data, JOB.batch_size, 0, seed=5000):
        worker.begin_step()
        params = worker.pull()
        loss, grads = model.loss_and_grads(params, x, y)
        worker.push(grads, loss=loss, examples=len(x))


def train_pipelined(worker: Worker, epochs: int = 1, **options: Any) -> StepPipeline:
    data = JOB.load("train")
    model = JOB.build_model(data)
    worker.create_variables(model.variables(), optimizer=JOB.optimizer)
    pipe = StepPipeline(worker, **options)
    device = worker.device
    for x, y in (b for e in range(epochs) for b in batches(data, JOB.batch_size, e, seed=5000)):
        params = pipe.begin()
        loss, grads = model.loss_and_grads(
            params, device.asarray(x), device.asarray(y), on_ready=pipe.grads_ready
        )
        assert pipe.end(grads, loss=loss, examples=len(x)), worker.client.dropped
    pipe.close()
    return pipe


def final_values(worker: Worker) -> dict[str, np.ndarray]:
    return {k: to_numpy(v).copy() for k, v in worker.pull().items()}


def run(procs: Reaper, mode: str, device: Device, **options: Any) -> dict[str, Any]:
    with cluster(procs, mode) as chief, Worker(chief, 0, device=device, timeout=60) as w:
        pipe = None if options.pop("plain", False) else train_pipelined(w, **options)
        if pipe is None:
            train_plain(w)
        values = final_values(w)
        out = {"values": values, "pipe": pipe, "staleness": w.staleness, "steps": w.step}
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    reaper = Reaper(tmp_path_factory.mktemp("reference"))
    try:
        values: dict[str, np.ndarray] = run(reaper, "sync", Device(), plain=True)["values"]
    finally:
        left = reaper.reap()
    assert not left, left
    return values


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_fresh_schedules_match_the_plain_loop_exactly(
    procs: Reaper, reference: dict[str, np.ndarray], mode: str, kind: str
) -> None:
    """Exactly on the host and the emulated device; on a GPU within float rounding
    (its matrix products sum in another order)."""
    separate = kind != "cpu"
    # push_bytes=1: every layer is pushed on its own, as soon as backprop finished it
    result = run(procs, mode, device_of(kind), push_bytes=1)
    assert set(result["values"]) == set(reference)
    for name, ref in reference.items():
        if kind == "cuda":
            np.testing.assert_allclose(result["values"][name], ref, rtol=1e-4, atol=1e-5)
        else:
            np.testing.assert_array_equal(result["values"][name], ref, err_msg=name)
    pipe: StepPipeline = result["pipe"]
    stats = pipe.stats.as_dict()
    assert stats["steps"] == result["steps"] == 23  # ceil(1438 / 64)
    assert 0.0 <= stats["overlap"] <= 1.0
    took = stats["took_seconds"]
    assert set(took) == set(COMM_PHASES)
    assert took["push"] > 0 and took["pull"] > 0
    if separate:  # values and gradients went through the device copies
        assert took["h2d"] > 0 and took["d2h"] > 0
    if mode == "async":
        assert result["staleness"] == 0  # push_pull brings this worker's own update back


def test_prefetch_overlaps_the_pull_with_one_more_step_of_staleness(procs: Reaper) -> None:
    result = run(procs, "async", Device("cpu", emulate=True), prefetch=True, epochs=4)
    pipe: StepPipeline = result["pipe"]
    assert pipe.prefetch and not pipe.push_pull
    # the values of step t+1 were pulled before step t's push: the PS measures it
    assert result["staleness"] == 1
    stats = pipe.stats.as_dict()
    assert stats["steps"] == 4 * 23
    # one blocking pull (the first step); every later one travelled during a step
    assert stats["took_seconds"]["pull"] > stats["waited_seconds"]["pull"]
    data = JOB.load("test")
    model = JOB.build_model(data)
    accuracy = model.evaluate(result["values"], data.x, data.y)["accuracy"]
    # it learns (chance is 0.1), if more slowly per step than with fresh values (0.81 after
    # these 92 steps): one step of delay meets momentum 0.9
    assert accuracy > 0.35, accuracy
