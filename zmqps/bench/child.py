"""``python -m zmqps.bench.child SIDE ROLE CONFIG``: the entry point of every benchmark child.

Rules of this module:

* One module runs every child, so functions that travel by reference (torch RPC)
  resolve to ``zmqps.bench.<side>`` names in every process, never ``__main__``.
* A child stops when the coordinator is gone (SIGTERM to itself), and a worker
  also when its control pipe closes.
* A failure is reported on the control pipe (workers), logged with its
  traceback, and ends the process at once with status 1: no interpreter
  teardown that could wait on peers (torch RPC's graceful shutdown would).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from zmqps.bench.common import Control
from zmqps.process import exit_with_parent

__all__ = ["main"]

Entry = Callable[[dict[str, Any], Control | None], None]


def _entry(side: str, role: str) -> Entry:
    if side == "zmqps" and role == "worker":
        from zmqps.bench import zmqps_side

        return zmqps_side.worker_main
    if side == "raw":
        from zmqps.bench import raw_zmq

        return {"server": raw_zmq.server_main, "worker": raw_zmq.worker_main}[role]
    if side == "torch":
        from zmqps.bench import torch_rpc

        return {"ps": torch_rpc.ps_main, "worker": torch_rpc.worker_main}[role]
    raise SystemExit(f"zmqps.bench.child: unknown side/role {side}/{role}")


def main(argv: Sequence[str]) -> int:
    if len(argv) != 3:
        raise SystemExit("usage: python -m zmqps.bench.child SIDE ROLE CONFIG")
    side, role, path = argv
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    exit_with_parent(os.getppid())
    config = json.loads(Path(path).read_text())
    ctl = Control() if role == "worker" else None
    try:
        _entry(side, role)(config, ctl)
    except BaseException as exc:
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            return 0
        traceback.print_exc()
        if ctl is not None:
            with contextlib.suppress(OSError):
                ctl.send(error=f"{type(exc).__name__}: {exc}"[:2000])
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
