"""The launcher's watch for stopped or hung tasks (``Launcher._liveness``), on a fake
clock: it kills a task the chief counts dead (or a chief that answers nothing) after
its bound, never for the launcher's own stop (Ctrl-Z), and with replication it also
kills a PS process the chief's probes no longer hear, so that it comes back."""

from __future__ import annotations

import argparse
import asyncio
from types import SimpleNamespace
from typing import Any

import zmqps.cli.launch as launch
from zmqps.cli.launch import Child, Launcher, _planned, _trained


class _Proc:
    def __init__(self) -> None:
        self.signals: list[Any] = []

    def send_signal(self, sig: Any) -> None:
        self.signals.append(sig)

    def kill(self) -> None:
        self.signals.append("kill")


def _launcher(replication: int) -> Launcher:
    lc = Launcher.__new__(Launcher)
    lc.args = argparse.Namespace(heartbeat_timeout=2.0, replication=replication)
    lc.children = [Child(n, []) for n in ("chief", "ps0", "ps1", "worker0")]
    for c in lc.children:
        c.proc = _Proc()  # type: ignore[assignment]
    lc.status, lc.status_at, lc.stopping = None, 0.0, False
    lc.said = []  # type: ignore[attr-defined]
    lc.say = lc.said.append  # type: ignore[attr-defined,method-assign]
    return lc


def _watch(monkeypatch: Any, lc: Launcher, script: Any, seconds: float) -> None:
    """Run the watch while ``script(now)`` plays the world at each look; the clock
    moves one second a look, or as ``script`` returns (a stop of the launcher)."""
    clock = [0.0]
    monkeypatch.setattr(launch, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(launch, "LIVENESS_TICK_S", 0.001)

    async def go() -> None:
        watch = asyncio.ensure_future(lc._liveness())
        while clock[0] < seconds:
            await asyncio.sleep(0.002)
            clock[0] += script(clock[0]) or 1.0
        lc.stopping = True
        await asyncio.wait_for(watch, 2.0)

    asyncio.run(go())


def test_the_launchers_own_stop_is_not_the_chiefs_silence(monkeypatch: Any) -> None:
    """Ctrl-Z on the launcher for 35 s, then fg: a healthy chief was killed as hung."""
    lc = _launcher(1)
    stopped = [False]

    def world(now: float) -> float | None:
        lc.status, lc.status_at = {"step_known": True}, now  # the chief answers
        if now >= 10 and not stopped[0]:
            stopped[0] = True
            return 35.0  # the launcher is stopped: nothing runs, its clock goes on
        return None

    _watch(monkeypatch, lc, world, 80)
    assert lc.children[0].proc.signals == [], lc.said  # type: ignore[union-attr]


def test_a_chief_silent_past_the_bound_is_killed(monkeypatch: Any) -> None:
    lc = _launcher(1)
    _watch(monkeypatch, lc, lambda now: None, 30)  # never a status
    assert "kill" in lc.children[0].proc.signals  # type: ignore[union-attr]


def test_a_chief_gets_its_start_up_first_whatever_hung_after_says(monkeypatch: Any) -> None:
    """``--hung-after 0.5``: a chief that had not answered its first status within 1 s
    of each (re)start (loading its data) was killed, four times, and the run failed;
    the help says a task started again has 15 s of start-up first."""
    for seconds, killed in ((launch.START_GRACE_S - 2, False), (launch.START_GRACE_S + 4, True)):
        lc = _launcher(1)
        lc.args.hung_after = 0.5
        _watch(monkeypatch, lc, lambda now: None, seconds)  # no status yet
        assert ("kill" in lc.children[0].proc.signals) == killed, lc.said  # type: ignore[union-attr]


def test_a_replicated_ps_the_chiefs_probes_do_not_hear_is_killed(monkeypatch: Any) -> None:
    """SIGSTOP of a PS with --replication 2: its states failed over, and the rest of
    the run went on with one copy; the stopped process was never restarted."""
    lc = _launcher(2)
    for c in lc.children:
        c.started_at = -100.0

    def world(now: float) -> None:
        silent = [0] if now >= 5 else []
        lc.status = {"step_known": True, "ps_down": {}, "replication": {"silent": silent}}
        lc.status_at = now

    _watch(monkeypatch, lc, world, 40)
    assert "kill" in lc.children[1].proc.signals  # type: ignore[union-attr]
    assert lc.children[2].proc.signals == []  # type: ignore[union-attr]
    assert lc.children[0].proc.signals == []  # type: ignore[union-attr]


def test_a_ps_schedule_asks_nothing_once_training_is_over() -> None:
    two = [{"index": 0}, {"index": 1}]
    running = {"phase": "running", "global_step": 500, "steps_planned": 920}
    running.update(workers_expected=2, workers=two)
    assert _planned(running) == 920 and not _trained(running)
    # the count grows as workers register: not known until every one expected has
    early = {**running, "global_step": 460, "steps_planned": 460, "workers": two[:1]}
    assert _planned(early) == 0 and not _trained(early)
    assert _trained({**running, "global_step": 920})  # every planned step taken
    assert _trained({**running, "phase": "finishing"})
    assert _trained({**running, "finished": True})
    # the steps planned not known (a chief not started yet, a bad field): not over
    assert not _trained({"phase": "running", "global_step": 10})
    assert _planned({"steps_planned": "x"}) == 0 and not _trained({"steps_planned": None})


def test_a_ps_schedule_not_asked_says_so_truly_when_its_step_was_passed() -> None:
    """A run too short for the launcher to see it at step 0: its first status said
    training over at step 46, and the line said it "ended at step 46 before" step 0."""
    lc = _launcher(1)
    lc.args = argparse.Namespace(ps_schedule="0:1", ps=2)
    lc.cluster = SimpleNamespace(chief="127.0.0.1:1")  # type: ignore[assignment]
    two = [{"index": 0}, {"index": 1}]
    lc.status = {"phase": "finishing", "global_step": 46, "steps_planned": 46}
    lc.status.update(workers_expected=2, workers=two, variables=4)
    asyncio.run(asyncio.wait_for(lc._ps_schedule(), 5.0))
    assert lc.said == [  # type: ignore[attr-defined]
        "zmqps launch: --ps-schedule from step 0 on: training ended (at step 46) before the"
        " launcher could ask for it"
    ]
