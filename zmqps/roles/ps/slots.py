"""The PS states one PS process serves (its "slots").

With replication a process holds, beside its own PS state, a copy of the state
of each PS it backs up, and once a backup is promoted it serves that state as
the primary. Each state is a whole :class:`PSService` (shards, dedup window,
ledgers, sync mode), so the same code serves and applies every copy. A request
names the state it is for by its ``slot`` (a PS index; none: the process's own);
:class:`PSSlots` is the handler that sends it there.
"""

from __future__ import annotations

from collections.abc import Awaitable

from zmqps.roles.ps.service import PSService
from zmqps.wire import Message
from zmqps.wire.errors import InvalidArgument, NotFound

__all__ = ["PSSlots"]


class PSSlots:
    """A process's PS states by slot; its own is ``own.index``."""

    def __init__(self, own: PSService):
        self.own = own
        self._slots: dict[int, PSService] = {own.index: own}

    def add(self, service: PSService) -> None:
        """Serve ``service`` (a copy of PS ``service.index``'s state) too."""
        if service.index in self._slots:
            raise InvalidArgument(f"ps {self.own.index} already holds ps {service.index}'s state")
        self._slots[service.index] = service

    def remove(self, index: int) -> PSService:
        """Stop serving PS ``index``'s state (never the process's own)."""
        if index == self.own.index:
            raise InvalidArgument(f"ps {index} cannot drop its own state")
        return self._slots.pop(index)

    def slots(self) -> list[int]:
        return sorted(self._slots)

    def __call__(self, msg: Message) -> Message | Awaitable[Message]:
        if msg.slot is None:
            return self.own(msg)
        service = self._slots.get(msg.slot)
        if service is None:
            raise NotFound(f"ps {self.own.index} holds no copy of ps {msg.slot}'s state")
        return service(msg)
