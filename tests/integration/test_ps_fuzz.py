"""Fuzzing a live PS (its own process, real TCP on 127.0.0.1) while a worker trains.

More than 10,000 random and crafted messages from several fuzzing DEALER sockets:
msgpack bombs (huge declared lengths), deep nesting, ext types, non-string keys,
wrong types for every header field and every body field of every op, truncated and
extra frames, bad dtypes, shape / length mismatches, negative dims, ndim > 8, huge
declared shapes, unknown ops, wrong protocol versions, random mutations of valid
messages, hypothesis-generated headers, the hostile corpus of test_ps_hostile, and
frames above MAXMSGSIZE (from a DEALER, and as raw ZMTP frame headers declaring
2**62 bytes). Everything is generated from fixed seeds, so a failure reproduces.

The expected outcome of every message is computed before sending with the codec
the PS runs (``zmqps.wire.decode``) and the dispatcher's rules: dropped (request id
unreadable, or past its deadline), a ``protocol`` error reply, or a reply from the
handler (the corpus only holds handler-level messages that cannot change state, or
curated ones whose error code is known). The test asserts:

* the PS never crashes: it answers ping on every socket at the end;
* every message got exactly the expected outcome, and the PS's counters
  (``bad_messages``, ``expired``, ``requests``, ``errors``, ``replies``) equal what
  was sent; no ``internal`` error anywhere;
* the worker's final parameters are bit-identical to the same worker sequence run
  against a second, unfuzzed PS (and to the numpy SGD reference);
* the PS's peak RSS grows by less than :data:`RSS_BOUND` over the attack.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import re
import struct
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
from helpers import Reaper, memory, wait_for
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_ps_hostile import (
    OPTS,
    PLACEMENT,
    _deep,
    _map,
    as_bytes,
    codec_error_cases,
    handler_error_cases,
    header,
    live_ps,
    packed,
    push_body,
    sgd,
    unreadable_cases,
    values,
)

from zmqps.roles.client import ParameterClient
from zmqps.roles.ps import PSService
from zmqps.transport import Client, Server, SocketOptions
from zmqps.transport.shm import _NAME as SHM_NAME
from zmqps.wire import PROTOCOL_VERSION, Message, Tensor, decode, encode, request
from zmqps.wire.codec import DEFAULT_LIMITS
from zmqps.wire.errors import DeadlineExceeded, ProtocolError
from zmqps.wire.schema import (
    REQUEST_BODIES,
    AnyList,
    AnyMap,
    Bool,
    Float,
    Int,
    List,
    Map,
    OneOf,
    Schema,
    Str,
    Tree,
    Tuple,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

SEED = 20240917
#: MAXMSGSIZE of the fuzzed PS: above its largest legitimate frame (4 MiB chunks),
#: small enough that oversize frames are cheap to send.
MAX_MSG = 8 << 20
#: The bound on the PS's peak RSS growth over the attack.
RSS_BOUND = 64 << 20
N_FUZZERS = 4
#: Ids of well-formed requests: unique across the corpus, so replies match one case.
IDS = itertools.count(10_000_000)
#: Handler-level ops a fuzzer may send: none of them can change the PS's state.
SAFE_OPS = {"ping", "status", "ps_state", "pull", "pull_rows", "shm_detach"}
PUSH_OPS = {"push", "push_pull", "push_rows"}

# --------------------------------------------------------------------------- the oracle


@dataclass
class Fz:
    category: str
    frames: list[bytes]
    #: "drop", "expired", "protocol" or "handler"
    outcome: str
    rid: int | None
    #: for curated handler cases: the exact error code, or "dup"
    code: str | None = None


def is_safe(msg: Message) -> bool:
    """Can the PS serve ``msg`` without changing anything a worker sees?"""
    b = msg.body
    if msg.op in SAFE_OPS:
        return True
    if msg.op in PUSH_OPS:  # pushes to shards that do not exist: refused before dedup
        return bool(b["shards"]) and not set(b["shards"]) & {0, 1} and "shm" not in b
    if msg.op == "shm_attach":
        return not SHM_NAME.fullmatch(b["name"]) or not os.path.exists(f"/dev/shm/{b['name']}")
    return False


def classify(frames: list[bytes]) -> tuple[str, int | None, Message | None]:
    """What the PS's dispatcher will do with ``frames``: (outcome, reply id, message)."""
    try:
        msg = decode(frames)
    except ProtocolError as exc:
        rid = getattr(exc, "request_id", None)
        return ("drop", None, None) if rid is None else ("protocol", rid, None)
    if msg.is_reply:
        return "protocol", msg.id, msg
    if msg.deadline is not None:
        now = time.time()
        if msg.deadline < now - 3600:
            return "expired", None, msg
        if msg.deadline < now + 10 * 365 * 86400:
            return "ambiguous", msg.id, msg
    return "handler", msg.id, msg


class Corpus:
    """Cases by category; only cases with a known outcome and a unique reply id get in."""

    def __init__(self) -> None:
        self.cases: list[Fz] = []
        self.skipped: Counter[str] = Counter()
        self._ids: set[int] = set()

    def add(
        self,
        category: str,
        frames: list[Any],
        *,
        must: str | None = None,
        code: str | None = None,
        trusted: bool = False,
    ) -> None:
        frames = as_bytes(frames)
        outcome, rid, msg = classify(frames)
        if must is not None:
            assert outcome == must, f"{category}: expected {must}, the codec says {outcome}"
        if outcome == "ambiguous" or (
            outcome == "handler" and not trusted and (msg is None or not is_safe(msg))
        ):
            self.skipped[category] += 1
            return
        if rid is not None:
            if rid in self._ids:
                self.skipped[category] += 1
                return
            self._ids.add(rid)
        self.cases.append(Fz(category, frames, outcome, rid, code))

    def counts(self) -> dict[str, int]:
        return dict(Counter(c.category for c in self.cases))


# --------------------------------------------------------------------------- crafted corpora

WRONG: list[Any] = [
    None,
    True,
    False,
    -1,
    0,
    1,
    2**31,
    2**63,
    2**64 - 1,
    -(2**63),
    1.5,
    float("nan"),
    float("inf"),
    -0.0,
    "",
    "x",
    "x" * 300,
    "ping",
    b"",
    b"\x00\xff",
    [],
    [1],
    [[[[]]]],
    {},
    {"a": 1},
    {1: 2},
    msgpack.ExtType(1, b"x"),
    msgpack.Timestamp(0),
]
BAD_DTYPES: list[Any] = [
    "object",
    "O",
    "V8",
    "U4",
    ">f4",
    "<f4",
    "f4",
    "float128",
    "complex64",
    "bfloat16",
    "",
    "FLOAT32",
    "float32 ",
    "float32\x00",
    7,
    None,
    ["float32"],
]
BAD_SHAPES: list[Any] = [
    [-1],
    [4, -1],
    [-(2**63)],
    [1] * 9,
    [1] * 16,
    [2**62, 2**62],
    [0, 2**62, 2**62],
    [2**64 - 1],
    [1.5],
    ["4"],
    [True],
    [None],
    "4",
    4,
    None,
    {},
]
BOMBS: dict[str, bytes] = {
    "array16": b"\xdc\xff\xff",
    "array32": b"\xdd\xff\xff\xff\xff",
    "map16": b"\xde\xff\xff",
    "map32": b"\xdf\xff\xff\xff\xff",
    "str8": b"\xd9\xff",
    "str16": b"\xda\xff\xff",
    "str32": b"\xdb\xff\xff\xff\xff",
    "bin8": b"\xc4\xff",
    "bin16": b"\xc5\xff\xff",
    "bin32": b"\xc6\xff\xff\xff\xff",
    "ext8": b"\xc7\xff\x01",
    "ext16": b"\xc8\xff\xff\x01",
    "ext32": b"\xc9\xff\xff\xff\xff\x01",
    "fixext16": b"\xd8\x01",
}


def rid_first(rid: int, op: str, body: bytes, **extra: bytes) -> bytes:
    """A header map with the id first and ``body`` as raw msgpack bytes."""
    fields = [("id", msgpack.packb(rid)), ("v", b"\x01"), ("op", msgpack.packb(op))]
    fields += [("body", body), *extra.items()]
    return _map(fields)


def bombs(c: Corpus, rng: random.Random) -> None:
    for name, prefix in BOMBS.items():
        for _ in range(20):
            tail = rng.randbytes(rng.randint(0, 40))
            c.add(f"msgpack bomb ({name})", [prefix + tail], must="drop")
            rid = next(IDS)
            c.add(f"msgpack bomb ({name}) in body", [rid_first(rid, "ping", prefix + tail)])
    for _ in range(10):  # over the limits, with the bytes really there
        c.add("str over max_str_len", packed(header(next(IDS), "ping", {}, x="s" * 70_000)))
        c.add(
            "array over max_array_len", [b"\xdd" + struct.pack(">I", 140_000) + b"\xc0" * 140_000]
        )
        over = DEFAULT_LIMITS.max_map_len + 1
        c.add("map over max_map_len", [msgpack.packb({f"k{i}": 0 for i in range(over)})])
        c.add("bin in header", packed(header(next(IDS), "ping", {}, x=b"\x00" * 10)))
        c.add(
            "ext in header",
            [msgpack.packb({**header(next(IDS), "ping", {}), "x": msgpack.ExtType(5, b"e")})],
        )


def nesting(c: Corpus) -> None:
    for depth in (10, 100, 500, 1000, 1023, 1024, 1025, 5000, 100_000):
        arr = _deep(depth)
        mp = b"\x81\xa1k" * depth + b"\xc0"
        for _ in range(4):
            c.add(f"deep nesting ({depth})", [arr])
            c.add(f"deep nesting ({depth})", [mp])
            c.add(f"deep nesting ({depth}) in body", [rid_first(next(IDS), "ping", mp)])
            c.add(
                f"deep nesting ({depth}) in bufs",
                [rid_first(next(IDS), "pull", msgpack.packb({"shards": [7]}), bufs=arr)],
            )


def non_string_keys(c: Corpus) -> None:
    keys: list[bytes] = [b"\x07", b"\xc0", b"\xc3", b"\xcb" + struct.pack(">d", 1.5), b"\x91\x01"]
    keys += [b"\xc4\x02id", b"\x80", b"\xd4\x01\x00"]
    for k in keys:
        for _ in range(10):
            rid = next(IDS)
            base = _map([("v", b"\x01"), ("op", msgpack.packb("ping")), ("id", msgpack.packb(rid))])
            raw = bytes([base[0] + 2]) + base[1:] + msgpack.packb("body") + b"\x80" + k + b"\x01"
            c.add("non-string key", [raw], must="drop")
            body = b"\x81" + k + b"\x01"
            c.add("non-string key in body", [rid_first(next(IDS), "ping", body)])


def header_fields(c: Corpus) -> None:
    bases = [("ping", {}), ("pull", {"shards": [7]}), ("status", {})]
    for op, body in bases:
        for field in ("v", "op", "id", "body", "from", "bufs", "dl"):
            for value in WRONG:
                for _ in range(2):
                    h = header(next(IDS), op, body)
                    h[field] = value
                    c.add(f"wrong type: header.{field}", [msgpack.packb(h, use_bin_type=True)])
            for _ in range(5):
                h = header(next(IDS), op, body)
                h.pop(field, None)
                c.add(f"missing: header.{field}", packed(h))
        for _ in range(10):
            c.add("unknown header field", packed(header(next(IDS), op, body, evil=1)))


def example(schema: Schema) -> Any:
    """A small valid value of ``schema``."""
    if isinstance(schema, Int):
        return max(schema.lo, min(schema.hi, 7))
    if isinstance(schema, Float):
        return max(schema.lo, 0.0)
    if isinstance(schema, Str):
        return "x"
    if isinstance(schema, OneOf):
        return min(schema.values)
    if isinstance(schema, Bool):
        return False
    if isinstance(schema, List):
        return [example(schema.item)]
    if isinstance(schema, Tuple):
        return [example(s) for s in schema.items]
    if isinstance(schema, Map):
        return {k: example(s) for k, s in schema.required.items()}
    if isinstance(schema, AnyMap):
        return {}
    if isinstance(schema, AnyList):
        return []
    if isinstance(schema, Tree):
        return ["d", {}] if schema.root == "d" else ["t", []]
    raise AssertionError(schema)


def schema_paths(schema: Schema, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths to every field of a schema's example value (optional fields included)."""
    if isinstance(schema, Map):
        for k, s in {**schema.required, **schema.optional}.items():
            yield (*prefix, k)
            yield from itertools.islice(schema_paths(s, (*prefix, k)), 12)
    elif isinstance(schema, (List, Tuple)):
        item = schema.item if isinstance(schema, List) else schema.items[0]
        yield (*prefix, 0)
        yield from itertools.islice(schema_paths(item, (*prefix, 0)), 12)


def set_path(doc: Any, path: tuple[Any, ...], value: Any, schema: Schema) -> None:
    node, sch = doc, schema
    for k in path[:-1]:
        if isinstance(sch, Map):
            sch = sch.required.get(k) or sch.optional[k]
            if k not in node:
                node[k] = example(sch)
        else:
            sch = sch.item if isinstance(sch, List) else sch.items[0]  # type: ignore[attr-defined]
        node = node[k]
    node[path[-1]] = value


def body_fields(c: Corpus) -> None:
    """Every body field of every op with every wrong value (and the field dropped)."""
    for op, schema in sorted(REQUEST_BODIES.items()):
        base = example(schema)
        for path in schema_paths(schema):
            for value in WRONG:
                body = json.loads(json.dumps(base))
                set_path(body, path, value, schema)
                c.add(f"wrong type: {op} body", packed(header(next(IDS), op, body)))
            if len(path) == 1 and path[0] in base:
                body = dict(base)
                del body[path[0]]
                c.add(f"missing: {op} body field", packed(header(next(IDS), op, body)))
        c.add(f"unknown field: {op} body", packed(header(next(IDS), op, {**base, "evil": 1})))


def tensor_specs(c: Corpus, rng: random.Random) -> None:
    body = push_body("mallory", 0, 1, [7])
    g4 = np.arange(4, dtype=np.float32).tobytes()

    def send(label: str, specs: Any, *bufs: bytes) -> None:
        for op in ("push", "push_pull", "push_rows", "pull_rows"):
            b = {"shards": [7]} if op == "pull_rows" else body
            c.add(label, packed(header(next(IDS), op, b, bufs=specs), *bufs), must="protocol")

    for dt in BAD_DTYPES:
        send("bad dtype", [[dt, [4], "grad", 7, 0]], g4)
    for shape in BAD_SHAPES:
        send("bad shape", [["float32", shape, "grad", 7, 0]], g4)
    for n in (0, 1, 3, 5, 8, 15, 17, 1 << 20):
        send(
            "shape/length mismatch",
            [["float32", [4], "grad", 7, 0]],
            g4[:n] if n < 16 else g4 + b"\x00" * (n - 16),
        )
    for dims in ([2**62], [2**40, 2**40], [2**31, 2**31, 4], [2**20] * 8):
        send("huge declared shape", [["float32", dims, "grad", 7, 0]], g4)
    for kind in ("weights", "", 7, None, "GRAD"):
        send("bad kind", [["float32", [4], kind, 7, 0]], g4)
    for ref, off in ((2**31, 0), (-2, 0), ("7", 0), (7, -1), (7, 2**63), (7, 1.5)):
        send("bad ref/offset", [["float32", [4], "grad", ref, off]], g4)
    for spec in (
        [],
        ["float32"],
        ["float32", [4], "grad", 7],
        ["float32", [4], "grad", 7, 0, 0],
        "float32",
        7,
        {},
    ):
        send("malformed spec", [spec], g4)
    for bufs in ("x", 7, {"a": 1}, None):
        send("bufs not a list", bufs, g4)
    good = [["float32", [4], "grad", 7, 0]]
    for _ in range(10):
        send("truncated frames (missing buffer)", good)
        send("extra frames", good, g4, g4)
        send("extra frames", [], g4)
        send("extra frames", good * 2, g4)
    for _ in range(30):  # random specs
        spec = [
            rng.choice([*BAD_DTYPES, "float32", "int64"]),
            rng.choice([*BAD_SHAPES, [4], [2, 2], [1, 4]]),
            rng.choice(["grad", "index", "rows", "value", "x"]),
            rng.choice([7, -1, 2**31]),
            rng.choice([0, -1, 4]),
        ]
        for op in ("push", "pull_rows"):
            b = {"shards": [7]} if op == "pull_rows" else body
            c.add("random spec", packed(header(next(IDS), op, b, bufs=[spec]), g4))


def ops_and_versions(c: Corpus) -> None:
    unknown = ["", "PING", "ping\x00", " ping", "_op_ping", "__init__", "status()", "ok ", "x" * 32]
    unknown += ["x" * 33, "frobnicate", "restore_all", "apply", "eval", "exec", "getattr"]
    unknown += [f"op{i}" for i in range(20)]
    for op in unknown:
        for _ in range(4):
            c.add("unknown op", packed(header(next(IDS), op, {})), must="protocol")
    for v in (0, 2, 3, 2**31 - 1, 2**31, -1, 1.0, "1", None, True, [1], {"v": 1}):
        for op, body in (("ping", {}), ("pull", {"shards": [0]})):
            for _ in range(5):
                c.add("wrong protocol version", packed(header(next(IDS), op, body, v=v)))


def reused(c: Corpus, rng: random.Random) -> None:
    """The corpus of test_ps_hostile (its setup-dependent replays left out)."""
    for case in unreadable_cases(rng):
        c.add("hostile corpus: unreadable", case.frames, must="drop")
    for case in codec_error_cases(lambda: next(IDS)):
        c.add("hostile corpus: codec", case.frames, must="protocol")
    skip = {"zombie's old incarnation", "replay of dup/1/1"}
    for case in handler_error_cases(lambda: next(IDS), np.random.default_rng(SEED)):
        if case.label in skip:
            continue
        # refused by the PS, not the codec (e.g. "register" is no PS op): handler-level
        c.add(
            "hostile corpus: handler", case.frames, must="handler", code=case.expect, trusted=True
        )


def mutations(c: Corpus, rng: random.Random, n: int) -> None:
    """Random byte-level mutations of valid messages."""
    g = np.arange(600, dtype=np.float32)
    idx = np.array([1, 5], np.int64)

    def bases(rid: int) -> list[list[bytes]]:
        return [
            as_bytes(encode(request("ping", {}, id=rid, sender="f"))),
            as_bytes(encode(request("status", {}, id=rid))),
            as_bytes(encode(request("pull", {"shards": [0, 1]}, id=rid, deadline=2e9 * 100))),
            as_bytes(
                encode(
                    request(
                        "push",
                        push_body("mallory", 0, 3, [7]),
                        [Tensor(g[:300], "grad", 7, 0), Tensor(g[300:], "grad", 7, 300)],
                        id=rid,
                    )
                )
            ),
            as_bytes(
                encode(request("pull_rows", {"shards": [7]}, [Tensor(idx, "index", 7)], id=rid))
            ),
        ]

    for _ in range(n):
        frames = rng.choice(bases(next(IDS)))
        h = bytearray(frames[0])
        kind = rng.choice(
            ["flip", "flip", "flip", "truncate", "extend", "insert", "frames", "tensor"]
        )
        if kind == "flip":
            for _ in range(rng.randint(1, 6)):
                h[rng.randrange(len(h))] ^= rng.randint(1, 255)
        elif kind == "truncate":
            del h[rng.randrange(len(h)) :]
        elif kind == "extend":
            h += rng.randbytes(rng.randint(1, 16))
        elif kind == "insert":
            at = rng.randrange(len(h))
            h[at:at] = rng.randbytes(rng.randint(1, 8))
        frames = [bytes(h), *frames[1:]]
        if kind == "frames":
            op = rng.choice(["drop", "dup", "add", "swap"])
            if op == "drop" and len(frames) > 1:
                frames.pop(rng.randrange(1, len(frames)))
            elif op == "dup" and len(frames) > 1:
                frames.append(frames[-1])
            elif op == "swap" and len(frames) > 2:
                frames[1], frames[2] = frames[2], frames[1]
            else:
                frames.append(rng.randbytes(rng.randint(0, 32)))
        elif kind == "tensor" and len(frames) > 1:
            i = rng.randrange(1, len(frames))
            t = frames[i]
            frames[i] = t[: rng.randrange(len(t))] if rng.random() < 0.5 else t + rng.randbytes(4)
        c.add("mutated valid message", frames)


# --------------------------------------------------------------------------- hypothesis corpus

LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=6))
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.integers(-5, 5), inner, max_size=4)
    ),
    max_leaves=10,
)
OPS = [*sorted(REQUEST_BODIES), "ok", "error", "frobnicate", ""]
SPECS = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from([*BAD_DTYPES, "float32", "int64", "uint8", "bool"]),
            st.lists(st.integers(-3, 2**63), max_size=10) | VALUES,
            st.sampled_from(["grad", "index", "rows", "value", "w"]) | VALUES,
            st.integers(-2, 9) | VALUES,
            st.integers(-2, 2**62) | VALUES,
        ).map(list),
        VALUES,
    ),
    max_size=3,
)
HEADERS = st.fixed_dictionaries(
    {},
    optional={
        "v": st.just(PROTOCOL_VERSION) | VALUES,
        "op": st.sampled_from(OPS) | VALUES,
        "id": st.integers(0, 2**63 - 1) | VALUES,
        "body": st.dictionaries(
            st.sampled_from(["shards", "versions", "worker", "inc", "seq", "gen", "wait", "x"]),
            VALUES,
            max_size=5,
        )
        | VALUES,
        "from": st.text(max_size=140) | VALUES,
        "bufs": SPECS | VALUES,
        "dl": st.sampled_from([0.0, 1.0, 1e300, math.inf, -1.0]) | VALUES,
        "extra": VALUES,
    },
)


def hypothesis_cases(c: Corpus, n: int) -> None:
    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(h=HEADERS, bufs=st.lists(st.binary(max_size=48), max_size=4), pad=st.integers(-1, 1))
    def gen(h: dict[str, Any], bufs: list[bytes], pad: int) -> None:
        if type(h.get("id")) is int and 0 <= h["id"] < 2**63:
            h["id"] = next(IDS)  # unique, so its reply matches this case only
        declared = h.get("bufs")
        frames = list(bufs)
        if isinstance(declared, list) and pad == 0:
            frames = [rng_bytes(spec) for spec in declared]
        try:
            raw = msgpack.packb(h, use_bin_type=True)
        except (ValueError, TypeError, OverflowError):
            return
        c.add("hypothesis", [raw, *frames])

    gen()


def rng_bytes(spec: Any) -> bytes:
    """Bytes of the length a spec announces, when it announces a small one."""
    try:
        dtype = np.dtype({"float32": "<f4", "int64": "<i8", "uint8": "u1", "bool": "?"}[spec[0]])
        n = dtype.itemsize * math.prod(spec[1])
        return b"\x00" * n if 0 <= n <= 4096 else b""
    except Exception:
        return b"\x00" * 4


def build_corpus() -> Corpus:
    rng = random.Random(SEED)
    c = Corpus()
    reused(c, rng)
    bombs(c, rng)
    nesting(c)
    non_string_keys(c)
    header_fields(c)
    body_fields(c)
    tensor_specs(c, rng)
    ops_and_versions(c)
    mutations(c, rng, 1500)
    hypothesis_cases(c, 1000)
    rng.shuffle(c.cases)
    return c


# --------------------------------------------------------------------------- oversize frames


def zmtp_greeting() -> bytes:
    """A ZMTP 3.0 greeting, NULL mechanism, as a client."""
    return (
        b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
    )


def zmtp_ready() -> bytes:
    def prop(name: bytes, value: bytes) -> bytes:
        return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value

    body = b"\x05READY" + prop(b"Socket-Type", b"DEALER") + prop(b"Identity", b"")
    return bytes([0x04, len(body)]) + body


async def raw_connection(port: int, payload: bytes, handshake: bool) -> bool:
    """Connect over plain TCP, (handshake and) send ``payload``; True if the PS hangs up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if handshake:
            writer.write(zmtp_greeting())
            await writer.drain()
            await asyncio.wait_for(reader.readexactly(64), 5)
            writer.write(zmtp_ready())
            await writer.drain()
        writer.write(payload)
        await writer.drain()
        try:
            while await asyncio.wait_for(reader.read(65536), 5):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


# --------------------------------------------------------------------------- the worker


class Worker:
    """The legitimate worker: pull, a gradient that depends on what it pulled, push
    (every third step a push_pull). Deterministic given the PS's answers."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.transport = Client(ctx, endpoint, "worker:0", options=OPTS, timeout=20)
        self.pc = ParameterClient(
            [self.transport],
            PLACEMENT,
            worker="legit",
            incarnation=3,
            chunk_bytes=8000,
            timeout=20.0,
            shared_memory=False,
        )
        self.rng = np.random.default_rng(SEED)
        self.steps = 0
        self.ref: np.ndarray | None = None

    async def step(self) -> None:
        i = self.steps
        if i % 3 != 1:  # after a push_pull the client already holds fresh values
            await self.pc.pull()
        w = self.pc.params["w"]
        if self.ref is None:
            self.ref = w.copy()
        assert np.array_equal(w, self.ref), f"legit step {i}: values drifted"
        g = self.rng.integers(-8, 9, size=w.shape).astype(np.float32) + np.sign(w)
        await self.pc.push({"w": g}, pull=i % 3 == 0)
        sgd(self.ref, g)
        self.steps += 1

    async def close(self) -> None:
        await self.transport.close()


async def reference_run(steps: int) -> tuple[np.ndarray, dict[int, int]]:
    """The same worker sequence against an unfuzzed in-process PS."""
    async with live_ps() as ps:
        w = Worker(ps.ctx, ps.server.endpoint)
        try:
            for _ in range(steps):
                await w.step()
        finally:
            await w.close()
        return await values(ps), ps.service.store.versions()


# --------------------------------------------------------------------------- the test


async def fuzz_live_ps(endpoint: str, pid: int, corpus: Corpus) -> dict[str, Any]:
    ctx = zmq.asyncio.Context()
    admin = Client(ctx, endpoint, "admin", options=OPTS, timeout=20)
    worker = Worker(ctx, endpoint)
    fuzzers = []
    for i in range(N_FUZZERS):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, f"fuzz-{i}".encode())
        s.connect(endpoint)
        fuzzers.append(s)
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.setsockopt(zmq.ROUTING_ID, b"oversize")
    big.connect(endpoint)
    port = int(endpoint.rsplit(":", 1)[1])
    out: dict[str, Any] = {}
    try:
        defs = [d.to_wire() for _, d in PLACEMENT.shard_defs()]
        assert (await admin.request("create_shards", {"shards": defs})).body == {"shards": [0, 1]}
        for _ in range(3):  # warm up; the PS now knows legit's incarnation 3 and seq 1
            await worker.step()
        mem_before = memory(pid)

        replies: list[dict[int, Message]] = [{} for _ in fuzzers]
        stray: list[Any] = []
        shares = [corpus.cases[i::N_FUZZERS] for i in range(N_FUZZERS)]
        done = asyncio.Event()
        during = {"steps": 0, "oversize": 0, "raw": 0, "hung_up": 0}

        async def send(i: int) -> None:
            seen = worker.steps
            for k, case in enumerate(shares[i]):
                await fuzzers[i].send_multipart(case.frames)
                if k % 10 == 0:
                    await asyncio.sleep(0.002)  # let the others (and the worker) in
                if k % 250 == 249:  # the worker trains all along, however slow the machine
                    while worker.steps == seen:
                        await asyncio.sleep(0.002)
                    seen = worker.steps

        async def collect(i: int) -> None:
            while True:
                m = decode(await fuzzers[i].recv_multipart())
                if m.id in replies[i]:
                    stray.append(m)
                replies[i][m.id] = m

        async def oversize() -> None:
            g = np.zeros(MAX_MSG // 4 + 1, np.float32)  # one frame of MAX_MSG + 4 bytes
            for k in range(12):
                if k % 3 == 0:
                    frames = [b"\x80" + b"\x00" * MAX_MSG]  # a header frame above the limit
                else:
                    rid = next(IDS)
                    frames = as_bytes(
                        encode(
                            request(
                                "push", push_body("m", 0, 1, [7]), [Tensor(g, "grad", 7)], id=rid
                            )
                        )
                    )
                await big.send_multipart(frames, copy=False)
                during["oversize"] += 1
                await asyncio.sleep(0.05)
            greeting = zmtp_greeting()
            raw = [
                (b"\x02" + struct.pack(">Q", 2**62) + b"\x00" * 64, True),  # declares 4 EiB
                (b"\x02" + struct.pack(">Q", MAX_MSG + 1) + b"\x00" * 64, True),
                (b"\x06" + struct.pack(">Q", 2**63) + b"\x00" * 8, True),  # a huge command
                (greeting[:12] + b"EVIL".ljust(20, b"\x00") + greeting[32:], False),
                (greeting[:12] + b"CURVE".ljust(20, b"\x00") + greeting[32:], False),
                (b"\xff" + b"\x00" * 8 + b"\x7e" + b"\x00" * 60, False),  # bad signature
            ]
            for k in range(36):  # raw TCP: huge declared frames, bad greetings
                payload, handshake = raw[k % len(raw)]
                hung = await raw_connection(port, payload, handshake=handshake)
                during["raw"] += 1
                during["hung_up"] += hung

        async def train() -> None:
            while not done.is_set() or worker.steps < 30:
                await worker.step()
                if not done.is_set():
                    during["steps"] += 1
                await asyncio.sleep(0.005)  # a worker that also computes

        collectors = [asyncio.ensure_future(collect(i)) for i in range(N_FUZZERS)]
        try:
            t0 = time.monotonic()
            trainer = asyncio.ensure_future(train())
            await asyncio.gather(*(send(i) for i in range(N_FUZZERS)), oversize())
            expected = [sum(1 for c in share if c.rid is not None) for share in shares]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and any(
                len(r) < n for r, n in zip(replies, expected, strict=True)
            ):
                await asyncio.sleep(0.02)
            done.set()
            out["elapsed"] = time.monotonic() - t0
            await trainer
            await asyncio.sleep(0.3)  # nothing else may arrive
        finally:
            for t in collectors:
                t.cancel()
            for t in collectors:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        mem_after = memory(pid)

        # still alive, and serving every socket (the oversize sender reconnected)
        assert (await admin.request("ping")).body == {"role": "ps", "index": 0}
        pings = 0
        for s in [*fuzzers, big]:
            rid = next(IDS)
            await s.send_multipart(as_bytes(encode(request("ping", {}, id=rid))))
            m = decode(await asyncio.wait_for(s.recv_multipart(), 10))
            assert m.id == rid and m.op == "ok"
            pings += 1
        final = await values_via(admin)
        versions = (await admin.request("status")).body
        out.update(
            replies=replies,
            shares=shares,
            stray=stray,
            mem_before=mem_before,
            mem_after=mem_after,
            during=during,
            steps=worker.steps,
            final=final,
            ref=worker.ref,
            status=versions,
            pings=pings,
        )
        await worker.close()
        await admin.request("shutdown", {"reason": "fuzz test done"})
        out["client_requests"] = admin.stats.requests + worker.transport.stats.requests
        out["client_replies"] = admin.stats.replies + worker.transport.stats.replies
    finally:
        await admin.close()
        for s in [*fuzzers, big]:
            s.close()
        ctx.term()
    return out


async def values_via(admin: Client) -> np.ndarray:
    """test_ps_hostile.values, for a PS known by its admin client only."""
    return await values(SimpleNamespace(admin=admin))  # type: ignore[arg-type]


def summary_category(category: str) -> str:
    """Categories folded for the printout (every op's body fields as one, ...)."""
    category = category.split(" (")[0]
    category = re.sub(
        r"^(wrong type|missing|unknown field): \w+ body( field)?$", r"\1: body field", category
    )
    return re.sub(r"^(wrong type|missing): header\.\w+$", r"\1: header field", category)


def test_fuzzing_a_live_ps_while_a_worker_trains(procs: Reaper, tmp_path: Path) -> None:
    t_start = time.monotonic()
    corpus = build_corpus()
    t_built = time.monotonic()
    cases = corpus.cases
    assert len(cases) >= 10_000, corpus.counts()

    stats_path = tmp_path / "ps-stats.json"
    target = Path(__file__).with_name("ps_fuzz_target.py")
    ps = procs.spawn([sys.executable, str(target), str(stats_path), str(MAX_MSG)], name="ps")
    line = wait_for(
        lambda: next((ln for ln in ps.stdout.splitlines() if ln.startswith("serving ")), None),
        30,
        what="the PS to serve",
    )
    endpoint = line.split()[1]

    out = asyncio.run(fuzz_live_ps(endpoint, ps.pid, corpus))
    ps.expect_exit(0, timeout=20)
    stats = json.loads(stats_path.read_text())
    transport, service = stats["transport"], stats["service"]

    # every message got its expected outcome
    assert out["stray"] == []
    wrong = []
    n_error_replies = 0
    n_fuzz_replies = 0
    for share, replies in zip(out["shares"], out["replies"], strict=True):
        want = {c.rid: c for c in share if c.rid is not None}
        assert set(replies) <= set(want) | set()
        n_fuzz_replies += len(replies)
        for rid, case in want.items():
            m = replies.get(rid)
            if m is None:
                wrong.append((case.category, case.outcome, "no reply"))
                continue
            code = m.body.get("code") if m.op == "error" else None
            n_error_replies += code is not None
            got = "dup" if m.op == "ok" and m.body.get("applied") is False else code
            if code == "internal":
                wrong.append((case.category, case.outcome, "internal error", m.body))
            elif case.outcome == "protocol" and code != "protocol":
                wrong.append((case.category, "protocol", got, m.body))
            elif case.outcome == "handler" and case.code is None and code == "protocol":
                wrong.append((case.category, "handler", got, m.body))
            elif case.code is not None and got != case.code:
                wrong.append((case.category, case.code, got, m.body))
    assert not wrong, f"{len(wrong)} unexpected outcomes, e.g. {wrong[:5]}"

    # the same worker sequence against an unfuzzed PS
    steps = out["steps"]
    t_ref = time.monotonic()
    ref_values, ref_versions = asyncio.run(reference_run(steps))
    t_ref = time.monotonic() - t_ref
    identical = out["final"].tobytes() == ref_values.tobytes()

    # the figures (printed first, so a failure below still shows them)
    by = Counter(c.outcome for c in cases)
    handler_errors = n_error_replies - by["protocol"]
    before, after = out["mem_before"], out["mem_after"]
    growth = after["VmHWM"] - before["VmRSS"]
    mib = 1 << 20
    categories = Counter(summary_category(c.category) for c in cases)
    print(
        f"\n{len(cases)} fuzz messages + {out['during']['oversize']} oversize frames"
        f" + {out['during']['raw']} raw TCP connections in {out['elapsed']:.1f}s"
        f" (corpus built in {t_built - t_start:.1f}s): {by['drop']} dropped,"
        f" {by['expired']} expired, {by['protocol']} protocol errors, {by['handler']} served"
        f" ({handler_errors} with an error); {sum(corpus.skipped.values())} skipped"
        f"\nby category: {dict(sorted(categories.items()))}"
        f"\nworker: {steps} steps, {out['during']['steps']} during the attack; identical to"
        f" the unfuzzed run: {identical} (reference run {t_ref:.1f}s)"
        f"\nPS RSS {before['VmRSS'] / mib:.1f} MiB before, peak {after['VmHWM'] / mib:.1f} MiB"
        f" (HWM before {before['VmHWM'] / mib:.1f}), {after['VmRSS'] / mib:.1f} MiB after:"
        f" peak growth {growth / mib:.1f} MiB (bound {RSS_BOUND / mib:.0f} MiB)"
        f"\ntotal {time.monotonic() - t_start:.1f}s"
    )
    # the PS's counters agree with what was sent
    assert transport["bad_messages"] == by["drop"] + by["protocol"]
    assert transport["expired"] == by["expired"]
    assert transport["errors"] == handler_errors
    assert transport["requests"] == by["handler"] + out["client_requests"] + out["pings"]
    assert transport["replies"] == n_fuzz_replies + out["client_replies"] + out["pings"]
    assert transport["unroutable"] == 0
    curated = Counter(c.code for c in cases)
    assert service["duplicates"] == curated["dup"]
    assert service["fenced"] == curated["fenced"]

    # the worker is unaffected: bit-identical to the same sequence without the fuzzer
    assert np.array_equal(out["final"], out["ref"])
    assert identical
    assert ref_versions == {0: steps, 1: steps}
    assert service["updates_applied"] == 2 * steps
    assert out["during"]["steps"] >= 10, out["during"]

    # oversize frames never reached the PS, and every raw connection was hung up on
    assert out["during"]["hung_up"] == out["during"]["raw"]

    # bounded memory
    assert growth < RSS_BOUND


# --------------------------------------------------------------------------- oversize, client side


def test_oversize_request_surfaces_deadline_exceeded() -> None:
    """A frame over the server's MAXMSGSIZE (but not over the client's own) is dropped
    by ZeroMQ together with the
    connection, silently: the caller gets DeadlineExceeded within its deadline, naming
    the request. Requests in flight beside it on that connection may be lost with it
    (they time out the same way, never hang); the client is served again afterwards."""
    limit = 1 << 20
    options = SocketOptions(linger_ms=0, max_msg_size=limit)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        server = Server(ctx, "127.0.0.1:0", PSService(0), name="ps0", options=options)
        server.bind()
        server.start()
        # a client configured with a larger limit than this server's (with the same
        # limit it refuses to send such a frame: test_transport.py)
        client_options = SocketOptions(linger_ms=0, max_msg_size=4 * limit)
        client = Client(ctx, server.endpoint, "w", options=client_options, timeout=1.0)
        big = np.zeros(limit // 4 + 1, np.float32)  # one frame of limit + 4 bytes

        async def timed(op: str, tensors: list[Tensor]) -> tuple[float, BaseException | None]:
            t0 = time.monotonic()
            try:
                await client.request(op, {"shards": [0]} if tensors else {}, tensors)
            except DeadlineExceeded as exc:
                return time.monotonic() - t0, exc
            return time.monotonic() - t0, None

        try:
            await client.request("ping")
            served = server.stats.requests
            for _ in range(3):
                (t_big, err), (t_beside, beside) = await asyncio.gather(
                    timed("pull", [Tensor(big, "index", 0)]), timed("ping", [])
                )
                assert isinstance(err, DeadlineExceeded)
                assert "pull to tcp://127.0.0.1:" in str(err) and "no reply within 1s" in str(err)
                assert 0.9 < t_big < 3.0 and t_beside < 3.0
                assert beside is None or isinstance(beside, DeadlineExceeded)
                # the connection comes back: the next request is served
                assert (await client.request("ping", timeout=5)).body["role"] == "ps"
            assert server.stats.bad_messages == 0  # the oversize frames never reached it
            assert server.stats.requests >= served + 3
        finally:
            await client.close()
            await server.stop()
            ctx.term()

    asyncio.run(main())
