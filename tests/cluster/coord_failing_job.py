"""A coordinator job whose drive() fails at once (tests/cluster/test_coordinator_cluster.py)."""

from __future__ import annotations

from typing import Any


def drive(coordinator: Any, job: Any, callbacks: Any = ()) -> dict[str, Any]:
    raise RuntimeError("the job's own bug")
