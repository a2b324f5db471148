"""The summary ``zmqps launch`` prints at the end says what went wrong on the way:
tasks restarted, restores (whose batches were trained again), an evaluator that
evaluated nothing, a chief restarted during the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from zmqps.cli.launch import _evaluations, _print_summary

BASE: dict[str, Any] = {
    "wall_seconds": 12.0,
    "mode": "sync",
    "ps": 2,
    "workers": 2,
    "global_step": 40,
    "examples": 1280,
    "examples_per_second": 100.0,
}


def printed(capsys: pytest.CaptureFixture[str], **extra: Any) -> str:
    _print_summary({**BASE, **extra})
    return capsys.readouterr().out


def test_a_clean_run_says_nothing_of_restarts(capsys: pytest.CaptureFixture[str]) -> None:
    out = printed(capsys, restarts=[], restores=0, evaluations=3)
    assert "restarted" not in out and "WARNING" not in out


def test_a_rate_not_known_is_said_so_not_printed_as_none_or_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert "1280 examples, 100.0 examples/s" in printed(capsys)
    out = printed(capsys, examples_per_second=None, chief_restarted=True)
    assert "1280 examples, examples/s not known (the chief was restarted and saw" in out, out
    assert "None" not in out and "measured after its restart" not in out, out


def test_restarts_restores_and_a_silent_evaluator_are_said(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = printed(
        capsys,
        restarts=[{"task": "worker1"}, {"task": "worker1"}, {"task": "ps0"}],
        restores=1,
        rewound_batches=17,
        evaluations=0,
        chief_restarted=True,
    )
    assert "tasks restarted: worker1 2x, ps0 1x; 1 restores from a checkpoint, 17 batches" in out
    assert "WARNING: the evaluator evaluated nothing" in out
    assert "the chief was restarted" in out


def test_a_restore_with_no_checkpoint_is_not_said_to_be_from_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A PS killed before the first checkpoint: the chief's log said "no committed
    checkpoint", the summary "1 restores from a checkpoint"."""
    out = printed(
        capsys, restarts=[{"task": "ps1"}], restores=1, restores_from_scratch=1, evaluations=3
    )
    assert "1 to the initial values (no checkpoint yet), 0 batches trained again" in out
    assert "from a checkpoint" not in out
    out = printed(
        capsys, restarts=[{"task": "ps1"}], restores=3, restores_from_scratch=1, evaluations=3
    )
    assert "2 restores from a checkpoint, 1 to the initial values (no checkpoint yet)" in out


def test_evaluations_are_the_lines_of_the_evaluators_log(tmp_path: Path) -> None:
    assert _evaluations(tmp_path / "missing.jsonl") == 0
    log = tmp_path / "evaluator.jsonl"
    log.write_text('{"step": 1}\n\n{"step": 2}\n')
    assert _evaluations(log) == 2
