"""TensorBoard summaries: the windows' figures (sans-IO, a fake clock) and the event
files they become (read back with TensorBoard's own reader)."""

from __future__ import annotations

import errno
import io
import logging
import math
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zmqps.metrics.summaries import SAMPLES, Summaries, Window, open_summaries, percentile


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_window_reports_rates_means_percentiles_and_last_values_once_it_ends() -> None:
    clock = Clock()
    w = Window(interval=2.0, clock=clock)
    for staleness in range(1, 11):
        w.count("steps")
        w.count("examples", 32)
        w.observe("staleness", staleness)
    w.last("loss", 0.5)
    w.last("loss", 0.25)
    clock.now += 1.0
    assert w.take() is None  # not over yet
    clock.now += 1.0
    got = w.take()
    assert got == {
        "loss": 0.25,
        "steps_per_second": 5.0,
        "examples_per_second": 160.0,
        "staleness_mean": 5.5,
        "staleness_p50": 5,
        "staleness_p90": 9,
        "staleness_max": 10,
    }
    clock.now += 5.0
    assert w.take() is None  # nothing happened: nothing to say


def test_a_forced_window_leaves_out_the_rates_of_what_did_not_happen() -> None:
    clock = Clock()
    w = Window(interval=2.0, clock=clock)
    w.count("steps", 0)
    w.count("examples", 64)
    w.last("workers_alive", 0)
    clock.now += 0.5
    assert w.take(force=True) == {"examples_per_second": 128.0, "workers_alive": 0}


def test_series_keep_a_bounded_sample_and_drop_what_is_not_finite() -> None:
    w = Window(interval=1.0, clock=Clock())
    for v in range(10 * SAMPLES):
        w.observe("wait", float(v))
    w.observe("wait", math.nan)
    w.observe("wait", math.inf)
    assert len(w._series["wait"]) == SAMPLES  # the latest ones
    got = w.take(force=True)
    assert got is not None and got["wait_max"] == 10 * SAMPLES - 1
    assert got["wait_p50"] >= 9 * SAMPLES


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=200), st.floats(0, 100))
def test_percentile_is_a_value_of_the_sample_with_its_share_at_or_below(
    values: list[float], q: float
) -> None:
    p = percentile(values, q)
    assert p in values
    at_or_below = sum(v <= p for v in values)
    assert at_or_below >= math.ceil(q / 100 * len(values))
    assert percentile(values, 100) == max(values) and percentile(values, 0) == min(values)


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard's own reader gets back of ``folder``'s event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_summaries_write_finite_scalars_a_reader_gets_back(tmp_path: Path) -> None:
    assert open_summaries(None, "chief") is None
    with open_summaries(tmp_path, "worker3") as s:  # type: ignore[union-attr]
        assert s.path == tmp_path / "worker3"
        s.scalars(10, {"train/loss": 0.5, "train/bad": math.nan, "train/none": None})
        # in the file when the call returns: TensorBoard sees it while the task runs
        assert read_scalars(s.path) == {"train/loss": [(10, 0.5)]}
        s.scalars(20, {"train/loss": 0.25, "train/steps_per_second": 12})
        assert s.written == 3
    s.close()  # again: nothing happens
    s.scalars(30, {"train/loss": 0.1})  # after close: dropped, no error
    assert read_scalars(tmp_path / "worker3") == {
        "train/loss": [(10, 0.5), (20, 0.25)],
        "train/steps_per_second": [(20, 12.0)],
    }


class FullDisk(io.RawIOBase):
    """A file on a full disk: every write fails with ENOSPC."""

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("when", ["first write", "a later write"])
def test_a_full_disk_stops_the_summaries_not_the_task(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, when: str
) -> None:
    """No writer thread: the call that meets the full disk logs it in one line naming
    the file, the summaries stop, and closing returns at once (tensorboardX's own
    writer left a traceback from its thread and hung the task's close)."""
    s = Summaries(tmp_path, "chief")
    assert s._file is not None
    name = s._file.path.name
    if when == "a later write":
        s.scalars(1, {"cluster/x": 1.0})
    s._file._file = io.BufferedWriter(FullDisk(), buffer_size=64)
    s.scalars(2, {"cluster/x": 2.0, "cluster/y": 3.0})  # logged, not raised
    s.scalars(3, {"cluster/x": 4.0})  # the summaries stopped: nothing is tried
    threads = threading.active_count()
    s.close()
    s.close()
    assert threading.active_count() == threads  # no thread of its own to wait for
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, caplog.text
    assert name in errors[0].getMessage() and "No space left" in errors[0].getMessage()
    assert errors[0].exc_info is None  # one line, no traceback
    if when == "a later write":
        assert read_scalars(tmp_path / "chief") == {"cluster/x": [(1, 1.0)]}
