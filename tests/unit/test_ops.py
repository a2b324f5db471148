"""The typed bodies' converters (zmqps.wire.ops): each field is read, at import, from
its annotation as written, without evaluating it; that reading must agree with the
evaluated type for every field of every body (sans-IO)."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from zmqps.wire import ops
from zmqps.wire.errors import ProtocolError
from zmqps.wire.schema import Map


def _bodies() -> list[type[ops.Body]]:
    found = []
    for value in vars(ops).values():
        if isinstance(value, type) and issubclass(value, ops.Body) and value is not ops.Body:
            found.append(value)
    return found


def test_every_field_is_read_as_its_evaluated_type() -> None:
    bodies = _bodies()
    assert len(bodies) > 60
    kinds = set()
    for cls in bodies:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            assert isinstance(f.type, str), (cls.__name__, f.name)
            assert ops._kind_of(f.type) == ops._kind(hints[f.name]), (cls.__name__, f.name)
            kinds.add(ops._kind_of(f.type)[0])
        # the converters the body was made with are those readings
        for name, kind, _, sub in cls._CODEC:
            assert (kind, sub) == ops._kind(hints[name]), (cls.__name__, name)
    assert kinds == {ops._PLAIN, ops._TUPLE, ops._BODY, ops._WHO}


def test_a_field_given_as_a_type_is_read_as_one() -> None:
    assert ops._kind_of(int) == (ops._PLAIN, None)
    assert ops._kind_of(tuple[int, ...]) == (ops._TUPLE, None)
    assert ops._kind_of(ops.ShmRef | None) == (ops._BODY, ops.ShmRef)
    assert ops._kind_of(ops.Who) == (ops._WHO, None)


def test_a_generation_or_step_whose_next_would_overflow_is_refused() -> None:
    """A ``restore`` to generation 2**63 - 1 was taken by a PS; the chief, computing the
    next generation from it, failed (its 64-bit field) and exited 1."""
    body = {"gen": 2**63 - 1, "step": 0, "shards": []}
    with pytest.raises(ProtocolError, match=r"Restore body\.gen"):
        ops.Restore.parse(body)
    with pytest.raises(ProtocolError, match=r"Restore body\.step"):
        ops.Restore.parse({**body, "gen": 1, "step": 2**63 - 1})
    top = ops.MAX_COUNT
    assert ops.Restore.parse({**body, "gen": top, "step": top}).gen == top
    for cls in (ops.Restore, ops.Push, ops.Pull, ops.PushReply):  # generations and steps
        schema = cls.SCHEMA
        assert isinstance(schema, Map)
        known = {**schema.required, **schema.optional}
        for name in ("gen", "values_step", "token_step"):
            if name in known:
                with pytest.raises(ProtocolError):
                    known[name].check(2**63 - 1, f"{cls.__name__}.{name}")


@pytest.mark.parametrize("loss", [float("inf"), float("-inf"), float("nan")])
def test_a_heartbeats_loss_is_finite(loss: float) -> None:
    """An infinite loss in a heartbeat was kept and made ``zmqps status --json`` print
    ``Infinity``, which JSON parsers refuse (a worker leaves a non-finite loss out)."""
    who = {"role": "worker", "index": 0, "incarnation": 1}
    assert ops.Heartbeat.parse({**who, "step": 1, "loss": 1e308}).loss == 1e308
    with pytest.raises(ProtocolError, match="loss"):
        ops.Heartbeat.parse({**who, "step": 1, "loss": loss})
