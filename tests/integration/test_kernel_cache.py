"""The compiled kernels' cache serves a process started after the one that compiled
them: every kernel a PS loads at its start (:func:`zmqps.roles.ps.warm.warm_kernels`)
is a hit, none is compiled again, and the cache stops growing.

Before: the row kernels called the dense ones through a closure cell, which numba
pickles into a cached kernel's key with an identifier drawn anew in each process.
Every PS start compiled the four row kernels again (its kernels loaded in 1.6 s, not
0.7) and added them to the cache's index, which grew with every start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

_LOAD = """
import json
from zmqps.core import _kernels
from zmqps.roles.ps.warm import warm_kernels
warm_kernels()
print(json.dumps({
    name: [sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values())]
    for name, k in _kernels._KERNELS.items()
}))
"""


def _start(cache: Path) -> dict[str, Any]:
    """A fresh process's warm-up: each kernel's cache hits and misses."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def _cache_files(cache: Path) -> dict[str, int]:
    return {str(p.relative_to(cache)): p.stat().st_size for p in cache.rglob("*") if p.is_file()}


def test_a_second_process_loads_every_kernel_from_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "numba"
    first = _start(cache)
    used = {name for name, (hits, misses) in first.items() if hits + misses}
    # the float32 kernels a PS runs: the value check, the rows' sum, each optimizer's
    # dense and row update
    assert {"bad_sum", "sum_rows", "sgd", "adam", "sgd_rows", "adam_rows"} <= used, first
    files = _cache_files(cache)
    second = _start(cache)
    assert {n: m for n, (_, m) in second.items() if m} == {}, "compiled again: " + str(second)
    assert all(second[n][0] >= 1 for n in used), second
    assert _cache_files(cache) == files, "the cache grew on a start that compiled nothing"
