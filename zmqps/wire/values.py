"""Values of scheduled functions on the wire: nested Python data <-> (tree, tensors).

Rules of this module:

* Arguments and results of coordinator-mode functions cross the wire as a msgpack
  tree in the header plus one raw buffer per numpy array, like every other message:
  nothing is ever pickled, and nothing but the types below is accepted.
* A tree is a scalar (None, bool, int in int64, float, str) or a ``[tag, payload]``
  node: ``l`` list, ``t`` tuple, ``d`` dict with str keys, ``a`` array (payload: the
  buffer's index), ``s`` numpy scalar (a 0-d buffer), ``r`` per-worker resource (its
  id). Bytes travel as uint8 arrays.
* The receiving side checks the tree with :class:`zmqps.wire.schema.Tree` (bounded
  depth and size, walked without recursion) before :func:`decode_value` sees it, and
  every buffer index is checked against the buffers the message carries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from zmqps.wire.codec import wire_dtype
from zmqps.wire.errors import InvalidArgument, ProtocolError
from zmqps.wire.messages import Tensor, as_wire_array
from zmqps.wire.schema import Tree

__all__ = ["MAX_DEPTH", "ResourceRef", "decode_value", "encode_value"]

#: How deep a value may nest (the schema refuses deeper trees on receipt).
MAX_DEPTH = Tree().max_depth
_INT64 = (-(2**63), 2**63 - 1)


class ResourceRef:
    """A value that stands for a per-worker resource (e.g. a dataset iterator): each
    worker substitutes its own object for it when it runs the function."""

    __slots__ = ("id",)

    def __init__(self, id: int) -> None:
        self.id = int(id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id})"


def encode_value(value: Any) -> tuple[Any, list[Tensor]]:
    """``value`` as a (tree, tensors) pair; arrays are passed on without a copy when
    they are already C-contiguous little-endian. InvalidArgument names the first value
    that cannot cross the wire."""
    tensors: list[Tensor] = []
    return _encode(value, tensors, 0, "value"), tensors


def _encode(v: Any, tensors: list[Tensor], depth: int, path: str) -> Any:
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        if not _INT64[0] <= v <= _INT64[1]:
            raise InvalidArgument(f"{path}: int {v} does not fit in int64")
        return int(v)
    if isinstance(v, float):
        return float(v)
    if depth >= MAX_DEPTH:
        raise InvalidArgument(f"{path}: nested deeper than {MAX_DEPTH}")
    if isinstance(v, ResourceRef):
        return ["r", v.id]
    if isinstance(v, np.ndarray):
        return ["a", _buffer(v, tensors, path)]
    if isinstance(v, np.generic):
        return ["s", _buffer(np.asarray(v), tensors, path)]
    if isinstance(v, (bytes, bytearray, memoryview)):
        return ["a", _buffer(np.frombuffer(bytes(v), np.uint8), tensors, path)]
    if isinstance(v, tuple):
        return ["t", [_encode(x, tensors, depth + 1, f"{path}[{i}]") for i, x in enumerate(v)]]
    if isinstance(v, list):
        return ["l", [_encode(x, tensors, depth + 1, f"{path}[{i}]") for i, x in enumerate(v)]]
    if isinstance(v, Mapping):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise InvalidArgument(f"{path}: dict keys must be str, got {type(k).__name__}")
            out[k] = _encode(x, tensors, depth + 1, f"{path}[{k!r}]")
        return ["d", out]
    raise InvalidArgument(
        f"{path}: a {type(v).__name__} cannot cross the wire (numbers, str, None, numpy"
        " arrays and lists / tuples / dicts of them can; never pickled objects)"
    )


def _buffer(arr: np.ndarray, tensors: list[Tensor], path: str) -> int:
    # as_wire_array (np.ascontiguousarray) makes 0-d arrays 1-d: keep the shape
    wire = as_wire_array(arr).reshape(arr.shape)
    try:
        wire_dtype(wire.dtype)
    except ProtocolError:
        raise InvalidArgument(
            f"{path}: arrays of dtype {arr.dtype} cannot cross the wire"
        ) from None
    tensors.append(Tensor(wire))
    return len(tensors) - 1


def decode_value(
    tree: Any,
    tensors: Sequence[Tensor],
    resolve: Callable[[int], Any] | None = None,
) -> Any:
    """The value of a tree already checked by :class:`~zmqps.wire.schema.Tree`. Arrays
    are read-only views of the received frames; ``resolve`` turns a resource id into
    this side's object (ProtocolError without one)."""
    if tree is None or type(tree) in (bool, int, float, str):
        return tree
    tag, payload = tree
    if tag == "l":
        return [decode_value(x, tensors, resolve) for x in payload]
    if tag == "t":
        return tuple(decode_value(x, tensors, resolve) for x in payload)
    if tag == "d":
        return {k: decode_value(x, tensors, resolve) for k, x in payload.items()}
    if tag == "r":
        if resolve is None:
            raise ProtocolError("a per-worker resource cannot be resolved here")
        return resolve(payload)
    if payload >= len(tensors):
        raise ProtocolError(f"value refers to buffer {payload} of {len(tensors)}")
    arr = tensors[payload].array
    if tag == "s":
        if arr.ndim != 0:
            raise ProtocolError("a numpy scalar travels as a 0-d buffer")
        return arr[()]
    return arr
