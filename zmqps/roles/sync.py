"""The chief's side of sync and SSP training: tokens, the global step, the staleness bound.

Rules of this module:

* Sync (SyncReplicas): the global step advances only when every PS has applied
  it (each PS is long-polled with ``wait_step``); then the token queue gets M
  tokens of the new step (:class:`~zmqps.core.sync.TokenQueue`).
* M is the number of replicas not known to be gone (dead, left, done), at most
  ``total_replicas``; N is ``min(replicas_to_aggregate, M)``, pushed to every PS
  whenever it changes, so a dead worker never stalls a step for longer than the
  heartbeat timeout. A worker gone after every PS got its gradient for the current
  step still counts for that step: shrinking N then would apply the step before the
  live workers' gradients arrive, and drop them as stale.
* Only the PS that hold shards have steps; the global step waits for those.
* SSP: :class:`~zmqps.core.sync.StalenessBound` over the live workers and those not
  registered yet (at clock 0), as sync waits for them too.
* Every wait is a long poll with a deadline (no busy polling); clients re-poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from zmqps.core.membership import Membership
from zmqps.core.sync import MODES, StalenessBound, TokenQueue
from zmqps.transport import Requester
from zmqps.wire.errors import DeadlineExceeded, InvalidArgument, NotReady, ZmqpsError

__all__ = ["SyncConfig", "SyncDriver"]

log = logging.getLogger("zmqps.chief")

POLL_S = 5.0  # one long poll to a PS


@dataclass(frozen=True)
class SyncConfig:
    mode: str = "async"
    replicas_to_aggregate: int | None = None  # N; default: total replicas
    total_replicas: int | None = None  # M; default: number of workers
    init_tokens: int = 0  # K extra tokens of step 0
    max_staleness: int = 2  # S (ssp)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgument(f"unknown mode {self.mode!r}; expected one of {', '.join(MODES)}")
        for name in ("replicas_to_aggregate", "total_replicas"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise InvalidArgument(f"{name} must be >= 1")
        if self.init_tokens < 0 or self.max_staleness < 0:
            raise InvalidArgument("init_tokens and max_staleness must be >= 0")


class SyncDriver:
    def __init__(
        self,
        cfg: SyncConfig,
        members: Membership,
        ps: Sequence[Requester],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.members = members
        self.ps = list(ps)
        self.stepping = list(ps)  # the PS whose steps make the global step
        self.clock = clock
        self.total = cfg.total_replicas or members.num_workers
        self.aggregate = cfg.replicas_to_aggregate or self.total
        self.tokens = TokenQueue()
        self.bound = StalenessBound(cfg.max_staleness)
        self.global_step = 0
        self.required = 0  # N as last told to the PS
        self.counted: set[int] = set()  # gone workers whose gradient the current step holds
        self._configuring = asyncio.Lock()
        self.changed = asyncio.Condition()
        self.started = False
        self.step_started_at = clock()
        #: awaited with each new global step before its tokens are put
        self.on_step: Callable[[int], Awaitable[None]] | None = None

    @property
    def mode(self) -> str:
        return self.cfg.mode

    # ------------------------------------------------------------ replicas

    def replicas(self) -> int:
        """M: replicas not known to be gone, at most ``total_replicas`` (a gone worker
        whose gradient the current step holds counts until the step is applied)."""
        now = self.clock()
        gone = set(self.members.dead(now))
        gone |= {i for i, w in self.members.workers.items() if w.done or w.gone}
        return max(0, min(self.total, self.members.num_workers - len(gone - self.counted)))

    def needed(self) -> int:
        """N as it must be now: never more than M (never less than 1)."""
        return max(1, min(self.aggregate, self.replicas()))

    async def _configure_ps(self, required: int) -> None:
        body = {"mode": self.mode, "required": required}
        await asyncio.gather(*(c.request("sync_config", body, timeout=10.0) for c in self.ps))
        self.required = required

    async def _reconfigure(self) -> None:
        """Tell the PS the N of now, if it changed (serialized: the last word is fresh)."""
        async with self._configuring:
            needed = self.needed()
            if needed != self.required:
                log.info(
                    "replicas to aggregate %d -> %d (M = %d live replicas)",
                    self.required,
                    needed,
                    self.replicas(),
                )
                await self._configure_ps(needed)

    async def _count_contributions(self, gone: Sequence[int]) -> None:
        """Keep counting, for the current step, the ``gone`` workers whose gradient for it
        every PS already holds."""
        step = self.global_step
        held = {f"worker:{i}": i for i in gone}
        for c in self.stepping:
            try:
                rep = await c.request("status", timeout=2.0)
            except ZmqpsError:
                return
            sync = rep.body.get("sync") or {}
            if sync.get("step") != step:
                return  # the step is applied (or not known): nothing to wait for
            got = set(sync.get("contributors", []))
            held = {name: i for name, i in held.items() if name in got}
        if self.global_step == step:
            self.counted |= set(held.values())

    async def membership_changed(self, rejoined: bool = False, gone: Sequence[int] = ()) -> None:
        """Re-derive N after a worker joined, or the workers ``gone`` left or died; wake
        every waiter."""
        if self.mode == "sync" and self.started:
            if rejoined:
                self.tokens.put(self.global_step, 1)  # its share of the current step
            if gone:
                await self._count_contributions(gone)
            await self._reconfigure()
        async with self.changed:
            self.changed.notify_all()

    # ------------------------------------------------------------ sync

    async def run(self, holders: Sequence[int] | None = None, start_step: int = 0) -> None:
        """Drive sync training: start tokens, then advance the global step forever.

        ``holders``: the indices of the PS that hold shards (default: every PS).
        ``start_step``: the step the PS are at (not 0 after a restore or when a
        restarted chief adopts running PS); only step 0 gets the extra init tokens.
        Cancel the task to stop (a restore restarts it).
        """
        if self.mode == "async":
            return
        if holders is not None:
            self.stepping = [self.ps[i] for i in sorted(set(holders))]
        self.required = 0  # tell every PS N afresh (a restarted PS has forgotten it)
        await self._configure_ps(self.needed() if self.mode == "sync" else 1)
        self.started = True
        if self.mode != "sync":
            return
        self.global_step = start_step
        self.counted.clear()
        self.tokens.restart(start_step, self.replicas())
        if start_step == 0:
            self.tokens.put(0, self.cfg.init_tokens, extra=True)
        self.step_started_at = self.clock()
        async with self.changed:
            self.changed.notify_all()
        while True:
            step = self.global_step + 1
            await asyncio.gather(*(self._wait_ps(c, step) for c in self.stepping))
            self.global_step = step
            self.counted.clear()
            await self._reconfigure()
            if self.on_step is not None:
                await self.on_step(step)  # e.g. a checkpoint, while no tokens are out
            self.step_started_at = self.clock()
            self.tokens.advance(self.global_step, self.replicas())
            async with self.changed:
                self.changed.notify_all()

    async def _wait_ps(self, ps: Requester, step: int) -> None:
        while True:
            try:
                rep = await ps.request(
                    "wait_step", {"step": step, "wait": POLL_S}, timeout=POLL_S + 5
                )
            except DeadlineExceeded:
                log.warning("ps at %s does not answer while step %d waits on it", ps.endpoint, step)
                continue
            if int(rep.body["step"]) >= step:
                return

    async def applied_step(self) -> int:
        """The step every PS has applied, without the lag of the loop above (at the end
        of training the last push can be acknowledged before the loop hears of it)."""
        if not self.stepping:
            return self.global_step
        try:
            reps = await asyncio.gather(
                *(c.request("wait_step", {"step": 0}, timeout=5.0) for c in self.stepping)
            )
        except ZmqpsError:
            return self.global_step
        return max(self.global_step, min(int(r.body["step"]) for r in reps))

    async def take_token(self, worker: str, wait: float) -> int:
        """A token for ``worker`` (its value is the step to compute); NotReady after
        ``wait`` seconds."""
        deadline = self.clock() + wait
        async with self.changed:
            while True:
                token = self.tokens.take(worker) if self.started else None
                if token is not None:
                    return token
                left = deadline - self.clock()
                if left <= 0:
                    raise NotReady(f"no token within {wait:g}s (global step {self.global_step})")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), left)

    # ------------------------------------------------------------ ssp

    async def ssp_clock(self, index: int, completed: int, wait: float) -> int:
        """Record that worker ``index`` completed ``completed`` steps; return once it may start
        the next one (the slowest live worker's clock), NotReady after ``wait`` seconds."""
        self.bound.report(index, completed)
        deadline = self.clock() + wait
        async with self.changed:
            self.changed.notify_all()
            while True:
                live = self._ssp_live()
                if index not in live:
                    live.append(index)
                if self.bound.may_start(completed, live):
                    slowest = self.bound.slowest(live)
                    return completed if slowest is None else slowest
                left = deadline - self.clock()
                if left <= 0:
                    raise NotReady(f"step {completed} waits on slower workers (ssp)")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), left)

    def _ssp_live(self) -> list[int]:
        """The workers the bound waits for: the live ones and those not registered yet."""
        unseen = (i for i in range(self.members.num_workers) if i not in self.members.workers)
        return sorted({*self.members.alive(self.clock()), *unseen})

    # ------------------------------------------------------------ status

    async def waiting_on(self, live: Sequence[int], skip: Sequence[Requester] = ()) -> list[int]:
        """Live workers whose gradient for the current step some PS has not received
        (``skip``: PS known not to answer, not asked)."""
        if self.mode != "sync":
            return []
        names = {f"worker:{i}": i for i in live}
        missing: set[int] = set()

        async def ask(c: Requester) -> None:
            try:
                rep = await c.request("status", timeout=2.0)
            except ZmqpsError:
                return  # an unreachable PS: zmqps status reports it under ps_down
            sync = rep.body.get("sync") or {}
            got = set(sync.get("contributors", []))
            missing.update(i for name, i in names.items() if name not in got)

        # All PS at once: one cut off by a partition costs the status 2 s, not 2 s each.
        await asyncio.gather(*(ask(c) for c in self.stepping if c not in skip))
        return sorted(missing)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode}
        if self.mode == "sync":
            out.update(
                replicas_to_aggregate=self.required or self.needed(),
                total_replicas=self.replicas(),
                tokens_available=len(self.tokens),
                tokens_discarded=self.tokens.discarded,
                step_age_s=round(self.clock() - self.step_started_at, 3),
            )
        if self.mode == "ssp":
            out["ssp"] = dict(self.bound.snapshot())
        return out
