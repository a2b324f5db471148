"""HeldExamples: the examples of a worker incarnation's batches that hold, by position."""

from __future__ import annotations

import random

import pytest

from zmqps.core import held
from zmqps.core.held import HeldExamples


def test_going_back_takes_off_exactly_the_examples_of_the_batches_taken_back() -> None:
    h = HeldExamples()
    for p in range(45):
        h.add(p, 23 if p % 23 == 22 else 32)  # each epoch of 23 batches ends with 23
    assert h.total == 45 * 32 - 9  # one short batch (22)
    h.back(20)
    assert (h.end, h.total) == (20, 20 * 32)
    for p in range(20, 46):
        h.add(p, 23 if p % 23 == 22 else 32)
    assert h.total == 46 * 32 - 2 * 9 and not h.estimated


def test_a_batch_pushed_again_at_an_earlier_position_goes_back_there_first() -> None:
    h = HeldExamples(start=10)
    for p in range(10, 20):
        h.add(p, 5)
    h.add(15, 7)  # a loop that took a rewind to 15 and trained on
    assert (h.end, h.total) == (16, 5 * 5 + 7)


def test_going_back_before_the_incarnation_start_counts_from_there() -> None:
    h = HeldExamples(start=100)
    for p in range(100, 110):
        h.add(p, 4)
    h.back(90)
    assert (h.start, h.end, h.total) == (90, 90, 0)
    h.add(90, 4)
    assert h.total == 4


def test_a_checkpoint_ahead_of_the_incarnation_counts_the_gap_at_the_last_size() -> None:
    h = HeldExamples()
    for p in range(5):
        h.add(p, 8)
    h.back(7)  # the restore holds 7 of its batches: nothing taken back
    h.add(7, 8)
    assert (h.end, h.total, h.estimated) == (8, 64, True)


def test_runs_stay_bounded_and_going_back_into_merged_ones_estimates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(held, "MAX_RUNS", 8)
    rng = random.Random(3)
    sizes = [rng.randint(1, 50) for _ in range(200)]
    h = HeldExamples()
    for p, n in enumerate(sizes):
        h.add(p, n)
        assert len(h._runs) <= 9
    assert h.total == sum(sizes) and not h.estimated
    h.back(199)  # the last run is one batch: exact
    assert h.total == sum(sizes[:199]) and not h.estimated
    h.back(3)  # into the merged runs: at their mean
    assert h.estimated and h.total == pytest.approx(sum(sizes[:3]), abs=150)


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError):
        HeldExamples(-1)
    with pytest.raises(ValueError):
        HeldExamples().add(0, -1)


@pytest.mark.parametrize("seed", range(30))
def test_random_pushes_and_restores_agree_with_a_ledger_of_every_position(seed: int) -> None:
    """Seeded sequences of pushes (at the end, or at an earlier position: a loop that
    took a rewind) and restores going back anywhere after the start: the total is
    always the sum over the positions that hold, each at its latest push, exactly
    (runs never merged here)."""
    rng = random.Random(seed)
    start = rng.randrange(0, 50)
    h = HeldExamples(start)
    model: dict[int, int] = {}  # position -> examples of its latest push
    end = start
    for _ in range(400):
        r = rng.random()
        if r < 0.08 and end > start:
            back = rng.randrange(start + 1, end + 1)
            h.back(back)
            model = {p: e for p, e in model.items() if p < back}
            end = back
        else:
            p = rng.randrange(start, end) if r < 0.12 and end > start else end
            examples = rng.choice([32, 32, 32, 17, 0, 64])
            h.add(p, examples)
            model = {q: e for q, e in model.items() if q < p}
            model[p] = examples
            end = p + 1
        assert (h.end, h.total) == (end, sum(model.values())), seed
    assert not h.estimated
