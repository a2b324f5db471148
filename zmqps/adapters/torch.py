"""PyTorch modules trained through a zmqps cluster: keep your ``nn.Module``.

Rules of this module:

* Variables are the module's ``named_parameters()`` (names as PyTorch spells them,
  e.g. ``0.weight``, with an optional ``prefix``), same shapes, same float dtype.
* The PS's values are the source of truth. zmqps initializes variables on the PS
  with seeded, sharding-independent initializers (there is no "from values"
  initializer), so the module's own random initial values are *replaced* by the
  first pull. :func:`torch_default_init` picks, per parameter, the initializer that
  draws from PyTorch's default distribution: ``uniform(+-1/sqrt(fan_in))`` for the
  weight and bias of Linear / Conv-like modules (``fan_in`` = product of the weight's
  dims after the first, as PyTorch computes it), ``normal(0, 1)`` for ``Embedding``,
  ``constant`` for a parameter whose elements are all equal (norm layers' ones and
  zeros). Pass ``init=`` to choose others. Every process gets identical values, so
  single-process training started from a pull is an exact reference.
* CPU, zero-copy: a pulled array becomes the parameter's storage
  (``param.data = torch.from_numpy(array)``); later pulls refresh it in place, so the
  module sees new values with no copy. The worker may replace an array (first use of
  the shared-memory path, a restore): each pull checks identity and rebinds. An array
  that cannot be shared (read-only, dtype or layout mismatch) is copied instead.
  Gradients are pushed as ``p.grad.numpy()`` views (no copy), then set to ``None``.
* Other devices go through a :class:`DeviceBridge` registered per device type
  (:func:`register_bridge`). The default copies through host memory. A worker on a
  GPU (``Worker(device="cuda:N")``, :mod:`zmqps.device`) gets :class:`DLPackBridge`
  from :class:`TorchModel`: pulled cupy arrays become the CUDA parameters' storage
  and gradients are handed to the worker as cupy views, both through DLPack with no
  copy; the worker stages them through pinned host buffers.
* The one loop for every mode: :meth:`TorchModel.begin_step` (sync: takes a token,
  then pulls the values of its step; ssp: waits for the bound, then pulls; async:
  pulls only if the last push did not bring values back), forward / backward, then
  :meth:`TorchModel.push` (async: ``push_pull``; sync / ssp: ``push``).
* Towers (``TorchModel(net, worker, devices=["cuda:0", "cuda:1"])``): one replica
  of the module per device, the first being ``net`` itself (moved to the first
  device). A pull lands in ``net`` and is copied to the other replicas.
  :meth:`TorchModel.forward_backward` cuts the batch into one slice per replica,
  runs each replica's forward and backward on its slice (its loss weighted by its
  share of the examples) and sums the gradients into ``net``'s: the gradient of the
  whole batch, pushed once as one worker's step.
* PyTorch is imported only here and only when needed; a missing install raises
  :class:`ImportError` saying what to install.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from zmqps.core.variables import FLOAT_DTYPES, VariableDef
from zmqps.device import Device, is_device_array

if TYPE_CHECKING:
    import torch

__all__ = [
    "DLPackBridge",
    "DeviceBridge",
    "HostCopyBridge",
    "TorchModel",
    "WorkerLike",
    "grads_of",
    "pull_into",
    "push_grads",
    "register_bridge",
    "torch_default_init",
    "variables_of",
]

Array = npt.NDArray[Any]
InitFn = Callable[[str, "torch.nn.Parameter"], Mapping[str, Any] | None]


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "zmqps.adapters.torch needs PyTorch: pip install 'zmqps[torch]' (or torch>=2.1)"
        ) from e
    return torch


class WorkerLike(Protocol):
    """What the adapter uses of :class:`zmqps.Worker`."""

    mode: str

    def create_variables(
        self, variables: Sequence[VariableDef], optimizer: Mapping[str, Any] | None = None
    ) -> Any: ...

    def begin_step(self, poll: float = 10.0) -> int: ...

    def pull(self, names: Iterable[str] | None = None) -> Mapping[str, Array]: ...

    def push(
        self, grads: Mapping[str, Any], *, loss: float | None = None, examples: int | None = None
    ) -> bool: ...

    def push_pull(
        self, grads: Mapping[str, Any], *, loss: float | None = None, examples: int | None = None
    ) -> Mapping[str, Array]: ...


# ------------------------------------------------------------------ devices


class DeviceBridge(Protocol):
    """Moves values between the worker's arrays and tensors on one device type."""

    def to_push(self, grad: torch.Tensor) -> Any:
        """An array the worker can push (numpy, or whatever a device-aware worker takes)."""

    def load(self, param: torch.Tensor, array: Array) -> None:
        """Write the pulled ``array`` into ``param`` (in place)."""


class HostCopyBridge:
    """Through host memory: one device-to-host copy per gradient, one host-to-device
    copy per pulled parameter."""

    def to_push(self, grad: torch.Tensor) -> Any:
        return grad.detach().to("cpu").numpy()

    def load(self, param: torch.Tensor, array: Array) -> None:
        th = _torch()
        param.data.copy_(th.from_numpy(np.ascontiguousarray(array)))


class DLPackBridge:
    """Tensors <-> arrays of a device-aware worker on the same device, with no copy:
    a gradient is handed over as a view (DLPack); a pulled device array becomes the
    parameter's storage (later pulls refresh it in place), or is copied on the device
    if its dtype or layout does not fit."""

    def __init__(self, device: Device) -> None:
        self.device = device

    def to_push(self, grad: torch.Tensor) -> Any:
        g = grad.detach()
        a = self.device.from_dlpack(g if g.is_contiguous() else g.contiguous())
        return a.reshape(1) if a.ndim == 0 else a

    def load(self, param: torch.Tensor, array: Any) -> None:
        th = _torch()
        if not is_device_array(array) and self.device.is_cuda:
            _DEFAULT_BRIDGE.load(param, array)
            return
        t = th.from_dlpack(array)
        if t.device == param.device and t.dtype == param.dtype and t.is_contiguous():
            if param.data.data_ptr() != t.data_ptr():
                param.data = t.view(param.shape)
            return
        param.data.copy_(t.view(param.shape))


_BRIDGES: dict[str, DeviceBridge] = {}
_DEFAULT_BRIDGE = HostCopyBridge()


def register_bridge(device_type: str, bridge: DeviceBridge | None) -> None:
    """Use ``bridge`` for tensors on ``device_type`` (``"cuda"``...); None: the default
    (:class:`HostCopyBridge`)."""
    if bridge is None:
        _BRIDGES.pop(device_type, None)
    else:
        _BRIDGES[device_type] = bridge


def _bridge(device_type: str) -> DeviceBridge:
    return _BRIDGES.get(device_type, _DEFAULT_BRIDGE)


# ------------------------------------------------------------------ variables


def _dtype_name(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in FLOAT_DTYPES:
        raise TypeError(
            f"parameter dtype {t.dtype} is not supported (one of {', '.join(FLOAT_DTYPES)})"
        )
    return name


def _fan_in(shape: Sequence[int]) -> int:
    return math.prod(shape[1:]) if len(shape) > 1 else int(shape[0])


def torch_default_init(
    module: torch.nn.Module, *, seed: int = 0
) -> Callable[[str, torch.nn.Parameter], Mapping[str, Any]]:
    """Initializer configs drawing from PyTorch's default distributions (see the module
    docstring); ``seed`` seeds every random one (zmqps also keys draws on the name)."""
    th = _torch()
    owner_weight: dict[str, tuple[int, ...]] = {}
    embeddings: set[str] = set()
    for mname, sub in module.named_modules():
        own = dict(sub.named_parameters(recurse=False))
        weight = own.get("weight")
        for pname in own:
            full = f"{mname}.{pname}" if mname else pname
            if isinstance(sub, th.nn.Embedding | th.nn.EmbeddingBag):
                embeddings.add(full)
            elif weight is not None and weight.dim() >= 2:
                owner_weight[full] = tuple(weight.shape)

    def init(name: str, param: torch.nn.Parameter) -> Mapping[str, Any]:
        if name in embeddings:
            return {"name": "normal", "mean": 0.0, "stddev": 1.0, "seed": seed}
        if name in owner_weight:
            bound = 1.0 / math.sqrt(max(1, _fan_in(owner_weight[name])))
            return {"name": "uniform", "low": -bound, "high": bound, "seed": seed}
        flat = param.detach().reshape(-1)
        if flat.numel() > 0 and bool((flat == flat[0]).all()):
            return {"name": "constant", "value": float(flat[0])}
        bound = 1.0 / math.sqrt(max(1, _fan_in(tuple(param.shape))))
        return {"name": "uniform", "low": -bound, "high": bound, "seed": seed}

    return init


def variables_of(
    module: torch.nn.Module,
    *,
    prefix: str = "",
    seed: int = 0,
    init: InitFn | None = None,
    optimizer: Mapping[str, Any] | None = None,
) -> list[VariableDef]:
    """One :class:`VariableDef` per parameter of ``module`` (trainable or not).

    ``init(name, param)`` returns an initializer config (None: the default of
    :func:`torch_default_init`); ``optimizer`` sets a per-variable optimizer.
    A 0-d parameter becomes a variable of shape ``(1,)``.
    """
    default = torch_default_init(module, seed=seed)
    out = []
    for name, p in module.named_parameters():
        config = (init(name, p) if init is not None else None) or default(name, p)
        shape = tuple(p.shape) or (1,)
        out.append(VariableDef(prefix + name, shape, _dtype_name(p), config, optimizer))
    return out


# ------------------------------------------------------------------ values


def _shareable(p: torch.Tensor, a: Array) -> bool:
    return (
        p.device.type == "cpu"
        and isinstance(a, np.ndarray)
        and a.flags.c_contiguous
        and a.flags.writeable
        and str(a.dtype) == _dtype_name(p)
    )


def _bind(p: torch.nn.Parameter, a: Array, zero_copy: bool) -> None:
    th = _torch()
    if a.shape != tuple(p.shape) and a.size != p.numel():
        raise ValueError(f"pulled shape {a.shape} does not fit parameter {tuple(p.shape)}")
    if zero_copy and _shareable(p, a):
        if p.data.data_ptr() != a.ctypes.data or p.data.numel() != a.size:
            p.data = th.from_numpy(a).view(p.shape)
        return  # already its storage: the pull refreshed it in place
    if p.device.type == "cpu":
        p.data.copy_(th.from_numpy(np.ascontiguousarray(a)).view(p.shape))
    else:
        _bridge(p.device.type).load(p, a.reshape(tuple(p.shape)))


def _load(
    module: torch.nn.Module, arrays: Mapping[str, Array], prefix: str, zero_copy: bool
) -> None:
    for name, p in module.named_parameters():
        key = prefix + name
        if key not in arrays:
            raise KeyError(f"the worker has no variable {key!r} (create_variables first?)")
        _bind(p, arrays[key], zero_copy)


def pull_into(
    module: torch.nn.Module, worker: WorkerLike, *, prefix: str = "", zero_copy: bool = True
) -> None:
    """Pull the module's variables into its parameters (CPU: as views, see module doc)."""
    names = [prefix + n for n, _ in module.named_parameters()]
    _load(module, worker.pull(names), prefix, zero_copy)


def grads_of(module: torch.nn.Module, *, prefix: str = "") -> dict[str, Any]:
    """The module's gradients as arrays to push: numpy views on CPU (no copy); zeros
    for a parameter without a gradient (every worker pushes every variable, so a sync
    step never waits on one)."""
    out: dict[str, Any] = {}
    for name, p in module.named_parameters():
        g = p.grad
        if g is None:
            out[prefix + name] = np.zeros(tuple(p.shape) or (1,), dtype=_dtype_name(p))
        elif g.device.type == "cpu":
            a = g.detach().numpy()
            out[prefix + name] = a.reshape(1) if a.ndim == 0 else a
        else:
            out[prefix + name] = _bridge(g.device.type).to_push(g)
    return out


def _zero_grad(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def _float(loss: Any) -> float | None:
    if loss is None:
        return None
    return float(loss.detach().item()) if hasattr(loss, "detach") else float(loss)


def push_grads(
    module: torch.nn.Module,
    worker: WorkerLike,
    *,
    prefix: str = "",
    loss: Any = None,
    examples: int | None = None,
    pull: bool = False,
    zero_copy: bool = True,
) -> bool:
    """Push the module's gradients (then set them to None). ``pull=True``: push_pull,
    and the new values land in the module. Returns whether the push was applied
    (False: dropped as stale); always True with ``pull``."""
    grads = grads_of(module, prefix=prefix)
    if pull:
        arrays = worker.push_pull(grads, loss=_float(loss), examples=examples)
        _zero_grad(module)
        _load(module, arrays, prefix, zero_copy)
        return True
    accepted = worker.push(grads, loss=_float(loss), examples=examples)
    _zero_grad(module)
    return accepted


class TorchModel:
    """A module bound to a worker: one training loop for async, sync and ssp.

    >>> model = TorchModel(net, worker)                         # doctest: +SKIP
    >>> model.create(optimizer={"name": "sgd", "lr": 0.1})      # doctest: +SKIP
    >>> for x, y in data:                                       # doctest: +SKIP
    ...     model.begin_step()
    ...     loss = loss_fn(net(x), y)
    ...     loss.backward()
    ...     model.push(loss=loss, examples=len(x))
    """

    def __init__(
        self,
        module: torch.nn.Module,
        worker: WorkerLike,
        *,
        prefix: str = "",
        seed: int = 0,
        init: InitFn | None = None,
        zero_copy: bool = True,
        devices: Sequence[Any] | None = None,
    ) -> None:
        th = _torch()
        if devices is not None and len(devices) == 0:
            raise ValueError("devices: name at least one (e.g. ['cuda:0', 'cuda:1'])")
        towers = [th.device(d) for d in devices] if devices is not None else []
        if towers:
            module.to(towers[0])
        self.module = module
        #: the module on each tower's device, ``module`` first (one without towers)
        self.replicas = [module] + [copy.deepcopy(module).to(d) for d in towers[1:]]
        self.worker = worker
        self.prefix = prefix
        self.zero_copy = zero_copy
        self.variables = variables_of(module, prefix=prefix, seed=seed, init=init)
        device = getattr(worker, "device", None)
        if isinstance(device, Device) and device.is_cuda and "cuda" not in _BRIDGES:
            register_bridge("cuda", DLPackBridge(device))
        self._fresh = False  # the module holds the values the last push_pull returned

    def create(self, optimizer: Mapping[str, Any] | None = None) -> Any:
        """Create the variables (idempotent: every worker may call it) and pull them."""
        placement = self.worker.create_variables(self.variables, optimizer)
        self.pull()
        return placement

    def pull(self) -> None:
        pull_into(self.module, self.worker, prefix=self.prefix, zero_copy=self.zero_copy)
        self._spread()
        self._fresh = True

    def _spread(self) -> None:
        """Copy ``module``'s values to the other replicas (device to device)."""
        if len(self.replicas) == 1:
            return
        th = _torch()
        with th.no_grad():
            source = list(self.module.parameters())
            for replica in self.replicas[1:]:
                for dst, src in zip(replica.parameters(), source, strict=True):
                    dst.copy_(src, non_blocking=True)

    def forward_backward(
        self, loss_fn: Callable[[torch.nn.Module, Any, Any], torch.Tensor], x: Any, y: Any
    ) -> torch.Tensor:
        """``loss_fn(replica, x, y)`` (a mean over the examples) and its backward on
        every tower, each on its slice of the batch; leaves the gradient of the whole
        batch in ``module``'s ``.grad`` and returns the batch's loss (on the first
        device). With one device: ``loss_fn(module, x, y).backward()``."""
        from zmqps.device.towers import Towers

        n = len(x)
        if n == 0:
            raise ValueError("an empty batch has no gradient")
        total: torch.Tensor | None = None
        for replica, part in zip(self.replicas, Towers.slices(n, len(self.replicas)), strict=True):
            if part.stop == part.start:
                continue  # no examples for this tower
            device = next(replica.parameters()).device
            xs = x[part].to(device, non_blocking=True)
            ys = y[part].to(device, non_blocking=True)
            loss = loss_fn(replica, xs, ys) * ((part.stop - part.start) / n)
            loss.backward()
            share: torch.Tensor = loss.detach().to(self._device)
            total = share if total is None else total + share
        self._gather()
        assert total is not None
        return total

    @property
    def _device(self) -> Any:
        return next(self.module.parameters()).device

    def _gather(self) -> None:
        """Sum the other replicas' gradients into ``module``'s (then clear theirs)."""
        own = list(self.module.parameters())
        for replica in self.replicas[1:]:
            for dst, src in zip(own, replica.parameters(), strict=True):
                if src.grad is None:
                    continue
                g = src.grad.to(dst.device, non_blocking=True)
                src.grad = None  # handed over: dst may take the tensor itself
                if dst.grad is None:
                    dst.grad = g
                else:
                    dst.grad.add_(g)

    def begin_step(self, poll: float = 10.0) -> int:
        """Wait until this worker may compute (see :meth:`zmqps.Worker.begin_step`) and
        make sure the module holds the values to compute on; returns the step."""
        step = self.worker.begin_step(poll)
        if self.worker.mode != "async" or not self._fresh:
            self.pull()
        return step

    def push(self, *, loss: Any = None, examples: int | None = None) -> bool:
        """Push the gradients of the last backward; async: the new values come back."""
        if self.worker.mode == "async":
            push_grads(
                self.module,
                self.worker,
                prefix=self.prefix,
                loss=loss,
                examples=examples,
                pull=True,
                zero_copy=self.zero_copy,
            )
            self._spread()
            self._fresh = True
            return True
        self._fresh = False
        return push_grads(
            self.module, self.worker, prefix=self.prefix, loss=loss, examples=examples
        )
