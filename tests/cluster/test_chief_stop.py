"""A chief stopped by a signal ends within a bound whatever its PS do: one that does
not answer is not waited for past a short budget, and a second signal stops the
chief at once (no more waiting for workers, a last checkpoint, or the PS)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from helpers import Reaper, addresses, script, wait_for

from zmqps.roles.chief.serve import SIGNAL_SHUTDOWN_S


def _hosts(n_workers: int = 1) -> tuple[list[str], list[str]]:
    chief, ps, *workers = addresses(2 + n_workers)
    hosts = ["--chief-host", chief, "--ps-hosts", ps, "--worker-hosts", ",".join(workers)]
    return hosts, [chief, ps, *workers]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_chief_whose_ps_is_down_obeys_a_signal_within_the_budget(
    procs: Reaper, sig: signal.Signals
) -> None:
    hosts, _ = _hosts()
    chief = procs.spawn([script("zmqps-server"), *hosts, "--role", "chief"], name="chief")
    wait_for(lambda: "serving on" in chief.stderr, timeout=30, what="the chief to serve")
    time.sleep(0.5)  # it is waiting for its PS, which never comes
    chief.send(sig)
    # its shutdown of the PS that never came: one attempt of SIGNAL_SHUTDOWN_S (before:
    # the end-of-run window, 30 s, and a second signal did nothing)
    chief.expect_exit(128 + int(sig), timeout=SIGNAL_SHUTDOWN_S + 6)
    assert "did not acknowledge shutdown in 2s" in chief.stderr, chief.tail()


@pytest.mark.timeout(90)
def test_a_second_signal_stops_the_chief_at_once(procs: Reaper, tmp_path: Path) -> None:
    """The PS stopped (SIGSTOP) while the run goes on: the first SIGINT makes the chief
    wait for its worker and its last checkpoint (about 8 s of grace, then the PS's
    shutdown); the second ends that wait."""
    hosts, _ = _hosts()
    server = script("zmqps-server")
    ckpt = tmp_path / "ckpt"
    job = ["--model", "softmax", "--epochs", "1000"]
    chief = procs.spawn(
        [server, *hosts, "--role", "chief", *job, "--checkpoint-dir", str(ckpt)], name="chief"
    )
    ps = procs.spawn(  # a chief that takes checkpoints refuses a PS that cannot
        [server, *hosts, "--role", "ps", "--index", "0", "--checkpoint-dir", str(ckpt)],
        name="ps0",
    )
    worker = procs.spawn(
        [script("zmqps-worker"), *hosts, "--role", "worker", "--index", "0", *job],
        name="worker0",
    )
    wait_for(lambda: "registered" in chief.stderr, timeout=40, what="the worker to register")
    time.sleep(1.0)  # training
    ps.send(signal.SIGSTOP)
    try:
        chief.send(signal.SIGINT)
        wait_for(lambda: "stopping the run" in chief.stderr, timeout=10, what="the first stop")
        time.sleep(1.0)
        assert chief.poll() is None, chief.tail()  # still waiting (worker, checkpoint, PS)
        chief.send(signal.SIGINT)
        chief.expect_exit(130, timeout=6)
        assert "stopping at once" in chief.stderr, chief.tail()
        assert "Traceback" not in chief.stderr, chief.tail()
    finally:
        ps.send(signal.SIGCONT)
    # not told (the chief stopped waiting): stopped by hand, as the chief's log says
    for task in (ps, worker):
        task.send(signal.SIGTERM)
    for task in (ps, worker):
        assert task.wait(30) is not None, task.tail()
