"""``bin/faults``: run fault schedules and report (see README, "Fault schedules").

    bin/faults --seeds 200              # seeds 1..200
    bin/faults --seed 17 --seed 40      # these seeds
    bin/faults --seeds 30 --mode sync   # the first 30 seeds whose schedule is sync
    bin/faults --seeds 100 --replication 2   # replicated schedules: fail-overs, no restore

Exit code 1 when any invariant was violated, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from faults.report import run_one, summarize
from faults.runner import References, netns_unavailable
from faults.schedule import FAULT_KINDS, Schedule, draw, draw_replicated


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bin/faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, metavar="N", help="run N schedules (seeds from --start)")
    p.add_argument("--start", type=int, default=1, help="first seed of --seeds (default: 1)")
    p.add_argument("--seed", type=int, action="append", default=[], help="run this seed")
    p.add_argument("--mode", choices=("async", "sync", "ssp"), help="only schedules of this mode")
    p.add_argument("--driver", choices=("worker", "coordinator"), help="only this driver")
    p.add_argument("--kind", choices=FAULT_KINDS, help="only schedules with this fault kind")
    p.add_argument("--no-netns", action="store_true", help="never use network namespaces")
    p.add_argument(
        "--work",
        default=os.path.join(tempfile.gettempdir(), "zmqps-faults"),
        help="folder for the runs (default: %(default)s); a run with a violation is kept",
    )
    p.add_argument("--keep", action="store_true", help="keep every run's folder")
    p.add_argument(
        "--cache",
        default=os.path.join(Path.home(), ".cache", "zmqps-faults"),
        help="unfaulted results per configuration (default: %(default)s)",
    )
    p.add_argument("--json", metavar="FILE", help="also write every result as JSON lines here")
    p.add_argument("--list", action="store_true", help="print the schedules, run nothing")
    p.add_argument(
        "--replication",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: the replicated schedules (3 PS, two copies of each state; default: 1)",
    )
    args = p.parse_args(argv)
    # SIGTERM ends the run like Ctrl-C: the cluster is stopped, namespaces deleted
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.seeds and not args.seed:
        p.error("give --seeds N or --seed S")

    why = "--no-netns" if args.no_netns else netns_unavailable()
    if why is not None:
        print(f"faults: partitions left out of the draw: {why}", file=sys.stderr)

    def drawn(seed: int) -> Schedule:
        return draw_replicated(seed, why) if args.replication > 1 else draw(seed, why)

    schedules = [drawn(s) for s in args.seed]
    if args.seeds:
        seed = args.start
        while len(schedules) < len(args.seed) + args.seeds:
            s = drawn(seed)
            seed += 1
            if args.mode and s.mode != args.mode:
                continue
            if args.driver and s.driver != args.driver:
                continue
            if args.kind and args.kind not in s.kinds():
                continue
            schedules.append(s)
    if args.list:
        for s in schedules:
            print(s.describe())
        return 0

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    refs = References(Path(args.cache), work, say=lambda m: print(f"faults: {m}", flush=True))
    results = []
    failures = 0
    started = time.monotonic()
    out = open(args.json, "a") if args.json else None  # noqa: SIM115 - closed below
    try:
        for n, s in enumerate(schedules, 1):
            try:
                res = run_one(s, refs, work, keep=args.keep, say=lambda m: None)
            except RuntimeError as exc:  # no unfaulted run of its configuration ended well
                print(f"[{n}/{len(schedules)}] {s.describe()}\n    not run: {exc}", flush=True)
                failures += 1
                continue
            results.append(res)
            state = (
                "ok"
                if res.ok
                else "VIOLATED " + ", ".join(f"{c.invariant}:{c.name}" for c in res.violations)
            )
            print(
                f"[{n}/{len(schedules)}] {s.describe()}\n    {state}; {res.wall:.1f}s;"
                f" longest pause {res.pause['seconds']}s ({res.pause['cause']})",
                flush=True,
            )
            if out is not None:
                out.write(json.dumps(res.to_json()) + "\n")
                out.flush()
    except KeyboardInterrupt:
        print("faults: interrupted", file=sys.stderr)
    finally:
        if out is not None:
            out.close()
    print()
    print(summarize(results))
    if failures:
        print(f"\n{failures} schedules not run: their configuration's unfaulted runs failed")
    print(f"\n{time.monotonic() - started:.0f}s in all")
    return 0 if results and not failures and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
