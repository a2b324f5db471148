"""Room in a ring of bytes, handed out and taken back in order (sans-IO).

What it is for: a primary that shares a host with a backup writes the tensors of
each replication entry into a region of shared memory both map (a ring), and the
entry names where they are; the backup reads them there instead of from a socket
(:mod:`zmqps.roles.ps.replica`). This module decides where each entry's bytes go;
it never touches memory.

Rules of this module:

* Each block belongs to one key (an entry's index); keys are handed out in
  increasing order and taken back in that order (:meth:`RingSpace.free_through`),
  so the live blocks form one run around the ring, oldest first.
* A block is contiguous: one that does not fit before the end of the ring starts at
  0, if the oldest live block leaves room there. Blocks start on
  :data:`ALIGN`-byte boundaries, so any tensor dtype is aligned in them.
* Live blocks never overlap and never leave ``[0, size)``; a request with no room
  gets None (the caller sends the bytes another way): nothing waits here.
* The block of a key asked for again (an entry sent again) is the one it got.
"""

from __future__ import annotations

from collections import deque

__all__ = ["ALIGN", "RingSpace", "aligned"]

#: every block starts at a multiple of this (a cache line; every dtype's alignment)
ALIGN = 64


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


class RingSpace:
    """The live blocks of a ring of ``size`` bytes: key -> (offset, bytes)."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"a ring of {size} bytes")
        self.size = size - size % ALIGN
        self._blocks: deque[tuple[int, int, int]] = deque()  # (key, offset, bytes), oldest first
        self._by_key: dict[int, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def used(self) -> int:
        """Bytes held by live blocks (padding to the ring's end not counted)."""
        return sum(n for _, _, n in self._blocks)

    def get(self, key: int) -> int | None:
        """The offset of ``key``'s live block, or None."""
        block = self._by_key.get(key)
        return None if block is None else block[0]

    def alloc(self, key: int, nbytes: int) -> int | None:
        """A block of ``nbytes`` for ``key`` (the one it has, if live): its offset, or
        None when the ring has no contiguous room for it now, or when ``key`` is not
        above every live key (blocks go back in the order of their keys)."""
        known = self._by_key.get(key)
        if known is not None:
            return known[0] if known[1] >= nbytes else None
        if self._blocks and key <= self._blocks[-1][0]:
            return None
        n = aligned(max(nbytes, 1))
        if n > self.size:
            return None
        if not self._blocks:
            at = 0
        else:
            first = self._blocks[0][1]
            _, last, last_n = self._blocks[-1]
            end = last + last_n
            if last >= first:  # not wrapped: after the newest block, else from 0 to the oldest
                if end + n <= self.size:
                    at = end
                elif n <= first:
                    at = 0
                else:
                    return None
            elif end + n <= first:  # wrapped: room between the newest and the oldest
                at = end
            else:
                return None
        self._blocks.append((key, at, n))
        self._by_key[key] = (at, n)
        return at

    def free_through(self, key: int) -> None:
        """Take back every block of a key up to ``key``."""
        while self._blocks and self._blocks[0][0] <= key:
            k, _, _ = self._blocks.popleft()
            del self._by_key[k]
