"""Writes checkpoints into a root in a loop until killed (for the crash tests).

Usage: ``python ckpt_writer.py ROOT BIG_ROWS [PHASE:N]``. Prints ``ready`` once
imported and waits for a line on stdin (so a writer can be started, and its imports
done, while another one still runs on the same root; it exits at end of input), then
prints ``starting STEP`` once it has read the root and ``committed STEP`` after each
commit. Continues from the newest committed step; every third step is committed twice
(a retried step replaces its checkpoint). Every value is a function of the step
(:func:`expected`), so a reader can check what it restores.

With ``PHASE:N`` the writer SIGKILLs itself right after the N-th rename of that
phase of the commit protocol (see :data:`PHASES`): the windows too narrow for a
random kill to hit often.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from zmqps.checkpoint import Checkpoint, CheckpointRoot, Manifest, write_shard
from zmqps.core.partition import Partitioner, plan
from zmqps.core.variables import Placement, VariableDef

NUM_PS = 2
#: Slot names of each optimizer used here (as zmqps.core.optimizers names them; not
#: imported, to keep this script's start fast).
SLOTS = {"sgd": (), "adam": ("m", "v"), "momentum": ("momentum",)}


def variables(big_rows: int) -> list[VariableDef]:
    return [
        VariableDef("big", (big_rows, 256), "float32", optimizer={"name": "sgd", "lr": 0.1}),
        VariableDef("emb", (50, 8), "float32", optimizer={"name": "adam", "lr": 0.01}, sparse=True),
        VariableDef("bias", (8,), "float64", optimizer={"name": "momentum", "lr": 0.1}),
    ]


def placement(big_rows: int) -> Placement:
    return plan(variables(big_rows), NUM_PS, Partitioner(num_shards=3))


@functools.lru_cache(maxsize=32)
def _base(row_size: int, row_start: int, rows: int) -> np.ndarray:
    return np.arange(row_start * row_size, (row_start + rows) * row_size, dtype=np.float64) % 1000


def expected(var: VariableDef, step: int, row_start: int, rows: int) -> np.ndarray:
    """Values of rows [row_start, row_start + rows) of ``var`` at ``step``."""
    base = _base(var.row_size, row_start, rows)
    return (base + step).astype(var.dtype).reshape(rows, *var.shape[1:])


def slot_value(name: str, step: int) -> float:
    return step + 0.5 if name == "m" else step + 0.25


def write_shards(temp: Path, pl: Placement, step: int) -> Manifest:
    """Write every shard of ``pl`` at ``step`` into ``temp``; the manifest to commit."""
    records = []
    for _, sd in pl.shard_defs():
        var = pl.variable(sd.var)
        slots = {
            name: np.full(sd.shape, slot_value(name, step), dtype=sd.dtype)
            for name in SLOTS[sd.optimizer["name"]]
        }
        values = expected(var, step, sd.row_start, sd.rows)
        records.append(write_shard(temp, sd, values, slots, version=step))
    return Manifest(
        step=step,
        generation=0,
        mode="sync",
        variables=[v.to_wire() for v in pl.variables],
        optimizer=pl.optimizer,
        num_ps=NUM_PS,
        shards=records,
        extra={"worker_steps": {"0": step}},
    )


def commit_into(root: CheckpointRoot, temp: Path, pl: Placement, step: int) -> Checkpoint:
    return root.commit(temp, write_shards(temp, pl, step))


def commit(root: CheckpointRoot, pl: Placement, step: int) -> Checkpoint:
    return commit_into(root, root.new_temp(step), pl, step)


#: Renames of the commit protocol, by the name they give: the manifest into the temp
#: directory, an existing checkpoint of the same step moved away, the temp directory
#: committed, LATEST replaced, a pruned checkpoint moved out of sight.
PHASES = {
    "manifest": r"manifest\.json",
    "old": r"\.old-ckpt-.*",
    "commit": r"ckpt-[0-9]+",
    "latest": r"LATEST",
    "del": r"\.del-ckpt-.*",
}


def die_after(phase: str, n: int) -> None:
    """SIGKILL this process right after the ``n``-th rename of ``phase``."""
    pattern = re.compile(PHASES[phase])
    seen = 0

    def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
        def renamed(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            nonlocal seen
            out = real(src, dst, *args, **kwargs)
            if pattern.fullmatch(Path(dst).name):
                seen += 1
                if seen == n:
                    os.kill(os.getpid(), signal.SIGKILL)
            return out

        return renamed

    os.rename = wrap(os.rename)  # type: ignore[assignment]
    os.replace = wrap(os.replace)  # type: ignore[assignment]


def main() -> None:
    if len(sys.argv) > 3:
        phase, n = sys.argv[3].split(":")
        die_after(phase, int(n))
    pl = placement(int(sys.argv[2]))
    print("ready", flush=True)
    if not sys.stdin.readline():
        return  # never told to start
    root = CheckpointRoot(Path(sys.argv[1]), keep=3)
    done = root.checkpoints()
    step = max((c.step for c in done), default=0) + 1
    print(f"starting {step}", flush=True)
    while True:
        commit(root, pl, step)
        if step % 3 == 0:
            commit(root, pl, step)
        print(f"committed {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
