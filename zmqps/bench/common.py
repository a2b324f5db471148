"""Plumbing shared by the benchmark sides: stats, machine info, child processes.

Rules of this module:

* Children run in their own sessions (their pid is their process group) with
  stderr (and stdout, unless it is the control pipe) in a log file; every one
  is stopped by :func:`stop_all` (SIGTERM, then SIGKILL after a grace period)
  whatever happens in the parent, Ctrl-C included.
* Workers speak JSON lines: the parent writes commands on their stdin, they
  answer on the original stdout (:class:`Control` moves stray prints to stderr).
  A worker answers ``ready`` once set up, then one report per ``run``.
* Every wait has a deadline, and a wait on workers fails at once when any
  process of their side has exited.
* Timing: a ``run`` names a start instant on CLOCK_MONOTONIC (system-wide on
  Linux); each worker sleeps until then, times its steps and reports t0/t1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = [
    "HOST",
    "BenchError",
    "Child",
    "Control",
    "Side",
    "SideContext",
    "child_argv",
    "child_env",
    "int_list",
    "machine_info",
    "run_local_cluster",
    "serve_steps",
    "stop_all",
    "summarize",
]

HOST = "127.0.0.1"
#: seconds between sending ``run`` and the start instant (pipes and wake-ups).
START_DELAY_S = 0.1
#: seconds a paused side gets to settle after SIGCONT before its run is sent.
RESUME_SETTLE_S = 0.3


class BenchError(Exception):
    """A side failed: a child died, answered an error, or missed a deadline."""


# ---------------------------------------------------------------------- stats


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of ``values`` (non-empty)."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(module: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    import numpy

    from zmqps.transport import zmq_versions

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = os.cpu_count() or 0
    return {
        "nproc": affinity,
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        **zmq_versions(),  # pyzmq, libzmq
        "numpy": numpy.__version__,
        "torch": _version("torch"),
        "zmqps": _version("zmqps"),
        "loadavg": list(os.getloadavg()),
    }


# ---------------------------------------------------------------------- child side


class Control:
    """A worker's end of the control pipe (JSON lines on the original stdin / stdout)."""

    def __init__(self) -> None:
        out_fd = os.dup(1)
        os.dup2(2, 1)  # stray prints of libraries go to the log, not into the protocol
        self._out = os.fdopen(out_fd, "w", buffering=1)
        self._in = sys.stdin

    def send(self, **msg: Any) -> None:
        self._out.write(json.dumps(msg) + "\n")
        self._out.flush()

    def recv(self) -> dict[str, Any] | None:
        """The next command, or None when the parent closed the pipe (or died)."""
        line = self._in.readline()
        if not line:
            return None
        cmd: dict[str, Any] = json.loads(line)
        return cmd


def serve_steps(
    ctl: Control, steps: Mapping[str, Callable[[], object]], info: Mapping[str, Any]
) -> None:
    """Announce ``ready`` (with ``info``), then run the parent's timed runs until ``exit``."""
    ctl.send(ready=True, **info)
    while True:
        cmd = ctl.recv()
        if cmd is None or cmd["cmd"] == "exit":
            return
        step = steps[cmd["variant"]]
        n = int(cmd["steps"])
        delay = float(cmd["start"]) - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        t0 = time.monotonic()
        for _ in range(n):
            step()
        finish = getattr(step, "finish", None)  # work a step left in flight, timed too
        if finish is not None:
            finish()
        t1 = time.monotonic()
        ctl.send(t0=t0, t1=t1, steps=n)


# ---------------------------------------------------------------------- parent side


class Child:
    """One child process; with ``control`` its stdin/stdout are the JSON-lines pipe."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: Path,
        env: Mapping[str, str],
        *,
        control: bool = False,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = self.log_path.open("wb")
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.popen = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE if control else subprocess.DEVNULL,
            stdout=subprocess.PIPE if control else self._log,
            stderr=self._log,
            env=dict(env),
            start_new_session=True,
        )
        if control:
            threading.Thread(target=self._read, name=f"bench-{name}", daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            self._lines.put(raw.decode(errors="replace"))
        self._lines.put(None)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 12) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(f"    [{self.name}] {t}" for t in text.splitlines()[-lines:])

    def send(self, **msg: Any) -> None:
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write((json.dumps(msg) + "\n").encode())
            self.popen.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise BenchError(
                f"{self.name} is gone (exit {self.popen.poll()})\n{self.tail()}"
            ) from None

    def recv(self, timeout: float, watch: Sequence[Child] = ()) -> dict[str, Any]:
        """The next message; fails when this child or one of ``watch`` exits, or at timeout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                for c in watch:
                    if not c.running():
                        raise BenchError(
                            f"{c.name} exited with {c.popen.returncode} while {self.name}"
                            f" was working\n{c.tail()}"
                        ) from None
                if time.monotonic() >= deadline:
                    raise BenchError(
                        f"{self.name}: no answer within {timeout:g}s\n{self.tail()}"
                    ) from None
                continue
            if line is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(2.0)
                raise BenchError(
                    f"{self.name} exited with {self.popen.poll()}\n{self.tail()}"
                ) from None
            try:
                msg: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError:
                continue  # not ours (nothing else should write there, but never trip on it)
            if "error" in msg:
                raise BenchError(f"{self.name}: {msg['error']}\n{self.tail()}")
            return msg

    def signal(self, sig: int) -> None:
        if self.running():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
                if sig == signal.SIGTERM:  # a paused child acts on it only once continued
                    os.killpg(self.pid, signal.SIGCONT)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None

    def close_files(self) -> None:
        with contextlib.suppress(OSError):
            self._log.close()
        if self.popen.stdin is not None:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()


def stop_all(children: Sequence[Child], grace: float = 5.0) -> None:
    """SIGTERM every child still running, SIGKILL those left after ``grace`` seconds."""
    for c in children:
        c.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in children:
        if c.wait(deadline - time.monotonic()) is None:
            c.signal(signal.SIGKILL)
            c.wait(5.0)
    for c in children:
        c.close_files()


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_local_cluster(
    ps: int,
    workers: int,
    worker_argv: Callable[[str, int], list[str]],
    *,
    chief_flags: Sequence[str] = (),
    timeout: float = 120.0,
    what: str = "bench",
) -> list[dict[str, Any]]:
    """A zmqps chief and ``ps`` PS on 127.0.0.1 (``zmqps server``), and ``workers``
    processes ``worker_argv(chief_address, index)`` that each print one JSON line last.
    Returns those records (in index order) once the servers have exited; every process
    is killed if anything fails."""
    from zmqps.transport import free_ports

    ports = free_ports(1 + ps + workers)
    addrs = [f"{HOST}:{p}" for p in ports]
    spec = json.dumps(
        {"cluster": {"chief": addrs[:1], "ps": addrs[1 : 1 + ps], "worker": addrs[1 + ps :]}}
    )
    env = child_env()
    server = [sys.executable, "-m", "zmqps", "server", "--cluster", spec]
    procs: list[subprocess.Popen[Any]] = [
        subprocess.Popen(
            [*server, "--role", "chief", *chief_flags], env=env, stderr=subprocess.DEVNULL
        )
    ]
    procs += [
        subprocess.Popen(
            [*server, "--role", "ps", "--index", str(i)], env=env, stderr=subprocess.DEVNULL
        )
        for i in range(ps)
    ]
    kids = [
        subprocess.Popen(
            worker_argv(addrs[0], i),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(workers)
    ]
    try:
        out = []
        for k in kids:
            stdout, stderr = k.communicate(timeout=timeout)
            if k.returncode != 0:
                raise BenchError(f"{what}: a worker exited with {k.returncode}: {stderr[-500:]}")
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        for p in procs:
            p.wait(timeout=30)
        return out
    finally:
        for p in [*procs, *kids]:
            if p.poll() is None:
                p.kill()
                p.wait()


def child_argv(side: str, role: str, config: Path) -> list[str]:
    return [sys.executable, "-m", "zmqps.bench.child", side, role, str(config)]


@dataclass(frozen=True)
class SideContext:
    """What every side's ``spawn`` gets besides the workload."""

    workers: int
    run_dir: Path
    timeout: float
    seed: int = 0
    zmqps_env: Mapping[str, str] = field(default_factory=dict)
    pause_idle: bool = True

    def write_config(self, name: str, config: Mapping[str, Any]) -> Path:
        path = self.run_dir / f"{name}.json"
        path.write_text(json.dumps(config))
        return path


@dataclass
class Side:
    """One side of a suite run: its servers, its workers and their results."""

    name: str
    units_per_step: int
    timeout: float
    servers: list[Child] = field(default_factory=list)
    workers: list[Child] = field(default_factory=list)
    #: servers stop on SIGTERM (exit 0); the others exit on their own after the workers.
    sigterm_servers: bool = False
    #: pause (SIGSTOP) every process of the side between its runs: for sides that
    #: burn CPU while idle (TensorPipe's threads poll), which would slow the others.
    pause_idle: bool = False
    paused: bool = False
    info: list[dict[str, Any]] = field(default_factory=list)
    #: zmqps sides: the PS addresses, whose ``status`` the report reads after the runs
    ps_addresses: list[str] = field(default_factory=list)
    error: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def children(self) -> list[Child]:
        return [*self.workers, *self.servers]

    def wait_ready(self) -> None:
        self.info = [w.recv(self.timeout, watch=self.children) for w in self.workers]

    def pause(self) -> None:
        if self.pause_idle and not self.paused:
            for c in self.children:
                c.signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            for c in self.children:
                c.signal(signal.SIGCONT)
            self.paused = False
            time.sleep(RESUME_SETTLE_S)

    def run(self, variant: str, steps: int) -> dict[str, Any]:
        """One timed run of ``steps`` steps per worker, all workers from one instant."""
        self.resume()
        start = time.monotonic() + START_DELAY_S
        for w in self.workers:
            w.send(cmd="run", variant=variant, steps=steps, start=start)
        reports = [w.recv(self.timeout, watch=self.children) for w in self.workers]
        self.pause()
        t0 = min(r["t0"] for r in reports)
        t1 = max(r["t1"] for r in reports)
        total = sum(int(r["steps"]) for r in reports)
        seconds = max(t1 - t0, 1e-9)
        return {
            "value": total * self.units_per_step / seconds,
            "seconds": seconds,
            "steps": total,
            "late_start_s": max(r["t0"] for r in reports) - start,
            "per_worker": [
                {"steps": r["steps"], "seconds": r["t1"] - r["t0"], "start_s": r["t0"] - start}
                for r in reports
            ],
        }

    def fail(self, exc: BaseException) -> None:
        self.error = str(exc) or type(exc).__name__
        stop_all(self.children, grace=2.0)

    def close(self, grace: float = 60.0) -> None:
        """Let workers leave, then servers stop; kill whatever is left. Notes bad exits."""
        self.resume()
        if self.error is None:
            for w in self.workers:
                with contextlib.suppress(BenchError):
                    if w.running():
                        w.send(cmd="exit")
            deadline = time.monotonic() + grace
            for c in self.workers:
                c.wait(deadline - time.monotonic())
            if self.sigterm_servers:
                for c in self.servers:
                    c.signal(signal.SIGTERM)
            for c in self.servers:
                c.wait(deadline - time.monotonic())
            for c in self.children:
                rc = c.popen.poll()
                if rc is None:
                    self.warnings.append(f"{c.name} did not exit within {grace:g}s; killed")
                elif rc != 0:
                    self.warnings.append(f"{c.name} exited with {rc}\n{c.tail()}")
        stop_all(self.children, grace=2.0)


def int_list(text: str) -> tuple[int, ...]:
    """``"4096,4096"`` as numbers, each at least 1 (an argparse ``type``)."""
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 4096,4096, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values
