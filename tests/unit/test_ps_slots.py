"""A PS process serving several PS states (zmqps.roles.ps.slots): a request goes to
the state its slot names, or to the process's own."""

from __future__ import annotations

import asyncio

import pytest

from zmqps.roles.ps import PSService
from zmqps.roles.ps.slots import PSSlots
from zmqps.transport.fake import FakeNetwork
from zmqps.wire.errors import InvalidArgument, NotFound


def test_requests_reach_the_state_their_slot_names() -> None:
    async def body() -> None:
        own, copy = PSService(1), PSService(3)
        slots = PSSlots(own)
        slots.add(copy)
        assert slots.slots() == [1, 3]
        net = FakeNetwork()
        net.serve("ps1", slots, name="ps1")
        plain = net.client("ps1", "w0")
        to_own = net.client("ps1", "w0", slot=1)
        to_copy = net.client("ps1", "w0", slot=3)
        to_none = net.client("ps1", "w0", slot=2)
        assert (await plain.request("status")).body["index"] == 1
        assert (await to_own.request("status")).body["index"] == 1
        assert (await to_copy.request("status")).body["index"] == 3
        with pytest.raises(NotFound, match="ps 1 holds no copy of ps 2"):
            await to_none.request("status")
        slots.remove(3)
        with pytest.raises(NotFound):
            await to_copy.request("status")

    asyncio.run(body())


def test_a_process_keeps_its_own_state_and_one_copy_per_ps() -> None:
    slots = PSSlots(PSService(0))
    slots.add(PSService(2))
    with pytest.raises(InvalidArgument, match="already holds"):
        slots.add(PSService(2))
    with pytest.raises(InvalidArgument, match="own state"):
        slots.remove(0)
