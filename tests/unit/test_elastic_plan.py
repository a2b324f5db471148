"""The elastic planner (``core/elastic.py``): where PS states go when the PS count
changes, and the schedules that change it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqps.core.elastic import Move, cap, moves, parse_schedule, past_the_end, plan_homes
from zmqps.wire.errors import InvalidArgument


def _loads(sizes: dict[int, int], homes: dict[int, int], processes: list[int]) -> dict[int, int]:
    out = dict.fromkeys(processes, 0)
    for s, p in homes.items():
        out[p] += sizes[s]
    return out


def test_draining_one_of_two_moves_exactly_its_states() -> None:
    sizes = {0: 100, 1: 100}
    planned = plan_homes(sizes, {0: 0, 1: 1}, [0])
    assert planned == {0: 0, 1: 0}
    assert moves(sizes, {0: 0, 1: 1}, planned) == [Move(1, 1, 0, 100)]


def test_a_process_back_takes_its_own_state_home() -> None:
    sizes = {0: 100, 1: 100}
    assert plan_homes(sizes, {0: 0, 1: 0}, [0, 1]) == {0: 0, 1: 1}


def test_a_large_state_stays_and_the_small_ones_move() -> None:
    # the digits MLP: one large state and two small ones, all on one process; a second
    # process lowers the highest load most cheaply by taking the two small ones
    sizes = {0: 32808, 1: 512, 2: 5120}
    planned = plan_homes(sizes, dict.fromkeys(sizes, 0), [0, 1])
    assert planned == {0: 0, 1: 1, 2: 1}


def test_six_states_balance_over_one_two_and_three_processes() -> None:
    sizes = dict.fromkeys(range(6), 10)
    homes = {s: s % 2 for s in range(6)}
    three = plan_homes(sizes, homes, [0, 1, 2])
    assert sorted(_loads(sizes, three, [0, 1, 2]).values()) == [20, 20, 20]
    # only what balance needs moved: two states, one from each process
    assert sum(1 for s in sizes if three[s] != homes[s]) == 2
    one = plan_homes(sizes, three, [0])
    assert set(one.values()) == {0}
    two = plan_homes(sizes, one, [0, 1])
    assert sorted(_loads(sizes, two, [0, 1]).values()) == [30, 30]


def test_a_balanced_cluster_moves_nothing() -> None:
    sizes = {0: 5, 1: 7, 2: 6}
    homes = {0: 0, 1: 1, 2: 2}
    assert plan_homes(sizes, homes, [0, 1, 2]) == homes


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        plan_homes({0: 1}, {0: 0}, [])
    with pytest.raises(InvalidArgument):
        plan_homes({0: 1}, {1: 0}, [0])
    with pytest.raises(InvalidArgument):
        plan_homes({0: -1}, {0: 0}, [0])


@settings(max_examples=500, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 1000), min_size=1, max_size=12),
    data=st.data(),
)
def test_every_plan_serves_every_state_under_the_cap_and_moves_nothing_it_need_not(
    sizes: list[int], data: st.DataObject
) -> None:
    by_state = dict(enumerate(sizes))
    pool = list(range(len(sizes) + 2))
    homes = {s: data.draw(st.sampled_from(pool)) for s in by_state}
    processes = data.draw(st.lists(st.sampled_from(pool), min_size=1, unique=True))
    planned = plan_homes(by_state, homes, processes)
    assert set(planned) == set(by_state)
    assert set(planned.values()) <= set(processes)
    limit = cap(sizes, len(processes))
    before = _loads(by_state, {s: p for s, p in homes.items() if p in processes}, processes)
    after = _loads(by_state, planned, sorted(set(processes)))
    # the highest load at most the cap (a packing reaches it), within one state
    assert max(after.values()) <= limit + max(sizes)
    moved = [s for s, p in planned.items() if p != homes[s] and by_state[s]]
    if all(p in processes and before[p] <= limit for p in homes.values()):
        assert not moved  # no process leaves, none above the cap: nothing moves
    # a state of a process that leaves always moves; one of a process that stays only
    # when some process is above the cap before, or the states that must move find no
    # room under it
    leaving = sum(by_state[s] for s in by_state if homes[s] not in processes)
    over = sum(max(0, n - limit) for n in before.values())
    if not over and not leaving:
        assert not moved
    # planned again on its outcome, a plan converges: each round that moves states
    # lowers the highest load, and nothing moves back and forth
    rounds, highest = 0, max(after.values())
    while (again := plan_homes(by_state, planned, processes)) != planned:
        now = max(_loads(by_state, again, sorted(set(processes))).values())
        assert now < highest
        planned, highest, rounds = again, now, rounds + 1
        assert rounds < 50


def test_moves_drain_leaving_processes_first() -> None:
    sizes = {0: 1, 1: 50, 2: 10}
    homes = {0: 0, 1: 0, 2: 2}
    planned = {0: 1, 1: 0, 2: 0}
    out = moves(sizes, homes, planned)
    assert [m.state for m in out] == [2, 0]  # process 2 leaves: its state first


def test_schedules_parse_and_refuse_what_cannot_run() -> None:
    assert parse_schedule("0:2, 40:3,80:1,120:2", 3) == [(0, 2), (40, 3), (80, 1), (120, 2)]
    for bad in ("40", "x:2", "10:0", "10:4", "10:2,5:1", "10:2,10:1", "-1:2"):
        with pytest.raises(InvalidArgument, match="--ps-schedule"):
            parse_schedule(bad, 3)


def test_a_schedule_past_the_runs_last_step_is_named() -> None:
    schedule = parse_schedule("0:2,1500:3,3000:1", 3)
    late = past_the_end(schedule, 920)
    assert late is not None
    assert "1500:3,3000:1 never comes" in late and "920 global steps" in late
    assert past_the_end(schedule, 3001) is None
    # the last step is the run's end: moves stop there, so a point at it never comes
    assert past_the_end(schedule, 3000) is not None and "3000:1" in past_the_end(schedule, 3000)
    assert past_the_end(schedule, 0) is None  # the steps planned not known yet
