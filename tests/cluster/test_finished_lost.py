"""A chief restarted after its workers finished, the PS state they trained lost: the run
ends within a bound, failed, and says why (real processes).

Fault schedule 13110 found it: the workers finished and left, the lone PS lost its
state (no copy: ``--replication 1``) before the final checkpoint was committed, and the
chief was restarted. It found an empty PS and no checkpoint, started anew, and waited
for ever for workers 0 and 1 to register. Here: two workers push all their batches and
hold; the PS is stopped (so the final checkpoint cannot be taken), the workers leave,
the chief and the PS are killed with ``kill -9``, both are started again. The chief
knows from its record that the workers finished, and that nothing holds their work; it
awaits them (a worker still waiting for the run's end would train it again), and they
exited: it fails the run once they are not heard within 10 s of its start.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers import Reaper, addresses, script, wait_for

from zmqps.checkpoint.root import CheckpointRoot
from zmqps.core.finished import RECORD_NAME, Finished, parse_record

WORKER = Path(__file__).with_name("sync_worker.py")
STEPS = 12


def _recorded(path: Path) -> dict[int, Finished]:
    try:
        return parse_record(path.read_bytes())
    except (OSError, ValueError):
        return {}


@pytest.mark.timeout(180)
def test_a_chief_restarted_after_the_workers_finished_and_the_ps_lost_its_state_fails(
    procs: Reaper, tmp_path: Path
) -> None:
    chief, ps, *workers = addresses(4)
    hosts = ["--chief-host", chief, "--ps-hosts", ps, "--worker-hosts", ",".join(workers)]
    ckpts = tmp_path / "checkpoints"
    server = script("zmqps-server")
    chief_argv = [
        server,
        *hosts,
        "--role",
        "chief",
        "--model",
        "none",
        "--summary",
        str(tmp_path / "summary.json"),
        "--checkpoint-dir",
        str(ckpts),
        "--checkpoint-secs",
        "600",  # no checkpoint but the final one
        "--heartbeat-timeout",
        "3",
    ]
    ps_argv = [server, *hosts, "--role", "ps", "--index", "0", "--checkpoint-dir", str(ckpts)]
    first_chief = procs.spawn(chief_argv, name="chief")
    first_ps = procs.spawn(ps_argv, name="ps0")
    hold = tmp_path / "go"
    started = [
        procs.spawn(
            [
                sys.executable,
                str(WORKER),
                "--chief",
                chief,
                "--index",
                str(i),
                "--workers",
                "2",
                "--steps",
                str(STEPS),
                "--out",
                str(tmp_path / f"worker{i}.json"),
                "--hold",
                str(hold),
            ],
            name=f"worker{i}",
        )
        for i in range(2)
    ]
    wait_for(
        lambda: all(Path(f"{hold}.{i}").exists() for i in range(2)),
        90,
        what="both workers to push all their batches",
    )
    # the PS stops: the final checkpoint cannot be taken; the workers leave, done
    first_ps.send(signal.SIGSTOP)
    hold.write_text("go\n")
    record = ckpts / RECORD_NAME
    wait_for(
        lambda: (
            {i: (f.steps, f.gen) for i, f in _recorded(record).items()}
            == {0: (STEPS, 0), 1: (STEPS, 0)}
        ),
        30,
        what="the chief to record both workers finished",
    )
    for w in started:
        w.expect_exit(0, timeout=30)
    assert CheckpointRoot(ckpts).latest() is None  # nothing was committed
    # the chief and the PS are lost (the PS with its state: no copy), then started again
    first_chief.send(signal.SIGKILL)
    first_ps.send(signal.SIGKILL)
    first_chief.wait(10)
    first_ps.wait(10)
    new_ps = procs.spawn(ps_argv, name="ps0-again")
    began = time.monotonic()
    new_chief = procs.spawn(chief_argv, name="chief-again")
    # before: "waiting for workers [0, 1] to register", for ever
    new_chief.expect_exit(3, timeout=120)
    took = time.monotonic() - began
    said = [line for line in new_chief.stderr.splitlines() if line.startswith("zmqps: error:")]
    assert len(said) == 1, new_chief.tail()
    assert said[0].startswith(
        "zmqps: error: the run cannot finish: workers 0, 1 finished their work (24 batches)"
    ), said
    assert "no checkpoint was committed" in said[0], said
    assert said[0].endswith(
        "(workers 0, 1 were not heard within 10s of this chief's start: not running)"
    ), said
    assert took < 90, f"{took:.1f}s\n{new_chief.tail()}"
    # the failed run shut its PS down, and its summary says why
    new_ps.expect_exit(0, timeout=30)
    assert _recorded(record)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == {
        "failed": said[0].removeprefix("zmqps: error: "),
        "work_lost": True,
        "checkpoint": None,
    }, summary
    # A chief started again (a supervisor that restarts whatever exits non-zero, e.g.
    # compose's restart: on-failure) fails the same way at once. It used to wait its
    # whole start-up timeout (120 s) for the PS shut down, then exit 1.
    began = time.monotonic()
    third = procs.spawn(chief_argv, name="chief-third")
    third.expect_exit(3, timeout=60)
    took = time.monotonic() - began
    again = [line for line in third.stderr.splitlines() if line.startswith("zmqps: error:")]
    assert again == said, third.tail()
    assert f"are in {record} (a new run in this directory starts without it" in third.stderr
    assert took < 30, f"{took:.1f}s\n{third.tail()}"
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
