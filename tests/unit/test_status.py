"""The status lines of elastic PS (``roles/status.format_elastic``), as ``zmqps scale``
and ``zmqps status`` print them: from hand-made answers, and from a real mover's
status after a scale down on the in-memory network (through JSON, as the CLI gets it)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

from fake_replicated import chief_on, replicated_config, serve_ps

from zmqps.core.variables import VariableDef
from zmqps.roles.status import format_elastic, format_status
from zmqps.transport import FakeNetwork

AT_REST: dict[str, Any] = {
    "serving": [0, 1],
    "asked": None,
    "waiting": None,
    "moving": None,
    "planned": 0,
    "moves_done": 0,
    "moves_failed": 0,
    "moved_bytes": 0,
    "recent_moves": [],
    "drained": [],
    "epoch": 1,
}


def lines(text: str) -> list[str]:
    return text.splitlines()


def test_a_cluster_as_started() -> None:
    assert lines(format_elastic(AT_REST)) == [
        "serving       ps 0, 1  (placement epoch 1)",
        "asked         as started",
        "moves         0 done, 0 failed, 0 bytes moved",
    ]


def test_a_move_under_way_with_its_progress() -> None:
    moving = {"state": 1, "from": 1, "to": 0, "phase": "copying", "progress": 0.426}
    text = format_elastic({**AT_REST, "asked": [0], "moving": moving})
    assert lines(text) == [
        "serving       ps 0, 1  (placement epoch 1)",
        "asked         ps 0",
        "moving        ps 1's state from ps 1 to ps 0 (copying, 43%)",
        "moves         0 done, 0 failed, 0 bytes moved",
    ]


def test_a_move_just_begun_has_no_progress_yet() -> None:
    # the mover's first record of a move: no progress until the copy is looked at
    moving = {"state": 2, "from": 2, "to": 0, "phase": "starting"}
    text = format_elastic({**AT_REST, "asked": [0, 1], "moving": moving})
    assert "moving        ps 2's state from ps 2 to ps 0 (starting, 0%)" in lines(text)


def test_waiting_moves_done_and_failed_and_drained() -> None:
    text = format_elastic(
        {
            **AT_REST,
            "serving": [0],
            "asked": [0, 1, 2],
            "waiting": "ps 1, 2 asked for and not answering",
            "moves_done": 3,
            "moves_failed": 1,
            "moved_bytes": 12288,
            "drained": [1, 2],
            "epoch": 5,
        }
    )
    assert lines(text) == [
        "serving       ps 0  (placement epoch 5)",
        "asked         ps 0, 1, 2",
        "waiting       ps 1, 2 asked for and not answering",
        "moves         3 done, 1 failed, 12288 bytes moved",
        "drained       ps 1, 2",
    ]


def test_format_status_shows_the_elastic_lines_only_once_asked_or_moved() -> None:
    base: dict[str, Any] = {"mode": "async", "global_step": 3, "workers_expected": 1}
    assert "serving" not in format_status(base)
    assert "serving" not in format_status({**base, "elastic": AT_REST})
    asked = format_status({**base, "elastic": {**AT_REST, "asked": [0]}})
    assert "asked         ps 0" in asked
    # a restarted chief adopts what it finds (asked: those serving), moves done count
    moved = format_status({**base, "elastic": {**AT_REST, "moves_done": 2}})
    assert "moves         2 done, 0 failed, 0 bytes moved" in moved
    moving = {"state": 0, "from": 0, "to": 1, "phase": "in sync", "progress": 1.0}
    assert "(in sync, 100%)" in format_status({**base, "elastic": {**AT_REST, "moving": moving}})


def test_a_real_movers_status_after_a_scale_down() -> None:
    chief_at = "127.0.0.1:7000"
    ps = ("127.0.0.1:7100", "127.0.0.1:7101")
    sgd = {"name": "sgd", "lr": 0.5}

    async def body() -> dict[str, Any]:
        net = FakeNetwork()
        for i, address in enumerate(ps):
            serve_ps(net, i, address)
        chief = chief_on(net, replace(replicated_config(chief_at, ps, sgd), replication=1))
        await chief.start()
        await chief.create_variables((VariableDef("w", (8, 4), init={"name": "zeros"}),), sgd)
        mover = chief.recovery.mover
        assert mover is not None
        mover.scale(1)
        for _ in range(3):
            await mover.step()
        return dict(json.loads(json.dumps(chief.status()["elastic"])))

    elastic = asyncio.run(asyncio.wait_for(body(), 30.0))
    text = format_elastic(elastic)
    assert elastic["moves_done"] == 1 and elastic["moved_bytes"] > 0, elastic
    assert lines(text)[:2] == [
        f"serving       ps 0  (placement epoch {elastic['epoch']})",
        "asked         ps 0",
    ]
    assert f"moves         1 done, 0 failed, {elastic['moved_bytes']} bytes moved" in text
    assert "drained       ps 1" in text
    assert "moving" not in text and "waiting" not in text


def test_the_text_status_shows_each_states_copies_and_whom_a_blocked_step_waits_on() -> None:
    """``zmqps status`` printed nothing of the copies the README says it shows (only
    ``--json`` had them), and "step waits on nobody" under a blocked line."""
    status = {
        "mode": "sync",
        "global_step": 245,
        "blocker": "the copies of ps 2's state (6s) do not all have step 245",
        "waiting_on": [],
        "step_age_s": 8.5,
        "ps": ["ps0", "ps1", "ps2"],
        "replication": {
            "replication": 2,
            "silent": [1],
            "copies": {"0": {"primary": 0, "backups": [1]}, "2": {"primary": 2, "backups": []}},
            "under_replicated": [2],
            "copying": {"state": 2, "from": 2, "to": 0, "phase": "copying"},
        },
    }
    text = lines(format_status(status))
    assert "step waits on what is blocked above, no worker (for 8.5s)" in text
    assert "copies        2 of each state: ps 0's on ps 0 (backups ps 1); ps 2's on ps 2" in text
    assert "short         of copies: ps 2's state" in text
    assert "copying       ps 2's state from ps 2 to ps 0 (copying)" in text
    assert "silent        ps 1 (past the heartbeat timeout)" in text
    calm = {**status, "blocker": None, "waiting_on": [1], "replication": {}}
    assert "step waits on worker 1 (for 8.5s)" in lines(format_status(calm))
