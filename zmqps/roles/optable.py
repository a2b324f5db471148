"""An op table: the explicit map from an op to its typed body and its handler.

Every role's request handler (PS, chief, a worker's function server) declares one;
nothing is found by name. The codec has checked the body against the op's schema
already (the trust boundary), so :meth:`OpTable.resolve` only builds it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from zmqps.wire import Message
from zmqps.wire import ops as o
from zmqps.wire.errors import ProtocolError

__all__ = ["Handler", "OpTable"]

Handler = Callable[[Message, Any], "Message | Awaitable[Message]"]


class OpTable:
    def __init__(self, server: str, ops: Mapping[str, tuple[type[o.Body], Handler]]) -> None:
        self.server = server
        self.ops = dict(ops)

    def resolve(self, msg: Message) -> tuple[Any, Handler]:
        """The request's typed body and the handler of its op (ProtocolError for an op
        this server does not serve)."""
        entry = self.ops.get(msg.op)
        if entry is None:
            raise ProtocolError(f"{self.server} does not serve {msg.op!r}")
        body, handler = entry
        return body.from_wire(msg.body), handler

    def __call__(self, msg: Message) -> Message | Awaitable[Message]:
        req, handler = self.resolve(msg)
        return handler(msg, req)
