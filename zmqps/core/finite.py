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
* :func:`first_nonfinite_of` checks all the arrays of one push at once. Given a
  :class:`Parts` runner (the PS's threads) and at least :data:`PARALLEL_BYTES`, their
  vectorized sums are split into ``runner.threads`` parts of equal bytes and summed
  at the same time (the compiled kernels release the GIL). One core reads about
  18 GB/s here, two about 40: the check stays one read of the gradient, a shorter
  one. Only when a sum is not 0 is the first bad element looked for, one array at a
  time in push order, so the answer is the same as a serial check's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from zmqps.core import _kernels

__all__ = ["PARALLEL_BYTES", "Parts", "first_nonfinite", "first_nonfinite_of"]

#: arrays up to this many elements go through the compiled loop (when there is one)
SMALL_ELEMS = 1 << 14
#: large arrays are summed this many elements at a time (256 KiB of float32)
BLOCK_ELEMS = 1 << 16
#: a push of at least this many bytes is checked by several threads at once
PARALLEL_BYTES = 8 << 20


class Parts(Protocol):
    """Runs calls at the same time, each on its own thread, the caller's included."""

    threads: int

    def run(self, calls: Sequence[Callable[[], bool]]) -> list[bool]: ...


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


def first_nonfinite_of(
    arrays: Sequence[np.ndarray[Any, Any]], parts: Parts | None = None
) -> tuple[int, int] | None:
    """``(j, i)``: element ``i`` of ``arrays[j]`` is the first NaN or infinity of the
    1-D float arrays in order, or None when all are finite."""
    if parts is not None and parts.threads > 1 and sum(a.nbytes for a in arrays) >= PARALLEL_BYTES:
        sums = [_kernels.kernel("nonfinite_sum", a) for a in arrays]
        if all(k is not None for k in sums):
            calls = [_summer(sums, part) for part in _split(arrays, parts.threads)]
            if all(parts.run(calls)):
                return None
    for j, a in enumerate(arrays):
        i = first_nonfinite(a)
        if i is not None:
            return j, i
    return None


Part = list[tuple[int, np.ndarray[Any, Any]]]


def _split(arrays: Sequence[np.ndarray[Any, Any]], k: int) -> list[Part]:
    """The arrays cut into ``k`` runs of about equal bytes: (array index, slice)."""
    share = -(-sum(a.nbytes for a in arrays) // k)
    out: list[Part] = [[]]
    room = share
    for j, a in enumerate(arrays):
        lo, n, size = 0, a.shape[0], a.itemsize
        while lo < n:
            take = min(n - lo, max(1, room // size))
            out[-1].append((j, a[lo : lo + take]))
            lo += take
            room -= take * size
            if room <= 0 and len(out) < k:
                out.append([])
                room = share
    return [p for p in out if p]


def _summer(sums: Sequence[Any], part: Part) -> Callable[[], bool]:
    """A call that says whether every piece of ``part`` is finite (its sum is 0)."""
    return lambda: all(sums[j](piece) == 0 for j, piece in part)
