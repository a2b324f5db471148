"""RateLimitedLog: one line per interval per key, with a count of those not logged."""

from __future__ import annotations

import logging

import pytest

from zmqps.logs import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_interval_per_key_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    rl = RateLimitedLog(logging.getLogger("t"), 10.0, clock)
    with caplog.at_level(logging.WARNING, "t"):
        assert rl.warning("bad push from %s", "a", key="a")
        for _ in range(999):  # a client repeating it: counted, not logged
            clock.now += 0.001
            assert not rl.warning("bad push from %s", "a", key="a")
        assert rl.warning("bad push from %s", "b", key="b")  # another key: at once
        clock.now = 110.0
        assert rl.warning("bad push from %s", "a", key="a")
    assert [r.getMessage() for r in caplog.records] == [
        "bad push from a",
        "bad push from b",
        "bad push from a (999 more like it in the last 10 s)",
    ]


def test_keys_are_bounded() -> None:
    clock = Clock()
    rl = RateLimitedLog(logging.getLogger("t"), 10.0, clock, max_keys=3)
    for k in range(100):
        rl.warning("x", key=k)
    assert len(rl._keys) == 3
    assert rl.warning("x", key=0)  # forgotten: logged at once again
