"""Run schedules and report: faults injected by kind, invariants held / violated, pauses."""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from faults.invariants import INVARIANTS, Check, check_all, longest_pause, violated
from faults.runner import References, RunRecord, execute
from faults.schedule import FAULT_KINDS, Schedule

__all__ = ["Result", "replay_command", "run_one", "summarize"]


def replay_command(s: Schedule) -> str:
    """The command that runs schedule ``s`` again (from the repository's root)."""
    cmd = f"bin/faults --seed {s.seed} --keep"
    if any(kind == "partition_ps" for kind, _ in s.left_out):
        cmd += " --no-netns"
    return cmd


@dataclass
class Result:
    schedule: Schedule
    checks: list[Check]
    pause: dict[str, Any]
    faults: list[dict[str, Any]]
    wall: float
    run_dir: Path | None  # kept (a violation, or --keep)
    summary: dict[str, Any] | None
    accuracy_all: float | None = None
    reference: dict[str, Any] | None = None

    @property
    def violations(self) -> list[Check]:
        return violated(self.checks)

    @property
    def ok(self) -> bool:
        return not self.violations

    def message(self) -> str:
        """What a failing test prints: the seed, the schedule, the replay command."""
        lines = [
            self.schedule.describe(),
            f"replay: {replay_command(self.schedule)}",
            *(f"  {c}" for c in self.violations),
            f"  longest pause {self.pause['seconds']}s ({self.pause['cause']};"
            f" named {self.pause['named']})",
        ]
        for f in self.faults:
            lines.append(f"  fault {json.dumps(f)}")
        if self.run_dir is not None:
            lines.append(f"  logs in {self.run_dir}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.schedule.seed,
            "schedule": self.schedule.to_json(),
            "ok": self.ok,
            "checks": [c.__dict__ for c in self.checks],
            "longest_pause": self.pause,
            "faults": self.faults,
            "wall": round(self.wall, 2),
            "run_dir": None if self.run_dir is None else str(self.run_dir),
            "replay": replay_command(self.schedule),
            "summary": self.summary,
            "accuracy_all": self.accuracy_all,
            "reference": self.reference,
        }


def _fault_rows(rec: RunRecord) -> list[dict[str, Any]]:
    rows = []
    for f in rec.faults:
        row = f.to_json()
        for k in ("fired", "ended"):
            if row[k] is not None:
                row[k] = round(row[k] - rec.started, 2)
        rows.append(row)
    return rows


def run_one(
    s: Schedule,
    refs: References,
    work: Path,
    keep: bool = False,
    say: Callable[[str], None] = print,
) -> Result:
    """Run ``s`` (its unfaulted reference first, if not cached) and check it; the run's
    folder is kept when an invariant is violated or ``keep``."""
    ref = refs.get(s)
    unfaulted = [
        Check("1", "unfaulted-run", False, f"an unfaulted run of {s.config_key()}: {why}")
        for why in refs.failures.get(s.config_key(), [])
    ]
    refs.failures[s.config_key()] = []  # reported once, with this schedule
    run_dir = work / f"seed-{s.seed}-{time.strftime('%H%M%S')}"
    n = 1
    while run_dir.exists():
        n += 1
        run_dir = work / f"seed-{s.seed}-{time.strftime('%H%M%S')}-{n}"
    say(s.describe())
    rec = execute(s, run_dir, ref, say=say)
    checks = unfaulted + check_all(rec, ref)
    res = Result(
        schedule=s,
        checks=checks,
        pause=longest_pause(rec),
        faults=_fault_rows(rec),
        wall=rec.wall,
        run_dir=run_dir,
        summary=rec.summary,
        accuracy_all=rec.accuracy_all,
        reference=ref.to_json(),
    )
    if res.ok and not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
        res.run_dir = None
    return res


def summarize(results: Iterable[Result]) -> str:
    """The report over many schedules."""
    results = list(results)
    injected: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    for r in results:
        for f in r.faults:
            (injected if f["fired"] is not None else skipped)[f["kind"]] += 1
    by_inv: dict[str, list[tuple[Result, Check]]] = {k: [] for k in INVARIANTS}
    for r in results:
        for c in r.violations:
            by_inv[c.invariant].append((r, c))
    lines = [f"{len(results)} schedules, {sum(not r.ok for r in results)} with violations", ""]
    lines.append("faults injected by kind (skipped: their point was never reached):")
    for kind in FAULT_KINDS:
        lines.append(f"  {kind:<24} {injected[kind]:>4}   skipped {skipped[kind]}")
    left_out = {why for r in results for _, why in r.schedule.left_out}
    for why in sorted(left_out):
        lines.append(f"  left out of the draw: {why}")
    lines.append("")
    lines.append("invariants:")
    for k, text in INVARIANTS.items():
        found = by_inv[k]
        seeds = sorted({r.schedule.seed for r, _ in found})
        state = "held" if not found else f"VIOLATED in {len(seeds)} schedules: seeds {seeds}"
        lines.append(f"  {k}. {text}: {state}")
        names = Counter(c.name for _, c in found)
        for name, count in names.items():
            lines.append(f"       {name}: {count}")
    lines.append("")
    lines.append("longest pauses:")
    for r in sorted(results, key=lambda r: -r.pause["seconds"])[:10]:
        p = r.pause
        lines.append(
            f"  {p['seconds']:>6.1f}s  seed {r.schedule.seed} ({r.schedule.mode}): {p['cause']};"
            f" status named {p['named'] or 'nothing'}"
        )
    bad = [r for r in results if not r.ok]
    if bad:
        lines.append("")
        lines.append("violations:")
        for r in bad:
            lines.append(r.message())
    return "\n".join(lines)
