"""The launcher's relay of a task's output: every line reaches the log file whole,
however long, so a task never blocks on a full pipe."""

from __future__ import annotations

import asyncio

import pytest

from zmqps.cli.launch import RELAY_PART_BYTES, _lines


def _collect(data: bytes, pieces: int) -> list[bytes]:
    async def run() -> list[bytes]:
        stream = asyncio.StreamReader()
        step = max(1, len(data) // pieces)
        for i in range(0, len(data), step):
            stream.feed_data(data[i : i + step])
        stream.feed_eof()
        return [line async for line in _lines(stream)]

    return asyncio.run(run())


@pytest.mark.parametrize("pieces", [1, 3, 1000])
def test_lines_longer_than_the_readers_buffer_come_whole(pieces: int) -> None:
    long = b"x" * (200 * 1024)  # past asyncio's 64 KiB line limit
    data = b"first\n" + long + b"\nlast"
    assert _collect(data, pieces) == [b"first", long, b"last"]


def test_output_without_a_newline_comes_in_bounded_parts() -> None:
    data = b"y" * (2 * RELAY_PART_BYTES + 5)
    out = _collect(data, 7)
    assert b"".join(out) == data
    assert max(map(len, out)) <= RELAY_PART_BYTES


def test_empty_lines_are_kept() -> None:
    assert _collect(b"a\n\nb\n", 5) == [b"a", b"", b"b"]
