"""Finite checks of pushed values (sans-IO).

Rules of this module:

* :func:`first_nonfinite` finds the first NaN or infinity of a 1-D float array, or
  says there is none, allocating nothing on the common path (all finite).
* With numba (float32 / float64): small arrays (most shards of a model of many
  variables) go through one compiled loop that stops at the first bad element; large
  ones through one vectorized sum of ``x - x`` (0 for a finite x, NaN otherwise: it
  cannot overflow), and only when it is not 0 through the loop. That is one read
  of the gradient, at about 26 GB/s on one core.
* Without (or for float16): summed a block at a time (numpy's vectorized
  reduction): a sum is finite only if every term is, so only a block whose sum is
  not finite (a NaN or an infinity in it, or finite values whose sum overflows) is
  looked at element by element.
* float16 is summed in float32, so a float16 gradient of large but finite values is
  not taken for an overflow.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zmqps.core import _kernels

__all__ = ["first_nonfinite"]

#: arrays up to this many elements go through the compiled loop (when there is one)
SMALL_ELEMS = 1 << 14
#: large arrays are summed this many elements at a time (256 KiB of float32)
BLOCK_ELEMS = 1 << 16


def first_nonfinite(a: np.ndarray[Any, Any]) -> int | None:
    """The index of the first NaN or infinity of the 1-D float array ``a``, or None."""
    n = a.shape[0]
    loop = _kernels.kernel("first_nonfinite", a)
    if loop is not None:
        if n > SMALL_ELEMS and _kernels.kernel("nonfinite_sum", a)(a) == 0:
            return None  # the common case: one vectorized pass, at memory bandwidth
        i = int(loop(a))
        return None if i < 0 else i
    acc = np.float32 if a.dtype.itemsize < 4 else None
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowing sum is expected
        for lo in range(0, n, BLOCK_ELEMS):
            block = a[lo : lo + BLOCK_ELEMS]
            if math.isfinite(np.add.reduce(block, dtype=acc)):
                continue
            bad = np.flatnonzero(~np.isfinite(block))
            if bad.size:
                return lo + int(bad[0])
    return None
