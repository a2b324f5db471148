"""RateLimitedLog: one line per interval per key, with a count of those not logged."""

from __future__ import annotations

import logging

import pytest

from zmqps.logs import OneLineFormatter, RateLimitedLog


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


def test_a_new_key_for_every_event_does_not_flood(caplog: pytest.LogCaptureFixture) -> None:
    """A client that connected anew for every expired request (a new routing id, so a
    new key each time) wrote 1,500 lines in 1.4 s: a kind of key writes at most
    ``lines_per_kind`` lines an interval, whatever the keys; other kinds are not held
    back, and the next line of the kind says how many were not written. (A log whose
    keys the code bounds, a worker's index, keeps a line per key: no cap unless asked.)"""
    clock = Clock()
    rl = RateLimitedLog(logging.getLogger("t"), 10.0, clock, lines_per_kind=5)
    with caplog.at_level(logging.WARNING, "t"):
        logged = [rl.warning("expired from %s", p, key=("expired", p)) for p in range(1500)]
        assert sum(logged) == 5
        assert rl.warning("refused %s", 1, key=("refused", 1))  # another kind: at once
        clock.now += 10.0
        assert rl.warning("expired from %s", "late", key=("expired", "late"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 7
    uncapped = RateLimitedLog(logging.getLogger("t"), 10.0, clock)
    assert all(uncapped.warning("w %s", i, key=("registered", i)) for i in range(100))
    assert lines[-1] == "expired from late (1495 more like it in the last 10 s)"


def test_a_record_is_one_line_whatever_a_peer_put_in_it() -> None:
    """A reason a client sent with a newline used to write a line of its own, e.g. a
    forged "ps 0 is down" error on the operator's terminal."""
    fmt = OneLineFormatter("%(levelname).1s %(name)s: %(message)s")
    forged = "done)\n02:05:28 E zmqps.chief: ps 0 is down (forged\r\x1b[2K\u2028\x85x"
    record = logging.LogRecord(
        "zmqps.chief", logging.INFO, __file__, 1, "left (%s)", (forged,), None
    )
    line = fmt.format(record)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert "\u2028" not in line and "\x85" not in line
    assert line == (
        "I zmqps.chief: left (done)\\n02:05:28 E zmqps.chief: ps 0 is down (forged"
        "\\r\\x1b[2K\\u2028\\x85x)"
    )
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord(
            "zmqps.ps", logging.ERROR, __file__, 1, "failed\n%s", ("x",), sys.exc_info()
        )
    out = fmt.format(record).splitlines()
    assert out[0] == "E zmqps.ps: failed\\nx"
    assert out[1].startswith("Traceback") and out[-1] == "ValueError: boom"
