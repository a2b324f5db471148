"""The shipped sbatch script on a real single-node Slurm (controller and node daemon on
127.0.0.1, their own munge, configuration and state in a temporary folder): a whole
cluster from one ``srun``, sync and async, to a finished, accurate run with every task
exiting 0; ``scancel`` mid-run leaves no process behind.

bin/test installs Debian's ``slurm-wlm`` and ``munge`` when ``CI`` is set (or with
``ZMQPS_INSTALL_SYSTEM=1``, as root); elsewhere these tests skip, saying so.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    Reaper,
    _argv,
    _pids,
    chief_status,
    free_run,
    needs_tools,
    read_json,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "slurm" / "zmqps.sbatch"
VENV = ROOT / ".venv"
NEEDED = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo", "munged")
INSTALL = (
    "Slurm is not installed ({}): run the tests as root with CI=1 or ZMQPS_INSTALL_SYSTEM=1"
    " (bin/test installs Debian's slurm-wlm and munge), or apt-get install slurm-wlm munge"
)

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(300),
    needs_tools(NEEDED, INSTALL),
]


class Slurm:
    """A single-node Slurm of this test module's own."""

    def __init__(self, root: Path, procs: Reaper) -> None:
        self.root = root
        self.procs = procs
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.env.pop("TF_CONFIG", None)

    def start(self) -> None:
        root = self.root
        for d in ("state", "spool", "munge"):
            (root / d).mkdir(parents=True, exist_ok=True)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = root / "munge" / "munge.socket"
        self.munged = self.procs.spawn(
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--pid-file={root / 'munge' / 'munged.pid'}",
                f"--seed-file={root / 'munge' / 'munged.seed'}",
                f"--log-file={root / 'munge' / 'munged.log'}",
            ],
            name="munged",
        )
        wait_for(lambda: sock.exists() or None, 20, what="munged's socket")
        ctld, slurmd = free_run(2), free_run(1)
        host = socket.gethostname().split(".")[0]
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=zmqpstest",
                    f"SlurmctldHost={host}(127.0.0.1)",
                    f"SlurmctldPort={ctld}",
                    f"SlurmdPort={slurmd}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={sock}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "MpiDefault=none",
                    "SchedulerType=sched/backfill",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SlurmdParameters=config_overrides",
                    "ReturnToService=2",
                    "JobCompType=jobcomp/none",
                    "AccountingStorageType=accounting_storage/none",
                    "KillWait=5",
                    f"StateSaveLocation={root / 'state'}",
                    f"SlurmdSpoolDir={root / 'spool'}",
                    f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={root / 'slurmd.pid'}",
                    f"SlurmctldLogFile={root / 'slurmctld.log'}",
                    f"SlurmdLogFile={root / 'slurmd.log'}",
                    # the node is "localhost": every task address is a loopback one
                    "NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 RealMemory=4000 State=UNKNOWN",
                    "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        self.ctld = self.procs.spawn(["slurmctld", "-D", "-i"], name="slurmctld", env=self.env)
        self.slurmd = self.procs.spawn(
            ["slurmd", "-D", "-N", "localhost"], name="slurmd", env=self.env
        )

        def idle() -> bool | None:
            assert self.ctld.poll() is None, self.ctld.tail() + self.log("slurmctld")
            assert self.slurmd.poll() is None, self.slurmd.tail() + self.log("slurmd")
            out = self.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
            return True if out == "idle" else None

        wait_for(idle, 60, what="the Slurm node to be idle", interval=0.5)

    def log(self, daemon: str) -> str:
        path = self.root / f"{daemon}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"\n--- {daemon}.log:\n" + "\n".join(text.splitlines()[-20:])

    def run(self, *argv: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            argv, env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True, **kw
        )
        if check:
            assert proc.returncode == 0, (argv, proc.returncode, proc.stdout, proc.stderr)
        return proc

    def sbatch(self, run: Path, ntasks: int, settings: dict[str, str], *, wait: bool) -> Any:
        env = {
            "ZMQPS_VENV": str(VENV),
            "ZMQPS_RUN_DIR": str(run),
            "ZMQPS_PORT_BASE": str(free_run(ntasks)),
            "ZMQPS_METRICS_PORT": str(free_run(ntasks)),
            **settings,
        }
        argv = ["sbatch", "--parsable", f"--ntasks={ntasks}", f"--output={run}.out"]
        job = self.run(*argv, str(SCRIPT), env=env, check=False, cwd=run.parent, timeout=60)
        if not wait or job.returncode != 0:
            return job
        return self.wait(job.stdout.strip().split(";")[0], timeout=240)

    def wait(self, job_id: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """The finished job's state, as ``sbatch --wait`` would give it: returncode 0 when
        it COMPLETED with exit code 0. Polled every 0.5 s (``sbatch --wait`` polls after
        2, 10 and 42 s, so a 12 s job took 42)."""
        deadline = time.monotonic() + timeout
        while True:
            shown = self.run("scontrol", "-o", "show", "job", job_id, check=False)
            fields = dict(f.split("=", 1) for f in shown.stdout.split() if "=" in f)
            state = fields.get("JobState", "")
            if state and state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                code = fields.get("ExitCode", "1:0").split(":")[0]
                rc = 0 if state == "COMPLETED" and code == "0" else int(code) or 1
                return subprocess.CompletedProcess(shown.args, rc, shown.stdout, shown.stderr)
            assert time.monotonic() < deadline, f"job {job_id} not done in {timeout} s: {shown}"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    root = tmp_path_factory.mktemp("slurm")
    procs = Reaper(root / "logs")
    cluster = Slurm(root, procs)
    try:
        cluster.start()
    except AssertionError as exc:
        procs.reap()
        pytest.skip(f"the Slurm daemons did not start here: {exc}")
    try:
        yield cluster
    finally:
        procs.reap()


def zmqps_tasks(run: Path) -> list[int]:
    """Live processes whose command line names the run folder (the job's tasks)."""
    return [pid for pid in _pids() if str(run) in " ".join(_argv(pid))]


@pytest.mark.parametrize(
    ("mode", "ntasks", "settings"),
    [
        ("sync", 5, {"ZMQPS_PS": "2"}),  # chief, 2 PS, 2 workers
        ("async", 5, {"ZMQPS_EVALUATOR": "1"}),  # chief, evaluator, 1 PS, 2 workers
    ],
)
def test_the_sbatch_script_trains_a_whole_cluster(
    slurm: Slurm, tmp_path: Path, mode: str, ntasks: int, settings: dict[str, str]
) -> None:
    run = tmp_path / f"run-{mode}"
    started = time.monotonic()
    done = slurm.sbatch(
        run, ntasks, {"ZMQPS_MODE": mode, "ZMQPS_EPOCHS": "20", **settings}, wait=True
    )
    wall = time.monotonic() - started
    out = Path(f"{run}.out").read_text(errors="replace")
    assert done.returncode == 0, (done.stdout, done.stderr, out[-3000:])
    # srun names every task that exited non-zero ("task 3: Exited with exit code 1")
    assert not re.search(r"task \d+: (Exited|Killed|Terminated)", out), out[-3000:]
    summary = read_json(run / "summary.json")
    assert summary is not None, out[-3000:]
    assert summary["mode"] == mode and summary["workers"] == 2, summary
    assert summary["test_accuracy"] >= 0.95, summary
    assert (run / "model").is_dir() and (run / "tensorboard" / "chief").is_dir()
    assert "cluster from Slurm: rank 0 is chief 0" in out, out[-3000:]
    if settings.get("ZMQPS_EVALUATOR") == "1":
        assert (run / "evaluator.jsonl").exists(), out[-3000:]
    assert not zmqps_tasks(run)
    print(
        f"\nslurm {mode}: sbatch to the end {wall:.1f}s, test accuracy {summary['test_accuracy']},"
        f" global step {summary['global_step']}"
    )


def test_scancel_mid_run_leaves_no_process(slurm: Slurm, tmp_path: Path) -> None:
    run = tmp_path / "run-cancel"
    base = free_run(4)
    job = slurm.sbatch(
        run,
        4,
        {"ZMQPS_MODE": "async", "ZMQPS_EPOCHS": "400", "ZMQPS_PORT_BASE": str(base)},
        wait=False,
    )
    assert job.returncode == 0, (job.stdout, job.stderr)
    job_id = job.stdout.strip().split(";")[0]

    def training() -> dict[str, Any] | None:
        st = chief_status(f"127.0.0.1:{base}", timeout=1.0)
        return st if st is not None and st.get("global_step", 0) > 20 else None

    wait_for(training, 90, what="the Slurm job to train", interval=0.5)
    assert len(zmqps_tasks(run)) >= 4
    slurm.run("scancel", job_id)
    cancelled = time.monotonic()

    def gone() -> bool | None:
        queued = slurm.run("squeue", "-h", "-j", job_id, check=False).stdout.strip()
        return True if not queued and not zmqps_tasks(run) else None

    wait_for(gone, 60, what="the job and every one of its processes to end", interval=0.5)
    print(f"\nscancel: every task gone {time.monotonic() - cancelled:.1f}s after it")
