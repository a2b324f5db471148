"""A chief or a PS started by hand takes one BLAS thread (OpenBLAS starts one per
core as numpy loads, each spinning a while after any call, for nothing in a process
that runs no parallel BLAS); a thread count the user set wins. A real interpreter:
the variables only count if set before numpy is first imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zmqps.blas import THREAD_VARS

PROBE = """
import json, sys
from zmqps.cli import entry
before = "numpy" in sys.modules
entry.one_thread()
import numpy
from threadpoolctl import threadpool_info
print(json.dumps({"before": before, "threads": [p["num_threads"] for p in threadpool_info()
                                               if p["user_api"] == "blas"]}))
"""


@pytest.mark.parametrize("user", [None, "2"])
def test_a_server_process_has_one_blas_thread_unless_the_user_chose(user: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    if user is not None:
        env["OPENBLAS_NUM_THREADS"] = user
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert not seen["before"], "the entry point imported numpy before setting the threads"
    assert seen["threads"], "numpy has no BLAS that threadpoolctl sees"
    want = 1 if user is None else min(int(user), os.cpu_count() or 1)
    assert set(seen["threads"]) == {want}, seen
