"""Server-side optimizers: SGD, momentum (optionally Nesterov), Adagrad, Adam and FTRL.

Rules of this module:

* An optimizer is configured once from an ``OPTIMIZER`` map (see
  :data:`zmqps.wire.schema.OPTIMIZER`) by :func:`make_optimizer`, which refuses unknown
  names, unknown keys and out-of-range values with
  :class:`~zmqps.wire.errors.InvalidArgument`. After that it holds no state: slots
  live with the shard, and are passed in.
* ``apply_dense`` updates a flat chunk IN PLACE and allocates no arrays: every
  temporary lives in the caller's ``scratch`` buffer, every ufunc writes with
  ``out=``. Scalars are Python floats so that (NEP 50) float16/32 arrays are never
  promoted to float64.
* ``apply_rows`` is lazy: only the given rows of the parameter and of its slots change,
  and Adam's bias correction uses the shard's update count ``step``
  (like ``LazyAdamOptimizer``). It may allocate.
* float16 parameters are updated in float32: their slots and the scratch buffer are
  float32 (:func:`compute_dtype`); only the final write rounds to float16. Adam's
  ``eps`` and ``(1-b2)*g**2`` would otherwise underflow to zero.
* The effective gradient is ``g = scale * grad + weight_decay * param`` (L2 decay,
  computed from the parameter before this update).
* Formulas (``t`` = ``step``, 1-based):

  - sgd:      ``p -= lr * g``
  - momentum: ``m = mu * m + g``; ``p -= lr * m``, or with Nesterov
    ``p -= lr * (g + mu * m)`` (TF ``MomentumOptimizer``)
  - adagrad:  ``a += g**2``; ``p -= lr * g / (sqrt(a) + eps)`` (Keras ``Adagrad``)
  - adam:     ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*g**2``;
    ``lr_t = lr * sqrt(1 - b2**t) / (1 - b1**t)``; ``p -= lr_t * m / (sqrt(v) + eps)``
    (TF ``AdamOptimizer``, the "epsilon hat" form of Kingma & Ba, Sec. 2)
  - ftrl:     FTRL-proximal (McMahan et al. 2013, TF ``FtrlOptimizer`` with
    ``lr_power = -0.5``): ``n' = n + g**2``; ``z += g - (sqrt(n') - sqrt(n)) / lr * p``;
    ``n = n'``; ``p = (clip(z, -l1, l1) - z) / ((beta + sqrt(n)) / lr + 2 * l2)``
    (zero where ``|z| <= l1``). Slots ``accumulator`` (n, starts at
    ``initial_accumulator``) and ``linear`` (z).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from zmqps.core import _kernels, lowp
from zmqps.wire.errors import InvalidArgument

__all__ = [
    "OPTIMIZERS",
    "SGD",
    "Adagrad",
    "Adam",
    "Ftrl",
    "Momentum",
    "Optimizer",
    "compute_dtype",
    "make_optimizer",
]

Array = npt.NDArray[Any]

#: apply_dense works through a chunk in blocks of this many elements so that its
#: temporaries stay cache-resident between passes (measured on a 1M-element chunk:
#: 5-20% faster than whole-chunk passes; much smaller blocks lose to per-call overhead).
BLOCK_ELEMS = 1 << 17

#: Use the fused one-pass kernels of :mod:`zmqps.core._kernels` for float32 / float64
#: parameters when numba is available (tests switch it off to check the reference path).
USE_KERNELS = True


def compute_dtype(dtype: str | np.dtype[Any]) -> np.dtype[Any]:
    """The dtype slots and scratch use for a parameter of ``dtype`` (float16 -> float32)."""
    dt = np.dtype(dtype)
    return np.dtype(np.float32) if dt == np.float16 else dt


#: the largest value a hyperparameter (lr, weight decay, eps, ...) may take: far past
#: any that trains, and small enough that one update of a gradient the PS takes (below
#: its dtype's limit) stays finite (``lr=1e300`` made every parameter infinite)
MAX_HYPERPARAMETER = 1e6

#: the smallest nonzero value a hyperparameter may take: float32's smallest normal
#: number (updates run in float32; below it a value rounds to 0 or loses its digits)
MIN_HYPERPARAMETER = float(np.finfo(np.float32).tiny)


def _number(config: Mapping[str, Any], key: str, default: float | None) -> float:
    v = config.get(key, default)
    if v is None:
        raise InvalidArgument(f"optimizer {config.get('name')!r} needs {key!r}")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidArgument(f"optimizer {key!r} must be a finite number, got {v!r}")
    if v < 0:
        raise InvalidArgument(f"optimizer {key!r} must be >= 0, got {v!r}")
    if v > MAX_HYPERPARAMETER:
        top = MAX_HYPERPARAMETER
        raise InvalidArgument(f"optimizer {key!r} must be at most {top:g}, got {v!r}")
    if 0 < v < MIN_HYPERPARAMETER:
        # 0 in a float32 update: an eps or accumulator of 1e-300 passed the check that
        # it is not 0, then a zero gradient's update made 0 / 0 (NaN parameters, every
        # push accepted, exit code 0)
        raise InvalidArgument(
            f"optimizer {key!r} must be 0 or at least {MIN_HYPERPARAMETER:.3g} (float32's"
            f" smallest normal number: a smaller one is 0 in the update), got {v!r}"
        )
    return float(v)


class Optimizer(ABC):
    """Common base: config handling, argument checks and the effective gradient.

    Subclasses implement :meth:`_update` on one block: ``g`` is the effective gradient
    (``grad`` itself when no scaling, decay or cast is needed, else scratch) and ``tmp``
    a free scratch block of the same length.
    """

    name: ClassVar[str]
    #: Names of the per-element slots, in a fixed order.
    slot_names: ClassVar[tuple[str, ...]] = ()
    #: ``apply_dense`` needs ``scratch`` of at least ``scratch_factor * min(n, BLOCK_ELEMS)``
    #: elements (``scratch_factor * n`` is always enough).
    scratch_factor: ClassVar[int] = 2
    #: Keys this optimizer accepts besides name, lr and weight_decay, with defaults.
    defaults: ClassVar[Mapping[str, float | bool]] = {}

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.lr = _number(config, "lr", None)
        self.weight_decay = _number(config, "weight_decay", 0.0)
        if self.lr * self.weight_decay > 1.0:
            # each update scales a parameter by 1 - lr * weight_decay: past -1 it grows
            # without bound from any push, however small (lr 1 and weight decay 1e6
            # reached infinity in seven pushes of 0.001, each one accepted)
            raise InvalidArgument(
                f"optimizer {self.name!r}: lr x weight_decay must be at most 1, got"
                f" {self.lr:g} x {self.weight_decay:g} = {self.lr * self.weight_decay:g}"
                " (each update scales the parameters by 1 - lr x weight_decay: below 0 it"
                " overshoots, below -1 they grow without bound from any push)"
            )

    def config(self) -> dict[str, Any]:
        """The full config, defaults filled in (JSON-able)."""
        out: dict[str, Any] = {"name": self.name, "lr": self.lr}
        if self.weight_decay:
            out["weight_decay"] = self.weight_decay
        out.update({k: getattr(self, k) for k in self.defaults})
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config()})"

    def init_slots(self, shape: tuple[int, ...], dtype: str | np.dtype[Any]) -> dict[str, Array]:
        """Fresh slots (zeros unless the optimizer says otherwise) of ``compute_dtype(dtype)``."""
        return {name: np.zeros(shape, dtype=compute_dtype(dtype)) for name in self.slot_names}

    # -- dense ---------------------------------------------------------------

    def has_kernel(self, param: Array) -> bool:
        """Whether :meth:`apply_dense` runs a fused kernel for ``param``: then it writes
        nothing but ``param``, the slots and ``wire`` (not ``scratch``), so disjoint
        pieces of one shard may be updated by several threads at once."""
        return USE_KERNELS and _kernels.kernel(self.name, param) is not None

    def apply_dense(
        self,
        param: Array,
        grad: Array,
        slots: Mapping[str, Array],
        step: int,
        scratch: Array,
        scale: float = 1.0,
        wire: Array | None = None,
    ) -> None:
        """Apply one update to the flat chunk ``param`` in place (slots too).

        ``param``, ``grad`` and every slot are 1-D of the same length ``n``; ``grad`` may
        be read-only and of another float dtype. ``scratch`` is 1-D of ``compute_dtype(param)``
        with at least ``scratch_factor * min(n, BLOCK_ELEMS)`` elements. ``step`` is
        the 1-based update count of the shard; ``scale`` multiplies the gradient.
        ``wire`` (a float32 ``param`` only): a 1-D bfloat16 array of length ``n`` that
        gets the new values rounded (by the fused kernel in its one pass, else after
        the update). Allocates no arrays.
        """
        n = self._check(param, grad, slots, step, scratch, wire)
        scale = float(scale)
        fused = _kernels.kernel(self.name, param) if USE_KERNELS else None
        if fused is not None:
            self._fused(
                fused, param, _kernel_grad(grad), slots, step, scale, param.dtype.type, wire=wire
            )
            return
        b = max(1, min(n, BLOCK_ELEMS))
        g_buf = scratch[:b]
        tmp_buf = scratch[b : 2 * b]
        direct = scale == 1.0 and not self.weight_decay and grad.dtype == scratch.dtype
        for lo in range(0, n, b):
            hi = min(lo + b, n)
            m = hi - lo
            p = param[lo:hi]
            if direct:
                g = grad[lo:hi]
            else:
                g = g_buf[:m]
                self._effective_grad(p, grad[lo:hi], g, tmp_buf[:m], scale)
            self._update(p, g, {k: v[lo:hi] for k, v in slots.items()}, step, tmp_buf[:m])
        if wire is not None:
            lowp.narrow_all([(param, wire)])

    def _effective_grad(self, p: Array, grad: Array, g: Array, tmp: Array, scale: float) -> None:
        if lowp.is_narrow(grad.dtype):  # widened exactly first: the product in float32
            lowp.widen_into(g, grad)
            np.multiply(g, scale, out=g)
        else:
            np.multiply(grad, scale, out=g)  # casts grad to the compute dtype
        if self.weight_decay:
            np.multiply(p, self.weight_decay, out=tmp)
            np.add(g, tmp, out=g)

    def _fused(
        self,
        kernel: Any,
        p: Array,
        g: Array,
        slots: Mapping[str, Array],
        step: int,
        scale: float,
        dt: Any,
        rows: Array | None = None,
        wire: Array | None = None,
    ) -> None:
        """Run the fused kernel: ``kernel(p, g, w, *slots, *scalars)`` (``w``: the bits
        of ``wire``, or None), or ``kernel(rows, p, g, *slots, *scalars)``.

        Scalars are passed as ``dt`` (the parameter's dtype). With ``rows``, ``p``, ``g``
        and the slots are 2-D and the ``*_rows`` kernel updates just those rows
        (``g[k]`` belongs to ``rows[k]``).
        """
        if rows is None:
            lead: tuple[Any, ...] = (p, g, None if wire is None else lowp.bits(wire))
        else:
            lead = (rows, p, g)
        kernel(*lead, *(slots[n] for n in self.slot_names), *self._kernel_args(step, scale, dt))

    @abstractmethod
    def _kernel_args(self, step: int, scale: float, dt: Any) -> tuple[Any, ...]:
        """The scalar arguments of this optimizer's kernel, after the slots."""

    @abstractmethod
    def _update(
        self, p: Array, g: Array, slots: Mapping[str, Array], step: int, tmp: Array
    ) -> None: ...

    def _check(
        self,
        param: Array,
        grad: Array,
        slots: Mapping[str, Array],
        step: int,
        scratch: Array,
        wire: Array | None = None,
    ) -> int:
        if param.ndim != 1 or grad.shape != param.shape:
            raise InvalidArgument(
                f"apply_dense: param {param.shape} and grad {grad.shape} must be equal 1-D"
            )
        if (grad.dtype.kind != "f" and not lowp.is_narrow(grad.dtype)) or param.dtype.kind != "f":
            raise InvalidArgument(f"apply_dense: float arrays needed, got grad {grad.dtype}")
        if set(slots) != set(self.slot_names) or any(
            s.shape != param.shape for s in slots.values()
        ):
            raise InvalidArgument(f"apply_dense: slots must be {self.slot_names} of {param.shape}")
        n = int(param.shape[0])
        need = self.scratch_factor * min(n, BLOCK_ELEMS)
        cdt = compute_dtype(param.dtype)
        if scratch.dtype != cdt or scratch.ndim != 1 or scratch.shape[0] < need:
            raise InvalidArgument(f"apply_dense: scratch must be 1-D {cdt} of >= {need} elements")
        if step < 1:
            raise InvalidArgument(f"apply_dense: step must be >= 1, got {step}")
        if wire is not None and (
            not lowp.is_narrow(wire.dtype)
            or wire.shape != param.shape
            or param.dtype != np.float32
            or not wire.flags.writeable
        ):
            raise InvalidArgument(
                f"apply_dense: wire must be writable 1-D bfloat16 of {param.shape}"
                f" for a float32 param, got {wire.dtype}{wire.shape} for {param.dtype}"
            )
        return n

    # -- rows ----------------------------------------------------------------

    def apply_rows(
        self,
        param: Array,
        rows: Array,
        grad_rows: Array,
        slots: Mapping[str, Array],
        step: int,
        scale: float = 1.0,
        *,
        checked: bool = False,
    ) -> None:
        """Lazy update of the given rows of a 2-D ``(rows, row_size)`` parameter view.

        ``rows`` are UNIQUE local row indices (not checked: duplicates would keep one
        update); ``grad_rows`` has shape ``(len(rows), row_size)``. Untouched rows of
        ``param`` and of every slot are left exactly as they were. ``checked``: the
        caller validated ``rows`` against ``param`` already (a shard's keys), so they
        are not read again for their range.
        """
        if param.ndim != 2 or rows.ndim != 1 or rows.dtype.kind not in "iu":
            raise InvalidArgument("apply_rows: param must be 2-D and rows 1-D integers")
        k, width = rows.shape[0], param.shape[1]
        if grad_rows.shape != (k, width):
            raise InvalidArgument(f"apply_rows: grad_rows {grad_rows.shape} != {(k, width)}")
        if k == 0:
            return
        if not checked and (int(rows.min()) < 0 or int(rows.max()) >= param.shape[0]):
            raise InvalidArgument(f"apply_rows: row index outside [0, {param.shape[0]})")
        fused = _kernels.kernel(f"{self.name}_rows", param) if USE_KERNELS else None
        if fused is not None and param.flags.c_contiguous:
            g = np.ascontiguousarray(grad_rows)
            rows = rows.astype(np.int64, copy=False)
            self._fused(fused, param, g, slots, step, float(scale), param.dtype.type, rows)
            return
        p = np.take(param, rows, axis=0)
        gathered = {name: np.take(s, rows, axis=0) for name, s in slots.items()}
        scratch = np.empty(
            self.scratch_factor * min(p.size, BLOCK_ELEMS), dtype=compute_dtype(param.dtype)
        )
        self.apply_dense(
            p.reshape(-1),
            np.ascontiguousarray(grad_rows).reshape(-1),
            {name: s.reshape(-1) for name, s in gathered.items()},
            step,
            scratch,
            scale,
        )
        param[rows] = p
        for name, s in gathered.items():
            slots[name][rows] = s


class SGD(Optimizer):
    """Plain gradient descent, ``p -= lr * g``."""

    name = "sgd"
    scratch_factor = 1

    def apply_dense(
        self,
        param: Array,
        grad: Array,
        slots: Mapping[str, Array],
        step: int,
        scratch: Array,
        scale: float = 1.0,
        wire: Array | None = None,
    ) -> None:
        # Two passes, no blocking needed: p = p * (1 - lr*wd) + (-lr*scale) * grad
        n = self._check(param, grad, slots, step, scratch, wire)
        factor = -self.lr * float(scale)
        fused = _kernels.kernel(self.name, param) if USE_KERNELS else None
        if fused is not None:
            g = _kernel_grad(grad)
            self._fused(fused, param, g, slots, step, float(scale), param.dtype.type, wire=wire)
            return
        narrow = lowp.is_narrow(grad.dtype)
        b = max(1, min(n, BLOCK_ELEMS))
        for lo in range(0, n, b):
            hi = min(lo + b, n)
            p, s = param[lo:hi], scratch[: hi - lo]
            if narrow:
                lowp.widen_into(s, grad[lo:hi])
                np.multiply(s, factor, out=s)
            else:
                np.multiply(grad[lo:hi], factor, out=s)
            if self.weight_decay:
                np.multiply(p, 1.0 - self.lr * self.weight_decay, out=p)
            np.add(p, s, out=p)
        if wire is not None:
            lowp.narrow_all([(param, wire)])

    def _kernel_args(self, step: int, scale: float, dt: Any) -> tuple[Any, ...]:
        return dt(-self.lr * scale), dt(1.0 - self.lr * self.weight_decay)

    def _update(
        self, p: Array, g: Array, slots: Mapping[str, Array], step: int, tmp: Array
    ) -> None:  # pragma: no cover - apply_dense is overridden
        np.subtract(p, self.lr * g, out=p)


class Momentum(Optimizer):
    """Heavy-ball momentum, optionally Nesterov (TF ``MomentumOptimizer`` form)."""

    name = "momentum"
    slot_names = ("momentum",)
    defaults: ClassVar[Mapping[str, float | bool]] = {"momentum": 0.9, "nesterov": False}

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.momentum = _number(config, "momentum", 0.9)
        if self.momentum > 1.0:
            raise InvalidArgument(f"momentum must be in [0, 1], got {self.momentum}")
        nesterov = config.get("nesterov", False)
        if not isinstance(nesterov, bool):
            raise InvalidArgument(f"nesterov must be a bool, got {nesterov!r}")
        self.nesterov = nesterov

    def _kernel_args(self, step: int, scale: float, dt: Any) -> tuple[Any, ...]:
        return (dt(self.lr), dt(self.momentum), dt(scale), dt(self.weight_decay), self.nesterov)

    def _update(
        self, p: Array, g: Array, slots: Mapping[str, Array], step: int, tmp: Array
    ) -> None:
        m = slots["momentum"]
        np.multiply(m, self.momentum, out=m)
        np.add(m, g, out=m)
        if self.nesterov:
            np.multiply(g, -self.lr, out=tmp)
            np.add(p, tmp, out=p)
            np.multiply(m, -self.lr * self.momentum, out=tmp)
        else:
            np.multiply(m, -self.lr, out=tmp)
        np.add(p, tmp, out=p)


class Adagrad(Optimizer):
    """Adagrad (Keras form): ``a += g**2; p -= lr * g / (sqrt(a) + eps)``."""

    name = "adagrad"
    slot_names = ("accumulator",)
    defaults: ClassVar[Mapping[str, float | bool]] = {"initial_accumulator": 0.1, "eps": 1e-7}

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.initial_accumulator = _number(config, "initial_accumulator", 0.1)
        self.eps = _number(config, "eps", 1e-7)
        if self.initial_accumulator == 0.0 and self.eps == 0.0:
            raise InvalidArgument("adagrad needs initial_accumulator > 0 or eps > 0")

    def init_slots(self, shape: tuple[int, ...], dtype: str | np.dtype[Any]) -> dict[str, Array]:
        acc = np.full(shape, self.initial_accumulator, dtype=compute_dtype(dtype))
        return {"accumulator": acc}

    def _kernel_args(self, step: int, scale: float, dt: Any) -> tuple[Any, ...]:
        return dt(self.lr), dt(self.eps), dt(scale), dt(self.weight_decay)

    def _update(
        self, p: Array, g: Array, slots: Mapping[str, Array], step: int, tmp: Array
    ) -> None:
        acc = slots["accumulator"]
        np.multiply(g, g, out=tmp)
        np.add(acc, tmp, out=acc)
        np.sqrt(acc, out=tmp)
        np.add(tmp, self.eps, out=tmp)
        np.divide(g, tmp, out=tmp)
        np.multiply(tmp, self.lr, out=tmp)
        np.subtract(p, tmp, out=p)


class Adam(Optimizer):
    """Adam, TF form: bias correction folded into ``lr_t``, eps added to ``sqrt(v)``."""

    name = "adam"
    slot_names = ("m", "v")
    defaults: ClassVar[Mapping[str, float | bool]] = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.beta1 = _number(config, "beta1", 0.9)
        self.beta2 = _number(config, "beta2", 0.999)
        self.eps = _number(config, "eps", 1e-8)
        if self.beta1 >= 1.0 or self.beta2 >= 1.0:
            raise InvalidArgument("adam: beta1 and beta2 must be in [0, 1)")
        if self.eps <= 0.0:
            raise InvalidArgument("adam: eps must be > 0")

    def lr_t(self, step: int) -> float:
        """The bias-corrected step size at 1-based ``step``."""
        return self.lr * math.sqrt(1.0 - self.beta2**step) / (1.0 - self.beta1**step)

    def _kernel_args(self, step: int, scale: float, dt: Any) -> tuple[Any, ...]:
        return (
            dt(self.lr_t(step)),
            dt(1.0 - self.beta1),
            dt(1.0 - self.beta2),
            dt(self.eps),
            dt(scale),
            dt(self.weight_decay),
        )

    def _update(
        self, p: Array, g: Array, slots: Mapping[str, Array], step: int, tmp: Array
    ) -> None:
        m, v = slots["m"], slots["v"]
        # m += (1 - b1) * (g - m)
        np.subtract(g, m, out=tmp)
        np.multiply(tmp, 1.0 - self.beta1, out=tmp)
        np.add(m, tmp, out=m)
        # v += (1 - b2) * (g*g - v)
        np.multiply(g, g, out=tmp)
        np.subtract(tmp, v, out=tmp)
        np.multiply(tmp, 1.0 - self.beta2, out=tmp)
        np.add(v, tmp, out=v)
        # p -= lr_t * m / (sqrt(v) + eps)
        np.sqrt(v, out=tmp)
        np.add(tmp, self.eps, out=tmp)
        np.divide(m, tmp, out=tmp)
        np.multiply(tmp, self.lr_t(step), out=tmp)
        np.subtract(p, tmp, out=p)


class Ftrl(Optimizer):
    """FTRL-proximal (TF ``FtrlOptimizer``, ``lr_power = -0.5``), the classic CTR optimizer.

    ``l1`` makes weights exactly zero while ``|z| <= l1`` (sparse models); ``l2`` and
    ``beta`` damp the per-coordinate step ``lr / (beta + sqrt(n))``."""

    name = "ftrl"
    slot_names = ("accumulator", "linear")
    defaults: ClassVar[Mapping[str, float | bool]] = {
        "initial_accumulator": 0.1,
        "l1": 0.0,
        "l2": 0.0,
        "beta": 0.0,
    }

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        if self.lr <= 0.0:
            raise InvalidArgument("ftrl: lr must be > 0")
        self.initial_accumulator = _number(config, "initial_accumulator", 0.1)
        self.l1 = _number(config, "l1", 0.0)
        self.l2 = _number(config, "l2", 0.0)
        self.beta = _number(config, "beta", 0.0)
        if self.initial_accumulator == 0.0 and self.beta == 0.0 and self.l2 == 0.0:
            raise InvalidArgument("ftrl needs initial_accumulator > 0, beta > 0 or l2 > 0")

    def init_slots(self, shape: tuple[int, ...], dtype: str | np.dtype[Any]) -> dict[str, Array]:
        cdt = compute_dtype(dtype)
        return {
            "accumulator": np.full(shape, self.initial_accumulator, dtype=cdt),
            "linear": np.zeros(shape, dtype=cdt),
        }

    def _kernel_args(self, step: int, scale: float, dt: Any) -> tuple[Any, ...]:
        return ()  # no fused kernel: the numpy path below

    def _update(
        self, p: Array, g: Array, slots: Mapping[str, Array], step: int, tmp: Array
    ) -> None:
        n, z = slots["accumulator"], slots["linear"]
        inv_lr = 1.0 / self.lr
        # z += g + sqrt(n) * p / lr  ...
        np.sqrt(n, out=tmp)
        np.multiply(tmp, p, out=tmp)
        np.multiply(tmp, inv_lr, out=tmp)
        np.add(z, tmp, out=z)
        np.add(z, g, out=z)
        # ... - sqrt(n + g*g) * p / lr, with n += g*g
        np.multiply(g, g, out=tmp)
        np.add(n, tmp, out=n)
        np.sqrt(n, out=tmp)
        np.multiply(tmp, p, out=tmp)
        np.multiply(tmp, inv_lr, out=tmp)
        np.subtract(z, tmp, out=z)
        # p = (clip(z, -l1, l1) - z) / ((beta + sqrt(n)) / lr + 2 * l2)
        np.sqrt(n, out=tmp)
        np.add(tmp, self.beta, out=tmp)
        np.multiply(tmp, inv_lr, out=tmp)
        np.add(tmp, 2.0 * self.l2, out=tmp)
        np.clip(z, -self.l1, self.l1, out=p)
        np.subtract(p, z, out=p)
        np.divide(p, tmp, out=p)


#: Optimizer classes by config name.
OPTIMIZERS: Mapping[str, type[Optimizer]] = {
    cls.name: cls for cls in (SGD, Momentum, Adagrad, Adam, Ftrl)
}


def _kernel_grad(grad: Array) -> Array:
    """What a fused kernel takes for ``grad``: itself, or a bfloat16 one's bits."""
    return lowp.bits(grad) if lowp.is_narrow(grad.dtype) else grad


def make_optimizer(config: Mapping[str, Any]) -> Optimizer:
    """Build (and validate) the optimizer an ``OPTIMIZER`` config map describes."""
    if not isinstance(config, Mapping):
        raise InvalidArgument(f"optimizer config must be a map, got {type(config).__name__}")
    name = config.get("name")
    cls = OPTIMIZERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InvalidArgument(f"unknown optimizer {name!r}; known: {', '.join(sorted(OPTIMIZERS))}")
    unknown = sorted(set(config) - {"name", "lr", "weight_decay", *cls.defaults})
    if unknown:
        raise InvalidArgument(f"optimizer {name!r} does not take {', '.join(unknown)}")
    return cls(config)
