"""Ask a chief for N PS (its ``scale`` op), and perhaps kill -9 a task while a move is
under way (a script, run as a process, in the chief's namespace when there are
namespaces: the harness's own cannot reach those addresses).

    python scaler.py --chief HOST:PORT --ps N --out FILE [--victim source|destination|chief
                     --pid NAME=PID ... [--watch-s 20]] [--parent-pid PID]

The ask is sent again until the chief answers it (a chief restarting answers nothing).
With ``--victim``, the chief's status is then polled as fast as it answers until its
``elastic.moving`` names a move; the move's source PS (``from``), destination (``to``)
or the chief is killed at once (by the pids given: the harness's supervisor started
them). One JSON line goes to ``--out``: what was asked, what was answered, and (with a
victim) whom it killed and the move it saw, or why it killed nobody.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from zmqps.roles.status import fetch_status
from zmqps.wire.errors import ZmqpsError


async def ask(chief: str, n: int, give_up: float) -> dict[str, Any] | str:
    """The chief's answer to ``scale`` (``{"ps": n}``), sent until answered."""
    why = "not sent"
    while time.monotonic() < give_up:
        try:
            return await fetch_status(chief, timeout=2.0, op="scale", body={"ps": n})
        except (ZmqpsError, OSError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.2)
    return f"no answer to scale: {why}"


async def watch(chief: str, n: int, victim: str, pids: dict[str, int], until: float) -> dict:
    """Poll the status until a move is under way, then kill ``victim`` of it."""
    polls = 0
    last: dict[str, Any] = {}
    while time.monotonic() < until:
        try:
            st = await fetch_status(chief, timeout=1.0)
        except (ZmqpsError, OSError):
            await asyncio.sleep(0.01)
            continue
        polls += 1
        el = st.get("elastic") or {}
        moving = el.get("moving")
        if moving:
            name = (
                "chief"
                if victim == "chief"
                else f"ps{moving['to' if victim == 'destination' else 'from']}"
            )
            pid = pids.get(name)
            if pid is None:
                return {"killed": None, "why": f"no pid of {name}", "moving": moving}
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return {"killed": None, "why": f"{name} ({pid}) had exited", "moving": moving}
            return {
                "killed": name,
                "pid": pid,
                "t": time.monotonic(),
                "moving": moving,
                "polls": polls,
            }
        last = el
        # the plan is done: every state where it was asked, no move left to catch
        if el.get("asked") == list(range(n)) and el.get("planned") == 0:
            return {
                "killed": None,
                "why": "the moves were over before one was seen",
                "polls": polls,
                "elastic": last,
            }
    return {"killed": None, "why": "no move seen in time", "polls": polls, "elastic": last}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--chief", required=True)
    p.add_argument("--ps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--victim", choices=("source", "destination", "chief"))
    p.add_argument("--pid", action="append", default=[], help="NAME=PID of a task")
    p.add_argument("--ask-s", type=float, default=30.0, help="how long the ask is sent again")
    p.add_argument("--watch-s", type=float, default=20.0, help="how long a move is waited for")
    p.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    args = p.parse_args()
    if args.parent_pid:

        def orphaned() -> None:
            while os.getppid() == args.parent_pid:
                time.sleep(0.5)
            os._exit(0)

        threading.Thread(target=orphaned, daemon=True).start()
    pids = {k: int(v) for k, v in (x.split("=", 1) for x in args.pid)}

    async def go() -> dict[str, Any]:
        sent = time.monotonic()
        answer = await ask(args.chief, args.ps, sent + args.ask_s)
        out: dict[str, Any] = {"ps": args.ps, "sent": sent, "answered": time.monotonic()}
        if isinstance(answer, str):
            return {**out, "answered": None, "error": answer}
        out["answer"] = answer
        if args.victim:
            until = time.monotonic() + args.watch_s
            out.update(await watch(args.chief, args.ps, args.victim, pids, until))
        return out

    line = asyncio.run(go())
    with open(args.out, "a") as f:
        f.write(json.dumps(line, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
