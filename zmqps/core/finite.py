"""Value checks of pushed gradients (sans-IO): finite, and in range.

Rules of this module:

* A pushed value is *bad* when it is NaN, an infinity, or so large that an update
  could overflow: ``|x| >= LIMITS[dtype]``. The limits are powers of two far past
  any trained gradient and far below overflow: a limit's square, summed over every
  row id one push may repeat, stays finite, so no optimizer's slot (Adam's and
  Adagrad's squares, FTRL's accumulator, momentum's sum) nor parameter can reach
  infinity from one push (see ``LIMITS``).
* :func:`first_bad` finds the first bad element of a 1-D float array, or says there
  is none, allocating nothing on the common path (all good).
* With numba (float32 / float64): small arrays (most shards of a model of many
  variables) go through one compiled loop that stops at the first bad element; large
  ones through one vectorized sum of ``y - y`` with ``y = x * k``, ``k`` the power of
  two that takes the limit to the overflow threshold: 0 for a good x, NaN otherwise
  (it cannot overflow), and only when it is not 0 through the loop. That is one read
  of the gradient, at about 26 GB/s on one core; the multiply is free at that speed.
* Without (or for float16): a block at a time, its minimum and maximum (numpy's
  vectorized reductions, which keep NaN): only a block with a bad one in it is
  looked at element by element.
* bfloat16 gradients (a variable's wire dtype, :mod:`zmqps.core.lowp`) are checked
  on their bits: ``|x|`` is the low 15 bits, ordered as the magnitudes are, with NaN
  and the infinities above every finite value, so one integer maximum compared with
  the limit's bits says whether any is bad. Their limit is float32's: the update
  runs in float32.
* :func:`first_bad_of` checks all the arrays of one push at once. Given a
  :class:`Parts` runner (the PS's threads) and at least :data:`PARALLEL_BYTES`, their
  vectorized sums are split into ``runner.threads`` parts of equal bytes and summed
  at the same time (the compiled kernels release the GIL). One core reads about
  18 GB/s here, two about 40: the check stays one read of the gradient, a shorter
  one. Only when a sum is not 0 is the first bad element looked for, one array at a
  time in push order, so the answer is the same as a serial check's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from zmqps.core import _kernels
from zmqps.wire.codec import is_bfloat16

__all__ = ["LIMITS", "PARALLEL_BYTES", "Parts", "first_bad", "first_bad_of", "limit"]

#: arrays up to this many elements go through the compiled loop (when there is one)
SMALL_ELEMS = 1 << 14
#: large arrays are summed this many elements at a time (256 KiB of float32)
BLOCK_ELEMS = 1 << 16
#: a push of at least this many bytes is checked by several threads at once
PARALLEL_BYTES = 8 << 20

#: Pushed values at or past these magnitudes are refused. float32: 2**32 (4.3e9);
#: its square is 2**64 and, repeated by the 2**20 row ids a push may name
#: (``MAX_ROWS``), 2**104: Adam, Adagrad and FTRL stay 2**24 pushes of nothing but
#: such values away from float32's 2**128. float64 likewise. float16 variables are
#: updated in float32 (slots too), so only the parameter itself is float16; 2**15 is
#: a first filter only: repeated row ids add up and the learning rate multiplies, so
#: an update that would still take a float16 parameter past 65504 is undone and
#: refused whole (``ShardStore.apply_all``): a float16 parameter never becomes infinite.
#: bfloat16 (float32's upper half) has float32's.
LIMITS: dict[str, float] = {
    "float16": 2.0**15,
    "float32": 2.0**32,
    "float64": 2.0**256,
    "bfloat16": 2.0**32,
}
#: the bits of the bfloat16 limit (a power of two: exact), and what the OR-check of
#: bfloat16 bits adds to each element's magnitude (one lane, four lanes)
_LIMIT_BITS16 = np.uint16(int(np.array(LIMITS["bfloat16"], np.float32).view(np.uint32)) >> 16)
_C16 = np.uint16(0x8000 - int(_LIMIT_BITS16))
_C64 = np.uint64(int(_C16) * 0x0001000100010001)


class Parts(Protocol):
    """Runs calls at the same time, each on its own thread, the caller's included."""

    threads: int

    def run(self, calls: Sequence[Callable[[], bool]]) -> list[bool]: ...


@functools.cache
def limit(dtype: np.dtype[Any]) -> float:
    """The magnitude at which a pushed value of ``dtype`` is refused."""
    return LIMITS["bfloat16" if is_bfloat16(dtype) else np.dtype(dtype).name]


@functools.cache
def _scale(dtype: np.dtype[Any]) -> Any:
    """``k``: ``x * k`` overflows exactly when ``|x| >= limit(dtype)`` (both powers of
    two, so the product is exact until it overflows), as the array's own dtype."""
    info = np.finfo(dtype)
    return dtype.type(2.0 ** (info.maxexp - math.log2(limit(dtype))))


def first_bad(a: np.ndarray[Any, Any]) -> int | None:
    """The index of the first NaN, infinity or out-of-range value (``|x| >=
    limit(a.dtype)``) of the 1-D float array ``a``, or None."""
    if is_bfloat16(a.dtype):
        return _first_bad16(a)
    n = a.shape[0]
    lim = limit(a.dtype)
    loop = _kernels.kernel("first_bad", a)
    if loop is not None:
        if n > SMALL_ELEMS and _kernels.kernel("bad_sum", a)(a, _scale(a.dtype)) == 0:
            return None  # the common case: one vectorized pass, at memory bandwidth
        i = int(loop(a, lim))
        return None if i < 0 else i
    for lo in range(0, n, BLOCK_ELEMS):
        block = a[lo : lo + BLOCK_ELEMS]
        if -lim < float(block.min()) and float(block.max()) < lim:
            continue  # NaN fails both comparisons
        bad = np.flatnonzero(~(np.abs(block.astype(np.float64)) < lim))
        if bad.size:
            return lo + int(bad[0])
    return None


def _any_bad16(bits: np.ndarray[Any, Any]) -> bool:
    """Whether some element of the bfloat16 bits ``bits`` is bad (compiled: the words
    of four elements between an unaligned head and tail)."""
    one, four = _kernels.bits_kernel("bad_bits16"), _kernels.bits_kernel("bad_words16")
    n = bits.shape[0]
    head = min(n, (-bits.ctypes.data % 8) // 2)
    body = (n - head) // 4 * 4
    return bool(
        one(bits[:head], _C16)
        or (body and four(bits[head : head + body].view(np.uint64), _C64))
        or one(bits[head + body :], _C16)
    )


def _first_bad16(a: np.ndarray[Any, Any]) -> int | None:
    """:func:`first_bad` of a bfloat16 array, on its bits."""
    bits = a.view(np.uint16)
    if _kernels.bits_kernel("bad_bits16") is not None:
        if not _any_bad16(bits):
            return None
        i = int(_kernels.bits_kernel("first_bad16")(bits, _LIMIT_BITS16))
        return None if i < 0 else i
    bad = np.flatnonzero((bits & np.uint16(0x7FFF)) >= _LIMIT_BITS16)
    return int(bad[0]) if bad.size else None


def _all_good(a: np.ndarray[Any, Any]) -> Callable[[np.ndarray[Any, Any]], bool] | None:
    """A compiled check that a piece of an array like ``a`` holds no bad value, which
    releases the GIL (None: none for this dtype)."""
    if is_bfloat16(a.dtype):
        if _kernels.bits_kernel("bad_bits16") is None:
            return None
        return lambda piece: not _any_bad16(piece.view(np.uint16))
    total = _kernels.kernel("bad_sum", a)
    if total is None:
        return None
    k = _scale(a.dtype)
    return lambda piece: bool(total(piece, k) == 0)


def first_bad_of(
    arrays: Sequence[np.ndarray[Any, Any]], parts: Parts | None = None
) -> tuple[int, int] | None:
    """``(j, i)``: element ``i`` of ``arrays[j]`` is the first bad value (see
    :func:`first_bad`) of the 1-D float arrays in order, or None when all are good."""
    if parts is not None and parts.threads > 1 and sum(a.nbytes for a in arrays) >= PARALLEL_BYTES:
        checks = [_all_good(a) for a in arrays]
        if all(c is not None for c in checks):
            calls = [_checker(checks, part) for part in _split(arrays, parts.threads)]
            if all(parts.run(calls)):
                return None
    for j, a in enumerate(arrays):
        i = first_bad(a)
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


def _checker(checks: Sequence[Any], part: Part) -> Callable[[], bool]:
    """A call that says whether every piece of ``part`` is good."""
    return lambda: all(checks[j](piece) for j, piece in part)
