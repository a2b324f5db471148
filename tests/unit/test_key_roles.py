"""Under CURVE, what each allow-listed key may ask of a PS and of the chief (sans-IO:
the checks on ``Message.peer``, the allow-list's name of the sender's key)."""

from __future__ import annotations

from typing import Any

import pytest

from zmqps.roles.chief.service import check_key
from zmqps.roles.ps import PSService
from zmqps.roles.ps.slots import PSSlots
from zmqps.wire import Message
from zmqps.wire import ops as o
from zmqps.wire.errors import InvalidArgument

PUSH = {"shards": [0], "versions": [0], "gen": 0, "worker": "worker:0", "inc": 1, "seq": 1}
FENCE = {"worker": "worker:0", "inc": 2**62, "left": True, "steps": 7}


def ps_asked(peer: str, op: str, body: dict[str, Any]) -> Any:
    slots = PSSlots(PSService(0), make_copy=lambda slot: PSService(slot), link=None)
    return slots(Message(op, 1, "x", body, peer=peer))


@pytest.mark.parametrize("key", ["evaluator", "status", "ps", "ps1"])
@pytest.mark.parametrize("op", ["push", "push_pull", "push_rows", "push_pull_rows", "fence"])
def test_only_a_workers_or_the_chiefs_key_pushes_or_fences_on_a_ps(key: str, op: str) -> None:
    """The read-only keys (an evaluator's, the operator's ``status``) fenced a worker
    out (``fence`` at incarnation 2**62: the real worker exited 1), and could push
    refused gradients that count toward a sync step."""
    body = FENCE if op == "fence" else PUSH
    with pytest.raises(InvalidArgument, match=f"refused from the key named '{key}'"):
        ps_asked(key, op, body)


@pytest.mark.parametrize("key", ["worker", "worker0", "chief"])
def test_a_workers_key_fences_its_own_end(key: str) -> None:
    rep = ps_asked(key, "fence", {"worker": "worker:0", "inc": 3, "left": True, "steps": 5})
    assert rep.op == "ok", rep


def test_a_per_task_worker_key_speaks_for_its_own_task_only() -> None:
    token = o.TakeToken(o.Who("worker", 0, 1)).to_wire()  # its Who flattened
    for op, body in (("fence", FENCE), ("push", PUSH), ("take_token", token)):
        with pytest.raises(InvalidArgument, match="speaks only for worker:3, not 'worker:0'"):
            ps_asked("worker3", op, body)
    evaluator = o.TakeToken(o.Who("evaluator", 0, 1)).to_wire()
    with pytest.raises(InvalidArgument, match="speaks only for workers, not 'evaluator:0'"):
        ps_asked("worker", "take_token", evaluator)


def chief_asked(peer: str, op: str, body: dict[str, Any] | None = None) -> None:
    check_key(Message(op, 1, "x", body or {}, peer=peer))


@pytest.mark.parametrize("key", ["worker", "worker2", "evaluator", "ps", "ps0"])
def test_only_the_operator_or_the_chief_controls_the_run(key: str) -> None:
    """Any allow-listed key could shut the run down (``shutdown`` from an evaluator's
    key was answered ok: the chief and the PS exited, the worker never trained)."""
    for op, body in (("shutdown", {}), ("checkpoint", {}), ("scale", {"ps": 1})):
        with pytest.raises(InvalidArgument, match=f"refused from the key named '{key}'"):
            chief_asked(key, op, body)
    chief_asked(key, "scale", {})  # the moves' status: anyone's
    chief_asked(key, "status")
    if not key.startswith("worker"):  # the model is a worker's (or the chief's) to define
        with pytest.raises(InvalidArgument, match=f"refused from the key named '{key}'"):
            chief_asked(key, "create_vars", {})
    else:
        chief_asked(key, "create_vars", {})


def test_the_operators_key_and_the_chiefs_control_the_run() -> None:
    for key in ("status", "chief"):
        for op, body in (("shutdown", {}), ("checkpoint", {}), ("scale", {"ps": 2})):
            chief_asked(key, op, body)


def test_a_key_speaks_for_tasks_of_its_own_role_only() -> None:
    worker0 = o.Register(o.Who("worker", 0, 1)).to_wire()  # as a worker sends it
    chief_asked("worker", "register", worker0)
    chief_asked("worker0", "heartbeat", o.Heartbeat(o.Who("worker", 0, 1), 3).to_wire())
    chief_asked("chief", "register", worker0)  # the coordinator's
    chief_asked("evaluator", "register", o.Register(o.Who("evaluator", 0, 1)).to_wire())
    for key in ("status", "evaluator", "ps", "worker1"):
        with pytest.raises(InvalidArgument, match="does not speak for worker:0"):
            chief_asked(key, "register", worker0)
        with pytest.raises(InvalidArgument, match="does not speak for worker:0"):
            chief_asked(key, "take_token", o.TakeToken(o.Who("worker", 0, 1)).to_wire())
