"""Values on the wire at a lower precision than the PS keeps them (sans-IO).

Rules of this module:

* A dense float32 variable may travel as **bfloat16** (its *wire dtype*,
  ``VariableDef.wire``): pulls bring its values rounded to bfloat16 and pushes carry
  its gradients in bfloat16, half the bytes each way. The PS keeps the float32 master
  values and optimizer slots, and updates in float32 with the gradient widened
  exactly; a backup applies the same bfloat16 gradient, so copies stay bit-identical.
* bfloat16 is float32's upper half: the same exponent range (nothing overflows or
  underflows that float32 would not), 8 bits of significand. Widening is exact;
  narrowing rounds to nearest, ties to even, as ``ml_dtypes`` (the numpy dtype used
  here) and every accelerator do; a NaN stays a NaN.
* With numba, the conversions are compiled loops at memory speed and the optimizer
  kernels read bfloat16 gradients directly (:mod:`zmqps.core._kernels`); without it,
  ``ml_dtypes``' numpy casts give the same bits.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from zmqps.core import _kernels

__all__ = ["BFLOAT16", "WIRE_DTYPES", "add_into", "bits", "is_narrow", "narrow", "widen_into"]

BFLOAT16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)

#: wire dtype name -> (numpy dtype, the variable dtypes it may stand for)
WIRE_DTYPES: dict[str, tuple[np.dtype[Any], tuple[str, ...]]] = {
    "bfloat16": (BFLOAT16, ("float32",)),
}


def is_narrow(dtype: Any) -> bool:
    """Whether arrays of ``dtype`` are a wire dtype narrower than their variable's."""
    return bool(np.dtype(dtype) == BFLOAT16)


def bits(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The raw bits of a bfloat16 array, as uint16 (a view)."""
    return a.view(np.uint16)


def narrow(src: np.ndarray[Any, Any], out: np.ndarray[Any, Any] | None = None) -> Any:
    """``src`` (float32) rounded to bfloat16, into ``out`` (flat, same size) or a new
    array; returns it."""
    flat = np.ascontiguousarray(src, dtype=np.float32).reshape(-1)
    if out is None:
        out = np.empty(flat.shape[0], BFLOAT16)
    k = _kernels.bits_kernel("narrow_bf16")
    if k is None:
        with np.errstate(invalid="ignore"):  # NaN stays NaN
            out.reshape(-1)[...] = flat.astype(BFLOAT16)
    else:
        k(flat, bits(out.reshape(-1)))
    return out


def widen_into(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
    """Copy bfloat16 ``src`` into float32 ``dst`` (flat, same size), exactly."""
    k = _kernels.bits_kernel("widen_bf16")
    flat = dst.reshape(-1)
    if k is None or not flat.flags.c_contiguous:
        np.copyto(flat, src.reshape(-1).astype(np.float32))
        return
    k(bits(np.ascontiguousarray(src).reshape(-1)), flat)


def add_into(acc: np.ndarray[Any, Any], g: np.ndarray[Any, Any]) -> None:
    """``acc += g`` for a running sum ``acc`` (float32 / float64) and a gradient of
    acc's dtype or bfloat16 (widened exactly)."""
    if not is_narrow(g.dtype):
        np.add(acc, g, out=acc)
        return
    k = _kernels.kernel("add_into", acc)
    if k is None or not acc.flags.c_contiguous:
        np.add(acc, g.astype(acc.dtype), out=acc)
        return
    k(acc, bits(np.ascontiguousarray(g)))
