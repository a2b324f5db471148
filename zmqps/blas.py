"""The threads of numpy's BLAS (OpenBLAS, MKL) and of OpenMP, as the environment
sets them when a process starts (they are read once, as numpy is imported).

Rules of this module:

* It imports nothing of zmqps or numpy: the console scripts call it before their
  heavy imports.
* A variable the user set wins: nothing here changes it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

__all__ = ["THREAD_VARS", "one_thread", "user_chose"]

#: what numpy's BLAS (OpenBLAS, MKL) and OpenMP read for their number of threads
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def user_chose(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` sets any of :data:`THREAD_VARS`."""
    return any(v in environ for v in THREAD_VARS)


def one_thread(environ: MutableMapping[str, str] | None = None) -> bool:
    """One BLAS thread for a process that computes nothing BLAS runs in parallel (a
    chief, a PS): :data:`THREAD_VARS` set to 1 in ``environ`` (this process's by
    default), unless the user set any of them; whether they were set. Else OpenBLAS
    starts a thread per core as numpy is imported, and each spins for a while after
    any call: measured 0.13 s of CPU at every start (0.22 s against 0.09 for
    ``import numpy`` on 2 cores), taken from the workers that share the machine."""
    env = os.environ if environ is None else environ
    if user_chose(env):
        return False
    env.update(dict.fromkeys(THREAD_VARS, "1"))
    return True
