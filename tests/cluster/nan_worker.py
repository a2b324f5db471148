"""``zmqps-worker`` whose model spoils one gradient every ``ZMQPS_TEST_NAN_EVERY`` steps.

A user's model that diverges now and then: every N-th call of ``loss_and_grads`` the
loss is NaN and one element of one gradient is NaN (the PS must refuse it, the worker
skip it). Everything else is the real ``zmqps-worker`` (same flags). The fault comes
from here, never from the product.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from zmqps.cli.main import worker_main
from zmqps.roles.job import JobConfig

EVERY = int(os.environ.get("ZMQPS_TEST_NAN_EVERY", "50"))
_build = JobConfig.build_model


def _spoiling(self: JobConfig, data: Any) -> Any:
    model = _build(self, data)
    real = model.loss_and_grads
    calls = [0]

    def loss_and_grads(params: Any, x: Any, y: Any, on_ready: Any = None) -> Any:
        calls[0] += 1
        loss, grads = real(params, x, y)
        if calls[0] % EVERY == 0:
            name = sorted(grads)[0]
            spoiled = np.array(grads[name], copy=True)
            spoiled.flat[0] = np.nan
            grads = {**grads, name: spoiled}
            loss = float("nan")
        return loss, grads

    model.loss_and_grads = loss_and_grads  # type: ignore[method-assign]
    return model


JobConfig.build_model = _spoiling  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(worker_main())
