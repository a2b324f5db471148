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
* Given a :class:`~zmqps.core.finite.Parts` runner (the process's threads) and at
  least :data:`PARALLEL_BYTES` to read, a conversion is cut into equal parts run at
  the same time (the loops release the GIL): it is on the path of a reply someone
  waits for, while the other cores are idle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from zmqps.core import _kernels
from zmqps.wire.codec import bfloat16, is_bfloat16

if TYPE_CHECKING:
    from zmqps.core.finite import Parts

__all__ = [
    "PARALLEL_BYTES",
    "WIRE_DTYPES",
    "add_into",
    "bfloat16",
    "bits",
    "is_narrow",
    "narrow",
    "narrow_all",
    "widen_all",
    "widen_into",
]

#: wire dtype name -> the variable dtypes it may stand for (its numpy dtype:
#: ``zmqps.wire.codec.DTYPES``; bfloat16's, :func:`bfloat16`, is imported on first use)
WIRE_DTYPES: dict[str, tuple[str, ...]] = {
    "bfloat16": ("float32",),
}


def is_narrow(dtype: Any) -> bool:
    """Whether arrays of ``dtype`` are a wire dtype narrower than their variable's."""
    return is_bfloat16(dtype)


def bits(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The raw bits of a bfloat16 array, as uint16 (a view)."""
    return a.view(np.uint16)


#: a conversion reading at least this many bytes is run by several threads
PARALLEL_BYTES = 8 << 20

Pair = tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]


def narrow(
    src: np.ndarray[Any, Any], out: np.ndarray[Any, Any] | None = None, parts: Parts | None = None
) -> Any:
    """``src`` (float32) rounded to bfloat16, into ``out`` (flat, same size) or a new
    array; returns it."""
    flat = np.ascontiguousarray(src, dtype=np.float32).reshape(-1)
    if out is None:
        out = np.empty(flat.shape[0], bfloat16())
    narrow_all([(flat, out.reshape(-1))], parts)
    return out


def narrow_all(pairs: Sequence[Pair], parts: Parts | None = None) -> None:
    """Each ``(float32 src, bfloat16 dst)`` of ``pairs`` (flat, same sizes) rounded."""
    k = _kernels.bits_kernel("narrow_bf16")
    if k is None:
        with np.errstate(invalid="ignore"):  # NaN stays NaN
            for src, dst in pairs:
                dst[...] = src.astype(bfloat16())
        return
    _run(k, [(src, bits(dst)) for src, dst in pairs], parts)


def widen_into(
    dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any], parts: Parts | None = None
) -> None:
    """Copy bfloat16 ``src`` into float32 ``dst`` (flat, same size), exactly."""
    widen_all([(src.reshape(-1), dst.reshape(-1))], parts)


def widen_all(pairs: Sequence[Pair], parts: Parts | None = None) -> None:
    """Each ``(bfloat16 src, float32 dst)`` of ``pairs`` (flat, same sizes) widened."""
    k = _kernels.bits_kernel("widen_bf16")
    if k is None or not all(dst.flags.c_contiguous for _, dst in pairs):
        for src, dst in pairs:
            np.copyto(dst, src.astype(np.float32))
        return
    _run(k, [(bits(np.ascontiguousarray(src)), dst) for src, dst in pairs], parts)


def _run(kernel: Any, pairs: Sequence[Pair], parts: Parts | None) -> None:
    """``kernel(src, dst)`` over every pair: cut into ``parts.threads`` runs of about
    equal size run at once when there is enough to read, else in turn."""
    total = sum(src.nbytes for src, _ in pairs)
    if parts is None or parts.threads <= 1 or total < PARALLEL_BYTES:
        for src, dst in pairs:
            kernel(src, dst)
        return
    share = -(-sum(src.shape[0] for src, _ in pairs) // parts.threads)
    runs: list[list[Pair]] = [[]]
    room = share
    for src, dst in pairs:
        lo, n = 0, src.shape[0]
        while lo < n:
            take = min(n - lo, room)
            runs[-1].append((src[lo : lo + take], dst[lo : lo + take]))
            lo += take
            room -= take
            if room <= 0:
                runs.append([])
                room = share

    def call(run: list[Pair]) -> Callable[[], bool]:
        def go() -> bool:
            for src, dst in run:
                kernel(src, dst)
            return True

        return go

    parts.run([call(r) for r in runs if r])


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
