"""Messages: the sans-IO vocabulary every layer above speaks.

A message on the wire is ``[header][buffer 0][buffer 1]...``; here it is a
:class:`Message` holding a small ``body`` map and a tuple of :class:`Tensor`
(one per buffer). Arrays are never copied by this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.wire.errors import ZmqpsError

__all__ = [
    "ERROR",
    "KINDS",
    "OK",
    "PROTOCOL_VERSION",
    "REQUEST_OPS",
    "Message",
    "Tensor",
    "as_wire_array",
    "error_reply",
    "reply",
    "request",
]

PROTOCOL_VERSION = 1

OK = "ok"
ERROR = "error"

#: Every request op the protocol knows (bodies are in :mod:`zmqps.wire.schema`).
REQUEST_OPS = frozenset(
    {
        "ping",
        "register",
        "heartbeat",
        "leave",
        "create_vars",
        "get_placement",
        "create_shards",
        "pull",
        "push",
        "push_pull",
        "pull_rows",
        "push_rows",
        "push_pull_rows",
        "table_rows",
        "shm_attach",
        "shm_detach",
        "seal_hello",
        "status",
        "shutdown",
        "sync_config",
        "wait_step",
        "take_token",
        "ssp_clock",
        # checkpoints and recovery
        "ps_state",
        "fence",
        "checkpoint",
        "checkpoint_save",
        "checkpoint_done",
        "restore",
        # replication: the chief sets each copy's part; a primary ships its entries
        "replica",
        "placement",
        "replicate",
        "join",
        "install",
        "replica_ring",
        # elastic PS: the processes that serve the states (an operator to the chief)
        "scale",
        # coordinator mode: functions scheduled onto worker servers
        "run",
        "make_resource",
    }
)

#: What a buffer is: shard values (or a chunk of them), a gradient chunk,
#: row indices (int64), or row values / row gradients.
KINDS = frozenset({"value", "grad", "index", "rows"})


@dataclass(frozen=True, slots=True)
class Tensor:
    """One buffer of a message and what it is.

    ``ref`` is the shard id the buffer belongs to (-1: none); ``offset`` is the
    element offset of this chunk inside the flattened shard (large shards travel
    as several chunks).
    """

    array: npt.NDArray[Any]
    kind: str = "value"
    ref: int = -1
    offset: int = 0


@dataclass(frozen=True, slots=True)
class Message:
    """A request or a reply. ``op`` is a request op, ``"ok"`` or ``"error"``.

    ``slot``: which PS state of the receiving process a request is for (a process
    serves its own and those it backs up); None: the process's own.

    ``peer``: set by a CURVE server on what it received, the name its allow-list
    gives the client's key (``chief``, ``ps``, ``worker3``: never on the wire, so
    no client can claim one); empty without CURVE."""

    op: str
    id: int = 0
    sender: str = ""
    body: Mapping[str, Any] = field(default_factory=dict)
    tensors: tuple[Tensor, ...] = ()
    deadline: float | None = None
    slot: int | None = None
    peer: str = ""

    @property
    def is_reply(self) -> bool:
        return self.op in (OK, ERROR)


def request(
    op: str,
    body: Mapping[str, Any] | None = None,
    tensors: Sequence[Tensor] = (),
    *,
    id: int = 0,
    sender: str = "",
    deadline: float | None = None,
    slot: int | None = None,
) -> Message:
    return Message(op, id, sender, body or {}, tuple(tensors), deadline, slot)


def reply(
    req: Message,
    body: Mapping[str, Any] | None = None,
    tensors: Sequence[Tensor] = (),
    *,
    sender: str = "",
) -> Message:
    return Message(OK, req.id, sender, body or {}, tuple(tensors))


def error_reply(request_id: int, err: ZmqpsError | Exception, *, sender: str = "") -> Message:
    """The error reply for ``err``; unknown exception types become code ``internal``."""
    code = err.code if isinstance(err, ZmqpsError) else "internal"
    text = str(err) or type(err).__name__
    return Message(ERROR, request_id, sender, {"code": code, "message": text[:2000]})


def as_wire_array(array: Any, dtype: np.dtype[Any] | None = None) -> npt.NDArray[Any]:
    """A C-contiguous little-endian view of ``array`` (copies only when it must)."""
    arr = np.asarray(array, dtype=dtype)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr)
