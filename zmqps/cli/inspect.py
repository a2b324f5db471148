"""``zmqps inspect CKPT_DIR``: what a checkpoint root (or one checkpoint) holds, verified.

Rules of this module:

* Read only: it never writes, prunes or cleans anything in the directory.
* For every committed checkpoint: step, generation, mode, creation time, shards,
  bytes, and per variable its full shape, dtype, dense/sparse, optimizer, slots and
  the row ranges of its shard files; ``LATEST``; with ``--verify`` (the default)
  every file's size, sha256 and safetensors header (:meth:`Checkpoint.verify`).
* Exit status: 0 when every committed checkpoint is intact (so the latest
  verifies), 1 when any fails verification or its manifest does not load, or there
  is none; 2 for a path that is not a directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from zmqps.checkpoint.format import CheckpointError
from zmqps.checkpoint.root import MANIFEST, Checkpoint, CheckpointRoot, is_valid_name

__all__ = ["add_args", "describe", "run"]

#: Row ranges shown per variable in the text output (the JSON lists all).
MAX_RANGES = 8


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path", metavar="CKPT_DIR", help="a checkpoint root, or one checkpoint directory in it"
    )
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check every file's size, sha256 and header (default: on)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def describe(ckpt: Checkpoint, problems: list[str] | None) -> dict[str, Any]:
    """A JSON-able description of one checkpoint (``problems=None``: not verified)."""
    m = ckpt.manifest
    variables = []
    for v in ckpt.variable_defs():
        shards = m.shards_of(v.name)
        variables.append(
            {
                "name": v.name,
                "shape": list(v.shape),
                "dtype": v.dtype,
                "sparse": v.sparse,
                "optimizer": ckpt.optimizer_of(v.name),
                "slots": list(shards[0].slots) if shards else [],
                "rows": [[s.row_start, s.row_end] for s in shards],
                "versions": [s.version for s in shards],
            }
        )
    return {
        "name": ckpt.name,
        "path": str(ckpt.path),
        "step": m.step,
        "generation": m.generation,
        "mode": m.mode,
        "created": m.created,
        "num_ps": m.num_ps,
        "shards": len(m.shards),
        "bytes": m.nbytes,
        "verified": None if problems is None else not problems,
        "problems": problems or [],
        "variables": variables,
        "extra": dict(m.extra),
    }


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _optimizer(cfg: dict[str, Any]) -> str:
    rest = " ".join(f"{k}={v}" for k, v in sorted(cfg.items()) if k != "name")
    return f"{cfg.get('name')}({rest})" if rest else str(cfg.get("name"))


def _status(d: dict[str, Any]) -> str:
    if d["verified"] is None:
        return "not verified"
    return "ok" if d["verified"] else "FAILED"


def _text(report: dict[str, Any]) -> str:
    lines = []
    n = len(report["checkpoints"])
    head = f"{report['kind']} {report['path']}: {n} committed checkpoint{'s' * (n != 1)}"
    if report["kind"] == "root":
        head += f", LATEST {report['latest'] or '(none)'}"
    lines.append(head)
    for d in report["checkpoints"]:
        created = datetime.fromtimestamp(d["created"], tz=timezone.utc)
        mark = "  [LATEST]" if d["name"] == report["latest"] else ""
        lines.append("")
        lines.append(f"{d['name']}{mark}  {_status(d)}")
        lines.append(
            f"  step {d['step']}  generation {d['generation']}  mode {d['mode']}"
            f"  created {created:%Y-%m-%d %H:%M:%S} UTC"
        )
        lines.append(f"  {d['shards']} shards, {_size(d['bytes'])}, written by {d['num_ps']} PS")
        for p in d["problems"]:
            lines.append(f"  problem: {p}")
        table = [("variable", "shape", "dtype", "kind", "optimizer", "slots", "rows")]
        for v in d["variables"]:
            ranges = [f"[{a},{b})" for a, b in v["rows"]]
            if len(ranges) > MAX_RANGES:
                ranges = [*ranges[: MAX_RANGES - 1], f"... {len(ranges)} shards"]
            table.append(
                (
                    v["name"],
                    "(" + ", ".join(map(str, v["shape"])) + ")",
                    v["dtype"],
                    "sparse" if v["sparse"] else "dense",
                    _optimizer(v["optimizer"]),
                    ",".join(v["slots"]) or "-",
                    " ".join(ranges),
                )
            )
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
        for row in table:
            cells = [c.ljust(w) for c, w in zip(row, widths, strict=False)]
            lines.append("    " + "  ".join([*cells, row[-1]]).rstrip())
        if d["extra"]:
            lines.append(f"  extra: {json.dumps(d['extra'], sort_keys=True)[:200]}")
    for b in report["broken"]:
        lines.append("")
        lines.append(f"{b['name']}  BROKEN: {b['problem']}")
    if report["kind"] == "root":
        lines.append("")
        usable = report["usable"]
        if report["verify"]:
            lines.append(f"a restore would use: {usable or '(nothing usable)'}")
        else:
            lines.append(f"newest: {usable or '(none)'} (not verified)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        print(f"zmqps inspect: error: {path} {what}", file=sys.stderr)
        return 2
    verify: bool = args.verify
    broken: list[tuple[str, str]] = []
    ckpts: list[Checkpoint] = []
    latest: str | None = None
    if (path / MANIFEST).exists() or is_valid_name(path.name):
        kind = "checkpoint"
        try:
            ckpts = [Checkpoint.load(path)]
        except CheckpointError as exc:
            broken.append((path.name, str(exc)))
    else:
        kind = "root"
        root = CheckpointRoot(path)
        ckpts, broken = root.scan()
        latest = root.latest_name()
    described = [describe(c, c.verify() if verify else None) for c in ckpts]
    usable = next((d["name"] for d in reversed(described) if d["verified"] is not False), None)
    report = {
        "kind": kind,
        "path": str(path),
        "latest": latest,
        "verify": verify,
        "usable": usable,
        "checkpoints": described,
        "broken": [{"name": n, "problem": p} for n, p in broken],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_text(report))
    if not ckpts and not broken and kind == "root":
        inner = path / "checkpoints"  # a run folder (zmqps launch --run-dir) named instead
        if inner.is_dir():
            print(
                f"zmqps inspect: {path} looks like a run folder: its checkpoints are in"
                f" {inner} (zmqps inspect {inner})",
                file=sys.stderr,
            )
    if not ckpts or broken or any(d["verified"] is False for d in described):
        return 1
    return 0
