"""``Map.check`` accepts a common scalar field (Int, Str, Bool, Float, AnyList) with an
inline test, calling the field's own schema only when that test fails: the two must
agree on every value, so that the field's schema stays the one rule (a change to it
that the inline test missed would be bypassed for every top-level field)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqps.wire.errors import ProtocolError
from zmqps.wire.schema import AnyList, Bool, Float, Int, Map, Schema, Str

SCHEMAS: list[Schema] = [
    Int(),
    Int(0, 10),
    Int(-5, 5),
    Str(),
    Str(3),
    Bool(),
    Float(),
    Float(0.0, 1.0),
    Float(-1.0, math.inf),
    AnyList(),
]

VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=4),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


def accepts(schema: Schema, value: Any) -> bool:
    try:
        schema.check(value, "v")
    except ProtocolError:
        return False
    return True


@pytest.mark.parametrize("schema", SCHEMAS, ids=repr)
@settings(max_examples=300, deadline=None)
@given(value=VALUES)
def test_a_field_in_a_map_is_accepted_exactly_when_its_schema_accepts_it(
    schema: Schema, value: Any
) -> None:
    assert accepts(Map(required={"f": schema}), {"f": value}) == accepts(schema, value)
    assert accepts(Map(optional={"f": schema}), {"f": value}) == accepts(schema, value)
