"""Which connection makes room at a server socket's bound (sans-IO: the descriptors
are numbers, the shutdown recorded): one that never spoke past the grace, else the
one silent longest past ``SILENT_EVICT_S``, else the new one is refused."""

from __future__ import annotations

import pytest

from zmqps.transport.connections import QUIET_GRACE_S, SILENT_EVICT_S, Connections


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def bounded(monkeypatch: pytest.MonkeyPatch) -> tuple[Connections, Clock, list[int]]:
    clock, shut = Clock(), []
    conns = Connections("t", 3, lambda: None, clock)
    conns.port = 1
    monkeypatch.setattr(conns, "audit", lambda: 0)
    monkeypatch.setattr(conns, "_shut", lambda fd: shut.append(fd) or True)
    return conns, clock, shut


def test_a_connection_that_never_spoke_goes_first_the_oldest_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    conns, clock, shut = bounded(monkeypatch)
    for fd in (10, 11, 12):
        conns.accepted(fd)
        clock.now += 1.0
    conns.heard(10)
    conns.accepted(13)  # all younger than the grace: the new one is refused
    assert shut == [13] and conns.refused == 1 and conns.fds == {10, 11, 12}
    clock.now += QUIET_GRACE_S
    conns.heard(10)
    conns.accepted(14)  # 11 never spoke and is the oldest such: it goes
    assert shut == [13, 11] and conns.evicted == 1 and conns.fds == {10, 12, 14}


def test_failing_that_the_one_silent_longest_goes_past_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    conns, clock, shut = bounded(monkeypatch)
    for fd in (10, 11, 12):
        conns.accepted(fd)
        conns.heard(fd)
        clock.now += 1.0
    conns.heard(10)  # 11 is now the one silent longest
    conns.accepted(13)
    assert shut == [13]  # nobody silent long enough: refused
    clock.now += SILENT_EVICT_S
    conns.heard(10)
    conns.heard(12)
    conns.accepted(14)
    assert shut == [13, 11] and conns.fds == {10, 12, 14}
    conns.gone(14)  # a descriptor closed is forgotten, its number reusable
    conns.accepted(14)
    assert conns.fds == {10, 12, 14} and 14 not in conns._heard
