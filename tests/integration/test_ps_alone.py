"""A PS started by hand with no chief to give it variables is never silent: it says
what it waits for, again and again, until variables come or it is stopped."""

from __future__ import annotations

import asyncio
import logging

import pytest
from helpers import serving_ps

import zmqps.roles.ps.serve as serve_module
from zmqps.roles.ps import PSConfig
from zmqps.transport import SocketOptions, free_ports

pytestmark = pytest.mark.timeout(30)

OPTS = SocketOptions(linger_ms=0)


def _notes_of_an_idle_ps(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    first: float,
    every: float,
) -> list[str]:
    """The "no variables" notes of a PS served alone for a second, its first note
    after ``first`` seconds and then one every ``every``."""
    monkeypatch.setattr(serve_module, "IDLE_NOTE_S", every)
    monkeypatch.setattr(serve_module, "FIRST_IDLE_NOTE_S", first)
    caplog.set_level(logging.WARNING, "zmqps.ps")

    async def main() -> None:
        (port,) = free_ports(1)
        async with serving_ps(PSConfig(index=0, bind=f"127.0.0.1:{port}"), OPTS):
            await asyncio.sleep(1.0)

    asyncio.run(main())
    return [r.getMessage() for r in caplog.records if "no variables after" in r.getMessage()]


def test_a_ps_without_variables_says_what_it_waits_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    notes = _notes_of_an_idle_ps(monkeypatch, caplog, 0.3, 0.3)
    assert 2 <= len(notes) <= 5, notes
    assert "waiting for a chief to create them" in notes[0]
    assert "zmqps-server --role chief" in notes[0]


def test_a_ps_without_variables_says_so_first_well_before_its_period(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first note comes after FIRST_IDLE_NOTE_S (10 s), not after a whole period
    (60 s: a PS whose chief was never started said nothing for a minute)."""
    notes = _notes_of_an_idle_ps(monkeypatch, caplog, 0.2, 30.0)
    assert len(notes) == 1, notes
