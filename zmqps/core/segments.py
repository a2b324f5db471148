"""Summing runs of equal keys: the rows of repeated ids, sorted together, into one row each.

``np.add.reduceat(values, starts, axis=0)`` does it, but pays a fixed cost per run:
about 1.2 ms for 4096 rows of 64 float32 in ~4000 runs, which is what a batch of
ids drawn from a large vocabulary looks like. :func:`sum_runs` instead takes the
first row of every run, then adds the second rows of all runs that have one in one
fancy-indexed step, then the third rows, and so on: as many numpy passes as the
longest run, each touching only the rows that exist (about 0.18 ms for the same
batch). Within a run rows are added in their order, first to last, as reduceat
and ``np.add.at`` do. Runs longer than :data:`MAX_PASSES` (a few hot ids repeated
hundreds of times) go to reduceat, which is the faster one there.

:func:`sum_rows` does the same from a batch's ``inverse`` (``ids == uniq[inverse]``,
as ``np.unique`` gives it) without sorting the rows first: a compiled kernel
(:mod:`zmqps.core._kernels`) reads each row once and copies or adds it into its id's
row, in the batch's order, which is the order a stable sort puts each run in. The
result is the one :func:`sum_runs` gives on the stably sorted rows, bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.core import _kernels

__all__ = [
    "MAX_PASSES",
    "Order",
    "load_kernels",
    "same_ids",
    "sum_rows",
    "sum_runs",
    "unique_inverse",
    "unique_sorted",
]

Array = npt.NDArray[Any]

#: longest run summed pass by pass; longer ones use ``np.add.reduceat``
MAX_PASSES = 16


def sum_runs(values: Array, starts: Array) -> Array:
    """One row per run of ``values`` (rows already grouped): ``starts`` are the first
    row of each run, ascending, ``starts[0] == 0``. Returns a new array."""
    n = values.shape[0]
    starts = np.asarray(starts, np.int64)
    out: Array = values[starts]
    if starts.size == n:
        return out
    lengths = np.diff(np.append(starts, n))
    if int(lengths.max()) > MAX_PASSES:
        summed: Array = np.add.reduceat(values, starts, axis=0)
        return summed
    run = np.repeat(np.arange(starts.size), lengths)  # the run of every row
    pos = np.arange(n) - starts[run]  # its place in the run (0: the first)
    for k in range(1, int(lengths.max())):
        rows = np.flatnonzero(pos == k)  # the k-th row of every run that has one
        out[run[rows]] += values[rows]  # no run twice: plain fancy indexing adds right
    return out


#: the ids of a batch sorted with their positions (each ``id << bits | position``) and
#: ``bits``, as :func:`unique_sorted` makes them: the order :func:`sum_rows` may follow
Order = tuple[Array, int]


def sum_rows(
    values: Array,
    inverse: Array,
    size: int,
    *,
    load: bool = True,
    out: Array | None = None,
    order: Order | None = None,
) -> Array:
    """One row per distinct id of a batch: row ``j`` of the result is the sum of the
    rows ``values[i]`` with ``inverse[i] == j``, the first copied and the others added
    in order of ``i``. Every ``j`` in ``[0, size)`` must occur in ``inverse`` (as
    ``np.unique(ids, return_inverse=True)`` makes it). Returns a new array of
    ``values``' dtype and row shape.

    float32 / float64 rows go through the compiled kernel (one pass, no sort), other
    dtypes through :func:`sum_runs`. ``load=False``: the kernel only once
    :func:`load_kernels` loaded it (an event loop must not wait seconds for numba;
    a thread that may calls that first). ``out``: written there instead (``size``
    rows of ``values``' dtype and row shape, C-contiguous; every row is written) and
    returned. ``order``: the batch's ids sorted with their positions
    (:func:`unique_sorted`, when ``inverse`` is its): the kernel then writes each
    distinct id's row once, in order (the same bits)."""
    n = values.shape[0]
    inverse = np.asarray(inverse).reshape(-1).astype(np.int64, copy=False)
    if inverse.shape[0] != n:
        raise ValueError(f"sum_rows: {inverse.shape[0]} inverse entries for {n} rows")
    row_shape = values.shape[1:]
    if out is not None and (
        out.shape != (size, *row_shape) or out.dtype != values.dtype or not out.flags.c_contiguous
    ):
        raise ValueError(f"sum_rows: out is {out.shape} {out.dtype}, not {(size, *row_shape)}")
    if n == 0 or size == 0:
        return np.empty((size, *row_shape), values.dtype) if out is None else out
    fused = _kernels.kernel("sum_rows", values) if load or _loaded else None
    if fused is not None:
        g = np.ascontiguousarray(values).reshape(n, -1)
        flat = np.empty((size, g.shape[1]), values.dtype) if out is None else out.reshape(size, -1)
        if order is not None and order[0].shape[0] == n:
            _kernels.kernel("sum_sorted_rows", values)(g, order[0], order[1], flat)
        else:
            fused(g, inverse, flat, np.zeros(size, np.bool_))
        return flat.reshape((size, *row_shape)) if out is None else out
    stable = np.argsort(inverse, kind="stable")
    ranked = inverse[stable]
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    summed = sum_runs(values[stable], starts)
    if out is None:
        return summed
    out[...] = summed
    return out


def unique_inverse(ids: Array, *, load: bool = True) -> tuple[Array, Array]:
    """``np.unique(ids, return_inverse=True)`` of a 1-D array (``inverse`` 1-D): for
    int64 ids, through compiled kernels (one sort of the ids packed with their
    positions, then one pass; about a third of the time for a batch of 4096), the
    same arrays. ``load=False``: the kernels only once :func:`load_kernels` loaded
    them, as :func:`sum_rows`."""
    uniq, inverse, _ = unique_sorted(ids, load=load)
    return uniq, inverse


def unique_sorted(ids: Array, *, load: bool = True) -> tuple[Array, Array, Order | None]:
    """:func:`unique_inverse`, and the :data:`Order` it sorted when it took the
    compiled path (else None)."""
    n = ids.shape[0]
    pack = _kernels.index_kernel("pack_positions", ids) if n > 1 and (load or _loaded) else None
    if pack is not None:
        bits = (n - 1).bit_length()
        packed = np.empty(n, np.int64)
        if pack(ids, bits, packed):  # else an id too large to pack with its position
            packed.sort()
            uniq = np.empty(n, np.int64)
            inverse = np.empty(n, np.intp)
            m = _kernels.index_kernel("unpack_sorted", ids)(packed, bits, uniq, inverse)
            return uniq[:m], inverse, (packed, bits)
    uniq, inverse = np.unique(ids, return_inverse=True)
    return uniq, inverse.reshape(-1), None


def same_ids(a: Array, b: Array, *, load: bool = True) -> bool:
    """Whether 1-D id arrays ``a`` and ``b`` are equal (``np.array_equal``): for int64
    ids, compiled (one pass that stops at the first difference, no temporary).
    ``load=False``: the kernel only once :func:`load_kernels` loaded it."""
    if a.shape != b.shape:
        return False
    equal = _kernels.index_kernel("equal_ids", a) if load or _loaded else None
    if equal is not None and _kernels.index_kernel("equal_ids", b) is not None:
        return bool(equal(a, b))
    return bool(np.array_equal(a, b))


def load_kernels() -> None:
    """Load the compiled row kernels now (numba's first call: up to seconds), so that
    :func:`sum_rows` and :func:`unique_inverse` with ``load=False`` find them; a
    no-op after the first call."""
    global _loaded
    if not _loaded:
        sum_rows(np.zeros((2, 1), np.float32), np.zeros(2, np.int64), 1)
        ids = np.array([5, 3, 5], np.int64)
        uniq, inverse, order = unique_sorted(ids)
        sum_rows(np.zeros((3, 1), np.float32), inverse, uniq.shape[0], order=order)
        same_ids(np.zeros(2, np.int64), np.zeros(2, np.int64))
        _loaded = True


_loaded = False
