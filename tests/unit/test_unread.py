"""The bound on bytes of replies peers have not read (transport/unread.py), sans-IO:
a peer past its bound waits, all peers past the total wait unless they have read
everything, and replies handed over are forgotten."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zmqps.transport.unread import UnreadReplies


@dataclass
class FakeTracker:
    done: bool = False


def test_a_peer_past_its_bound_waits_until_it_reads() -> None:
    u = UnreadReplies(lambda: 14, lambda: 100)
    sent = [FakeTracker() for _ in range(4)]
    for t in sent:
        assert u.refusal("a", 0.0) is None
        u.sent("a", t, 4, 0.0)
    assert u.queued("a") == 16 and u.bytes == 16
    assert u.refusal("a", 0.0) is not None
    assert u.refusal("b", 0.0) is None  # another peer is served
    sent[0].done = sent[1].done = True
    assert u.refusal("a", 0.0) is None  # 8 left
    assert u.queued("a") == 8 and u.bytes == 8
    sent[3].done = True  # handed over out of order: counted once the older one is
    assert u.queued("a") == 8
    sent[2].done = True
    assert u.refusal("a", 0.0) is None
    assert u.bytes == 0 and len(u) == 0


def test_past_the_total_only_peers_with_unread_bytes_wait() -> None:
    u = UnreadReplies(lambda: 50, lambda: 60)
    trackers = {p: FakeTracker() for p in "abc"}
    for p, t in trackers.items():
        u.sent(p, t, 25, 0.0)
    assert u.bytes == 75
    assert u.refusal("a", 0.0) is not None and u.refusal("b", 0.05) is not None
    assert u.refusal("d", 0.0) is None  # it has nothing unread
    trackers["c"].done = True  # c read its reply: the sweep (every 0.1 s) sees it
    assert u.refusal("a", 0.05) is not None
    assert u.refusal("a", 0.2) is None
    assert u.bytes == 50 and u.queued("c") == 0


def test_random_sends_and_reads_keep_the_counts_exact() -> None:
    rng = np.random.default_rng(3)
    u = UnreadReplies(lambda: 1 << 40, lambda: 1 << 40)
    live: list[tuple[str, FakeTracker, int]] = []
    now = 0.0
    for _ in range(2000):
        now += float(rng.random()) * 0.05
        peer = f"p{int(rng.integers(8))}"
        if rng.random() < 0.6:
            t, n = FakeTracker(), int(rng.integers(1, 1000))
            u.sent(peer, t, n, now)
            live.append((peer, t, n))
        elif live:
            live[int(rng.integers(len(live)))][1].done = True
        u.refusal(peer, now)
    for _, t, _ in live:
        t.done = True
    u.sent("last", FakeTracker(done=True), 1, now + 1.0)  # sweeps every peer
    assert u.refusal("last", now + 1.0) is None
    assert u.bytes == 0 and len(u) == 0
