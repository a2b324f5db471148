"""Codec: Message <-> list of frames. This is the trust boundary.

Rules of this module (see RELIABILITY.md, "Facts that bite"):

* The header frame's size is capped *before* msgpack sees it; msgpack runs with
  explicit limits, ``raw=False``, ``strict_map_key=True`` and no ext types.
* The decoded header is validated against a schema, then the op's body schema.
* Buffer dtypes come from an allow-list of little-endian numeric types; ``ndim``
  is bounded, dims are non-negative and ``prod(shape) * itemsize`` must equal the
  frame's length exactly.
* Buffers are never copied: ``encode`` returns the arrays themselves (the
  transport sends them with ``copy=False``) and ``decode`` wraps frames with
  ``np.frombuffer`` (read-only views).
* Nothing is ever pickled or unpickled.
* Every failure is a :class:`ProtocolError`; if the request id was readable it is
  attached as ``request_id`` so the server can send an error reply.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from zmqps.wire.errors import ProtocolError
from zmqps.wire.messages import (
    ERROR,
    KINDS,
    OK,
    PROTOCOL_VERSION,
    REQUEST_OPS,
    Message,
    Tensor,
)
from zmqps.wire.ops import REQUEST_BODIES
from zmqps.wire.schema import AnyList, AnyMap, Float, Int, Map, Str

__all__ = [
    "DTYPES",
    "Limits",
    "bfloat16",
    "buffer_specs",
    "check_spec",
    "decode",
    "encode",
    "is_bfloat16",
    "tensor_spec",
    "wire_dtype",
]


@functools.cache
def bfloat16() -> np.dtype[Any]:
    """numpy's bfloat16 (``ml_dtypes``), imported on first use: importing ``ml_dtypes``
    takes over a second (1.3 s here), which every process would pay at start-up
    (a status query, each task of a launch) though only a bfloat16 wire needs it."""
    import ml_dtypes

    dtype: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return dtype


def is_bfloat16(dtype: Any) -> bool:
    """Whether ``dtype`` (a numpy dtype or its name) is bfloat16, without importing it."""
    kind = getattr(dtype, "kind", None)
    if kind is None:
        return bool(dtype == "bfloat16")
    # numpy counts bfloat16 a void ("V"); a dtype's name is built anew on every read
    # (slow, on every tensor of every message): only a void's is read
    return kind == "V" and bool(dtype.name == "bfloat16")


class _Dtypes(Mapping[str, "np.dtype[Any]"]):
    """Wire dtype name -> numpy dtype; bfloat16's is looked up only when asked for."""

    def __init__(self, fixed: dict[str, np.dtype[Any]]) -> None:
        self._fixed = fixed

    def __getitem__(self, name: str) -> np.dtype[Any]:
        if name == "bfloat16":
            return bfloat16()
        return self._fixed[name]

    def __contains__(self, name: object) -> bool:
        return name == "bfloat16" or name in self._fixed

    def __iter__(self) -> Iterator[str]:
        yield from self._fixed
        yield "bfloat16"

    def __len__(self) -> int:
        return len(self._fixed) + 1


_FIXED: dict[str, np.dtype[Any]] = {
    name: np.dtype(code)
    for name, code in {
        "bool": "?",
        "int8": "i1",
        "uint8": "u1",
        "int16": "<i2",
        "uint16": "<u2",
        "int32": "<i4",
        "uint32": "<u4",
        "int64": "<i8",
        "uint64": "<u8",
        "float16": "<f2",
        "float32": "<f4",
        "float64": "<f8",
    }.items()
}
#: Wire dtype name -> numpy dtype. Nothing outside this table ever crosses the wire.
#: bfloat16 (``ml_dtypes``): a variable's values and gradients on a lighter wire.
DTYPES: Mapping[str, np.dtype[Any]] = _Dtypes(_FIXED)
_NAME_OF = {dt.newbyteorder("<") if dt.itemsize > 1 else dt: name for name, dt in _FIXED.items()}

MAX_NDIM = 8


@dataclass(frozen=True)
class Limits:
    """Decoder limits. The defaults fit placements of tens of thousands of shards."""

    max_header_bytes: int = 1 << 20
    max_buffers: int = 1 << 16
    max_buffer_bytes: int = 1 << 30
    max_str_len: int = 1 << 16
    max_array_len: int = 1 << 17
    max_map_len: int = 1 << 14  # a map keyed by worker names holds up to 8192


DEFAULT_LIMITS = Limits()

#: the highest PS slot a request may name (a PS index)
MAX_SLOT = 1 << 20

# "bufs" holds mixed-type specs and is checked by _check_spec; "body" by the op's schema.
_HEADER = Map(
    {"v": Int(0, 2**31), "op": Str(32), "id": Int(0, 2**63 - 1), "body": AnyMap()},
    {"from": Str(128), "bufs": AnyList(), "dl": Float(0.0), "slot": Int(0, MAX_SLOT)},
)


#: wire names of the numpy dtypes met so far (only allowed ones: a handful)
_WIRE_NAMES: dict[np.dtype[Any], str] = {}


def wire_dtype(dtype: Any) -> str:
    """The wire name of ``dtype``; raises ProtocolError if it is not allowed."""
    if isinstance(dtype, np.dtype):
        known = _WIRE_NAMES.get(dtype)
        if known is None:
            known = _WIRE_NAMES[dtype] = _wire_name(dtype)
        return known
    return _wire_name(dtype)


def _wire_name(dtype: Any) -> str:
    if is_bfloat16(dtype):
        return "bfloat16"
    dt = np.dtype(dtype)
    key = dt.newbyteorder("<") if dt.itemsize > 1 and dt.byteorder != "|" else dt
    name = _NAME_OF.get(key)
    if name is None or dt.byteorder == ">":
        raise ProtocolError(f"dtype {dt.str} is not allowed on the wire")
    return name


def tensor_spec(t: Tensor) -> list[Any]:
    """What the header says of tensor ``t``: ``[dtype, shape, kind, ref, offset]``."""
    arr = t.array
    if not arr.flags.c_contiguous:
        raise ProtocolError("tensor arrays must be C-contiguous")
    if t.kind not in KINDS:
        raise ProtocolError(f"unknown tensor kind {t.kind!r}")
    return [wire_dtype(arr.dtype), list(arr.shape), t.kind, t.ref, t.offset]


def encode(msg: Message) -> list[Any]:
    """Frames for ``msg``: the packed header, then each tensor's array (not copied)."""
    specs = []
    frames: list[Any] = [b""]
    for t in msg.tensors:
        specs.append(tensor_spec(t))
        arr = t.array
        # bfloat16 has no buffer-protocol format: its bits go as uint16 (same bytes)
        frames.append(arr.view(np.uint16) if is_bfloat16(arr.dtype) else arr)
    header: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "op": msg.op,
        "id": msg.id,
        "body": dict(msg.body),
    }
    if msg.sender:
        header["from"] = msg.sender
    if specs:
        header["bufs"] = specs
    if msg.deadline is not None:
        header["dl"] = msg.deadline
    if msg.slot is not None:
        header["slot"] = msg.slot
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def _unpack_header(frame: memoryview, limits: Limits) -> Any:
    if frame.nbytes > limits.max_header_bytes:
        raise ProtocolError(
            f"header frame of {frame.nbytes} bytes exceeds {limits.max_header_bytes}"
        )
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=limits.max_str_len,
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"undecodable header: {type(exc).__name__}: {exc}"[:300]) from None


def _brief(value: Any, n: int) -> str:
    """A short description of an untrusted value: never its repr, which can recurse
    (msgpack nests ~1000 deep, past Python's recursion limit) or be huge."""
    if type(value) in (str, int, float, bool) or value is None:
        return repr(value)[:n]
    return f"<{type(value).__name__}>"


def check_spec(
    spec: Any, i: int, max_bytes: int, where: str = "header.bufs"
) -> tuple[np.dtype[Any], tuple[int, ...], str, int, int]:
    """The dtype, shape, kind, ref and offset of buffer spec ``spec`` (``where[i]``),
    checked: an allowed dtype and kind, at most ``max_bytes``."""
    if type(spec) is not list or len(spec) != 5:
        raise ProtocolError(f"{where}[{i}]: expected [dtype, shape, kind, ref, offset]")
    name, shape, kind, ref, offset = spec
    if type(name) is not str or name not in DTYPES:
        raise ProtocolError(f"{where}[{i}]: dtype {_brief(name, 32)} is not allowed")
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise ProtocolError(f"{where}[{i}]: shape must be a list of at most {MAX_NDIM} dims")
    dtype = DTYPES[name]
    # A zero dim makes the byte count 0 whatever the others are, but numpy still
    # refuses shapes whose non-zero dims overflow (ValueError): bound them too.
    span = dtype.itemsize
    for d in shape:
        if type(d) is not int or d < 0:
            raise ProtocolError(f"{where}[{i}]: dims must be non-negative ints")
        span *= d or 1
    if span > max_bytes:
        raise ProtocolError(f"{where}[{i}]: shape {shape[:MAX_NDIM]} exceeds {max_bytes} bytes")
    if type(kind) is not str or kind not in KINDS:
        raise ProtocolError(f"{where}[{i}]: unknown kind {_brief(kind, 32)}")
    if type(ref) is not int or not -1 <= ref <= _MAX_REF:
        _REF.check(ref, f"{where}[{i}].ref")  # says what is wrong
    if type(offset) is not int or not 0 <= offset <= _MAX_OFFSET:
        _OFFSET.check(offset, f"{where}[{i}].offset")
    return dtype, tuple(shape), kind, ref, offset


_MAX_REF, _MAX_OFFSET = 2**31 - 1, 2**62
_REF, _OFFSET = Int(-1, _MAX_REF), Int(0, _MAX_OFFSET)


def buffer_specs(
    frame: Any, limits: Limits = DEFAULT_LIMITS
) -> tuple[int | None, list[tuple[np.dtype[Any], tuple[int, ...], str, int, int]]]:
    """A message's id and its buffers' specs (checked, as :func:`decode` checks them),
    read off its header frame alone: where its buffers may go before they are read.
    The message itself is still checked whole by :func:`decode`."""
    header = _unpack_header(memoryview(frame), limits)
    if type(header) is not dict:
        raise ProtocolError("header is not a map")
    rid = header.get("id")
    if type(rid) is not int or not 0 <= rid < 2**63:
        rid = None
    bufs = header.get("bufs", [])
    if type(bufs) is not list or len(bufs) > limits.max_buffers:
        raise ProtocolError("header.bufs: expected a bounded list")
    return rid, [check_spec(spec, i, limits.max_buffer_bytes) for i, spec in enumerate(bufs)]


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate and decode ``frames`` (bytes, memoryviews or zmq Frames) into a Message."""
    if not frames:
        raise ProtocolError("empty message")
    header = _unpack_header(memoryview(frames[0]), limits)
    if type(header) is not dict:
        raise ProtocolError("header is not a map")
    request_id = header.get("id")
    if type(request_id) is not int or not 0 <= request_id < 2**63:
        request_id = None
    try:
        return _decode_checked(header, frames, limits)
    except ProtocolError as exc:
        exc.request_id = request_id  # type: ignore[attr-defined]
        raise


def _decode_checked(header: dict[str, Any], frames: Sequence[Any], limits: Limits) -> Message:
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported protocol version {_brief(version, 20)}"
            f" (this side speaks {PROTOCOL_VERSION})"
        )
    bufs = header.get("bufs", [])
    _HEADER.check(header, "header")
    op = header["op"]
    body = header["body"]
    if op in REQUEST_OPS:
        REQUEST_BODIES[op].check(body, f"{op}.body")
    elif op == ERROR:
        Map({"code": Str(64), "message": Str(4096)}).check(body, "error.body")
    elif op != OK:
        raise ProtocolError(f"unknown op {op!r}")
    if type(bufs) is not list or len(bufs) > limits.max_buffers:
        raise ProtocolError("header.bufs: expected a bounded list")
    if len(bufs) != len(frames) - 1:
        raise ProtocolError(f"header announces {len(bufs)} buffers, message has {len(frames) - 1}")
    tensors = []
    for i, spec in enumerate(bufs):
        dtype, shape, kind, ref, offset = check_spec(spec, i, limits.max_buffer_bytes)
        frame = memoryview(frames[i + 1])
        expected = dtype.itemsize
        for d in shape:
            expected *= d
        if expected != frame.nbytes:
            raise ProtocolError(
                f"header.bufs[{i}]: shape {list(shape)} of {dtype.name} needs {expected} bytes,"
                f" frame has {frame.nbytes}"
            )
        if frame.nbytes > limits.max_buffer_bytes:
            raise ProtocolError(f"buffer {i} exceeds {limits.max_buffer_bytes} bytes")
        arr: npt.NDArray[Any] = np.frombuffer(frame, dtype=dtype).reshape(shape)
        tensors.append(Tensor(arr, kind, ref, offset))
    return Message(
        op=op,
        id=header["id"],
        sender=header.get("from", ""),
        body=body,
        tensors=tuple(tensors),
        deadline=header.get("dl"),
        slot=header.get("slot"),
    )
