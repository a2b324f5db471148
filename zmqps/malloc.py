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

It also keeps one arena for every thread (``MALLOC_ARENA_MAX=1``). ZeroMQ's I/O
thread allocates every frame received; in an arena of its own those come from
heaps of at most 64 MiB, and a heap emptied is unmapped whatever the trim
threshold: a PS receiving more than one heap's worth per step (a push and a
backup's entry) mapped a fresh heap and faulted on every page of it, each step
(626,000 page faults in a 20-step dense bench with two copies, 160,000 with one
arena; its system time fell by 40 %). The threads allocate a few large blocks
each, so one arena's lock is not contended.

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

__all__ = ["ARENAS", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_malloc"]

#: allocations at or above this many bytes are mapped on their own
MMAP_THRESHOLD = 64 << 20
#: free bytes at the top of the heap kept rather than returned to the system
TRIM_THRESHOLD = 256 << 20
#: arenas the process' threads share
ARENAS = 1
_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_tuned: bool | None = None


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds and keep one arena, once per process;
    True if it took all three."""
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
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        and mallopt(_M_ARENA_MAX, ARENAS)
    )
    return _tuned
