"""Where each PS state is served: requests address a PS *state*, a link sends them to
the process that serves it now.

With replication a PS state (its shards, dedup window, ledgers, sync mode) outlives
the process it started on: a fail-over promotes a copy on another PS process. The
chief and the workers keep talking to "PS i" (state i) through a :class:`StateLink`;
:class:`Homes` knows which process serves each state (the placement says, at each
epoch) and the link sends there, naming the state as the request's slot when it is
not the process's own.

Rules of this module:

* A request in flight when its state moves (a new placement epoch) is failed at once
  with ``NotPrimary`` (:meth:`Homes.update`), not left to its deadline (nor sent
  again to the old process by the transport's own attempts, as a timeout is): one
  that may be sent again (``attempts > 1``: reads, deduplicated pushes) is sent again
  to the new home, within its attempts; any other raises, as a lost request does, and
  so does one naming shared-memory regions (``shm``, ``shm_out``: those of the
  process it was sent to; the caller sends it again by TCP).
* ``NotPrimary`` (the process serves only a backup of the state: the caller's
  placement is older than the process's) is handled the same way once the homes have
  moved; before that it is raised.
* An error raised carries ``epoch``: the placement epoch the request was routed by.
  A caller that has heard of a newer one since (the worker's session) sends the
  request again at once instead of waiting for a restore.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zmqps.core.variables import Placement
from zmqps.transport import Landing, Requester
from zmqps.wire import Message, Tensor
from zmqps.wire.errors import DeadlineExceeded, NotPrimary, ZmqpsError

__all__ = ["Homes", "StateLink"]


class Homes:
    """The process serving each PS state (state ``i`` on process ``i`` until a
    fail-over), and a requester per process."""

    def __init__(self, processes: Sequence[Requester]) -> None:
        self.processes = list(processes)
        self.of = list(range(len(self.processes)))
        self.epoch = 0

    def links(self) -> list[StateLink]:
        """A link to every PS state."""
        return [StateLink(self, i) for i in range(len(self.processes))]

    def update(self, placement: Placement) -> list[int]:
        """Take a newer placement's homes; returns the states that moved. Requests in
        flight on a process that no longer serves a state it served are failed (they
        are sent again to the new home, when they may be)."""
        if placement.epoch <= self.epoch:
            return []
        self.epoch = placement.epoch
        moved: list[int] = []
        left: set[int] = set()
        for s in placement.shards:
            if self.of[s.state] != s.ps:
                moved.append(s.state)
                left.add(self.of[s.state])
                self.of[s.state] = s.ps
        for process in sorted(left):
            client = self.processes[process]
            if hasattr(client, "fail_pending"):
                # not a timeout: the transport would send it to the old process again
                exc = NotPrimary(f"ps state moved away from {client.endpoint}")
                client.fail_pending(exc)
        return sorted(set(moved))


class StateLink:
    """A requester for PS state ``state``: sent to the process serving it now."""

    #: :meth:`request` takes ``landing`` (passed on to a process's client that takes
    #: it: where a sealed reply's buffers are opened, see ``transport/client.py``)
    lands = True

    def __init__(self, homes: Homes, state: int) -> None:
        self.homes = homes
        self.state = state

    @property
    def endpoint(self) -> str:
        return self.homes.processes[self.homes.of[self.state]].endpoint

    async def request(
        self,
        op: str,
        body: Mapping[str, Any] | None = None,
        tensors: Sequence[Tensor] = (),
        *,
        timeout: float | None = None,
        attempts: int = 1,
        slot: int | None = None,
        landing: Landing | None = None,
    ) -> Message:
        attempt = 0
        while True:
            home = self.homes.of[self.state]
            epoch = self.homes.epoch
            client = self.homes.processes[home]
            attempt += 1
            # an explicit slot: another state the same process holds (the chief
            # creating a backup's copy there)
            named = self.state if slot is None else slot
            extra: dict[str, Any] = {} if named == home else {"slot": named}
            if landing is not None and getattr(client, "lands", False):
                extra["landing"] = landing
            try:
                return await client.request(
                    op, body, tensors, timeout=timeout, attempts=attempts, **extra
                )
            except (DeadlineExceeded, NotPrimary) as exc:
                moved = self.homes.of[self.state] != home
                if not moved or attempts <= 1 or attempt >= attempts + 1 or _local(body):
                    setattr(exc, "epoch", epoch)  # noqa: B010
                    raise
            except ZmqpsError as exc:
                # the placement epoch the request was routed by: a caller that learned
                # of a newer one since sends it again at once (the state moved)
                setattr(exc, "epoch", epoch)  # noqa: B010
                raise

    def fail_pending(self, exc: BaseException) -> int:
        """Fail the requests waiting on the process serving this state (a restore)."""
        client = self.homes.processes[self.homes.of[self.state]]
        fail = getattr(client, "fail_pending", None)
        return 0 if fail is None else int(fail(exc))

    async def close(self) -> None:
        """Close the client of the process this state started on: closing every
        state's link closes every process's client once, wherever states moved."""
        await self.homes.processes[self.state].close()


def _local(body: Mapping[str, Any] | None) -> bool:
    """Whether a request names shared-memory regions: another process has other
    regions under those ids, so it is never sent there."""
    return body is not None and (body.get("shm") is not None or body.get("shm_out") is not None)
