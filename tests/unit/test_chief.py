"""ChiefService with in-memory PS (FakeNetwork + PSService): variables, placement, membership.

The service is driven by handler messages built with ``zmqps.wire.request`` (and, in one
test, through the fake transport so the real codec and body schemas are exercised).
Time is a fake clock; every test runs inside ``asyncio.run`` with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from zmqps.config import ClusterSpec
from zmqps.core.partition import Partitioner, greedy_by_bytes, plan, round_robin
from zmqps.core.variables import Placement, VariableDef
from zmqps.roles.checkpointer import Checkpointer
from zmqps.roles.chief import ChiefConfig, ChiefService
from zmqps.roles.client import ParameterClient
from zmqps.roles.configs import CheckpointPolicy, SyncConfig
from zmqps.roles.job import JobConfig
from zmqps.roles.ps import PSService
from zmqps.roles.status import format_status
from zmqps.transport.base import TransportStats
from zmqps.transport.fake import FakeNetwork
from zmqps.wire import Message, decode, encode, request
from zmqps.wire import ops as o
from zmqps.wire.errors import (
    ConfigError,
    DeadlineExceeded,
    FencedError,
    InvalidArgument,
    NotReady,
    ProtocolError,
)

T = TypeVar("T")

CHIEF = "127.0.0.1:7000"
SGD = {"name": "sgd", "lr": 0.1}
VARS = (
    VariableDef("w", (12, 4), init={"name": "glorot_uniform", "seed": 1}),
    VariableDef("b", (5,), init={"name": "zeros"}),
    VariableDef("emb", (30, 2), init={"name": "normal", "seed": 2}, sparse=True),
)


def run(coro: Awaitable[T], timeout: float = 5.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def spec(num_ps: int, num_workers: int) -> ClusterSpec:
    return ClusterSpec(
        chief=CHIEF,
        ps=tuple(f"127.0.0.1:{7100 + i}" for i in range(num_ps)),
        worker=tuple(f"127.0.0.1:{7200 + i}" for i in range(num_workers)),
    )


@dataclass
class Env:
    net: FakeNetwork
    cfg: ChiefConfig
    chief: ChiefService
    clock: Clock
    services: list[PSService] = field(default_factory=list)
    stats: list[TransportStats] = field(default_factory=list)

    def created(self) -> list[int]:
        """create_shards requests each PS served."""
        return [s.by_op.get("create_shards", 0) for s in self.stats]

    def serve(self, i: int) -> None:
        svc = PSService(i)
        self.services[i] = svc
        self.stats[i] = self.net.serve(self.cfg.cluster.ps[i], svc, name=f"ps{i}")


def make_env(
    num_ps: int = 2,
    num_workers: int = 2,
    *,
    serve: Sequence[int] | None = None,
    **cfg: Any,
) -> Env:
    """Must be called inside a running loop (services create asyncio.Event objects)."""
    cluster = spec(num_ps, num_workers)
    cfg.setdefault("partitioner", Partitioner(num_shards=2))
    cfg.setdefault("optimizer", dict(SGD))
    config = ChiefConfig(bind=f"tcp://{CHIEF}", cluster=cluster, **cfg)
    net = FakeNetwork()
    clients = [net.client(addr, "chief:0") for addr in cluster.ps]
    clock = Clock()
    env = Env(net, config, ChiefService(config, clients, clock=clock), clock)
    env.services = [PSService(i) for i in range(num_ps)]
    env.stats = [TransportStats() for _ in range(num_ps)]
    for i in range(num_ps) if serve is None else serve:
        env.serve(i)
    return env


async def call(chief: ChiefService, op: str, body: dict[str, Any] | None = None) -> Message:
    out = chief(request(op, body, sender="test"))
    if inspect.isawaitable(out):
        out = await out
    assert isinstance(out, Message)
    return out


def who(index: int, incarnation: int = 0, **extra: Any) -> dict[str, Any]:
    return {"role": "worker", "index": index, "incarnation": incarnation, **extra}


def store_ids(env: Env) -> list[list[int]]:
    return [svc.store.ids() for svc in env.services]


def expected_ids(placement: Placement, num_ps: int) -> list[list[int]]:
    return [sorted(s.id for s in placement.shards if s.ps == i) for i in range(num_ps)]


# ---------------------------------------------------------------- create_variables


def test_create_variables_places_shards_on_the_ps() -> None:
    async def body() -> None:
        env = make_env(3)
        assert not env.chief.placement_ready.is_set()
        placement = await env.chief.create_variables(VARS, SGD)
        assert env.chief.placement is placement
        assert env.chief.placement_ready.is_set()
        assert placement.variables == VARS
        assert dict(placement.optimizer) == SGD
        assert len(placement.shards) == 6  # Partitioner(num_shards=2), three variables
        assert store_ids(env) == expected_ids(placement, 3)
        assert env.created() == [1, 1, 1]
        for svc in env.services:
            for shard in svc.store:
                assert dict(shard.definition.optimizer) == SGD

    run(body())


def test_create_variables_is_idempotent() -> None:
    async def body() -> None:
        env = make_env(2)
        first = await env.chief.create_variables(VARS, SGD)
        again = await env.chief.create_variables(list(VARS), dict(SGD))
        assert again is first
        # the same definitions built afresh (another worker asking) give the same placement
        fresh = tuple(VariableDef.from_wire(v.to_wire()) for v in VARS)
        assert await env.chief.create_variables(fresh, {"lr": 0.1, "name": "sgd"}) is first
        rep = await call(env.chief, "create_vars", {"variables": [v.to_wire() for v in VARS]})
        assert Placement.from_wire(rep.body["placement"]) == first  # config optimizer = SGD
        assert env.created() == [1, 1]  # the PS were asked once

        # a PS asked again (a restarted chief does this) keeps its state
        client = ParameterClient(
            [env.net.client(a, "w") for a in env.cfg.cluster.ps], first, worker="w", incarnation=0
        )
        await client.push({"b": np.ones(5, np.float32)}, pull=True)
        by_ps: dict[int, list[dict[str, Any]]] = {}
        for ps, d in first.shard_defs():
            by_ps.setdefault(ps, []).append(d.to_wire())
        for ps, defs in by_ps.items():
            await env.net.client(env.cfg.cluster.ps[ps], "chief:1").request(
                "create_shards", {"shards": defs}
            )
        params = await client.pull()
        np.testing.assert_allclose(params["b"], -0.1)
        assert client.global_step == 1

    run(body())


@pytest.mark.parametrize(
    ("variables", "optimizer", "what"),
    [
        (
            (*VARS[:2], VariableDef("emb", (31, 2), init=VARS[2].init, sparse=True)),
            SGD,
            "emb: shape (30, 2) -> (31, 2)",
        ),
        (
            (*VARS[:2], VariableDef("emb", (30, 2), init={"name": "normal", "seed": 3})),
            SGD,
            "emb: init ",
        ),
        (
            (*VARS[:2], VariableDef("emb", (30, 2), "float64", VARS[2].init, sparse=True)),
            SGD,
            "emb: dtype 'float32' -> 'float64'",
        ),
        (
            (*VARS[:2], VariableDef("emb", (30, 2), init=VARS[2].init)),
            SGD,
            "emb: sparse True -> False",
        ),
        (VARS[:2], SGD, "the cluster's emb not asked for"),
        ((*VARS, VariableDef("x", (3,))), SGD, "x not in the cluster"),
        (tuple(reversed(VARS)), SGD, "the same variables in another order"),
        (VARS, {"name": "sgd", "lr": 0.2}, "{'lr': 0.1, 'name': 'sgd'} -> {'lr': 0.2, 'name'"),
        (VARS, {"name": "adam", "lr": 0.1}, "-> {'lr': 0.1, 'name': 'adam'}"),
        (
            (VARS[0], VARS[1].with_optimizer({"name": "adam", "lr": 0.1}), VARS[2]),
            SGD,
            f"{VARS[1].name}: optimizer None -> ",
        ),
    ],
)
def test_create_with_different_definitions_is_refused(
    variables: tuple[VariableDef, ...], optimizer: dict[str, Any], what: str
) -> None:
    """Refused, saying what differs (it named every variable the cluster holds, which
    with thousands said nothing of why)."""

    async def body() -> None:
        env = make_env(2)
        first = await env.chief.create_variables(VARS, SGD)
        with pytest.raises(InvalidArgument, match="different definitions") as err:
            await env.chief.create_variables(variables, optimizer)
        assert what in str(err.value), str(err.value)
        assert env.chief.placement is first
        assert env.created() == [1, 1]
        assert store_ids(env) == expected_ids(first, 2)
        # and through the handler, the error is raised for the dispatcher to turn into a reply
        with pytest.raises(InvalidArgument):
            await call(
                env.chief,
                "create_vars",
                {"variables": [v.to_wire() for v in variables], "optimizer": optimizer},
            )

    run(body())


BAD_OPTIMIZERS = [
    {"name": "nope", "lr": 0.1},
    {"name": "sgd"},  # no lr
    {"name": "sgd", "lr": -1.0},
    {"name": "adam", "lr": 0.1, "beta1": 1.5},
    {"name": "momentum", "lr": 0.1, "momentum": 2.0},
    {"name": "sgd", "lr": 0.1, "momentum": 0.9},  # a key sgd does not take
]
BAD_INITS = [
    {"name": "nope"},
    {"name": "normal", "stddev": -1.0},
    {"name": "uniform", "low": 1.0, "high": 0.0},
    {"name": "zeros", "stddev": 1.0},
    {"name": "normal", "seed": "x"},
]


def _assert_nothing_created(env: Env) -> None:
    assert env.chief.placement is None
    assert env.chief.variables._creating is None
    assert not env.chief.placement_ready.is_set()
    assert env.created() == [0] * len(env.services)
    assert all(len(svc.store) == 0 for svc in env.services)


@pytest.mark.parametrize("optimizer", BAD_OPTIMIZERS)
def test_invalid_optimizer_creates_nothing(optimizer: dict[str, Any]) -> None:
    async def body() -> None:
        env = make_env(2)
        with pytest.raises(InvalidArgument):
            await env.chief.create_variables(VARS, optimizer)
        own = (VARS[0], VariableDef("b", (5,), optimizer=optimizer), VARS[2])
        with pytest.raises(InvalidArgument):
            await env.chief.create_variables(own, SGD)
        _assert_nothing_created(env)
        # nothing is stuck: a valid request still works
        assert (await env.chief.create_variables(VARS, SGD)).variables == VARS

    run(body())


@pytest.mark.parametrize("init", BAD_INITS)
def test_invalid_initializer_creates_nothing(init: dict[str, Any]) -> None:
    async def body() -> None:
        env = make_env(2)
        bad = (VARS[0], VariableDef("b", (5,), init=init), VARS[2])
        with pytest.raises(InvalidArgument):
            await env.chief.create_variables(bad, SGD)
        _assert_nothing_created(env)
        assert (await env.chief.create_variables(VARS, SGD)).variables == VARS

    run(body())


def test_unplannable_variables_create_nothing() -> None:
    async def body() -> None:
        env = make_env(2)
        with pytest.raises(InvalidArgument, match="duplicate"):
            await env.chief.create_variables((VARS[0], VARS[0]), SGD)
        _assert_nothing_created(env)
        assert (await env.chief.create_variables(VARS, SGD)).variables == VARS

        env = make_env(2, placement="nope")
        with pytest.raises(InvalidArgument, match="unknown placement"):
            await env.chief.create_variables(VARS, SGD)
        _assert_nothing_created(env)

    run(body())


def test_concurrent_create_variables_make_one_placement() -> None:
    async def body() -> None:
        env = make_env(3)
        msg = call(env.chief, "create_vars", {"variables": [v.to_wire() for v in VARS]})
        rep, *placements = await asyncio.gather(
            msg, *(env.chief.create_variables(VARS, SGD) for _ in range(5))
        )
        assert isinstance(rep, Message)
        assert all(p is placements[0] for p in placements)
        assert Placement.from_wire(rep.body["placement"]) == placements[0]
        assert env.created() == [1, 1, 1]
        assert store_ids(env) == expected_ids(placements[0], 3)

    run(body())


def test_concurrent_create_with_different_definitions() -> None:
    async def body() -> None:
        env = make_env(2)
        other = (VariableDef("z", (4,)),)
        first, second, third = await asyncio.gather(
            env.chief.create_variables(VARS, SGD),
            env.chief.create_variables(other, SGD),
            env.chief.create_variables(VARS, SGD),
            return_exceptions=True,
        )
        assert isinstance(first, Placement) and third is first
        assert isinstance(second, InvalidArgument)
        assert env.chief.placement is first
        assert env.created() == [1, 1]

    run(body())


def test_a_built_in_jobs_chief_defines_the_model_whatever_comes_first() -> None:
    """A worker's create_vars that reaches a built-in job's chief before the chief
    created its own variables waits for them and is checked against them: a worker of
    another model is refused, it never defines the cluster's model."""

    async def body() -> None:
        env = make_env(2, job=JobConfig())
        other = (VariableDef("z", (4,)),)
        early = asyncio.ensure_future(
            call(
                env.chief,
                "create_vars",
                {"variables": [v.to_wire() for v in other], "optimizer": SGD},
            )
        )
        await asyncio.sleep(0.05)
        assert not early.done() and env.created() == [0, 0]  # waits for the chief's own
        first = await env.chief.create_variables(VARS, SGD)  # the chief, data loaded
        with pytest.raises(InvalidArgument, match="different definitions"):
            await early
        assert env.chief.placement is first
        # the same model as the chief's is answered with the chief's placement
        rep = await call(
            env.chief,
            "create_vars",
            {"variables": [v.to_wire() for v in VARS], "optimizer": SGD},
        )
        assert Placement.from_wire(rep.body["placement"]) == first

    run(body())


# ---------------------------------------------------------------- PS that never answers


def test_ps_that_never_answers_fails_with_not_ready() -> None:
    async def body() -> None:
        env = make_env(2, serve=[0], startup_timeout=0.2)
        t0 = time.monotonic()
        with pytest.raises(NotReady, match="ps 1"):
            await env.chief.create_variables(VARS, SGD)
        elapsed = time.monotonic() - t0
        assert 0.2 <= elapsed < 1.5
        assert env.chief.placement is None
        assert not env.chief.placement_ready.is_set()
        with pytest.raises(NotReady):
            await call(env.chief, "get_placement", {"wait": 0.01})
        # once the PS is up, a new attempt succeeds; PS 0 receives its shards again, harmlessly
        env.serve(1)
        placement = await env.chief.create_variables(VARS, SGD)
        assert store_ids(env) == expected_ids(placement, 2)
        assert env.created() == [2, 1]

    run(body())


def test_create_vars_message_fails_with_not_ready_when_no_ps_answers() -> None:
    async def body() -> None:
        env = make_env(1, serve=[], startup_timeout=0.05)
        with pytest.raises(NotReady):
            await call(env.chief, "create_vars", {"variables": [v.to_wire() for v in VARS]})
        assert env.chief.placement is None

    run(body())


# ---------------------------------------------------------------- get_placement


def test_get_placement_waits_for_creation() -> None:
    async def body() -> None:
        env = make_env(2)
        waiter = asyncio.ensure_future(call(env.chief, "get_placement", {"wait": 3.0}))
        await asyncio.sleep(0.02)
        assert not waiter.done()
        placement = await env.chief.create_variables(VARS, SGD)
        rep = await asyncio.wait_for(waiter, 1.0)
        assert Placement.from_wire(rep.body["placement"]) == placement
        # afterwards it answers at once, with or without wait
        rep = await call(env.chief, "get_placement")
        assert Placement.from_wire(rep.body["placement"]) == placement

    run(body())


def test_get_placement_not_ready_when_never_created() -> None:
    async def body() -> None:
        env = make_env(2)
        with pytest.raises(NotReady):
            await call(env.chief, "get_placement")  # no wait
        t0 = time.monotonic()
        with pytest.raises(NotReady):
            await call(env.chief, "get_placement", {"wait": 0.1})
        assert 0.09 <= time.monotonic() - t0 < 1.0

    run(body())


# ---------------------------------------------------------------- membership over messages


def test_register_heartbeat_leave() -> None:
    async def body() -> None:
        env = make_env(2, num_workers=2, heartbeat_interval=0.5)
        await env.chief.start()  # the PS answer, hold nothing: a fresh cluster
        rep = await call(env.chief, "register", who(0, 7, steps_planned=10))
        assert rep.body == {
            "ps": list(env.cfg.cluster.ps),
            "placement": None,
            "global_step": 0,
            "mode": "async",
            "heartbeat_interval": 0.5,
            "gen": 0,
            "recovering": False,
            "steps_done": 0,
            "last_step": -1,
            "finished": False,
        }
        placement = await env.chief.create_variables(VARS, SGD)
        rep = await call(env.chief, "register", who(1, 3))
        assert Placement.from_wire(rep.body["placement"]) == placement

        env.clock.now += 1.0
        rep = await call(env.chief, "heartbeat", who(0, 7, step=4, loss=0.5, examples=128))
        assert rep.body == {
            "global_step": 4,
            "stop": False,
            "gen": 0,
            "recovering": False,
            "finished": False,
            "ps_down": [],
        }
        rep = await call(env.chief, "heartbeat", who(1, 3, step=2))
        assert rep.body["global_step"] == 6
        w0 = env.chief.members.workers[0]
        assert (w0.step, w0.loss, w0.examples, w0.last_seen) == (4, 0.5, 128, 101.0)

        rep = await call(env.chief, "leave", who(0, 7, step=5, reason="done", examples=160))
        assert rep.body == {"global_step": 7}
        assert not env.chief.all_done.is_set()
        rep = await call(env.chief, "leave", who(1, 3, step=2))  # reason defaults to "done"
        assert rep.body == {"global_step": 7}
        assert env.chief.all_done.is_set()
        assert env.chief.members.workers[1].left_reason == "done"
        assert env.chief.members.all_done_at == 101.0

    run(body())


def test_a_workers_counts_past_any_run_are_refused_and_the_sums_stay_int64() -> None:
    """A heartbeat saying 2**63 - 1 steps (in range for an int64 on the wire) used to
    become the chief's global step for good, past what its own replies may carry:
    every worker then failed on the chief's answer and the checkpoints named that
    step could not be resumed. A task's counts are bounded on the wire, and the sums
    the chief makes of them stay an int64 whatever the incarnations add up to."""

    def sent(op: str, body: dict[str, Any]) -> None:
        decode([bytes(memoryview(f)) for f in encode(request(op, body, sender="x"))])

    async def body() -> None:
        env = make_env(1, num_workers=1)
        await call(env.chief, "register", who(0, 1))
        for field_ in ("step", "examples", "nonfinite"):
            extra = {"step": 1, field_: 2**63 - 1}
            for op in ("heartbeat", "leave"):
                with pytest.raises(ProtocolError, match=field_):
                    sent(op, who(0, 1, **extra))  # what the chief's decoder answers
            sent("heartbeat", who(0, 1, **{**extra, field_: 2**48}))
        for op, key in (("register", "steps_done"), ("register", "steps_planned")):
            with pytest.raises(ProtocolError, match=key):
                sent(op, who(0, 1, **{key: 2**48 + 1}))
        with pytest.raises(ProtocolError, match="steps"):
            sent("fence", {"worker": "worker:0", "inc": 1, "left": True, "steps": 2**63 - 1})
        assert env.chief.global_step == 0
        rep = await call(env.chief, "heartbeat", who(0, 1, step=2**48, examples=2**48))
        assert rep.body["global_step"] == 2**48
        env.chief.consistency.step_offset = 2**63 - 10  # a restored run's, say
        rep = await call(env.chief, "heartbeat", who(0, 1, step=2**48))
        assert rep.body["global_step"] == 2**63 - 1
        encode(rep)  # a reply the codec (and every worker) takes
        for inc in range(2, 40):  # incarnations add up; the sums say "at least"
            await call(env.chief, "register", who(0, inc))
            await call(env.chief, "heartbeat", who(0, inc, step=2**48, examples=2**48))
        assert env.chief.members.examples <= 2**63 - 1
        assert (await call(env.chief, "status")).body["global_step"] == 2**63 - 1

    run(body())


def test_an_ssp_clock_past_any_run_is_refused() -> None:
    """An ssp worker's clock is a count it reports of itself, as a heartbeat's step:
    ``completed`` = 2**63 - 1 (in range for an int64 on the wire) made the chief's
    global step 2**62 for good, in every reply and the status."""

    def sent(body: dict[str, Any]) -> None:
        decode([bytes(memoryview(f)) for f in encode(request("ssp_clock", body, sender="x"))])

    async def body() -> None:
        env = make_env(1, num_workers=2, sync=SyncConfig(mode="ssp", max_staleness=2))
        for i in range(2):
            await call(env.chief, "register", who(i, 1))
        for completed in (2**63 - 1, 2**48 + 1):
            with pytest.raises(ProtocolError, match="completed"):
                sent(who(0, 1, completed=completed, wait=0.0))  # what the decoder answers
        sent(who(0, 1, completed=2**48, wait=0.0))
        rep = await call(env.chief, "ssp_clock", who(0, 1, completed=1, wait=0.0))
        assert rep.body == {"slowest": 0} and env.chief.global_step == 1

    run(body())


def test_a_flood_of_leaves_and_registrations_writes_a_line_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """20,000 evaluator leaves (no registration needed) used to write 20,000 chief log
    lines; a role other than worker or evaluator counted as an evaluator, whose last
    evaluation a finished run waits for."""

    def sent(op: str, body: dict[str, Any]) -> None:
        decode([bytes(memoryview(f)) for f in encode(request(op, body, sender="x"))])

    async def body() -> None:
        env = make_env(1, num_workers=1)
        with caplog.at_level(logging.INFO, "zmqps.chief"):
            for i in range(2000):
                ev = {"role": "evaluator", "index": i % 100, "incarnation": i}
                await call(env.chief, "leave", {**ev, "step": 0, "reason": "x\n" * 100})
            for inc in range(1, 200):
                await call(env.chief, "register", who(0, inc))
                await call(env.chief, "leave", who(0, inc, step=1))
        lines = [r for r in caplog.records if r.name == "zmqps.chief"]
        assert len(lines) <= 10, [r.getMessage()[:80] for r in lines]
        for role in ("snowman", "chief", "ps", "", "worker "):
            with pytest.raises(ProtocolError, match="role"):
                sent("register", {"role": role, "index": 0, "incarnation": 1})
        assert not env.chief.evaluator_heard

    run(body())


def test_a_new_incarnation_of_an_evaluator_replaces_the_old_one() -> None:
    """An evaluator killed at the end and started again: its new incarnation evaluated
    and left, yet the run waited ~40 s more for the dead one to fall silent."""

    async def body() -> None:
        env = make_env(1, num_workers=1)
        ev = {"role": "evaluator", "index": 0}
        await call(env.chief, "register", {**ev, "incarnation": 1})
        await call(env.chief, "register", {**ev, "incarnation": 2})
        assert env.chief.live_evaluators() == [(0, 2)]
        await call(env.chief, "leave", {**ev, "incarnation": 2, "step": 0})
        assert env.chief.live_evaluators() == []

    run(body())


def test_register_of_other_roles_is_not_membership() -> None:
    async def body() -> None:
        env = make_env(1, num_workers=1)
        rep = await call(env.chief, "register", {"role": "evaluator", "index": 0, "incarnation": 0})
        assert rep.body["ps"] == list(env.cfg.cluster.ps)
        assert env.chief.members.workers == {}

    run(body())


def test_rejoin_and_fencing_over_messages() -> None:
    async def body() -> None:
        env = make_env(1, num_workers=1)
        await call(env.chief, "register", who(0, 1))
        await call(env.chief, "heartbeat", who(0, 1, step=9))
        rep = await call(env.chief, "register", who(0, 2))  # restarted process
        assert rep.body["global_step"] == 9  # never goes back
        with pytest.raises(FencedError):
            await call(env.chief, "heartbeat", who(0, 1, step=10))
        with pytest.raises(FencedError):
            await call(env.chief, "register", who(0, 1))
        with pytest.raises(FencedError):
            await call(env.chief, "leave", who(0, 1, step=10))
        assert not env.chief.all_done.is_set()
        with pytest.raises(InvalidArgument):
            await call(env.chief, "register", who(1, 0))  # only one worker in the cluster
        rep = await call(env.chief, "heartbeat", who(0, 2, step=1))
        assert rep.body["global_step"] == 10

    run(body())


def test_all_done_only_when_every_worker_left() -> None:
    async def body() -> None:
        env = make_env(1, num_workers=3)
        for i in range(3):
            await call(env.chief, "register", who(i))
        await call(env.chief, "leave", who(0, step=1))
        await call(env.chief, "leave", who(2, step=1))
        assert not env.chief.all_done.is_set()
        # a dead worker does not end the job
        env.clock.now += 1000.0
        assert env.chief.members.dead(env.clock()) == [1]
        assert not env.chief.all_done.is_set()
        await call(env.chief, "register", who(1, 1))  # comes back
        await call(env.chief, "leave", who(1, 1, step=3, reason="out of data"))
        assert env.chief.all_done.is_set()
        assert env.chief.status()["global_step"] == 5

    run(body())


async def finished_run(num_ps: int, num_workers: int, steps: int, **leave: Any) -> Env:
    """A started chief with variables whose workers all registered and left (done)."""
    env = make_env(num_ps, num_workers=num_workers)
    await env.chief.start()
    await env.chief.create_variables(VARS, SGD)
    for i in range(num_workers):
        await call(env.chief, "register", who(i))
        await call(env.chief, "leave", who(i, step=steps, **leave))
    assert env.chief.all_done.is_set()
    return env


def test_a_chief_started_after_every_worker_finished_ends_the_run() -> None:
    # a chief that crashed at the end of a run (every worker gone, its work done) and
    # was restarted: nobody will leave again, so it must end the run on its own
    async def body() -> None:
        env = await finished_run(2, 2, steps=4)
        clients = [env.net.client(addr, "chief:0") for addr in env.cfg.cluster.ps]
        restarted = ChiefService(env.cfg, clients, clock=env.clock)
        await restarted.start()
        assert restarted.all_done.is_set()
        assert restarted.status()["global_step"] == 8

    run(body())


def test_status() -> None:
    async def body() -> None:
        env = make_env(2, num_workers=3, heartbeat_timeout=10.0)
        # before it heard the PS, a (restarted) chief knows no step, and says so
        assert env.chief.status()["step_known"] is False
        assert "not known yet" in format_status(env.chief.status())
        await env.chief.start()
        st = env.chief.status()
        assert st["step_known"] is True
        assert st["role"] == "chief"
        assert st["mode"] == "async"
        assert (st["global_step"], st["steps_planned"], st["examples"]) == (0, 0, 0)
        assert st["workers_expected"] == 3
        assert (st["workers_alive"], st["workers_dead"], st["workers"]) == ([], [], [])
        assert st["ps"] == list(env.cfg.cluster.ps)
        assert (st["variables"], st["shards"]) == (0, 0)
        assert st["uptime_s"] >= 0

        await env.chief.create_variables(VARS, SGD)
        await call(env.chief, "register", who(0, steps_planned=20))
        await call(env.chief, "register", who(1, steps_planned=30))
        await call(env.chief, "register", who(2))
        env.clock.now += 5.0
        await call(env.chief, "heartbeat", who(0, step=6, loss=1.25, examples=192))
        await call(env.chief, "leave", who(2, step=2, examples=64))
        env.clock.now += 6.0  # worker 1 last seen 11 s ago: dead
        st = env.chief.status()
        assert (st["global_step"], st["steps_planned"], st["examples"]) == (8, 50, 256)
        assert st["workers_alive"] == [0]
        assert st["workers_dead"] == [1]
        assert [(w["index"], w["state"], w["step"]) for w in st["workers"]] == [
            (0, "alive", 6),
            (1, "dead", 0),
            (2, "done", 2),
        ]
        assert st["workers"][0]["loss"] == 1.25
        assert st["workers"][1]["last_seen_s"] == 11.0
        assert (st["variables"], st["shards"]) == (3, 6)
        rep = await call(env.chief, "status")
        assert rep.body == {
            **st,
            "uptime_s": rep.body["uptime_s"],
            "waiting_on": [],  # async: no step waits on anyone
            "blocker": None,  # worker 0 trains: nothing holds it back
        }

    run(body())


def test_ping_shutdown_and_unknown_op() -> None:
    async def body() -> None:
        env = make_env(1, num_workers=1)
        assert (await call(env.chief, "ping")).body == {"role": "chief", "index": 0}
        with pytest.raises(ProtocolError, match="does not serve"):
            await call(env.chief, "pull", {"shards": [0]})
        assert not env.chief.shutdown_requested.is_set()
        await call(env.chief, "shutdown", {"reason": "test"})
        assert env.chief.shutdown_requested.is_set()

    run(body())


def test_through_the_fake_transport() -> None:
    """The same conversation as a worker has it: encoded, decoded, schema-checked."""

    async def body() -> None:
        env = make_env(2, num_workers=1)
        env.net.serve(CHIEF, env.chief, name="chief")
        chief = env.net.client(CHIEF, "worker:0")
        rep = await chief.request("register", who(0, 5, steps_planned=3))
        assert rep.body["placement"] is None
        rep = await chief.request(
            "create_vars", {"variables": [v.to_wire() for v in VARS], "optimizer": SGD}
        )
        placement = Placement.from_wire(rep.body["placement"])
        assert placement == env.chief.placement
        rep = await chief.request("get_placement", {"wait": 1.0})
        assert Placement.from_wire(rep.body["placement"]) == placement
        with pytest.raises(InvalidArgument):  # typed on the client side
            await chief.request("create_vars", {"variables": [VARS[0].to_wire()]})
        await chief.request("heartbeat", who(0, 5, step=2, loss=0.1))
        with pytest.raises(FencedError):
            await chief.request("heartbeat", who(0, 4, step=2))
        with pytest.raises(ProtocolError):  # body schema: step is required
            await chief.request("heartbeat", who(0, 5))
        await chief.request("leave", who(0, 5, step=3, reason="done"))
        assert env.chief.all_done.is_set()
        st = (await chief.request("status")).body
        assert st["global_step"] == 3

    run(body())


# ---------------------------------------------------------------- placement policy


SIZED = tuple(
    VariableDef(name, (rows,), init={"name": "ones"})
    for name, rows in [("a", 100), ("b", 10), ("c", 10), ("d", 10), ("e", 80)]
)


@pytest.mark.parametrize(
    ("policy", "expected"), [("round_robin", round_robin), ("greedy", greedy_by_bytes)]
)
def test_placement_policy_is_honored(policy: str, expected: Any) -> None:
    async def body() -> None:
        env = make_env(2, placement=policy, partitioner=Partitioner(num_shards=1))
        placement = await env.chief.create_variables(SIZED, SGD)
        sizes = [v.nbytes for v in SIZED]
        want = expected(sizes, 2)
        assert [s.ps for s in placement.shards] == want
        assert store_ids(env) == expected_ids(placement, 2)
        loads = [sum(sz for sz, p in zip(sizes, want, strict=True) if p == i) for i in (0, 1)]
        if policy == "round_robin":
            assert want == [0, 1, 0, 1, 0]
            assert loads == [760, 80]
        else:
            assert want == [0, 1, 1, 0, 1]
            assert loads == [440, 400]
        assert [svc.store.nbytes() for svc in env.services] == loads  # sgd: no slots

    run(body())


def test_a_rejoining_worker_is_fenced_on_every_ps_at_registration() -> None:
    async def body() -> None:
        env = make_env(2, num_workers=2)
        await env.chief.create_variables(VARS, SGD)
        await call(env.chief, "register", who(0, 7))
        await call(env.chief, "register", who(0, 9))  # a new incarnation of worker 0
        for svc in env.services:
            assert svc.dedup.incarnation("worker:0") == 9
            with pytest.raises(FencedError):
                svc.dedup.check("worker:0", 7, 1)

    run(body())


def test_a_worker_registers_only_once_every_ps_answered_its_fence() -> None:
    """Where a new incarnation resumes needs what every PS applied from the old one:
    with a PS paused (silent), registering is refused (NotReady: the worker registers
    again), never answered with a resume point that leaves that PS out."""

    async def body() -> None:
        env = make_env(2, num_workers=2)
        await env.chief.create_variables(VARS, SGD)
        await call(env.chief, "register", who(0, 7))
        paused = env.cfg.cluster.ps[1]
        env.net.remove(paused)
        with pytest.raises(NotReady, match=f"ps {paused} did not answer the fence of worker:0"):
            await call(env.chief, "register", who(0, 9))
        assert env.services[0].dedup.incarnation("worker:0") == 9  # told already
        env.net.serve(paused, env.services[1], name="ps1")  # continued
        await call(env.chief, "register", who(0, 9))
        for svc in env.services:
            assert svc.dedup.incarnation("worker:0") == 9

    run(body())


def test_the_end_of_a_run_keeps_asking_a_silent_ps_to_shut_down() -> None:
    """A PS cut off (a partition) when the run ends is told once it can be reached
    again, within three heartbeat timeouts (at most 30 s): it must not serve an ended
    run for ever. The client resends on each deadline and when the connection is back."""
    from zmqps.roles.chief.serve import SHUTDOWN_ATTEMPT_S, _shutdown_ps, shutdown_attempts

    assert shutdown_attempts(2.5) == 2  # the fault harness's heartbeat timeout: 10 s
    assert shutdown_attempts(10.0) == 6  # the default: 30 s
    assert shutdown_attempts(60.0) == 6  # never more than 30 s
    assert shutdown_attempts(0.1) == 1

    asked: list[tuple[str, float, int]] = []

    class Silent:
        endpoint = "tcp://10.0.0.1:2222"

        async def request(self, op: str, body: Any, *, timeout: float, attempts: int) -> Any:
            asked.append((op, timeout, attempts))
            raise DeadlineExceeded("no reply")

    run(_shutdown_ps([Silent()], heartbeat_timeout=10.0))  # type: ignore[list-item]
    assert asked == [("shutdown", SHUTDOWN_ATTEMPT_S, 6)]
    # a process the chief knows silent (its states failed over: stopped for good, say)
    # is asked once: the end of the run does not wait 30 s on it
    asked.clear()
    run(_shutdown_ps([Silent(), Silent()], 10.0, silent={1}))  # type: ignore[list-item]
    assert sorted(asked) == [
        ("shutdown", SHUTDOWN_ATTEMPT_S, 1),
        ("shutdown", SHUTDOWN_ATTEMPT_S, 6),
    ]


def test_a_drained_ps_started_again_as_the_run_ends_is_shut_down_too() -> None:
    """A PS drained by a scale down (it exited 0) and started again just as the run
    ended (fault schedule seed 9: for the scale back up) was told nothing: the chief
    skipped drained PS at the end, and it waited for a chief for ever. A process that
    answers at a drained PS's address with another boot id is shut down; the process
    drained (same boot id), or none, is left alone."""
    from types import SimpleNamespace

    from zmqps.roles.chief.serve import _shutdown_ps

    asked: list[tuple[int, str]] = []

    class PS:
        def __init__(self, q: int, boot: str | None) -> None:
            self.q, self.boot, self.endpoint = q, boot, f"tcp://10.0.0.{q}:2222"

        async def request(self, op: str, body: Any, *, timeout: float, attempts: int) -> Any:
            asked.append((self.q, op))
            if self.boot is None:
                raise DeadlineExceeded("no reply")
            return SimpleNamespace(body={"boot": self.boot})

    clients = [PS(0, "a"), PS(1, "new"), PS(2, "old"), PS(3, None)]
    run(_shutdown_ps(clients, 10.0, drained={1: "old", 2: "old", 3: "old"}))  # type: ignore[arg-type]
    assert sorted(asked) == [
        (0, "shutdown"),
        (1, "ps_state"),
        (1, "shutdown"),
        (2, "ps_state"),
        (3, "ps_state"),
    ]


def test_a_failed_shutdown_step_is_recorded_and_the_next_ones_run() -> None:
    from zmqps.roles.chief.serve import _cleanly

    async def broken() -> None:
        raise OSError("socket gone")

    async def fine() -> None:
        ran.append("fine")

    ran: list[str] = []
    failed: list[str] = []

    async def body() -> None:
        await _cleanly("server", broken(), failed)
        await _cleanly("client", fine(), failed)

    run(body())
    assert failed == ["server"]
    assert ran == ["fine"]


def test_the_nonfinite_verdict() -> None:
    from zmqps.roles.chief.finish import nonfinite_verdict

    assert nonfinite_verdict(0, 1000, 0.0) == ""
    assert nonfinite_verdict(50, 1000, 0.05) == ""  # at the share: fine
    assert nonfinite_verdict(51, 1000, 0.05).startswith(
        "51 of 1000 steps (5.1%) had non-finite gradients"
    )
    assert nonfinite_verdict(1, 1000, 0.0)  # none allowed
    assert nonfinite_verdict(1000, 1000, 1.0) == ""
    # a step refused and never ended (rows refused, no push after): never past 100 %
    assert nonfinite_verdict(73, 72, 0.5).startswith("73 of 73 steps (100.0%)")


def test_nonfinite_steps_of_every_incarnation_are_counted() -> None:
    async def body() -> None:
        env = make_env(1, num_workers=2, max_nonfinite_share=0.5)
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        await call(env.chief, "register", who(0))
        await call(env.chief, "heartbeat", who(0, step=10, nonfinite=2))
        await call(env.chief, "register", who(0, 1))  # restarted: its count stays
        await call(env.chief, "leave", who(0, 1, step=5, nonfinite=1))
        await call(env.chief, "register", who(1))
        await call(env.chief, "heartbeat", who(1, step=3, nonfinite=1))
        assert env.chief.members.nonfinite == 4
        assert not env.chief.shutdown_requested.is_set() and not env.chief.failure
        # none allowed: the first one heard stops the run
        strict = make_env(1, num_workers=1, max_nonfinite_share=0.0)
        await strict.chief.start()
        await call(strict.chief, "register", who(0))
        await call(strict.chief, "heartbeat", who(0, step=7, nonfinite=1))
        assert strict.chief.shutdown_requested.is_set()
        assert "--max-nonfinite-share is 0" in strict.chief.failure

    run(body())


def test_the_end_waits_for_the_clusters_evaluator_still_starting() -> None:
    """A 2-epoch launch on a loaded machine ended 2 s after the chief began, before the
    evaluator's process was up: the chief gave it three heartbeat intervals and shut
    down; the evaluator then waited for a chief that was gone until the launcher
    stopped it, having scored nothing. The cluster's evaluator never heard is waited
    for until it has been silent a heartbeat timeout since the chief began; it then
    scores the final model and leaves. One that never comes costs that bound alone."""
    from zmqps.roles.chief.serve import _evaluators_done

    ev = {"role": "evaluator", "index": 0, "incarnation": 1}

    def with_evaluator() -> Env:
        env = make_env(1, num_workers=1, heartbeat_interval=0.05, heartbeat_timeout=1.5)
        cluster = replace(env.chief.cfg.cluster, evaluator=("127.0.0.1:7300",))
        env.chief.cfg = replace(env.chief.cfg, cluster=cluster)
        return env

    async def starting_late() -> None:
        env = with_evaluator()
        done = asyncio.ensure_future(_evaluators_done(env.chief))
        await asyncio.sleep(0.5)  # past three heartbeat intervals: up only now
        assert not done.done()
        await call(env.chief, "register", ev)
        await asyncio.sleep(0.3)  # its last evaluation
        assert not done.done()
        await call(env.chief, "leave", {**ev, "step": 0, "reason": "done"})
        await asyncio.wait_for(done, 1.0)

    async def never_started() -> None:
        env = with_evaluator()
        started = time.monotonic()
        await _evaluators_done(env.chief)
        assert 1.0 < time.monotonic() - started < 2.5  # the chief's heartbeat timeout

    run(starting_late())
    run(never_started())


def test_evaluators_kept_are_bounded() -> None:
    from zmqps.roles.chief.service import MAX_EVALUATORS

    async def body() -> None:
        env = make_env(1, num_workers=1, heartbeat_timeout=10.0)
        await env.chief.start()
        ev = {"role": "evaluator"}
        for inc in range(MAX_EVALUATORS + 50):  # a client inventing evaluators
            await call(env.chief, "register", {**ev, "index": inc, "incarnation": inc})
        assert len(env.chief.evaluators) == MAX_EVALUATORS
        assert (MAX_EVALUATORS + 49, MAX_EVALUATORS + 49) in env.chief.evaluators  # the newest
        for inc in range(100):  # incarnations of one: the latest replaces the others
            await call(env.chief, "register", {**ev, "index": 0, "incarnation": 10**5 + inc})
        assert [k for k in env.chief.evaluators if k[0] == 0] == [(0, 10**5 + 99)]
        env.clock.now += 11.0  # all silent past the timeout: forgotten at the next one
        await call(env.chief, "register", {**ev, "index": 0, "incarnation": 10**6})
        assert list(env.chief.evaluators) == [(0, 10**6)]

    run(body())


def test_a_run_that_stands_still_says_in_the_log_what_it_waits_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker that exited with an error left a hand-started run waiting for ever with
    nothing in the chief's log (and the status said every worker left, one was done)."""

    async def body() -> None:
        env = make_env(1, num_workers=2, heartbeat_timeout=10.0)
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        await call(env.chief, "register", who(0))
        await call(env.chief, "register", who(1))
        await call(env.chief, "leave", who(0, step=46, reason="done"))
        await call(env.chief, "leave", who(1, step=0, reason="error"))
        st = (await call(env.chief, "status")).body
        assert st["blocker"] == (
            "no live worker: worker 1 (error) left without finishing its work; waiting for"
            " it to come back (start it again)"
        )
        reporter = asyncio.ensure_future(env.chief.report_waits(every=0.05))
        for _ in range(20):
            await asyncio.sleep(0.01)
            env.clock.now += 0.02
        reporter.cancel()

    with caplog.at_level(logging.WARNING, logger="zmqps.chief"):
        run(body())
    waits = [r.getMessage() for r in caplog.records if "training has waited" in r.getMessage()]
    assert waits and "worker 1 (error) left without finishing its work" in waits[0], waits
    assert len(waits) <= 5  # once per period, not per look


async def _worker_0_done(num_ps: int, planned: int, **cfg: Any) -> Env:
    """A started chief of two workers, each planning ``planned`` steps: worker 0 has
    done them all and left, worker 1 is registered."""
    env = make_env(num_ps, num_workers=2, **cfg)
    await env.chief.start()
    await env.chief.create_variables(VARS, SGD)
    await call(env.chief, "register", who(0, 0, steps_planned=planned))
    await call(env.chief, "register", who(1, 0, steps_planned=planned))
    await call(env.chief, "leave", who(0, 0, step=planned, reason="done"))
    return env


def test_an_async_run_whose_live_workers_push_nothing_ends_at_the_stall_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Async: worker 0 finished, worker 1 is alive (its heartbeats come) and pushes
    nothing, stuck in its own code: no step waits on anyone, so no blocker was named,
    nothing was said, and the run never ended. Standing still, the run now says whom
    it has not heard a push from, and past --stall-timeout ends failed naming them."""

    async def body() -> None:
        env = await _worker_0_done(1, 50, heartbeat_timeout=1e9, stall_timeout=60.0)
        await call(env.chief, "heartbeat", who(1, 0, step=3))
        assert env.chief.blocker(await env.chief.full_status()) is None  # nothing holds it
        watch = asyncio.ensure_future(env.chief.report_waits(look=0.005))
        for _ in range(70):  # 70 s of the chief's clock, its heartbeats still coming
            env.clock.now += 1.0
            await call(env.chief, "heartbeat", who(1, 0, step=3))
            await asyncio.sleep(0.01)
        await asyncio.wait_for(env.chief.shutdown_requested.wait(), 2.0)
        watch.cancel()
        assert "--stall-timeout 60" in env.chief.failure, env.chief.failure
        assert "no push from worker 1 (alive" in env.chief.failure, env.chief.failure

    with caplog.at_level(logging.WARNING, logger="zmqps.chief"):
        run(body())
    waits = [r.getMessage() for r in caplog.records if "training has waited" in r.getMessage()]
    assert waits and "the global step stays at 53: no push from worker 1" in waits[0], waits


def test_a_wait_is_first_said_after_ten_seconds_then_every_thirty(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A chief started with its PS and no worker said nothing for 30 s: the first line
    comes after 10 s of waiting, then one every 30 s."""
    said: list[float] = []

    async def body() -> None:
        env = make_env(1, num_workers=2)
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        reporter = asyncio.ensure_future(env.chief.report_waits(look=0.005))
        start = env.clock.now
        for _ in range(150):  # 75 s of the chief's clock, half a second a look
            n = len([r for r in caplog.records if "training has waited" in r.getMessage()])
            env.clock.now += 0.5
            await asyncio.sleep(0.01)
            if len([r for r in caplog.records if "training has waited" in r.getMessage()]) > n:
                said.append(env.clock.now - start)
        reporter.cancel()

    with caplog.at_level(logging.WARNING, logger="zmqps.chief"):
        run(body())
    waits = [r.getMessage() for r in caplog.records if "training has waited" in r.getMessage()]
    assert "waiting for workers [0, 1] to register" in waits[0], waits
    assert len(said) == 3, said
    assert 10.0 <= said[0] <= 12.0 and 40.0 <= said[1] <= 42.0 and 70.0 <= said[2] <= 72.0, said


def test_a_sync_step_waiting_for_a_worker_never_started_names_it() -> None:
    """Sync, worker 1 of 2 never started: the stall's line said "training starts at
    step 0 (generation 0): the workers take its values", not the worker it waited on."""

    async def body() -> None:
        env = make_env(1, num_workers=2, sync=SyncConfig(mode="sync"))
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        await call(env.chief, "register", who(0))
        why = env.chief.blocker(await env.chief.full_status()) or ""
        assert why.startswith("step 0 waits on worker 0 (alive: "), why
        assert why.endswith(
            ", and on worker 1: never registered, counted among the replicas"
            " a sync step waits for (start it)"
        ), why
        placement = env.chief.placement
        assert placement is not None
        pusher = ParameterClient(
            [env.net.client(a, "worker:0:0") for a in env.cfg.cluster.ps],
            placement,
            worker="worker:0",
            incarnation=0,
            shared_memory=False,
        )
        await call(env.chief, "take_token", who(0, wait=1.0))
        grads = {v.name: np.ones(v.shape, np.float32) for v in VARS}
        await pusher.push(grads, step=0)
        why = env.chief.blocker(await env.chief.full_status()) or ""
        assert why == (
            "step 0 waits on worker 1: never registered, counted among the replicas a sync"
            " step waits for (start it)"
        ), why
        await call(env.chief, "register", who(1))
        assert "never registered" not in (env.chief.blocker(await env.chief.full_status()) or "")

    run(body())


def test_training_that_stands_still_past_the_stall_timeout_ends_the_run_failed() -> None:
    """A worker stopped for ever (its heartbeats stop, its data is not done), or one
    alive that never pushes its step: the run waits for it, says so, and past
    --stall-timeout ends failed, naming what it waited on; a run whose training moves,
    or that is finishing, never does."""

    async def body() -> None:
        env = await _worker_0_done(2, 10, heartbeat_timeout=5.0, stall_timeout=60.0)
        watch = asyncio.ensure_future(env.chief.report_waits(every=0.01))
        env.clock.now += 6.0  # worker 1 is silent past the heartbeat timeout
        await asyncio.sleep(0.05)
        assert "waiting for workers [1] to come back" in env.chief.blocker(
            await env.chief.full_status()
        )
        env.clock.now += 50.0  # 56 s standing still: not yet
        await asyncio.sleep(0.05)
        assert not env.chief.failure and not env.chief.shutdown_requested.is_set()
        env.clock.now += 10.0
        await asyncio.wait_for(env.chief.shutdown_requested.wait(), 2.0)
        watch.cancel()
        assert "stood still" in env.chief.failure and "--stall-timeout 60" in env.chief.failure
        assert "workers [1]" in env.chief.failure
        # the end itself is no stall
        env.chief.failure = ""
        env.chief.shutdown_requested.clear()
        for working in (
            "finishing: the final checkpoint, evaluation and export",
            "stopping (a shutdown was requested)",
        ):
            env.chief._check_stall(1e6, working)
            assert not env.chief.failure, working
        # workers never started, variables never created: past the limit (a chief
        # started with its PS and no worker waited for ever)
        for never in (
            "waiting for workers [1] to register",
            "waiting for the variables to be created",
        ):
            env.chief._check_stall(61.0, never)
            assert never in env.chief.failure
            env.chief.failure = ""
            env.chief.shutdown_requested.clear()
        # a step held by a live worker is (it held a sync run for ever): past the limit
        held = "step 5 waits on worker 1 (alive: heartbeats come, the step's push does not)"
        env.chief._check_stall(59.0, held)
        assert not env.chief.failure
        env.chief._check_stall(61.0, held)
        assert "step 5 waits on worker 1 (alive" in env.chief.failure
        env.chief.failure = ""
        env.chief.shutdown_requested.clear()
        env.chief._check_stall(61.0, "waiting for ps 1 (silent 10s when found) to come back")
        assert "ps 1" in env.chief.failure

    run(body())
    with pytest.raises(ConfigError, match="--stall-timeout must be >= 0"):
        ChiefConfig(bind="tcp://127.0.0.1:1", cluster=spec(1, 1), stall_timeout=-1.0)


def test_a_finished_workers_heartbeat_is_held_until_the_run_ends() -> None:
    """A worker that left done and waits for the run's end sends heartbeats the chief
    may hold (``wait``): each is answered the moment the run finishes (or stops, or
    changes phase), else after at most one heartbeat interval; one is held per
    worker, a newer one answering the older at once; a worker still at work, or one
    that did not ask to wait, is answered at once."""

    async def body() -> None:
        env = await finished_run(1, 2, steps=4, waits=True)
        chief = env.chief
        assert chief.cfg.heartbeat_interval <= 2.0  # the bound of a hold below
        held = asyncio.ensure_future(call(chief, "heartbeat", who(0, step=4, wait=60.0)))
        await asyncio.sleep(0.05)
        assert not held.done()  # nothing changed: held
        # a plain heartbeat of the same worker is answered at once and holds nothing
        at_once = o.HeartbeatReply.parse((await call(chief, "heartbeat", who(0, step=4))).body)
        assert not at_once.finished and not held.done()
        # a newer held heartbeat of worker 0 answers the older one now
        newer = asyncio.ensure_future(call(chief, "heartbeat", who(0, step=4, wait=60.0)))
        older = o.HeartbeatReply.parse((await asyncio.wait_for(held, 1.0)).body)
        assert not older.finished and not newer.done()
        other = asyncio.ensure_future(call(chief, "heartbeat", who(1, step=4, wait=60.0)))
        await asyncio.sleep(0.05)
        assert not other.done() and len(chief._held_beats) == 2  # one per worker
        chief.finished = True  # the run's end answers every held heartbeat at once
        for fut in (newer, other):
            beat = o.HeartbeatReply.parse((await asyncio.wait_for(fut, 1.0)).body)
            assert beat.finished
        assert chief._held_beats == {}
        assert all(w.told_finished for w in chief.members.workers.values())
        # after the end nothing is held
        after = await asyncio.wait_for(call(chief, "heartbeat", who(1, step=4, wait=60.0)), 1.0)
        assert o.HeartbeatReply.parse(after.body).finished

    run(body())


def test_a_held_heartbeat_is_answered_within_one_interval_and_at_a_stop() -> None:
    async def body() -> None:
        env = make_env(1, num_workers=1, heartbeat_interval=0.2)
        chief = env.chief
        await chief.start()
        await chief.create_variables(VARS, SGD)
        await call(chief, "register", who(0))
        await call(chief, "leave", who(0, step=4, waits=True))
        t0 = time.monotonic()
        beat = await asyncio.wait_for(call(chief, "heartbeat", who(0, step=4, wait=60.0)), 5.0)
        assert not o.HeartbeatReply.parse(beat.body).finished
        assert time.monotonic() - t0 < 5.0  # bounded by the interval, not the wait asked
        held = asyncio.ensure_future(call(chief, "heartbeat", who(0, step=4, wait=60.0)))
        await asyncio.sleep(0.02)
        chief.shutdown_requested.set()
        assert o.HeartbeatReply.parse((await asyncio.wait_for(held, 1.0)).body).stop

    run(body())


# ---------------------------------------------------------------- the recovery watch


def test_a_ps_silent_at_the_end_of_the_run_is_waited_for_and_still_watched() -> None:
    """A PS stopped (SIGSTOP) while the chief takes the final checkpoint: the end
    waits for it, in phase finishing, and the PS watch goes on (it used to die of an
    invalid transition, so a PS then restarted empty was never restored)."""
    from zmqps.core.recovery import Event, Phase

    async def body() -> None:
        env = make_env(2, 1, heartbeat_interval=0.05, heartbeat_timeout=0.2)
        rec = env.chief.recovery
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        rec.handle(Event.ALL_DONE)
        watch = asyncio.ensure_future(rec.watch_ps())
        silent = env.net._servers.pop(env.cfg.cluster.ps[1])
        # the watch runs on real time: on a loaded machine it may take more turns
        for _ in range(100):
            env.clock.now += 0.1
            await asyncio.sleep(0.06)
            if set(rec.health.down) == {1}:
                break
        assert not watch.done() and rec.phase is Phase.FINISHING
        assert set(rec.health.down) == {1}
        env.net._servers[env.cfg.cluster.ps[1]] = silent  # SIGCONT
        for _ in range(100):
            env.clock.now += 0.05
            await asyncio.sleep(0.06)
            if not rec.health.down:
                break
        assert not watch.done() and rec.health.down == {}
        watch.cancel()

    run(body())


def test_a_status_at_the_end_of_the_run_asks_the_ps_nothing() -> None:
    """Sync, every worker done: the chief takes the final checkpoint, then shuts the PS
    down. A status in that time asked each PS whom the step waits on, and waited 2 s
    for those already gone; the chief's exit waited with it (fault schedule 715)."""
    from zmqps.core.recovery import Event

    async def body() -> None:
        env = make_env(2, 2, sync=SyncConfig(mode="sync"))
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        await call(env.chief, "register", who(0))
        st = (await call(env.chief, "status")).body
        asked = [s.by_op.get("status", 0) for s in env.stats]
        assert st["waiting_on"] == [0] and asked == [1, 1]  # during the run: each PS asked
        env.chief.recovery.handle(Event.ALL_DONE)
        st = (await call(env.chief, "status")).body
        assert st["waiting_on"] == [] and [s.by_op.get("status", 0) for s in env.stats] == asked
        assert st["blocker"] == "finishing: the final checkpoint, evaluation and export"

    run(body())


def test_the_status_names_where_training_starts_until_its_first_step() -> None:
    """Right after training (re)starts (a restore, a chief's start), before the workers
    have pushed in its generation, the status named nothing (fault schedule 878, draw
    g11: the first status after a restore, in a pause of 9.7 s)."""

    async def body() -> None:
        env = make_env(1, num_workers=1)
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        await call(env.chief, "register", who(0))
        st = (await call(env.chief, "status")).body
        assert st["blocker"] == (
            "training starts at step 0 (generation 0): the workers take its values"
        )
        await call(env.chief, "heartbeat", who(0, step=3))
        assert (await call(env.chief, "status")).body["blocker"] is None

    run(body())


def test_after_a_restore_below_the_step_shown_the_status_names_the_steps_trained_again() -> None:
    """Async and ssp never show a lower global step: after a restore to a checkpoint
    below it, the workers train again the steps after the checkpoint while the step
    shown stands still. The status named nothing then (fault schedule 878, draw g12: a
    chief restart restored every shard to step 927 with 982 shown, and the status
    named no blocker in a pause of 10 s)."""

    async def body() -> None:
        env = make_env(1, num_workers=1)
        rec = env.chief.recovery
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        await call(env.chief, "register", who(0))
        # what a restarted chief shows at first: the step the lost chief had reached
        env.chief.consistency.global_step = 6
        st = (await call(env.chief, "status")).body
        assert (st["global_step"], st["blocker"]) == (6, None)
        await rec.restore_lost([0], env.clock(), "ps 0 restarted")
        step, gen, shown = rec.resumed
        assert (step, shown) == (0, 6) and gen == rec.gen
        st = (await call(env.chief, "status")).body
        again = (
            f"training starts at step 0 (generation {gen}): the workers take its values and"
            " train again the steps after it; the global step stays 6 until they pass it"
        )
        assert (st["global_step"], st["blocker"]) == (6, again)
        # the workers report the steps they train again: the wait is not a stall
        await call(env.chief, "heartbeat", who(0, step=2))
        st = (await call(env.chief, "status")).body
        assert (st["global_step"], st["blocker"]) == (6, again)
        assert env.chief.consistency.counted_step == 2
        await call(env.chief, "heartbeat", who(0, step=7))
        st = (await call(env.chief, "status")).body
        assert (st["global_step"], st["blocker"]) == (7, None)

    run(body())


def test_a_shutdown_during_a_restore_stops_without_restarting_training() -> None:
    """SIGTERM while every PS is being restored: the restore ends and training does not
    start again (handling 'restored' in phase stopping used to raise)."""
    from zmqps.core.recovery import Event, Phase

    async def body() -> None:
        env = make_env(2, 1)
        rec = env.chief.recovery
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        restore_all = rec.restore_all

        async def stopped_meanwhile(*args: Any) -> int:
            step = await restore_all(*args)
            rec.handle(Event.SHUTDOWN)
            return step

        rec.restore_all = stopped_meanwhile  # type: ignore[method-assign]
        await rec.restore_lost([1], env.clock(), "ps 1 restarted")
        assert rec.phase is Phase.STOPPING and rec._training is None
        # a PS lost while the run stops is not restored
        await rec.restore_lost([0], env.clock(), "ps 0 restarted")
        assert rec.phase is Phase.STOPPING and rec.restore_count == 1

    run(body())


def test_a_failing_chief_watcher_ends_the_run_with_its_error() -> None:
    """A background task of the chief that fails (a bug) must not leave the run going
    on without it: the run is cancelled and the error raised."""
    from zmqps.roles.chief.serve import _Watchers

    async def body() -> None:
        watchers = _Watchers()
        cancelled = asyncio.Event()

        async def run_forever() -> bool:
            try:
                await asyncio.Future()
            finally:
                cancelled.set()
            return True

        async def broken() -> None:
            await asyncio.sleep(0.01)
            raise RuntimeError("a bug in a watcher")

        async def quiet() -> None:
            await asyncio.Future()

        watchers.start("quiet one", quiet())
        watchers.start("broken one", broken())
        with pytest.raises(RuntimeError, match="a bug in a watcher"):
            await watchers.unless_one_fails(run_forever())
        assert cancelled.is_set()
        watchers.cancel()
        # a run that ends first is the result; a watcher cancelled is no failure
        ok = _Watchers()
        ok.start("quiet one", quiet())

        async def done() -> bool:
            return True

        assert await ok.unless_one_fails(done()) is True
        ok.cancel()
        await asyncio.sleep(0)
        assert not ok.failed.is_set()

    run(body())


def test_a_worker_that_heard_a_later_placement_epoch_gets_the_placement_past_it() -> None:
    """A chief restarted with the process that alone was told the last placement epoch
    publishes one the workers may have heard already (theirs from the last chief): a
    worker registering again says its epoch, and the placement is published past it,
    so that the worker fetches it instead of keeping its old routes."""

    async def body() -> None:
        env = make_env(2, 1)
        chief = env.chief
        await chief.start()
        await chief.create_variables(VARS, SGD)
        placement = chief.placement
        assert placement is not None
        heard = placement.epoch + 3
        await call(chief, "register", who(0, epoch=heard))
        after = chief.placement
        assert after is not None and after.epoch == heard + 1
        assert after.shards == placement.shards  # only the epoch moved on
        beat = o.HeartbeatReply.parse((await call(chief, "heartbeat", who(0, step=0))).body)
        assert beat.epoch == heard + 1
        # an older or first registration changes nothing
        await call(chief, "register", who(0, incarnation=1, epoch=heard - 5))
        await call(chief, "register", who(0, incarnation=2))
        assert chief.placement is not None and chief.placement.epoch == heard + 1
        # nor one no chief of the run could have published (it would use the epochs up)
        from zmqps.wire.schema import INT64_MAX

        await call(chief, "register", who(0, incarnation=3, epoch=INT64_MAX - 1))
        assert chief.placement is not None and chief.placement.epoch == heard + 1
        # nor the epoch this chief told (its own placement): a client registering in a
        # loop with it moved the epoch on each time, a log line each
        for inc in range(4, 204):
            await call(chief, "register", who(0, incarnation=inc, epoch=heard + 1))
        assert chief.placement is not None and chief.placement.epoch == heard + 1

    run(body())


def test_a_worker_of_a_cluster_lost_before_any_checkpoint_finds_the_cluster_made_anew() -> None:
    """The PS and the chief lost before the first checkpoint: the new chief finds empty
    PS and no checkpoint, and makes the cluster anew in the generation the running
    workers already had. The first of them to register again (it ran under an earlier
    chief) has every shard restored to its initial values in a new generation, as a
    living chief does when its PS come back empty: the workers' waits for a new
    generation end. A worker that never ran (a first start) changes nothing."""

    async def body() -> None:
        env = make_env(1, num_workers=2, heartbeat_interval=0.5)
        await env.chief.start()  # empty PS, no checkpoint: fresh
        await env.chief.create_variables(VARS, SGD)
        rep = await call(env.chief, "register", who(1, 5, steps_planned=10))
        await asyncio.sleep(0.05)
        assert rep.body["gen"] == 0 and env.chief.gen == 0  # a first start: nothing
        # a worker this chief knows registering again (it forgot nothing): nothing
        await call(env.chief, "register", who(1, 5, steps_planned=10, steps_done=0))
        await asyncio.sleep(0.05)
        assert env.chief.gen == 0

        await call(env.chief, "register", who(0, 7, steps_planned=10, steps_done=3))
        for _ in range(500):  # (a loaded machine: the restore takes its time; its
            # generation is set before it ends: the PS' boot ids are read after it)
            if env.chief.gen == 1 and not env.chief.recovery.recovering:
                break
            await asyncio.sleep(0.01)
        assert env.chief.gen == 1
        assert env.services[0].gen == 1  # the PS hold the initial values, generation 1
        rep = await call(env.chief, "heartbeat", who(0, 7, step=0))
        assert rep.body["gen"] == 1 and rep.body["recovering"] is False

        # once: another worker of before registering again restores nothing more
        await call(env.chief, "register", who(1, 6, steps_planned=10, steps_done=2))
        await asyncio.sleep(0.05)
        assert env.chief.gen == 1

    run(body())


@pytest.mark.parametrize("made", [False, True], ids=["before-the-variables", "before-training"])
def test_a_worker_of_a_lost_cluster_registered_before_training_has_the_values_made_anew(
    made: bool,
) -> None:
    """The same, the worker of the lost cluster registering before training begins:
    before the new chief made the variables (it waits for every worker), or between
    the variables made and training begun (one turn of the loop: their creation ends
    in a task of its own). Training's start restores them in a new generation, and the
    worker goes back to its first batch. Before, nothing did (the first case: the
    worker resumed after its batches of the lost cluster, lost with its PS, and a push
    of it sent again to the new values was refused as hostile, "pulled version 1
    outside [0, 0]": the worker exited 1), or the restore was refused for the phase
    (the second: the worker, told its push was of values that are gone, waited for
    ever for a new generation; 2 of 7 replays of the chief and every PS killed at the
    workers' first steps)."""

    async def body() -> None:
        env = make_env(1, num_workers=2, heartbeat_interval=0.5)
        await env.chief.start()  # empty PS, no checkpoint: fresh
        if made:
            await env.chief.variables.create(VARS, dict(SGD))  # training not begun
        await call(env.chief, "register", who(0, 7, steps_planned=10, steps_done=3))
        await call(env.chief, "register", who(1, 5, steps_planned=10))
        if made:
            env.chief.recovery.variables_created()
        else:
            await env.chief.create_variables(VARS, SGD)
        for _ in range(500):  # (a loaded machine: the restore takes its time; its
            # generation is set before it ends: the PS' boot ids are read after it)
            if env.chief.gen == 1 and not env.chief.recovery.recovering:
                break
            await asyncio.sleep(0.01)
        assert env.chief.gen == 1 and env.services[0].gen == 1
        rep = await call(env.chief, "heartbeat", who(0, 7, step=3))
        assert rep.body["gen"] == 1 and rep.body["recovering"] is False
        assert rep.body["rewind"] == 0, rep.body

    run(body())


async def _chief_on_a_checkpoint_of_two_workers(
    tmp_path: Path, label: int, extra: dict[str, Any]
) -> Env:
    """An async checkpoint labelled ``label`` (with ``extra``) of a PS holding what
    workers 0 and 1 pushed up to their batches 5 and 7, then a started chief (and an
    empty PS) on it."""
    placement = plan(VARS, 1, Partitioner(num_shards=2), optimizer=dict(SGD))
    net = FakeNetwork()
    net.serve("ps0", PSService(0, checkpoint_dir=str(tmp_path)), name="ps0")
    client = net.client("ps0", "chief:0")
    defs = tuple(d.to_wire() for _, d in placement.shard_defs())
    cursors = {"worker:0": 5, "worker:1": 7}
    restore = o.Restore(0, 0, defs, None, placement.to_wire(), cursors, False)
    await client.request("restore", restore.to_wire())
    ck = Checkpointer(CheckpointPolicy(str(tmp_path)), [client])
    ckpt = await ck.take(label, placement, "async", 0, extra)
    assert ckpt is not None and ckpt.cursors == cursors
    env = make_env(1, num_workers=2, serve=[], checkpoint=CheckpointPolicy(str(tmp_path)))
    env.services[0] = PSService(0, checkpoint_dir=str(tmp_path))
    env.stats[0] = env.net.serve(env.cfg.cluster.ps[0], env.services[0], name="ps0")
    await env.chief.start()
    return env


def test_a_chief_that_resumes_from_a_checkpoint_reports_its_step_at_once(
    tmp_path: Path,
) -> None:
    """Async: a new chief finds empty PS and a checkpoint of step 12 whose batches are
    all its workers' (cursors 5 and 7). Its status says global step 12 from the moment
    the restore is done, not the step offset alone (12 - 5 - 7 = 0) until workers
    report: the global step read 0 there, and went back from what the lost chief had
    said (fault schedules 9606 and 9614)."""

    async def body() -> None:
        env = await _chief_on_a_checkpoint_of_two_workers(tmp_path, 12, {})
        status = (await call(env.chief, "status")).body
        assert status["step_known"] and status["gen"] >= 1
        assert status["global_step"] == 12
        # each worker's new incarnation resumes after its batches (the chief counts
        # them as its earlier ones'), then reports the batches it trained since: the
        # checkpoint's are not counted twice
        for i in (0, 1):
            await call(env.chief, "register", who(i, 1, steps_planned=20))
            await call(env.chief, "heartbeat", who(i, 1, step=2))
        assert (await call(env.chief, "status")).body["global_step"] == 12 + 2 + 2

    run(body())


@pytest.mark.parametrize(
    ("label", "extra", "expected"),
    [
        # an older writer: the offset it counted on top of the workers it had heard
        (8, {"workers": {"0": 4, "1": 4}}, 12),
        # the offset recorded: a run that went on from a finished run of step 100
        (104, {"workers": {"0": 2, "1": 2}, "step_offset": 100}, 112),
    ],
)
def test_a_resumed_async_run_starts_at_the_pushes_its_checkpoint_holds(
    tmp_path: Path, label: int, extra: dict[str, Any], expected: int
) -> None:
    """Async, the whole run stopped by kill -9: its latest checkpoint was labelled with
    the step the chief had heard from heartbeats (235) while its values held 326
    pushes (its cursors), and the resumed run ended at global step 9,109 for 9,200
    worker steps. The global step of a resumed run is the pushes its checkpoint's
    values hold, on top of the steps of the runs before it."""

    async def body() -> None:
        env = await _chief_on_a_checkpoint_of_two_workers(tmp_path, label, extra)
        assert (await call(env.chief, "status")).body["global_step"] == expected
        for i in (0, 1):
            await call(env.chief, "register", who(i, 1, steps_planned=20))
            await call(env.chief, "heartbeat", who(i, 1, step=2))
        assert (await call(env.chief, "status")).body["global_step"] == expected + 4
        # its own checkpoints say the offset, for a run resumed from them in turn
        assert env.chief.checkpoints is not None
        assert env.chief.checkpoints._extra()["step_offset"] == expected - 12

    run(body())


def test_a_burst_of_checkpoint_requests_shares_checkpoints_named_by_their_step(
    tmp_path: Path,
) -> None:
    """2,048 ``checkpoint`` requests sent at once took one checkpoint each, one after
    the other, each under the global step read when its request arrived: 679 commits
    of one name over 40 s while the step went on, and the last one's manifest said a
    step 21,602 before its values (a resume then ended short, with exit 0). Requests
    that arrive together share one checkpoint, whose step is read when its snapshot is
    taken; a request after it gets a later one."""

    async def body() -> None:
        env = make_env(1, num_workers=1, checkpoint=CheckpointPolicy(str(tmp_path)))
        env.services[0] = PSService(0, checkpoint_dir=str(tmp_path))
        env.stats[0] = env.net.serve(env.cfg.cluster.ps[0], env.services[0], name="ps0")
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        await call(env.chief, "register", who(0, 1, steps_planned=100))
        await call(env.chief, "heartbeat", who(0, 1, step=5))
        ck = env.chief.checkpoints.ck
        before = ck.committed
        replies = await asyncio.gather(
            *(call(env.chief, "checkpoint", {"wait": 30.0}) for _ in range(64))
        )
        assert all(r.op != "error" for r in replies), replies[0].body
        names = {r.body["name"] for r in replies}
        assert len(names) == 1 and ck.committed - before == 1
        assert ck.last_committed is not None and ck.last_committed.step == 5
        await call(env.chief, "heartbeat", who(0, 1, step=9))
        later = await call(env.chief, "checkpoint", {"wait": 30.0})
        assert later.body["name"] not in names and ck.committed - before == 2
        assert ck.last_committed.step == 9

    run(body())


def test_a_ps_without_a_checkpoint_dir_is_refused_at_the_start(tmp_path: Path) -> None:
    """A chief that takes checkpoints and a PS started without --checkpoint-dir: the
    chief found out at its first checkpoint, the final one of a run started by hand,
    after all the training (exit 3, nothing committed). It refuses at the start now,
    naming the PS (a configuration error: exit code 2, never restarted)."""

    async def body() -> None:
        env = make_env(2, num_workers=1, serve=[], checkpoint=CheckpointPolicy(str(tmp_path)))
        env.serve(0)
        env.services[1] = PSService(1, checkpoint_dir=str(tmp_path))
        env.stats[1] = env.net.serve(env.cfg.cluster.ps[1], env.services[1], name="ps1")
        with pytest.raises(ConfigError) as refused:
            await env.chief.start()
        assert str(refused.value) == (
            f"ps 0 runs without --checkpoint-dir, and this chief takes checkpoints"
            f" (--checkpoint-dir {tmp_path}): give every PS --checkpoint-dir (a folder all"
            " of them and the chief see), or the chief none"
        )

    run(body())


def test_a_ps_started_again_without_a_checkpoint_dir_is_named_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The start check cannot see a PS restarted by hand mid-run without
    --checkpoint-dir: each checkpoint failed from then on, the final one the run, and
    nothing said why before. The watch that finds it restarted names it, once."""

    async def body() -> None:
        policy = CheckpointPolicy(str(tmp_path))
        env = make_env(
            2, 1, serve=[], checkpoint=policy, heartbeat_interval=0.05, heartbeat_timeout=0.2
        )
        for i in range(2):
            env.services[i] = PSService(i, checkpoint_dir=str(tmp_path))
            env.stats[i] = env.net.serve(env.cfg.cluster.ps[i], env.services[i], name=f"ps{i}")
        rec = env.chief.recovery
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        watch = asyncio.ensure_future(rec.watch_ps())
        env.services[0] = PSService(0)  # started again by hand, the flag forgotten
        env.net.serve(env.cfg.cluster.ps[0], env.services[0], name="ps0")
        said = "ps 0 (127.0.0.1:7100) was started again without --checkpoint-dir"
        for _ in range(100):
            env.clock.now += 0.1
            await asyncio.sleep(0.03)
            if said in caplog.text:
                break
        for _ in range(10):  # heard again: not said again
            env.clock.now += 0.1
            await asyncio.sleep(0.03)
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        assert caplog.text.count(said) == 1, caplog.text

    with caplog.at_level(logging.WARNING, logger="zmqps"):
        run(body())


def test_a_ps_serving_nothing_that_does_not_answer_is_not_waited_for_at_the_end() -> None:
    """A chief started again after a scale down drained a PS (it exited 0) does not know
    that PS left: the end of its run spent 30 s asking it to shut down. A process that
    serves no state and holds no copy is asked once whether it runs, and told only if
    it does; one serving a state, or a copy, gets the whole window as before."""
    from types import SimpleNamespace

    from zmqps.core.variables import Placement, ShardInfo, VariableDef
    from zmqps.roles.chief.serve import _serving_nothing, _shutdown_ps
    from zmqps.roles.homes import Homes

    asked: list[tuple[int, str, int]] = []

    class PS:
        def __init__(self, q: int, up: bool, slow: int = 0) -> None:
            self.q, self.up, self.endpoint = q, up, f"tcp://10.0.0.{q}:2222"
            self.slow = slow  # probes it leaves unanswered, listening all the while

        async def request(self, op: str, body: Any, *, timeout: float, attempts: int) -> Any:
            asked.append((self.q, op, attempts))
            if op == "ps_state" and self.slow:
                self.slow -= 1
                raise DeadlineExceeded("no reply yet")
            if not self.up:
                raise DeadlineExceeded("no reply")
            return SimpleNamespace(body={"boot": "b"})

        async def listening(self) -> bool:
            return self.up

    clients = [PS(0, True), PS(1, False), PS(2, True), PS(3, False), PS(4, True, slow=2)]
    homes = Homes(clients)  # type: ignore[arg-type]
    homes.of = [0, 0, 0, 3, 0]  # states 1, 2 and 4 moved onto 0; 3 serves its own
    v = VariableDef("w", (4,))
    shards = (ShardInfo(0, "w", 0, 0, 4, 0, backups=(2,)),)
    idle = _serving_nothing(homes, Placement((v,), shards, {"name": "sgd", "lr": 0.1}))
    assert idle == {1, 4}  # 2 holds a copy, 0 and 3 serve states
    run(_shutdown_ps(clients, 10.0, idle=idle))  # type: ignore[arg-type]
    assert sorted(asked) == [
        (0, "shutdown", 6),
        (1, "ps_state", 1),  # nothing listens there: gone, nothing more
        (2, "shutdown", 6),
        (3, "shutdown", 6),
        # started again as the run ended and slow to answer (a fault schedule left one
        # waiting for a chief for ever): asked while it listens, then told
        (4, "ps_state", 1),
        (4, "ps_state", 1),
        (4, "ps_state", 1),
        (4, "shutdown", 6),
    ]


def _ended(env: Env, name: str = "ckpt-000000004600", step: int = 4600) -> None:
    """The chief found, at start, that its run ended (its final checkpoint ``name``)."""
    from types import SimpleNamespace

    from zmqps.roles.chief.recovery import RunFinished

    ckpt: Any = SimpleNamespace(name=name, step=step)
    env.chief.ended_before = RunFinished(ckpt, {"global_step": step}, "no PS answered")
    env.chief.finished = True


def test_a_chief_whose_run_ended_before_it_tells_registering_tasks_so() -> None:
    """Started again on a finished run: a worker's register is answered at once (no PS
    is asked: they are gone), naming the final checkpoint, and counted as told."""

    async def body() -> None:
        env = make_env(2, num_workers=2, serve=[])  # no PS answers
        _ended(env)
        rep = await call(env.chief, "register", who(1, 7, steps_planned=10))
        info = o.ClusterInfo.parse(rep.body, "register reply")
        assert (info.ended, info.global_step, info.finished) == ("ckpt-000000004600", 4600, True)
        ev = {"role": "evaluator", "index": 0, "incarnation": 1}
        rep = await call(env.chief, "register", ev)
        assert rep.body["ended"] == "ckpt-000000004600"
        # told, and kept only for the tasks of the spec (this one names no evaluator):
        # registers of other indexes cannot grow what the chief keeps
        for i in (2, 99, 1 << 40):
            await call(env.chief, "register", who(i, 0, steps_planned=10))
        assert env.chief.told_ended == {("worker", 1)}

    run(body())


def test_the_chief_of_an_ended_run_waits_for_the_clusters_tasks_within_a_bound() -> None:
    from zmqps.roles.chief.serve import _late_tasks_told, ended_grace

    async def body() -> None:
        env = make_env(1, num_workers=2, serve=[], startup_timeout=0.3)
        assert ended_grace(env.cfg) == 0.3  # min(--startup-timeout, 2 heartbeat timeouts)
        _ended(env)
        started = time.monotonic()
        await _late_tasks_told(env.chief)  # nobody registers: the grace, then it ends
        assert 0.3 <= time.monotonic() - started < 2.0
        env = make_env(1, num_workers=2, serve=[], startup_timeout=30.0)
        _ended(env)
        waiting = asyncio.ensure_future(_late_tasks_told(env.chief))
        await call(env.chief, "register", who(0, 1))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # worker 1 not told yet
        await call(env.chief, "register", who(1, 1))
        await asyncio.wait_for(waiting, 1.0)  # every task of the spec told: it ends

    run(body())


def test_a_worker_registering_with_the_chief_of_an_ended_run_raises_run_ended() -> None:
    from zmqps.roles.worker import RunEnded, Session

    async def body() -> None:
        env = make_env(1, num_workers=1, serve=[])
        _ended(env)
        env.net.serve(CHIEF, env.chief, name="chief")
        session = Session(env.net.client(CHIEF, "worker:0:1"), o.Who("worker", 0, 1))
        with pytest.raises(RunEnded, match=r"the run already finished \(ckpt-000000004600,"):
            await session.open(5.0)
        await session.close()

    run(body())
