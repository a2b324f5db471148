"""Watch a cluster from inside one of its namespaces; one JSON line per poll.

    python netns_probe.py --chief HOST:PORT --out FILE [--metrics URL ...]

Lines ``{"t": unix time, "status": the chief's status or null, "metrics": {}}`` and,
from a thread of their own, ``{"t": ..., "status": null, "metrics": {URL:
{"name{label=value,...}": value} or null}}`` (only zmqps_* samples). Runs until
SIGTERM (exit 0). The test process lives in the host's namespace and cannot reach
the cluster's addresses; this script runs next to the chief and can.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from zmqps.roles.status import fetch_status
from zmqps.wire.errors import ZmqpsError


def scrape(url: str) -> dict[str, float] | None:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("zmqps_") and not s.name.endswith("_bucket"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


async def status(chief: str) -> dict[str, Any] | None:
    try:
        return await fetch_status(chief, timeout=4.0)
    except (ZmqpsError, OSError):
        return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--chief", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--metrics", nargs="*", default=[])
    p.add_argument("--interval", type=float, default=0.25)
    args = p.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    lock = threading.Lock()

    with open(args.out, "a") as f:

        def write(line: dict[str, Any]) -> None:
            with lock:
                f.write(json.dumps({"t": time.time(), **line}) + "\n")
                f.flush()

        def scrape_loop() -> None:
            # On its own thread: a status request can take seconds while a PS is cut
            # off (the chief asks every PS whom the step waits on); /metrics cannot.
            while not stop.is_set():
                write({"status": None, "metrics": {u: scrape(u) for u in args.metrics}})
                stop.wait(args.interval)

        scraper = threading.Thread(target=scrape_loop, daemon=True)
        scraper.start()
        while not stop.is_set():
            write({"status": asyncio.run(status(args.chief)), "metrics": {}})
            stop.wait(args.interval)
        scraper.join(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
