"""``zmqps bench checkpoint``: what a checkpoint costs, and a restore onto other PS.

Rules of this module:

* It runs the PS's own steps on a real store: the snapshot a ``checkpoint_save``
  takes (a copy of values and optimizer slots: the only part that holds training
  back), the shard files :func:`zmqps.checkpoint.write_shard` writes, the commit,
  a full digest verification, and a resharded restore (``Checkpoint.read_rows`` for
  the shards of another number of PS).
* Figures are seconds and GB/s of checkpointed state (values + slots), medians of
  ``repeat`` runs into a temporary directory (``--checkpoint-root`` picks where:
  its filesystem is what is measured).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from zmqps.checkpoint import CheckpointRoot, Manifest, write_shard
from zmqps.core.partition import Partitioner, plan
from zmqps.core.store import ShardStore
from zmqps.core.variables import VariableDef

__all__ = ["format_checkpoint", "run_checkpoint"]

ADAM = {"name": "adam", "lr": 0.001}


def _placement(n: int, num_ps: int, shard_mb: int) -> Any:
    var = VariableDef("w", (n // 256, 256), "float32", init={"name": "zeros"})
    return plan((var,), num_ps, Partitioner(max_shard_bytes=shard_mb << 20), "round_robin", ADAM)


def run_checkpoint(
    size_mb: float = 100.0, repeat: int = 3, root: str | None = None
) -> dict[str, Any]:
    n = max(1 << 16, int(size_mb * (1 << 20)) // 4 // 256 * 256)
    src = _placement(n, 2, 16)
    store = ShardStore()
    store.create([d for _, d in src.shard_defs()])
    state_bytes = store.nbytes()
    target = _placement(n, 3, 12)  # other row boundaries: every read is resharded
    base = Path(tempfile.mkdtemp(prefix="zmqps-bench-ckpt-", dir=root))
    times: dict[str, list[float]] = {k: [] for k in ("snapshot", "write", "commit", "verify")}
    times["restore"] = []
    try:
        ckroot = CheckpointRoot(base, keep=1)
        for step in range(1, repeat + 1):
            t0 = time.perf_counter()
            snap = [
                (sh.definition, sh.values.copy(), {k: v.copy() for k, v in sh.slots.items()})
                for sh in store
            ]
            t1 = time.perf_counter()
            temp = ckroot.new_temp(step)
            records = [write_shard(temp, d, v, sl, step) for d, v, sl in snap]
            t2 = time.perf_counter()
            manifest = Manifest(
                step=step,
                variables=[v.to_wire() for v in src.variables],
                optimizer=ADAM,
                num_ps=2,
                shards=records,
            )
            ckpt = ckroot.commit(temp, manifest)
            t3 = time.perf_counter()
            problems = ckpt.verify()
            t4 = time.perf_counter()
            assert not problems, problems
            for _, d in target.shard_defs():
                ckpt.read_rows(d.var, d.row_start, d.rows)
            t5 = time.perf_counter()
            del snap
            for k, a, b in (
                ("snapshot", t0, t1),
                ("write", t1, t2),
                ("commit", t2, t3),
                ("verify", t3, t4),
                ("restore", t4, t5),
            ):
                times[k].append(b - a)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "suite": "checkpoint",
        "state_mb": state_bytes / (1 << 20),
        "shards": len(src.shards),
        "restore_shards": len(target.shards),
        "repeat": repeat,
        "seconds": {k: {"median": med[k], "min": min(v), "max": max(v)} for k, v in times.items()},
        "gb_per_s": {k: state_bytes / med[k] / 1e9 for k in med if med[k] > 0},
    }


def format_checkpoint(run: dict[str, Any]) -> str:
    lines = [
        f"checkpoint: {run['state_mb']:.0f} MB of state (values + adam slots) in"
        f" {run['shards']} shards of 2 PS, restored onto {run['restore_shards']} shards of 3 PS;"
        f" median (min-max) of {run['repeat']}"
    ]
    for k, v in run["seconds"].items():
        gbs = run["gb_per_s"].get(k)
        rate = f"{gbs:6.2f} GB/s" if gbs else ""
        lines.append(f"  {k:<9} {v['median']:7.3f} s  ({v['min']:.3f}-{v['max']:.3f})  {rate}")
    return "\n".join(lines)
