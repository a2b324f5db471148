"""PushDeduper: duplicates, out-of-order sequences, fencing, window, persistence."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqps.core.dedup import PushDeduper
from zmqps.wire.errors import FencedError, InvalidArgument


def apply(d: PushDeduper, worker: str, inc: int, seq: int) -> bool:
    """What the PS does: check, apply, commit. Returns whether it applied."""
    if not d.check(worker, inc, seq):
        return False
    d.commit(worker, inc, seq)
    return True


def test_new_then_duplicate() -> None:
    d = PushDeduper()
    assert apply(d, "w0", 0, 0)
    assert not apply(d, "w0", 0, 0)
    assert apply(d, "w0", 0, 1)
    assert apply(d, "w1", 0, 1)  # workers are independent
    assert not d.check("w0", 0, 1)


def test_check_alone_records_nothing() -> None:
    d = PushDeduper()
    assert d.check("w", 0, 5)
    assert d.check("w", 0, 5)  # a push that failed validation is retried: still new
    assert len(d) == 0


def test_out_of_order_within_window() -> None:
    d = PushDeduper(window=8)
    assert apply(d, "w", 0, 6)
    assert apply(d, "w", 0, 5)  # late arrival of an older push
    assert not apply(d, "w", 0, 5)
    assert not apply(d, "w", 0, 6)
    assert apply(d, "w", 0, 0)  # 6 - 0 < 8
    assert apply(d, "w", 0, 3)
    assert apply(d, "w", 0, 20)
    with pytest.raises(InvalidArgument):  # 20 - 12 >= 8: cannot tell
        d.check("w", 0, 12)
    with pytest.raises(InvalidArgument):
        d.commit("w", 0, 12)
    assert apply(d, "w", 0, 13)


def test_incarnations_fence_and_reset() -> None:
    d = PushDeduper()
    apply(d, "w", 1, 10)
    with pytest.raises(FencedError):
        d.check("w", 0, 11)
    with pytest.raises(FencedError):
        d.commit("w", 0, 11)
    assert d.check("w", 2, 10)  # new incarnation: fresh window (seq may restart)
    apply(d, "w", 2, 0)
    assert d.incarnation("w") == 2
    with pytest.raises(FencedError):
        d.check("w", 1, 11)
    assert not d.check("w", 2, 0)
    assert d.check("w", 2, 10)


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgument):
        PushDeduper(window=0)
    with pytest.raises(InvalidArgument):
        PushDeduper().check("w", 0, -1)


def test_memory_bounded() -> None:
    d = PushDeduper(window=64)
    for seq in range(0, 100_000, 3):
        apply(d, "w", 0, seq)
    state = d.snapshot()["workers"]["w"]
    assert int(state["bits"], 16).bit_length() <= 64


def test_worker_names_and_incarnation_counts_are_bounded() -> None:
    from zmqps.core.dedup import MAX_INCARNATIONS, PushLedger

    d = PushDeduper(window=8, max_workers=3)
    for name in ("a", "b", "c"):
        assert apply(d, name, 0, 0)
    # a client inventing names: refused (typed), nothing recorded; known names go on
    with pytest.raises(InvalidArgument, match="3 worker names"):
        d.check("mallory-1", 0, 0)
    assert len(d) == 3 and apply(d, "a", 0, 1) and apply(d, "b", 1, 0)
    ledger = PushLedger()
    for inc in range(MAX_INCARNATIONS + 10):  # one name, ever newer incarnations
        ledger.applied("w", inc, 0, None, None)
    assert len(ledger.by_incarnation) == MAX_INCARNATIONS
    assert f"w/{MAX_INCARNATIONS + 9}/0" in ledger.by_incarnation
    assert "w/0/0" not in ledger.by_incarnation  # the oldest went


def test_fenced_names_and_their_characters_are_bounded_too() -> None:
    """A fence (what a chief sends when it registers a worker) from a client inventing
    names is bounded like a push: by count and by the names' characters together, so
    every map keyed by them stays decodable; a known name is fenced whatever the bound."""
    d = PushDeduper(window=8, max_workers=4, max_chars=24)
    assert d.fence("a", 1) and d.fence("b" * 10, 1)
    with pytest.raises(InvalidArgument, match="characters"):
        d.fence("c" * 14, 1)  # 1 + 10 + 14 > 24
    with pytest.raises(InvalidArgument, match="characters"):
        d.check("c" * 14, 0, 0)
    assert d.fence("c" * 12, 1) and d.fence("d", 1) and len(d) == 4
    with pytest.raises(InvalidArgument, match="4 worker names"):
        d.fence("e", 1)
    assert len(d) == 4 and "e" not in set(d)
    assert d.fence("a", 2) and not d.fence("a", 2)  # known names go on
    d.forget("b" * 10)
    assert d.fence("f" * 10, 1)  # forgetting gives the room back
    with pytest.raises(InvalidArgument, match="bounds"):
        PushDeduper(window=8, max_workers=4, max_chars=10).restore(d.snapshot())


def test_snapshot_restore_json_roundtrip() -> None:
    d = PushDeduper(window=16)
    for seq in (0, 2, 5, 7):
        apply(d, "a", 3, seq)
    apply(d, "b", 0, 100)
    snap = json.loads(json.dumps(d.snapshot()))
    e = PushDeduper(window=16)
    e.restore(snap)
    for seq in range(8):
        assert e.check("a", 3, seq) == (seq not in (0, 2, 5, 7))
    assert not e.check("b", 0, 100)
    with pytest.raises(FencedError):
        e.check("a", 2, 9)
    assert e.snapshot() == d.snapshot()


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"workers": {"a": {"incarnation": 0}}},
        {"workers": {"a": {"incarnation": -1, "high": 0, "bits": "1"}}},
        {"workers": {"a": {"incarnation": 0, "high": 0, "bits": "zz"}}},
        {"workers": []},
    ],
)
def test_restore_refuses_malformed(bad: dict[str, Any]) -> None:
    d = PushDeduper()
    apply(d, "keep", 0, 1)
    with pytest.raises(InvalidArgument):
        d.restore(bad)
    assert not d.check("keep", 0, 1)  # unchanged


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 200), max_size=300), st.integers(1, 64))
def test_matches_a_set_model(seqs: list[int], window: int) -> None:
    d = PushDeduper(window=window)
    applied: set[int] = set()
    for seq in seqs:
        high = max(applied, default=-1)
        if applied and high - seq >= window:
            with pytest.raises(InvalidArgument):
                d.check("w", 0, seq)
            continue
        assert apply(d, "w", 0, seq) == (seq not in applied)
        applied.add(seq)


def test_fence_refuses_older_incarnations_before_the_new_one_pushes() -> None:
    d = PushDeduper()
    d.commit("w", 1, 0)
    assert d.fence("w", 2)  # the chief registered incarnation 2
    with pytest.raises(FencedError):
        d.check("w", 1, 1)  # a late push of the paused old process
    assert d.check("w", 2, 0)  # the new one starts a fresh window
    assert not d.fence("w", 2) and not d.fence("w", 1)  # never backwards
    assert d.fence("never-pushed", 5)
    with pytest.raises(FencedError):
        d.check("never-pushed", 4, 0)


def test_a_name_the_chief_fences_makes_room_by_a_name_it_never_registered() -> None:
    """8,192 pushes under invented names filled the table for good: the real worker's
    fence was refused, it never registered, and training stayed at step 0."""
    d = PushDeduper(window=8, max_workers=4)
    d.fence("worker:0", 1)
    for i in range(3):
        d.commit(f"invented{i}", 1, 0)
    assert d.full_for("worker:1") and not d.full_for("worker:0")
    assert d.unregistered() == "invented0"  # the oldest never fenced
    d.forget("invented0")
    assert d.fence("worker:1", 1)
    assert d.full_for("worker:2") and d.unregistered() == "invented1"
    d.forget("invented1")
    d.forget("invented2")
    d.fence("worker:2", 1)
    d.fence("worker:3", 1)
    assert d.unregistered() is None  # every name registered: nobody is made room by
    with pytest.raises(InvalidArgument):
        d.fence("worker:4", 1)
