"""The chief's status over time, as the probe wrote it (tests/faults/probe.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Sample", "Timeline", "named_blockers", "progress_of"]


@dataclass(frozen=True)
class Sample:
    t: float  # CLOCK_MONOTONIC seconds (the middle of the request)
    lat: float  # the request's round trip
    status: dict[str, Any] | None  # None: the chief did not answer


def progress_of(status: dict[str, Any]) -> int:
    """Steps the workers have done, as the chief knows them (every incarnation)."""
    return sum(int(w.get("step") or 0) for w in status.get("workers") or [])


def named_blockers(status: dict[str, Any]) -> dict[str, Any]:
    """What a status names as holding training up (empty: nothing). Today's fields:
    ``waiting_on`` (sync), ``ps_down``, ``recovering``, ``workers_dead``; the roles
    redesign adds ``blocker``, taken as it comes."""
    out: dict[str, Any] = {}
    if status.get("blocker"):
        out["blocker"] = status["blocker"]
    if status.get("recovering"):
        out["recovering"] = True
    if status.get("ps_down"):
        out["ps_down"] = sorted(int(i) for i in status["ps_down"])
    if status.get("waiting_on"):
        out["waiting_on"] = sorted(int(i) for i in status["waiting_on"])
    if status.get("workers_dead"):
        out["workers_dead"] = sorted(int(i) for i in status["workers_dead"])
    return out


class Timeline:
    """The probe's lines, read as they come (a half-written last line waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.samples: list[Sample] = []
        self._offset = 0
        self._partial = b""

    def read(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            self.samples.append(Sample(float(line["t"]), float(line["lat"]), line["status"]))

    def latest(self) -> dict[str, Any] | None:
        """The last status the chief answered with."""
        for s in reversed(self.samples):
            if s.status is not None:
                return s.status
        return None

    def answered_since(self, t: float) -> bool:
        for s in reversed(self.samples):
            if s.t <= t:
                return False
            if s.status is not None:
                return True
        return False

    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.status is not None]
