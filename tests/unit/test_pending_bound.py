"""Requests that wait on a server (long polls) are bounded per peer and in all: one
more is refused at once with ``busy`` and counted, nothing is done for it, and the
bound frees as the waits end (answered, timed out or cancelled). Sans-IO: the
in-memory transport runs the same dispatcher as the ZeroMQ server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from zmqps.transport import FakeNetwork
from zmqps.transport.dispatch import MAX_PENDING_PER_PEER
from zmqps.wire import Message, reply
from zmqps.wire.errors import Busy
from zmqps.wire.ops import WaitStep

#: a long poll's body (the handler here answers it once released)
POLL = WaitStep(1 << 40, 30.0).to_wire()


def _waiting_server(net: FakeNetwork, release: asyncio.Event, started: list[int]) -> Any:
    def handler(msg: Message) -> Any:
        async def wait() -> Message:
            started.append(msg.id)
            await release.wait()
            return reply(msg, {"ok": True})

        return wait()

    return net.serve("srv", handler, name="srv")


async def _settled(done: Any, within: float = 10.0) -> None:
    """Wait until every request sent so far was admitted or refused."""
    deadline = asyncio.get_running_loop().time() + within
    while not done():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.01)  # the refused ones' replies reach their callers


def test_one_peer_cannot_pin_more_than_its_share_of_waits() -> None:
    async def body() -> None:
        net, release, started = FakeNetwork(), asyncio.Event(), []
        stats = _waiting_server(net, release, started)
        a = net.client("srv", "a", timeout=30.0)
        extra = 25
        polls = [asyncio.ensure_future(a.request("ping")) for _ in range(MAX_PENDING_PER_PEER)]
        server = net._servers["srv"]
        await _settled(lambda: server.pending == MAX_PENDING_PER_PEER)
        # one more is refused at once; the client sends it again until its time is up
        polls += [asyncio.ensure_future(a.request("ping", timeout=0.3)) for _ in range(extra)]
        await _settled(lambda: sum(p.done() for p in polls) == extra)
        refused = [p for p in polls if p.done()]
        assert len(refused) == extra
        assert all(isinstance(p.exception(), Busy) for p in refused)
        assert stats.busy >= 2 * extra  # each refused, then sent again and refused again
        assert len(started) == MAX_PENDING_PER_PEER  # nothing ran for the refused
        # another peer is still served, and the first one again once its waits end
        b = net.client("srv", "b", timeout=30.0)
        other = asyncio.ensure_future(b.request("ping"))
        release.set()
        assert (await other).body == {"ok": True}
        done = await asyncio.gather(*(p for p in polls if p not in refused))
        assert len(done) == MAX_PENDING_PER_PEER
        assert (await a.request("ping")).body == {"ok": True}
        assert net._servers["srv"].pending == 0

    asyncio.run(asyncio.wait_for(body(), 20.0))


def test_all_peers_together_are_bounded_and_a_timed_out_wait_frees_its_place() -> None:
    async def body() -> None:
        net, release, started = FakeNetwork(), asyncio.Event(), []
        stats = _waiting_server(net, release, started)
        net._servers["srv"].max_pending = 40
        clients = [net.client("srv", f"c{i}", timeout=30.0) for i in range(10)]
        polls = [asyncio.ensure_future(c.request("ping")) for c in clients for _ in range(5)]
        await _settled(lambda: stats.busy >= 10 and net._servers["srv"].pending == 40)
        assert len(started) == 40 and not any(p.done() for p in polls)  # 10 sent again
        # a client that gives up (its deadline) frees its places at once
        impatient = net.client("srv", "late", timeout=0.1)
        with pytest.raises(Busy):
            await impatient.request("ping")
        for p in polls:
            p.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        assert net._servers["srv"].pending == 0
        with pytest.raises(Exception, match="no reply"):
            await impatient.request("ping")  # admitted now; it waits out its own deadline
        assert net._servers["srv"].pending == 0

    asyncio.run(asyncio.wait_for(body(), 20.0))


def test_a_request_refused_busy_is_sent_again_and_served_once_the_flood_ends() -> None:
    """A peer's flood fills the server's bound; another peer's request (the chief's
    wait on a PS, say) is answered ``busy``, sent again after short pauses, and served
    as soon as a place frees: it does not fail while its time lasts."""

    async def body() -> None:
        net, release, started = FakeNetwork(), asyncio.Event(), []
        stats = _waiting_server(net, release, started)
        net._servers["srv"].max_pending = 20
        flood = net.client("srv", "mallory", timeout=30.0)
        polls = [asyncio.ensure_future(flood.request("ping")) for _ in range(20)]
        await _settled(lambda: net._servers["srv"].pending == 20)
        chief = net.client("srv", "chief:0", timeout=30.0)
        wait = asyncio.ensure_future(chief.request("ping"))
        await _settled(lambda: stats.busy >= 3)  # refused, and sent again
        assert not wait.done()
        for p in polls:
            p.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        release.set()
        assert (await asyncio.wait_for(wait, 5.0)).body == {"ok": True}

    asyncio.run(asyncio.wait_for(body(), 20.0))


def test_a_flood_of_long_polls_cannot_shut_out_a_peer_that_holds_few() -> None:
    """A client flooding a PS with long polls (``wait_step`` of a step that never comes)
    from a few identities filled every pending place, and the chief's own step polls
    and the workers' waits were refused ``busy``: a sync run stood still. A peer that
    holds few is served: the heaviest peer's oldest long poll is answered ``busy`` and
    the newcomer takes its place; the bound in all still holds. Among peers holding
    one each, nobody is heavier: a newcomer is refused as before."""

    async def body() -> None:
        net, release, started = FakeNetwork(), asyncio.Event(), []
        stats = _waiting_server(net, release, started)
        server = net._servers["srv"]
        server.max_pending = 40
        evil = net.client("srv", "evil", timeout=30.0)
        flood = [asyncio.ensure_future(evil.request("wait_step", POLL)) for _ in range(40)]
        await _settled(lambda: server.pending == 40)
        chief = net.client("srv", "chief", timeout=30.0)
        mine = [asyncio.ensure_future(chief.request("wait_step", POLL)) for _ in range(3)]
        await _settled(lambda: len(started) == 43)  # the chief's three ran
        assert server.pending == 40 and stats.busy >= 3
        assert not any(p.done() for p in mine)
        release.set()
        assert all(r.body == {"ok": True} for r in await asyncio.gather(*mine))
        await asyncio.gather(*flood, return_exceptions=True)
        assert server.pending == 0

        # forty peers holding one each: nobody is heavier than a newcomer
        release.clear()
        started.clear()
        peers = [net.client("srv", f"p{i}", timeout=30.0) for i in range(40)]
        ones = [asyncio.ensure_future(p.request("wait_step", POLL)) for p in peers]
        await _settled(lambda: server.pending == 40)
        late = net.client("srv", "late", timeout=0.2)
        with pytest.raises(Busy):
            await late.request("wait_step", POLL)
        assert len(started) == 40
        release.set()
        await asyncio.gather(*ones)
        assert server.pending == 0

    asyncio.run(asyncio.wait_for(body(), 20.0))
