"""A live PS under attack: thousands of garbage and crafted messages from a raw
DEALER while a legitimate ParameterClient trains against it.

The PS must never crash, must answer every malformed message whose request id is
readable with an error reply, drop (and count) the others, and apply exactly the
legitimate pushes: the final parameters equal a reference SGD computation of those
pushes alone, bit for bit.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from zmqps.core.variables import Placement, ShardInfo, VariableDef
from zmqps.roles.client import ParameterClient
from zmqps.roles.ps import PSService
from zmqps.transport import Client, Server, SocketOptions
from zmqps.wire import PROTOCOL_VERSION, Message, Tensor, decode, encode, request
from zmqps.wire.errors import FencedError, InvalidArgument, NotFound, RolledBack

pytestmark = pytest.mark.timeout(60)

LR = 0.25  # a power of two: every SGD step below is exact in float32
ROWS, COLS = 1000, 16
HALF = ROWS // 2
SHARD_SIZE = HALF * COLS  # elements per shard
OPTS = SocketOptions(linger_ms=0)

VAR = VariableDef("w", (ROWS, COLS), "float32", init={"name": "normal", "seed": 5, "stddev": 0.5})
PLACEMENT = Placement(
    variables=(VAR,),
    shards=(ShardInfo(0, "w", 0, 0, HALF, 0), ShardInfo(1, "w", 1, HALF, HALF, 0)),
    optimizer={"name": "sgd", "lr": LR},
)


def sgd(ref: np.ndarray, grad: np.ndarray) -> None:
    """The reference update, with the same float32 operations as the PS's SGD."""
    ref += grad * np.float32(-LR)


def int_grad(rng: np.random.Generator, shape: tuple[int, ...] = (ROWS, COLS)) -> np.ndarray:
    return rng.integers(-8, 9, size=shape).astype(np.float32)


def push_body(
    worker: str, inc: int, seq: int, shards: list[int], versions: list[int] | None = None
) -> dict[str, Any]:
    return {
        "shards": shards,
        "versions": versions if versions is not None else [0] * len(shards),
        "worker": worker,
        "inc": inc,
        "seq": seq,
    }


def chunks(grads: dict[int, np.ndarray], step: int = 3000, kind: str = "grad") -> list[Tensor]:
    """Flat gradient chunks of each shard, tiling it exactly."""
    out = []
    for sid, g in grads.items():
        flat = g.reshape(-1)
        out += [Tensor(flat[o : o + step], kind, sid, o) for o in range(0, flat.size, step)]
    return out


def split(g: np.ndarray) -> dict[int, np.ndarray]:
    """A whole-variable gradient as per-shard flat pieces."""
    return {0: g[:HALF].reshape(-1), 1: g[HALF:].reshape(-1)}


@dataclass
class PS:
    ctx: zmq.asyncio.Context
    server: Server
    service: PSService
    admin: Client


@contextlib.asynccontextmanager
async def live_ps() -> AsyncIterator[PS]:
    """A PSService behind a real Server on 127.0.0.1:0 with the two shards of ``w`` created."""
    ctx = zmq.asyncio.Context()
    service = PSService(0)
    server = Server(ctx, "127.0.0.1:0", service, name="ps0", options=OPTS)
    server.bind()
    server.start()
    admin = Client(ctx, server.endpoint, "admin", options=OPTS, timeout=10)
    try:
        defs = [d.to_wire() for _, d in PLACEMENT.shard_defs()]
        rep = await admin.request("create_shards", {"shards": defs})
        assert rep.body == {"shards": [0, 1]}
        yield PS(ctx, server, service, admin)
    finally:
        await admin.close()
        await server.stop()
        ctx.term()


async def values(ps: PS) -> np.ndarray:
    """The whole variable as the PS holds it now (pulled over the wire)."""
    rep = await ps.admin.request("pull", {"shards": [0, 1]})
    flat = np.empty(ROWS * COLS, np.float32)
    for t in rep.tensors:
        base = 0 if t.ref == 0 else SHARD_SIZE
        flat[base + t.offset : base + t.offset + t.array.size] = t.array
    return flat.reshape(ROWS, COLS)


# --------------------------------------------------------------------------- hostile cases


@dataclass
class Case:
    label: str
    frames: list[bytes]
    #: None: dropped without a reply; an error code; or "dup" (ok, applied False).
    expect: str | None
    #: rejected by the codec (counted in server.stats.bad_messages)
    codec: bool
    rid: int | None = None


def as_bytes(frames: list[Any]) -> list[bytes]:
    return [f if isinstance(f, bytes) else memoryview(f).tobytes() for f in frames]


def header(rid: int, op: str = "push", body: Any = None, **extra: Any) -> dict[str, Any]:
    h: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": op, "id": rid, "body": body}
    h.update(extra)
    return h


def packed(h: Any, *bufs: bytes) -> list[bytes]:
    return [msgpack.packb(h, use_bin_type=True), *bufs]


NON_MAP_FIRST = [b for b in range(256) if not (0x80 <= b <= 0x8F or b in (0xDE, 0xDF))]


def random_bytes(rng: random.Random, n: int) -> bytes:
    return bytes([rng.choice(NON_MAP_FIRST)]) + rng.randbytes(n)


def random_obj(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 3 or r < 0.5:
        return rng.choice(
            [
                None,
                True,
                rng.randint(-(2**63), 2**64 - 1),
                rng.random() * 1e6,
                "".join(rng.choice("abcdefghijklmnop_") for _ in range(rng.randint(0, 12))),
            ]
        )
    if r < 0.75:
        return [random_obj(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    keys = ["v", "op", "body", "bufs", "dl", "from", "x", "shards"]
    return {rng.choice(keys): random_obj(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def _deep(depth: int) -> bytes:
    return b"\x91" * depth + b"\x01"


def _map(fields: list[tuple[Any, bytes]]) -> bytes:
    return bytes([0x80 | len(fields)]) + b"".join(msgpack.packb(k) + v for k, v in fields)


def unreadable_cases(rng: random.Random) -> list[Case]:
    """Messages whose request id cannot be read: dropped and counted, no reply."""
    out: list[Case] = []
    for _ in range(500):
        out.append(Case("random bytes", [random_bytes(rng, rng.randint(0, 200))], None, True))
    for _ in range(300):
        frames = [random_bytes(rng, rng.randint(0, 60))]
        frames += [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))]
        out.append(Case("random frames", frames, None, True))
    for _ in range(400):
        obj = random_obj(rng)
        if isinstance(obj, dict):
            obj["id"] = rng.choice([-1, "7", True, 2**63, 1.5, None, [3]])
        out.append(Case("random msgpack", packed(obj), None, True))
    base = dict(header(5, "ping", {}))
    crafted: dict[str, list[bytes]] = {
        "empty header": [b""],
        "1.1 MiB header": [b"\x84" + rng.randbytes(1_100_000)],
        "1 MiB of nested arrays": [b"\x91" * ((1 << 20) - 2) + b"\xc0"],
        "nesting past msgpack's stack": [_deep(1100)],
        "array32 of 4G items": [b"\xdd\xff\xff\xff\xff" + b"\x00" * 32],
        "map32 of 4G entries": [b"\xdf\xff\xff\xff\xff"],
        "str32 of 4 GB": [b"\xdb\xff\xff\xff\xff abc"],
        "bin in header": packed({**base, "from": b"\x00\x01"}),
        "ext in header": [
            _map([*((k, msgpack.packb(v)) for k, v in base.items()), ("x", b"\xd4\x01\x00")])
        ],
        "timestamp in header": [msgpack.packb({**base, "dl": msgpack.Timestamp(5)})],
        "int key": [msgpack.packb({**base, 7: 1})],
        "nil key": [_map([("id", b"\x05"), (None, b"\x01")])],
        "list key": [b"\x82" + msgpack.packb("id") + b"\x05" + b"\x91\x01\x01"],
        "truncated": [msgpack.packb(base)[:-3]],
        "trailing bytes": [msgpack.packb(base) + b"\x00"],
        "string past 64 KiB": packed({**base, "from": "x" * 70_000}),
        "no id": packed({k: v for k, v in base.items() if k != "id"}),
        "header is a list": packed([1, "push", 5, {}]),
        "invalid utf-8": [b"\x81\xa2\xff\xfe\x01"],
    }
    for label, frames in crafted.items():
        for _ in range(5):
            out.append(Case(label, frames, None, True))
    return out


def codec_error_cases(ids: Callable[[], int]) -> list[Case]:
    """Messages the codec refuses with the id readable: a "protocol" error reply."""
    good = push_body("mallory", 0, 1, [0])
    g4 = np.zeros(4, np.float32).tobytes()

    def spec(*s: Any) -> list[Any]:
        return list(s)

    variants: dict[str, Callable[[int], list[bytes]]] = {
        "version 2": lambda r: packed(header(r, body=good, v=2)),
        "version '1'": lambda r: packed(header(r, body=good, v="1")),
        "version True": lambda r: packed(header(r, body=good, v=True)),
        "version nested 1000 deep": lambda r: [
            _map(
                [
                    ("v", _deep(1000)),
                    ("op", msgpack.packb("ping")),
                    ("id", msgpack.packb(r)),
                    ("body", b"\x80"),
                ]
            )
        ],
        "unknown op": lambda r: packed(header(r, "frobnicate", {})),
        "op not a string": lambda r: packed(header(r, 3, {})),
        "body a list": lambda r: packed(header(r, "pull", [0])),
        "no body": lambda r: packed({"v": 1, "op": "ping", "id": r}),
        "unknown header field": lambda r: packed(header(r, "ping", {}, evil=1)),
        "sender too long": lambda r: packed(header(r, "ping", {}, **{"from": "m" * 200})),
        "deadline NaN": lambda r: packed(header(r, "ping", {}, dl=float("nan"))),
        "seq is a bool": lambda r: packed(header(r, body={**good, "seq": True})),
        "seq negative": lambda r: packed(header(r, body={**good, "seq": -1})),
        "shard id a string": lambda r: packed(header(r, body={**good, "shards": ["0"]})),
        "no worker": lambda r: packed(
            header(r, body={k: v for k, v in good.items() if k != "worker"})
        ),
        "unknown body field": lambda r: packed(header(r, body={**good, "scale": 100.0})),
        "worker name too long": lambda r: packed(header(r, body={**good, "worker": "m" * 65})),
        "pull of 65537 shards": lambda r: packed(header(r, "pull", {"shards": [0] * 65537})),
        "negative dims": lambda r: packed(
            header(r, body=good, bufs=[spec("float32", [-1], "grad", 0, 0)]), g4
        ),
        "ndim 9": lambda r: packed(
            header(r, body=good, bufs=[spec("float32", [1] * 9, "grad", 0, 0)]), g4
        ),
        "dtype float128": lambda r: packed(
            header(r, body=good, bufs=[spec("float128", [1], "grad", 0, 0)]), g4
        ),
        "dtype object": lambda r: packed(
            header(r, body=good, bufs=[spec("object", [1], "grad", 0, 0)]), g4
        ),
        "dtype >f4": lambda r: packed(
            header(r, body=good, bufs=[spec(">f4", [1], "grad", 0, 0)]), g4
        ),
        "dtype V8": lambda r: packed(
            header(r, body=good, bufs=[spec("V8", [1], "grad", 0, 0)]), g4 * 2
        ),
        "dtype U4": lambda r: packed(
            header(r, body=good, bufs=[spec("U4", [1], "grad", 0, 0)]), g4 * 4
        ),
        "shape/length mismatch": lambda r: packed(
            header(r, body=good, bufs=[spec("float32", [SHARD_SIZE], "grad", 0, 0)]), g4
        ),
        "huge dims, zero elements": lambda r: packed(
            header(r, body=good, bufs=[spec("float32", [0, 2**62, 2**62], "grad", 0, 0)]), b""
        ),
        "huge dims": lambda r: packed(
            header(r, body=good, bufs=[spec("float32", [2**62, 2**62], "grad", 0, 0)]), g4
        ),
        "missing buffer frame": lambda r: packed(
            header(r, body=good, bufs=[spec("float32", [1], "grad", 0, 0)])
        ),
        "extra buffer frame": lambda r: packed(
            header(r, body=good, bufs=[spec("float32", [1], "grad", 0, 0)]), g4, g4
        ),
        "unknown tensor kind": lambda r: packed(
            header(r, body=good, bufs=[spec("float32", [1], "weights", 0, 0)]), g4
        ),
        "ref out of range": lambda r: packed(
            header(r, body=good, bufs=[spec("float32", [1], "grad", 2**31, 0)]), g4
        ),
        "negative offset": lambda r: packed(
            header(r, body=good, bufs=[spec("float32", [1], "grad", 0, -1)]), g4
        ),
        "spec too short": lambda r: packed(
            header(r, body=good, bufs=[spec("float32", [1], "grad")]), g4
        ),
        "dtype nested 1000 deep": lambda r: [
            _map(
                [
                    ("v", b"\x01"),
                    ("op", msgpack.packb("pull")),
                    ("id", msgpack.packb(r)),
                    ("body", msgpack.packb({"shards": [0]})),
                    ("bufs", b"\x91\x95" + _deep(1000) + b"\x91\x01\xa5value\x00\x00"),
                ]
            ),
            g4,
        ],
        "an ok reply sent to the server": lambda r: as_bytes(encode(Message("ok", r))),
        "an error reply sent to the server": lambda r: packed(
            header(r, "error", {"code": "x", "message": "y"})
        ),
    }
    return [
        Case(label, make(rid := ids()), "protocol", True, rid)
        for label, make in variants.items()
        for _ in range(10)
    ]


def handler_error_cases(ids: Callable[[], int], rng: np.random.Generator) -> list[Case]:
    """Messages that decode but that the PS refuses (nothing changes), or duplicates."""
    g = split(int_grad(rng))
    f32 = np.float32

    def msg(op: str, body: dict[str, Any], tensors: list[Tensor]) -> Callable[[int], list[bytes]]:
        return lambda r: as_bytes(encode(request(op, body, tensors, id=r, sender="mallory")))

    def m(seq: int, shards: list[int], **kw: Any) -> dict[str, Any]:
        return {**push_body("mallory", 0, seq, shards), **kw}

    full0, full1 = g[0], g[1]
    idx = np.array([3, 7], np.int64)
    rows2 = np.ones((2, COLS), f32)
    variants: dict[str, tuple[str, Callable[[int], list[bytes]]]] = {
        "push to unknown shard": ("not_found", msg("push", m(1, [7]), chunks({7: full0}))),
        "push_pull to unknown shard": (
            "not_found",
            msg("push_pull", m(1, [0, 9]), chunks({0: full0, 9: full1})),
        ),
        "pull unknown shard": ("not_found", msg("pull", {"shards": [0, 12]}, [])),
        "pull_rows unknown shard": (
            "not_found",
            msg("pull_rows", {"shards": [4]}, [Tensor(idx, "index", 4)]),
        ),
        "chunks with a gap": (
            "invalid_argument",
            msg(
                "push",
                m(2, [0]),
                [Tensor(full0[:2000], "grad", 0, 0), Tensor(full0[4000:], "grad", 0, 4000)],
            ),
        ),
        "overlapping chunks": (
            "invalid_argument",
            msg(
                "push",
                m(3, [0]),
                [Tensor(full0[:5000], "grad", 0, 0), Tensor(full0[4000:], "grad", 0, 4000)],
            ),
        ),
        "chunk one short": (
            "invalid_argument",
            msg("push", m(4, [0]), [Tensor(full0[:-1], "grad", 0, 0)]),
        ),
        "chunk one long": (
            "invalid_argument",
            msg("push", m(5, [0]), [Tensor(np.append(full0, f32(1)), "grad", 0, 0)]),
        ),
        "chunk past the end": (
            "invalid_argument",
            msg(
                "push", m(5, [0]), [*chunks({0: full0}), Tensor(full0[:10], "grad", 0, SHARD_SIZE)]
            ),
        ),
        "empty chunk": (
            "invalid_argument",
            msg("push", m(6, [0]), [*chunks({0: full0}), Tensor(full0[:0], "grad", 0, 0)]),
        ),
        "int32 gradient": (
            "invalid_argument",
            msg("push", m(7, [0]), chunks({0: full0.astype(np.int32)})),
        ),
        "bool gradient": ("invalid_argument", msg("push", m(8, [0]), chunks({0: full0 > 0}))),
        "uint8 gradient": (
            "invalid_argument",
            msg("push", m(8, [0]), chunks({0: np.abs(full0).astype(np.uint8)})),
        ),
        "values instead of grads": (
            "invalid_argument",
            msg("push", m(9, [0]), chunks({0: full0}, kind="value")),
        ),
        "tensor for a shard not named": (
            "invalid_argument",
            msg("push", m(10, [0]), chunks({0: full0, 1: full1})),
        ),
        "no gradient for a named shard": (
            "invalid_argument",
            msg("push", m(11, [0, 1]), chunks({0: full0})),
        ),
        "shard named twice": (
            "invalid_argument",
            msg("push", m(12, [0, 0], versions=[0, 0]), chunks({0: full0})),
        ),
        "versions length mismatch": (
            "invalid_argument",
            msg("push", m(13, [0, 1], versions=[0]), chunks(g)),
        ),
        # values this PS never had (as a push of a cluster lost, sent again to the
        # values made anew, says): pull again; nothing changed, counted dropped
        "version from the future": (
            "rolled_back",
            msg("push", m(14, [0], versions=[10**6]), chunks({0: full0})),
        ),
        "second shard invalid": (
            "invalid_argument",
            msg("push", m(15, [0, 1]), [*chunks({0: full0}), Tensor(full1[:-16], "grad", 1, 0)]),
        ),
        "push_pull with a gap": (
            "invalid_argument",
            msg("push_pull", m(16, [1]), [Tensor(full1[1:], "grad", 1, 1)]),
        ),
        "pull_rows float index": (
            "invalid_argument",
            msg("pull_rows", {"shards": [0]}, [Tensor(idx.astype(np.float64), "index", 0)]),
        ),
        "pull_rows 2-D index": (
            "invalid_argument",
            msg("pull_rows", {"shards": [0]}, [Tensor(idx.reshape(1, 2), "index", 0)]),
        ),
        "pull_rows row of the other shard": (
            "invalid_argument",
            msg("pull_rows", {"shards": [1]}, [Tensor(idx, "index", 1)]),
        ),
        "pull_rows two tensors for one shard": (
            "invalid_argument",
            msg("pull_rows", {"shards": [0]}, [Tensor(idx, "index", 0), Tensor(idx, "index", 0)]),
        ),
        "push_rows kinds swapped": (
            "invalid_argument",
            msg("push_rows", m(17, [0]), [Tensor(rows2, "rows", 0), Tensor(idx, "index", 0)]),
        ),
        "push_rows float index": (
            "invalid_argument",
            msg(
                "push_rows",
                m(18, [0]),
                [Tensor(idx.astype(f32), "index", 0), Tensor(rows2, "rows", 0)],
            ),
        ),
        "push_rows int rows": (
            "invalid_argument",
            msg(
                "push_rows",
                m(19, [0]),
                [Tensor(idx, "index", 0), Tensor(rows2.astype(np.int32), "rows", 0)],
            ),
        ),
        "push_rows wrong row width": (
            "invalid_argument",
            msg(
                "push_rows",
                m(20, [0]),
                [Tensor(idx, "index", 0), Tensor(rows2[:, :15].copy(), "rows", 0)],
            ),
        ),
        "push_rows row outside the shard": (
            "invalid_argument",
            msg(
                "push_rows", m(21, [0]), [Tensor(idx + HALF, "index", 0), Tensor(rows2, "rows", 0)]
            ),
        ),
        "create_shards conflicting": (
            "invalid_argument",
            msg(
                "create_shards",
                {"shards": [{**PLACEMENT.shard_defs()[0][1].to_wire(), "rows": 10}]},
                [],
            ),
        ),
        "create_shards new + conflicting": (
            "invalid_argument",
            msg(
                "create_shards",
                {
                    "shards": [
                        {**PLACEMENT.shard_defs()[0][1].to_wire(), "id": 50},
                        {**PLACEMENT.shard_defs()[1][1].to_wire(), "row_start": 0},
                    ]
                },
                [],
            ),
        ),
        "create_shards int dtype": (
            "invalid_argument",
            msg(
                "create_shards",
                {
                    "shards": [
                        {**PLACEMENT.shard_defs()[0][1].to_wire(), "id": 51, "dtype": "int32"}
                    ]
                },
                [],
            ),
        ),
        "create_shards unknown optimizer": (
            "invalid_argument",
            msg(
                "create_shards",
                {
                    "shards": [
                        {
                            **PLACEMENT.shard_defs()[0][1].to_wire(),
                            "id": 52,
                            "optimizer": {"name": "evil", "lr": 1.0},
                        }
                    ]
                },
                [],
            ),
        ),
        "register (not a PS op)": (
            "protocol",
            msg("register", {"role": "worker", "index": 0, "incarnation": 0}, []),
        ),
        "heartbeat (not a PS op)": (
            "protocol",
            msg("heartbeat", {"role": "worker", "index": 0, "incarnation": 0, "step": 1}, []),
        ),
        "create_vars (not a PS op)": ("protocol", msg("create_vars", {"variables": []}, [])),
        # valid pushes from replaced incarnations
        "legit's old incarnation 2": (
            "fenced",
            msg("push", push_body("legit", 2, 99, [0, 1]), chunks(g)),
        ),
        "legit's old incarnation 0": (
            "fenced",
            msg("push", push_body("legit", 0, 1, [0]), chunks({0: full0})),
        ),
        "zombie's old incarnation": (
            "fenced",
            msg("push_pull", push_body("zombie", 1, 2, [0, 1]), chunks(g)),
        ),
        # valid pushes already applied
        "replay of dup/1/1": ("dup", msg("push", push_body("dup", 1, 1, [0, 1]), chunks(g))),
        "replay of legit/3/1": ("dup", msg("push", push_body("legit", 3, 1, [0, 1]), chunks(g))),
    }
    return [
        Case(label, make(rid := ids()), code, False, rid)
        for label, (code, make) in variants.items()
        for _ in range(10)
    ]


# --------------------------------------------------------------------------- the attack


@pytest.mark.timeout(90)
def test_live_ps_survives_hostile_traffic_and_applies_only_legitimate_pushes() -> None:
    rng = random.Random(20240601)
    nprng = np.random.default_rng(11)
    next_id = iter(range(1_000_000, 2_000_000))
    cases = unreadable_cases(rng)
    cases += codec_error_cases(lambda: next(next_id))
    cases += handler_error_cases(lambda: next(next_id), nprng)
    rng.shuffle(cases)
    assert len(cases) >= 2000
    by_id = {c.rid: c for c in cases if c.rid is not None}
    expected_replies = len(by_id)

    async def main() -> dict[str, Any]:
        async with live_ps() as ps:
            ref = await values(ps)
            # Setup pushes (part of the reference): "dup" and "zombie" are known to the PS.
            for worker, inc in (("dup", 1), ("zombie", 2)):
                g = int_grad(nprng)
                rep = await ps.admin.request(
                    "push", push_body(worker, inc, 1, [0, 1]), chunks(split(g))
                )
                assert rep.body["applied"] is True
                sgd(ref, g)

            legit_transport = Client(
                ps.ctx, ps.server.endpoint, "worker:0", options=OPTS, timeout=10
            )
            pc = ParameterClient(
                [legit_transport],
                PLACEMENT,
                worker="legit",
                incarnation=3,
                chunk_bytes=8000,
                timeout=5.0,
            )
            legit_pushes = 0

            async def legit_step() -> None:
                nonlocal legit_pushes
                i = legit_pushes
                if i % 3 != 1:  # after a push_pull the client already holds fresh values
                    await pc.pull()
                assert np.array_equal(pc.params["w"], ref), f"legit step {i}: values drifted"
                g = int_grad(nprng)
                await pc.push({"w": g}, pull=i % 3 == 0)
                sgd(ref, g)
                legit_pushes += 1

            await legit_step()  # the PS now knows legit's incarnation 3

            hostile = ps.ctx.socket(zmq.DEALER)
            hostile.setsockopt(zmq.LINGER, 0)
            hostile.setsockopt(zmq.ROUTING_ID, b"mallory")
            hostile.connect(ps.server.endpoint)
            replies: dict[int, Message] = {}
            stray: list[Any] = []
            sent = asyncio.Event()
            during = {"pushes": 0}

            async def attack() -> None:
                for i, case in enumerate(cases):
                    await hostile.send_multipart(case.frames)
                    if i % 20 == 0:
                        await asyncio.sleep(0.002)  # let the legitimate worker in
                sent.set()
                during["pushes"] = legit_pushes

            async def collect() -> None:
                while True:
                    m = decode(await hostile.recv_multipart())
                    if m.id in replies or m.id not in by_id:
                        stray.append(m)
                    replies[m.id] = m

            async def train() -> None:
                while legit_pushes < 25 or not sent.is_set():
                    await legit_step()

            collector = asyncio.ensure_future(collect())
            try:
                t0 = time.monotonic()
                await asyncio.gather(attack(), train())
                deadline = time.monotonic() + 30
                while len(replies) < expected_replies and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.3)  # nothing else may arrive
                elapsed = time.monotonic() - t0
            finally:
                collector.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collector
                hostile.close()

            # the PS is alive and serves everyone
            assert (await ps.admin.request("ping")).body == {"role": "ps", "index": 0}
            await legit_step()
            final = await values(ps)
            await legit_transport.close()
            return {
                "replies": replies,
                "stray": stray,
                "ref": ref,
                "final": final,
                "legit_pushes": legit_pushes,
                "stats": ps.server.stats,
                "service": ps.service,
                "elapsed": elapsed,
                "during": during["pushes"] - 1,
            }

    out = asyncio.run(main())
    replies, stats, service = out["replies"], out["stats"], out["service"]

    assert out["stray"] == []
    wrong = []
    for rid, case in by_id.items():
        m = replies.get(rid)
        got = (
            None
            if m is None
            else (
                "dup"
                if m.op == "ok" and m.body.get("applied") is False
                else m.body.get("code", m.op)
            )
        )
        if got != case.expect:
            wrong.append((case.label, case.expect, got, None if m is None else m.body))
    assert not wrong, f"{len(wrong)} unexpected outcomes, e.g. {wrong[:5]}"

    dropped = sum(1 for c in cases if c.rid is None)
    error_replies = sum(1 for m in replies.values() if m.op == "error")
    assert error_replies == sum(1 for c in cases if c.expect not in (None, "dup"))
    assert stats.bad_messages == sum(1 for c in cases if c.codec)
    assert stats.bad_messages == dropped + sum(1 for c in cases if c.codec and c.rid is not None)
    assert stats.errors == sum(1 for c in cases if not c.codec and c.expect != "dup")
    assert service.duplicates == sum(1 for c in cases if c.expect == "dup")
    assert service.fenced == sum(1 for c in cases if c.expect == "fenced")

    # bad pushes changed nothing: exactly the legitimate updates, bit for bit
    pushes = out["legit_pushes"] + 2
    assert service.store.updates_applied == 2 * pushes
    assert service.store.versions() == {0: pushes, 1: pushes}
    assert service.store.ids() == [0, 1]  # no shard slipped in via create_shards
    assert np.array_equal(out["final"], out["ref"])
    assert out["during"] >= 10  # the legitimate worker trained while under attack
    codes = Counter(c.expect for c in cases)
    print(
        f"\n{len(cases)} hostile messages in {out['elapsed']:.2f}s: {dropped} dropped,"
        f" {error_replies} error replies {dict(codes)}; {out['legit_pushes']} legitimate pushes,"
        f" {out['during']} of them during the attack"
    )


# --------------------------------------------------------------------------- push semantics


def run(main: Callable[[PS], Any]) -> None:
    async def wrapper() -> None:
        async with live_ps() as ps:
            await main(ps)

    asyncio.run(wrapper())


@pytest.mark.parametrize("defect", ["short chunk", "unknown shard", "int dtype", "future version"])
def test_push_with_an_invalid_second_shard_changes_nothing(defect: str) -> None:
    g = split(int_grad(np.random.default_rng(1)))

    async def main(ps: PS) -> None:
        before = await values(ps)
        shards, versions = [0, 1], [0, 0]
        tensors = chunks({0: g[0]})
        if defect == "short chunk":
            tensors += [Tensor(g[1][:-1], "grad", 1, 0)]
        elif defect == "unknown shard":
            shards = [0, 3]
            tensors += chunks({3: g[1]})
        elif defect == "int dtype":
            tensors += chunks({1: g[1].astype(np.int64)})
        else:
            versions = [0, 1]
            tensors += chunks({1: g[1]})
        body = {**push_body("w", 1, 1, shards), "versions": versions}
        refusal = {"unknown shard": NotFound, "future version": RolledBack}
        with pytest.raises(refusal.get(defect, InvalidArgument)):
            await ps.admin.request("push", body, tensors)
        assert np.array_equal(await values(ps), before)  # shard 0 untouched
        assert ps.service.store.versions() == {0: 0, 1: 0}
        assert ps.service.store.updates_applied == 0
        # the refused push was not recorded: the corrected retry (same seq) applies
        rep = await ps.admin.request("push", push_body("w", 1, 1, [0, 1]), chunks(g))
        assert rep.body["applied"] is True
        expected = before.copy()
        sgd(expected, np.concatenate([g[0], g[1]]).reshape(ROWS, COLS))
        assert np.array_equal(await values(ps), expected)

    run(main)


@pytest.mark.parametrize("op", ["push", "push_pull"])
def test_duplicate_push_is_acked_but_not_applied(op: str) -> None:
    g = int_grad(np.random.default_rng(2))

    async def main(ps: PS) -> None:
        expected = await values(ps)
        body = push_body("w", 4, 7, [0, 1])
        first = await ps.admin.request(op, body, chunks(split(g)))
        assert first.body["applied"] is True and first.body["versions"] == [1, 1]
        sgd(expected, g)
        for _ in range(3):  # e.g. a retry whose first ack was lost
            again = await ps.admin.request(op, body, chunks(split(g)))
            assert again.body["applied"] is False
            assert again.body["versions"] == [1, 1] and again.body["staleness"] == []
        if op == "push_pull":  # the duplicate still returns the current values
            flat = np.concatenate(
                [t.array for t in sorted(again.tensors, key=lambda t: (t.ref, t.offset))]
            )
            assert np.array_equal(flat.reshape(ROWS, COLS), expected)
        assert np.array_equal(await values(ps), expected)
        assert ps.service.duplicates == 3
        assert ps.service.store.updates_applied == 2

    run(main)


def test_older_incarnation_is_fenced_after_a_newer_one_pushed() -> None:
    rng = np.random.default_rng(3)

    async def main(ps: PS) -> None:
        expected = await values(ps)
        g = int_grad(rng)
        # incarnation 1 pushes, then its replacement (2) does
        assert (
            await ps.admin.request("push", push_body("w", 1, 1, [0, 1]), chunks(split(g)))
        ).body["applied"]
        sgd(expected, g)
        g = int_grad(rng)
        assert (
            await ps.admin.request("push", push_body("w", 2, 1, [0, 1]), chunks(split(g)))
        ).body["applied"]
        sgd(expected, g)
        # the zombie (1) wakes up: fenced, whatever its sequence number
        for seq in (1, 2, 1000):
            with pytest.raises(FencedError):
                await ps.admin.request(
                    "push", push_body("w", 1, seq, [0, 1]), chunks(split(int_grad(rng)))
                )
        with pytest.raises(FencedError):
            await ps.admin.request("push_pull", push_body("w", 0, 5, [0]), chunks({0: split(g)[0]}))
        assert np.array_equal(await values(ps), expected)
        assert ps.service.fenced == 4
        # the live incarnation goes on; an even newer one fences it in turn
        g = int_grad(rng)
        assert (
            await ps.admin.request("push", push_body("w", 2, 2, [0, 1]), chunks(split(g)))
        ).body["applied"]
        sgd(expected, g)
        g = int_grad(rng)
        assert (
            await ps.admin.request("push", push_body("w", 3, 1, [0, 1]), chunks(split(g)))
        ).body["applied"]
        sgd(expected, g)
        with pytest.raises(FencedError):
            await ps.admin.request(
                "push", push_body("w", 2, 3, [0, 1]), chunks(split(int_grad(rng)))
            )
        assert np.array_equal(await values(ps), expected)

    run(main)


def test_parameter_client_of_a_replaced_incarnation_is_fenced() -> None:
    """The same through ParameterClient: a restarted worker fences its old self."""

    async def main(ps: PS) -> None:
        old_t = Client(ps.ctx, ps.server.endpoint, "worker:0", options=OPTS, timeout=5)
        new_t = Client(ps.ctx, ps.server.endpoint, "worker:0b", options=OPTS, timeout=5)
        try:
            old = ParameterClient(
                [old_t], PLACEMENT, worker="worker:0", incarnation=1, push_attempts=1
            )
            new = ParameterClient(
                [new_t], PLACEMENT, worker="worker:0", incarnation=2, push_attempts=1
            )
            g = np.ones((ROWS, COLS), np.float32)
            await old.pull()
            await old.push({"w": g})
            await new.pull()
            await new.push({"w": g})
            with pytest.raises(FencedError):
                await old.push({"w": g})
            await new.pull()
            assert ps.service.store.versions() == {0: 2, 1: 2}
        finally:
            await old_t.close()
            await new_t.close()

    run(main)
