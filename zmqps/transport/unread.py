"""Bytes of replies a peer has not read yet, bounded (sans-IO).

A reply's tensor frames go out zero-copy: until the peer reads them they pin the
buffers they view (on a PS, a shard's values as they were when pulled; the next
update copies first). A peer that sends pulls and never reads the replies would
pin a copy of the model per update. So the server tracks each large reply until
ZeroMQ has handed it to the connection (its ``MessageTracker`` is done) and counts
the bytes still queued, per peer and in all:

* a peer with more than ``per_peer`` bytes queued has its next requests refused
  with ``busy`` (nothing done) until it reads;
* while all peers together have more than ``total`` queued, every peer that has
  bytes queued is refused the same way; a peer with nothing queued is served.

The bounds are bytes as sent: replies that view the same buffer count once each,
so what they pin in memory is at most what is counted. Every client sends a
request answered ``busy`` again after short pauses, within its time, so a peer
that reads slowly (a large pull on a slow link) is delayed, never failed.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["TRACK_BYTES", "Tracker", "UnreadReplies"]

#: replies carrying at least this many bytes of tensors are tracked. Tracking costs
#: nothing measurable (a tracked frame goes zero-copy instead of being copied); left
#: untracked below 1 MiB, pulls of a small model that a peer never read grew a PS by
#: gigabytes (ZeroMQ queues 10,000 replies per connection). What stays untracked is
#: at most the send HWM of replies of less than this each, per connection.
TRACK_BYTES = 4 << 10
#: at most this often (seconds) are every peer's trackers looked at
_SWEEP_EVERY_S = 0.1


class Tracker(Protocol):
    """What ZeroMQ's ``MessageTracker`` gives: whether the frames were handed over."""

    @property
    def done(self) -> bool: ...


class UnreadReplies:
    """Tracked replies per peer, oldest first, and their bytes."""

    def __init__(self, per_peer: Callable[[], int], total: Callable[[], int]) -> None:
        #: the bounds, asked each time (a PS's grow with the shards it holds)
        self.per_peer = per_peer
        self.total = total
        self._queued: dict[Any, collections.deque[tuple[Tracker, int]]] = {}
        self._bytes: dict[Any, int] = {}
        self.bytes = 0
        self._swept = float("-inf")

    def sent(self, peer: Any, tracker: Tracker, nbytes: int, now: float) -> None:
        """A reply of ``nbytes`` to ``peer`` went out, tracked by ``tracker``. Replies
        handed over are forgotten here too (every peer's, at most every 0.1 s), so a
        peer that goes quiet leaves nothing behind for long."""
        if now - self._swept >= _SWEEP_EVERY_S:
            self._sweep(now)
        self._queued.setdefault(peer, collections.deque()).append((tracker, nbytes))
        self._bytes[peer] = self._bytes.get(peer, 0) + nbytes
        self.bytes += nbytes

    def refusal(self, peer: Any, now: float) -> str | None:
        """Why ``peer``'s new request must wait (``busy``), or None to serve it."""
        mine = self._settle(peer)
        if not mine:
            return None  # a peer that has read everything is always served
        if mine > self.per_peer():
            return f"{mine:,} bytes of replies to this peer are not read yet"
        if self.bytes > self.total():
            if now - self._swept >= _SWEEP_EVERY_S:
                self._sweep(now)
            if self.bytes > self.total():
                return f"{self.bytes:,} bytes of replies to all peers are not read yet"
        return None

    def queued(self, peer: Any) -> int:
        """Bytes of replies to ``peer`` not handed over yet (as of the last look)."""
        return self._bytes.get(peer, 0)

    def __len__(self) -> int:
        """Peers with replies tracked."""
        return len(self._queued)

    def _sweep(self, now: float) -> None:
        self._swept = now
        for peer in list(self._queued):
            self._settle(peer)

    def _settle(self, peer: Any) -> int:
        """Forget ``peer``'s replies that were handed over; its bytes still queued."""
        queue = self._queued.get(peer)
        if queue is None:
            return 0
        freed = 0
        while queue and queue[0][0].done:
            freed += queue.popleft()[1]
        if freed:
            self.bytes -= freed
            self._bytes[peer] -= freed
        if not queue:
            del self._queued[peer]
            del self._bytes[peer]
            return 0
        return self._bytes[peer]
