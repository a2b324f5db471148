"""zmqps.Worker's own API over an in-memory cluster (FakeNetwork + the real PS code).

:func:`worker` builds a :class:`Worker` without its chief (async mode): its pushes and
pulls go through the real :class:`ParameterClient` to real PS services, so what a call
sent, and what the PS applied, is read off the PS stores.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from test_ps_client import DENSE, EMB, LR, make_cluster

from zmqps.core.held import HeldExamples
from zmqps.metrics.summaries import Window
from zmqps.roles.worker.fresh import FreshValues
from zmqps.roles.worker.modes import make_step_mode
from zmqps.roles.worker.session import Session
from zmqps.roles.worker.worker import Worker
from zmqps.transport import LoopThread
from zmqps.wire import ops as o
from zmqps.wire.errors import InvalidArgument, ProtocolError
from zmqps.wire.schema import MAX_TALLY


@pytest.fixture
def worker() -> Iterator[Any]:
    """A worker of an async cluster of 2 PS (dense w, b, e and the table emb), and the
    cluster (``worker.cluster``)."""
    io = LoopThread("test-worker-api")
    try:
        cluster = io.run(make_cluster((*DENSE, EMB), 2, 3), timeout=10)
        w = Worker.__new__(Worker)
        w.io, w.cluster = io, cluster  # type: ignore[attr-defined]
        w.session = Session(None, o.Who("worker", 0, 1))  # type: ignore[arg-type]
        w.steps = make_step_mode("async", w.session, 0, lambda _k: None)
        w._client = cluster.client()
        w.device = SimpleNamespace(separate=False)  # type: ignore[assignment]
        w.metrics = w.summaries = None
        w._window, w._fresh = Window(), FreshValues()
        w.name, w.index, w.loss, w.examples, w.nonfinite = "worker:0", 0, None, 0, 0
        w.steps_done = w.step = w.rewound = w.retrained = w._furthest = w.lost_steps = 0
        w._held, w.examples_of, w._step_rows, w._refused_step = HeldExamples(), None, None, -1
        w.on_nonfinite = "skip"
        yield w
    finally:
        io.stop()


def _grads() -> dict[str, np.ndarray]:
    return {v.name: np.ones(v.shape, v.dtype) for v in DENSE}


def _untouched(w: Any) -> None:
    """Nothing of a refused step was sent nor counted: the PS hold their initial
    values at version 0, the worker's step and examples are as before."""
    assert all(v == 0 for v in w.cluster.versions().values())
    assert (w.step, w.examples, w.held_examples, w.loss) == (0, 0, 0, None)


@pytest.mark.parametrize(
    ("loss", "why"),
    [
        ("abc", r"loss: a number \(the step's loss\), got 'abc'"),
        ("1.5", r"loss: a number .* got '1.5'"),
        (True, r"loss: a number .* got True"),
        (np.bool_(False), r"loss: a number .* got "),
        (1 + 2j, r"loss: a number .* got \(1\+2j\)"),
        ([0.5], r"loss: a number .* got \[0.5\]"),
        (np.ones(3), r"loss: a number .* got array"),
        (10**400, r"loss: a number .* got 1000000.*\.\.\. \(int too large"),
    ],
)
def test_a_loss_that_is_not_a_number_is_refused_before_the_push_is_sent(
    worker: Any, loss: Any, why: str
) -> None:
    """``push(grads, loss="abc")`` raised ``ValueError: could not convert string to
    float`` after the gradient was sent and applied (the global step advanced): a retry
    applied it twice. Refused first, naming the argument; nothing is applied."""
    for call in (worker.push, worker.push_pull):
        with pytest.raises(InvalidArgument, match=why):
            call(_grads(), loss=loss, examples=4)
        _untouched(worker)


def test_a_loss_that_is_a_number_of_any_kind_is_taken_as_a_float(worker: Any) -> None:
    for loss in (0.25, 1, np.float32(0.5), np.array(0.75), float("nan"), float("inf")):
        assert worker.push(_grads(), loss=loss, examples=2)
        assert isinstance(worker.loss, float)
        assert worker.loss == float(loss) or (np.isnan(worker.loss) and np.isnan(float(loss)))
    assert worker.step == 6 and worker.held_examples == 12
    np.testing.assert_allclose(worker.cluster.shard_values("b"), worker.pull(["b"])["b"], rtol=1e-6)


def test_examples_past_what_the_wire_carries_are_refused_before_the_push_is_sent(
    worker: Any,
) -> None:
    """``examples=2**60`` was taken: the chief then refused the worker's heartbeats
    (it looked dead while alive) and its leave raised a raw ``ProtocolError``. A count
    past the wire's cap, or one that takes the worker's total past it, is refused."""
    for call in (worker.push, worker.push_pull):
        for bad in (2**60, MAX_TALLY + 1, np.int64(2**62)):
            with pytest.raises(InvalidArgument, match=rf"examples: .* \[0, {MAX_TALLY}\], got"):
                call(_grads(), loss=0.5, examples=bad)
            _untouched(worker)
    assert worker.push(_grads(), examples=MAX_TALLY - 10)  # at the cap: taken
    with pytest.raises(InvalidArgument, match=f"examples: .* would pass {MAX_TALLY} .* 11 more"):
        worker.push(_grads(), examples=11)
    assert worker.held_examples == MAX_TALLY - 10 and worker.step == 1
    assert worker.push(_grads(), examples=10)
    assert worker.held_examples == MAX_TALLY
    # what heartbeats and leave say of it is what the wire takes
    body = o.Heartbeat(o.Who("worker", 0, 1), step=2, examples=worker.held_examples).to_wire()
    assert o.Heartbeat.parse(body, "heartbeat").examples == MAX_TALLY
    with pytest.raises(ProtocolError, match="examples"):  # one more, and it is refused
        o.Heartbeat.parse({**body, "examples": MAX_TALLY + 1}, "heartbeat")


def test_pull_of_names_returns_only_those(worker: Any) -> None:
    """``pull("b")`` and ``pull(["b"])`` returned every variable pulled so far (the
    client's arrays), after a whole pull every dense one."""
    assert set(worker.pull()) == {"w", "b", "e"}
    assert set(worker.pull("b")) == {"b"}
    assert set(worker.pull(["b"])) == {"b"}
    assert set(worker.pull(("e", "w"))) == {"e", "w"}
    assert worker.push(_grads())
    got = worker.pull("b")
    assert set(got) == {"b"}
    np.testing.assert_allclose(got["b"], worker.cluster.shard_values("b"), rtol=1e-6)
    before = worker.cluster.shard_values("b") + LR  # one step of SGD on ones
    np.testing.assert_allclose(got["b"], before - LR, rtol=1e-6)
    with pytest.raises(InvalidArgument, match=r"unknown variables: \['zz'\]"):
        worker.pull(["b", "zz"])


@pytest.mark.parametrize("grads", [[np.ones(3)], None, "w", np.ones(3)])
def test_gradients_that_are_not_a_mapping_are_refused_before_anything_is_sent(
    worker: Any, grads: Any
) -> None:
    for call in (worker.push, worker.push_pull):
        with pytest.raises(InvalidArgument, match="grads: a mapping of variable names"):
            call(grads, examples=4)
        _untouched(worker)


def test_rows_of_a_dense_variable_are_refused_before_anything_is_sent(worker: Any) -> None:
    """``push_rows("w", ...)`` was taken: in sync it counted as the worker's share of
    w's step, its whole push then came stale (one row applied; b none of its
    gradient). Rows are for embedding variables only."""
    name = DENSE[0].name
    width = DENSE[0].shape[1:]
    ids = np.array([0], np.int64)
    why = f"{name!r} is a dense variable: rows are for embedding variables"
    with pytest.raises(InvalidArgument, match=why):
        worker.push_rows(name, ids, np.ones((1, *width), np.float32))
    with pytest.raises(InvalidArgument, match=why):
        worker.pull_rows(name, ids)
    with pytest.raises(InvalidArgument, match=why):
        worker.push_pull_rows(name, ids, np.ones((1, *width), np.float32), ids)
    _untouched(worker)
    assert worker.push_rows(EMB.name, ids, np.ones((1, *EMB.shape[1:]), np.float32))
