"""The console scripts' entry points (``zmqps``, ``zmqps-server``, ``zmqps-worker``,
``python -m zmqps``): light, so that a Ctrl-C at any moment, even while the
commands' heavy imports (numpy, zmq, the roles) run, ends with one line and exit
code 130, never a traceback."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Sequence
from types import ModuleType

from zmqps.blas import one_thread

__all__ = ["exiting", "interrupted", "main", "server_main", "started", "worker_main"]

#: the exit code of a run ended by Ctrl-C, as a shell says (128 + SIGINT)
EXIT_INTERRUPTED = 130


def interrupted(prog: str) -> int:
    """One line on stderr; the exit code of an interrupted run."""
    with contextlib.suppress(OSError, ValueError, KeyboardInterrupt):
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


#: Ctrl-Cs that came while a program started (its imports, its arguments): one that a
#: library swallowed (a ``KeyboardInterrupt`` caught while a module was imported) is
#: still seen, by :func:`started`, before the command runs
_CAME: list[int] = []


def _on_sigint(signum: int, frame: object) -> None:
    _CAME.append(signum)
    raise KeyboardInterrupt


def started() -> bool:
    """The program's start is over, its command about to run: Ctrl-C as Python handles
    it again (``asyncio.run`` then cancels its main task on one); whether one came
    during the start (then the command must not run: it was interrupted)."""
    if signal.getsignal(signal.SIGINT) is _on_sigint:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    came = bool(_CAME)
    _CAME.clear()
    return came


def _cli() -> ModuleType:
    """``zmqps.cli.main``, imported (numpy, zmq, the roles: the slow part of a start).
    A Ctrl-C in there can surface as another error of an import it broke: whatever
    it raised after a Ctrl-C is the Ctrl-C's. The handler that records it stays until
    the command runs (:func:`started`)."""
    mine = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # not SIG_IGN
    if mine:
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        from zmqps.cli import main as cli
    except BaseException:
        if started():
            raise KeyboardInterrupt from None
        raise
    return cli


def exiting() -> None:
    """The command's exit code is known: from here the process only exits. A stop
    signal now (Ctrl-C, SIGTERM, a hangup) is ignored, so the code it exits with is
    the command's: otherwise one that came while the interpreter shut down (after it
    had put the default actions back) killed it by that signal, after a run's summary
    had said it was done. A second Ctrl-C while this runs is the same one."""
    while True:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
        except KeyboardInterrupt:
            continue
        return


def _run(prog: str, command: str, argv: Sequence[str] | None) -> int:
    try:
        code = int(getattr(_cli(), command)(argv))
    except KeyboardInterrupt:
        exiting()
        return interrupted(prog)
    except BaseException:  # SystemExit (argparse: --help, a usage error), a crash
        exiting()
        raise
    exiting()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if list(args[:1]) == ["server"]:  # ``zmqps server``: as zmqps-server
        one_thread()
    return _run("zmqps", "main", argv)


def server_main(argv: Sequence[str] | None = None) -> int:
    # a chief or a PS: one BLAS thread (unless the user chose), set before numpy loads
    one_thread()
    return _run("zmqps-server", "server_main", argv)


def worker_main(argv: Sequence[str] | None = None) -> int:
    return _run("zmqps-worker", "worker_main", argv)
