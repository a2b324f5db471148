"""Worker.push_rows_async against a real chief and PS: a row push on its way while the
next pull goes out reads as a push that was waited for (async mode), whatever the
caller does with its arrays meanwhile; a refusal as not finite is skipped as
``push_rows`` skips it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import Reaper, addresses, zmqps_cmd

from zmqps import VariableDef, Worker

LR = 0.5


@pytest.mark.timeout(120)
def test_push_rows_async_in_order_with_the_next_pull(procs: Reaper, tmp_path: Path) -> None:
    chief, ps, worker = addresses(3)
    spec = json.dumps({"cluster": {"chief": [chief], "ps": [ps], "worker": [worker]}})
    base = ["server", "--cluster", spec]
    flags = ["--lr", str(LR), "--num-shards", "3", "--heartbeat-timeout", "30"]
    flags += ["--max-nonfinite-share", "1"]  # the one refused step does not fail the run
    servers = [
        procs.spawn(
            zmqps_cmd(*base, "--role", "chief", "--model", "none", "--optimizer", "sgd", *flags),
            name="chief",
        ),
        procs.spawn(zmqps_cmd(*base, "--role", "ps", "--index", "0"), name="ps"),
    ]
    w = Worker(chief, index=0, timeout=30, connect_timeout=30)
    try:
        w.create_variables([VariableDef("emb", (90, 4), sparse=True)])
        want = np.zeros((90, 4), np.float32)
        rng = np.random.default_rng(0)
        ids = np.empty(20, np.int64)
        grads = np.empty((20, 4), np.float32)
        pending = None
        for _ in range(12):
            ids[:] = rng.integers(0, 90, 20)  # refilled in place every step
            ids[:2] = [0, 89]  # the first and the last row, every step
            got = w.pull_rows("emb", ids)  # sent after the last push: reads it
            np.testing.assert_allclose(got, want[ids], rtol=1e-6, atol=1e-7)
            if pending is not None:
                assert pending.result() is True
            grads[:] = rng.standard_normal((20, 4)).astype(np.float32)
            summed = np.zeros_like(want)
            np.add.at(summed, ids, grads)
            want -= np.float32(LR) * summed
            pending = w.push_rows_async("emb", ids, grads)
            grads[:] = np.nan  # the push holds nothing of the caller's arrays
            ids[:] = 1
        assert pending is not None and pending.result() is True
        np.testing.assert_allclose(w.pull_rows("emb", np.arange(90)), want, rtol=1e-5, atol=1e-6)
        # a refused push: skipped and counted, as push_rows does it
        bad = np.full((1, 4), np.inf, np.float32)
        assert w.push_rows_async("emb", np.array([3]), bad).result() is False
        assert w.nonfinite == 1
        np.testing.assert_allclose(w.pull_rows("emb", [3])[0], want[3], rtol=1e-5, atol=1e-6)
    finally:
        w.close("done")
    for p in servers:  # the run ends with its one worker done
        assert p.wait(60) == 0
