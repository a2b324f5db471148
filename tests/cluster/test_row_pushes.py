"""Worker.push_rows_async against a real chief and PS: a row push on its way while the
next pull goes out reads as a push that was waited for (async mode), whatever the
caller does with its arrays meanwhile; a refusal as not finite is skipped as
``push_rows`` skips it."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import Proc, Reaper, addresses, zmqps_cmd

from zmqps import VariableDef, Worker
from zmqps.wire.errors import InvalidArgument, ShutdownError

LR = 0.5


def _chief_and_ps(procs: Reaper, *flags: str) -> tuple[str, list[Proc]]:
    """A chief (no model of its own, SGD at ``LR``) and one PS, for one worker: the
    chief's address and both processes."""
    chief, ps, worker = addresses(3)
    spec = json.dumps({"cluster": {"chief": [chief], "ps": [ps], "worker": [worker]}})
    base = ["server", "--cluster", spec]
    job = ["--model", "none", "--optimizer", "sgd", "--lr", str(LR), "--heartbeat-timeout", "30"]
    return chief, [
        procs.spawn(zmqps_cmd(*base, "--role", "chief", *job, *flags), name="chief"),
        procs.spawn(zmqps_cmd(*base, "--role", "ps", "--index", "0"), name="ps"),
    ]


@pytest.mark.timeout(120)
def test_push_rows_async_in_order_with_the_next_pull(procs: Reaper, tmp_path: Path) -> None:
    # the one refused step does not fail the run
    chief, servers = _chief_and_ps(procs, "--num-shards", "3", "--max-nonfinite-share", "1")
    w = Worker(chief, index=0, timeout=30, connect_timeout=30)
    try:
        w.create_variables([VariableDef("emb", (90, 4), sparse=True)])
        want = np.zeros((90, 4), np.float32)
        rng = np.random.default_rng(0)
        ids = np.empty(20, np.int64)
        grads = np.empty((20, 4), np.float32)
        pending = None
        for _ in range(12):
            ids[:] = rng.integers(0, 90, 20)  # refilled in place every step
            ids[:2] = [0, 89]  # the first and the last row, every step
            got = w.pull_rows("emb", ids)  # sent after the last push: reads it
            np.testing.assert_allclose(got, want[ids], rtol=1e-6, atol=1e-7)
            if pending is not None:
                assert pending.result() is True
            grads[:] = rng.standard_normal((20, 4)).astype(np.float32)
            summed = np.zeros_like(want)
            np.add.at(summed, ids, grads)
            want -= np.float32(LR) * summed
            pending = w.push_rows_async("emb", ids, grads)
            grads[:] = np.nan  # the push holds nothing of the caller's arrays
            ids[:] = 1
        assert pending is not None and pending.result() is True
        np.testing.assert_allclose(w.pull_rows("emb", np.arange(90)), want, rtol=1e-5, atol=1e-6)
        # a refused push: skipped and counted, as push_rows does it
        bad = np.full((1, 4), np.inf, np.float32)
        assert w.push_rows_async("emb", np.array([3]), bad).result() is False
        assert w.nonfinite == 1
        np.testing.assert_allclose(w.pull_rows("emb", [3])[0], want[3], rtol=1e-5, atol=1e-6)
    finally:
        w.close("done")
    for p in servers:  # the run ends with its one worker done
        assert p.wait(60) == 0


@pytest.mark.timeout(120)
def test_push_pull_rows_reads_its_push_on_two_ps(procs: Reaper, tmp_path: Path) -> None:
    """Worker.push_pull_rows against a real chief and two PS: one message a step to
    each PS; the rows it brings read its push (a fixed-size table against numpy, a
    hash-keyed one against the rows it read before); a refusal as not finite is
    skipped as push_rows skips it, and the rows still come."""
    chief, ps0, ps1, worker = addresses(4)
    spec = json.dumps({"cluster": {"chief": [chief], "ps": [ps0, ps1], "worker": [worker]}})
    base = ["server", "--cluster", spec]
    flags = ["--lr", str(LR), "--num-shards", "5", "--heartbeat-timeout", "30"]
    flags += ["--max-nonfinite-share", "1"]
    servers = [
        procs.spawn(
            zmqps_cmd(*base, "--role", "chief", "--model", "none", "--optimizer", "sgd", *flags),
            name="chief",
        ),
        *(
            procs.spawn(zmqps_cmd(*base, "--role", "ps", "--index", str(i)), name=f"ps{i}")
            for i in (0, 1)
        ),
    ]
    w = Worker(chief, index=0, timeout=30, connect_timeout=30)
    try:
        w.create_variables(
            [
                VariableDef("emb", (90, 4), sparse=True),
                VariableDef("tab", (64, 3), sparse=True, table={"row_budget": 1000}),
            ]
        )
        assert {s.ps for s in w.client.placement.shards_of("emb")} == {0, 1}
        want = np.zeros((90, 4), np.float32)
        known: dict[int, np.ndarray] = {}
        rng = np.random.default_rng(1)
        ids = rng.integers(0, 90, 20)
        keys = rng.integers(-(2**50), 2**50, 9)
        np.testing.assert_allclose(w.pull_rows("emb", ids), want[ids])
        for k, row in zip(keys.tolist(), w.pull_rows("tab", keys), strict=True):
            known[k] = row
        for _ in range(8):
            grads = rng.standard_normal((20, 4)).astype(np.float32)
            nxt = rng.integers(0, 90, 20)
            nxt[:2] = [0, 89]
            summed = np.zeros_like(want)
            np.add.at(summed, ids, grads)
            want -= np.float32(LR) * summed
            got = w.push_pull_rows("emb", ids, grads, nxt)
            np.testing.assert_allclose(got, want[nxt], rtol=1e-5, atol=1e-6)
            ids = nxt
            # the hash-keyed table: ids repeated, ids new to it
            g = rng.standard_normal((keys.size, 3)).astype(np.float32)
            for k, row in zip(keys.tolist(), g, strict=True):
                known[k] = known[k] - np.float32(LR) * row
            nxt_keys = np.concatenate([keys[:3], keys[:1], rng.integers(-(2**50), 2**50, 5)])
            got = w.push_pull_rows("tab", keys, g, nxt_keys)
            for k, row in zip(nxt_keys.tolist(), got, strict=True):
                if k in known:
                    np.testing.assert_allclose(row, known[k], rtol=1e-5, atol=1e-6)
                known[k] = row
            keys = nxt_keys
        sent = w.client.push_counts
        assert sum(c["applied"] for c in sent.values()) == sum(c["sent"] for c in sent.values())
        assert w.client.rows_both == {0, 1}
        # every row of the table reads the updates, the rows no pull read included
        np.testing.assert_allclose(w.pull_rows("emb", np.arange(90)), want, rtol=1e-5, atol=1e-6)
        # a refused push: skipped and counted; the rows are read all the same
        bad = np.full((ids.size, 4), np.inf, np.float32)
        got = w.push_pull_rows("emb", ids, bad, np.arange(90))
        assert w.nonfinite == 1
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    finally:
        w.close("done")
    for p in servers:
        assert p.wait(60) == 0


@pytest.mark.timeout(120)
def test_a_sync_step_that_leaves_a_variable_out_is_refused_not_held_for_ever(
    procs: Reaper, tmp_path: Path
) -> None:
    """A sync push that left out a dense variable (or pushed nothing) was reported
    applied and held the step, and every worker with it, for ever: each shard waits for
    N gradients. A dense push lacking one is refused before it is sent; a step whose
    pushes left out a table (a dense push and no row push at all, too) is refused at
    the next ``begin_step``, every time: the worker cannot go on, and its leave lets
    the others."""
    chief, servers = _chief_and_ps(procs, "--num-shards", "2", "--mode", "sync")
    w = Worker(chief, index=0, timeout=30, connect_timeout=30)
    try:
        # an empty model, created, held the cluster: every later creation was refused
        with pytest.raises(InvalidArgument, match="no variables given"):
            w.create_variables([])
        # named as unknown (the wire's schema said "missing field 'lr'")
        with pytest.raises(InvalidArgument, match="unknown optimizer 'zzz'; known: adagrad"):
            w.create_variables([VariableDef("x", (2,))], optimizer={"name": "zzz"})
        w.create_variables(
            [
                VariableDef("kernel", (8, 2)),
                VariableDef("bias", (2,)),
                VariableDef("emb", (40, 4), sparse=True),
                VariableDef("emb2", (40, 4), sparse=True),
            ]
        )
        g = {"kernel": np.ones((8, 2), np.float32), "bias": np.ones(2, np.float32)}
        ids, rows = np.array([1, 2]), np.ones((2, 4), np.float32)
        for lacking, grads in (("bias", {"kernel": g["kernel"]}), ("kernel, bias", {})):
            assert w.begin_step() == 0
            with pytest.raises(InvalidArgument, match=f"this one lacks {lacking} "):
                w.push(grads)
        # other values than a gradient's, refused before anything is sent (complex lost
        # its imaginary part, bool became 0 / 1, a negative count lowered the examples)
        for bad, why in (
            ({**g, "bias": np.ones(2, np.complex64)}, "gradient for bias: complex64 values"),
            ({**g, "kernel": np.ones((8, 2), bool)}, "gradient for kernel: bool values"),
        ):
            with pytest.raises(InvalidArgument, match=why):
                w.push(bad)
        with pytest.raises(InvalidArgument, match=r"examples: a count .* got -5"):
            w.push(g, examples=-5)
        # one name as a string: that variable (its characters were taken for names)
        np.testing.assert_array_equal(w.pull("bias")["bias"], np.zeros(2))
        for name in ("emb", "emb2"):
            assert w.push_rows(name, ids, rows)
        assert w.push(g)  # step 0, whole: applied
        assert w.begin_step() == 1
        np.testing.assert_allclose(w.pull()["bias"], -LR * np.ones(2), rtol=1e-6)
        assert w.begin_step() == 1
        assert w.push(g)  # a dense push, and no row push at all (or some tables only)
        for _ in range(2):  # refused, not held: the worker cannot go on
            with pytest.raises(InvalidArgument, match="step 1's pushes left out emb, emb2: ev"):
                w.begin_step()
    finally:
        w.close("error")  # its work unfinished: the run waits for it, until stopped
    # used after its close: one line (a raw "Event loop is closed" came, and a warning)
    with pytest.raises(ShutdownError, match="is closed: nothing more can be sent"):
        w.pull()
    servers[0].send(signal.SIGTERM)
    assert servers[0].wait(60) == 128 + signal.SIGTERM
    assert servers[1].wait(60) == 0  # shut down by the chief


@pytest.mark.timeout(120)
def test_a_sync_step_held_by_a_live_worker_ends_the_run_at_the_stall_timeout(
    procs: Reaper,
) -> None:
    """A worker alive (its heartbeats come) that never pushes its step, as one stuck in
    its own code or a client that pushed part of a step: the step, and every other
    worker, waited for ever, since a step waiting on a live worker counted as work under
    way. Past ``--stall-timeout`` the run ends failed (exit code 3), naming it."""
    stall = 6.0
    chief, servers = _chief_and_ps(
        procs, "--num-shards", "2", "--mode", "sync", "--stall-timeout", str(stall)
    )
    w = Worker(chief, index=0, timeout=30, connect_timeout=30)
    try:
        w.create_variables([VariableDef("kernel", (8, 2)), VariableDef("bias", (2,))])
        g = {"kernel": np.ones((8, 2), np.float32), "bias": np.ones(2, np.float32)}
        assert w.begin_step() == 0
        assert w.push(g)
        assert w.begin_step() == 1  # and stuck in step 1: its heartbeats go on
        started = time.monotonic()
        code = servers[0].wait(stall + 45)
        took = time.monotonic() - started
    finally:
        w.close("error")
    assert code == 3, servers[0].tail()
    assert stall <= took <= stall + 30, took
    assert "step 1 waits on worker 0 (alive" in servers[0].stderr, servers[0].tail()
    assert f"--stall-timeout {stall:g}" in servers[0].stderr, servers[0].tail()
    assert servers[1].wait(60) == 0  # shut down by the chief
