"""Where a replication entry's bytes go in the ring a primary shares with a backup
(``zmqps.core.ring``): seeded sequences of requests and releases, and the invariants
after each one."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqps.core.ring import ALIGN, RingSpace, aligned


def _live(space: RingSpace) -> list[tuple[int, int, int]]:
    return list(space._blocks)


def _check(space: RingSpace) -> None:
    """Live blocks are aligned, inside the ring, disjoint, and in key order."""
    blocks = _live(space)
    keys = [k for k, _, _ in blocks]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    spans = sorted((at, at + n) for _, at, n in blocks)
    for at, end in spans:
        assert at % ALIGN == 0 and 0 <= at < end <= space.size
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(0, 1 << 14),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 1 << 13)), max_size=80),
)
def test_live_blocks_never_overlap_or_leave_the_ring(
    size: int, ops: list[tuple[bool, int]]
) -> None:
    space = RingSpace(size)
    key, freed = 0, -1
    for alloc, n in ops:
        if alloc or not len(space):
            key += 1
            at = space.alloc(key, n)
            if at is not None:
                assert space.get(key) == at
                assert space.alloc(key, n) == at  # asked again: the same block
            elif not len(space):  # an empty ring refuses only what cannot fit in it
                assert aligned(max(n, 1)) > space.size
        else:
            freed = _live(space)[min(len(space) - 1, n % 3)][0]
            space.free_through(freed)
            assert all(k > freed for k, _, _ in _live(space))
        _check(space)


def test_blocks_wrap_to_the_start_once_the_oldest_are_released() -> None:
    space = RingSpace(10 * ALIGN)
    assert space.alloc(1, 4 * ALIGN) == 0
    assert space.alloc(2, 4 * ALIGN) == 4 * ALIGN
    assert space.alloc(3, 4 * ALIGN) is None  # 2 left at the end, 0 before the oldest
    space.free_through(1)
    assert space.alloc(3, 4 * ALIGN) == 0  # wrapped
    assert space.alloc(4, ALIGN) is None  # between the newest (ends at 4) and the oldest (4)
    assert space.used == 8 * ALIGN
    space.free_through(3)
    assert len(space) == 0
    assert space.alloc(5, 10 * ALIGN) == 0  # empty: from the start, the whole ring


def test_a_key_not_above_the_live_ones_gets_no_block() -> None:
    """An entry sent again after later ones took blocks goes beside its message: blocks
    go back in key order, so an older key among newer ones would pin them."""
    space = RingSpace(1 << 10)
    assert space.alloc(5, 100) == 0
    assert space.alloc(3, 100) is None
    assert space.alloc(5, 200) is None  # larger than its block: beside too
    assert space.alloc(5, 64) == 0


@pytest.mark.parametrize("seed", range(5))
def test_a_long_run_of_entries_reuses_the_ring(seed: int) -> None:
    """A backup acknowledging one entry behind the newest (as a primary's entries go):
    the ring keeps handing out room, never two live blocks over the same bytes."""
    rng = np.random.default_rng(seed)
    space = RingSpace(3 << 20)
    placed = 0
    for key in range(1, 2000):
        if space.alloc(key, int(rng.integers(1, 1 << 20))) is not None:
            placed += 1
        if key > 1:
            space.free_through(key - 1 - int(rng.integers(0, 2)))
        _check(space)
    assert placed > 1500
