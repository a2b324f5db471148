"""The launcher's console and a task's output to the launcher never block."""

from __future__ import annotations

import io
import os
import threading
import time

from zmqps.cli.console import Console
from zmqps.process import DroppingWriter


class _Stuck(io.StringIO):
    """A terminal that takes nothing until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def write(self, s: str) -> int:
        self.go.wait(10)
        return super().write(s)


def test_a_stuck_terminal_drops_and_counts_lines_never_blocks() -> None:
    out = _Stuck()
    console = Console(out, limit=100)
    started = time.monotonic()
    for i in range(50):
        console.write(f"line {i}\n")
    assert time.monotonic() - started < 1.0
    assert console.dropped_total > 0
    out.go.set()
    console.write("after\n")
    console.close(timeout=5)
    text = out.getvalue()
    assert f"{console.dropped_total} lines of output dropped" in text
    assert text.index("lines of output dropped") < text.index("after\n")


def test_a_full_pipe_drops_lines_and_says_so_once_read() -> None:
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        writer = DroppingWriter(w, wait_s=0.05)
        line = b"x" * 99 + b"\n"
        started = time.monotonic()
        for _ in range(2000):  # 200 KB: more than a pipe holds
            assert writer.write(line) == len(line)
        assert time.monotonic() - started < 2.0
        assert writer.dropped_total > 0
        while True:  # the reader comes back
            try:
                if not os.read(r, 1 << 16):
                    break
            except BlockingIOError:
                break
            os.set_blocking(r, False)
        writer.write(b"next\n")
        got = os.read(r, 1 << 16)
        assert got.startswith(f"zmqps: {writer.dropped_total} lines of output dropped".encode())
        assert got.endswith(b"next\n")
    finally:
        os.close(r)
        os.close(w)
