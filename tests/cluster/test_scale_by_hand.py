"""``zmqps scale`` as a user runs it, on a cluster started by hand (zmqps-server /
zmqps-worker, one process per task, digits MLP, async).

2 PS -> ``zmqps scale --ps 1 --wait 30``: ps1's state moves to ps0, ps1 is drained and
exits 0 by itself, training goes on. ps1 started again by hand with the same flags ->
``zmqps scale --ps 2 --wait 30``: a state moves back, ``zmqps scale --json`` shows both
PS serving. The chief's metrics say the same. The run ends with exit 0 for every task,
and scores as the same run without scaling, started alongside it, within a loose bound.
``zmqps scale --ps 5`` on a spec of 2 PS fails with one line, no traceback.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    Proc,
    Reaper,
    addresses,
    chief_status,
    free_ports,
    read_json,
    script,
    wait_for,
    zmqps_cmd,
)
from prometheus_client.parser import text_string_to_metric_families

#: 2 workers, 46 steps an epoch between them: about 30 s of training with the baseline
#: alongside on 2 busy cores; the scales (each a Python process starting, ps1 too, whose
#: first copy waits for its kernels) are done about 15 s in (the test checks that they
#: were done before the end)
EPOCHS = 160
JOB = ["--model", "mlp", "--epochs", str(EPOCHS)]


def scale(chief: str, *flags: str, wait: float = 0.0) -> subprocess.CompletedProcess[str]:
    argv = zmqps_cmd("scale", "--chief", chief, "--timeout", "10", *flags)
    if wait:
        argv += ["--wait", f"{wait:g}"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=wait + 30)


def scale_json(chief: str, *flags: str, wait: float = 0.0) -> dict[str, Any]:
    out = scale(chief, "--json", *flags, wait=wait)
    assert out.returncode == 0, out.stdout + out.stderr
    return dict(json.loads(out.stdout))


def global_step(chief: str) -> int:
    st = chief_status(chief)
    return -1 if st is None else int(st.get("global_step") or 0)


def scrape(port: int) -> dict[str, float]:
    """The chief's metrics: ``name{label="v"}`` -> value."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


class Cluster:
    """A chief, 2 PS and 2 workers started by hand with the classic flags."""

    def __init__(self, procs: Reaper, tmp: Path, name: str, metrics_port: int) -> None:
        self.chief, ps0, ps1, w0, w1 = addresses(5)
        hosts = ["--chief-host", self.chief, "--ps-hosts", f"{ps0},{ps1}"]
        hosts += ["--worker-hosts", f"{w0},{w1}"]
        self.summary = tmp / f"{name}-summary.json"
        server, worker = script("zmqps-server"), script("zmqps-worker")
        chief = [server, *hosts, "--role", "chief", *JOB, "--summary", str(self.summary)]
        chief += ["--metrics-port", str(metrics_port)]
        self.chief_p = procs.spawn(chief, name=f"{name}-chief")
        self.ps = [
            procs.spawn([server, *hosts, "--role", "ps", "--index", str(i)], name=f"{name}-ps{i}")
            for i in (0, 1)
        ]
        self.workers = [
            procs.spawn(
                [worker, *hosts, "--role", "worker", "--index", str(i), *JOB],
                name=f"{name}-worker{i}",
            )
            for i in (0, 1)
        ]

    def tasks(self) -> list[Proc]:
        return [self.chief_p, *self.ps, *self.workers]


@pytest.mark.timeout(120)
def test_scale_down_and_up_by_hand(procs: Reaper, tmp_path: Path) -> None:
    port, base_port = free_ports(2)
    run = Cluster(procs, tmp_path, "scaled", port)
    base = Cluster(procs, tmp_path, "baseline", base_port)
    chief = run.chief
    total = 46 * EPOCHS
    # a scale beyond the spec (asked as the cluster starts): one line, no traceback,
    # an operator's mistake as --ps 0 is (exit code 2; it said 1)
    beyond = procs.spawn(zmqps_cmd("scale", "--chief", chief, "--ps", "5"), name="scale-5")
    wait_for(lambda: global_step(chief) >= 50, 40, what="step 50", interval=0.2)
    beyond.expect_exit(2, timeout=20)
    assert beyond.stdout == ""
    err = beyond.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("zmqps: error:") and "5 PS asked for" in err and "names 2" in err, err

    # 2 -> 1: ps1's state moves to ps0; ps1, left without states, exits 0 by itself
    one = scale_json(chief, "--ps", "1", wait=30)
    assert one["serving"] == [0] and one["asked"] == [0], one
    assert (one["moves_done"], one["moves_failed"]) == (1, 0), one
    run.ps[1].expect_exit(0, timeout=30)
    assert "drained" in run.chief_p.stderr
    at_exit = global_step(chief)
    wait_for(lambda: global_step(chief) > at_exit + 20, 30, what="training after the drain")
    m = scrape(port)
    assert (m["zmqps_ps_serving"], m["zmqps_ps_asked"], m["zmqps_ps_drained"]) == (1, 1, 1), m
    assert m['zmqps_ps_moves_total{outcome="done"}'] == 1, m
    assert m["zmqps_ps_moved_bytes_total"] == one["moved_bytes"] > 0, m
    assert m["zmqps_placement_epoch"] == one["epoch"] >= 1, m

    # ps1 started again by hand, same flags, while training goes on on ps0: a PS that
    # left and is started again joins on its own (no longer drained, asked for again)
    again = procs.spawn(run.ps[1].argv, name="scaled-ps1-again")
    joins = "ps 1 answers and serves nothing: it joins"
    wait_for(lambda: joins in run.chief_p.stderr, 30, what="ps1 joining again")
    wait_for(lambda: "scaling to 2 PS: ps 0, 1" in run.chief_p.stderr, 10, what="the ask")
    m = scrape(port)
    assert (m["zmqps_ps_asked"], m["zmqps_ps_drained"]) == (2, 0), m

    # 1 -> 2 asked too (as a user would): a state moves back onto ps1, once
    two = scale_json(chief, "--ps", "2", wait=30)
    assert two["serving"] == [0, 1] and two["asked"] == [0, 1], two
    assert (two["moves_done"], two["moves_failed"]) == (2, 0), two
    step = global_step(chief)
    assert 0 < step < total, f"the run was over ({step} of {total}) when it was scaled back"
    where = scale_json(chief)  # no --ps: where the states are
    assert where["serving"] == [0, 1] and where["moving"] is None and where["drained"] == [], where
    assert where["epoch"] > one["epoch"], where
    m = scrape(port)
    assert (m["zmqps_ps_serving"], m["zmqps_ps_asked"], m["zmqps_ps_drained"]) == (2, 2, 0), m
    assert m['zmqps_ps_moves_total{outcome="done"}'] == 2, m
    assert m['zmqps_ps_moves_total{outcome="failed"}'] == 0, m
    assert m["zmqps_ps_move_in_progress"] == 0, m
    assert m["zmqps_placement_epoch"] == where["epoch"], m

    for task in [*run.tasks(), again, *base.tasks()]:
        if task is not run.ps[1]:
            task.expect_exit(0, timeout=60)
    scaled, baseline = read_json(run.summary), read_json(base.summary)
    assert scaled["global_step"] == baseline["global_step"] == total, (scaled, baseline)
    # (what the chief said of any restore, to tell why: the summary's "restores" alone
    # said nothing of its cause)
    said = [ln for ln in run.chief_p.stderr.splitlines() if " W " in ln or " E " in ln]
    assert not scaled.get("restores"), (scaled.get("recoveries"), said)
    assert not baseline.get("restores"), baseline.get("recoveries")
    assert scaled["elastic"]["moves"] == 2 and scaled["elastic"]["serving"] == [0, 1], scaled
    # the moves cost nothing the model learns: as good as the run left alone (async:
    # the two differ run to run by about a point of accuracy)
    assert baseline["test_accuracy"] >= 0.9, baseline
    assert scaled["test_accuracy"] >= baseline["test_accuracy"] - 0.04, (scaled, baseline)
    assert scaled["test_loss"] <= baseline["test_loss"] * 1.5 + 0.05, (scaled, baseline)
    assert "restoring" not in run.chief_p.stderr
    assert "moved from ps 1 to ps 0" in run.chief_p.stderr
    assert "moved from ps 0 to ps 1" in run.chief_p.stderr
