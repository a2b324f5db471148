"""The compiled kernels themselves (numba), imported only by
:func:`zmqps.core._kernels.available` (numba is imported lazily: this module imports
it at its top). What each kernel computes, and the rules they keep, are in
:mod:`zmqps.core._kernels`.

Every kernel is a function of this module, never a closure: numba keys a cached
kernel by the pickled contents of its closure cells, and a cell holding another
kernel (a dispatcher, pickled with an identifier drawn anew in every process) made
each process miss the cache. The row kernels, which call the dense ones, were then
compiled again by every PS at its start (its kernels loaded in 1.6 s instead of
0.7) and added to the cache's index each time, which grew without bound.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

jit = numba.njit(nogil=True, cache=True, error_model="numpy")


@intrinsic  # type: ignore[misc]
def f32_of_bits(typingctx, u):  # type: ignore[no-untyped-def]
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic  # type: ignore[misc]
def bits_of_f32(typingctx, x):  # type: ignore[no-untyped-def]
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


def _g(g: Any, i: Any) -> Any:
    """Element ``i`` of a gradient: as it is, or widened from bfloat16 bits."""


@overload(_g, inline="always")  # type: ignore[misc]
def _g_impl(g, i):  # type: ignore[no-untyped-def]
    if g.dtype == types.uint16:
        return lambda g, i: f32_of_bits(np.uint32(g[i]) << np.uint32(16))  # type: ignore[call-arg]
    return lambda g, i: g[i]


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")  # type: ignore[misc]
def round16(x):  # type: ignore[no-untyped-def]
    # float32 -> bfloat16 bits, to nearest even; a NaN keeps its sign and stays a
    # (quiet) NaN rather than rounding to an infinity
    u = bits_of_f32(x)  # type: ignore[call-arg,var-annotated]
    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        r = (u >> np.uint32(16)) | np.uint32(0x40)
    return np.uint16(r)


def _put(w: Any, i: Any, x: Any) -> Any:
    """Element ``i`` of a wire copy set to ``x`` rounded (nothing when ``w`` is None)."""


@overload(_put, inline="always")  # type: ignore[misc]
def _put_impl(w, i, x):  # type: ignore[no-untyped-def]
    if isinstance(w, types.NoneType):
        return lambda w, i, x: None

    def put(w, i, x):  # type: ignore[no-untyped-def]
        w[i] = round16(x)

    return put


# The dense kernels take ``w`` after the gradient: None, or the bfloat16 bits of the
# shard's wire copy, which gets each new value rounded as it is written (one pass
# over the parameter instead of an update and then a rounding pass). The None
# variant is compiled apart and is the plain loop.
@jit  # type: ignore[misc]
def sgd(p, g, w, a, keep):  # type: ignore[no-untyped-def]
    # p = keep * p + a * g   (a = -lr * scale, keep = 1 - lr * wd)
    for i in range(p.shape[0]):
        pi = keep * p[i] + a * _g(g, i)
        p[i] = pi
        _put(w, i, pi)


@jit  # type: ignore[misc]
def momentum(p, g, w, m, lr, mu, scale, wd, nesterov):  # type: ignore[no-untyped-def]
    for i in range(p.shape[0]):
        gi = scale * _g(g, i) + wd * p[i]
        mi = mu * m[i] + gi
        m[i] = mi
        pi = p[i] - lr * (gi + mu * mi) if nesterov else p[i] - lr * mi
        p[i] = pi
        _put(w, i, pi)


@jit  # type: ignore[misc]
def adagrad(p, g, w, a, lr, eps, scale, wd):  # type: ignore[no-untyped-def]
    for i in range(p.shape[0]):
        gi = scale * _g(g, i) + wd * p[i]
        ai = a[i] + gi * gi
        a[i] = ai
        pi = p[i] - lr * gi / (np.sqrt(ai) + eps)
        p[i] = pi
        _put(w, i, pi)


@jit  # type: ignore[misc]
def adam(p, g, w, m, v, lr_t, c1, c2, eps, scale, wd):  # type: ignore[no-untyped-def]
    # c1 = 1 - beta1, c2 = 1 - beta2, in the parameters' dtype: an int literal here
    # (``1 - b1``) would promote the whole loop to float64 and halve its speed
    for i in range(p.shape[0]):
        gi = scale * _g(g, i) + wd * p[i]
        mi = m[i] + c1 * (gi - m[i])
        vi = v[i] + c2 * (gi * gi - v[i])
        m[i] = mi
        v[i] = vi
        pi = p[i] - lr_t * mi / (np.sqrt(vi) + eps)
        p[i] = pi
        _put(w, i, pi)


# Row variants: ``rows`` (unique local row ids) first, then 2-D parameter, 2-D
# gradient (one row per id) and 2-D slots; each touched row is updated in place,
# with no gather / scatter copies (and no wire copy: the store keeps one for
# whole-shard updates only). Each element is computed by the same expression as
# the dense kernel's, in the same dtypes (the same bits), in one loop nest: a call
# of the dense kernel per row cost about twice the memory traffic of the update.
@jit  # type: ignore[misc]
def sgd_rows(rows, p, g, a, keep):  # type: ignore[no-untyped-def]
    width = p.shape[1]
    for k in range(rows.shape[0]):
        r = rows[k]
        for c in range(width):
            p[r, c] = keep * p[r, c] + a * g[k, c]


@jit  # type: ignore[misc]
def momentum_rows(rows, p, g, m, lr, mu, scale, wd, nesterov):  # type: ignore[no-untyped-def]
    width = p.shape[1]
    for k in range(rows.shape[0]):
        r = rows[k]
        for c in range(width):
            gi = scale * g[k, c] + wd * p[r, c]
            mi = mu * m[r, c] + gi
            m[r, c] = mi
            p[r, c] = p[r, c] - lr * (gi + mu * mi) if nesterov else p[r, c] - lr * mi


@jit  # type: ignore[misc]
def adagrad_rows(rows, p, g, a, lr, eps, scale, wd):  # type: ignore[no-untyped-def]
    width = p.shape[1]
    for k in range(rows.shape[0]):
        r = rows[k]
        for c in range(width):
            gi = scale * g[k, c] + wd * p[r, c]
            ai = a[r, c] + gi * gi
            a[r, c] = ai
            p[r, c] = p[r, c] - lr * gi / (np.sqrt(ai) + eps)


@jit  # type: ignore[misc]
def adam_rows(rows, p, g, m, v, lr_t, c1, c2, eps, scale, wd):  # type: ignore[no-untyped-def]
    width = p.shape[1]
    for k in range(rows.shape[0]):
        r = rows[k]
        for c in range(width):
            gi = scale * g[k, c] + wd * p[r, c]
            mi = m[r, c] + c1 * (gi - m[r, c])
            vi = v[r, c] + c2 * (gi * gi - v[r, c])
            m[r, c] = mi
            v[r, c] = vi
            p[r, c] = p[r, c] - lr_t * mi / (np.sqrt(vi) + eps)


# The one kernel with a fastmath flag: reassociation only, so the sum vectorizes.
# Each term is y - y with y = x * k (k a power of two, so y is exact unless it
# overflows): +0 when y is finite, NaN when x is NaN or infinite or when y
# overflowed (|x| at or past the limit the caller chose k for). NaN survives any
# order of additions: the sum is 0 exactly when every x is finite and in range.
# (Not y * 0: reassociation may turn (x * k) * 0 into x * (k * 0) = x * 0, blind
# to overflow; y - y cannot fold without the nnan flag.)
@numba.njit(nogil=True, cache=True, error_model="numpy", fastmath={"reassoc"})  # type: ignore[misc]
def bad_sum(g, k):  # type: ignore[no-untyped-def]
    s = g.dtype.type(0)
    for i in range(g.shape[0]):
        y = g[i] * k
        s += y - y
    return s


@jit  # type: ignore[misc]
def first_bad(g, limit):  # type: ignore[no-untyped-def]
    # not (|x| < limit) holds for NaN, for an infinity and for |x| >= limit
    for i in range(g.shape[0]):
        if not abs(g[i]) < limit:
            return i
    return -1


@jit  # type: ignore[misc]
def bad_bits16(g, c):  # type: ignore[no-untyped-def]
    # bfloat16 bits: |x| is the low 15 bits, ordered as the magnitudes are, NaN and
    # the infinities above every finite value. With c = 0x8000 - limit bits,
    # (|x| + c) has its top bit set exactly when |x| >= the limit: one OR of them
    # all says whether any is (an OR vectorizes where a maximum of uint16 does not)
    acc = np.uint16(0)
    for i in range(g.shape[0]):
        acc |= (g[i] & np.uint16(0x7FFF)) + c
    return (acc & np.uint16(0x8000)) != 0


@jit  # type: ignore[misc]
def bad_words16(w, c4):  # type: ignore[no-untyped-def]
    # bad_bits16 four elements at a time (a uint64 word; c4 is c in each lane): a
    # lane's sum stays below 0x10000, so nothing carries into the next lane
    acc = np.uint64(0)
    for i in range(w.shape[0]):
        acc |= (w[i] & np.uint64(0x7FFF7FFF7FFF7FFF)) + c4
    return (acc & np.uint64(0x8000800080008000)) != 0


@jit  # type: ignore[misc]
def first_bad16(g, limit_bits):  # type: ignore[no-untyped-def]
    for i in range(g.shape[0]):
        if (g[i] & np.uint16(0x7FFF)) >= limit_bits:
            return i
    return -1


@jit  # type: ignore[misc]
def narrow_bf16(src, dst):  # type: ignore[no-untyped-def]
    for i in range(src.shape[0]):
        dst[i] = round16(src[i])


@jit  # type: ignore[misc]
def widen_bf16(src, dst):  # type: ignore[no-untyped-def]
    for i in range(src.shape[0]):
        dst[i] = f32_of_bits(np.uint32(src[i]) << np.uint32(16))  # type: ignore[call-arg]


# The rows of a batch's repeated ids summed into one row per distinct id, in one
# pass: row i goes to out[inverse[i]], copied the first time, added after (in i
# order: what a stable sort and a sum of each run in order gives)
@jit  # type: ignore[misc]
def sum_rows(g, inverse, out, seen):  # type: ignore[no-untyped-def]
    width = g.shape[1]
    for i in range(g.shape[0]):
        j = inverse[i]
        if seen[j]:
            for c in range(width):
                out[j, c] += g[i, c]
        else:
            seen[j] = True
            for c in range(width):
                out[j, c] = g[i, c]


# Row ids to a fixed-size shard's local row numbers: out[i] = ids[i] - start, each
# checked to lie in [0, n) (False at the first that does not; out is then partly
# written), in one pass instead of a minimum, a maximum, a conversion and a
# subtraction over the ids
@jit  # type: ignore[misc]
def local_rows(ids, start, n, out):  # type: ignore[no-untyped-def]
    for i in range(ids.shape[0]):
        k = ids[i] - start
        if k < 0 or k >= n:
            return False
        out[i] = k
    return True


# Whether keys are strictly increasing (distinct and sorted: what a client sends)
@jit  # type: ignore[misc]
def increasing(keys):  # type: ignore[no-untyped-def]
    for i in range(1, keys.shape[0]):  # noqa: SIM110 (numba compiles no generator)
        if keys[i] <= keys[i - 1]:
            return False
    return True


# A batch's distinct ids and ``inverse`` (``ids == uniq[inverse]``) with one sort of
# plain int64 values instead of an argsort: each id packed with its position in the
# low ``bits`` bits (``pack_positions``; False if an id is too large to pack), the
# packed values sorted (numpy's vectorized sort), then one pass (``unpack_sorted``)
# writes each distinct id once and each position's rank among them; returns how many
# distinct ids there are. The same arrays as ``np.unique(ids, return_inverse=True)``.
@jit  # type: ignore[misc]
def pack_positions(ids, bits, out):  # type: ignore[no-untyped-def]
    lim = np.int64(1) << np.int64(62 - bits)
    for i in range(ids.shape[0]):
        v = ids[i]
        if v >= lim or v < -lim:
            return False
        out[i] = (v << np.int64(bits)) | np.int64(i)
    return True


@jit  # type: ignore[misc]
def unpack_sorted(packed, bits, uniq, inverse):  # type: ignore[no-untyped-def]
    mask = (np.int64(1) << np.int64(bits)) - np.int64(1)
    k = -1
    prev = np.int64(0)
    for i in range(packed.shape[0]):
        v = packed[i] >> np.int64(bits)
        if k < 0 or v != prev:
            k += 1
            uniq[k] = v
            prev = v
        inverse[packed[i] & mask] = k
    return k + 1


# Whether two id arrays of one length are equal (the first difference ends it)
@jit  # type: ignore[misc]
def equal_ids(a, b):  # type: ignore[no-untyped-def]
    for i in range(a.shape[0]):  # noqa: SIM110 (numba compiles no generator)
        if a[i] != b[i]:
            return False
    return True


# sum_rows in the order of the ids sorted with their positions (``unique_inverse``'s
# packed values): each distinct id's row written once, in order (the rows of one id
# in the batch's order: the first copied, the others added, as sum_rows adds them)
@jit  # type: ignore[misc]
def sum_sorted_rows(g, packed, bits, out):  # type: ignore[no-untyped-def]
    mask = (np.int64(1) << np.int64(bits)) - np.int64(1)
    width = g.shape[1]
    j = -1
    prev = np.int64(0)
    for k in range(packed.shape[0]):
        v = packed[k] >> np.int64(bits)
        i = packed[k] & mask
        if j < 0 or v != prev:
            j += 1
            prev = v
            for c in range(width):
                out[j, c] = g[i, c]
        else:
            for c in range(width):
                out[j, c] += g[i, c]


@jit  # type: ignore[misc]
def add_into(acc, g):  # type: ignore[no-untyped-def]
    for i in range(acc.shape[0]):
        acc[i] += _g(g, i)


KERNELS: dict[str, Any] = {
    "bad_bits16": bad_bits16,
    "bad_words16": bad_words16,
    "first_bad16": first_bad16,
    "narrow_bf16": narrow_bf16,
    "widen_bf16": widen_bf16,
    "add_into": add_into,
    "local_rows": local_rows,
    "pack_positions": pack_positions,
    "equal_ids": equal_ids,
    "unpack_sorted": unpack_sorted,
    "increasing": increasing,
    "sum_rows": sum_rows,
    "sum_sorted_rows": sum_sorted_rows,
    "first_bad": first_bad,
    "bad_sum": bad_sum,
    "sgd": sgd,
    "momentum": momentum,
    "adagrad": adagrad,
    "adam": adam,
    "sgd_rows": sgd_rows,
    "momentum_rows": momentum_rows,
    "adagrad_rows": adagrad_rows,
    "adam_rows": adam_rows,
}
