"""A Ctrl-C while a program starts (its imports, its arguments) ends it with 130, even
when an import swallowed the ``KeyboardInterrupt`` it raised: the command never runs
(sans-IO: the handler is called by hand, no signal is sent)."""

from __future__ import annotations

import argparse
import contextlib
import signal

import pytest

from zmqps.cli import entry
from zmqps.cli.main import _run


def test_a_ctrl_c_an_import_swallowed_still_stops_the_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ran: list[bool] = []
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, entry._on_sigint)  # as _cli() leaves it
    try:
        with contextlib.suppress(KeyboardInterrupt):  # an import swallowed it
            entry._on_sigint(signal.SIGINT, None)  # the Ctrl-C, during the import
        code = _run(lambda args: ran.append(True) or 0, argparse.Namespace(prog="zmqps"))
        assert code == entry.EXIT_INTERRUPTED and not ran
        assert "zmqps: interrupted" in capsys.readouterr().err
        # Python's own handler again, as asyncio.run expects it; nothing left pending
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert _run(lambda args: ran.append(True) or 0, argparse.Namespace(prog="zmqps")) == 0
        assert ran == [True]
    finally:
        signal.signal(signal.SIGINT, before)


def test_an_import_a_ctrl_c_broke_raises_the_ctrl_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever an import raised after a Ctrl-C is the Ctrl-C's."""
    before = signal.getsignal(signal.SIGINT)
    real_import = __import__

    def importing(name: str, *args: object, **kwargs: object) -> object:
        if name == "zmqps.cli":
            with contextlib.suppress(KeyboardInterrupt):
                signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # type: ignore[operator]
            raise ImportError("an import the Ctrl-C broke")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("builtins.__import__", importing)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            entry._cli()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize(
    ("entry_point", "argv", "one"),
    [
        ("server_main", ["--job-name", "ps"], True),
        ("main", ["server", "--job-name", "ps"], True),
        ("main", ["launch"], False),  # the launcher shares the cores among its workers
        ("worker_main", ["--job-name", "worker"], False),  # a worker computes
    ],
)
def test_a_chief_or_ps_started_takes_one_blas_thread_before_numpy_loads(
    monkeypatch: pytest.MonkeyPatch, entry_point: str, argv: list[str], one: bool
) -> None:
    """Set before the command's imports (numpy reads them once, as it loads)."""
    seen: list[bool] = []
    monkeypatch.setattr(entry, "one_thread", lambda: seen.append(True) or True)
    monkeypatch.setattr(entry, "_run", lambda prog, command, args: 0)
    assert getattr(entry, entry_point)(argv) == 0
    assert seen == ([True] if one else [])
