"""Reading a running cluster's state from its chief (``zmqps status``, the launcher's progress)."""

from __future__ import annotations

import uuid
from typing import Any

from zmqps.transport import Client, SocketOptions, new_context

__all__ = ["fetch_status", "format_status"]


async def fetch_status(
    chief: str,
    timeout: float = 5.0,
    options: SocketOptions | None = None,
    op: str = "status",
    body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The chief's answer to ``op`` (its status, or ``scale``'s account of the moves)."""
    ctx = new_context()
    client = Client(ctx, chief, f"{op}:{uuid.uuid4().hex[:8]}", options=options, timeout=timeout)
    try:
        rep = await client.request(op, body)
        return dict(rep.body)
    finally:
        # a status query left unsent (the chief gone) is dropped: with the socket's
        # linger, ctx.term() would block the caller's event loop for that long
        await client.close(linger_ms=0)
        ctx.term()


def _workers(indices: Any) -> str:
    if not indices:
        return "nobody"
    return ", ".join(f"worker {i}" for i in indices)


def _step(s: dict[str, Any]) -> Any:
    if s.get("step_known", True):
        return s.get("global_step")
    return "not known yet (the chief is starting: it learns it from the PS)"


def format_status(s: dict[str, Any]) -> str:
    lines = [
        f"mode          {s.get('mode')}" + (f"  ({s['phase']})" if s.get("phase") else ""),
        f"global step   {_step(s)}"
        + (f" / {s['steps_planned']} planned" if s.get("steps_planned") else ""),
        f"examples      {s.get('examples')}",
        f"workers alive {len(s.get('workers_alive', []))} of {s.get('workers_expected')}"
        + (f"  (dead: {s['workers_dead']})" if s.get("workers_dead") else ""),
        f"ps            {', '.join(s.get('ps', []))}",
        f"variables     {s.get('variables')} in {s.get('shards')} shards",
    ]
    if s.get("blocker"):
        lines.append(f"blocked       {s['blocker']}")
    elif s.get("finished"):
        lines.append("finished      the run is over")
    down = s.get("ps_down") or {}
    if down:
        lines.append(
            "ps down       "
            + ", ".join(f"ps {i} (silent {sec:.0f}s when found)" for i, sec in down.items())
        )
    if s.get("mode") == "sync":
        lines += [
            f"replicas      N = {s.get('replicas_to_aggregate')} of M = {s.get('total_replicas')}",
            f"tokens        {s.get('tokens_available')} available"
            f" ({s.get('tokens_discarded')} discarded)",
            f"step waits on {_step_waits(s)} (for {s.get('step_age_s', 0):.1f}s)",
        ]
    if s.get("mode") == "ssp" and s.get("ssp"):
        ssp = s["ssp"]
        lines.append(
            f"ssp           max staleness {ssp['max_staleness']},"
            f" largest spread granted {ssp['max_spread']}"
        )
    replication = s.get("replication") or {}
    if replication.get("copies"):
        lines.append(format_replication(replication))
    elastic = s.get("elastic") or {}
    if elastic.get("asked") is not None or elastic.get("moves_done") or elastic.get("moving"):
        lines.append(format_elastic(elastic))
    workers = s.get("workers") or []
    if workers:
        lines.append("worker  incarnation       state  step    loss    last seen")
        for w in workers:
            loss = "-" if w.get("loss") is None else f"{w['loss']:.4f}"
            lines.append(
                f"{w['index']:<7} {w['incarnation']:<17} {w['state']:<6} {w['step']:<7}"
                f" {loss:<7} {w['last_seen_s']:.1f}s ago"
            )
    return "\n".join(lines)


def _step_waits(s: dict[str, Any]) -> str:
    """Whom the sync step waits on: its workers, or (none of them) what blocks it."""
    waiting = s.get("waiting_on")
    if not waiting and s.get("blocker"):
        return "what is blocked above, no worker"
    return _workers(waiting)


def format_replication(r: dict[str, Any]) -> str:
    """Each state's copies (``--replication``), the states short of copies, the copy
    under way and the processes silent past the heartbeat timeout."""
    copies = r.get("copies") or {}
    lines = [
        f"copies        {r.get('replication')} of each state: "
        + "; ".join(
            f"ps {state}'s on ps {c['primary']}"
            + (f" (backups ps {', '.join(map(str, c['backups']))})" if c.get("backups") else "")
            for state, c in sorted(copies.items(), key=lambda kv: int(kv[0]))
        )
    ]
    short = r.get("under_replicated") or []
    if short:
        lines.append(f"short         of copies: ps {', '.join(map(str, short))}'s state")
    copying = r.get("copying")
    if copying:
        lines.append(
            f"copying       ps {copying.get('state')}'s state from ps {copying.get('from')}"
            f" to ps {copying.get('to')} ({copying.get('phase')})"
        )
    silent = r.get("silent") or []
    if silent:
        lines.append(f"silent        ps {', '.join(map(str, silent))} (past the heartbeat timeout)")
    return "\n".join(lines)


def format_elastic(e: dict[str, Any]) -> str:
    """``zmqps scale``'s lines: who serves the states, what moves, what was moved."""
    lines = [
        f"serving       ps {', '.join(map(str, e.get('serving') or []))}"
        f"  (placement epoch {e.get('epoch', 0)})",
        "asked         "
        + ("as started" if e.get("asked") is None else f"ps {', '.join(map(str, e['asked']))}"),
    ]
    moving = e.get("moving")
    if moving:
        done = 100 * float(moving.get("progress", 0))
        lines.append(
            f"moving        ps {moving['state']}'s state from ps {moving['from']} to ps"
            f" {moving['to']} ({moving.get('phase')}, {done:.0f}%)"
        )
    if e.get("waiting"):
        lines.append(f"waiting       {e['waiting']}")
    lines.append(
        f"moves         {e.get('moves_done', 0)} done, {e.get('moves_failed', 0)} failed,"
        f" {e.get('moved_bytes', 0)} bytes moved"
    )
    if e.get("drained"):
        lines.append(f"drained       ps {', '.join(map(str, e['drained']))}")
    return "\n".join(lines)
