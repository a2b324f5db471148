"""``zmqps bench scale-sim``: many simulated workers against a real chief and real PS.

Rules of this module:

* The chief and the PS are the real servers (``zmqps server``), started as a user
  starts them; only the workers are simulated. A simulated worker is a coroutine
  speaking the real wire protocol with the real message bodies: ``register``,
  ``heartbeat`` at the interval the chief hands out, ``take_token`` (sync) or
  ``ssp_clock``, a tiny ``push`` to every PS each step, ``leave``. Workers are
  spread over a few processes (``--sim-procs``); each process connects one socket
  to each server per group of :data:`GROUP` workers, so that 1,000 workers against
  100 PS need a few thousand connections, not 100,000. A server keys everything
  of a worker by the worker named in the body (``Who``), never by the connection.
* The model: one variable of :data:`WIDTH` float32 per PS (``v<k>``, placed
  round-robin: one shard on each PS), SGD with learning rate 1, zeros at the start.
  Every worker pushes ones. A sync step applies the mean of N ones, exactly 1, so
  after S steps every value is exactly ``-S``; each PS's ``aggregated`` counter (the
  steps applied, by how many gradients each was the mean of) must read
  ``{N: S}``: every step the mean of exactly N gradients, applied once.
* Sampled throughout, every :data:`SAMPLE_S` seconds: each server's CPU time and RSS
  (``/proc``) and the chief's answer time to a ``ping`` from a socket of its own (its
  event-loop lag plus one loopback round trip). Figures: the chief's CPU per worker
  per step and per heartbeat (a phase of heartbeats alone before the steps), its
  RSS per worker, the step rate and the chief's added time per step, each PS's CPU
  per push, the time to detect one worker that goes silent, ``status`` latency and
  size, and false deaths (workers the chief declared dead that never stopped, at the
  end or at any time in its log: the steps meanwhile were of fewer than N gradients,
  so a run with one is not exact either).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SimConfig", "SimFailed", "format_scale_sim", "run_scale_sim"]

#: simulated workers sharing one connection to each server
GROUP = 32
#: floats in each PS's variable
WIDTH = 8
#: seconds between samples of the servers' CPU, RSS and ping time
SAMPLE_S = 0.25
HOST = "127.0.0.1"


@dataclass(frozen=True)
class SimConfig:
    workers: int = 100
    ps: int = 1
    steps: int = 100
    #: sync: N gradients per step (default: every worker, N = M)
    aggregate: int | None = None
    mode: str = "sync"
    procs: int = 4
    heartbeat_timeout: float = 10.0
    #: seconds of heartbeats alone (registered, no steps) measured before the steps
    idle_s: float = 3.0
    #: after the steps: one worker goes silent, the chief must declare it dead
    detect: bool = True
    timeout: float = 600.0
    extra_chief_flags: tuple[str, ...] = field(default_factory=tuple)


# ---------------------------------------------------------------- measuring servers


def _proc_times(pid: int) -> tuple[float, int]:
    """(CPU seconds user + system, RSS bytes) of a live process, from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return cpu, rss


# ---------------------------------------------------------------- the simulated side

#: a push's attempts, as a worker's (``ParameterClient.push_attempts``)
PUSH_ATTEMPTS = 3


def _said(line: str) -> None:
    """A simulated worker's failure, on the process's stderr (its log) at once: a run
    that then hangs says why in its logs."""
    print(line, file=sys.stderr, flush=True)


async def _sim(args: argparse.Namespace) -> dict[str, Any]:
    """One process of simulated workers (``--child``): returns its record."""
    from zmqps.core.variables import Placement, VariableDef
    from zmqps.transport import Client, new_context
    from zmqps.transport.base import waited
    from zmqps.wire import ops as o
    from zmqps.wire.errors import NotReady
    from zmqps.wire.messages import Tensor

    ctx = new_context(max_sockets=1 << 16)
    mine = list(range(args.first, args.workers, args.stride))
    ps_addrs: list[str] = json.loads(args.ps_addrs)
    groups: dict[int, tuple[Client, list[Client]]] = {}

    def clients(g: int) -> tuple[Client, list[Client]]:
        if g not in groups:
            name = f"sim{args.first}-{g}"
            groups[g] = (
                Client(ctx, args.chief, name, timeout=60.0),
                [Client(ctx, a, name, timeout=60.0) for a in ps_addrs],
            )
        return groups[g]

    inc = time.time_ns() // 1000
    record: dict[str, Any] = {
        "workers": len(mine),
        "tokens": 0,
        "tokens_from_ps": 0,
        "pushes": 0,
        "outcomes": {},
        "errors": [],
        "step_seconds": [],
        # heartbeats answered between "ready" and "go" (the idle phase) and after "go"
        "beats_idle": 0,
        "beats_steps": 0,
        # sync, by step: when this process's last push of it was acknowledged, and
        # when its first token of it came (the parent takes the max and min over all)
        "acked": {},
        "first_token": {},
    }
    phase = [""]  # "" (registering), "idle", "steps"
    ready: set[int] = set()
    stop_beats = asyncio.Event()
    silent_at: dict[int, float] = {}
    beat_every = [1.0]  # the chief's heartbeat interval, as it says at registration

    async def beats(who: o.Who, chief: Client, interval: float, progress: list[int]) -> None:
        while not stop_beats.is_set():
            try:
                await chief.request(
                    "heartbeat",
                    o.Heartbeat(who, progress[0]).to_wire(),
                    timeout=max(5.0, 4 * interval),
                    attempts=2,
                )
                if phase[0]:
                    record[f"beats_{phase[0]}"] += 1
            except Exception as exc:  # recorded: the run goes on
                record["errors"].append(f"heartbeat {who.index}: {exc!r}")
                _said(f"worker {who.index}: heartbeat: {exc!r}")
            await waited(stop_beats.wait(), interval)

    async def worker(i: int, group: int, start: asyncio.Event) -> None:
        chief, ps = clients(group)
        who = o.Who("worker", i, inc)
        body = o.Register(who, args.steps).to_wire()
        while True:
            try:
                rep = await chief.request("register", body, timeout=30.0, attempts=2)
                break
            except NotReady:
                await asyncio.sleep(0.2)
        info = o.ClusterInfo.parse(rep.body, "register reply")
        beat_every[0] = info.heartbeat_interval
        if i == 0 and info.placement is None:
            variables = [
                VariableDef(f"v{k}", (WIDTH,), init={"name": "zeros"}).to_wire()
                for k in range(len(ps))
            ]
            await chief.request(
                "create_vars",
                o.CreateVars(tuple(variables), {"name": "sgd", "lr": 1.0}).to_wire(),
                timeout=60.0,
            )
        progress = [0]
        beat = asyncio.ensure_future(beats(who, chief, info.heartbeat_interval, progress))
        placement = info.placement
        while placement is None:
            rep = await chief.request("get_placement", o.GetPlacement(wait=5.0).to_wire())
            placement = o.PlacementReply.parse(rep.body, "placement").placement
        by_ps: dict[int, list[int]] = {}
        for s in Placement.from_wire(placement).shards:
            by_ps.setdefault(s.ps, []).append(s.id)
        versions = {sid: 0 for sids in by_ps.values() for sid in sids}
        grad = np.ones(WIDTH, np.float32)
        seq = [0] * len(ps)
        ready.add(i)
        await start.wait()
        have = -1
        token_ps: int | None = None  # where the last token said to ask for the next
        for done in range(args.steps):
            t0 = time.perf_counter()
            step: int | None = None
            if args.mode == "sync":
                while True:
                    # as a worker does: the PS the last token named, else the chief
                    asked = chief if token_ps is None else ps[token_ps]
                    try:
                        rep = await asked.request(
                            "take_token",
                            o.TakeToken(who, 10.0, have, info.gen).to_wire(),
                            timeout=30.0,
                            attempts=2,  # a long poll: sent again on a new connection
                        )
                        break
                    except NotReady:
                        token_ps = None
                        continue
                token = o.Token.parse(rep.body, "token")
                step, token_ps = token.step, token.ps
                record["tokens_from_ps"] += asked is not chief
                have = step
                first = record["first_token"]
                first[step] = min(first.get(step, float("inf")), time.time())
                record["tokens"] += 1

            async def push(
                k: int, sids: list[int], step: int | None = step, cursor: int = done + 1
            ) -> None:
                seq[k] += 1
                req = o.Push(
                    shards=tuple(sids),
                    versions=tuple(versions[s] for s in sids),
                    worker=who.name,
                    inc=who.incarnation,
                    seq=seq[k],
                    step=step,
                    gen=info.gen,
                    cursor=cursor,
                )
                tensors = [Tensor(grad, "grad", s, 0) for s in sids]
                try:
                    # sent again over a new connection, as a worker does (the PS
                    # deduplicates by sequence): a server whose loop was busy past the
                    # ZMTP heartbeat timeout drops a connection whose pipe is full,
                    # and the requests queued behind it with it
                    rep = await ps[k].request(
                        "push", req.to_wire(), tensors, timeout=60.0, attempts=PUSH_ATTEMPTS
                    )
                except Exception as exc:
                    _said(f"worker {i}: push of step {step} to ps {k}: {exc!r}")
                    raise
                out = o.PushReply.parse(rep.body, "push reply")
                record["outcomes"][out.outcome] = record["outcomes"].get(out.outcome, 0) + 1
                for s, v in zip(sids, out.versions, strict=False):
                    versions[s] = max(versions[s], v)

            await asyncio.gather(*(push(k, sids) for k, sids in by_ps.items()))
            if step is not None:
                record["acked"][step] = max(record["acked"].get(step, 0.0), time.time())
            record["pushes"] += len(by_ps)
            progress[0] = done + 1
            record["step_seconds"].append(time.perf_counter() - t0)
        beat.cancel()
        if i == args.silent:  # goes silent: no leave, no heartbeats
            silent_at[i] = time.time()
            return
        await chief.request(
            "leave", o.Leave(who, args.steps, "done").to_wire(), timeout=30.0, attempts=2
        )

    start = asyncio.Event()
    tasks = [asyncio.ensure_future(worker(i, k // GROUP, start)) for k, i in enumerate(mine)]
    # every worker registered, knows the placement and heartbeats: the parent times
    # the idle phase, then says go
    while len(ready) < len(mine):
        failed = [t for t in tasks if t.done() and t.exception() is not None]
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
        await asyncio.sleep(0.05)
    phase[0] = "idle"
    print(json.dumps({"ready": True, "heartbeat_interval": beat_every[0]}), flush=True)
    loop = asyncio.get_running_loop()
    line = await loop.run_in_executor(None, sys.stdin.readline)
    if line.strip() != "go":
        raise SystemExit(2)
    phase[0] = "steps"
    start.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            record["errors"].append(repr(r))
    stop_beats.set()
    record["silent_at"] = silent_at
    for chief, ps in groups.values():
        for c in (chief, *ps):
            await c.close()
    ctx.term()
    steps = record.pop("step_seconds")
    record["step_ms_median"] = 1000 * statistics.median(steps) if steps else None
    return record


# ---------------------------------------------------------------- the parent


class _Pinger:
    """A thread of its own asking the chief ``ping`` every :data:`SAMPLE_S` seconds;
    keeps each answer time (the chief's event-loop lag plus one round trip)."""

    def __init__(self, chief: str) -> None:
        import threading

        self.chief = chief
        self.times: list[tuple[float, float]] = []  # (when, seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.run(self._loop())

    async def _loop(self) -> None:
        from zmqps.transport import Client, new_context

        ctx = new_context()
        client = Client(ctx, self.chief, f"pinger-{os.getpid()}", timeout=30.0)
        try:
            while not self._stop.is_set():
                t = time.perf_counter()
                try:
                    await client.request("ping", {}, timeout=30.0)
                    self.times.append((time.time(), time.perf_counter() - t))
                except Exception:  # a chief not up yet, or gone
                    pass
                await asyncio.sleep(SAMPLE_S)
        finally:
            await client.close()
            ctx.term()

    def between(self, t0: float, t1: float) -> list[float]:
        return [s for when, s in self.times if t0 <= when <= t1]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


async def _ask(
    address: str, op: str, body: dict[str, Any], timeout: float = 60.0
) -> tuple[Any, int, float, Any]:
    """One request from a socket of its own: (reply body, its encoded bytes, seconds,
    the reply's tensors)."""
    import msgpack

    from zmqps.transport import Client, new_context

    ctx = new_context()
    client = Client(ctx, address, f"ask-{os.getpid()}-{time.time_ns()}", timeout=timeout)
    try:
        t = time.perf_counter()
        rep = await client.request(op, body, timeout=timeout)
        took = time.perf_counter() - t
        return rep.body, len(msgpack.packb(rep.body)), took, rep.tensors
    finally:
        await client.close()
        ctx.term()


def _stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max": ordered[-1],
    }


def run_scale_sim(cfg: SimConfig) -> dict[str, Any]:
    """One simulated run; its figures and invariants (see the module doc)."""
    from zmqps.bench.common import child_env
    from zmqps.transport import free_ports

    n = cfg.aggregate if cfg.aggregate is not None else cfg.workers
    ports = free_ports(1 + cfg.ps)
    chief = f"{HOST}:{ports[0]}"
    ps_addrs = [f"{HOST}:{p}" for p in ports[1:]]
    tmp = Path(tempfile.mkdtemp(prefix="zmqps-scale-sim-"))
    # the workers' addresses only count them (M): simulated workers listen on nothing
    spec = {
        "cluster": {
            "chief": [chief],
            "ps": ps_addrs,
            "worker": [f"{HOST}:{i + 1}" for i in range(cfg.workers)],
        }
    }
    (tmp / "cluster.json").write_text(json.dumps(spec))
    env = child_env()
    # a checkpoint halfway (sync: at that step's boundary): its commit time with P PS
    server = [
        sys.executable, "-m", "zmqps", "server", "--cluster", str(tmp / "cluster.json"),
        "--checkpoint-dir", str(tmp / "checkpoints"),
    ]  # fmt: skip
    files = contextlib.ExitStack()
    logs = {
        name: files.enter_context(open(tmp / f"{name}.log", "wb"))  # noqa: SIM115 - the stack closes it
        for name in ("chief", *map(str, range(cfg.ps)))
    }
    chief_flags = [
        "--role", "chief", "--mode", cfg.mode, "--heartbeat-timeout", str(cfg.heartbeat_timeout),
        "--keep-alive", "--summary", str(tmp / "summary.json"),
        "--checkpoint-steps", str(max(1, cfg.steps // 2)), *cfg.extra_chief_flags,
    ]  # fmt: skip
    if cfg.mode == "sync":
        chief_flags += ["--replicas-to-aggregate", str(n), "--total-replicas", str(cfg.workers)]
    servers = [subprocess.Popen([*server, *chief_flags], env=env, stderr=logs["chief"])]
    servers += [
        subprocess.Popen([*server, "--role", "ps", "--index", str(k)], env=env, stderr=logs[str(k)])
        for k in range(cfg.ps)
    ]
    silent = cfg.workers - 1 if cfg.detect else -1
    procs = min(cfg.procs, cfg.workers)
    sims = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "zmqps.bench.scale_sim",
                "--child",
                "--chief",
                chief,
                "--ps-addrs",
                json.dumps(ps_addrs),
                "--workers",
                str(cfg.workers),
                "--first",
                str(p),
                "--stride",
                str(procs),
                "--steps",
                str(cfg.steps),
                "--mode",
                cfg.mode,
                "--silent",
                str(silent),
            ],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=files.enter_context(open(tmp / f"sim{p}.log", "wb")),  # noqa: SIM115
            text=True,
        )
        for p in range(procs)
    ]
    pinger = _Pinger(chief)
    deadline = time.monotonic() + cfg.timeout
    out: dict[str, Any] = {"workers": cfg.workers, "ps": cfg.ps, "N": n, "steps": cfg.steps}
    try:
        # every simulated worker registered
        out["heartbeat_interval"] = min(
            _read_line(sim, deadline, "ready", servers, tmp)["heartbeat_interval"] for sim in sims
        )
        # heartbeats alone
        hb0, t0 = _cpu(servers), time.time()
        time.sleep(cfg.idle_s)
        hb1, t1 = _cpu(servers), time.time()
        chief_idle = hb1[0][0] - hb0[0][0]
        out["chief_rss_mib_registered"] = hb1[0][1] / 2**20
        out["ping_ms_idle"] = _ms(pinger.between(t0, t1))
        # the steps
        for sim in sims:
            assert sim.stdin is not None
            sim.stdin.write("go\n")
            sim.stdin.flush()
        s0, t2 = _cpu(servers), time.time()
        records = [_read_line(sim, deadline, "workers", servers, tmp) for sim in sims]
        s1, t3 = _cpu(servers), time.time()
        steps_s = t3 - t2
        # the chief's CPU per heartbeat (its idle background included), from the
        # heartbeats the simulators had answered in each phase: under load they come
        # late, so a rate assumed from the interval would overstate them
        beats_idle = sum(r["beats_idle"] for r in records)
        per_beat = chief_idle / max(1, beats_idle)
        out["chief_cpu_us_per_heartbeat"] = 1e6 * per_beat
        out["heartbeats_per_s_idle"] = beats_idle / (t1 - t0)
        out["heartbeats_per_s_steps"] = sum(r["beats_steps"] for r in records) / steps_s
        chief_steps = (s1[0][0] - s0[0][0]) - per_beat * sum(r["beats_steps"] for r in records)
        out["seconds"] = steps_s
        out["steps_per_s"] = cfg.steps / steps_s
        out["step_ms"] = 1000 * steps_s / cfg.steps
        out["chief_cpu_us_per_worker_step"] = 1e6 * chief_steps / (cfg.workers * cfg.steps)
        out["chief_cpu_share"] = (s1[0][0] - s0[0][0]) / steps_s
        out["chief_rss_mib"] = s1[0][1] / 2**20
        out["chief_rss_kib_per_worker"] = s1[0][1] / 1024 / cfg.workers
        pushes = sum(r["pushes"] for r in records)
        ps_cpu = sum(b[0] - a[0] for a, b in zip(s0[1:], s1[1:], strict=True))
        out["ps_cpu_us_per_push"] = 1e6 * ps_cpu / max(1, pushes)
        out["ping_ms_steps"] = _ms(pinger.between(t2, t3))
        out["worker_step_ms_median"] = statistics.median(
            r["step_ms_median"] for r in records if r["step_ms_median"] is not None
        )
        out["chief_added_ms"] = _ms(_chief_added(records))
        out["outcomes"] = _sum_counts(r["outcomes"] for r in records)
        tokens = sum(r["tokens"] for r in records)
        out["tokens_from_ps"] = sum(r["tokens_from_ps"] for r in records) / max(1, tokens)
        out["errors"] = [e for r in records for e in r["errors"]][:20]
        # one worker silent: how long until the chief calls it dead
        if cfg.detect:
            went = min(float(t) for r in records for t in r["silent_at"].values())
            out["detect_s"] = _await_dead(chief, silent, deadline, servers, tmp) - went
        status, size, took, _ = asyncio.run(_ask(chief, "status", {}))
        out["status_bytes"], out["status_ms"] = size, 1000 * took
        dead_now = {int(w) for w in status.get("workers_dead", [])}
        out["global_step"] = status.get("global_step")
        out["exact"] = _exact(chief, ps_addrs, n, cfg) if cfg.mode == "sync" else None
        asyncio.run(_ask(chief, "shutdown", {}))
        out["exit_codes"] = [s.wait(timeout=max(1.0, deadline - time.monotonic())) for s in servers]
        logs["chief"].flush()
        out["checkpoint_commit_s"] = _commit_seconds(tmp / "chief.log")
        # dead at the end, or called dead during the run and back since (its share of
        # the steps meanwhile went to the others: a step of fewer than N gradients)
        called = dead_now | _called_dead(tmp / "chief.log")
        out["false_deaths"] = sorted(called - {silent})
        out["sim_exit_codes"] = [s.wait(timeout=30) for s in sims]
        return out
    finally:
        pinger.stop()
        everyone: list[subprocess.Popen[Any]] = [*sims, *servers]
        for p in everyone:
            if p.poll() is None:
                p.kill()
                p.wait()
        files.close()
        out["logs"] = str(tmp)


class SimFailed(RuntimeError):
    """A simulated run could not finish: a server or a simulator process ended early,
    or the run took longer than its timeout."""


def _check_servers(servers: Sequence[subprocess.Popen[Any]], logs: Path) -> None:
    """SimFailed when a server (the chief first, then the PS) has ended."""
    for k, server in enumerate(servers):
        if server.poll() is not None:
            name = "the chief" if k == 0 else f"ps {k - 1}"
            raise SimFailed(
                f"scale-sim: {name} exited {server.returncode} during the run (logs: {logs})"
            )


def _read_line(
    sim: subprocess.Popen[str],
    deadline: float,
    key: str,
    servers: Sequence[subprocess.Popen[Any]],
    logs: Path,
) -> dict[str, Any]:
    """The next JSON line of a simulator process that holds ``key``; SimFailed when a
    server ends meanwhile or the deadline passes."""
    import select

    assert sim.stdout is not None
    while True:
        _check_servers(servers, logs)
        left = deadline - time.monotonic()
        if left <= 0:
            raise SimFailed(f"scale-sim: no {key!r} from a simulator process in time")
        ready, _, _ = select.select([sim.stdout], [], [], min(left, 1.0))
        if not ready:
            if sim.poll() is not None:
                raise SimFailed(f"scale-sim: a simulator process exited {sim.returncode}")
            continue
        line = sim.stdout.readline()
        if not line:
            raise SimFailed(f"scale-sim: a simulator process exited {sim.wait()}")
        rec: dict[str, Any] = json.loads(line)
        if key in rec:
            return rec


def _commit_seconds(log: Path) -> list[float]:
    """The chief's "checkpoint ... committed in S s" lines: each commit's seconds."""
    import re

    text = log.read_text(errors="replace")
    return [float(x) for x in re.findall(r"checkpoint \S+ committed in ([0-9.]+)s", text)]


def _called_dead(log: Path) -> set[int]:
    """The workers the chief's log says it considered dead (at any time)."""
    import re

    text = log.read_text(errors="replace")
    said = re.findall(r"worker (\d+) missed heartbeats for \S+: considered dead", text)
    return {int(i) for i in said}


def _chief_added(records: Sequence[dict[str, Any]]) -> list[float]:
    """Sync: per step, seconds from the last acknowledged push of step s (the PS have
    applied it: the push that completes a step is answered after the step) to the
    first token of step s + 1 any worker got: what the chief adds to a step (the PS's
    answer to its ``wait_step``, its step advance, the token's wake-up and reply)."""
    acked: dict[int, float] = {}
    first: dict[int, float] = {}
    for r in records:
        for k, t in r["acked"].items():
            acked[int(k)] = max(acked.get(int(k), 0.0), float(t))
        for k, t in r["first_token"].items():
            first[int(k)] = min(first.get(int(k), float("inf")), float(t))
    return [first[s + 1] - t for s, t in acked.items() if s + 1 in first]


def _cpu(servers: Sequence[subprocess.Popen[Any]]) -> list[tuple[float, int]]:
    return [_proc_times(s.pid) for s in servers]


def _ms(seconds: Sequence[float]) -> dict[str, float] | None:
    st = _stats(seconds)
    return None if st is None else {k: 1000 * v for k, v in st.items()}


def _sum_counts(counts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + int(v)
    return total


def _await_dead(
    chief: str,
    index: int,
    deadline: float,
    servers: Sequence[subprocess.Popen[Any]],
    logs: Path,
) -> float:
    """The wall time at which the chief's status first lists worker ``index`` dead."""
    while time.monotonic() < deadline:
        _check_servers(servers, logs)
        status, _, _, _ = asyncio.run(_ask(chief, "status", {}, timeout=5.0))
        if index in [int(w) for w in status.get("workers_dead", [])]:
            return time.time()
        time.sleep(0.05)
    raise SimFailed(f"scale-sim: worker {index} never declared dead")


#: How far a simulated shard's value may be from ``-steps`` (see :func:`_exact`): far
#: above float32 rounding, far below the 1 of a step missed or applied twice.
ROUNDING = 0.25


def _exact(chief: str, ps_addrs: Sequence[str], n: int, cfg: SimConfig) -> dict[str, Any]:
    """Each PS: its ``aggregated`` counter must be ``{N: steps}`` (every step the mean
    of exactly N gradients) and its values ``-steps`` (every step applied once).

    The values are compared within float32 rounding: a step applies the sum times
    ``1 / N``, which is 1 ulp off 1 for some N (950 ones: 0.99999994), so 100 steps
    end about 1e-5 off ``-100``; a step missed or applied twice is 1 off."""
    from zmqps.core.variables import Placement

    body, _, _, _ = asyncio.run(_ask(chief, "get_placement", {}))
    placement = Placement.from_wire(body["placement"])
    bad: list[str] = []
    for k, address in enumerate(ps_addrs):
        status, _, _, _ = asyncio.run(_ask(address, "status", {}))
        sync = status.get("sync") or {}
        aggregated = {int(a): int(b) for a, b in (sync.get("aggregated") or {}).items()}
        if aggregated != {n: cfg.steps}:
            bad.append(f"ps {k}: steps applied by gradients averaged {aggregated}")
        sids = [s.id for s in placement.shards if s.ps == k]
        _, _, _, tensors = asyncio.run(_ask(address, "pull", {"shards": sids}))
        for t in tensors:
            wrong = values_off(t.array, cfg.steps)
            if wrong is not None:
                bad.append(f"ps {k}: shard {t.ref} {wrong}")
    return {"ok": not bad, "problems": bad}


def values_off(values: np.ndarray[Any, Any], steps: int) -> str | None:
    """What is wrong with a simulated shard's values after ``steps`` steps of the mean
    of ones (they must be ``-steps`` within :data:`ROUNDING`), or None."""
    off = np.abs(values.astype(np.float64) + steps)
    if not off.size or float(off.max()) <= ROUNDING:  # NaN is never <=: reported
        return None
    first = ", ".join(f"{v:.7f}" for v in values.ravel()[:4])
    return f"holds [{first}, ...], not {-steps}"


def format_scale_sim(runs: Sequence[dict[str, Any]]) -> str:
    cols = [
        ("workers", "{:d}"), ("ps", "{:d}"), ("N", "{:d}"), ("steps_per_s", "{:.1f}"),
        ("chief_cpu_us_per_worker_step", "{:.1f}"), ("chief_cpu_us_per_heartbeat", "{:.1f}"),
        ("chief_rss_kib_per_worker", "{:.1f}"), ("ps_cpu_us_per_push", "{:.1f}"),
        ("detect_s", "{:.2f}"), ("status_ms", "{:.1f}"), ("status_bytes", "{:d}"),
        ("tokens_from_ps", "{:.3f}"),
    ]  # fmt: skip
    lines = [
        " | ".join(c for c, _ in cols)
        + " | ping ms (steps, p99) | chief added ms (median) | checkpoint s | exact | false deaths"
    ]
    for r in runs:
        cells = []
        for c, f in cols:
            v = r.get(c)
            cells.append("-" if v is None else f.format(v))
        ping = (r.get("ping_ms_steps") or {}).get("p99")
        exact = r.get("exact") or {}
        added = (r.get("chief_added_ms") or {}).get("median")
        commits = r.get("checkpoint_commit_s") or []
        cells += [
            "-" if ping is None else f"{ping:.1f}",
            "-" if added is None else f"{added:.1f}",
            "-" if not commits else f"{max(commits):.2f}",
            "yes" if exact.get("ok") else ("-" if not exact else "NO"),
            str(r.get("false_deaths")),
        ]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def _child_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="zmqps.bench.scale_sim")
    p.add_argument("--child", action="store_true")
    p.add_argument("--chief", required=True)
    p.add_argument("--ps-addrs", required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--stride", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--mode", default="sync")
    p.add_argument("--silent", type=int, default=-1)
    args = p.parse_args(argv)
    record = asyncio.run(_sim(args))
    print(json.dumps(record), flush=True)
    return 0


def _positive(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
        return value

    return parse


def main(
    argv: Sequence[str] | None = None,
    prog: str = "zmqps.bench.scale_sim",
    parser: type[argparse.ArgumentParser] = argparse.ArgumentParser,
) -> int:
    """``zmqps bench scale-sim`` (or ``python -m zmqps.bench.scale_sim``): every
    combination of ``--workers`` and ``--ps``; with ``--child``, a simulator process.
    ``parser``: the class of its argument parser (``zmqps``'s own, whose errors are one
    line naming the closest valid flag)."""
    from zmqps.bench.common import int_list

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--child" in argv:
        return _child_main(argv)
    p = parser(
        prog=prog,
        allow_abbrev=False,
        description="simulated workers (the real wire protocol) against a real chief and"
        " real PS: exactness, the chief's CPU per worker and step, latency, death detection",
    )
    p.add_argument("--workers", type=int_list, default=(100,), help="e.g. 10,100,1000")
    p.add_argument("--ps", type=int_list, default=(1,), help="e.g. 1,10,100")
    p.add_argument("--steps", type=_positive(int), default=100)
    p.add_argument(
        "--backup-workers",
        type=int,
        default=0,
        help="sync: workers beyond N (N = workers - this; default 0: N = M)",
    )
    p.add_argument("--procs", type=_positive(int), default=4, help="simulator processes")
    p.add_argument("--heartbeat-timeout", type=_positive(float), default=10.0)
    p.add_argument("--idle-s", type=_positive(float), default=3.0, help="heartbeats alone (s)")
    p.add_argument("--json", default=None, help="write the runs here")
    args = p.parse_args(argv)
    if not 0 <= args.backup_workers < min(args.workers):
        p.error(f"--backup-workers must be within [0, {min(args.workers)}) (the fewest workers)")
    runs = []
    for workers in args.workers:
        for ps in args.ps:
            cfg = SimConfig(
                workers,
                ps,
                args.steps,
                workers - args.backup_workers,
                procs=args.procs,
                heartbeat_timeout=args.heartbeat_timeout,
                idle_s=args.idle_s,
            )
            try:
                runs.append(run_scale_sim(cfg))
            except SimFailed as exc:
                print(exc, file=sys.stderr)
                return 1
            print(format_scale_sim(runs[-1:]), flush=True)
    if len(runs) > 1:
        print(format_scale_sim(runs))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    ok = True
    for r in runs:
        where = f"scale-sim, {r['workers']} workers and {r['ps']} PS"
        for problem in (r.get("exact") or {}).get("problems", []):
            print(f"{where}: not exact: {problem} (logs: {r['logs']})", file=sys.stderr)
            ok = False
        if r["false_deaths"]:
            alive = r["false_deaths"]
            print(f"{where}: workers called dead that were alive: {alive}", file=sys.stderr)
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
