"""Finite checks of pushed values (sans-IO).

Rules of this module:

* :func:`first_nonfinite` finds the first NaN or infinity of a 1-D float array, or
  says there is none, allocating nothing on the common path (all finite).
* Small arrays (most shards of a model of many variables) go through one compiled
  loop when numba is there: one call, no temporaries. Large ones are summed a block
  at a time (numpy's vectorized reduction, at memory bandwidth): a sum is finite only
  if every term is, so only a block whose sum is not finite (a NaN or an infinity in
  it, or finite values whose sum overflows) is looked at element by element.
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
    if n <= SMALL_ELEMS:
        loop = _kernels.kernel("first_nonfinite", a)
        if loop is not None:
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
