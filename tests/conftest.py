"""Shared fixtures: ``procs`` starts child processes and reaps every one it started.

Tests under tests/cluster are marked ``cluster`` (deselect them with ``-m "not cluster"``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import hypothesis  # noqa: F401 - imported (and assertion-rewritten) now, see below
import pytest
from helpers import Reaper

from zmqps.transport.ports import PORT_RANGE_ENV, port_range


def _ports_of_this_process() -> None:
    """Each test process of a run (pytest-xdist's gw0, gw1, ...) picks its clusters'
    ports in a part of the range of its own (``ZMQPS_PORT_RANGE``, inherited by every
    process it starts): a port is picked some seconds before its task binds it, and one
    picked meanwhile by a cluster of another test process met a task already bound
    there (a worker of one test registered with the other's chief; both failed)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or count < 2:
        return
    index = int(worker[2:])
    lo, top, _ = port_range()
    size = (top - lo) // count
    os.environ[PORT_RANGE_ENV] = f"{lo + index * size}-{lo + (index + 1) * size - 1}"


_ports_of_this_process()

# Imported here rather than lazily by hypothesis's pytest plugin at the end of a run:
# rewriting its modules that late failed on CPython 3.11.7 ("AST constructor recursion
# depth mismatch") after tests/unit/test_checkpointer.py ran alone.

CLUSTER_DIR = Path(__file__).parent / "cluster"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(CLUSTER_DIR):
            item.add_marker(pytest.mark.cluster)
        if _uses_a_fixture_of_its_module(item):
            # run by one process (bin/test: --dist loadgroup), so that the fixture, made
            # once per process (a Slurm of the module's own, unfaulted reference runs),
            # is made once
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def _uses_a_fixture_of_its_module(item: pytest.Item) -> bool:
    """Whether ``item`` uses a module-scoped fixture defined in its own module."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    module = item.nodeid.split("::")[0]
    return any(
        d.scope == "module" and d.baseid == module
        for defs in info.name2fixturedefs.values()
        for d in defs
    )


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
