"""Sync (SyncReplicas) and SSP training with real processes on loopback.

A chief (``zmqps-server --model none``: it only coordinates), two PS and three
workers running ``sync_worker.py`` (softmax regression on a fixed global batch, one
slice per worker). Faults: a worker SIGSTOPs itself holding a token (backup workers),
``kill -9`` (dead worker, then a new incarnation rejoins), SIGSTOP / SIGCONT from the
test (SSP). The cluster's state is read the way users read it: the chief's status
(``zmqps status``); the PS's own status by a request to it.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq.asyncio
from helpers import Proc, Reaper, addresses, read_json, script, wait_for, zmqps_cmd
from sync_worker import OPTIMIZERS, VARIABLES, global_batch, loss_and_grads

from zmqps.checkpoint import Checkpoint
from zmqps.core.initializers import initialize
from zmqps.core.optimizers import compute_dtype, make_optimizer
from zmqps.core.variables import VariableDef
from zmqps.roles.status import fetch_status
from zmqps.transport import Client

WORKER = Path(__file__).with_name("sync_worker.py")


@dataclass
class SyncCluster:
    """A chief and its PS, started; workers are added with :meth:`worker`."""

    procs: Reaper
    tmp: Path
    chief: str
    ps: list[str]
    chief_p: Proc
    ps_p: list[Proc]
    summary: Path
    workers: dict[str, Proc] = field(default_factory=dict)

    def worker(self, index: int, *flags: str, name: str | None = None) -> Proc:
        name = name or f"worker{index}"
        argv = [sys.executable, str(WORKER), "--chief", self.chief, "--index", str(index)]
        out = ["--out", str(self.tmp / f"{name}.json")]
        self.workers[name] = self.procs.spawn([*argv, *out, *flags], name=name)
        return self.workers[name]

    def record(self, name: str) -> dict[str, Any]:
        rec = read_json(self.tmp / f"{name}.json")
        assert rec is not None, f"{name} wrote no record\n{self.workers[name].tail()}"
        return dict(rec)

    def status(self) -> dict[str, Any]:
        return asyncio.run(fetch_status(self.chief, timeout=5.0))

    def ps_status(self, i: int) -> dict[str, Any]:
        return asyncio.run(_request(self.ps[i], "status"))

    def stop(self) -> None:
        """End a --keep-alive cluster: SIGTERM to the chief, which shuts the PS down."""
        self.chief_p.send(signal.SIGTERM)
        self.chief_p.expect_exit(0, timeout=20)
        for p in self.ps_p:
            p.expect_exit(0, timeout=20)


async def _request(address: str, op: str) -> dict[str, Any]:
    ctx = zmq.asyncio.Context()
    client = Client(ctx, address, f"test:{uuid.uuid4().hex[:8]}", timeout=5.0)
    try:
        return dict((await client.request(op)).body)
    finally:
        await client.close()
        ctx.term()


def start_cluster(
    procs: Reaper,
    tmp: Path,
    *chief_flags: str,
    num_ps: int = 2,
    num_workers: int = 3,
    ps_flags: Sequence[str] = (),
) -> SyncCluster:
    chief, *rest = addresses(1 + num_ps + num_workers)
    ps, workers = rest[:num_ps], rest[num_ps:]
    hosts = ["--chief-host", chief, "--ps-hosts", ",".join(ps), "--worker-hosts", ",".join(workers)]
    server = script("zmqps-server")
    summary = tmp / "summary.json"
    chief_p = procs.spawn(
        [
            server,
            *hosts,
            "--role",
            "chief",
            "--model",
            "none",
            "--summary",
            str(summary),
            *chief_flags,
        ],
        name="chief",
    )
    ps_p = [
        procs.spawn([server, *hosts, "--role", "ps", "--index", str(i), *ps_flags], name=f"ps{i}")
        for i in range(num_ps)
    ]
    # The status queries' deadline is for a running chief, not for a process start
    # (seconds on a loaded 2-core machine, with the other tasks starting beside it).
    wait_for(
        lambda: "serving on" in chief_p.stderr or chief_p.poll() is not None,
        timeout=60,
        what="the chief to serve",
    )
    assert chief_p.poll() is None, chief_p.tail()
    return SyncCluster(procs, tmp, chief, ps, chief_p, ps_p, summary)


def process_state(proc: Proc) -> str:
    """The kernel's state letter of a child (``T``: stopped)."""
    stat = Path(f"/proc/{proc.pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def initial(v: VariableDef) -> np.ndarray:
    return initialize(v.init, v.name, v.shape, v.dtype, 0, v.shape[0])


def reference(optimizer: dict[str, Any], steps: int) -> dict[str, np.ndarray]:
    """``steps`` steps of single-process training on the whole global batch."""
    opt = make_optimizer(optimizer)
    params = {v.name: initial(v) for v in VARIABLES}
    slots = {v.name: opt.init_slots(v.shape, v.dtype) for v in VARIABLES}
    x, y = global_batch()
    for step in range(1, steps + 1):
        _, grads = loss_and_grads(params, x, y)
        for v in VARIABLES:
            p = params[v.name]
            scratch = np.empty(opt.scratch_factor * p.size, compute_dtype(p.dtype))
            opt.apply_dense(
                p.reshape(-1),
                grads[v.name].astype(p.dtype).reshape(-1),
                {k: s.reshape(-1) for k, s in slots[v.name].items()},
                step,
                scratch,
            )
    return params


def assert_single_process(finals: Sequence[Path], optimizer: str, steps: int) -> None:
    """Each saved final model equals ``steps`` single-process steps (within 1e-5)."""
    expected = reference(OPTIMIZERS[optimizer], steps)
    for final in finals:
        got = np.load(final)
        for v in VARIABLES:
            diff = float(np.max(np.abs(got[v.name] - expected[v.name])))
            assert diff <= 1e-5, (v.name, diff)
        assert not np.allclose(got["w"], initial(VARIABLES[0]))  # it trained


# ----------------------------------------------------------------- correctness oracle


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("optimizer", "loop"), [("sgd", "worker"), ("adam", "worker"), ("adam", "pipeline")]
)
def test_sync_steps_equal_single_process_steps(
    procs: Reaper, tmp_path: Path, optimizer: str, loop: str
) -> None:
    """N = M = 3 workers, each on a fixed third of the global batch, 2 PS, 2 shards per
    variable: 50 sync steps give the parameters of 50 single-process steps.

    Worker 2 leaves right after its last push, while the other two still compute that
    step: the step must still wait for them (not be applied from worker 2's gradient
    and drop theirs as stale). Workers 0 and 1 wait for the global step to reach 50
    and save the final parameters. Every token but each worker's first comes from a
    PS (the chief releases them; it hears no request per worker and step), and the
    values of most steps with the reply of the push before (no pull request). The
    same with the built-in training loop's steps (``loop="pipeline"``).
    """
    steps = 50
    cluster = start_cluster(procs, tmp_path, "--mode", "sync", "--num-shards", "2")
    finals = [tmp_path / f"final{i}.npz" for i in range(2)]
    flags = ["--steps", str(steps), "--optimizer", optimizer]
    if loop == "pipeline":
        flags.append("--pipeline")
    last_slow = ["--sleep", "0.3", "--sleep-from", str(steps - 1)]
    workers = [cluster.worker(i, *flags, *last_slow, "--final", str(finals[i])) for i in (0, 1)]
    workers.append(cluster.worker(2, *flags))
    for w in workers:
        w.expect_exit(0, timeout=50)
    cluster.chief_p.expect_exit(0, timeout=20)
    for p in cluster.ps_p:
        p.expect_exit(0, timeout=20)

    for i in range(3):
        rec = cluster.record(f"worker{i}")
        assert [p["step"] for p in rec["pushes"]] == list(range(steps))
        assert all(p["accepted"] for p in rec["pushes"]), (i, rec)
        # the chief answered each worker's first token request; a PS the others
        # (workers 0 and 1 take one more token: the final step's)
        assert rec["tokens_from_ps"] == steps - 1 + (i < 2), rec["tokens_from_ps"]
        # the values of most steps came with the push before (every one but the first
        # on a quiet machine; a step not applied within the PS's short wait is pulled)
        assert rec["fresh_pulls"] >= steps // 2, rec
    expected = reference(OPTIMIZERS[optimizer], steps)
    for i, final in enumerate(finals):
        assert cluster.record(f"worker{i}")["final_step"] == steps
        got = np.load(final)
        for v in VARIABLES:
            diff = float(np.max(np.abs(got[v.name] - expected[v.name])))
            print(f"{optimizer} worker {i} {v.name}: max abs diff {diff:.3g}")
            assert diff <= 1e-5, (v.name, diff)
        assert not np.allclose(got["w"], initial(VARIABLES[0]))  # it trained
    summary = read_json(cluster.summary)
    assert (summary["mode"], summary["global_step"]) == ("sync", steps)
    assert "shards ready" in cluster.ps_p[0].stderr and "shards ready" in cluster.ps_p[1].stderr


@pytest.mark.timeout(60)
def test_one_ps_releasing_runs_of_steps_equals_single_process_steps(
    procs: Reaper, tmp_path: Path
) -> None:
    """One PS holds every shard and releases runs of steps by itself: the chief sees
    the checkpoint boundaries (every 7 steps) and the membership changes only. The
    oracle above holds (worker 2 leaves right after its last push, while the others
    still compute that step), and each checkpoint holds exactly the values of its
    step."""
    steps = 50
    ckpt = tmp_path / "ckpt"
    cluster = start_cluster(
        procs,
        tmp_path,
        "--mode",
        "sync",
        "--num-shards",
        "2",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-steps",
        "7",
        "--keep-checkpoints",
        "20",
        num_ps=1,
        ps_flags=("--checkpoint-dir", str(ckpt)),
    )
    finals = [tmp_path / f"final{i}.npz" for i in range(2)]
    flags = ["--steps", str(steps), "--optimizer", "adam"]
    last_slow = ["--sleep", "0.3", "--sleep-from", str(steps - 1)]
    workers = [cluster.worker(i, *flags, *last_slow, "--final", str(finals[i])) for i in (0, 1)]
    workers.append(cluster.worker(2, *flags))
    for w in workers:
        w.expect_exit(0, timeout=50)
    cluster.chief_p.expect_exit(0, timeout=20)
    cluster.ps_p[0].expect_exit(0, timeout=20)

    for i in range(3):
        rec = cluster.record(f"worker{i}")
        assert [p["step"] for p in rec["pushes"]] == list(range(steps))
        assert all(p["accepted"] for p in rec["pushes"]), (i, rec)
        # the values of most steps came with the push before (every one but the first
        # on a quiet machine; a step not applied within the PS's short wait is pulled)
        assert rec["fresh_pulls"] >= steps // 2, rec
    assert_single_process(finals, "adam", steps)
    # the policy's boundaries: the first at step 7, each next one 7 steps after the
    # last (later while one is still being written); each holds exactly its step
    taken = sorted(int(p.name[5:]) for p in ckpt.glob("ckpt-*") if p.name[5:].isdigit())
    assert taken[0] == 7 and len(taken) >= 3, taken
    assert all(b - a >= 7 for a, b in itertools.pairwise(taken[:-1])), taken
    for step in taken:
        values = Checkpoint.load(ckpt / f"ckpt-{step:012d}").variables()
        at = reference(OPTIMIZERS["adam"], step)
        for v in VARIABLES:
            diff = float(np.max(np.abs(values[v.name] - at[v.name])))
            assert diff <= 1e-5, (step, v.name, diff)
    summary = read_json(cluster.summary)
    assert (summary["mode"], summary["global_step"]) == ("sync", steps)


# ----------------------------------------------------------------- zmqps launch


@pytest.mark.timeout(90)
def test_launch_sync_trains_digits(procs: Reaper, tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    launcher = procs.spawn(
        zmqps_cmd(
            "launch",
            "--mode",
            "sync",
            "--no-progress",
            "--timeout",
            "80",
            "--summary",
            str(summary_path),
        ),
        name="launch",
    )
    launcher.expect_exit(0, timeout=85)
    summary = read_json(summary_path)
    print("launch --mode sync:", summary)
    assert summary["mode"] == "sync"
    # each worker's BLAS shares the cores (or takes the OMP_NUM_THREADS the user set)
    assert isinstance(summary["worker_blas_threads"], int) and summary["worker_blas_threads"] >= 1
    assert summary["test_accuracy"] >= 0.95, summary
    # Both workers made every step (none of their gradients was dropped), and the
    # summary counts the last step too.
    assert summary["global_step"] * 2 == summary["worker_steps"], summary


# ----------------------------------------------------------------- backup workers


@pytest.mark.timeout(60)
def test_backup_worker_stopped_holding_a_token(procs: Reaper, tmp_path: Path) -> None:
    """M = 3, N = 2: worker 2 stops itself holding a token; steps go on with the other
    two, and its late gradient is dropped as stale when it resumes.

    Worker 2 starts first, and the other two have steps to spare: started last on a
    loaded machine, it once registered after they had done all their steps, and then
    no step was left to go on without it."""
    steps, stop_at = 30, 5
    cluster = start_cluster(
        procs,
        tmp_path,
        "--mode",
        "sync",
        "--total-replicas",
        "3",
        "--replicas-to-aggregate",
        "2",
        "--keep-alive",
    )
    slow = cluster.worker(2, "--steps", str(steps), "--stop-at", str(stop_at))
    wait_for(
        lambda: any(w["index"] == 2 for w in cluster.status()["workers"]),
        timeout=30,
        what="worker 2 to register",
    )
    workers = [cluster.worker(i, "--steps", str(10 * steps)) for i in (0, 1)]

    wait_for(lambda: process_state(slow) == "T", timeout=30, what="worker 2 to stop itself")
    at_stop = cluster.status()["global_step"]
    # Training goes on without it (well inside the heartbeat timeout of 10 s).
    wait_for(
        lambda: cluster.status()["global_step"] >= at_stop + 3,
        timeout=8,
        what="the global step to advance while worker 2 is stopped",
    )
    assert slow.poll() is None
    slow.send(signal.SIGCONT)

    for w in (*workers, slow):
        w.expect_exit(0, timeout=40)
    rec = cluster.record("worker2")
    late = rec["pushes"][stop_at]
    assert late["step"] <= at_stop and not late["accepted"], rec["pushes"]
    assert rec["dropped"].get("stale", 0) >= 1, rec
    summary = wait_for(lambda: read_json(cluster.summary), timeout=20, what="the summary")
    assert summary["mode"] == "sync"
    dropped = [cluster.ps_status(i)["sync"]["dropped"].get("stale", 0) for i in (0, 1)]
    assert min(dropped) >= 1, dropped
    cluster.stop()


# ----------------------------------------------------------------- dead worker


@pytest.mark.timeout(60)
def test_dead_worker_is_dropped_and_rejoins(procs: Reaper, tmp_path: Path) -> None:
    """N = M = 3: kill -9 one worker; the step it stalls names it in the chief's status
    (what ``zmqps status`` shows), the global step moves on within heartbeat timeout
    + 2 s, then a new incarnation of it rejoins and the job ends normally."""
    timeout_s, steps = 3.0, 200
    cluster = start_cluster(
        procs, tmp_path, "--mode", "sync", "--heartbeat-timeout", str(timeout_s)
    )
    workers = [cluster.worker(i, "--steps", str(steps)) for i in range(3)]
    wait_for(lambda: cluster.status()["global_step"] >= 5, timeout=30, what="training to start")
    victim = workers[1]
    victim.send(signal.SIGKILL)
    killed_at = time.monotonic()
    victim.expect_exit(-signal.SIGKILL, timeout=10)

    # Right after the kill the step stalls on worker 1 (it still counts as alive). Read
    # with the request `zmqps status --json` makes and prints (`fetch_status`), from
    # this process: the window is the heartbeat timeout, and a `zmqps status` process
    # can take longer than that just to start on a loaded machine.
    def stalled_on_victim() -> dict[str, Any] | None:
        s = cluster.status()
        return s if 1 in s["waiting_on"] and 1 in s["workers_alive"] else None

    stalled = wait_for(stalled_on_victim, timeout=timeout_s, what="status naming worker 1")
    assert stalled["total_replicas"] == 3 and stalled["replicas_to_aggregate"] == 3

    wait_for(
        lambda: cluster.status()["global_step"] > stalled["global_step"],
        timeout=timeout_s + 2 + 5,
        what="the global step to move on",
        interval=0.02,
    )
    detected_s = time.monotonic() - killed_at
    print(f"global step moved on {detected_s:.2f}s after kill -9")
    assert detected_s <= timeout_s + 2
    # counted dead within the same bound (a push the worker sent just before the kill
    # may still complete its step, the next one then waiting for the timeout)
    s = wait_for(
        lambda: (
            (st := cluster.status())["replicas_to_aggregate"] == 2
            and 1 in st["workers_dead"]
            and st
        ),
        timeout=max(0.1, timeout_s + 2 - (time.monotonic() - killed_at)) + 1,
        what="worker 1 counted dead",
        interval=0.02,
    )
    assert s["global_step"] > stalled["global_step"], s

    rejoined = cluster.worker(1, "--steps", "10", name="worker1-again")
    for w in (workers[0], workers[2], rejoined):
        w.expect_exit(0, timeout=40)
    cluster.chief_p.expect_exit(0, timeout=20)
    for p in cluster.ps_p:
        p.expect_exit(0, timeout=20)
    assert "worker 1 missed heartbeats" in cluster.chief_p.stderr
    assert "rejoined" in cluster.chief_p.stderr
    summary = read_json(cluster.summary)
    assert summary["mode"] == "sync" and summary["global_step"] > stalled["global_step"]


# ----------------------------------------------------------------- SSP


def _spread(s: dict[str, Any]) -> tuple[int, dict[int, int]]:
    steps = {w["index"]: w["step"] for w in s["workers"] if w["state"] == "alive"}
    return (max(steps.values()) - min(steps.values()) if steps else 0), steps


@pytest.mark.timeout(60)
def test_ssp_bounds_the_spread(procs: Reaper, tmp_path: Path) -> None:
    """S = 2, worker 2 slower than the others and stopped twice: they never start a step
    more than 2 ahead of it (``ssp.max_spread``); a finished step shows as at most S + 1
    completed steps ahead while its worker waits to start the next one."""
    s_max, steps = 2, 100
    cluster = start_cluster(
        procs, tmp_path, "--mode", "ssp", "--max-staleness", str(s_max), "--keep-alive"
    )
    fast = [cluster.worker(i, "--steps", str(steps)) for i in (0, 1)]
    slow = cluster.worker(2, "--steps", str(steps), "--sleep", "0.01")
    snapshots: list[dict[str, Any]] = []

    def snap() -> dict[str, Any]:
        s = cluster.status()
        snapshots.append(s)
        return s

    def clocks(s: dict[str, Any]) -> dict[int, int]:
        return {int(k): v for k, v in s["ssp"]["clocks"].items()}

    def at_bound() -> bool:
        """Each fast worker waits to start step slow + S + 1 (or has finished)."""
        s = snap()
        c, done = clocks(s), {w["index"] for w in s["workers"] if w["state"] == "done"}
        return all(i in done or c.get(i, 0) == c.get(2, 0) + s_max + 1 for i in (0, 1))

    for _cycle in range(2):
        wait_for(
            lambda: 2 in clocks(snap()) and 2 in snapshots[-1]["workers_alive"],
            timeout=30,
            what="worker 2 training",
        )
        slow.send(signal.SIGSTOP)
        # Stopped well inside the heartbeat timeout: worker 2 still counts as alive.
        try:
            wait_for(at_bound, timeout=6, what="the fast workers to reach the bound")
        except AssertionError as exc:
            last = snapshots[-1]
            raise AssertionError(f"{exc}: ssp {last['ssp']}, workers {last['workers']}") from None
        for _ in range(5):
            assert at_bound()  # and they stay there
        slow.send(signal.SIGCONT)

    for w in (*fast, slow):
        w.expect_exit(0, timeout=40)
    final = cluster.status()
    cluster.stop()
    spreads = [_spread(s) for s in snapshots]
    largest = max(spread for spread, _ in spreads)
    print(f"ssp: max_spread {final['ssp']['max_spread']}, largest status spread {largest}")
    assert final["ssp"]["max_spread"] == s_max
    assert all(spread <= s_max + 1 for spread, _ in spreads), spreads
