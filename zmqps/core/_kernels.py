"""Fused optimizer kernels: one pass over memory per dense update.

Rules of this module:

* Each kernel computes exactly the formula of its optimizer in
  :mod:`zmqps.core.optimizers` (effective gradient ``scale * grad + wd * p``
  included) in one loop, so an update reads each array once and writes each
  once: near memory bandwidth, no temporaries. The numpy implementation there
  is the reference they are tested against.
* Kernels take float32 / float64 parameters (slots of the same dtype); the
  gradient may be of any float dtype. Anything else uses the numpy path.
* ``bad_sum`` (the value check of pushed gradients) is the one kernel built with a
  fastmath flag, reassociation alone, so that its sum vectorizes; its terms are 0
  or NaN, and NaN survives any order of additions.
* A gradient may also arrive as bfloat16 (a variable's wire dtype, see
  :mod:`zmqps.core.lowp`): kernels then take its bits as a ``uint16`` array and read
  each element through ``_g`` (widened exactly to float32 in the loop: one pass, no
  converted copy). ``narrow_bf16`` / ``widen_bf16`` convert whole arrays (rounding to
  nearest even, as every bfloat16 library does; NaN stays NaN), ``add_into`` adds a
  gradient of either kind into a running sum, ``bad_bits16`` is the value check of
  bfloat16 bits (an integer maximum: vectorizes without any fastmath flag).
* The dense optimizer kernels take a third array after the gradient, ``w``: None, or
  the bits of a bfloat16 copy of the parameter (a shard's wire copy, kept by the
  store), into which each new value is written rounded as ``narrow_bf16`` rounds it,
  in the same loop: the rounding a pull needs costs a write, not another pass.
* numba is imported lazily; :data:`available` says whether it could be.
  No fastmath: results are IEEE-exact like numpy (an FMA would differ in the last bit);
  ``error_model="numpy"`` keeps divisions vectorizable; single-threaded, because
  a PS shares its cores with the transport and, on one host, with workers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["available", "bits_kernel", "index_kernel", "kernel"]

_KERNELS: dict[str, Any] | None = None
_FAILED = False


def _build() -> dict[str, Any] | None:
    try:
        from zmqps.core import _jit
    except ImportError:  # pragma: no cover - numba is a dependency; kept for odd platforms
        return None
    return _jit.KERNELS


def available() -> bool:
    global _KERNELS, _FAILED
    if _KERNELS is None and not _FAILED:
        _KERNELS = _build()
        _FAILED = _KERNELS is None
    return _KERNELS is not None


def kernel(name: str, param: np.ndarray[Any, Any]) -> Any:
    """The fused kernel for optimizer ``name`` (or ``first_bad``, ``bad_sum``,
    ``add_into``, ``sum_rows``) and this parameter (array), or None (numpy path)."""
    if param.dtype not in (np.float32, np.float64) or (_KERNELS is None and not available()):
        return None
    assert _KERNELS is not None
    return _KERNELS.get(name)


def bits_kernel(name: str) -> Any:
    """A kernel of bfloat16 bits (``bad_bits16``, ``bad_words16``, ``first_bad16``,
    ``narrow_bf16``, ``widen_bf16``), or None (numpy path)."""
    if not available():
        return None
    assert _KERNELS is not None
    return _KERNELS[name]


def index_kernel(name: str, ids: np.ndarray[Any, Any]) -> Any:
    """A kernel of int64 row ids or keys (``local_rows``, ``increasing``,
    ``pack_positions``, ``unpack_sorted``), or None (the numpy path: another dtype, an
    array that is not C-contiguous and writable, whose kernel numba would compile
    anew, or no numba)."""
    if (
        ids.dtype != np.int64
        or not ids.flags.c_contiguous
        or not ids.flags.writeable
        or (_KERNELS is None and not available())
    ):
        return None
    assert _KERNELS is not None
    return _KERNELS[name]
