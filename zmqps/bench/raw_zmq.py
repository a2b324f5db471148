"""Side (b): raw blocking pyzmq moving zmqps' frames — the transport limit.

Rules of this module:

* One ROUTER server process per PS, DEALER clients, TCP on 127.0.0.1: the same
  number and sizes of frames per message as zmqps (header, then dense chunks of
  at most 4 MiB, or one index / rows frame per shard), and the same messages
  per step (one per PS and operation, all PS asked before any answer is read).
* No Python work beyond moving the frames: buffers are allocated once and sent
  with ``copy=False``, received frames are not looked at (no decode, no copy
  into parameters, no optimizer). The first header byte says what to answer.
* The server stops on SIGTERM with exit status 0.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from zmqps.bench.common import (
    HOST,
    Child,
    Control,
    Side,
    SideContext,
    child_argv,
    child_env,
    serve_steps,
)
from zmqps.bench.workload import Workload, header_bytes
from zmqps.transport import free_ports

__all__ = ["server_main", "spawn", "worker_main"]

PULL, PUSH, PUSH_PULL, PULL_ROWS, PUSH_ROWS = b"P", b"U", b"B", b"R", b"W"


def _header(op: bytes, buffers: int) -> bytes:
    return op + bytes(header_bytes(buffers) - 1)


def _buffer(nbytes: int, fill: int = 0) -> memoryview:
    """``nbytes`` bytes allocated once (numpy: no Python objects per byte)."""
    return np.full(max(1, nbytes), fill, np.uint8).data


def _views(buf: memoryview, sizes: list[int]) -> list[memoryview]:
    out, off = [], 0
    for n in sizes:
        out.append(buf[off : off + n])
        off += n
    return out


def spawn(wl: Workload, ctx: SideContext) -> Side:
    ports = free_ports(wl.num_ps, HOST)
    env = child_env()
    side = Side("raw", wl.units_per_step, ctx.timeout, sigterm_servers=True)
    for ps in wl.active_ps():
        path = ctx.write_config(
            f"raw-server{ps}", {"workload": wl.to_json(), "ps": ps, "port": ports[ps]}
        )
        side.servers.append(
            Child(f"raw-server{ps}", child_argv("raw", "server", path), ctx.run_dir, env)
        )
    for i in range(ctx.workers):
        config = {
            "workload": wl.to_json(),
            "ports": ports,
            "index": i,
            "seed": ctx.seed,
            "timeout": ctx.timeout,
        }
        path = ctx.write_config(f"raw-worker{i}", config)
        side.workers.append(
            Child(
                f"raw-worker{i}", child_argv("raw", "worker", path), ctx.run_dir, env, control=True
            )
        )
    return side


# ---------------------------------------------------------------------- server


def _stop(signum: int, frame: object) -> None:
    sys.exit(0)


def server_main(config: dict[str, Any], ctl: Control | None) -> None:
    wl = Workload.from_json(config["workload"])
    ps = int(config["ps"])
    signal.signal(signal.SIGTERM, _stop)
    zctx = zmq.Context()
    sock = zctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://{HOST}:{int(config['port'])}")
    sizes = [] if wl.suite == "sparse" else wl.chunk_sizes(ps)
    values = _views(_buffer(sum(sizes)), sizes)
    values_reply: list[Any] = [_header(b"o", len(values)), *values]
    ack = _header(b"o", 0)
    row_bytes = wl.row_bytes
    rows = _buffer(wl.batch_rows * row_bytes)
    print(f"raw server {ps}: {len(values)} value frames, {os.getpid()}", file=sys.stderr)
    try:
        while True:
            msg: list[Any] = sock.recv_multipart(copy=False)
            ident, op = msg[0], bytes(msg[1].buffer[:1])
            if op in (PULL, PUSH_PULL):
                sock.send_multipart([ident, *values_reply], copy=False)
            elif op == PULL_ROWS:
                frames = [rows[: (len(f) // 8) * row_bytes] for f in msg[2:]]
                sock.send_multipart([ident, _header(b"o", len(frames)), *frames], copy=False)
            else:
                sock.send_multipart([ident, ack], copy=False)
    finally:
        sock.close(linger=0)
        zctx.term()


# ---------------------------------------------------------------------- client

Frames = list[Any]


def _exchange(socks: dict[int, zmq.Socket[Any]], requests: dict[int, Frames]) -> None:
    for ps, frames in requests.items():
        socks[ps].send_multipart(frames, copy=False)
    for ps in requests:
        socks[ps].recv_multipart(copy=False)


def _dense_steps(
    wl: Workload, socks: dict[int, zmq.Socket[Any]]
) -> dict[str, Callable[[], object]]:
    pulls: dict[int, Frames] = {}
    pushes: dict[int, Frames] = {}
    push_pulls: dict[int, Frames] = {}
    for ps in socks:
        sizes = wl.chunk_sizes(ps)
        grads = _views(_buffer(sum(sizes), 1), sizes)
        pulls[ps] = [_header(PULL, 0)]
        pushes[ps] = [_header(PUSH, len(grads)), *grads]
        push_pulls[ps] = [_header(PUSH_PULL, len(grads)), *grads]

    def pull_push() -> None:
        _exchange(socks, pulls)
        _exchange(socks, pushes)

    def push_pull() -> None:
        _exchange(socks, push_pulls)

    return {"pull+push": pull_push, "push_pull": push_pull}


def _sparse_steps(
    wl: Workload, socks: dict[int, zmq.Socket[Any]], seed: int, index: int
) -> dict[str, Callable[[], object]]:
    row_bytes = wl.row_bytes
    grads = _buffer(wl.batch_rows * row_bytes, 1)

    def frames(ids: Any) -> tuple[dict[int, Frames], dict[int, Frames]]:
        pulls: dict[int, Frames] = {}
        pushes: dict[int, Frames] = {}
        for ps, parts in wl.split_ids(ids).items():
            index_frames = [np.ascontiguousarray(i) for _, i in parts]
            pulls[ps] = [_header(PULL_ROWS, len(parts)), *index_frames]
            pushes[ps] = [_header(PUSH_ROWS, 2 * len(parts))]
            off = 0
            for i in index_frames:
                n = i.size * row_bytes
                pushes[ps] += [i, grads[off : off + n]]
                off += n
        return pulls, pushes

    prepared = itertools.cycle([frames(ids) for ids in wl.id_pool(seed, index)])
    fresh = wl.fresh_ids(seed, index)

    def exchange(pulls: dict[int, Frames], pushes: dict[int, Frames]) -> None:
        _exchange(socks, pulls)
        _exchange(socks, pushes)

    return {
        "rows": lambda: exchange(*next(prepared)),
        "fresh": lambda: exchange(*frames(next(fresh))),  # frames built in the step, like zmqps
    }


def worker_main(config: dict[str, Any], ctl: Control | None) -> None:
    assert ctl is not None
    wl = Workload.from_json(config["workload"])
    ports = config["ports"]
    zctx = zmq.Context()
    socks: dict[int, zmq.Socket[Any]] = {}
    for ps in wl.active_ps():
        s = zctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, int(float(config["timeout"]) * 1000))
        s.connect(f"tcp://{HOST}:{ports[ps]}")
        socks[ps] = s
    try:
        if wl.suite == "sparse":
            steps = _sparse_steps(wl, socks, int(config["seed"]), int(config["index"]))
        else:
            steps = _dense_steps(wl, socks)
        serve_steps(ctl, steps, {})
    finally:
        for s in socks.values():
            s.close(linger=0)
        zctx.term()
