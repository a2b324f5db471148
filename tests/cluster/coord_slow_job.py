"""The digits job in coordinator mode with every training step slowed by 20 ms, so a
worker killed while it runs a function is killed mid-function (tests import it with
``--job coord_slow_job``)."""

from __future__ import annotations

import time
from typing import Any

from zmqps.coordinator import FunctionContext
from zmqps.coordinator.digits import batch_stream, drive, noop
from zmqps.coordinator.steps import train_step as _train_step

__all__ = ["batch_stream", "drive", "noop", "train_step"]


def train_step(ctx: FunctionContext, iterator: Any, model: Any) -> float:
    time.sleep(0.02)
    return _train_step(ctx, iterator, model)
