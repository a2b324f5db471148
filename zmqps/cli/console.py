"""The launcher's own terminal output, written without ever blocking the launcher.

``zmqps launch`` drains its tasks' pipes on its event loop; a write to a terminal
that is stopped (Ctrl-S, a pager waiting) or to a pipe nobody reads blocks, and a
launcher blocked there no longer drains the tasks' pipes, which then block the tasks.
:class:`Console` takes every write at once into a bounded queue that a thread of its
own writes out; what does not fit is dropped and counted, and a line says how many
once output gets through again. The task's log files get every line regardless.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import IO

__all__ = ["QUEUE_CHARS", "Console"]

#: characters queued for the terminal at most; beyond, writes are dropped and counted
QUEUE_CHARS = 1 << 20


class Console:
    """A file-like writer (``write``, ``flush``: usable by ``print`` and tqdm) over
    ``stream`` whose writes never block: a thread writes the queue out."""

    def __init__(self, stream: IO[str], limit: int = QUEUE_CHARS, who: str = "zmqps launch"):
        self.stream = stream
        self.limit = limit
        self.who = who
        self.encoding = getattr(stream, "encoding", "utf-8")
        self._queue: deque[str] = deque()
        self._queued = 0  # characters in the queue
        #: lines dropped since the last one queued (said before the next)
        self.dropped = 0
        #: lines dropped in all
        self.dropped_total = 0
        self._cond = threading.Condition()
        self._busy = False  # the thread is writing a part it took
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="zmqps-console", daemon=True)
        self._thread.start()

    def write(self, text: str) -> int:
        if not text:
            return 0
        with self._cond:
            if self._closed or self._queued + len(text) > self.limit:
                lines = text.count("\n")  # a progress bar's redraw is no line
                self.dropped += lines
                self.dropped_total += lines
                return len(text)
            if self.dropped:
                n = self.dropped
                self._put(
                    f"{self.who}: {n} line{'s' if n != 1 else ''} of output dropped (the"
                    " terminal or pipe took none; every task's lines are in its log file)\n"
                )
                self.dropped = 0
            self._put(text)
            self._cond.notify()
        return len(text)

    def _put(self, text: str) -> None:
        self._queue.append(text)
        self._queued += len(text)

    def flush(self) -> None:
        """Nothing to do here: the thread writes (and flushes) as soon as it can."""

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for everything queued to be written."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Write out what is queued (waiting at most ``timeout`` seconds), then take no
        more."""
        self.drain(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                parts = list(self._queue)
                self._queue.clear()
                self._queued = 0
                self._busy = True
            try:
                self.stream.write("".join(parts))
                self.stream.flush()
            except (OSError, ValueError):
                pass  # a terminal gone: nothing more to say there
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
