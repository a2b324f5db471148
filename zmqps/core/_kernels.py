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
* numba is imported lazily; :data:`available` says whether it could be.
  No fastmath: results are IEEE-exact like numpy (an FMA would differ in the last bit);
  ``error_model="numpy"`` keeps divisions vectorizable; single-threaded, because
  a PS shares its cores with the transport and, on one host, with workers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["available", "kernel"]

_KERNELS: dict[str, Any] | None = None
_FAILED = False


def _build() -> dict[str, Any] | None:
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency; kept for odd platforms
        return None
    jit = numba.njit(nogil=True, cache=True, error_model="numpy")

    @jit  # type: ignore[misc]
    def sgd(p, g, a, keep):  # type: ignore[no-untyped-def]
        # p = keep * p + a * g   (a = -lr * scale, keep = 1 - lr * wd)
        for i in range(p.shape[0]):
            p[i] = keep * p[i] + a * g[i]

    @jit  # type: ignore[misc]
    def momentum(p, g, m, lr, mu, scale, wd, nesterov):  # type: ignore[no-untyped-def]
        for i in range(p.shape[0]):
            gi = scale * g[i] + wd * p[i]
            mi = mu * m[i] + gi
            m[i] = mi
            if nesterov:
                p[i] -= lr * (gi + mu * mi)
            else:
                p[i] -= lr * mi

    @jit  # type: ignore[misc]
    def adagrad(p, g, a, lr, eps, scale, wd):  # type: ignore[no-untyped-def]
        for i in range(p.shape[0]):
            gi = scale * g[i] + wd * p[i]
            ai = a[i] + gi * gi
            a[i] = ai
            p[i] -= lr * gi / (np.sqrt(ai) + eps)

    @jit  # type: ignore[misc]
    def adam(p, g, m, v, lr_t, c1, c2, eps, scale, wd):  # type: ignore[no-untyped-def]
        # c1 = 1 - beta1, c2 = 1 - beta2, in the parameters' dtype: an int literal here
        # (``1 - b1``) would promote the whole loop to float64 and halve its speed
        for i in range(p.shape[0]):
            gi = scale * g[i] + wd * p[i]
            mi = m[i] + c1 * (gi - m[i])
            vi = v[i] + c2 * (gi * gi - v[i])
            m[i] = mi
            v[i] = vi
            p[i] -= lr_t * mi / (np.sqrt(vi) + eps)

    # Row variants: ``rows`` (unique local row ids) first, then 2-D parameter, 2-D
    # gradient (one row per id) and 2-D slots; each touched row is updated in place
    # by the dense kernel, with no gather / scatter copies.
    @jit  # type: ignore[misc]
    def sgd_rows(rows, p, g, a, keep):  # type: ignore[no-untyped-def]
        for k in range(rows.shape[0]):
            sgd(p[rows[k]], g[k], a, keep)

    @jit  # type: ignore[misc]
    def momentum_rows(rows, p, g, m, lr, mu, scale, wd, nesterov):  # type: ignore[no-untyped-def]
        for k in range(rows.shape[0]):
            r = rows[k]
            momentum(p[r], g[k], m[r], lr, mu, scale, wd, nesterov)

    @jit  # type: ignore[misc]
    def adagrad_rows(rows, p, g, a, lr, eps, scale, wd):  # type: ignore[no-untyped-def]
        for k in range(rows.shape[0]):
            r = rows[k]
            adagrad(p[r], g[k], a[r], lr, eps, scale, wd)

    @jit  # type: ignore[misc]
    def adam_rows(rows, p, g, m, v, lr_t, c1, c2, eps, scale, wd):  # type: ignore[no-untyped-def]
        for k in range(rows.shape[0]):
            r = rows[k]
            adam(p[r], g[k], m[r], v[r], lr_t, c1, c2, eps, scale, wd)

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

    return {
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


def available() -> bool:
    global _KERNELS, _FAILED
    if _KERNELS is None and not _FAILED:
        _KERNELS = _build()
        _FAILED = _KERNELS is None
    return _KERNELS is not None


def kernel(name: str, param: np.ndarray[Any, Any]) -> Any:
    """The fused kernel for optimizer ``name`` (or ``first_bad``, ``bad_sum``) and this
    parameter (array), or None (numpy path)."""
    if param.dtype not in (np.float32, np.float64) or not available():
        return None
    assert _KERNELS is not None
    return _KERNELS.get(name)
