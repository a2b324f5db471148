"""The device layer on numpy: specs, array modules, and the staging a GPU would do.

``Device("cpu", emulate=True)`` keeps device arrays apart from host buffers and
copies where a GPU copies, so these tests run the staging code without a GPU.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import pytest
from helpers import DEVICE_KINDS, device_of

from zmqps.core.variables import VariableDef
from zmqps.device import Device, DeviceError, array_module, is_device_array, to_numpy
from zmqps.device.staging import Mirror
from zmqps.models import build_model

VARS = [VariableDef("w", (3, 4)), VariableDef("b", (4,)), VariableDef("h", (2,), dtype="float64")]


@pytest.mark.parametrize(
    ("spec", "kind", "index"),
    [("cpu", "cpu", 0), ("cuda", "cuda", 0), ("cuda:3", "cuda", 3), (" CUDA:1 ", "cuda", 1)],
)
def test_parse(spec: str, kind: str, index: int) -> None:
    d = Device.parse(spec)
    assert (d.kind, d.index) == (kind, index)
    assert str(d) == ("cpu" if kind == "cpu" else f"cuda:{index}")
    assert Device.parse(d) is d
    assert Device.parse(None) == Device()


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:-1", "cpu:x", "", "cuda:1:2"])
def test_parse_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(DeviceError, match="bad device"):
        Device.parse(spec)


def test_bad_fields() -> None:
    with pytest.raises(DeviceError, match="unknown device kind"):
        Device("tpu")
    with pytest.raises(DeviceError, match=">= 0"):
        Device("cuda", -1)
    with pytest.raises(DeviceError, match="cpu device only"):
        Device("cuda", 0, emulate=True)


def test_cuda_without_cupy_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import zmqps.device as dev

    monkeypatch.setattr(dev, "_cupy", None)
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    with pytest.raises(DeviceError, match=r"pip install 'zmqps\[gpu\]'"):
        Device.parse("cuda:0").check()
    assert dev.cupy_available() is False


def test_cpu_arrays_and_modules() -> None:
    cpu = Device()
    assert cpu.xp is np and not cpu.separate and not cpu.is_cuda
    a = np.arange(6, dtype=np.float32)
    assert cpu.asarray(a) is a  # the host arrays themselves: no copy
    assert array_module(a, 1.0) is np
    assert not is_device_array(a)
    assert to_numpy(a) is a
    pinned = cpu.pinned_empty((2, 3), np.float32)
    assert pinned.shape == (2, 3) and pinned.dtype == np.float32
    assert cpu.check() is cpu
    cpu.synchronize()  # a no-op on the host
    assert cpu.use() is None


@pytest.mark.parametrize("kind", [p for p in DEVICE_KINDS if p.values[0] == "cuda"])
def test_a_gpu_device_copies_on_streams_and_shares_through_dlpack(kind: str) -> None:
    """The real thing (``pytest -m gpu``): cupy arrays, page-locked landing buffers,
    copies on a stream of their own timed by events, DLPack views of torch tensors."""
    gpu = device_of(kind).check()
    cp = gpu.xp
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    d = gpu.asarray(a)
    assert is_device_array(d) and array_module(d) is cp and d.device.id == gpu.index
    np.testing.assert_array_equal(to_numpy(d), a)
    pinned = gpu.pinned_empty((3, 4), np.float32)
    assert cp.cuda.runtime.pointerGetAttributes(pinned.ctypes.data).type == 1  # host, pinned
    with pytest.raises(DeviceError, match="CUDA device"):
        Device("cuda", cp.cuda.runtime.getDeviceCount()).check()

    m = Mirror(gpu, VARS, slots=2, replicas=[gpu])
    m.host[1]["w"][...] = 4.0
    copy = m.upload(1)
    copy.before_compute()  # the compute stream waits for it, not the host
    doubled = m.towers(1)[1]["w"] * 2  # queued after the copy on the compute stream
    assert float(doubled.sum()) == 8.0 * 12
    assert copy.done and copy.seconds() > 0.0
    g = {"w": cp.full((3, 4), 0.25, cp.float32), "b": cp.ones(4, cp.float32)}
    host, down = m.download(g)
    asyncio.run(down.wait_async())
    assert host["w"] is m.grads["w"] and (host["w"] == 0.25).all() and (host["b"] == 1).all()

    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.float32, device=f"cuda:{gpu.index}")
    view = gpu.from_dlpack(t)
    t += 1  # the same memory
    gpu.synchronize()
    np.testing.assert_array_equal(to_numpy(view), np.arange(1, 7, dtype=np.float32))


def test_emulated_device_copies() -> None:
    emu = Device("cpu", emulate=True)
    assert emu.separate and emu.xp is np
    a = np.arange(6, dtype=np.float32)
    b = emu.asarray(a)
    assert b is not a and np.array_equal(a, b)
    assert emu.asarray(a, dtype=np.float64).dtype == np.float64


@pytest.mark.parametrize("emulate", [False, True])
def test_mirror_upload_and_download(emulate: bool) -> None:
    device = Device("cpu", emulate=emulate)
    m = Mirror(device, VARS, slots=2)
    for slot in (0, 1):
        for v in VARS:
            host, dev = m.host[slot][v.name], m.dev[slot][v.name]
            assert host.shape == dev.shape == v.shape and host.dtype == np.dtype(v.dtype)
            assert (host is dev) is not emulate
            assert not host.any()
    # the two slots never share memory: the next step's values land beside this one's
    assert not np.shares_memory(m.host[0]["w"], m.host[1]["w"])
    m.host[1]["w"][...] = 7.0
    m.host[1]["b"][...] = 3.0
    copy = m.upload(1, ["w"])
    assert copy.done
    copy.wait()
    asyncio.run(copy.wait_async())
    assert copy.seconds() >= 0.0
    copy.before_compute()
    assert (m.dev[1]["w"] == 7.0).all()
    # only the named variables were uploaded
    assert (m.dev[1]["b"] == 3.0).all() is not emulate
    assert not m.dev[0]["w"].any()

    g = {"w": np.full((3, 4), 0.5, np.float32), "b": np.ones(4, np.float32)}
    host, copy = m.download(g)
    copy.wait()
    assert set(host) == {"w", "b"}
    for name in g:
        assert np.array_equal(host[name], g[name])
        # emulated: the gradients travel in the mirror's own (pinned) buffers
        assert (host[name] is m.grads.get(name)) is emulate
        assert (host[name] is g[name]) is not emulate


def test_mirror_download_checks_shapes_and_sparse() -> None:
    m = Mirror(Device("cpu", emulate=True), VARS)
    with pytest.raises(ValueError, match="gradient for w"):
        m.download({"w": np.zeros((4, 3), np.float32)})
    with pytest.raises(DeviceError, match="dense"):
        Mirror(Device(), [VariableDef("e", (10, 2), sparse=True)])
    with pytest.raises(ValueError, match="at least one slot"):
        Mirror(Device(), VARS, slots=0)


@pytest.mark.parametrize("name", ["mlp", "softmax"])
def test_models_hand_over_each_finished_gradient_once(name: str) -> None:
    options = {"hidden": (16, 8), "l2": 0.01} if name == "mlp" else {}
    model = build_model(name, 12, 5, seed=3, **options)
    rng = np.random.default_rng(0)
    params = {v.name: rng.normal(size=v.shape).astype(np.float32) * 0.3 for v in model.variables()}
    x = rng.normal(size=(9, 12)).astype(np.float32)
    y = rng.integers(0, 5, size=9)
    plain_loss, plain = model.loss_and_grads(params, x, y)
    handed: list[dict[str, np.ndarray]] = []
    snapshots: list[dict[str, np.ndarray]] = []

    def on_ready(grads: dict[str, np.ndarray]) -> None:
        handed.append(grads)
        snapshots.append({k: v.copy() for k, v in grads.items()})

    loss, grads = model.loss_and_grads(params, x, y, on_ready=on_ready)
    assert loss == plain_loss
    names = [n for group in handed for n in group]
    assert sorted(names) == sorted(grads) and len(names) == len(set(names))
    for group, snap in zip(handed, snapshots, strict=True):
        for n, g in group.items():
            assert g is grads[n]  # the very array returned ...
            assert np.array_equal(snap[n], grads[n])  # ... never modified after hand-over
            assert np.array_equal(grads[n], plain[n])
    if name == "mlp":
        # output layer first, then back through the hidden layers
        assert [sorted(g) for g in handed] == [
            ["mlp/out/b", "mlp/out/w"],
            ["mlp/dense_1/b", "mlp/dense_1/w"],
            ["mlp/dense_0/b", "mlp/dense_0/w"],
        ]
