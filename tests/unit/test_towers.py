"""Towers (zmqps.device.towers): K devices computing one step as one replica.

The oracle: K towers, each on its slice of a batch, give the gradient (and loss) of
one device computing the whole batch, within float rounding, for every model, with
even and uneven slices, on the host, on emulated devices, and on a GPU used K times
where there is one (``pytest -m gpu``). Every gradient reaches ``on_ready`` exactly
once, already averaged.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from helpers import DEVICE_KINDS, device_of

from zmqps.cli.args import worker_devices
from zmqps.core.variables import VariableDef
from zmqps.data import shard, steps_per_epoch
from zmqps.device import Device, DeviceError, parse_devices, to_numpy
from zmqps.device.staging import Copy, Mirror
from zmqps.device.towers import Towers
from zmqps.models import build_model
from zmqps.roles.job import JobConfig
from zmqps.wire.errors import ConfigError


def _problem(name: str, n: int, seed: int = 0) -> tuple[Any, dict[str, np.ndarray], Any, Any]:
    options: dict[str, Any] = {"hidden": (32, 16), "l2": 0.01} if name == "mlp" else {}
    model = build_model(name, 20, 7, seed=3, **options)
    rng = np.random.default_rng(seed)
    params = {v.name: rng.normal(size=v.shape).astype(np.float32) * 0.3 for v in model.variables()}
    x = rng.normal(size=(n, 20)).astype(np.float32)
    y = rng.integers(0, 7, size=n)
    return model, params, x, y


def _on(devices: list[Device], params: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """Each tower's own copy of ``params`` on its device."""
    out = []
    for d in devices:
        with d.context():
            out.append({k: d.asarray(v) for k, v in params.items()})
    return out


@pytest.mark.parametrize("kind", DEVICE_KINDS)
@pytest.mark.parametrize("name", ["mlp", "softmax"])
@pytest.mark.parametrize(("k", "n"), [(2, 64), (3, 64), (4, 5), (4, 3)])
def test_k_towers_give_the_gradient_of_the_whole_batch(
    kind: str, name: str, k: int, n: int
) -> None:
    model, params, x, y = _problem(name, n)
    one = device_of(kind)
    with one.context():
        ref_loss, ref = model.loss_and_grads(_on([one], params)[0], one.asarray(x), one.asarray(y))
    devices = [device_of(kind)] * k
    towers = Towers(devices)
    handed: list[dict[str, Any]] = []
    try:
        loss, grads = towers.loss_and_grads(
            model.loss_and_grads,
            _on(devices, params),
            x,
            y,
            on_ready=lambda g: handed.append({k: to_numpy(v).copy() for k, v in g.items()}),
        )
    finally:
        towers.close()
    assert list(grads) == list(ref)  # the model's order
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name_, g in grads.items():
        np.testing.assert_allclose(
            to_numpy(g), to_numpy(ref[name_]), rtol=1e-4, atol=1e-6, err_msg=name_
        )
    # every gradient handed over once, already averaged (what the push sends)
    seen = [name_ for part in handed for name_ in part]
    assert sorted(seen) == sorted(grads)
    for part in handed:
        for name_, g in part.items():
            np.testing.assert_array_equal(g, to_numpy(grads[name_]))


def test_one_tower_is_the_plain_call_in_this_thread() -> None:
    model, params, x, y = _problem("mlp", 16)
    towers = Towers([Device()])
    threads: list[str] = []

    def fn(p: Any, xx: Any, yy: Any, *, on_ready: Any = None) -> Any:
        threads.append(threading.current_thread().name)
        assert p is params
        return model.loss_and_grads(p, xx, yy, on_ready=on_ready)

    loss, grads = towers.loss_and_grads(fn, [params], x, y)
    ref_loss, ref = model.loss_and_grads(params, x, y)
    assert threads == [threading.current_thread().name]
    assert loss == ref_loss
    for name, g in ref.items():
        np.testing.assert_array_equal(grads[name], g)


def test_towers_run_side_by_side_on_their_own_slices() -> None:
    towers = Towers([Device("cpu", emulate=True)] * 3)
    barrier = threading.Barrier(3, timeout=10)  # each tower waits for the others
    seen: dict[int, list[float]] = {}

    def fn(p: Any, x: Any, y: Any, *, on_ready: Any = None) -> Any:
        barrier.wait()
        seen[int(p["id"][0])] = [float(v) for v in x[:, 0]]
        g = {"w": np.full(2, float(x.sum()), np.float32)}
        if on_ready is not None:
            on_ready(g)
        return float(len(x)), g

    params = [{"id": np.array([i], np.float32)} for i in range(3)]
    x = np.arange(7, dtype=np.float32).reshape(7, 1)
    loss, grads = towers.loss_and_grads(fn, params, x, np.zeros(7))
    towers.close()
    assert seen == {0: [0.0, 1.0, 2.0], 1: [3.0, 4.0], 2: [5.0, 6.0]}
    # weighted by examples: (3*3 + 2*7 + 2*11) / 7 for the gradient, (3*3 + 2*2 + 2*2) / 7
    assert grads["w"].tolist() == pytest.approx([45 / 7] * 2)
    assert loss == pytest.approx(17 / 7)


def test_a_tower_with_no_examples_sits_the_step_out() -> None:
    towers = Towers([Device()] * 4)
    calls: list[int] = []

    def fn(p: Any, x: Any, y: Any, *, on_ready: Any = None) -> Any:
        calls.append(len(x))
        return float(x.mean()), {"w": x.mean(axis=0)}

    loss, grads = towers.loss_and_grads(fn, [{}] * 4, np.ones((2, 3)), np.zeros(2))
    towers.close()
    assert sorted(calls) == [1, 1]
    assert loss == 1.0 and grads["w"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="empty batch"):
        Towers([Device()] * 2).loss_and_grads(fn, [{}] * 2, np.ones((0, 3)), np.zeros(0))


def test_a_tower_error_is_raised_after_every_tower_ended() -> None:
    towers = Towers([Device()] * 3)
    finished: list[int] = []

    def fn(p: Any, x: Any, y: Any, *, on_ready: Any = None) -> Any:
        if p["k"] == 1:
            raise FloatingPointError("tower 1 broke")
        finished.append(p["k"])
        return 0.0, {"w": np.zeros(1)}

    with pytest.raises(FloatingPointError, match="tower 1"):
        towers.loss_and_grads(fn, [{"k": i} for i in range(3)], np.ones((3, 1)), np.zeros(3))
    towers.close()
    assert sorted(finished) == [0, 2]


def test_towers_returning_different_variables_is_an_error() -> None:
    towers = Towers([Device()] * 2)

    def fn(p: Any, x: Any, y: Any, *, on_ready: Any = None) -> Any:
        return 0.0, {"w": np.zeros(1)} if p["k"] == 0 else {"v": np.zeros(1)}

    with pytest.raises(RuntimeError, match="different variables"):
        towers.loss_and_grads(fn, [{"k": 0}, {"k": 1}], np.ones((2, 1)), np.zeros(2))
    with pytest.raises(ValueError, match="1 parameter sets for 2 towers"):
        towers.loss_and_grads(fn, [{"k": 0}], np.ones((2, 1)), np.zeros(2))
    towers.close()
    with pytest.raises(DeviceError, match="at least one"):
        Towers([])


@pytest.mark.parametrize(("n", "k"), [(10, 3), (2, 4), (0, 2), (8, 8), (9, 1)])
def test_slices_cover_the_batch_evenly(n: int, k: int) -> None:
    slices = Towers.slices(n, k)
    assert len(slices) == k
    sizes = [s.stop - s.start for s in slices]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert [s.start for s in slices] == [sum(sizes[:i]) for i in range(k)]


@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_a_mirror_fills_every_towers_arrays_from_one_landing(kind: str) -> None:
    devices = [device_of(kind)] * 3
    variables = [VariableDef("w", (3, 4)), VariableDef("b", (4,))]
    m = Mirror(devices[0], variables, slots=2, replicas=devices[1:])
    towers = m.towers(1)
    assert len(towers) == 3 and towers[0] is m.dev[1]
    separate = devices[0].separate
    # a separate device keeps one array per tower; the host shares its buffers
    assert (towers[1]["w"] is towers[2]["w"]) is not separate
    m.host[1]["w"][...] = 2.5
    m.host[1]["b"][...] = 1.0
    copy = m.upload(1, ["w"])
    copy.wait()
    copy.before_compute()
    assert copy.done and copy.seconds() >= 0.0
    assert len(copy.parts) == 3  # one copy per tower's device
    for arrays in towers:
        assert (to_numpy(arrays["w"]) == 2.5).all()
        # only the named variable travelled
        assert bool((to_numpy(arrays["b"]) == 1.0).all()) is not separate
    assert not to_numpy(m.towers(0)[2]["w"]).any()


def test_copy_all_of_one_is_that_copy() -> None:
    one = Copy(seconds=0.25)
    assert Copy.all([one]) is one
    both = Copy.all([one, Copy(seconds=0.5)])
    assert both.done and both.seconds() == 0.5


def test_parse_devices() -> None:
    assert parse_devices(None) == [Device()]
    assert parse_devices("") == [Device()]
    assert parse_devices("cuda:0,cuda:1, cuda:0") == [
        Device("cuda", 0),
        Device("cuda", 1),
        Device("cuda", 0),
    ]
    assert parse_devices(["cpu", Device()]) == [Device(), Device()]
    with pytest.raises(DeviceError, match="all CUDA GPUs or all the host"):
        parse_devices("cuda:0,cpu")
    with pytest.raises(DeviceError, match="bad device"):
        parse_devices("cuda:0,gpu1")


def test_launch_spreads_workers_and_towers_over_the_visible_gpus() -> None:
    # cuda: worker i on GPUs i*K .. i*K+K-1, wrapping around those there are
    assert [worker_devices("cuda", 1, i, 4) for i in range(5)] == [
        "cuda:0",
        "cuda:1",
        "cuda:2",
        "cuda:3",
        "cuda:0",
    ]
    assert [worker_devices("cuda", 2, i, 4) for i in range(3)] == [
        "cuda:0,cuda:1",
        "cuda:2,cuda:3",
        "cuda:0,cuda:1",
    ]
    assert worker_devices("cuda", 3, 0, 1) == "cuda:0,cuda:0,cuda:0"  # one GPU, three towers
    assert worker_devices("cuda:1", 2, 5, 4) == "cuda:1,cuda:1"  # pinned to one GPU
    assert worker_devices("cpu", 1, 3, 0) == "cpu"
    with pytest.raises(ConfigError, match="needs --device cuda"):
        worker_devices("cpu", 2, 0, 0)
    with pytest.raises(ConfigError, match=">= 1"):
        worker_devices("cuda", 0, 0, 1)


def test_a_towers_step_takes_batch_size_per_tower() -> None:
    job = JobConfig(model="mlp", batch_size=64, epochs=2)
    n = len(shard(job.load("train"), 0, 2))
    assert job.planned_steps(0, 2) == steps_per_epoch(n, 64) * 2
    assert job.planned_steps(0, 2, towers=2) == steps_per_epoch(n, 128) * 2
    job.check_towers(4)
    with pytest.raises(ConfigError, match="ctr program computes on the host"):
        JobConfig(model="ctr", dataset="synthetic-ctr").check_towers(2)
