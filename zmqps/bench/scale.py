"""``zmqps bench scale``: how throughput and step time grow with PS and workers.

Rules of this module:

* One dense case per (PS count, worker count), measured as the dense suite measures
  (:func:`zmqps.bench.suites.run_case`): a float32 model of ``--size-mb`` (16 MiB
  unless given) sharded over the PS, the ``push_pull`` step, on each zmqps side asked
  for among ``zmqps`` (shared memory on one host) and ``zmqps-tcp``.
* Reported per case and side: the aggregate steps/s of all workers (the median of
  the repeats), the step time one worker sees (workers / aggregate: every worker
  steps all the time), the bytes each PS moves per aggregate step, and the aggregate
  against the 1 PS x 1 worker case of the same side.
* The cost model it is read against (:func:`cost_model`): a ``push_pull`` step of a
  model of S bytes on P PS sends S / P of gradients to each PS and brings S / P of
  values back, 2 S in all whatever P. Each PS reads and writes its S / P once in its
  update and copies it once into its reply; over TCP every byte also crosses the
  kernel twice each way (a copy into the sender's socket, one out of the
  receiver's), over shared memory it is written into the region once and read there
  once. So the CPU work of a step is about constant in P and W: adding PS spreads it
  and adds parallelism only where idle cores are; adding workers adds steps only
  while cores are idle. On a machine of C cores the aggregate stops growing once
  W + P processes keep the C cores busy, and the step time a worker sees then grows
  with W.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from zmqps.bench.suites import BenchConfig, run_case

__all__ = ["SCALE_PS", "SCALE_WORKERS", "cost_model", "format_scale", "run_scale"]

#: the PS and worker counts a scale run crosses by default
SCALE_PS = (1, 2, 4)
SCALE_WORKERS = (1, 2, 4, 8)
#: the sides it can measure (the others change what is measured, not how it grows)
SCALE_SIDES = ("zmqps", "zmqps-tcp")


def cost_model(model_bytes: int, ps: int) -> dict[str, Any]:
    """Bytes one ``push_pull`` step (one worker's) moves: at each PS and in all."""
    per_ps = 2 * -(-model_bytes // ps)  # gradients in, values out
    return {
        "model_bytes": model_bytes,
        "bytes_per_step_per_ps": per_ps,
        "bytes_per_step": 2 * model_bytes,
    }


def run_scale(
    cfg: BenchConfig,
    run_dir: Path,
    ps_counts: Sequence[int] = SCALE_PS,
    workers: Sequence[int] = SCALE_WORKERS,
) -> dict[str, Any]:
    """Every (PS, workers) case on each side; the scale run's report."""
    sides = tuple(s for s in cfg.sides if s in SCALE_SIDES) or ("zmqps",)
    cases: list[dict[str, Any]] = []
    for p in ps_counts:
        case_cfg = replace(cfg, ps=p, sides=sides, variants=("push_pull",), workers=None)
        for w in workers:
            (run,) = run_case("dense", w, case_cfg, run_dir / f"scale-ps{p}-x{w}")
            model = int(run["workload"]["model_bytes"])
            for side, s in run["sides"].items():
                cases.append(
                    {
                        "ps": p,
                        "workers": w,
                        "side": side,
                        "status": s["status"],
                        "steps_per_s": s.get("median"),
                        "min": s.get("min"),
                        "max": s.get("max"),
                        "step_ms": None if not s.get("median") else 1000.0 * w / s["median"],
                        "mb_per_s": s.get("mb_per_s_median"),
                        **cost_model(model, p),
                    }
                )
    first = {c["side"]: c["steps_per_s"] for c in cases if (c["ps"], c["workers"]) == (1, 1)}
    for c in cases:
        base = first.get(c["side"])
        c["vs_1x1"] = c["steps_per_s"] / base if base and c["steps_per_s"] else None
    return {
        "suite": "scale",
        "size_mb": cfg.size_mb,
        "steps_per_repeat": cfg.steps_for("dense"),
        "repeats": cfg.repeat,
        "ps_counts": list(ps_counts),
        "worker_counts": list(workers),
        "sides": list(sides),
        "cases": cases,
        "ok": all(c["status"] == "ok" for c in cases),
    }


def format_scale(run: dict[str, Any]) -> str:
    """A table per side: a row per PS count, aggregate steps/s and step time per
    worker count."""
    ws = run["worker_counts"]
    lines = [
        f"scale: {run['size_mb']:g} MiB float32 model, push_pull,"
        f" {run['steps_per_repeat']} steps per worker x {run['repeats']} repeats;"
        " aggregate steps/s over all workers (median), step time one worker sees,"
        " and the aggregate against 1 PS x 1 worker"
    ]
    for side in run["sides"]:
        lines.append(
            f"  {side:<10} {'bytes/step/PS':>14} "
            + " ".join(f"{f'{w} worker' + ('s' if w > 1 else ''):>22}" for w in ws)
        )
        for p in run["ps_counts"]:
            row = [c for c in run["cases"] if c["side"] == side and c["ps"] == p]
            per_ps = row[0]["bytes_per_step_per_ps"] / (1 << 20) if row else 0.0
            cells = []
            for w in ws:
                c = next((c for c in row if c["workers"] == w), None)
                if c is None or not c["steps_per_s"]:
                    cells.append(f"{'FAILED' if c else 'n/a':>22}")
                    continue
                vs = "" if c["vs_1x1"] is None else f" x{c['vs_1x1']:.2f}"
                cells.append(f"{c['steps_per_s']:>7.1f}/s {c['step_ms']:>6.1f}ms{vs:>6}")
            lines.append(f"  {f'{p} PS':<10} {per_ps:>10.1f} MiB " + " ".join(cells))
    return "\n".join(lines)
