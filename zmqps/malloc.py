"""Keeping the C allocator's buffers between steps (glibc ``mallopt``).

Every step of a worker and a PS allocates and frees the same large arrays: row
blocks, gathered gradients, received frames, a few hundred KiB to a few MiB each.
glibc serves an allocation at or above its mmap threshold with a fresh ``mmap``
and unmaps it on free, so the next step touches new pages and takes a page fault
per 4 KiB; and it returns the top of the heap to the system past its trim
threshold. Its dynamic threshold only adapts after a free, and not beyond what
it last saw. :func:`tune_malloc` raises both (allocations below 64 MiB come from
the heap, and up to 256 MiB of free heap are kept), which is what
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` would do from the
environment, but from inside the process.

Rules of this module:

* zmqps' own processes (``zmqps-server``, ``zmqps-worker``, ``zmqps launch``'s
  children) call it at start; a program using :class:`zmqps.Worker` decides for
  itself (it changes the whole process' allocator).
* ``ZMQPS_MALLOC=default`` leaves the allocator as it is; on a C library without
  ``mallopt`` (musl, macOS) nothing changes.
* Arrays of 64 MiB and more (PS shards) are still mapped on their own and return
  to the system when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_malloc"]

#: allocations at or above this many bytes are mapped on their own
MMAP_THRESHOLD = 64 << 20
#: free bytes at the top of the heap kept rather than returned to the system
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3

_tuned: bool | None = None


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; True if they were."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if os.environ.get("ZMQPS_MALLOC", "").strip().lower() == "default":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _tuned = bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _tuned
