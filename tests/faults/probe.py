"""Poll a chief's status and append one JSON line per poll (a script, run as a process).

    python probe.py --chief HOST:PORT --out FILE [--interval 0.15] [--timeout 4]
                    [--parent-pid PID]

Each line: ``{"t": monotonic seconds at the middle of the request, "lat": its round
trip, "status": the chief's status or null}``. The request is the one ``zmqps status
--json`` makes (:func:`zmqps.roles.status.fetch_status`). ``time.monotonic`` is
CLOCK_MONOTONIC, one clock for every process of the machine, so the harness compares
these times with its own. It runs as a process of its own so that, for a cluster in
network namespaces, it can live in the chief's namespace (the harness's namespace
cannot reach those addresses). It runs until killed, or until its parent is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time

from zmqps.roles.status import fetch_status
from zmqps.wire.errors import ZmqpsError


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--chief", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--interval", type=float, default=0.15)
    p.add_argument("--timeout", type=float, default=4.0)
    p.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    args = p.parse_args()
    if args.parent_pid:

        def watch() -> None:
            while os.getppid() == args.parent_pid:
                time.sleep(0.5)
            os._exit(0)

        threading.Thread(target=watch, daemon=True).start()
    with open(args.out, "a") as f:
        while True:
            sent = time.monotonic()
            try:
                status = asyncio.run(fetch_status(args.chief, timeout=args.timeout))
            except (ZmqpsError, OSError):
                status = None
            got = time.monotonic()
            line = {"t": round((sent + got) / 2, 4), "lat": round(got - sent, 4), "status": status}
            f.write(json.dumps(line) + "\n")
            f.flush()
            time.sleep(max(0.0, args.interval - (got - sent)))


if __name__ == "__main__":
    sys.exit(main())
