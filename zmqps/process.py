"""Process-level helpers for zmqps' own child processes (``zmqps launch``'s tasks,
the benchmarks' sides): below the command line, so the benchmarks need not
import it.
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import signal
import stat
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zmqps.blas import THREAD_VARS, user_chose
from zmqps.wire.errors import ZmqpsError

__all__ = [
    "THREAD_VARS",
    "DroppingWriter",
    "available_memory",
    "blas_threads",
    "exit_with_parent",
    "nonblocking_output",
    "thread_env",
    "usable_cores",
    "write_text_whole",
]


def usable_cores() -> int:
    """The cores this process may run on (its affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def available_memory() -> tuple[int, int] | None:
    """``(available, total)`` bytes of this machine's memory (``MemAvailable``,
    ``MemTotal``), or None where they cannot be read."""
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if len(found) != 2:
        return None
    return found["MemAvailable"], found["MemTotal"]


def blas_threads(cores: int, compute_tasks: int, other_tasks: int) -> int:
    """BLAS threads for each of ``compute_tasks`` processes computing on the host: the
    cores left once each of ``other_tasks`` (PS, chief, GPU workers) has one, shared
    (at least 1). Every process of a machine taking all its cores each (BLAS's
    default) oversubscribes it: measured 20x slower on 16 cores (BENCHMARKS.md)."""
    return max(1, (cores - other_tasks) // max(1, compute_tasks))


def thread_env(threads: int, environ: Mapping[str, str]) -> dict[str, str]:
    """``THREAD_VARS`` set to ``threads``, unless ``environ`` sets any of them (the
    user chose): then nothing."""
    if user_chose(environ):
        return {}
    return dict.fromkeys(THREAD_VARS, str(threads))


def exit_with_parent(pid: int, poll_s: float = 0.5) -> None:
    """Stop this process (SIGTERM to itself) once its parent ``pid`` is gone."""

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="zmqps-parent-watch", daemon=True).start()


#: seconds a write to a full output pipe waits for its reader before output is dropped
#: (once dropping, a write waits no more until one gets through again)
OUTPUT_WAIT_S = 1.0


class DroppingWriter(io.RawIOBase):
    """Writes to a non-blocking file descriptor (a pipe the launcher drains) that never
    block for long: a write that finds the pipe full waits at most
    :data:`OUTPUT_WAIT_S` for the reader (none at all while already dropping), then
    drops what did not fit and counts its lines; the next write that gets through
    starts with a line saying how many were dropped. A stopped or busy reader costs
    output lines, never the task's progress."""

    def __init__(self, fd: int, wait_s: float = OUTPUT_WAIT_S) -> None:
        super().__init__()
        self.fd = fd
        self.wait_s = wait_s
        #: lines dropped since output last got through (said then)
        self.dropped = 0
        #: lines dropped in all
        self.dropped_total = 0
        self._dropping = False
        self._mid_line = False  # the last bytes that got out ended inside a line
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def write(self, b: Any) -> int:
        data = bytes(b)
        with self._lock:
            note = self._note()
            out = memoryview(note + data)
            written = 0
            deadline = time.monotonic() + (0.0 if self._dropping else self.wait_s)
            while written < len(out):
                try:
                    n = os.write(self.fd, out[written:])
                except BlockingIOError:
                    n = 0
                except OSError:  # the reader is gone: nothing to wait for
                    break
                if n:
                    self._dropping = False
                    written += n
                    self._mid_line = out[written - 1] != 10  # b"\n"
                    continue
                left = deadline - time.monotonic()
                if left <= 0 or not _writable(self.fd, left):
                    break
            if written >= len(note):
                self.dropped = 0  # said (or nothing to say)
            if written < len(out):
                lines = max(1, data[max(0, written - len(note)) :].count(b"\n"))
                self.dropped += lines
                self.dropped_total += lines
                self._dropping = True
        return len(data)

    def _note(self) -> bytes:
        if not self.dropped:
            return b""
        note = (
            f"zmqps: {self.dropped} line{'s' if self.dropped != 1 else ''} of output"
            " dropped (the pipe to the launcher was full: nobody read it)\n"
        )
        return ("\n" if self._mid_line else "").encode() + note.encode()


def _writable(fd: int, timeout: float) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return bool(poller.poll(timeout * 1000))


def nonblocking_output() -> None:
    """Make this process's stdout and stderr (the pipe ``zmqps launch`` drains) never
    block it: the descriptors non-blocking, ``sys.stdout`` and ``sys.stderr`` on
    :class:`DroppingWriter`. Only for a pipe of this process's own (a terminal's
    descriptor is shared with the shell, and must stay blocking)."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        try:
            if not _is_pipe(fd):
                continue
            os.set_blocking(fd, False)
        except OSError:
            continue
        stream = io.TextIOWrapper(
            io.BufferedWriter(DroppingWriter(fd)),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,
            write_through=True,
        )
        old = getattr(sys, name)
        if old is not None:
            with contextlib.suppress(OSError, ValueError):
                old.flush()
        setattr(sys, name, stream)


def _is_pipe(fd: int) -> bool:
    return stat.S_ISFIFO(os.fstat(fd).st_mode)


def write_text_whole(path: str | os.PathLike[str], text: str, what: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: into a file of its own in the same
    folder, renamed over ``path``. A failure is one :class:`ZmqpsError` line naming
    ``what`` and the file (a full disk left 0-byte summaries behind and said only
    "[Errno 28] No space left on device"); nothing is left of the attempt. A link is
    followed (the file it names is replaced, the link kept); a path that is not a
    regular file (``/dev/stdout``), or a file in a folder this process cannot write in,
    is written in place."""
    target = Path(os.path.realpath(path))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        if target.exists() and not target.is_file():
            target.write_text(text)  # /dev/stdout, a pipe: nothing to rename over
            return
        try:
            tmp.write_text(text)
            os.replace(tmp, target)
        except PermissionError:
            if not target.is_file():
                raise
            target.write_text(text)  # a writable file in a folder that is not
    except OSError as exc:
        raise ZmqpsError(f"cannot write {what} {path}: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
