"""Links to PS states follow the placement's homes: a request in flight when its state
moves is failed at once, and sent again to the new home only when it may be."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from zmqps.core.variables import Placement, ShardInfo, VariableDef
from zmqps.roles.homes import Homes
from zmqps.wire import Message, Tensor
from zmqps.wire.errors import DeadlineExceeded, NotPrimary


class Process:
    """A PS process that holds every request until told, and records them; a request
    failed with a timeout is sent again within its attempts, as the transport does."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.seen: list[tuple[str, dict[str, Any], int | None]] = []
        self.pending: list[asyncio.Future[Message]] = []
        self.answer = False

    async def request(
        self,
        op: str,
        body: Mapping[str, Any] | None = None,
        tensors: Sequence[Tensor] = (),
        *,
        timeout: float | None = None,
        attempts: int = 1,
        slot: int | None = None,
    ) -> Message:
        for attempt in range(1, attempts + 1):  # as the transport: a timeout is retried
            self.seen.append((op, dict(body or {}), slot))
            if self.answer:
                return Message("ok", body={"applied": True})
            fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
            self.pending.append(fut)
            try:
                return await fut
            except DeadlineExceeded:
                if attempt == attempts:
                    raise
        raise AssertionError("unreachable")

    def fail_pending(self, exc: BaseException) -> int:
        for fut in self.pending:
            if not fut.done():
                fut.set_exception(exc)
        n, self.pending = len(self.pending), []
        return n

    async def close(self) -> None:
        pass


def _placement(epoch: int, home_of_1: int) -> Placement:
    v = VariableDef("w", (4, 2))
    shards = (
        ShardInfo(0, "w", 0, 0, 2, 0, backups=(1,)),
        ShardInfo(1, "w", 1, 2, 2, home_of_1, slot=1),
    )
    return replace(Placement((v,), shards), epoch=epoch)


@pytest.mark.parametrize(
    "body,sent_again",
    [
        ({"seq": 3}, True),  # a deduplicated push: sent again to the new home
        ({"seq": 3, "shm": {"region": 1, "offsets": [0]}}, False),  # names shared memory
        ({"seq": 3, "shm_out": {"region": 2, "offsets": [0]}}, False),
    ],
)
def test_a_request_in_flight_follows_its_state_unless_it_names_shared_memory(
    body: dict[str, Any], sent_again: bool
) -> None:
    async def go() -> None:
        procs = [Process(f"ps{i}") for i in range(3)]
        procs[2].answer = True
        homes = Homes(procs)
        link = homes.links()[1]
        call = asyncio.ensure_future(link.request("push", body, attempts=3))
        await asyncio.sleep(0.01)
        assert procs[1].seen == [("push", body, None)]
        assert homes.update(_placement(1, 2)) == [1]  # state 1 moved to process 2
        await asyncio.sleep(0.01)
        # failed for good there: not sent to the old process again (a timeout would be,
        # by the transport's own attempts: pushes waited for a stopped PS to come back)
        assert procs[1].seen == [("push", body, None)]
        if sent_again:
            assert (await asyncio.wait_for(call, 2.0)).body == {"applied": True}
            assert procs[2].seen == [("push", body, 1)]  # named as state 1 there
        else:
            with pytest.raises(NotPrimary) as err:
                await asyncio.wait_for(call, 2.0)
            assert err.value.epoch == 0  # type: ignore[attr-defined]  # routed by
            assert procs[2].seen == []

    asyncio.run(go())


def test_a_push_refused_for_its_values_is_raised_after_a_state_that_moved() -> None:
    """One PS state refuses a push's values, another's process lost the state: the
    caller hears of the move first (it sends the push again, whole), so the state
    that moved gets it too, and the refusal comes once every state has the outcome."""
    from zmqps.roles.client import Delivery, ParameterClient
    from zmqps.wire.errors import NonFiniteGradient

    class Refusing:
        endpoint = "ps"

        def __init__(self, exc: Exception) -> None:
            self.exc = exc
            self.seen = 0

        async def request(self, *_: Any, **__: Any) -> Message:
            self.seen += 1
            await asyncio.sleep(0.01 * self.seen)
            raise self.exc

        async def close(self) -> None:
            pass

    v = VariableDef("w", (4, 2))
    shards = (ShardInfo(0, "w", 0, 0, 2, 0), ShardInfo(1, "w", 1, 2, 2, 1))
    placement = Placement((v,), shards)
    refusing, moved = Refusing(NonFiniteGradient("nan")), Refusing(NotPrimary("moved"))
    client = ParameterClient(
        [refusing, moved], placement, worker="w", incarnation=0, shared_memory=False
    )
    grads = {"w": np.ones((4, 2), np.float32)}
    with pytest.raises(NotPrimary):
        asyncio.run(client.push(grads, delivery=Delivery()))
    assert refusing.seen == moved.seen == 1  # both answered before the failure was raised
