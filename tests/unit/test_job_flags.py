"""Tasks started by hand must agree on the job: a worker sends its job flags when it
registers; the chief refuses one of another cluster layout or model, naming both
values, and warns once per worker and flag about the differences that run (sans-IO:
the comparison, the chief's register op, the worker's session against an older
chief)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from test_chief import call, make_env, run, who

from zmqps.config import ClusterSpec
from zmqps.roles.agreement import REFUSED, WARNED, compare, job_flags, refusal
from zmqps.roles.job import JobConfig
from zmqps.roles.worker.session import Session
from zmqps.wire import Message
from zmqps.wire import ops as o
from zmqps.wire.errors import EXIT_CONFIG, ConfigError, NotFound, ProtocolError

CLUSTER = ClusterSpec(
    chief="127.0.0.1:7000", ps=("127.0.0.1:7100",), worker=("127.0.0.1:7200", "127.0.0.1:7201")
)
JOB = JobConfig(epochs=2)


def test_same_flags_agree() -> None:
    flags = job_flags(CLUSTER, JOB, "async")
    assert flags["--ps-hosts"] == "127.0.0.1:7100"
    assert flags["--worker-hosts"] == "127.0.0.1:7200,127.0.0.1:7201"
    assert (flags["--model"], flags["--hidden"], flags["--epochs"]) == ("mlp", "128", "2")
    assert (flags["--optimizer"], flags["--lr"], flags["--momentum"]) == ("momentum", "0.05", "0.9")
    assert compare(flags, job_flags(CLUSTER, JOB, None)) == []
    assert "--mode" not in job_flags(CLUSTER, JOB, None)  # a worker not given one
    assert "--model" not in job_flags(CLUSTER, None, "sync")  # a chief without a model


def test_another_cluster_layout_is_refused_naming_both_values() -> None:
    two_ps = ClusterSpec(
        chief=CLUSTER.chief, ps=("127.0.0.1:7100", "127.0.0.1:7101"), worker=CLUSTER.worker
    )
    diffs = compare(job_flags(CLUSTER, JOB, "async"), job_flags(two_ps, JOB, None))
    assert [(d.flag, d.refused) for d in diffs] == [("--ps-hosts", True)]
    assert refusal(1, diffs) == (
        "the chief refuses worker 1, started for another run: --ps-hosts: the chief's is"
        " 127.0.0.1:7100, this worker's 127.0.0.1:7100,127.0.0.1:7101 (every task of a run"
        " takes the same cluster spec)"
    )


def test_a_long_value_off_the_wire_is_cut_in_the_lines_that_show_it() -> None:
    """A worker's values come off the wire (up to 64 KiB each): a refusal or warning
    shows 300 characters of each and says how long it was."""
    flags = job_flags(CLUSTER, JOB, None)
    flags["--ps-hosts"] = "x" * 60_000
    flags["--epochs"] = "9" * 1_000
    diffs = compare(job_flags(CLUSTER, JOB, "async"), flags)
    line = refusal(1, diffs)
    assert line is not None and len(line) < 1_000, line
    assert "x" * 300 + "... (60000 characters)" in line
    (warned,) = [d for d in diffs if not d.refused]
    text = warned.warning(1)
    assert len(text) < 600 and "... (1000 characters)" in text, text


def test_what_is_refused_and_what_is_warned_about() -> None:
    chief = job_flags(CLUSTER, JOB, "async")
    other = JobConfig(
        model="mlp",
        hidden=(64,),
        batch_size=64,
        epochs=300,
        optimizer={"name": "sgd", "lr": 0.1},
        seed=7,
    )
    diffs = {d.flag: d for d in compare(chief, job_flags(CLUSTER, other, "sync"))}
    refused = {f for f, d in diffs.items() if d.refused}
    warned = {f for f, d in diffs.items() if not d.refused}
    assert refused == {"--hidden", "--optimizer", "--lr", "--seed"}
    assert warned == {"--mode", "--batch-size", "--epochs"}
    assert set(REFUSED).isdisjoint(WARNED)
    assert diffs["--epochs"].warning(1) == (
        "worker 1 runs with --epochs 300, the chief with --epochs 2: the worker's wins (it"
        " trains that many passes over its own data)"
    )
    assert "the chief's wins" in diffs["--mode"].why
    # the refusal names every refused flag, each with both values
    line = refusal(0, list(diffs.values()))
    assert line is not None
    for flag in refused:
        assert (
            f"{flag}: the chief's is {diffs[flag].chief}, this worker's {diffs[flag].worker}"
            in line
        )
    assert refusal(0, [diffs["--epochs"]]) is None


def test_flags_one_side_does_not_know_are_not_compared() -> None:
    chief = job_flags(CLUSTER, JOB, "async")
    assert compare(chief, {"--epochs": "2", "--from-a-newer-zmqps": "x"}) == []
    assert compare({"--ps-hosts": "a:1"}, {"--epochs": "9"}) == []


def _chief(**cfg: Any) -> Any:
    return make_env(1, 2, job=JobConfig(epochs=2), **cfg)


def test_the_chief_refuses_a_worker_of_another_cluster_layout() -> None:
    async def body() -> None:
        env = _chief()
        two_ps = ClusterSpec(
            chief=env.cfg.cluster.chief,
            ps=(*env.cfg.cluster.ps, "127.0.0.1:7999"),
            worker=env.cfg.cluster.worker,
        )
        flags = job_flags(two_ps, JobConfig(epochs=2), None)
        with pytest.raises(ConfigError, match=r"^the chief refuses worker 1, started for another"):
            await call(env.chief, "register", who(1, job=flags))
        assert 1 not in env.chief.members.workers

    run(body())


def test_the_chief_warns_once_per_worker_and_flag(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        env = _chief()
        flags = job_flags(env.cfg.cluster, JobConfig(epochs=300), "sync")
        for incarnation in (1, 1, 2):  # a retry, a new incarnation: said once
            for i in (0, 1):
                await call(env.chief, "register", who(i, incarnation, job=flags))
        assert sorted(env.chief.members.workers) == [0, 1]  # both run

    with caplog.at_level(logging.WARNING, logger="zmqps.chief"):
        run(body())
    lines = [r.getMessage() for r in caplog.records]
    assert sorted(lines) == [
        "worker 0 runs with --epochs 300, the chief with --epochs 2: the worker's wins"
        " (it trains that many passes over its own data)",
        "worker 0 runs with --mode sync, the chief with --mode async: the chief's wins"
        " (workers follow the chief's mode)",
        "worker 1 runs with --epochs 300, the chief with --epochs 2: the worker's wins"
        " (it trains that many passes over its own data)",
        "worker 1 runs with --mode sync, the chief with --mode async: the chief's wins"
        " (workers follow the chief's mode)",
    ]


def test_a_worker_that_sends_no_flags_is_not_compared(caplog: pytest.LogCaptureFixture) -> None:
    """An older worker (no ``job`` field) registers as before."""

    async def body() -> None:
        env = _chief()
        await call(env.chief, "register", who(0))
        assert 0 in env.chief.members.workers

    with caplog.at_level(logging.WARNING, logger="zmqps.chief"):
        run(body())
    assert caplog.records == []


def test_the_register_body_carries_the_flags_and_an_older_schema_refuses_them() -> None:
    flags = job_flags(CLUSTER, JOB, None)
    body = o.Register(o.Who("worker", 0, 1), 10, job=flags).to_wire()
    o.Register.SCHEMA.check(body, "register body")
    assert o.Register.from_wire(body).job == flags
    assert "job" not in o.Register(o.Who("worker", 0, 1), 10).to_wire()
    older = o.Map(
        {k: v for k, v in o.Register.SCHEMA.required.items()},
        {k: v for k, v in o.Register.SCHEMA.optional.items() if k != "job"},
    )
    with pytest.raises(ProtocolError, match="unknown field 'job'"):
        older.check(body, "register body")


class _OlderChief:
    """A chief of an older zmqps: its register schema does not know ``job``."""

    endpoint = "127.0.0.1:7000"

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def request(self, op: str, body: Any = None, *_: Any, **__: Any) -> Message:
        assert op == "register"
        self.bodies.append(dict(body))
        if "job" in body:
            raise ProtocolError("register body: unknown field 'job'")
        info = o.ClusterInfo(ps=("127.0.0.1:7100",), mode="async", heartbeat_interval=1.0)
        return Message("ok", body=info.to_wire())


def test_a_worker_registers_with_an_older_chief_without_its_flags() -> None:
    chief = _OlderChief()
    session = Session(chief, o.Who("worker", 0, 1), job={"--epochs": "3"})  # type: ignore[arg-type]
    info = asyncio.run(asyncio.wait_for(session.open(5.0), 5.0))
    assert info.ps == ("127.0.0.1:7100",)
    assert ["job" in b for b in chief.bodies] == [True, False]
    asyncio.run(asyncio.wait_for(session._register(5.0), 5.0))  # again: without at once
    assert ["job" in b for b in chief.bodies] == [True, False, False]


def test_another_protocol_error_is_not_taken_for_an_older_chief() -> None:
    class _Broken(_OlderChief):
        async def request(self, op: str, body: Any = None, *_: Any, **__: Any) -> Message:
            raise ProtocolError("register body: missing field 'role'")

    session = Session(_Broken(), o.Who("worker", 0, 1), job={"--epochs": "3"})  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="missing field"):
        asyncio.run(asyncio.wait_for(session.open(5.0), 5.0))


def test_a_worker_pointed_at_a_ps_says_so() -> None:
    """A worker whose chief address was a PS's ended with "a PS does not serve
    'register'" (exit 1): it is a configuration mistake, said as one (exit 2)."""
    from zmqps.roles.optable import OpTable

    class _PS(_OlderChief):
        async def request(self, op: str, body: Any = None, *_: Any, **__: Any) -> Message:
            return OpTable("a PS", {})(Message(op, 1, "worker:0", body))  # type: ignore[return-value]

    session = Session(_PS(), o.Who("worker", 0, 1))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"127\.0\.0\.1:7000 is a PS's, not the chief's"):
        asyncio.run(asyncio.wait_for(session.open(5.0), 5.0))


class _RestartedChief:
    """A chief restarted with other flags: it knows no task, and refuses this one's."""

    endpoint = "127.0.0.1:7000"

    async def request(self, op: str, body: Any = None, *_: Any, **__: Any) -> Message:
        if op == "heartbeat":
            raise NotFound("worker 0 is not registered")
        assert op == "register" and "job" in body
        raise ConfigError("the chief refuses worker 0, started for another run: --model: ...")


def test_a_worker_refused_when_it_registers_again_stops_with_exit_code_2() -> None:
    """Its heartbeats' task ended on the refusal, and the worker trained on without
    heartbeats (the chief counting it dead) instead of stopping."""
    stops: list[tuple[str, int]] = []
    session = Session(
        _RestartedChief(),  # type: ignore[arg-type]
        o.Who("worker", 0, 1),
        job={"--model": "mlp"},
        on_stop=lambda reason, code: stops.append((reason, code)),
    )

    async def go() -> None:
        session.start_heartbeats(0.01)
        assert session._heartbeats is not None
        await asyncio.wait_for(session._heartbeats, 5.0)

    asyncio.run(go())
    assert stops == [
        ("the chief refuses worker 0, started for another run: --model: ...", EXIT_CONFIG)
    ]
