"""Helpers for the process-level tests: spawn children, reap them, poll, pick ports.

Rules of this module:

* Loopback only: every address is ``127.0.0.1:<free port>``.
* Every child starts in its own session (its pid is its process group), with
  stdout / stderr in files, so a whole group can be signalled and its output
  read after the fact; :class:`Reaper` stops whatever is still running.
* Nothing sleeps for a fixed time: :func:`wait_for` polls up to a deadline.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from zmqps.cli.launch import free_ports as _free_ports
from zmqps.transport.ports import port_range

__all__ = [
    "HOST",
    "Proc",
    "Reaper",
    "addresses",
    "free_ports",
    "launched_by",
    "memory",
    "needs_tools",
    "read_json",
    "script",
    "tmpfs",
    "wait_for",
    "zmqps_cmd",
]

HOST = "127.0.0.1"
T = TypeVar("T")


#: the ports this test process handed out last (a few tests' worth): a port picked is
#: free until its task binds it, seconds later, and a second pick meanwhile handed it
#: out again (a test's two clusters, each picked apart: one chief's metrics port was
#: the other's PS port, and one of them failed with "Address already in use")
_GIVEN: collections.deque[int] = collections.deque(maxlen=512)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1, none of those handed out lately."""
    out: list[int] = []
    while len(out) < n:
        for port in _free_ports(n - len(out), HOST):
            if port not in _GIVEN and port not in out:
                out.append(port)
    _GIVEN.extend(out)
    return out


def free_run(n: int) -> int:
    """The first of ``n`` consecutive free TCP ports on 127.0.0.1 (a Slurm job's
    ``--port-base``), picked like :func:`free_ports`: in this test process's part of
    the range, below the kernel's ephemeral ports, which any process's connection may
    take at any moment (one picked there was taken before its task bound it)."""
    lowest, top, _ = port_range()
    rng = random.SystemRandom()
    for _ in range(200):
        base = rng.randrange(lowest, top - n + 1)
        with contextlib.ExitStack() as held:
            for port in range(base, base + n):
                s = held.enter_context(socket.socket())
                try:
                    s.bind((HOST, port))
                except OSError:
                    break
            else:
                if not set(range(base, base + n)) & set(_GIVEN):
                    _GIVEN.extend(range(base, base + n))
                    return base
    raise AssertionError(f"no {n} consecutive free ports in {lowest}-{top - 1}")


def needs_tools(tools: Sequence[str], why: str) -> pytest.MarkDecorator:
    """A skip unless every command of ``tools`` is on the PATH; ``why`` is the reason
    (how to install them), its ``{}`` the missing ones."""
    missing = [t for t in tools if shutil.which(t) is None]
    return pytest.mark.skipif(bool(missing), reason=why.format(", ".join(missing)))


def addresses(n: int) -> list[str]:
    """``n`` distinct free ``127.0.0.1:port`` addresses."""
    return [f"{HOST}:{p}" for p in free_ports(n)]


def script(name: str) -> str:
    """The console script ``name`` (zmqps-server, ...) installed beside this Python."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: install zmqps in this environment (pip install -e .)")
    return str(path)


def zmqps_cmd(*args: str) -> list[str]:
    """``python -m zmqps ARGS`` with this Python."""
    return [sys.executable, "-m", "zmqps", *args]


def memory(pid: int) -> dict[str, int]:
    """Process ``pid``'s resident memory now (``VmRSS``) and at its peak (``VmHWM``), bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def wait_for(
    predicate: Callable[[], T], timeout: float, *, what: str = "a condition", interval: float = 0.05
) -> T:
    """Poll ``predicate`` until it returns something truthy (and return it); fail at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def stopped_until(pid: int, predicate: Callable[[], T], timeout: float, *, what: str) -> T:
    """SIGSTOP ``pid`` until ``predicate`` holds (:func:`wait_for`), then SIGCONT it,
    also when the wait fails."""
    os.kill(pid, signal.SIGSTOP)
    try:
        return wait_for(predicate, timeout, what=what)
    finally:
        os.kill(pid, signal.SIGCONT)


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or None while it is missing or half written."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# --- /proc -----------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces
    return fields[0], int(fields[1])


def cpu_seconds(pid: int) -> float | None:
    """The CPU time ``pid`` has used (user + system), seconds; None when it is gone.
    Unlike the wall time since a start, it says how far a program got whatever the
    load on the machine."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _argv(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    return raw.decode(errors="replace").split("\0")


def sigint_ignored() -> None:
    """``preexec_fn``: start with SIGINT ignored, as a non-interactive shell starts a
    background job (``cmd &`` in a script, a CI step). Python then installs no
    KeyboardInterrupt, so a program must handle SIGINT itself to stop on it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def launched_by(pid: int) -> list[int]:
    """Live processes started by ``zmqps launch`` process ``pid`` (they carry its pid).

    The launcher's children run in their own sessions and outlive it if it is
    killed, so its process group does not find them; their ``--parent-pid`` does.
    """
    found = []
    for p in _pids():
        argv = _argv(p)
        if ("--parent-pid", str(pid)) in itertools.pairwise(argv) and _alive(p):
            found.append(p)
    return found


def _descendants(roots: set[int]) -> set[int]:
    parent = {p: s[1] for p in _pids() if (s := _proc_stat(p)) is not None}
    found: set[int] = set()
    frontier = set(roots)
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        group = os.getpgid(pid)
        if group != os.getpgrp():  # never signal the test runner's own group
            os.killpg(group, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


# --- children ----------------------------------------------------------------------


@dataclass
class Proc:
    """One child process with its output files."""

    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    out_path: Path
    err_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def poll(self) -> int | None:
        return self.popen.poll()

    def send(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def wait_cpu(self, seconds: float, timeout: float) -> None:
        """Until the process has used ``seconds`` of CPU (or has exited)."""

        def far_enough() -> bool:
            used = cpu_seconds(self.pid)
            return used is None or used >= seconds or self.poll() is not None

        wait_for(far_enough, timeout, what=f"{seconds}s of CPU in {self.name}", interval=0.002)

    def tail(self, lines: int = 15) -> str:
        def last(text: str) -> str:
            return "\n".join(text.splitlines()[-lines:])

        return (
            f"--- {self.name} stdout:\n{last(self.stdout)}\n"
            f"--- {self.name} stderr:\n{last(self.stderr)}"
        )

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still running after {timeout:g}s\n{self.tail()}"
            ) from None

    def expect_exit(self, code: int = 0, timeout: float = 60.0) -> None:
        """Wait for the exit and assert its code (the output tails go into the message)."""
        rc = self.wait(timeout)
        assert rc == code, f"{self.name} exited with {rc}, expected {code}\n{self.tail()}"


def _terminal_signals() -> None:
    """In a child before it runs: SIGINT, SIGQUIT and SIGHUP as a command started from a
    terminal has them (their default action). A test suite run in the background or
    under ``nohup`` passes them on ignored, and a Python program started so never
    raises KeyboardInterrupt: what a Ctrl-C test sends would be lost."""
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


class Reaper:
    """Starts children and, at :meth:`reap`, stops every one still running."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def spawn(
        self,
        argv: Sequence[str],
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        **kw: Any,
    ) -> Proc:
        """Start ``argv`` in a new session; ``env`` adds to (TF_CONFIG: replaces) the parent's."""
        name = name or f"{Path(argv[0]).name}-{len(self.procs)}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        full_env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        full_env.update({"PYTHONUNBUFFERED": "1", **(env or {})})
        out, err = self.log_dir / f"{name}.out", self.log_dir / f"{name}.err"
        with out.open("wb") as fo, err.open("wb") as fe:
            popen = subprocess.Popen(
                list(argv),
                stdout=fo,
                stderr=fe,
                stdin=subprocess.DEVNULL,
                env=full_env,
                start_new_session=True,
                **{"preexec_fn": _terminal_signals, **kw},
            )
        proc = Proc(name, list(argv), popen, out, err)
        self.procs.append(proc)
        return proc

    def reap(self, grace: float = 5.0) -> list[str]:
        """SIGTERM every leftover (and its descendants), SIGKILL after ``grace``.

        Returns a description of each process that was still running.
        """
        roots = {p.pid for p in self.procs if p.poll() is None}
        extra = {q for p in self.procs for q in launched_by(p.pid)}
        victims = (roots | _descendants(roots) | extra) - {os.getpid()}
        names = {p.pid: p.name for p in self.procs}
        left = [f"{names.get(pid, 'pid')} ({pid}): {' '.join(_argv(pid))[:200]}" for pid in victims]
        for pid in victims:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(max(0.0, deadline - time.monotonic()))
        while any(_alive(pid) for pid in victims) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in victims:
            if _alive(pid):
                _signal(pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(5.0)
        return left


# --- zmqps launch clusters -------------------------------------------------------------


def launch_run(procs: Reaper, run: Path, *flags: str, timeout: float = 120) -> tuple[Proc, Path]:
    """Start ``zmqps launch`` with its logs in ``run`` and its summary next to it."""
    summary = run.parent / f"{run.name}-summary.json"
    argv = zmqps_cmd(
        "launch",
        "--no-progress",
        "--timeout",
        f"{timeout:g}",
        "--run-dir",
        str(run),
        "--summary",
        str(summary),
        *flags,
    )
    return procs.spawn(argv, name=run.name), summary


def chief_address(launcher: Proc) -> str:
    """The chief's address, as the launcher prints it at start (or, with -q, as its
    task configuration in RUN_DIR/tasks says)."""
    argv = launcher.argv
    run_dir = Path(argv[argv.index("--run-dir") + 1]) if "--run-dir" in argv else None

    def find() -> str | None:
        m = re.search(r"zmqps launch: chief (127\.0\.0\.1:\d+),", launcher.stderr)
        if m:
            return m.group(1)
        task = None if run_dir is None else read_json(run_dir / "tasks" / "chief.json")
        return None if not task else str(task["chief"]["bind"])

    return str(wait_for(find, 30, what="the launcher to print the chief's address"))


def chief_status(chief: str, timeout: float = 2.0) -> dict[str, Any] | None:
    """The chief's status, or None while it does not answer."""
    from zmqps.roles.status import fetch_status
    from zmqps.wire.errors import ZmqpsError

    try:
        return asyncio.run(fetch_status(chief, timeout=timeout))
    except (ZmqpsError, OSError):
        return None


def task_pid(launcher: Proc, task: str) -> int:
    """The pid of the launcher's child running ``task`` (``chief``, ``ps1``, ``worker0``,
    ``evaluator``): it runs ``zmqps task --config RUN_DIR/tasks/<task>.json``."""
    suffix = f"/tasks/{task}.json"
    # launchers of before tasks were data started them with flags: --role ps --index 1
    m = re.fullmatch(r"(chief|ps|worker|evaluator)(\d*)", task)
    role, index = (m.group(1), m.group(2)) if m else (task, "")
    flags = [f"--index {index}"] if index else []
    flags += ["worker --"] if role == "worker" else [f"--role {role}"]

    def find() -> int | None:
        for pid in launched_by(launcher.pid):
            argv = _argv(pid)
            line = " ".join(argv)
            if any(arg.endswith(suffix) for arg in argv) or all(f in line for f in flags):
                return pid
        return None

    return int(wait_for(find, 30, what=f"the task {task}"))


def _gpu_marks() -> list[pytest.MarkDecorator]:
    from zmqps.device import cupy_available

    reason = "needs a CUDA GPU and cupy (pip install 'zmqps[gpu]'); run with: pytest -m gpu"
    return [pytest.mark.gpu, pytest.mark.skipif(not cupy_available(), reason=reason)]


#: the kinds of device a test of device code runs on: the host, the emulated device
#: (copies where a GPU copies), and a CUDA GPU where there is one (marked ``gpu``)
DEVICE_KINDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("emulate", id="emulate"),
    pytest.param("cuda", id="cuda", marks=_gpu_marks()),
]


def device_of(kind: str, index: int = 0) -> Any:
    """A Device of ``kind`` (one of DEVICE_KINDS' values)."""
    from zmqps.device import Device

    if kind == "cuda":
        return Device("cuda", index)
    return Device("cpu", emulate=kind == "emulate")


@contextlib.asynccontextmanager
async def serving_ps(cfg: Any, options: Any = None) -> Any:
    """``serve_ps(cfg)`` in this loop, with a client ``w0:0`` that reached it (a ping):
    yields the client; at the end asks the PS to shut down and waits for it."""
    import zmq.asyncio

    from zmqps.roles.ps import serve_ps
    from zmqps.transport import Client

    ctx = zmq.asyncio.Context()
    task = asyncio.ensure_future(serve_ps(cfg, ctx, options))
    client = Client(ctx, cfg.bind, "w0:0", options=options)
    try:
        await client.request("ping", timeout=5.0, attempts=3)
        yield client
        await client.request("shutdown", timeout=5.0)
        await asyncio.wait_for(task, 10.0)
    finally:
        task.cancel()
        await client.close()
        ctx.term()


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real file system of ``size`` (``mount -t tmpfs``) at ``path``, unmounted after:
    a full disk. Skips without root or where it cannot be mounted."""
    if os.geteuid() != 0:
        pytest.skip("a real full disk needs root to mount a small tmpfs")
    path.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            check=True,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here ({exc})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, timeout=10)
