"""Process-level helpers for zmqps' own child processes (``zmqps launch``'s tasks,
the benchmarks' sides): below the command line, so the benchmarks need not
import it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["exit_with_parent"]


def exit_with_parent(pid: int, poll_s: float = 0.5) -> None:
    """Stop this process (SIGTERM to itself) once its parent ``pid`` is gone."""

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="zmqps-parent-watch", daemon=True).start()
