"""Values of scheduled functions (zmqps.wire.values) and the Tree schema: sans-IO."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

from zmqps.coordinator.server import lookup
from zmqps.wire import decode, encode, request
from zmqps.wire.errors import InvalidArgument, NotFound, ProtocolError
from zmqps.wire.schema import Tree
from zmqps.wire.values import MAX_DEPTH, ResourceRef, decode_value, encode_value


def roundtrip(value: Any, resolve: Any = None) -> Any:
    """Through a real run request: encode, frames as bytes, decode (schema included)."""
    args, tensors = encode_value(value)
    msg = request(
        "run", {"fn": "f", "args": ["t", [args]], "kwargs": ["d", {}], "steps": 1}, tensors
    )
    frames = [f if isinstance(f, bytes) else memoryview(f).tobytes() for f in encode(msg)]
    got = decode(frames)
    return decode_value(got.body["args"], got.tensors, resolve)[0]


def test_scalars_containers_and_arrays_round_trip() -> None:
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    value = {
        "none": None,
        "flags": [True, False],
        "ints": (0, -1, 2**63 - 1, -(2**63)),
        "float": 0.25,
        "nan": float("nan"),
        "text": "héllo",
        "array": a,
        "f32": np.float32(1.5),
        "i8": np.int8(-3),
        "nested": [[{"x": (np.zeros(0, np.int32),)}]],
        "bytes": b"\x00\x01",
    }
    out = roundtrip(value)
    assert out["none"] is None and out["flags"] == [True, False]
    assert out["ints"] == (0, -1, 2**63 - 1, -(2**63))
    assert out["float"] == 0.25 and np.isnan(out["nan"]) and out["text"] == "héllo"
    np.testing.assert_array_equal(out["array"], a)
    assert out["array"].dtype == np.float64 and not out["array"].flags.writeable
    assert isinstance(out["f32"], np.float32) and out["f32"] == np.float32(1.5)
    assert isinstance(out["i8"], np.int8) and out["i8"] == -3
    inner = out["nested"][0][0]["x"][0]
    assert inner.shape == (0,) and inner.dtype == np.int32
    np.testing.assert_array_equal(out["bytes"], np.array([0, 1], np.uint8))


def test_arrays_are_not_copied_when_already_wire_ready() -> None:
    a = np.ones((4, 4), np.float32)
    _, tensors = encode_value((a,))
    assert tensors[0].array is a or np.shares_memory(tensors[0].array, a)
    big_endian = np.ones(3, ">f4")
    _, tensors = encode_value(big_endian)
    assert tensors[0].array.dtype == np.dtype("<f4")


def test_resources_resolve_on_the_receiving_side_only() -> None:
    assert roundtrip([ResourceRef(7)], resolve=lambda rid: f"iterator {rid}") == ["iterator 7"]
    with pytest.raises(ProtocolError, match="resource"):
        roundtrip(ResourceRef(1))


@pytest.mark.parametrize(
    "bad",
    [
        object(),
        {1: "non-str key"},
        2**63,
        -(2**63) - 1,
        np.array(["a", "b"]),
        np.array([1 + 2j]),
        np.array([object()], dtype=object),
        types.SimpleNamespace(x=1),
        {1, 2},
        lambda: None,
    ],
)
def test_what_cannot_cross_the_wire_is_refused_by_name(bad: Any) -> None:
    with pytest.raises(InvalidArgument):
        encode_value({"arg": [bad]})


def test_nesting_is_bounded_on_both_sides() -> None:
    deep: Any = 1
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(InvalidArgument, match="deeper"):
        encode_value(deep)
    # a hostile peer nests far deeper: refused without recursion
    tree: Any = 1
    for _ in range(100_000):
        tree = ["l", [tree]]
    with pytest.raises(ProtocolError, match="deeper"):
        Tree().check(tree, "args")


@pytest.mark.parametrize(
    "tree",
    [
        [],
        ["l"],
        ["x", []],
        ["l", {}],
        ["d", []],
        ["d", {1: 2}],
        ["a", -1],
        ["a", "0"],
        ["r", 2**31],
        [1, []],
        {"l": []},
        b"bytes",
        ["l", [["s", 1.5]]],
    ],
)
def test_the_tree_schema_refuses_malformed_nodes(tree: Any) -> None:
    with pytest.raises(ProtocolError):
        Tree().check(tree, "args")


def test_the_tree_schema_bounds_the_node_count() -> None:
    with pytest.raises(ProtocolError, match="nodes"):
        Tree(max_nodes=100).check(["l", list(range(200))], "args")


def test_buffer_indices_are_checked_against_the_message() -> None:
    with pytest.raises(ProtocolError, match="buffer 3"):
        decode_value(["a", 3], ())
    _, tensors = encode_value(np.ones(2))
    with pytest.raises(ProtocolError, match="0-d"):
        decode_value(["s", 0], tensors)


def test_functions_are_looked_up_by_public_name_only() -> None:
    mod = types.ModuleType("job")
    mod.step = lambda ctx: 1  # type: ignore[attr-defined]
    mod.CONSTANT = 3  # type: ignore[attr-defined]
    mod.Klass = type("Klass", (), {})  # type: ignore[attr-defined]
    mod._hidden = lambda ctx: 2  # type: ignore[attr-defined]
    assert lookup(mod, "step")(None) == 1
    with pytest.raises(NotFound):
        lookup(mod, "missing")
    for name in ("CONSTANT", "Klass", "_hidden", "os.system", "__import__", "a b"):
        with pytest.raises((InvalidArgument, NotFound)):
            lookup(mod, name)
