"""TensorBoard summaries: each task's scalars in event files, through tensorboardX.

Rules of this module:

* ``--logdir DIR`` gives each task a run folder of its own, ``DIR/<task>``
  (``chief``, ``worker0``, ``evaluator``): TensorBoard shows one run per task and
  overlays the runs that write the same tag (every worker's ``train/loss``).
* Every scalar is against the global step. A role reports what it sees; the
  windowed figures (rates, percentiles, means) are computed here (:class:`Window`),
  sans-IO, at most once per window, from bounded state (a reservoir of the last
  :data:`SAMPLES` values per series).
* Events are tensorboardX's protocol buffers, framed as TensorBoard reads them, and
  written by the caller, no writer thread: each :meth:`Summaries.scalars` call's
  events are in the file (flushed to the OS) when it returns. A value that is not
  finite (a NaN loss) is left out, not written. Writing never raises into training
  and never hangs a task's end: a failure (a full disk) is logged once, in one line
  naming the file, and the task's summaries stop; closing after it does nothing.
  (tensorboardX's own ``SummaryWriter`` flushes from a thread of its own: on a full
  disk that thread died with a traceback and closing the writer waited for it for
  ever.)
* Only this package imports tensorboardX, and only when a logdir is given.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "SAMPLES",
    "WINDOW_S",
    "Summaries",
    "Window",
    "open_summaries",
    "percentile",
]

log = logging.getLogger("zmqps.summaries")

#: Seconds a window of figures lasts (one point per tag and window).
WINDOW_S = 1.0
#: Values kept per series for the percentiles of one window (the latest ones).
SAMPLES = 1024
#: What writing an event file may raise (a full or gone disk, a file closed under it):
#: logged, and the task's summaries stop; anything else is a bug and propagates.
WRITE_ERRORS = (OSError, ValueError)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values`` (sorted or not), nearest rank."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


class EventFile:
    """One TensorBoard event file (``events.out.tfevents.<time>.<host>.<pid>``): records
    of serialized ``Event`` protocol buffers, each framed by its length and the masked
    CRC-32C of both (TFRecord), buffered, written by the caller."""

    def __init__(self, folder: Path) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.record_writer import masked_crc32c

        self._event, self._crc = Event, masked_crc32c
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = folder / name
        self._file = self.path.open("ab")
        self._write(self._event(wall_time=time.time(), file_version="brain.Event:2"))

    def scalar(self, tag: str, value: float, step: int, walltime: float) -> None:
        from tensorboardX.summary import scalar

        self._write(self._event(wall_time=walltime, step=step, summary=scalar(tag, value)))

    def _write(self, event: Any) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        crc = self._crc
        self._file.write(
            header + struct.pack("<I", crc(header)) + data + struct.pack("<I", crc(data))
        )

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        """Flush and close; the file is closed even when the flush fails."""
        try:
            self._file.flush()
        finally:
            self._file.close()


class Summaries:
    """One task's TensorBoard run, ``logdir/run``."""

    def __init__(self, logdir: str | Path, run: str) -> None:
        self.path = Path(logdir) / run
        self.path.mkdir(parents=True, exist_ok=True)
        self._file: EventFile | None = EventFile(self.path)
        self.written = 0

    def scalars(self, step: int, values: Mapping[str, float | int | None]) -> None:
        """Each finite value of ``values`` (tag -> value) at global step ``step``, in
        the file when this returns."""
        events = self._file
        if events is None:
            return
        now = time.time()
        try:
            for tag, value in values.items():
                if value is None or not math.isfinite(value):
                    continue
                events.scalar(tag, float(value), int(step), now)
                self.written += 1
            events.flush()
        except WRITE_ERRORS as exc:
            self._failed(exc)

    def flush(self) -> None:
        if self._file is not None:
            try:
                self._file.flush()
            except WRITE_ERRORS as exc:
                self._failed(exc)

    def close(self) -> None:
        """Flush and close (idempotent); a failure is logged, not raised."""
        events, self._file = self._file, None
        if events is None:
            return
        try:
            events.close()
        except WRITE_ERRORS as exc:
            log.error("summaries in %s: cannot write %s: %s", self.path, events.path.name, exc)

    def _failed(self, exc: BaseException) -> None:
        events, self._file = self._file, None
        assert events is not None
        log.error(
            "summaries in %s: cannot write %s: %s; no more summaries",
            self.path,
            events.path.name,
            exc,
        )
        with contextlib.suppress(*WRITE_ERRORS):  # already failing; said above
            events.close()

    def __enter__(self) -> Summaries:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_summaries(logdir: str | Path | None, run: str) -> Summaries | None:
    """``logdir/run``'s summaries, or None without a logdir."""
    if not logdir:
        return None
    summaries = Summaries(logdir, run)
    log.info("TensorBoard summaries in %s", summaries.path)
    return summaries


class Window:
    """Figures of one window of a task's life: counters become rates per second,
    series become means and percentiles. :meth:`take` returns them once ``interval``
    seconds passed since the window began (and starts the next one), else None; with
    ``force`` (a task's end) at once, without the rates of what did not happen in the
    window (no work after the end is not a rate of 0)."""

    def __init__(self, interval: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        self._began = clock()
        self._counts: dict[str, float] = {}
        self._series: dict[str, deque[float]] = {}
        self._last: dict[str, float] = {}

    def count(self, name: str, n: float = 1.0) -> None:
        """``n`` more of ``name`` (its rate per second is reported)."""
        self._counts[name] = self._counts.get(name, 0.0) + n

    def observe(self, name: str, value: float) -> None:
        """One value of series ``name`` (its mean, p50, p90 and max are reported)."""
        if not math.isfinite(value):
            return
        series = self._series.get(name)
        if series is None:
            series = self._series[name] = deque(maxlen=SAMPLES)
        series.append(value)

    def last(self, name: str, value: float) -> None:
        """``name`` as it is now (reported as is)."""
        self._last[name] = value

    def take(self, force: bool = False) -> dict[str, float] | None:
        now = self.clock()
        elapsed = now - self._began
        if not force and elapsed < self.interval:
            return None
        if not (self._counts or self._series or self._last):
            return None
        out: dict[str, float] = dict(self._last)
        if elapsed > 0:
            for name, n in self._counts.items():
                if n or not force:
                    out[f"{name}_per_second"] = n / elapsed
        for name, series in self._series.items():
            if not series:
                continue
            values = list(series)
            out[f"{name}_mean"] = sum(values) / len(values)
            out[f"{name}_p50"] = percentile(values, 50)
            out[f"{name}_p90"] = percentile(values, 90)
            out[f"{name}_max"] = max(values)
        self._began = now
        self._counts.clear()
        self._series.clear()
        self._last.clear()
        return out
