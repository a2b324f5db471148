"""Where a worker computes: the host (numpy) or a CUDA GPU (cupy).

Layer map (depends on numpy, and on cupy only when a CUDA device is used)::

    (here)   Device, DeviceError, array_module, to_numpy, cupy_available, parse_devices
    staging  Copy, CopyStream, Mirror: pinned host buffers <-> device arrays (per tower)
    towers   Towers: one step computed on K devices, gradients averaged on the first

Rules of this package:

* It is the only place in zmqps that imports cupy, and only when a CUDA device is
  asked for: ``import zmqps`` and every CPU path work without cupy installed.
* Every API has the same shapes on numpy. ``Device("cpu")`` computes on the host
  arrays themselves (no copies); ``Device("cpu", emulate=True)`` keeps "device"
  arrays apart from the host buffers and copies between them exactly where a GPU
  would, so the staging and overlap code runs (and is tested) without a GPU.
* Models get their array module from :func:`array_module` of their inputs, so one
  code path runs on numpy and on cupy.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "Device",
    "DeviceError",
    "array_module",
    "choose_devices",
    "cuda_device_count",
    "cupy_available",
    "is_device_array",
    "parse_devices",
    "to_numpy",
]

_SPEC = re.compile(r"^(cpu|cuda)(?::(\d+))?$")
_cupy: ModuleType | None = None


class DeviceError(ValueError):
    """A device that cannot be used: a bad spec, cupy missing, no such GPU."""


def _import_cupy() -> ModuleType:
    global _cupy
    if _cupy is None:
        try:
            _cupy = importlib.import_module("cupy")
        except ImportError as exc:
            raise DeviceError(
                "a CUDA device needs cupy: pip install 'zmqps[gpu]' (cupy-cuda12x, CUDA 12.x;"
                " for CUDA 13 pip install cupy-cuda13x)"
                f" ({exc})"
            ) from None
    return _cupy


def cupy_available() -> bool:
    """True if cupy imports and sees at least one CUDA device."""
    return cuda_device_count() > 0


def cuda_device_count() -> int:
    """How many CUDA devices cupy sees (0 without cupy or a driver)."""
    try:
        return int(_import_cupy().cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver: cupy raises its own CUDA errors
        return 0


def is_device_array(a: Any) -> bool:
    """True for a cupy array (checked without importing cupy)."""
    return type(a).__module__.startswith("cupy")


def array_module(*arrays: Any) -> ModuleType:
    """numpy, or cupy if any of ``arrays`` is a cupy array (like ``cupy.get_array_module``)."""
    if any(is_device_array(a) for a in arrays):
        return _import_cupy()
    return np


def to_numpy(a: Any) -> npt.NDArray[Any]:
    """A numpy array of ``a`` (copied to the host if it is on a GPU; else as is)."""
    if is_device_array(a):
        host: npt.NDArray[Any] = a.get()
        return host
    return np.asarray(a)


@dataclass(frozen=True)
class Device:
    """A compute device: ``cpu``, or ``cuda`` with a GPU index."""

    kind: str = "cpu"
    index: int = 0
    #: cpu only: keep device arrays apart from host buffers (copies where a GPU copies)
    emulate: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "cuda"):
            raise DeviceError(f"unknown device kind {self.kind!r}; expected cpu or cuda[:N]")
        if self.index < 0:
            raise DeviceError(f"device index must be >= 0, got {self.index}")
        if self.emulate and self.kind != "cpu":
            raise DeviceError("emulate applies to the cpu device only")

    @classmethod
    def parse(cls, spec: str | Device | None) -> Device:
        """``"cpu"``, ``"cuda"`` (GPU 0) or ``"cuda:N"``; None means cpu."""
        if spec is None:
            return cls()
        if isinstance(spec, Device):
            return spec
        m = _SPEC.match(spec.strip().lower())
        if m is None:
            raise DeviceError(f"bad device {spec!r}; expected cpu, cuda or cuda:N")
        return cls(m.group(1), int(m.group(2) or 0))

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def separate(self) -> bool:
        """True if device arrays are not the host buffers (a GPU, or emulation)."""
        return self.is_cuda or self.emulate

    @property
    def xp(self) -> ModuleType:
        """The array module computing on this device (numpy or cupy)."""
        return _import_cupy() if self.is_cuda else np

    def check(self) -> Device:
        """Fail now, with a clear error, if this device cannot be used; returns self."""
        if self.is_cuda:
            cp = _import_cupy()
            try:
                count = int(cp.cuda.runtime.getDeviceCount())
            except Exception as exc:
                raise DeviceError(f"{self}: CUDA is not usable here ({exc})") from None
            if self.index >= count:
                raise DeviceError(f"{self}: this machine has {count} CUDA device(s)")
        return self

    def use(self) -> Any:
        """Make this device current (a cupy Device context; a no-op on cpu)."""
        if self.is_cuda:
            return self.xp.cuda.Device(self.index).use()
        return None

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """This device is the current one inside (cupy's current device is per thread)."""
        if self.is_cuda:
            with self.xp.cuda.Device(self.index):
                yield
        else:
            yield

    def asarray(self, a: Any, dtype: Any = None) -> Any:
        """``a`` on this device (a copy for host data on a GPU)."""
        if self.is_cuda:
            with self.xp.cuda.Device(self.index):
                return self.xp.asarray(a, dtype=dtype)
        arr = np.asarray(to_numpy(a), dtype=dtype)
        return arr.copy() if self.emulate else arr

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        if self.is_cuda:
            with self.xp.cuda.Device(self.index):
                return self.xp.empty(shape, dtype=dtype)
        return np.empty(shape, dtype=dtype)

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> Any:
        if self.is_cuda:
            with self.xp.cuda.Device(self.index):
                return self.xp.zeros(shape, dtype=dtype)
        return np.zeros(shape, dtype=dtype)

    def pinned_empty(self, shape: tuple[int, ...], dtype: Any) -> npt.NDArray[Any]:
        """A host array in page-locked memory on a GPU (copies to and from it can be
        asynchronous); an ordinary numpy array on cpu."""
        if not self.is_cuda:
            return np.empty(shape, dtype=dtype)
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        mem = self.xp.cuda.alloc_pinned_memory(max(1, count * dt.itemsize))
        return np.frombuffer(mem, dt, count).reshape(shape)

    def from_dlpack(self, obj: Any) -> Any:
        """An array of this device's module viewing ``obj`` (a torch / JAX tensor on
        this device), with no copy (DLPack)."""
        if self.is_cuda:
            with self.xp.cuda.Device(self.index):
                return self.xp.from_dlpack(obj)
        return np.from_dlpack(obj)

    def synchronize(self) -> None:
        """Wait for all work queued on this device."""
        if self.is_cuda:
            with self.xp.cuda.Device(self.index):
                self.xp.cuda.runtime.deviceSynchronize()


def parse_devices(specs: str | Device | Sequence[str | Device] | None) -> list[Device]:
    """Devices from ``"cuda:0,cuda:1"``, a list of specs or Devices, or one spec; None
    or an empty spec means ``[cpu]``. A device may repeat (towers sharing one GPU)."""
    if specs is None:
        return [Device()]
    if isinstance(specs, Device):
        return [specs]
    items = specs.split(",") if isinstance(specs, str) else list(specs)
    out = [Device.parse(s) for s in items if not (isinstance(s, str) and not s.strip())]
    if not out:
        return [Device()]
    if len({d.emulate for d in out}) > 1 or len({d.is_cuda for d in out}) > 1:
        raise DeviceError(
            "the devices of one worker are all CUDA GPUs or all the host,"
            f" got {', '.join(str(d) for d in out)}"
        )
    return out


def choose_devices(
    device: str | Device | None, devices: str | Sequence[str | Device] | None
) -> list[Device]:
    """A worker's devices: ``devices`` (towers) or the one ``device`` (None: cpu);
    :class:`DeviceError` if both are given and ``device`` is not the first of them."""
    if devices is None:
        return [Device.parse(device)]
    out = parse_devices(devices)
    if device is not None and Device.parse(device) != out[0]:
        raise DeviceError(
            f"device {device} and devices {', '.join(map(str, out))} disagree:"
            " give one of them (the first of devices is the worker's device)"
        )
    return out
