"""Host <-> device staging: pinned landing buffers, device copies, a copy stream.

Rules of this module:

* Pulled values land in host buffers (page-locked on a GPU) and are copied to the
  device on a copy stream of their own, so a copy runs while the compute stream
  works; the compute stream waits on the copy's event, the host does not.
* Gradients are copied device -> pinned host on the copy stream after the compute
  stream has produced them; the wire sends the pinned buffers (zero-copy).
* Parameters are double-buffered (two slots): the next step's values are uploaded
  into one slot while the current step computes on the other.
* Towers (several devices of one worker, :mod:`zmqps.device.towers`): a slot's host
  buffers are filled once and copied to every tower's device, each on that device's
  copy stream; the gradients to send are those of the first device.
* On ``Device("cpu")`` a slot's device arrays are its host buffers (nothing is
  copied, for every tower); with ``emulate=True`` they are separate numpy arrays and every copy
  happens (synchronously) where a GPU would copy, with the same shapes and calls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.core.variables import VariableDef
from zmqps.device import Device, DeviceError, is_device_array

__all__ = ["Copy", "CopyStream", "Mirror"]

Array = npt.NDArray[Any]


class Copy:
    """A queued copy: ``done`` / ``wait()`` / ``wait_async()``, and how long it took.
    A copy to several towers' devices is one :class:`Copy` with ``parts``."""

    def __init__(
        self,
        event: Any = None,
        start: Any = None,
        seconds: float = 0.0,
        device: int = 0,
        parts: Sequence[Copy] = (),
    ) -> None:
        self._event = event  # a cupy Event, or None for a finished host copy
        self._start = start
        self._seconds = seconds
        self._device = device  # the GPU whose streams the events are on
        self.parts = tuple(parts)

    @classmethod
    def all(cls, copies: Sequence[Copy]) -> Copy:
        """One copy made of ``copies`` (one per tower): done when all are."""
        return copies[0] if len(copies) == 1 else cls(parts=copies)

    @property
    def done(self) -> bool:
        if self.parts:
            return all(p.done for p in self.parts)
        return self._event is None or bool(self._event.done)

    def wait(self) -> None:
        """Block the host until the copy has finished."""
        for p in self.parts:
            p.wait()
        if self._event is not None:
            self._event.synchronize()

    async def wait_async(self, poll: float = 0.0002) -> None:
        """Wait without blocking the event loop."""
        while not self.done:
            await asyncio.sleep(poll)

    def seconds(self) -> float:
        """Time the copy took on its stream (waits for it); of several towers' copies,
        the longest (they run side by side)."""
        if self.parts:
            return max(p.seconds() for p in self.parts)
        if self._event is None:
            return self._seconds
        self._event.synchronize()
        import cupy  # only reached with a CUDA device, where cupy is imported already

        return float(cupy.cuda.get_elapsed_time(self._start, self._event)) / 1000.0

    def before_compute(self) -> None:
        """Make the compute stream of the copy's device (this thread's current stream
        there) wait for this copy, without blocking the host."""
        for p in self.parts:
            p.before_compute()
        if self._event is not None:
            import cupy

            with cupy.cuda.Device(self._device):
                cupy.cuda.get_current_stream().wait_event(self._event)


class CopyStream:
    """Copies between pinned host buffers and device arrays, on a stream of their own."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._stream: Any = None
        if device.is_cuda:
            cp = device.xp
            with cp.cuda.Device(device.index):
                self._stream = cp.cuda.Stream(non_blocking=True)

    def _events(self) -> tuple[Any, Any]:
        cp = self.device.xp
        return cp.cuda.Event(), cp.cuda.Event()

    def h2d(self, pairs: Iterable[tuple[Any, Array]]) -> Copy:
        """Copy each host array into its device array: ``(dst_device, src_host)``."""
        if self._stream is None:
            started = time.perf_counter()
            for dst, src in pairs:
                if dst is not src:
                    np.copyto(dst, src)
            return Copy(seconds=time.perf_counter() - started)
        cp = self.device.xp
        start, end = self._events()
        with cp.cuda.Device(self.device.index):
            start.record(self._stream)
            for dst, src in pairs:
                dst.set(src, stream=self._stream)
            end.record(self._stream)
        return Copy(end, start, device=self.device.index)

    def d2h(self, pairs: Iterable[tuple[Array, Any]]) -> Copy:
        """Copy each device array into its host buffer, ``(dst_host, src_device)``, once
        the compute stream has produced it."""
        if self._stream is None:
            started = time.perf_counter()
            for dst, src in pairs:
                if dst is not src:
                    np.copyto(dst, src, casting="same_kind")
            return Copy(seconds=time.perf_counter() - started)
        cp = self.device.xp
        start, end = self._events()
        with cp.cuda.Device(self.device.index):
            ready = cp.cuda.get_current_stream().record()
            self._stream.wait_event(ready)
            start.record(self._stream)
            for dst, src in pairs:
                src.get(stream=self._stream, out=dst, blocking=False)
            end.record(self._stream)
        return Copy(end, start, device=self.device.index)


class Mirror:
    """Dense variables on a device: ``slots`` pairs of (host landing buffers, device
    arrays), and one set of pinned gradient buffers. With ``replicas`` (the other
    towers' devices), each slot also has arrays on each of them, filled from the
    same host buffers: :meth:`towers`."""

    def __init__(
        self,
        device: Device,
        variables: Sequence[VariableDef],
        slots: int = 2,
        replicas: Sequence[Device] = (),
    ) -> None:
        if slots < 1:
            raise ValueError("a mirror needs at least one slot")
        if any(v.sparse for v in variables):
            raise DeviceError("only dense variables are mirrored on a device")
        self.device = device
        self.variables = {v.name: v for v in variables}
        self.stream = CopyStream(device)
        #: the towers' devices after the first, each with its own copy stream
        self.replicas = [(d, CopyStream(d)) for d in replicas]
        self.host: list[dict[str, Array]] = []
        self.dev: list[dict[str, Any]] = []
        self._replica_dev: list[list[dict[str, Any]]] = []
        for _ in range(slots):
            host = {v.name: device.pinned_empty(v.shape, v.dtype) for v in variables}
            for a in host.values():
                a[...] = 0
            self.host.append(host)
            self.dev.append(self._on(device, host))
            self._replica_dev.append([self._on(d, host) for d, _ in self.replicas])
        self.grads: dict[str, Array] = (
            {v.name: device.pinned_empty(v.shape, v.dtype) for v in variables}
            if device.separate
            else {}
        )

    @staticmethod
    def _on(device: Device, host: dict[str, Array]) -> dict[str, Any]:
        """Device arrays shaped as ``host`` (the host buffers themselves on the cpu)."""
        if not device.separate:
            return host
        return {n: device.zeros(a.shape, a.dtype) for n, a in host.items()}

    def towers(self, slot: int) -> list[dict[str, Any]]:
        """Slot ``slot``'s arrays on every tower's device, the first device's first."""
        return [self.dev[slot], *self._replica_dev[slot]]

    def upload(self, slot: int, names: Iterable[str] | None = None) -> Copy:
        """Queue the copy of slot ``slot``'s host buffers (or ``names``) to its device
        arrays, on every tower's device."""
        host, dev = self.host[slot], self.dev[slot]
        wanted = list(host if names is None else names)
        copies = [self.stream.h2d((dev[n], host[n]) for n in wanted)]
        for (_, stream), arrays in zip(self.replicas, self._replica_dev[slot], strict=True):
            copies.append(stream.h2d((arrays[n], host[n]) for n in wanted))
        return Copy.all(copies)

    def download(self, grads: Mapping[str, Any]) -> tuple[dict[str, Array], Copy]:
        """Queue the copy of device gradients to the pinned gradient buffers; returns the
        host arrays to send (valid once the copy is done). Host gradients pass as is."""
        out: dict[str, Array] = {}
        pairs: list[tuple[Array, Any]] = []
        for name, g in grads.items():
            if self.device.separate and name in self.grads:
                dst = self.grads[name]
                if tuple(g.shape) != dst.shape:
                    raise ValueError(f"gradient for {name}: shape {tuple(g.shape)} != {dst.shape}")
                if is_device_array(g) or self.device.emulate:
                    pairs.append((dst, g))
                    out[name] = dst
                    continue
            out[name] = np.asarray(g)
        return out, self.stream.d2h(pairs)
