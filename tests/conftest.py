"""Shared fixtures: ``procs`` starts child processes and reaps every one it started.

Tests under tests/cluster are marked ``cluster`` (deselect them with ``-m "not cluster"``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import hypothesis  # noqa: F401 - imported (and assertion-rewritten) now, see below
import pytest
from helpers import Reaper

# Imported here rather than lazily by hypothesis's pytest plugin at the end of a run:
# rewriting its modules that late failed on CPython 3.11.7 ("AST constructor recursion
# depth mismatch") after tests/unit/test_checkpointer.py ran alone.

CLUSTER_DIR = Path(__file__).parent / "cluster"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(CLUSTER_DIR):
            item.add_marker(pytest.mark.cluster)


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed


@pytest.fixture
def procs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Reaper]:
    """Spawns children (``procs.spawn(argv)``); at teardown stops any still running.

    A test that passed but left a process running fails at teardown: every
    test must wait for (and assert the exit code of) what it starts.
    """
    reaper = Reaper(tmp_path / "logs")
    yield reaper
    left = reaper.reap()
    if left and not request.node.stash.get(_CALL_FAILED, True):
        pytest.fail("processes left running (now killed):\n" + "\n".join(left))
