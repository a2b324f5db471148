"""The ZeroMQ context every zmqps socket is made from.

Roles, the coordinator and the benchmarks hold a context (one per process or
per event loop) and pass it to :class:`~zmqps.transport.Server` and
:class:`~zmqps.transport.Client`; they create it here and annotate it with
:data:`ZmqContext`, so that nothing outside this package imports ``zmq``
(an import contract in pyproject.toml checks it).
"""

from __future__ import annotations

from typing import TypeAlias

import zmq
import zmq.asyncio

__all__ = ["ZmqContext", "new_context", "zmq_versions"]

#: the asyncio ZeroMQ context (``zmq.asyncio.Context``), for annotations
ZmqContext: TypeAlias = zmq.asyncio.Context


def new_context(max_sockets: int | None = None) -> ZmqContext:
    """A new asyncio ZeroMQ context; its owner calls ``term()`` on it when done.
    ``max_sockets``: more sockets than libzmq's default 1,023 (a load simulator's
    thousands of clients)."""
    ctx = zmq.asyncio.Context()
    if max_sockets is not None:
        ctx.set(zmq.MAX_SOCKETS, max_sockets)
    return ctx


def zmq_versions() -> dict[str, str]:
    """The pyzmq and libzmq versions (``{"pyzmq": ..., "libzmq": ...}``)."""
    return {"pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()}
