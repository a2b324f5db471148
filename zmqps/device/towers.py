"""Towers: one worker's step computed on several devices, as one replica with a
K-times batch (the multi-GPU pattern of in-graph replication).

    towers = Towers([Device("cuda", 0), Device("cuda", 1)])
    loss, grads = towers.loss_and_grads(
        model.loss_and_grads, mirror.towers(slot), x, y, on_ready=pipe.grads_ready
    )

Rules of this module:

* The batch is cut into one contiguous slice per tower, as even as can be (sizes
  differ by at most one); a tower whose slice is empty sits the step out.
* Each tower computes on its own device's copy of the parameters, in a thread of its
  own (cupy's current device is per thread, and a GPU runs one tower's kernels while
  the host launches the next one's). One tower computes in the calling thread, on
  the arrays it is given, with nothing in between: the single-device path is the
  path of a worker without towers.
* A variable's gradient is the mean of the towers' gradients weighted by their
  examples: the gradient of the whole batch, within float rounding (a model's loss
  is a mean over examples). It is summed on the first device in tower order (the
  same result whatever thread finishes first), as soon as every tower has handed
  that variable over (``on_ready``), so its push can leave while earlier layers
  still compute. The loss is the same weighted mean.
* On a GPU, a tower's gradients are read after an event recorded on its stream when
  it handed them over: the sum waits for that tower's kernels, not the host. A
  gradient on another GPU is copied to the first one (peer to peer where the GPUs
  allow it).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from zmqps.device import Device, DeviceError

__all__ = ["LossAndGrads", "Towers"]

#: A model's ``loss_and_grads(params, x, y, *, on_ready=None) -> (loss, grads)``.
LossAndGrads = Callable[..., tuple[float, dict[str, Any]]]
GradsReady = Callable[[dict[str, Any]], None]


class Towers:
    """The devices one worker computes a step on; the first one holds the result."""

    def __init__(self, devices: Sequence[Device]) -> None:
        if not devices:
            raise DeviceError("towers need at least one device")
        self.devices = list(devices)
        self.first = self.devices[0]
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(len(self.devices), "zmqps-tower")
            if len(self.devices) > 1
            else None
        )

    def __len__(self) -> int:
        return len(self.devices)

    def __repr__(self) -> str:
        return f"Towers({', '.join(str(d) for d in self.devices)})"

    def describe(self, batch: int) -> str:
        """``cuda:0`` or ``2 towers (cuda:0, cuda:1), 64 examples each``."""
        if len(self.devices) == 1:
            return str(self.first)
        names = ", ".join(str(d) for d in self.devices)
        return f"{len(self.devices)} towers ({names}), {batch} examples each"

    @staticmethod
    def slices(n: int, k: int) -> list[slice]:
        """``n`` examples cut into ``k`` contiguous slices, sizes differing by at most one."""
        base, extra = divmod(n, k)
        out, start = [], 0
        for i in range(k):
            size = base + (1 if i < extra else 0)
            out.append(slice(start, start + size))
            start += size
        return out

    def loss_and_grads(
        self,
        fn: LossAndGrads,
        params: Sequence[Mapping[str, Any]],
        x: Any,
        y: Any,
        *,
        on_ready: GradsReady | None = None,
    ) -> tuple[float, dict[str, Any]]:
        """The loss and gradients of the batch ``(x, y)`` (host or device arrays), each
        tower computing ``fn`` on its slice with its own ``params``; gradients on the
        first device, each handed to ``on_ready`` once all towers have it."""
        if len(params) != len(self.devices):
            raise ValueError(f"{len(params)} parameter sets for {len(self.devices)} towers")
        if self._pool is None:
            first = self.first
            return fn(params[0], first.asarray(x), first.asarray(y), on_ready=on_ready)
        n = len(x)
        if n == 0:
            raise ValueError("an empty batch has no gradient")
        work = [(k, s) for k, s in enumerate(self.slices(n, len(self.devices))) if s.stop > s.start]
        reducer = _Reducer(self.first, {k: (s.stop - s.start) / n for k, s in work}, on_ready)
        futures = [
            self._pool.submit(self._tower, k, fn, params[k], x[s], y[s], reducer) for k, s in work
        ]
        concurrent.futures.wait(futures)
        loss = 0.0
        for (k, _), fut in zip(work, futures, strict=True):
            loss += reducer.weights[k] * fut.result()  # raises a tower's error
        return loss, reducer.result()

    def _tower(
        self, k: int, fn: LossAndGrads, params: Mapping[str, Any], x: Any, y: Any, red: _Reducer
    ) -> float:
        device = self.devices[k]
        with device.context():
            loss, grads = fn(
                params,
                device.asarray(x),
                device.asarray(y),
                on_ready=lambda g: red.give(k, device, g),
            )
            red.give(k, device, grads, final=True)  # those not handed over already
        return float(loss)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class _Reducer:
    """Gradients of one step's towers, averaged per variable once every tower has it."""

    def __init__(
        self, first: Device, weights: dict[int, float], on_ready: GradsReady | None
    ) -> None:
        self.first = first
        self.weights = weights
        self.on_ready = on_ready
        self._parts: dict[str, dict[int, tuple[Any, Any]]] = {}
        self._done: dict[str, Any] = {}
        self._order: list[str] = []  # as the first tower to finish returns them
        self._lock = threading.Lock()

    def give(
        self, k: int, device: Device, grads: Mapping[str, Any], *, final: bool = False
    ) -> None:
        """Tower ``k`` hands over ``grads`` (computed on ``device``, this thread's);
        ``final``: all of them, in the model's order."""
        event = device.xp.cuda.get_current_stream().record() if device.is_cuda else None
        with self._lock:
            if final and not self._order:
                self._order = list(grads)
            ready: dict[str, Any] = {}
            for name, g in grads.items():
                if name in self._done:
                    continue
                parts = self._parts.setdefault(name, {})
                if k in parts:
                    continue
                parts[k] = (g, event)
                if len(parts) == len(self.weights):
                    ready[name] = self._done[name] = self._mean(self._parts.pop(name))
            if ready and self.on_ready is not None:
                self.on_ready(ready)

    def _mean(self, parts: dict[int, tuple[Any, Any]]) -> Any:
        first = self.first
        with first.context():
            acc = None
            for k in sorted(parts):
                g, event = parts[k]
                if event is not None:
                    first.xp.cuda.get_current_stream().wait_event(event)
                    if g.device.id != first.index:
                        g = g.copy()  # cupy copies to the current device
                term = g * self.weights[k]
                if acc is None:
                    acc = term
                else:
                    acc += term
            return acc

    def result(self) -> dict[str, Any]:
        if self._parts:
            missing = ", ".join(sorted(self._parts))
            raise RuntimeError(f"towers returned different variables (not all: {missing})")
        return {name: self._done[name] for name in self._order}
