"""Mistakes users make at the command line: one clear error line, exit code 2, no traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import Reaper, addresses, script, wait_for, zmqps_cmd


def _tf_config(task_type: str | None, index: int | None) -> str:
    chief, ps, w0, w1 = addresses(4)
    cluster = {"chief": [chief], "ps": [ps], "worker": [w0, w1]}
    if task_type is None:
        return json.dumps({"cluster": cluster})
    task: dict[str, object] = {"type": task_type}
    if index is not None:
        task["index"] = index
    return json.dumps({"cluster": cluster, "task": task})


NO_ROLE = (
    "no role: pass --role (or --job-name) and --index, or give a 'task' in TF_CONFIG / --cluster"
)


CASES = {
    "tf-config-not-json": (
        ["zmqps-server"],
        {"TF_CONFIG": '{"cluster": '},
        "TF_CONFIG: not valid JSON",
    ),
    "index-out-of-range": (
        ["zmqps-worker"],
        {"TF_CONFIG": _tf_config("worker", 5)},
        "TF_CONFIG: task index 5 out of range for 'worker' (2 tasks)",
    ),
    "no-cluster": (["zmqps-worker"], {}, "no cluster spec"),
    "unknown-role": (
        ["zmqps-worker", "--role", "trainer"],
        {"TF_CONFIG": _tf_config("worker", 0)},
        "--role: unknown role 'trainer'",
    ),
    "ps-task-for-zmqps-worker": (
        ["zmqps-worker"],
        {"TF_CONFIG": _tf_config("ps", 0)},
        "zmqps-worker runs roles worker and evaluator, not 'ps'",
    ),
    "worker-role-for-zmqps-server": (
        ["zmqps-server"],
        {"TF_CONFIG": _tf_config("worker", 1)},
        "zmqps-server serves roles chief and ps, not 'worker'",
    ),
    # the same TF_CONFIG is the same error for both programs (never a silent worker 0)
    "tf-config-without-task-server": (
        ["zmqps-server"],
        {"TF_CONFIG": _tf_config(None, None)},
        NO_ROLE,
    ),
    "tf-config-without-task-worker": (
        ["zmqps-worker", "--model", "mlp"],
        {"TF_CONFIG": _tf_config(None, None)},
        NO_ROLE,
    ),
    "tf-config-task-without-index": (
        ["zmqps-worker", "--model", "mlp"],
        {"TF_CONFIG": _tf_config("worker", None)},
        "TF_CONFIG: 'task' 'worker' has no 'index'; give it"
        ' (e.g. {"type": "worker", "index": 0}) or pass --index',
    ),
    "status-chief-without-port": (
        ["zmqps", "status", "--chief", "localhost"],
        {},
        "--chief: 'localhost' is not host:port (expected HOST:PORT, e.g. 127.0.0.1:2222)",
    ),
    "status-chief-port-not-a-number": (
        ["zmqps", "status", "--chief", "localhost:notaport"],
        {},
        "--chief: 'localhost:notaport': port 'notaport' is not a number"
        " (expected HOST:PORT, e.g. 127.0.0.1:2222)",
    ),
    "status-run-dir-not-a-run": (
        ["zmqps", "status", "--run-dir", "/nonexistent-run"],
        {},
        "--run-dir /nonexistent-run: no zmqps launch run there (no"
        " /nonexistent-run/tasks/chief.json); pass the run's --run-dir, or the chief's address"
        " with --chief",
    ),
    # two workers started without their index would both be worker 0
    "classic-flags-without-task-id": (
        [
            "zmqps-worker",
            *("--ps_hosts", "127.0.0.1:1", "--worker_hosts", "127.0.0.1:2,127.0.0.1:3"),
            *("--chief_host", "127.0.0.1:4", "--job_name", "worker"),
        ],
        {},
        "--role worker: the cluster has 2 worker tasks; say which one this is with --index",
    ),
    "launch-no-ps": (["zmqps", "launch", "--ps", "0"], {}, "--ps and --workers must be >= 1"),
    # checked once by the launcher, not by every (restarted) child
    "launch-no-epochs": (["zmqps", "launch", "--epochs", "0"], {}, "--epochs must be >= 1"),
    # it said "[Errno 20] Not a directory: '/dev/null/keys'", exit 1
    "keygen-folder-under-a-file": (
        ["zmqps", "keygen", "/dev/null/keys"],
        {},
        "zmqps keygen /dev/null/keys: cannot create it (Not a directory)",
    ),
}

#: Cases whose message is the whole line.
EXACT = {
    "status-chief-without-port",
    "status-chief-port-not-a-number",
    "status-run-dir-not-a-run",
    "tf-config-without-task-server",
    "tf-config-without-task-worker",
    "tf-config-task-without-index",
    "keygen-folder-under-a-file",
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", CASES)
def test_bad_spec_is_one_line_and_exit_2(procs: Reaper, case: str) -> None:
    (command, *args), env, message = CASES[case]
    p = procs.spawn([script(command), *args], name=case, env=env)
    p.expect_exit(2, timeout=20)
    err = p.stderr
    assert len(err.splitlines()) == 1 and err.startswith("zmqps: error: "), err
    assert message in err
    assert "Traceback" not in err + p.stdout
    if case in EXACT:
        assert err == f"zmqps: error: {message}\n"


@pytest.mark.timeout(30)
def test_status_of_absent_chief_is_one_line_and_exit_1(procs: Reaper) -> None:
    (chief,) = addresses(1)
    p = procs.spawn(zmqps_cmd("status", "--chief", chief, "--timeout", "0.5"), name="status")
    p.expect_exit(1, timeout=20)
    err = p.stderr
    assert len(err.splitlines()) == 1 and err.startswith("zmqps: error: "), err
    assert chief in err


@pytest.mark.timeout(60)
def test_status_of_a_curve_cluster_without_keys_hints_at_keys(
    procs: Reaper, tmp_path: Path
) -> None:
    """A CURVE server drops a plaintext handshake silently: the timeout says why it may be."""
    from zmqps.transport import keygen

    keygen(tmp_path / "keys")
    chief, ps, worker = addresses(3)
    hosts = ["--chief-host", chief, "--ps-hosts", ps, "--worker-hosts", worker]
    server = procs.spawn(
        [script("zmqps-server"), *hosts, "--role", "ps", "--keys", str(tmp_path / "keys")],
        name="ps",
        env={"ZMQPS_KEYS": ""},
    )
    wait_for(lambda: "serving on" in server.stderr, 30, what="the CURVE PS to serve")
    status = zmqps_cmd("status", "--chief", ps, "--timeout", "0.5")
    p = procs.spawn(status, name="status", env={"ZMQPS_KEYS": ""})
    p.expect_exit(1, timeout=20)
    assert p.stderr == (
        f"zmqps: error: status to tcp://{ps}: no reply within 0.5s (is the chief running?"
        " a cluster started with CURVE keys answers only with them: pass --keys DIR or set"
        " ZMQPS_KEYS)\n"
    )
    server.send(signal.SIGTERM)
    server.expect_exit(143, timeout=20)  # stopped by a signal, not by a chief


@pytest.mark.timeout(60)
def test_status_pointed_at_a_ps_says_so(procs: Reaper) -> None:
    """A PS answers ``status`` too: ``zmqps status --chief <a PS>`` printed a table of
    None and exited 0; it names what answered and exits 2."""
    chief, ps, worker = addresses(3)
    hosts = ["--chief-host", chief, "--ps-hosts", ps, "--worker-hosts", worker]
    server = procs.spawn([script("zmqps-server"), *hosts, "--role", "ps"], name="ps")
    wait_for(lambda: "serving on" in server.stderr, 30, what="the PS to serve")
    for flags in ([], ["--json"]):
        p = procs.spawn(zmqps_cmd("status", "--chief", ps, *flags), name="status")
        p.expect_exit(2, timeout=20)
        assert p.stdout == ""
        assert p.stderr == (
            f"zmqps: error: --chief {ps}: that is ps 0, not the chief (pass the chief's"
            " address: the cluster spec's chief, --chief-host)\n"
        ), p.stderr
    server.send(signal.SIGTERM)
    server.expect_exit(143, timeout=20)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_standalone_ps_names_the_signal_and_stops_at_once(procs: Reaper, sig: int) -> None:
    """A PS holding no variables has nothing to serve on for: Ctrl-C ends it in a
    moment (it waited the whole 8 s grace), its log names the signal it got, and its
    exit code says it (128 + the signal: no chief shut it down)."""
    chief, ps, worker = addresses(3)
    hosts = ["--chief-host", chief, "--ps-hosts", ps, "--worker-hosts", worker]
    p = procs.spawn([script("zmqps-server"), *hosts, "--role", "ps", "--index", "0"], name="ps")
    wait_for(lambda: "serving on" in p.stderr, 30, what="the PS to serve")
    started = time.monotonic()
    p.send(sig)
    p.expect_exit(128 + sig, timeout=20)
    assert time.monotonic() - started < 2.0, p.tail()
    name = signal.Signals(sig).name
    assert f"ps 0: {name}; stopping (no variables here yet)" in p.stderr, p.tail()


@pytest.mark.parametrize("command", ["zmqps", "zmqps-server", "zmqps-worker"])
def test_version(command: str) -> None:
    from zmqps.version import __version__

    done = subprocess.run(
        [script(command), "--version"], capture_output=True, text=True, timeout=30
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{command} {__version__}\n", "")


ABBREVIATED = {
    # --epochs 0: should --worker ever be taken for --workers again, nothing starts
    "launch": (
        ["zmqps", "launch", "--worker", "3", "--epochs", "0"],
        "zmqps launch: error: unrecognized arguments: --worker 3; did you mean --workers?",
    ),
    "keygen": (
        ["zmqps", "keygen", "keys", "--work", "3"],
        "zmqps keygen: error: unrecognized arguments: --work 3; did you mean --workers?",
    ),
    "server": (
        ["zmqps-server", "--heartbeat", "3"],
        "zmqps-server: error: unrecognized arguments: --heartbeat 3;"
        " did you mean --heartbeat-timeout?",
    ),
    "worker": (
        ["zmqps-worker", "--connect", "3"],
        "zmqps-worker: error: unrecognized arguments: --connect 3; did you mean --connect-timeout?",
    ),
    "program": (
        ["zmqps", "--verb", "status", "--chief", "127.0.0.1:1"],
        "zmqps: error: unrecognized arguments: --verb; did you mean --verbose?",
    ),
}


@pytest.mark.parametrize("case", ABBREVIATED)
def test_no_prefix_matching_of_flags(case: str, tmp_path: Path) -> None:
    """``--worker 3`` is a mistake, not ``--workers 3``: exit 2 before anything runs, the
    command that refused it named, and the flag it was probably meant as."""
    (command, *args), message = ABBREVIATED[case]
    done = subprocess.run(
        [script(command), *args], capture_output=True, text=True, timeout=30, cwd=tmp_path
    )
    assert done.returncode == 2, done.stderr
    # one line: the error and where to look (not the whole usage block ahead of it)
    prog = message.split(": error:")[0]
    assert done.stderr.splitlines() == [f"{message} (see {prog} -h)"], done.stderr
    assert not (tmp_path / "keys").exists()


def test_verbose_after_the_subcommand() -> None:
    """``zmqps launch ... -v`` is ``zmqps -v launch ...`` (it was an unrecognized argument)."""
    done = subprocess.run(
        zmqps_cmd("launch", "--epochs", "0", "-v"), capture_output=True, text=True, timeout=30
    )
    assert (done.returncode, done.stderr) == (2, "zmqps: error: --epochs must be >= 1\n")
    # -v brings the traceback of a runtime failure, wherever it is given, and adds up
    (chief,) = addresses(1)
    status = ["status", "--chief", chief, "--timeout", "0.2"]
    for argv in (["-v", *status], [*status, "-v"]):
        done = subprocess.run(zmqps_cmd(*argv), capture_output=True, text=True, timeout=30)
        assert done.returncode == 1, done.stderr
        assert "\nTraceback (most recent call last):\n" in done.stderr, done.stderr
        assert done.stderr.splitlines()[-1].startswith("zmqps.wire.errors.DeadlineExceeded: ")
    from zmqps.cli.main import _build

    for argv in (["-v", *status, "-vv"], ["-vv", *status, "-v"]):
        args = _build().parse_args(argv)
        assert args.verbose + args.sub_verbose == 3


@pytest.mark.timeout(60)
def test_top_ends_with_one_line_when_the_cluster_is_gone(procs: Reaper) -> None:
    """It went on redrawing "Connection refused" for ever after the run ended."""
    from helpers import free_ports

    chief, ps, worker = addresses(3)
    (port,) = free_ports(1)
    hosts = ["--chief-host", chief, "--ps-hosts", ps, "--worker-hosts", worker]
    metrics = ["--metrics-port", str(port)]
    server = procs.spawn([script("zmqps-server"), *hosts, "--role", "ps", *metrics], name="ps")
    wait_for(lambda: "serving on" in server.stderr, 30, what="the PS to serve")
    url = f"http://127.0.0.1:{port}/metrics"
    top = procs.spawn(zmqps_cmd("top", url, "--interval", "0.2"), name="top")
    wait_for(lambda: "requests/s" in top.stdout, 30, what="a view with the PS")
    server.send(signal.SIGTERM)
    server.expect_exit(143, timeout=20)  # stopped by a signal, not by a chief
    # never reached (started now, it waits out its 5 s while the first one does): exit
    # 1, one line
    never = procs.spawn(zmqps_cmd("top", url, "--interval", "0.5"), name="never")
    top.expect_exit(0, timeout=20)
    assert top.stdout.splitlines()[-1].startswith(
        "zmqps top: the cluster is gone: none of its 1 target answered for 5s ("
    ), top.tail()
    assert top.stderr == ""
    never.expect_exit(1, timeout=20)
    assert never.stderr.startswith(
        f"zmqps: error: top: none of the 1 target ever answered (5s; {url}: "
    ), never.tail()
    assert len(never.stderr.splitlines()) == 1
