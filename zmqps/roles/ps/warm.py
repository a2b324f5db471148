"""Loading the compiled kernels before they are needed (numba's first call).

The fused optimizer kernels and the value checks (:mod:`zmqps.core._kernels`) are
compiled by numba, cached on disk, and loaded on first use. That first use costs
more than one might think: importing numba (and the scipy it brings), setting up its
typing context, and loading each kernel's cached code took 1 to 4 s of one core on a
loaded 2-core machine, all in the caller's thread. A PS made that call in its event
loop on its first push: for those seconds it answered nobody, and a chief with a
heartbeat timeout of 2.5 s took every PS for dead at once and restored the cluster
from its checkpoint in an unfaulted run.

Rules of this module:

* :func:`warm_kernels` runs, once per process, the code paths a PS runs on values
  (the value check of a push, the sum of a push's repeated row ids, each
  optimizer's dense and row update, all on float32) on a few elements each, so
  that later calls find every kernel loaded. Other dtypes, and the kernels of a
  bfloat16 wire, still load on first use (a few milliseconds from the cache): warming
  those would import ``ml_dtypes`` (most of a second) in every PS, and hold every
  PS's first pushes that long, for a variant few runs use.
* It is meant for a thread: a PS starts it there as it starts serving and holds
  the requests that may need a kernel (not its event loop) until it is done
  (:class:`~zmqps.roles.ps.serve.KernelGate`).
* It changes no state anyone reads: its arrays are its own. Two threads may build
  the kernel table at once (``_kernels.available`` takes no lock, :mod:`zmqps.core`
  being free of threads); the requests that would need it wait, so that does not
  happen in a PS.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from zmqps.core import _kernels, finite, segments
from zmqps.core.optimizers import OPTIMIZERS, make_optimizer

__all__ = ["warm_kernels"]

_lock = threading.Lock()
_seconds: float | None = None


def warm_kernels() -> float:
    """Load every float32 kernel a PS uses (once per process: later calls return at
    once); the seconds the first call took (0.0 without numba: nothing to load)."""
    global _seconds
    with _lock:
        if _seconds is not None:
            return _seconds
        started = time.perf_counter()
        if _kernels.available():
            _exercise()
        _seconds = time.perf_counter() - started
        return _seconds


def _exercise() -> None:
    n, width = finite.SMALL_ELEMS + 1, 4  # past SMALL_ELEMS: the vectorized check too
    finite.first_bad(np.zeros(n, np.float32))
    segments.load_kernels()  # a push's repeated row ids summed
    ids = np.array([3, 4], np.int64)  # a row request's ids to a shard's keys, their order
    _kernels.index_kernel("local_rows", ids)(ids, 3, 2, np.empty(2, np.int64))
    _kernels.index_kernel("increasing", ids)(ids)
    for name in OPTIMIZERS:
        opt = make_optimizer({"name": name, "lr": 0.1})
        param = np.zeros(8, np.float32)
        scratch = np.zeros(opt.scratch_factor * param.size, np.float32)
        opt.apply_dense(param, np.ones(8, np.float32), opt.init_slots((8,), "float32"), 1, scratch)
        table = np.zeros((3, width), np.float32)
        rows = np.array([0, 2], np.int64)
        grads = np.ones((2, width), np.float32)
        opt.apply_rows(table, rows, grads, opt.init_slots(table.shape, "float32"), 1)
