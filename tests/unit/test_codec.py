"""The wire codec, sans IO: frames in, messages out (and back), and nothing but
ProtocolError for anything a peer can send."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from zmqps.core.variables import ShardDef, VariableDef
from zmqps.wire import (
    DTYPES,
    ERROR,
    OK,
    PROTOCOL_VERSION,
    Limits,
    Message,
    Tensor,
    decode,
    encode,
    error_reply,
    reply,
    request,
    wire_dtype,
)
from zmqps.wire.codec import DEFAULT_LIMITS, MAX_NDIM
from zmqps.wire.errors import (
    FencedError,
    InvalidArgument,
    NotFound,
    ProtocolError,
    RemoteError,
    Superseded,
    error_from_code,
)
from zmqps.wire.messages import KINDS, REQUEST_OPS
from zmqps.wire.schema import REQUEST_BODIES, Int, List, Map

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

WHO = {"role": "worker", "index": 3, "incarnation": 2}
PUSH = {"shards": [0, 4], "versions": [7, 0], "worker": "worker:3", "inc": 2, "seq": 11}

#: A valid body for every request op, exercising every optional field.
BODIES: dict[str, dict[str, Any]] = {
    "ping": {},
    "register": {**WHO, "steps_planned": 1000, "address": "10.0.0.3:2222"},
    "heartbeat": {**WHO, "step": 12, "loss": 0.25, "examples": 640},
    "leave": {**WHO, "step": 99, "reason": "done", "examples": 6400},
    "create_vars": {
        "variables": [
            VariableDef(
                "w",
                (784, 10),
                "float32",
                init={"name": "normal", "seed": 1, "mean": 0.0, "stddev": 0.1},
                optimizer={"name": "adam", "lr": 0.001, "beta1": 0.9, "beta2": 0.999},
            ).to_wire(),
            VariableDef("emb", (1000, 8), "float16", sparse=True).to_wire(),
        ],
        "optimizer": {"name": "momentum", "lr": 0.1, "momentum": 0.9, "nesterov": True},
    },
    "get_placement": {"wait": 2.5},
    "create_shards": {
        "shards": [
            ShardDef(
                id=5,
                var="w",
                index=1,
                dtype="float64",
                full_shape=(100, 3, 2),
                row_start=50,
                rows=50,
                init={"name": "uniform", "low": -1.0, "high": 1.0, "seed": 3},
                optimizer={"name": "sgd", "lr": 0.5, "weight_decay": 0.01},
            ).to_wire()
        ]
    },
    "pull": {"shards": [0, 1, 2], "gen": 1},
    "push": {**PUSH, "step": 3, "gen": 2},
    "push_pull": dict(PUSH),
    "pull_rows": {"shards": [9], "create": False},
    "table_rows": {"shard": 9, "start": 4096, "limit": 1024, "gen": 2},
    "push_rows": dict(PUSH),
    "push_pull_rows": {**PUSH, "pull": [3, 4], "create": False},
    "shm_attach": {"name": "zmqps-" + "ab" * 16, "size": 4096, "worker": "worker:0", "inc": 3},
    "shm_detach": {"region": 2},
    "seal_hello": {"random": "ab" * 32},
    "sync_config": {"mode": "sync", "required": 2},
    "wait_step": {"step": 3, "wait": 1.5},
    "take_token": {"role": "worker", "index": 0, "incarnation": 1, "wait": 2.0},
    "ssp_clock": {"role": "worker", "index": 1, "incarnation": 1, "completed": 4},
    "status": {},
    "shutdown": {"reason": "end of job"},
    "scale": {"ps": 2},
    "ps_state": {},
    "fence": {"worker": "worker:1", "inc": 17},
    "checkpoint": {"wait": 30.0},
    "checkpoint_save": {"name": ".tmp-ckpt-000000000012-ab12", "id": 7},
    "checkpoint_done": {"id": 7, "wait": 5.0},
    "restore": {"gen": 1, "step": 12, "shards": [], "name": "ckpt-000000000012"},
    "run": {
        "fn": "train_step",
        "args": ["t", []],
        "kwargs": ["d", {}],
        "steps": 10,
        "closure": 3,
        "inc": 5,
    },
    "make_resource": {"id": 1, "fn": "dataset", "args": ["t", []], "kwargs": ["d", {}], "inc": 5},
    "replica": {"slot": 2, "term": 3, "primary": True, "backups": [[0, "tcp://127.0.0.1:5"]]},
    "replicate": {"term": 3, "index": 9, "op": "fence", "body": {"worker": "w", "inc": 1}},
    "placement": {
        "placement": {
            "variables": [VariableDef("w", (4, 2)).to_wire()],
            "shards": [[0, "w", 0, 0, 4, 1]],
            "optimizer": {"name": "sgd", "lr": 0.1},
            "backups": [[2]],
            "epoch": 7,
        }
    },
    "join": {"slot": 1, "term": 2, "ps": 3, "endpoint": "tcp://127.0.0.1:5", "rate": 1e6},
    "replica_ring": {"term": 2, "name": "zmqps-" + "0" * 32, "size": 1 << 20},
    "install": {
        "term": 2,
        "index": 7,
        "part": 0,
        "last": False,
        "items": [[4, "values", 0, "float32", [3, 2]]],
        "meta": {},
    },
}

#: Fields holding a value tree (zmqps.wire.values): any scalar is a valid leaf and a
#: dict node's payload takes any str key, so only the node's own shape is mutated here
#: (the Tree schema has its own tests).
TREE_FIELDS = {("run", "args"), ("run", "kwargs"), ("make_resource", "args"),
               ("make_resource", "kwargs")}  # fmt: skip


#: maps whose content the receiving code checks (a copy's ledgers), not the codec
FREE_MAPS = {("install", "meta"), ("install", "state")}


def _inside_tree(op: str, path: tuple[Any, ...]) -> bool:
    if path and (op, path[0]) in FREE_MAPS:
        return True
    return len(path) >= 2 and (op, path[0]) in TREE_FIELDS


def test_every_request_op_has_a_body_here() -> None:
    assert set(BODIES) == set(REQUEST_OPS)


def wire(frames: list[Any]) -> list[bytes]:
    """What a peer receives: every frame as the bytes it holds."""
    return [f if isinstance(f, bytes) else memoryview(f).tobytes() for f in frames]


def roundtrip(msg: Message, limits: Limits | None = None) -> Message:
    return decode(wire(encode(msg)), limits or Limits())


def raw(header: Any, *bufs: bytes) -> list[bytes]:
    """A hand-made message: a header packed as given, then raw buffers."""
    return [msgpack.packb(header, use_bin_type=True), *bufs]


def hdr(op: str = "ping", body: Any = None, **extra: Any) -> dict[str, Any]:
    h: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "op": op,
        "id": 42,
        "body": {} if body is None else body,
    }
    h.update(extra)
    return h


def rejects(frames: list[Any], request_id: int | None = None, limits: Limits | None = None) -> str:
    """Assert that decoding fails with ProtocolError carrying ``request_id``; return its text."""
    with pytest.raises(ProtocolError) as info:
        decode(frames, limits or Limits())
    assert getattr(info.value, "request_id", None) == request_id, str(info.value)
    return str(info.value)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# --------------------------------------------------------------------------- round trips

dtype_names = st.sampled_from(sorted(DTYPES))
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=MAX_NDIM).map(tuple)


@st.composite
def tensors(draw: st.DrawFn) -> Tensor:
    dtype = DTYPES[draw(dtype_names)]
    if dtype == DTYPES["bfloat16"]:  # any bits: hypothesis has no bfloat16 strategy
        arr = draw(hnp.arrays(np.uint16, draw(shapes))).view(dtype)
    else:
        arr = draw(hnp.arrays(dtype, draw(shapes)))
    return Tensor(
        arr,
        draw(st.sampled_from(sorted(KINDS))),
        draw(st.integers(-1, 2**31 - 1)),
        draw(st.integers(0, 2**62)),
    )


@FAST
@given(
    op=st.sampled_from(sorted(BODIES)),
    ts=st.lists(tensors(), max_size=5),
    rid=st.integers(0, 2**63 - 1),
    sender=st.text(max_size=20),
    deadline=st.none() | st.floats(0.0, 1e12),
    slot=st.none() | st.integers(0, 1 << 20),
)
def test_request_roundtrip(
    op: str, ts: list[Tensor], rid: int, sender: str, deadline: float | None, slot: int | None
) -> None:
    msg = request(op, BODIES[op], ts, id=rid, sender=sender, deadline=deadline, slot=slot)
    out = roundtrip(msg)
    assert (out.op, out.id, out.sender, out.deadline, out.slot) == (
        op,
        rid,
        sender,
        deadline,
        slot,
    )
    assert out.body == BODIES[op]
    assert not out.is_reply
    assert len(out.tensors) == len(ts)
    for got, sent in zip(out.tensors, ts, strict=True):
        assert (got.kind, got.ref, got.offset) == (sent.kind, sent.ref, sent.offset)
        assert same_bits(got.array, sent.array)
        assert not got.array.flags.writeable  # a view of the received frame


@FAST
@given(
    ts=st.lists(tensors(), max_size=4),
    body=st.dictionaries(st.text(max_size=8), st.integers(-(2**63), 2**63 - 1)),
)
def test_ok_reply_roundtrip(ts: list[Tensor], body: dict[str, int]) -> None:
    req = request("pull", {"shards": [1]}, id=99)
    out = roundtrip(reply(req, body, ts, sender="ps0"))
    assert (out.op, out.id, out.sender, out.body) == (OK, 99, "ps0", body)
    assert out.is_reply
    assert all(same_bits(g.array, s.array) for g, s in zip(out.tensors, ts, strict=True))


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3), (1, 2, 1, 2, 1, 2, 1, 2)])
def test_every_dtype_and_shape(name: str, shape: tuple[int, ...]) -> None:
    arr = (np.arange(math.prod(shape)) % 7).astype(DTYPES[name]).reshape(shape)
    out = roundtrip(request("push", BODIES["push"], [Tensor(arr, "grad", 4, 12)]))
    (t,) = out.tensors
    assert t.array.dtype == DTYPES[name] and t.array.shape == shape
    assert np.array_equal(t.array, arr)
    assert wire_dtype(t.array.dtype) == name


def test_native_dtype_spellings_map_to_wire_names() -> None:
    assert wire_dtype(np.float32) == "float32"
    assert wire_dtype("=f8") == "float64"
    assert wire_dtype(np.longlong) == "int64"
    assert wire_dtype(np.intc) == "int32"
    assert wire_dtype(np.bool_) == "bool"
    assert wire_dtype("|u1") == "uint8"


# --------------------------------------------------------------------------- zero copy


def test_encode_returns_the_arrays_themselves() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.zeros(0, dtype=np.int64)
    frames = encode(request("push", BODIES["push"], [Tensor(a, "grad", 0), Tensor(b, "index", 4)]))
    assert len(frames) == 3
    assert frames[1] is a and frames[2] is b
    assert isinstance(frames[0], bytes)


@pytest.mark.parametrize("container", [bytes, bytearray, memoryview])
def test_decode_wraps_frames_without_copying(container: type) -> None:
    a = np.arange(1000, dtype=np.float64).reshape(10, 100)
    frames = wire(encode(request("push", BODIES["push"], [Tensor(a, "grad", 0)])))
    frames[1] = container(frames[1])
    (t,) = decode(frames).tensors
    backing = np.frombuffer(frames[1], dtype=np.uint8)
    assert np.shares_memory(t.array, backing)
    assert t.array.ctypes.data == backing.ctypes.data
    assert np.array_equal(t.array, a)
    if container is bytes:
        assert not t.array.flags.writeable


def test_decode_of_encoded_arrays_shares_their_memory() -> None:
    a = np.arange(64, dtype=np.int16).reshape(4, 4, 4)
    (t,) = decode(encode(request("pull", {"shards": [1]}, [Tensor(a)]))).tensors
    assert np.shares_memory(t.array, a)
    assert t.array.shape == a.shape


# --------------------------------------------------------------------------- encode refusals


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(4, dtype=">f4"),
        np.arange(4, dtype=">i8"),
        np.array([1, "x", None], dtype=object),
        np.zeros(3, dtype="V8"),
        np.array(["abcd"], dtype="U4"),
        np.array([b"ab"], dtype="S2"),
        np.zeros(2, dtype=np.complex64),
        np.zeros(2, dtype="datetime64[s]"),
        np.zeros(2, dtype=np.longdouble)
        if np.dtype(np.longdouble).itemsize > 8
        else np.zeros(2, "m8[s]"),
        np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")]),
    ],
    ids=lambda a: a.dtype.str,
)
def test_encode_refuses_dtypes_outside_the_allow_list(arr: np.ndarray) -> None:
    with pytest.raises(ProtocolError, match="not allowed"):
        encode(request("pull", {"shards": [0]}, [Tensor(arr)]))


def test_encode_refuses_non_contiguous_and_unknown_kinds() -> None:
    a = np.arange(20, dtype=np.float32).reshape(4, 5)
    with pytest.raises(ProtocolError, match="contiguous"):
        encode(request("pull", {"shards": [0]}, [Tensor(a[:, ::2])]))
    with pytest.raises(ProtocolError, match="contiguous"):
        encode(request("pull", {"shards": [0]}, [Tensor(a.T)]))
    with pytest.raises(ProtocolError, match="kind"):
        encode(request("pull", {"shards": [0]}, [Tensor(a, "gradient")]))


# --------------------------------------------------------------------------- schema rejections


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*path, i))


def _replace(body: dict[str, Any], path: tuple[Any, ...], new: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    node: Any = out
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = new
    return out


def _wrong_values(v: Any) -> list[Any]:
    """Values of the wrong type for a field holding ``v``. No bytes: msgpack bin makes the
    whole header unreadable, which is tested apart."""
    if isinstance(v, bool):
        return [1, 0, "true", None]
    if isinstance(v, int):
        return [True, False, "1", float(v) + 0.5, None, [v]]
    if isinstance(v, float):
        return ["0.5", True, None, float("nan")]
    if isinstance(v, str):
        return [1, None, ["x"], {"x": 1}]
    if isinstance(v, list):
        return [{}, "x", 1, None]
    if isinstance(v, dict):
        return [[], "x", 1, None]
    raise AssertionError(v)


def _mutants(op: str) -> Iterator[tuple[str, str, tuple[Any, ...], dict[str, Any]]]:
    """(what, label, path of the field touched, body) for every single-field corruption;
    ``what`` is "wrong" (a wrong-typed value), "extra" (an unknown field) or "drop"."""
    body = BODIES[op]
    for path, value in _paths(body):
        if path and not (_inside_tree(op, path) and len(path) > 2):
            for wrong in _wrong_values(value):
                yield "wrong", f"{path}={wrong!r}", path, _replace(body, path, wrong)
    for path, value in _paths(body):
        if not isinstance(value, dict) or _inside_tree(op, path):
            continue
        node = copy.deepcopy(body)
        target: Any = node
        for p in path:
            target = target[p]
        target["zz_unknown"] = 1
        yield "extra", f"{path}+zz_unknown", path, node
        for key in value:
            node = copy.deepcopy(body)
            target = node
            for p in path:
                target = target[p]
            del target[key]
            yield "drop", f"{path}-{key}", (*path, key), node


def _optional(op: str, path: tuple[Any, ...]) -> bool:
    """Whether the field at ``path`` is optional in the op's declared schema."""
    schema: Any = REQUEST_BODIES[op]
    for p in path[:-1]:
        if isinstance(schema, List):
            schema = schema.item
        else:
            schema = {**schema.required, **schema.optional}[p]
    return isinstance(schema, Map) and path[-1] in schema.optional


@pytest.mark.parametrize("op", sorted(BODIES))
def test_schema_rejects_every_wrong_type_unknown_field_and_missing_field(op: str) -> None:
    drops_ok = 0
    for what, label, path, body in _mutants(op):
        optional_drop = what == "drop" and _optional(op, path)
        try:
            decode(wire(encode(request(op, body, id=1234))))
        except ProtocolError as exc:
            assert exc.request_id == 1234, label  # type: ignore[attr-defined]
            assert not optional_drop, f"{op}: {label} refused"
            continue
        # only the removal of an optional field leaves a valid body
        assert optional_drop, f"{op}: {label} was accepted"
        drops_ok += 1
    assert drops_ok == sum(1 for w, _, p, _ in _mutants(op) if w == "drop" and _optional(op, p))


REQUIRED_DROPS = {
    "register": ["role", "index", "incarnation"],
    "heartbeat": ["role", "index", "incarnation", "step"],
    "leave": ["step"],
    "create_vars": ["variables"],
    "create_shards": ["shards"],
    "pull": ["shards"],
    "push": ["shards", "versions", "worker", "inc", "seq"],
    "push_pull": ["seq"],
    "pull_rows": ["shards"],
    "push_rows": ["worker"],
    "push_pull_rows": ["seq"],
    "table_rows": ["shard", "start", "limit"],
}


@pytest.mark.parametrize(("op", "field"), [(o, f) for o, fs in REQUIRED_DROPS.items() for f in fs])
def test_missing_required_field(op: str, field: str) -> None:
    body = {k: v for k, v in BODIES[op].items() if k != field}
    text = rejects(wire(encode(request(op, body, id=5))), 5)
    assert "missing" in text and field in text


@pytest.mark.parametrize(
    ("op", "body"),
    [
        ("push", {**PUSH, "seq": True}),  # bool is not an int
        ("push", {**PUSH, "inc": False}),
        ("push", {**PUSH, "shards": [True]}),
        ("push", {**PUSH, "seq": -1}),
        ("push", {**PUSH, "shards": [-1]}),
        ("push", {**PUSH, "shards": [2**31]}),
        ("push", {**PUSH, "versions": [-3, 0]}),
        ("push", {**PUSH, "worker": "w" * 65}),
        ("push", {**PUSH, "seq": 2**63}),
        ("push", {**PUSH, "shards": list(range(65537))}),  # longer than MAX_SHARDS
        ("pull", {"shards": "0"}),
        ("pull_rows", {"shards": [0], "create": 0}),  # not a bool
        ("push_pull_rows", {**PUSH, "pull": [-1]}),
        ("push_pull_rows", {**PUSH, "pull": "3"}),
        ("push_pull_rows", {**PUSH, "pull": [3], "create": 1}),  # not a bool
        ("table_rows", {"shard": 0, "start": -1, "limit": 8}),
        ("table_rows", {"shard": 0, "start": 0, "limit": 0}),
        ("pull", {"shards": [1.0]}),
        ("heartbeat", {**WHO, "step": 1, "loss": float("nan")}),
        ("heartbeat", {**WHO, "step": 1, "loss": True}),
        ("register", {**WHO, "index": 1 << 21}),
        ("get_placement", {"wait": -1.0}),
        ("get_placement", {"wait": 3601.0}),
        ("get_placement", {"wait": 301.0}),  # above MAX_WAIT_S
        (
            "create_vars",
            {"variables": [{**BODIES["create_vars"]["variables"][0], "shape": [-1, 4]}]},
        ),
        (
            "create_vars",
            {"variables": [{**BODIES["create_vars"]["variables"][0], "shape": [1] * 9}]},
        ),
        (
            "create_vars",
            {"variables": [{**BODIES["create_vars"]["variables"][0], "shape": [2**49]}]},
        ),
        ("create_vars", {"variables": [{**BODIES["create_vars"]["variables"][0], "sparse": 1}]}),
        ("create_vars", {"variables": [], "optimizer": {"name": "sgd", "lr": -0.1}}),
        (
            "create_vars",
            {"variables": [], "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 1.5}},
        ),
        ("create_shards", {"shards": [{**BODIES["create_shards"]["shards"][0], "rows": -1}]}),
        (
            "create_shards",
            {"shards": [{**BODIES["create_shards"]["shards"][0], "full_shape": [1] * 9}]},
        ),
        ("create_shards", {"shards": [{**BODIES["create_shards"]["shards"][0], "index": 1 << 17}]}),
        ("shutdown", {"reason": "x" * 257}),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_field_values_out_of_range(op: str, body: dict[str, Any]) -> None:
    rejects(wire(encode(request(op, body, id=77))), 77)


@given(
    st.lists(
        st.one_of(
            st.integers(-5, 20), st.booleans(), st.floats(allow_nan=True), st.text(max_size=2)
        ),
        max_size=12,
    )
)
def test_int_lists_are_checked_item_by_item(items: list[Any]) -> None:
    """A list of ints is checked in one loop (no call per item): it accepts and refuses
    exactly what checking each item does, and names the first bad one."""
    schema = List(Int(0, 9))
    first_bad = next(
        (i for i, v in enumerate(items) if type(v) is not int or not 0 <= v <= 9), None
    )
    if first_bad is None:
        schema.check(items, "body.shards")
        return
    with pytest.raises(ProtocolError, match=rf"^body\.shards\[{first_bad}\]: "):
        schema.check(items, "body.shards")


def test_header_checks_attach_the_request_id_when_readable() -> None:
    assert "version" in rejects(raw(hdr(v=2)), 42)
    assert "version" in rejects(raw(hdr(v="1")), 42)
    rejects(raw({k: v for k, v in hdr().items() if k != "v"}), 42)
    rejects(raw(hdr(v=True)), 42)  # True == 1 in Python, not on this wire
    assert "unknown op" in rejects(raw(hdr(op="frobnicate")), 42)
    rejects(raw(hdr(op=7)), 42)
    rejects(raw(hdr(op="x" * 33)), 42)
    rejects(raw(hdr(body=[])), 42)
    rejects(raw({k: v for k, v in hdr().items() if k != "body"}), 42)
    rejects(raw(hdr(extra=1)), 42)
    rejects(raw(hdr(**{"from": "x" * 129})), 42)
    rejects(raw(hdr(dl=-1.0)), 42)
    rejects(raw(hdr(dl=float("nan"))), 42)
    rejects(raw(hdr(dl="soon")), 42)
    rejects(raw(hdr(bufs={})), 42)
    rejects(raw(hdr(op="error", body={"code": "x"})), 42)  # error reply without message
    rejects(raw(hdr(op="error", body={"code": "x", "message": "m", "more": 1})), 42)
    rejects(raw(hdr(op="error", body={"code": "x", "message": "m" * 4097})), 42)


@pytest.mark.parametrize("bad_id", [-1, 2**63, 2**64 - 1, "7", 7.0, True, None, [7]])
def test_unreadable_request_id_is_not_attached(bad_id: Any) -> None:
    rejects(raw({**hdr(), "id": bad_id}), None)
    rejects(raw({**hdr(v=9), "id": bad_id}), None)


def test_missing_id_is_not_attached() -> None:
    rejects(raw({k: v for k, v in hdr().items() if k != "id"}), None)


# --------------------------------------------------------------------------- buffer specs


def spec_msg(*specs: Any, bufs: list[bytes] | None = None) -> list[bytes]:
    frames = raw(hdr("pull", {"shards": [0]}, bufs=list(specs)))
    return frames + (bufs if bufs is not None else [b"\0" * 8] * len(specs))


@pytest.mark.parametrize(
    "spec",
    [
        ["float128", [2], "value", 0, 0],
        ["object", [1], "value", 0, 0],
        [">f4", [2], "value", 0, 0],
        ["<f4", [2], "value", 0, 0],  # numpy spellings are not wire names
        ["V8", [1], "value", 0, 0],
        ["U4", [1], "value", 0, 0],
        ["O", [1], "value", 0, 0],
        [4, [2], "value", 0, 0],
        ["float32", [-2], "value", 0, 0],
        ["float32", [2, -1], "value", 0, 0],
        ["float32", [1] * 9, "value", 0, 0],
        ["float32", [2.0], "value", 0, 0],
        ["float32", [True, 2], "value", 0, 0],
        ["float32", 2, "value", 0, 0],
        ["float32", [2], "weights", 0, 0],
        ["float32", [2], 1, 0, 0],
        ["float32", [2], "value", -2, 0],
        ["float32", [2], "value", 2**31, 0],
        ["float32", [2], "value", True, 0],
        ["float32", [2], "value", 0, -1],
        ["float32", [2], "value", 0, 2**62 + 1],
        ["float32", [2], "value", 0],
        ["float32", [2], "value", 0, 0, 0],
        {"dtype": "float32"},
        "float32",
        None,
    ],
)
def test_bad_buffer_specs(spec: Any) -> None:
    rejects(spec_msg(spec), 42)


def test_shape_and_length_must_agree() -> None:
    ok = ["float32", [2], "value", 0, 0]
    assert len(decode(spec_msg(ok)).tensors) == 1
    assert "needs 8 bytes" in rejects(spec_msg(ok, bufs=[b"\0" * 7]), 42)
    rejects(spec_msg(ok, bufs=[b"\0" * 9]), 42)
    rejects(spec_msg(["float64", [3, 2], "value", 0, 0], bufs=[b"\0" * 40]), 42)
    rejects(spec_msg(["float32", [0], "value", 0, 0], bufs=[b"\0"]), 42)
    rejects(spec_msg(["float32", [], "value", 0, 0], bufs=[b""]), 42)


@pytest.mark.parametrize(
    "shape",
    [
        [2**62, 2**62],  # the byte count is a huge int: no overflow, just a mismatch
        [2**64 - 1],
        [2**32, 2**32, 2**32, 2**32, 2**32, 2**32, 2**32, 2**32],
        [0, 2**62, 2**62],  # zero elements, but numpy cannot even describe the shape
        [0, 2**64 - 1],
        [2**63, 0],
        [0, 2**31, 2**31, 2**31],
        [0, 2**40],
    ],
)
def test_huge_declared_shapes(shape: list[int]) -> None:
    rejects(spec_msg(["float32", shape, "value", 0, 0], bufs=[b"\0" * 4]), 42)
    rejects(spec_msg(["float32", shape, "value", 0, 0], bufs=[b""]), 42)


def test_extra_and_missing_buffer_frames() -> None:
    ok = ["int8", [4], "index", 1, 0]
    assert "announces 1 buffers, message has 2" in rejects(spec_msg(ok, bufs=[b"abcd", b"x"]), 42)
    rejects(spec_msg(ok, bufs=[]), 42)
    rejects(spec_msg(ok, ok, bufs=[b"abcd"]), 42)
    rejects([*raw(hdr("pull", {"shards": [0]})), b"stray"], 42)


def test_limits_on_buffers() -> None:
    ok = ["uint8", [32], "value", 0, 0]
    rejects(spec_msg(ok, bufs=[b"\0" * 32]), 42, Limits(max_buffer_bytes=16))
    decode(spec_msg(ok, bufs=[b"\0" * 32]), Limits(max_buffer_bytes=32))
    three = spec_msg(ok, ok, ok, bufs=[b"\0" * 32] * 3)
    rejects(three, 42, Limits(max_buffers=2))
    assert len(decode(three, Limits(max_buffers=3)).tensors) == 3


# --------------------------------------------------------------------------- error replies


@pytest.mark.parametrize(
    ("err", "code", "typ"),
    [
        (NotFound("no shard 3"), "not_found", NotFound),
        (InvalidArgument("bad shape"), "invalid_argument", InvalidArgument),
        (FencedError("old incarnation"), "fenced", FencedError),
        (Superseded("term 1 < 2"), "superseded", Superseded),
        (ProtocolError("bad frame"), "protocol", ProtocolError),
        (ValueError("boom"), "internal", RemoteError),
        (KeyError(), "internal", RemoteError),
    ],
)
def test_error_replies(err: Exception, code: str, typ: type) -> None:
    out = roundtrip(error_reply(31, err, sender="ps1"))
    assert (out.op, out.id, out.sender) == (ERROR, 31, "ps1")
    assert out.is_reply
    assert out.body["code"] == code
    assert out.body["message"]  # never empty: falls back to the type name
    exc = error_from_code(out.body["code"], out.body["message"])
    assert type(exc) is typ
    if typ is RemoteError:
        assert exc.code == "internal"


def test_error_reply_message_is_bounded() -> None:
    out = roundtrip(error_reply(1, InvalidArgument("x" * 100_000)))
    assert len(out.body["message"]) <= 4096


# --------------------------------------------------------------------------- hostile input


def _oversized_nested_header() -> bytes:
    """1 MiB (minus one byte) of nested one-element arrays: a classic msgpack bomb."""
    return b"\x91" * ((1 << 20) - 2) + b"\xc0"


def _deep(depth: int, leaf: bytes = b"\x01") -> bytes:
    return b"\x91" * depth + leaf


def _map_with(fields: list[tuple[bytes, bytes]]) -> bytes:
    assert len(fields) < 16
    return bytes([0x80 | len(fields)]) + b"".join(k + v for k, v in fields)


def _s(text: str) -> bytes:
    return msgpack.packb(text)


def _header_fields(
    v: bytes = b"\x01", op: bytes = b"", body: bytes = b"\x80"
) -> list[tuple[bytes, bytes]]:
    return [
        (_s("v"), v),
        (_s("op"), op or _s("ping")),
        (_s("id"), msgpack.packb(42)),
        (_s("body"), body),
    ]


CRAFTED_UNREADABLE: dict[str, list[bytes]] = {
    "empty header": [b""],
    "nil": [b"\xc0"],
    "truncated map": [b"\x84\xa1v"],
    "1 MiB nested arrays": [_oversized_nested_header()],
    "nesting past msgpack's stack": [_deep(5000)],
    "map32 declares 4G entries": [b"\xdf\xff\xff\xff\xff"],
    "array32 declares 4G items": [b"\xdd\xff\xff\xff\xff" + b"\x01" * 64],
    "str32 declares 4 GB": [b"\xdb\xff\xff\xff\xff" + b"a" * 64],
    "bin32 declares 4 GB": [b"\xc6\xff\xff\xff\xff"],
    "array16 past max_array_len": [msgpack.packb([0] * ((1 << 17) + 1))],
    "map past max_map_len": [
        msgpack.packb({str(i): 0 for i in range(DEFAULT_LIMITS.max_map_len + 1)})
    ],
    "string past max_str_len": [msgpack.packb({"v": 1, "op": "x" * 70_000, "id": 1, "body": {}})],
    "fixext1 in header": [_map_with([*_header_fields(), (_s("x"), b"\xd4\x05\x00")])],
    "ext8 in header": [_map_with([*_header_fields(), (_s("x"), b"\xc7\x03\x07abc")])],
    "timestamp ext in header": [
        _map_with([*_header_fields(), (_s("x"), msgpack.packb(msgpack.Timestamp(1)))])
    ],
    "bin value in header": [msgpack.packb({**hdr(), "from": b"me"}, use_bin_type=True)],
    "bin body key": [_map_with(_header_fields(body=b"\x81\xc4\x01k\x01"))],
    "int map keys": [msgpack.packb({1: 2, "id": 5})],
    "nil map key": [_map_with([(b"\xc0", b"\x01"), (_s("id"), b"\x05")])],
    "array map key": [_map_with([(b"\x91\x01", b"\x01"), (_s("id"), b"\x05")])],
    "float map key": [_map_with([(msgpack.packb(1.5), b"\x01"), (_s("id"), b"\x05")])],
    "trailing bytes": [msgpack.packb(hdr()) + b"\x00"],
    "two headers": [msgpack.packb(hdr()) * 2],
    "invalid utf-8": [_map_with([(b"\xa2\xff\xfe", b"\x01")])],
    "reserved byte 0xc1": [b"\xc1"],
    "header is a list": [msgpack.packb([1, "ping", 42, {}])],
    "header is an int": [msgpack.packb(42)],
    "header is a string": [msgpack.packb("id")],
}


@pytest.mark.parametrize("name", sorted(CRAFTED_UNREADABLE))
def test_crafted_undecodable_headers(name: str) -> None:
    rejects(CRAFTED_UNREADABLE[name], None)


def test_header_size_is_capped_before_msgpack() -> None:
    big = msgpack.packb({**hdr(), "from": "x" * 100})
    rejects([big], None, Limits(max_header_bytes=len(big) - 1))
    decode([big], Limits(max_header_bytes=len(big)))
    at_limit = b"\x84" + b"\0" * (1 << 20)  # one byte over the default cap
    assert "exceeds" in rejects([at_limit], None)


@pytest.mark.parametrize("depth", [100, 900, 1000, 1020])
def test_deeply_nested_field_values(depth: int) -> None:
    """Nesting msgpack still accepts must not break the error path (e.g. its repr)."""
    for key in ("v", "op", "body", "bufs", "dl", "from", "slot"):
        fields = dict(_header_fields())
        fields[_s(key)] = _deep(depth)
        rejects([_map_with(list(fields.items()))], 42)
    spec_fields = dict(_header_fields(op=_s("pull"), body=msgpack.packb({"shards": [0]})))
    for position in range(5):
        spec = [b"\xa7float32", b"\x91\x02", b"\xa5value", b"\x00", b"\x00"]
        spec[position] = _deep(depth)
        spec_fields[_s("bufs")] = b"\x91\x95" + b"".join(spec)
        rejects([_map_with(list(spec_fields.items())), b"\0" * 8], 42)


# Values as a hostile peer might put them in a header: everything msgpack can carry.
leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=10)
    | st.binary(max_size=10)
)
values = st.recursive(
    leaves,
    lambda kids: (
        st.lists(kids, max_size=5)
        | st.dictionaries(st.text(max_size=5) | st.integers(-5, 5), kids, max_size=5)
    ),
    max_leaves=20,
)
near_values = st.one_of(
    values,
    st.integers(-2, 2**64 - 1),
    st.sampled_from([*sorted(DTYPES), "float128", ">f4", "O", "V8", "U4"]),
    st.sampled_from(sorted(KINDS)),
    st.lists(st.integers(-2, 2**64 - 1) | st.just(0), max_size=10),
)


@st.composite
def near_valid_messages(draw: st.DrawFn) -> list[bytes]:
    """Headers close to valid ones, with fields dropped, replaced or added, and random bufs."""
    op = draw(st.sampled_from([*sorted(BODIES), OK, ERROR, "nope"]))
    header: dict[Any, Any] = {
        "v": PROTOCOL_VERSION,
        "op": op,
        "id": draw(st.integers(0, 2**63 - 1)),
        "body": copy.deepcopy(BODIES.get(op, {"code": "x", "message": "y"})),
    }
    for _ in range(draw(st.integers(0, 3))):
        body = header.get("body")
        target = body if isinstance(body, dict) and body and draw(st.booleans()) else header
        key = draw(st.sampled_from([*target.keys(), "bufs", "dl", "from", "slot", "zz"]))
        if draw(st.booleans()):
            target[key] = draw(near_values)
        else:
            target.pop(key, None)
    n = draw(st.integers(0, 3))
    specs = [
        [
            draw(near_values | st.sampled_from(sorted(DTYPES))),
            draw(
                st.lists(st.integers(-1, 2**64 - 1) | st.integers(0, 3), max_size=10) | near_values
            ),
            draw(st.sampled_from(sorted(KINDS)) | near_values),
            draw(st.integers(-2, 3) | near_values),
            draw(st.integers(-1, 3) | near_values),
        ][: draw(st.integers(3, 6))]
        for _ in range(n)
    ]
    if specs or draw(st.booleans()):
        header["bufs"] = specs
    packed = msgpack.packb(header, use_bin_type=True)
    bufs = draw(st.lists(st.binary(max_size=40), max_size=4))
    return [packed, *bufs]


def decodes_or_protocol_error(frames: list[Any]) -> None:
    try:
        msg = decode(frames)
    except ProtocolError as exc:
        rid = getattr(exc, "request_id", None)
        assert rid is None or (type(rid) is int and 0 <= rid < 2**63)
        return
    assert isinstance(msg, Message)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_only_ever_raise_protocol_error(data: bytes) -> None:
    decodes_or_protocol_error([data])


@FUZZ
@given(st.lists(st.binary(max_size=100), min_size=0, max_size=6))
def test_random_frame_lists_only_ever_raise_protocol_error(frames: list[bytes]) -> None:
    if not frames:
        rejects(frames, None)
        return
    decodes_or_protocol_error(frames)


@FUZZ
@given(values, st.lists(st.binary(max_size=20), max_size=3))
def test_random_msgpack_headers_only_ever_raise_protocol_error(
    header: Any, bufs: list[bytes]
) -> None:
    decodes_or_protocol_error([msgpack.packb(header, use_bin_type=True), *bufs])


@FUZZ
@given(near_valid_messages())
def test_near_valid_messages_only_ever_raise_protocol_error(frames: list[bytes]) -> None:
    decodes_or_protocol_error(frames)


@FUZZ
@given(
    op=st.sampled_from(sorted(BODIES)),
    data=st.data(),
)
def test_mutated_valid_encodings_only_ever_raise_protocol_error(
    op: str, data: st.DataObject
) -> None:
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    frames = wire(encode(request(op, BODIES[op], [Tensor(arr, "grad", 0)], id=8, deadline=1.0)))
    head = bytearray(frames[0])
    for _ in range(data.draw(st.integers(1, 4))):
        what = data.draw(st.sampled_from(["flip", "cut", "insert", "set"]))
        pos = data.draw(st.integers(0, max(0, len(head) - 1)))
        if what == "flip" and head:
            head[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif what == "cut":
            del head[pos:]
        elif what == "insert":
            head[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif head:
            head[pos] = data.draw(st.integers(0, 255))
    decodes_or_protocol_error([bytes(head), *frames[1:]])


@pytest.mark.parametrize("slot", [-1, 1 << 21, True, 1.0, "0", None, [0]])
def test_a_slot_that_is_not_a_ps_index_is_refused(slot: Any) -> None:
    header = {"v": PROTOCOL_VERSION, "op": "ping", "id": 7, "body": {}, "slot": slot}
    with pytest.raises(ProtocolError, match="slot"):
        decode([msgpack.packb(header)])
