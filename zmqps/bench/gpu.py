"""``python -m zmqps.bench.gpu``: GPU workers against CPU workers in one run, and the
same model on one device without a PS.

A chief and ``--ps`` PS (2) on 127.0.0.1, async; one worker process per entry of
``--workers`` (``cuda,cuda,cpu,cpu``: two on GPU 0, two on the host), each training
the zmqps MLP (``784 -> hidden... -> 10``, SGD on the PS, synthetic data) through
:class:`~zmqps.roles.overlap.StepPipeline`, as ``bench overlap`` does. Per worker:
examples/s, and its time split per step (:meth:`OverlapStats.as_dict`: how long each
transfer took against how long the step waited for it, compute, the share hidden).

Baselines, each run alone before the cluster (nothing else on the device), for every
device of ``--workers`` (``--native`` / ``--local`` choose):

* ``native``: the same MLP in a plain PyTorch loop (:mod:`zmqps.bench.native`):
  what the device does with the model when nothing is communicated;
* ``local``: the zmqps model's own math (``MLP.loss_and_grads`` on numpy / cupy)
  with SGD applied in place on the device, no PS: the compute a worker step does.

So ``worker / native`` is what training through zmqps delivers of the device's
PyTorch speed, ``local / native`` how the zmqps model's compute compares, and
``worker / local`` what the parameter server costs.

Rules of this module:

* Timing: every worker runs ``--warmup`` untimed steps, then waits at a barrier
  (a file per worker in a run folder) until every worker is ready, so the timed
  steps of all workers start together. Each then runs ``--steps`` steps or until
  ``--seconds`` have passed since that start, whichever comes first. A worker's
  ``examples_per_second`` is over its own timed steps; ``concurrent`` counts only
  the steps finished while every worker was still running (all workers under the
  same load). With ``--steps`` large enough that the window ends first, the two
  agree.
* CPU workers (and CPU baselines) get ``--cpu-threads`` BLAS / OpenMP threads each
  (default: the cores left once each PS and each GPU worker has one, shared among
  the CPU workers), so they do not oversubscribe the cores of the others.
* ``--schedule`` picks the pipeline's options: ``default`` (per-layer pushes of
  at least 1 MiB on a GPU, one push after backprop on the host), or ``serial`` /
  ``layers`` / ``prefetch`` as in ``bench overlap``.
* Every process of the cluster runs in the caller's process group with its log in
  a temporary run folder; the first to exit badly ends the run (the others are
  killed, its last log lines are in the error), and so does SIGTERM.
* Output: a table on stdout; ``--json FILE`` every figure. Exit code 1 when the
  cluster run failed (the baselines' failures are reported, not fatal), 2 for bad
  arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zmqps.bench.native import add_model_args, mlp_flops_per_example, mlp_parameters
from zmqps.bench.overlap import phase_split
from zmqps.process import THREAD_VARS, blas_threads, usable_cores

__all__ = ["SCHEDULES", "cpu_threads", "format_gpu", "main", "run_gpu"]

#: StepPipeline options per schedule (serial / layers / prefetch as in ``bench overlap``)
SCHEDULES: dict[str, dict[str, Any]] = {
    "default": {},
    "serial": {"push_bytes": 1 << 62},
    "layers": {"push_bytes": 0},
    "prefetch": {"prefetch": True},
}
INPUT_DIM = 784
NUM_CLASSES = 10
#: distinct synthetic batches per worker, used in turn
BATCHES = 4
LR = 0.01
BARRIER_POLL_S = 0.002


def cpu_threads(devices: Sequence[str], ps: int, nproc: int | None = None) -> int:
    """BLAS threads per CPU worker: the cores left once each PS and each GPU worker
    has one, shared among the CPU workers (at least 1)."""
    on_cpu = sum(1 for d in devices if d.startswith("cpu"))
    cores = usable_cores() if nproc is None else nproc
    return blas_threads(cores, on_cpu, ps + len(devices) - on_cpu)


def _thread_env(device: str, threads: int) -> dict[str, str]:
    return dict.fromkeys(THREAD_VARS, str(threads)) if device.startswith("cpu") else {}


# ---------------------------------------------------------------------- children


def _data(dev: Any, batch: int, seed: int) -> tuple[list[Any], list[Any]]:
    rng = np.random.default_rng(seed)
    xs = [dev.asarray(rng.random((batch, INPUT_DIM), dtype=np.float32)) for _ in range(BATCHES)]
    ys = [dev.asarray(rng.integers(0, NUM_CLASSES, batch)) for _ in range(BATCHES)]
    return xs, ys


def _device_info(dev: Any) -> dict[str, Any]:
    """The GPU's name and cupy's version (on a CUDA device), the BLAS threads (host)."""
    if dev.is_cuda:
        cp = dev.xp
        name = cp.cuda.runtime.getDeviceProperties(dev.index)["name"]
        return {
            "gpu": name.decode() if isinstance(name, bytes) else str(name),
            "cupy": cp.__version__,
        }
    return {"threads": os.environ.get("OPENBLAS_NUM_THREADS")}


def _barrier(folder: Path, index: int, workers: int, timeout: float) -> float:
    """Wait until every worker has reached this point; returns the instant all had
    (CLOCK_MONOTONIC, system-wide on Linux)."""
    (folder / f"ready-{index}").touch()
    deadline = time.monotonic() + timeout
    while sum(1 for p in folder.iterdir() if p.name.startswith("ready-")) < workers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {index}: the others were not ready within {timeout:g}s")
        time.sleep(BARRIER_POLL_S)
    return time.monotonic()


def _worker(cfg: dict[str, Any]) -> None:
    """One worker process: warm up, meet the others, run the timed steps; its record
    goes to the file ``cfg["out"]``."""
    from zmqps.models import MLP
    from zmqps.roles.overlap import StepPipeline
    from zmqps.roles.worker import Worker

    index, batch, warmup = int(cfg["index"]), int(cfg["batch"]), int(cfg["warmup"])
    model = MLP(INPUT_DIM, NUM_CLASSES, hidden=cfg["hidden"], seed=1)
    with Worker(cfg["chief"], index, device=cfg["device"], timeout=cfg["timeout"]) as w:
        dev = w.device
        xs, ys = _data(dev, batch, seed=index)
        w.create_variables(model.variables(), optimizer={"name": "sgd", "lr": LR})
        pipe = StepPipeline(w, **SCHEDULES[cfg["schedule"]])

        def step(i: int) -> float:
            params = pipe.begin()
            loss, grads = model.loss_and_grads(
                params, xs[i % BATCHES], ys[i % BATCHES], on_ready=pipe.grads_ready
            )
            pipe.end(grads, loss=loss, examples=batch)
            return loss

        for i in range(warmup):
            step(i)
        t0 = _barrier(Path(cfg["barrier"]), index, int(cfg["workers"]), float(cfg["timeout"]))
        pipe.stats = type(pipe.stats)()  # time the measured steps only
        deadline = t0 + float(cfg["seconds"]) if cfg["seconds"] else float("inf")
        ends: list[float] = []
        loss = float("nan")
        while len(ends) < int(cfg["steps"]) and time.monotonic() < deadline:
            loss = step(warmup + len(ends))
            ends.append(time.monotonic() - t0)
        pipe.close()
        info = _device_info(dev)
    seconds = ends[-1] if ends else 0.0
    rec = {
        "index": index,
        "device": str(dev),
        **info,
        "t0": t0,
        "steps": len(ends),
        "seconds": seconds,
        "examples": len(ends) * batch,
        "examples_per_second": len(ends) * batch / seconds if seconds > 0 else 0.0,
        "loss": loss,
        "ends": [round(e, 6) for e in ends],
        **pipe.stats.as_dict(),
    }
    Path(cfg["out"]).write_text(json.dumps(rec))


def _local(cfg: dict[str, Any]) -> None:
    """The zmqps model's math on one device, SGD in place there, no PS; prints a record."""
    from zmqps.core.initializers import initialize
    from zmqps.device import Device
    from zmqps.models import MLP

    batch, warmup, steps = int(cfg["batch"]), int(cfg["warmup"]), int(cfg["steps"])
    dev = Device.parse(cfg["device"]).check()
    dev.use()
    model = MLP(INPUT_DIM, NUM_CLASSES, hidden=cfg["hidden"], seed=1)
    params = {
        v.name: dev.asarray(initialize(v.init, v.name, v.shape, v.dtype, 0, v.shape[0]))
        for v in model.variables()
    }
    xs, ys = _data(dev, batch, seed=0)

    def step(i: int) -> float:
        loss, grads = model.loss_and_grads(params, xs[i % BATCHES], ys[i % BATCHES])
        for name, g in grads.items():
            g *= -LR
            params[name] += g
        return loss

    for i in range(warmup):
        step(i)
    dev.synchronize()
    done, loss = 0, float("nan")
    t0 = time.perf_counter()
    deadline = t0 + float(cfg["seconds"]) if cfg["seconds"] else float("inf")
    while done < steps and time.perf_counter() < deadline:
        loss = step(warmup + done)
        done += 1
    dev.synchronize()
    seconds = time.perf_counter() - t0
    flops = mlp_flops_per_example(cfg["hidden"]) * batch * done
    rec = {
        "bench": "local",
        "device": str(dev),
        **_device_info(dev),
        "steps": done,
        "seconds": seconds,
        "examples_per_second": batch * done / seconds,
        "step_ms": 1000 * seconds / max(1, done),
        "tflops": flops / seconds / 1e12,
        "loss": loss,
    }
    print(json.dumps(rec), flush=True)


# ---------------------------------------------------------------------- parent


def _json_child(argv: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run a child that prints one JSON record last; the record, or ``{"error": ...}``."""
    from zmqps.bench.common import child_env

    try:
        done = subprocess.run(
            argv,
            env=child_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:g}s"}
    lines = done.stdout.strip().splitlines()
    try:
        rec: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        rec = {}
    if done.returncode != 0:
        stderr = done.stderr.strip()
        last = stderr.splitlines()[-1] if stderr else "no output"
        rec.setdefault("error", f"exit {done.returncode}: {last}")
        rec["stderr"] = stderr[-2000:]
    return rec


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(f"    [{path.stem}] {t}" for t in text.splitlines()[-lines:])


def _cluster(
    ps: int,
    workers: Sequence[str],
    worker_cfg: dict[str, Any],
    threads: int,
    folder: Path,
    timeout: float,
) -> tuple[list[dict[str, Any]], list[str]]:
    """A chief and ``ps`` PS (``zmqps server``) and one worker process per device on
    127.0.0.1, every log in ``folder``; the workers' records (in index order) and
    warnings. Fails as soon as any process exits badly; every process is killed at
    the end, whatever happens."""
    from zmqps.bench.common import HOST, BenchError, child_env
    from zmqps.transport import free_ports

    addrs = [f"{HOST}:{p}" for p in free_ports(1 + ps + len(workers))]
    cluster = {"chief": addrs[:1], "ps": addrs[1 : 1 + ps], "worker": addrs[1 + ps :]}
    server = [
        sys.executable,
        "-m",
        "zmqps",
        "server",
        "--cluster",
        json.dumps({"cluster": cluster}),
    ]
    jobs: list[tuple[str, list[str], dict[str, str]]] = [
        ("chief", [*server, "--role", "chief"], {})
    ]
    jobs += [(f"ps-{i}", [*server, "--role", "ps", "--index", str(i)], {}) for i in range(ps)]
    for i, device in enumerate(workers):
        cfg = {**worker_cfg, "chief": addrs[0], "index": i, "device": device}
        cfg["out"] = str(folder / f"worker-{i}.json")
        me = [sys.executable, "-m", "zmqps.bench.gpu", "--worker", json.dumps(cfg)]
        jobs.append((f"worker-{i}", me, _thread_env(device, threads)))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, argv, env in jobs:
            with (folder / f"{name}.log").open("wb") as log:
                procs[name] = subprocess.Popen(
                    argv, env=child_env(env), stdout=log, stderr=subprocess.STDOUT
                )
        names = [f"worker-{i}" for i in range(len(workers))]
        deadline = time.monotonic() + timeout
        # every process watched at once: the first to fail ends the run (the other
        # workers may be waiting for it at the barrier)
        while True:
            codes = {name: p.poll() for name, p in procs.items()}
            for name, code in codes.items():
                if code not in (None, 0):
                    raise BenchError(f"{name} exited with {code}\n{_tail(folder / f'{name}.log')}")
            if all(codes[n] == 0 for n in names):
                break
            if time.monotonic() > deadline:
                raise BenchError(f"the workers did not finish within {timeout:g}s")
            time.sleep(0.05)
        warnings = []
        for name, p in procs.items():  # the servers end once every worker has left
            try:
                code = p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                warnings.append(f"{name} did not exit within 30 s after the workers; killed")
                continue
            if code != 0:
                warnings.append(f"{name} exited with {code}\n{_tail(folder / f'{name}.log')}")
        return [json.loads((folder / f"{n}.json").read_text()) for n in names], warnings
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def _baselines(
    kind: str,
    devices: Sequence[str],
    *,
    hidden: tuple[int, ...],
    batch: int,
    steps: int,
    seconds: float,
    warmup: int,
    threads: int,
    timeout: float,
) -> dict[str, dict[str, Any]]:
    out = {}
    for device in devices:
        env = _thread_env(device, threads)
        if kind == "native":
            argv = [sys.executable, "-m", "zmqps.bench.native", "--device", device]
            argv += ["--hidden", ",".join(map(str, hidden)), "--batch", str(batch)]
            argv += ["--steps", str(steps), "--warmup", str(warmup), "--seconds", str(seconds)]
            argv += ["--lr", str(LR)]
            if device.startswith("cpu"):
                argv += ["--threads", str(threads)]
        else:
            cfg = {
                "device": device,
                "hidden": hidden,
                "batch": batch,
                "steps": steps,
                "seconds": seconds,
                "warmup": warmup,
            }
            argv = [sys.executable, "-m", "zmqps.bench.gpu", "--local-run", json.dumps(cfg)]
        out[device] = _json_child(argv, env, timeout)
    return out


def _concurrent(recs: list[dict[str, Any]], batch: int) -> tuple[float, list[float | None]]:
    """The window every worker ran in (seconds) and each one's examples/s within it."""
    start = max(r["t0"] for r in recs)
    end = min(r["t0"] + r["seconds"] for r in recs)
    if end <= start:
        return 0.0, [None for _ in recs]
    rates: list[float | None] = []
    for r in recs:
        n = sum(1 for e in r["ends"] if start < r["t0"] + e <= end)
        rates.append(n * batch / (end - start))
    return end - start, rates


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def _kind(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


def _ratios(run: dict[str, Any]) -> dict[str, float]:
    """``a/b`` of the mean examples/s per device kind of workers, native and local runs."""
    figures: dict[str, float] = {}
    for kind in ("cuda", "cpu"):
        w = run["per_kind"].get(kind)
        if w is not None:
            figures[f"{kind}_worker"] = w["examples_per_second"]
        for base in ("native", "local"):
            recs = [
                r["examples_per_second"]
                for d, r in run[base].items()
                if _kind(d) == kind and "error" not in r
            ]
            if recs:
                figures[f"{base}_{kind}"] = statistics.fmean(recs)
    pairs = [
        ("cuda_worker", "native_cuda"),
        ("cuda_worker", "local_cuda"),
        ("local_cuda", "native_cuda"),
        ("cuda_worker", "cpu_worker"),
        ("cpu_worker", "native_cpu"),
        ("cpu_worker", "local_cpu"),
        ("local_cpu", "native_cpu"),
        ("native_cuda", "native_cpu"),
    ]
    return {
        f"{a}/{b}": figures[a] / figures[b]
        for a, b in pairs
        if a in figures and b in figures and figures[b] > 0
    }


def run_gpu(
    workers: Sequence[str] = ("cuda", "cuda", "cpu", "cpu"),
    hidden: tuple[int, ...] = (4096, 4096),
    batch: int = 512,
    steps: int = 100,
    seconds: float = 30.0,
    warmup: int = 5,
    schedule: str = "default",
    ps: int = 2,
    threads: int | None = None,
    native: Sequence[str] | None = None,
    local: Sequence[str] | None = None,
    baseline_steps: int = 200,
    baseline_seconds: float = 10.0,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Baselines first (``native`` / ``local``: devices, default those of ``workers``),
    then the cluster run; every figure as a dict (``error`` set if the cluster failed)."""
    from zmqps.bench.common import BenchError, machine_info

    devices = list(dict.fromkeys(workers))
    threads = threads or cpu_threads(workers, ps)
    run: dict[str, Any] = {
        "suite": "gpu",
        "machine": machine_info(),
        "workers": list(workers),
        "hidden": list(hidden),
        "batch": batch,
        "parameters": mlp_parameters(hidden),
        "flops_per_example": mlp_flops_per_example(hidden),
        "ps": ps,
        "mode": "async",
        "optimizer": {"name": "sgd", "lr": LR},
        "schedule": schedule,
        "steps": steps,
        "seconds_limit": seconds,
        "warmup": warmup,
        "cpu_threads": threads,
    }
    for kind, chosen in (("native", native), ("local", local)):
        run[kind] = _baselines(
            kind,
            devices if chosen is None else chosen,
            hidden=hidden,
            batch=batch,
            steps=baseline_steps,
            seconds=baseline_seconds,
            warmup=warmup,
            threads=threads,
            timeout=timeout,
        )

    worker_cfg = {
        "workers": len(workers),
        "schedule": schedule,
        "steps": steps,
        "seconds": seconds,
        "warmup": warmup,
        "hidden": hidden,
        "batch": batch,
        "timeout": timeout,
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zmqps-bench-gpu-") as folder:
        try:
            recs, run["warnings"] = _cluster(
                ps,
                workers,
                {**worker_cfg, "barrier": folder},
                threads,
                Path(folder),
                timeout=timeout + seconds + 60,
            )
        except (BenchError, OSError, ValueError) as exc:
            run["error"] = str(exc) or type(exc).__name__
            run["per_worker"], run["per_kind"] = [], {}
            run["ratios"] = _ratios(run)
            return run
    run["cluster_seconds"] = time.monotonic() - started
    window, rates = _concurrent(recs, batch)
    run["concurrent_seconds"] = window
    for rec, rate in zip(recs, rates, strict=True):
        rec["concurrent_examples_per_second"] = rate
        rec["tflops"] = rec["examples_per_second"] * run["flops_per_example"] / 1e12
    run["per_worker"] = recs
    run["examples_per_second"] = sum(r["examples_per_second"] for r in recs)
    run["per_kind"] = {}
    for kind in ("cuda", "cpu"):
        mine = [r for r in recs if _kind(r["device"]) == kind]
        if mine:
            run["per_kind"][kind] = {
                "workers": len(mine),
                "examples_per_second": statistics.fmean(r["examples_per_second"] for r in mine),
                "concurrent_examples_per_second": _mean(
                    [r["concurrent_examples_per_second"] for r in mine]
                ),
            }
    run["ratios"] = _ratios(run)
    return run


def _fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def format_gpu(run: dict[str, Any]) -> str:
    mb = run["parameters"] * 4 / 1e6
    threads = (
        f" ({run['cpu_threads']} BLAS threads per cpu worker)"
        if any(_kind(d) == "cpu" for d in run["workers"])
        else ""
    )
    lines = [
        f"gpu: MLP 784-{'-'.join(map(str, run['hidden']))}-10"
        f" ({run['parameters'] / 1e6:.1f} M parameters, {mb:.1f} MB), batch {run['batch']},"
        f" {run['ps']} PS, async, SGD, schedule {run['schedule']}; workers"
        f" {','.join(run['workers'])}{threads};"
        f" up to {run['steps']} steps or {run['seconds_limit']:g} s after {run['warmup']}"
        " warm-up steps",
    ]
    if "error" in run:
        lines.append(f"  cluster run FAILED: {run['error']}")
    else:
        lines.append(
            f"  {'worker':<7} {'device':<7} {'steps':>6} {'ex/s':>9} {'concurrent':>10}"
            f" {'TFLOP/s':>8}  ms per step: took/waited per phase, compute, hidden"
        )
        for r in run["per_worker"]:
            parts = phase_split(r, digits=1)
            lines.append(
                f"  {r['index']:<7} {r['device']:<7} {r['steps']:>6}"
                f" {r['examples_per_second']:>9.0f}"
                f" {_fmt(r['concurrent_examples_per_second']):>10} {r['tflops']:>8.2f}"
                f"  step {r['step_seconds'] * 1000:.1f}: {parts},"
                f" compute {r['compute_seconds'] * 1000:.1f}, hidden {r['overlap']:.0%}"
            )
        lines.append(
            f"  all workers: {run['examples_per_second']:.0f} examples/s;"
            f" concurrent window {run['concurrent_seconds']:.1f} s"
        )
    lines += [f"  warning: {w}" for w in run.get("warnings", [])]
    lines.append("  one device alone, no PS: examples/s, ms per step, TFLOP/s")
    for base, what in (("native", "torch loop"), ("local", "zmqps model")):
        for device, r in run[base].items():
            if "error" in r:
                lines.append(f"  {what:<12} {device:<7} FAILED: {r['error'][-300:]}")
            else:
                lines.append(
                    f"  {what:<12} {device:<7} {r['examples_per_second']:>9.0f}"
                    f" {r['step_ms']:>8.2f} ms {r['tflops']:>7.2f}"
                )
    if run["ratios"]:
        lines.append(
            "  ratios (examples/s): " + ", ".join(f"{k} {v:.3f}" for k, v in run["ratios"].items())
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- command line


def _devices(text: str) -> tuple[str, ...]:
    from zmqps.device import Device, DeviceError

    out = tuple(t.strip().lower() for t in text.split(",") if t.strip())
    try:
        for d in out:
            Device.parse(d)
    except DeviceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return out


def _baseline_devices(text: str) -> tuple[str, ...] | None:
    if text == "auto":
        return None
    if text == "none":
        return ()
    return _devices(text)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m zmqps.bench.gpu",
        description="GPU workers against CPU workers in one zmqps run (chief + PS on"
        " 127.0.0.1, async), and the same MLP on one device without a PS (PyTorch loop,"
        " zmqps model).",
        allow_abbrev=False,
    )
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument("--local-run", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument(
        "--workers",
        type=_devices,
        default=("cuda", "cuda", "cpu", "cpu"),
        metavar="DEVICES",
        help="one device per worker, comma-separated (default: cuda,cuda,cpu,cpu)",
    )
    add_model_args(p)
    p.add_argument("--steps", type=int, default=100, help="timed steps per worker (default: 100)")
    p.add_argument(
        "--seconds",
        type=float,
        default=30.0,
        help="or stop after this long (the same window for every worker; 0: no limit; default: 30)",
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    p.add_argument(
        "--schedule", choices=tuple(SCHEDULES), default="default", help="pipeline options"
    )
    p.add_argument("--ps", type=int, default=2, help="PS tasks (default: 2)")
    p.add_argument(
        "--cpu-threads",
        type=int,
        metavar="N",
        help="BLAS threads per cpu worker and cpu baseline (default: the cores left once"
        " each PS and GPU worker has one, shared among the cpu workers)",
    )
    p.add_argument(
        "--native",
        type=_baseline_devices,
        default=None,
        metavar="DEVICES",
        help="devices of the PyTorch-loop baseline: auto (those of --workers), none,"
        " or a list (default: auto)",
    )
    p.add_argument(
        "--local",
        dest="local_devices",
        type=_baseline_devices,
        default=None,
        metavar="DEVICES",
        help="devices of the zmqps-model baseline (no PS): auto, none or a list (default: auto)",
    )
    p.add_argument(
        "--baseline-steps", type=int, default=200, help="timed steps per baseline (default: 200)"
    )
    p.add_argument(
        "--baseline-seconds",
        type=float,
        default=10.0,
        help="or stop a baseline after this long (default: 10)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to set up or finish (default: 300)"
    )
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON here")
    a = p.parse_args(argv)
    # SIGTERM (a time limit) unwinds like Ctrl-C: the cluster's processes are killed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if a.worker:
        _worker(json.loads(a.worker))
        return 0
    if a.local_run:
        _local(json.loads(a.local_run))
        return 0
    if not a.workers:
        p.error("--workers names no device")
    ints = (a.batch, a.steps, a.ps, a.baseline_steps, a.cpu_threads or 1)
    if min(ints) < 1 or a.warmup < 0 or a.seconds < 0 or a.timeout <= 0:
        p.error("--batch, --steps, --ps, --cpu-threads must be >= 1, --warmup, --seconds >= 0")
    run = run_gpu(
        a.workers,
        a.hidden,
        a.batch,
        a.steps,
        a.seconds,
        a.warmup,
        a.schedule,
        a.ps,
        a.cpu_threads,
        a.native,
        a.local_devices,
        a.baseline_steps,
        a.baseline_seconds,
        a.timeout,
    )
    run["command"] = list(sys.argv)
    print(format_gpu(run), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(run, indent=2) + "\n")
    return 1 if "error" in run else 0


if __name__ == "__main__":
    sys.exit(main())
