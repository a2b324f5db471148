"""The consistency mode on the chief, as a strategy chosen once: async, ssp or sync.

Rules of this module:

* :func:`make_chief_mode` is the one place the chief reads the mode's name; every
  difference between the modes lives in the classes here.
* async and ssp: the global step is the number of updates the workers reported
  (plus the steps of the run a restored checkpoint was taken in). ssp: a worker may
  start step ``c`` only while the slowest live worker (or one not registered yet)
  has completed ``c - s`` (:class:`~zmqps.core.sync.StalenessBound`).
* sync (SyncReplicas): the global step advances only when every PS holding shards
  applied it (each is long-polled with ``wait_step``); tokens of a step are derived
  from the replicas live *now* (:class:`~zmqps.core.sync.TokenLedger`), so a worker
  that comes back, after it was counted dead or after a rejoin, finds its token.
  M is the number of replicas not known to be gone, at most ``total_replicas``; N is
  ``min(replicas_to_aggregate, M)``, pushed to every PS whenever it changes. A
  worker gone after every PS got its gradient for the current step still counts
  for that step (shrinking N then would apply the step before the live workers'
  gradients arrive, and drop them as stale).
* Every wait is a long poll with a deadline (no busy polling); clients re-poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from zmqps.core.membership import Membership
from zmqps.core.sync import StalenessBound, TokenLedger
from zmqps.roles.configs import SyncConfig
from zmqps.roles.waiters import Changes
from zmqps.transport import Requester
from zmqps.transport.base import waited
from zmqps.wire import ops as o
from zmqps.wire.errors import (
    Busy,
    DeadlineExceeded,
    InvalidArgument,
    NotPrimary,
    NotReady,
    ZmqpsError,
)
from zmqps.wire.schema import INT64_MAX

__all__ = ["AsyncMode", "ChiefMode", "SspMode", "SyncMode", "make_chief_mode"]

log = logging.getLogger("zmqps.chief")

#: what a token request says the worker computed last: a step, None, or a function
#: saying it as of now (a generation that changed while the poll waited voids it)
Have = int | None | Callable[[], int | None]

POLL_S = 5.0  # one long poll to a PS
#: a step that waits this long on a PS state has the reason said in the log (again
#: after as long)
BEHIND_REPORT_S = 15.0
#: seconds before a stepping poll a PS refused (``busy``: its pending requests are at
#: their bound, other peers' long polls) is sent again, doubling to the last
BUSY_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)
#: a step that waits this long on a PS state: the chief asks the state why (again
#: after as long), so its status names copies that hold the step within a heartbeat
#: timeout rather than at the first report in the log
BEHIND_LOOK_S = 2.0
#: how long one look at every worker (who is gone) is kept (see :meth:`SyncMode.gone`)
GONE_MEMO_S = 0.05


#: a look-up of the gradients a gone worker left in the open step that a PS did not
#: answer (loaded, stopped, ``busy``) is asked again after these seconds (the last
#: repeated) while the step is open: the worker counts in M meanwhile
LOOKUP_RETRY_S = (0.2, 0.5, 1.0, 2.0)
#: the seconds one look-up waits for each PS's answer
LOOKUP_TIMEOUT_S = 2.0
#: how long a leave (or a death) waits for that look-up before it goes on: past it the
#: look-up goes on by itself and tells the PS the N it finds
LOOKUP_WAIT_S = 5.0
#: Seconds before N is told again to every PS when some PS did not answer.
RECONFIGURE_RETRY_S = 1.0

#: sync, one PS releasing steps by itself: the most steps one poll lets it release
#: (the next checkpoint boundary usually comes first), and how long that poll waits
#: before it says where the PS is (the chief's ledger, ``zmqps status``, catch up)
AHEAD_STEPS = 1 << 16
AHEAD_POLL_S = 1.0


class ChiefMode:
    """What the modes have in common: the PS to configure, waiters to wake."""

    name = ""
    _floor = 0  # the highest global step known (async / ssp never go back)
    #: sync: who is gone, as last looked at (clock bucket, the workers), see
    #: :meth:`SyncMode.gone`; forgotten at every wake-up
    _gone_memo: tuple[int, frozenset[int]] | None = None

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
        self.stepping_ids = list(range(len(self.ps)))  # their indexes
        self.clock = clock
        self.started = False
        self.changed = Changes()
        #: async / ssp: the steps of the run a restored checkpoint was taken in
        self.step_offset = 0
        self.step_started_at = clock()
        #: awaited with each new global step before its tokens are put (sync)
        self.on_step: Callable[[int], Awaitable[None]] | None = None
        #: whether :attr:`on_step` has work at that step (sync: a checkpoint due); a
        #: boundary with none may be released by the PS itself
        self.step_due: Callable[[int], bool] = lambda step: self.on_step is not None
        #: whether a checkpoint will be due at that step, as planned now (a run of
        #: steps the PS releases by itself ends before the first); from one step on,
        #: every later step is due too
        self.plan_due: Callable[[int], bool] = lambda step: self.step_due(step)
        #: the cluster's generation (the chief's recovery owns it)
        self.generation: Callable[[], int] = lambda: 0
        #: hears how long token polls waited on the PS (sync: the PS hand tokens)
        self.on_token_waits: Callable[[Sequence[float]], None] | None = None
        #: a reconfiguration some PS missed: told again later (:meth:`_reconfigure`)
        self._retry: asyncio.Future[None] | None = None
        self._told_everyone = True
        #: work for the next step boundary the chief holds (sync: no tokens of the next
        #: step out; a PS state moved there leaves no step half-summed behind)
        self._at_boundary: list[tuple[Callable[[int], Awaitable[Any]], asyncio.Future[Any]]] = []
        self._running_jobs: set[asyncio.Future[None]] = set()
        self.setup()

    def at_boundary(self, job: Callable[[int], Awaitable[Any]]) -> asyncio.Future[Any]:
        """Run ``job(step)`` at the next step boundary the chief holds (sync: after
        ``step`` was applied everywhere, before any token of the next is put); its
        outcome is the future's. Async and ssp have no boundary: it runs at once."""
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._at_boundary.append((job, done))
        if self.name != "sync":
            running = asyncio.ensure_future(self._run_boundary_jobs(self.global_step))
            self._running_jobs.add(running)
            running.add_done_callback(self._running_jobs.discard)
        return done

    def drop_boundary_job(self, done: asyncio.Future[Any]) -> bool:
        """A job not run yet is not wanted any more; False when it began already."""
        kept = [(j, d) for j, d in self._at_boundary if d is not done]
        dropped = len(kept) != len(self._at_boundary)
        self._at_boundary = kept
        return dropped

    async def _run_boundary_jobs(self, step: int) -> None:
        jobs, self._at_boundary = self._at_boundary, []
        for job, done in jobs:
            try:
                out = await job(step)
            except Exception as exc:  # the job's failure is its caller's
                if not done.done():
                    done.set_exception(exc)
                continue
            if not done.done():
                done.set_result(out)

    def setup(self) -> None:
        """The mode's own state (subclasses)."""

    @property
    def global_step(self) -> int:
        """Updates applied to the model, as the workers reported them (never less than
        what was known before: a restarted chief starts from what the PS applied)."""
        self._floor = min(max(self._floor, self.counted_step), INT64_MAX)
        return self._floor

    @global_step.setter
    def global_step(self, step: int) -> None:
        self._floor = max(self._floor, step)

    @property
    def counted_step(self) -> int:
        """The steps counted since the last restore, on top of its checkpoint's step:
        :attr:`global_step` without its floor (after a restore below what was shown,
        this moves while the workers train again the steps after the checkpoint)."""
        return min(self.step_offset + self.members.global_step, INT64_MAX)

    async def _configure_ps(self, required: int) -> None:
        body = o.SyncConfigure(self.name, required).to_wire()
        await asyncio.gather(*(c.request("sync_config", body, timeout=10.0) for c in self.ps))

    async def start(self, holders: Sequence[int], step: int) -> None:
        """Training (re)starts: the PS holding shards are ``holders``, at ``step``.
        Returns once the mode runs (sync: its stepping loop runs until cancelled).

        A PS that does not take the mode in time (stopped, killed, loaded: a fail-over
        or restart deals with it) fails nothing: it is told again every
        :data:`RECONFIGURE_RETRY_S` until it does (``sync_config`` is idempotent). Its
        error used to end the training task, and with it the chief (exit 1)."""
        self._step_on(holders)
        await self._reconfigure()
        self.started = True
        await self._wake()

    async def _reconfigure(self) -> None:
        """Tell every PS the mode (async / ssp: N is 1); one that misses it is told
        again later (:meth:`_retry_reconfigure`)."""
        try:
            await self._configure_ps(1)
        except ZmqpsError as exc:
            self._retry_reconfigure(exc)
            return
        self._told_everyone = True

    def _retry_reconfigure(self, exc: ZmqpsError) -> None:
        """Some PS missed a reconfiguration: every PS is told again
        :data:`RECONFIGURE_RETRY_S` later (``sync_config`` is idempotent), until all
        have answered, while the mode runs."""
        if self._told_everyone:
            log.warning(
                "the mode or N not told to every PS (%s): telling them again every %gs",
                exc,
                RECONFIGURE_RETRY_S,
            )
        self._told_everyone = False
        if self._retry is not None and not self._retry.done():
            return

        async def again() -> None:
            await asyncio.sleep(RECONFIGURE_RETRY_S)
            self._retry = None  # a miss now schedules the next try
            if self.started:
                await self._reconfigure()

        self._retry = asyncio.ensure_future(again())

    def _step_on(self, holders: Sequence[int]) -> None:
        """The PS holding shards (``holders``) are those whose steps count."""
        self.stepping_ids = sorted(set(holders))
        self.stepping = [self.ps[i] for i in self.stepping_ids]

    def stop(self) -> None:
        self.started = False

    async def _wake(self) -> None:
        self._gone_memo = None
        self.changed.notify_all()

    async def membership_changed(self, gone: Sequence[int] = (), back: Sequence[int] = ()) -> None:
        """Workers registered, came back (``back``), left or died (``gone``)."""
        await self._wake()

    async def take_token(self, who: o.Who, wait: float, have: Have) -> int:
        raise InvalidArgument(f"take_token: the job runs in {self.name} mode")

    def token_ps(self, who: o.Who) -> int | None:
        """The PS worker ``who`` asks for its next token, or None: the chief."""
        return None

    async def ssp_clock(self, who: o.Who, completed: int, wait: float) -> int:
        raise InvalidArgument(f"ssp_clock: the job runs in {self.name} mode")

    async def applied_step(self) -> int:
        return self.global_step

    async def waiting_on(self, live: Sequence[int], skip: Sequence[Requester] = ()) -> list[int]:
        return []

    def held_by_copies(self) -> dict[int, tuple[float, int]]:
        """PS states whose step waits on their copies (sync only)."""
        return {}

    def refused_by(self) -> dict[int, float]:
        """PS states whose process refuses the chief's step polls (sync only)."""
        return {}

    def steps_planned(self) -> int:
        return self.members.steps_planned

    def status(self) -> dict[str, Any]:
        return {"mode": self.name}

    async def _long_wait(self, ready: Callable[[], Any], wait: float, what: str) -> Any:
        """``ready()``'s value once truthy (waking on every change), NotReady after
        ``wait`` seconds."""
        deadline = self.clock() + wait
        while True:
            value = ready()
            if value is not None and value is not False:
                return value
            left = deadline - self.clock()
            if left <= 0:
                raise NotReady(what)
            await self.changed.wait(left)


class AsyncMode(ChiefMode):
    name = "async"


class SspMode(ChiefMode):
    name = "ssp"

    def setup(self) -> None:
        self.bound = StalenessBound(self.cfg.max_staleness)

    async def ssp_clock(self, who: o.Who, completed: int, wait: float) -> int:
        """Record that worker ``who`` completed ``completed`` steps; return once it may
        start the next one (the slowest live worker's clock), NotReady after ``wait``."""
        self.bound.report(who.index, completed)
        await self._wake()

        def grant() -> int | None:
            live = self._live()
            if who.index not in live:
                live.append(who.index)
            if not self.bound.may_start(completed, live):
                return None
            slowest = self.bound.slowest(live)
            return completed if slowest is None else slowest

        return int(
            await self._long_wait(grant, wait, f"step {completed} waits on slower workers (ssp)")
        )

    async def waiting_on(self, live: Sequence[int], skip: Sequence[Requester] = ()) -> list[int]:
        """The slowest workers, when the bound holds another one back (a worker not
        registered with this chief yet counts, at the clock it last reported)."""
        held = self._live()
        slowest = self.bound.slowest(held)
        if slowest is None:
            return []
        clocks = self.bound.clocks
        if not any(clocks.get(w, 0) - slowest > self.bound.max_staleness for w in held):
            return []
        return [w for w in held if clocks.get(w, 0) == slowest]

    def _live(self) -> list[int]:
        """The workers the bound waits for: the live ones and those not registered yet."""
        unseen = (i for i in range(self.members.num_workers) if i not in self.members.workers)
        return sorted({*self.members.alive(self.clock()), *unseen})

    def status(self) -> dict[str, Any]:
        return {"mode": self.name, "ssp": dict(self.bound.snapshot())}


class SyncMode(ChiefMode):
    name = "sync"

    def setup(self) -> None:
        self.total = self.cfg.total_replicas or self.members.num_workers
        self.aggregate = self.cfg.replicas_to_aggregate or self.total
        self.tokens = TokenLedger()
        self._step = 0
        self.required = 0  # N as last told to the PS
        self.counted: set[int] = set()  # gone workers whose gradient the current step holds
        #: gone workers whose gradient for the current step is being looked for: counted
        #: in M meanwhile (else a reconfiguration in between could apply the step early)
        self.checking: set[int] = set()
        #: gone workers waiting for the next look-up, and the task looking
        self._to_look: dict[int, int] = {}  # worker -> the step open when it went
        self._looker: asyncio.Future[None] | None = None
        self._configuring = asyncio.Lock()
        #: PS states whose process said it takes ``WaitStep.release_step``
        self._releases: set[int] = set()
        #: ... and ``WaitStep.release_until``
        self._ranges: set[int] = set()
        #: the stepping poll letting the PS release a run of steps by itself, while it
        #: waits (a membership change cancels it, :meth:`_take_back`)
        self._ranging: asyncio.Future[Any] | None = None
        #: whether the last stepping poll sent let the PS release steps by itself
        self._allowing = False
        #: membership changes being settled (the PS releases nothing by itself then)
        self._unsettled = 0
        #: PS states whose step polls answer below the step waited for although they
        #: applied it (its copies do not all have it yet): state -> (since, step there)
        self._behind: dict[int, tuple[float, int]] = {}
        #: PS states whose process refuses the chief's stepping polls (``busy``: its
        #: pending requests are at their bound): state -> (since, refusals in a row)
        self._refused: dict[int, tuple[float, int]] = {}

    @property
    def global_step(self) -> int:
        return self._step

    @global_step.setter
    def global_step(self, step: int) -> None:
        self._step = step

    @property
    def counted_step(self) -> int:
        return self._step

    # ------------------------------------------------------------ replicas

    def gone(self) -> frozenset[int]:
        """Workers not counted in M: dead, done, or left unfinished a heartbeat timeout
        ago and not back (a gone worker whose gradient the current step holds counts
        until the step is applied, and so does one whose gradient is being looked for).

        A worker that left unfinished (``terminated``: a signal; ``error``) counts in M
        for a heartbeat timeout, as a worker killed outright does until it is counted
        dead: a launcher or an orchestrator starts it again, and meanwhile the others'
        steps wait for its share instead of being applied without it (a SIGTERM to one
        worker of a sync launch gave hundreds of steps of one gradient, the run's
        global step and model not the unfaulted one's; a stop reaching the tasks one by
        one left a checkpoint whose workers' batches disagreed with its step).

        One look at every worker is kept for :data:`GONE_MEMO_S` of the clock, until the
        next wake-up or change of ``counted`` / ``checking``, or until a worker it holds
        dead speaks: every long poll woken at once asks it, so a look per poll would
        cost O(workers) each, O(workers²) per step."""
        now = self.clock()
        key = int(now / GONE_MEMO_S)
        memo = self._gone_memo
        if memo is not None and memo[0] == key:
            return memo[1]
        gone = set(self.members.dead(now))
        gone |= {i for i, w in self.members.workers.items() if w.done}
        # left unfinished (a signal, an error): expected back, like a worker that went
        # silent it keeps its share of N for a heartbeat timeout
        gone |= set(self.members.lapsed(now))
        out = frozenset(gone - self.counted - self.checking)
        self._gone_memo = (key, out)
        return out

    def replicas(self) -> int:
        """M: replicas not known to be gone, at most ``total_replicas``."""
        return max(0, min(self.total, self.members.num_workers - len(self.gone())))

    def needed(self) -> int:
        """N as it must be now: never more than M (never less than 1)."""
        return max(1, min(self.aggregate, self.replicas()))

    async def _configure_ps(self, required: int) -> None:
        await super()._configure_ps(required)
        self.required = required

    async def _reconfigure(self) -> None:
        """Tell the PS the N of now, if it changed (serialized: the last word is fresh).

        A PS that does not answer in time (a loaded machine, a PS stopped) fails
        nothing: every PS is told again :data:`RECONFIGURE_RETRY_S` later, until all
        have answered (``sync_config`` is idempotent). A step whose N fell waits on
        that PS meanwhile; the chief does not end over it."""
        async with self._configuring:
            needed = self.needed()
            if needed != self.required:
                log.info(
                    "replicas to aggregate %d -> %d (M = %d live replicas)",
                    self.required,
                    needed,
                    self.replicas(),
                )
                try:
                    await self._configure_ps(needed)
                except ZmqpsError as exc:
                    self.required = 0  # not known everywhere: told to every PS again
                    self._retry_reconfigure(exc)
                    return
                self._told_everyone = True

    async def _count_contributions(self, gone: Sequence[int]) -> None:
        """Keep counting, for the current step, the ``gone`` workers whose gradient for
        it every PS still at that step holds (a PS that applied the step needs nobody:
        the step may still be open on another, holding the gradients of the gone).

        Workers leave in bursts (every one at the end of its run): those gone while a
        look-up is under way are looked up together by the next one, so a burst costs
        a few requests per PS, not one per worker. Returns once they were looked up, or
        after :data:`LOOKUP_WAIT_S` while a PS does not answer: they count in M until
        it does (or the step is applied), and the look-up then tells the PS the N it
        finds by itself."""
        looking = set(gone) - self.checking
        self.checking |= looking
        self._to_look.update(dict.fromkeys(looking, self._step))
        self._gone_memo = None
        if self._looker is None or self._looker.done():
            self._looker = asyncio.ensure_future(self._look_up())
        await waited(asyncio.shield(self._looker), LOOKUP_WAIT_S)

    async def _look_up(self) -> None:
        """Look up the workers queued for it, a batch at a time, until none is left. A
        batch a PS did not answer is asked again after a back-off (or at the next
        change: a step applied) while its step is open; once that step was applied
        its workers hold nothing of the next and count no more. N is told afresh
        after each batch (a leave that stopped waiting for it does not)."""
        tries = 0
        try:
            while self._to_look:
                step = self._step
                # gone while an earlier step was open: it was applied, they hold nothing
                moot = {i for i, at in self._to_look.items() if at != step}
                batch = set(self._to_look) - moot
                self._to_look = {}
                self.checking -= moot
                answered = True
                if batch:
                    try:
                        answered = await self._count_held(batch, retried=tries > 0)
                    except BaseException:
                        self.checking -= batch
                        raise
                if answered:
                    tries = 0
                    self.checking -= batch
                    self._gone_memo = None
                    await self._reconfigure()
                    await self._wake()
                    continue
                # still counted in M: asked again, with those gone meanwhile
                self._to_look = {**dict.fromkeys(batch, step), **self._to_look}
                await self.changed.wait(LOOKUP_RETRY_S[min(tries, len(LOOKUP_RETRY_S) - 1)])
                tries += 1
        finally:  # cancelled: nobody stays counted for a look-up that will not come
            self.checking -= set(self._to_look)
            self._to_look = {}
            self._gone_memo = None

    async def _count_held(self, gone: set[int], retried: bool = False) -> bool:
        """Count in ``counted`` those of ``gone`` whose gradient for the current step a
        PS at that step holds. False when a PS did not answer and the step is still
        open (asked again: said once, not ``retried``); True once settled (the step
        applied meanwhile: nobody)."""
        step = self._step
        held = {f"worker:{i}": i for i in sorted(gone)}
        body = o.Status(sync_of=tuple(held)).to_wire()
        try:
            replies = await asyncio.gather(
                *(c.request("status", body, timeout=LOOKUP_TIMEOUT_S) for c in self.stepping)
            )
        except ZmqpsError as exc:
            if self._step != step:
                return True
            if not retried:
                log.warning(
                    "could not look up whether step %d holds the gradients of workers %s"
                    " (%s): they count toward it while the look-up is asked again",
                    step + 1,
                    sorted(gone),
                    exc,
                )
            return False
        still_open = False
        for rep in replies:
            sync = rep.body.get("sync") or {}
            at = sync.get("step")
            if isinstance(at, int) and at > step:
                continue  # applied there: that PS waits for nobody
            if at != step:
                return True  # not known (e.g. restarted): count nobody
            got = set(sync.get("contributors", []))
            held = {name: i for name, i in held.items() if name in got}
            still_open = True
        if self._step == step and still_open:
            self.counted |= set(held.values())
        return True

    async def membership_changed(self, gone: Sequence[int] = (), back: Sequence[int] = ()) -> None:
        self._gone_memo = None
        if self.started:
            self._unsettled += 1  # no step released by the PS alone meanwhile
            try:
                # the ledger at the PS's step first: who holds what is of that step
                await self._take_back()
                if gone:
                    await self._count_contributions(gone)
                await self._reconfigure()
            finally:
                self._unsettled -= 1
        await self._wake()

    # ------------------------------------------------------------ the stepping loop

    async def start(self, holders: Sequence[int], step: int) -> None:
        """Drive sync training from ``step`` (0, or the step of a restore or of adopted
        PS; only step 0 gets the extra init tokens) until cancelled."""
        self._step_on(holders)
        self.required = 0  # tell every PS N afresh (a restarted PS has forgotten it)
        try:
            await self._configure_ps(self.needed())
        except ZmqpsError as exc:  # told again until every PS has it (as at a change of N)
            self.required = 0
            self._retry_reconfigure(exc)
        self._step = step
        self.counted.clear()
        self.tokens.restart(step, extra=self.cfg.init_tokens)
        self.step_started_at = self.clock()
        self.started = True
        self._allowing = False
        await self._wake()
        while True:
            nxt = self._step + 1
            released = self._step if self._relaying() else None
            until = None if released is None else self._release_until(nxt)
            if until is not None and released is not None:
                # the PS releases nxt .. until by itself; the chief hears where it is
                # about once a second, and at the boundary after (it is the chief's)
                rep = await self._run_ahead(until, released)
                if rep is None:  # taken back (a membership change): plan again
                    continue
                self._released_by_ps(rep.released)
                if self._step >= nxt or rep.step is None or rep.step < nxt:
                    continue
                # the PS applied nxt and released none of it (another generation): the
                # chief's boundary, as below (the poll answers at once)
            ahead = released is not None and self._may_release_ahead(nxt)
            self._allowing = ahead
            replies = await asyncio.gather(
                *(
                    self._wait_ps(c, nxt, k, released, ahead)
                    for k, c in zip(self.stepping_ids, self.stepping, strict=True)
                )
            )
            if self._step >= nxt:  # the PS released it and the ledger heard (_take_back)
                continue
            # tokens of nxt out already: the PS released it by itself (a release
            # allowed earlier, taken back after it came)
            out = ahead or any(r.released is not None and r.released >= nxt for r in replies)
            # before the step's gone workers stop counting
            replicas, gone = self.replicas(), self.gone()
            self._step = nxt
            self.counted.clear()
            self._gone_memo = None
            await self._reconfigure()
            if self._at_boundary and not out:
                await self._run_boundary_jobs(nxt)
            if self.on_step is not None and not out:
                # e.g. a checkpoint, while no tokens are out (a step the PS released by
                # itself has them out: one due meanwhile waits for the next boundary,
                # which the PS does not release by itself)
                await self.on_step(nxt)
            if self._step != nxt:
                continue  # the ledger moved on meanwhile (_take_back)
            self.step_started_at = self.clock()
            self.tokens.advance(nxt, replicas, gone)
            await self._wake()

    def _release_until(self, step: int) -> int | None:
        """The last step of the run from ``step`` on that the one PS may release by
        itself (:meth:`_may_release_ahead` at ``step``, and it said it takes
        ``release_until``): the step before the next checkpoint boundary
        (:attr:`plan_due`, a step from which on one is due), at most
        :data:`AHEAD_STEPS` ahead. None: the chief releases ``step`` itself, or only it."""
        if not self._may_release_ahead(step) or self.stepping_ids[0] not in self._ranges:
            return None
        due = self.plan_due
        if due(step):
            return None
        lo, hi = step, step + AHEAD_STEPS - 1  # not due at lo
        if not due(hi):
            return hi
        while hi - lo > 1:  # the first step due is in (lo, hi]
            mid = (lo + hi) // 2
            if due(mid):
                hi = mid
            else:
                lo = mid
        return lo

    async def _run_ahead(self, until: int, released: int) -> o.StepReply | None:
        """One poll letting the one PS release every step up to ``until`` by itself: it
        answers at the step after (the chief's boundary) or after
        :data:`AHEAD_POLL_S`, saying the step it released last. None: cancelled by a
        membership change (:meth:`_take_back`) or not answered (planned again)."""
        ps, k = self.stepping[0], self.stepping_ids[0]
        body = o.WaitStep(
            until + 1, AHEAD_POLL_S, released=released, gen=self.generation(), release_until=until
        ).to_wire()
        self._allowing = True
        task = asyncio.ensure_future(ps.request("wait_step", body, timeout=AHEAD_POLL_S + 5))
        self._ranging = task
        try:
            rep = await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelling = getattr(asyncio.current_task(), "cancelling", None)  # 3.11 on
            if not task.cancelled() or (cancelling is not None and cancelling()):
                task.cancel()
                raise  # the loop itself is cancelled
            return None
        except DeadlineExceeded:
            log.warning("ps at %s does not answer while it releases steps", ps.endpoint)
            return None
        except NotPrimary as exc:  # the process lost its copy: a fail-over moves it
            log.info("steps wait for a fail-over: %s", exc)
            await asyncio.sleep(0.1)
            return None
        except Busy as exc:
            await self._refusal(k, ps, exc)
            return None
        finally:
            if self._ranging is task:
                self._ranging = None
        self._refused.pop(k, None)
        out = o.StepReply.parse(rep.body, "wait_step reply")
        self._relayed(k, out)
        return out

    def _released_by_ps(self, released: int | None) -> None:
        """The one PS said it released steps up to ``released`` by itself: the ledger
        moves there (no ``on_step``: their tokens are out; a checkpoint due meanwhile
        waits for the next boundary, which the PS does not release by itself)."""
        if released is None or released <= self._step:
            return
        replicas, gone = self.replicas(), self.gone()
        self._step = released
        self.counted.clear()
        self._gone_memo = None
        self.step_started_at = self.clock()
        self.tokens.advance(released, replicas, gone)
        self.changed.notify_all()

    async def _take_back(self) -> None:
        """A membership change: the PS stops releasing steps by itself (a stepping poll
        without ``release_until``), and the ledger moves to the step it released, so
        the gone workers are looked up, and N told, at the step the PS is at. The
        loop's poll that allowed them is cancelled (it plans again)."""
        if len(self.stepping_ids) != 1:
            return  # several PS: the chief releases every step itself
        if not self._allowing and self.stepping_ids[0] not in self._ranges:
            return  # nothing allowed (a poll that took it back may be in flight: asked too)
        self._allowing = False
        if self._ranging is not None:
            self._ranging.cancel()
        ps = self.stepping[0]
        body = o.WaitStep(0, 0.0, released=self._step, gen=self.generation()).to_wire()
        try:
            rep = await ps.request("wait_step", body, timeout=2.0)
        except ZmqpsError as exc:
            log.warning(
                "ps at %s did not hear that the chief takes the steps back: %s", ps.endpoint, exc
            )
            return
        self._released_by_ps(o.StepReply.parse(rep.body, "wait_step reply").released)

    async def _wait_ps(
        self, ps: Requester, step: int, k: int, released: int | None, ahead: bool = False
    ) -> o.StepReply:
        """Until PS ``k`` applied ``step``; each poll tells it the step whose tokens are
        released (it hands them, :meth:`token_ps`), and each answer says how many it
        handed and how long their requests waited. ``ahead``: the PS releases ``step``
        itself the moment it applied it (:meth:`_may_release_ahead`)."""
        poll = min(POLL_S, BEHIND_LOOK_S)
        body = o.WaitStep(
            step, poll, released=released, gen=self.generation(), release_step=ahead or None
        ).to_wire()
        said = looked = self.clock()
        try:
            while True:
                try:
                    rep = await ps.request("wait_step", body, timeout=poll + 5, attempts=2)
                except DeadlineExceeded:
                    log.warning(
                        "ps at %s does not answer while step %d waits on it", ps.endpoint, step
                    )
                    continue
                except NotPrimary as exc:  # the process lost its copy: a fail-over moves it
                    log.info("step %d waits for a fail-over: %s", step, exc)
                    await asyncio.sleep(0.1)
                    continue
                except Busy as exc:
                    await self._refusal(k, ps, exc)
                    continue
                self._refused.pop(k, None)
                out = o.StepReply.parse(rep.body, "wait_step reply")
                self._relayed(k, out)
                if int(rep.body["step"]) >= step:
                    return out
                now = self.clock()
                if now - looked >= BEHIND_LOOK_S:
                    looked = now
                    say = now - said >= BEHIND_REPORT_S
                    if say:
                        said = now
                    await self._look_behind(ps, k, step, say)
        finally:
            self._behind.pop(k, None)
            self._refused.pop(k, None)

    async def _look_behind(self, ps: Requester, k: int, step: int, say: bool) -> None:
        """Step ``step`` has waited on PS state ``k`` past :data:`BEHIND_LOOK_S`: learn
        why from its status (its pushes not all in, or its copies not all caught up:
        :meth:`held_by_copies` then names it) and, ``say``, say it in the log (which
        backup holds it, from the primary's own account)."""
        try:
            rep = await ps.request("status", timeout=2.0)
        except ZmqpsError as exc:
            if say:
                log.warning("step %d waits on ps %d's state (at %s): %s", step, k, ps.endpoint, exc)
            return
        # a status is free-form: only what has the expected shape is read
        sync, replica = (rep.body.get(k) for k in ("sync", "replica"))
        sync = sync if isinstance(sync, dict) else {}
        replica = replica if isinstance(replica, dict) else {}
        there = sync.get("step")
        if isinstance(there, int) and there >= step:
            since = self._behind.get(k, (self.clock(), there))[0]
            self._behind[k] = (since, there)
            if not say:
                return
            log.warning(
                "step %d waits on ps %d's state (at %s): it applied step %d, and its copies"
                " do not all have it yet (entry %s of %s committed; backups at %s)",
                step,
                k,
                ps.endpoint,
                there,
                replica.get("committed"),
                replica.get("head"),
                replica.get("backups"),
            )
        elif say:
            # the PS has not the pushes of the step yet: say whose it has, so the worker
            # it waits for is named (the line read as if the PS were at fault)
            who = sync.get("contributors")
            who = who if isinstance(who, list) else []
            got = ", ".join(map(str, who[:8])) or "none"
            if len(who) > 8:
                got += f" and {len(who) - 8} more"
            log.info(
                "step %d waits on ps %d's state (at %s), at step %s: the pushes of %s of the"
                " %s it needs are in (the step waits for the other workers' pushes)",
                step,
                k,
                ps.endpoint,
                there,
                got,
                sync.get("required"),
            )

    def held_by_copies(self) -> dict[int, tuple[float, int]]:
        """PS states that applied the current step but cannot tell it yet (their copies
        do not all have it): state -> (since when, as the clock says; the step there)."""
        return dict(self._behind)

    def refused_by(self) -> dict[int, float]:
        """PS states whose process refuses the chief's stepping polls now (busy with
        other peers' requests): state -> since when, as the clock says."""
        return {k: since for k, (since, _) in self._refused.items()}

    async def _refusal(self, k: int, ps: Requester, exc: Busy) -> None:
        """PS state ``k``'s process refused a stepping poll (its pending requests are at
        their bound: other peers' long polls, a flood): nothing was done there, and the
        chief asks again after a back-off, never giving up on the step (its status
        names that PS meanwhile)."""
        since, n = self._refused.get(k, (self.clock(), 0))
        self._refused[k] = (since, n + 1)
        if n == 0:
            log.warning(
                "ps at %s refuses the chief's step polls (%s): asking again until it takes them",
                ps.endpoint,
                exc,
            )
        await asyncio.sleep(BUSY_BACKOFF_S[min(n, len(BUSY_BACKOFF_S) - 1)])

    def _may_release_ahead(self, step: int) -> bool:
        """Whether the PS may release ``step``'s tokens by itself the moment it applied
        it, the chief off the step's path: only when one PS holds shards (with several,
        a token from one that applied the step would let a worker pull another that has
        not yet) and it said it takes the field (an older one refuses it), no checkpoint
        is due at that boundary (:attr:`step_due`), and nothing of the membership is to
        settle there (gone workers still counted or looked up, N not told everywhere).
        Else the chief releases the step after it heard of it, as always."""
        return (
            len(self.stepping_ids) == 1
            and self.stepping_ids[0] in self._releases
            and not self.counted
            and not self.checking
            and not self._to_look
            and not self._unsettled
            and self._told_everyone
            and self.required == self.needed()
            and not self.step_due(step)
            and not self._at_boundary
        )

    def _relaying(self) -> bool:
        """Whether the PS hand this step's tokens: the ledger's rules are then those of
        :class:`~zmqps.core.sync.ReleasedTokens` (M is every live worker, no
        ``init_tokens`` left)."""
        return self.total >= self.members.num_workers and self.tokens.extra == 0

    def _relayed(self, k: int, rep: o.StepReply) -> None:
        if rep.releases:
            self._releases.add(k)
        else:
            self._releases.discard(k)
        if rep.releases_until:
            self._ranges.add(k)
        else:
            self._ranges.discard(k)
        if rep.granted_of is not None:
            self._count_relayed(k, rep.granted_of, rep.granted or 0)
        if rep.token_waits and self.on_token_waits is not None:
            self.on_token_waits(rep.token_waits)

    def _count_relayed(self, k: int, step: int, granted: int) -> None:
        """PS ``k`` said it handed ``granted`` tokens of ``step`` (its ``wait_step``
        answers, at each step's end and every poll; its ``status``)."""
        if step == self.tokens.step and self.started:
            self.tokens.relayed[k] = granted

    def token_ps(self, who: o.Who) -> int | None:
        """A PS holding shards, the same for a worker as long as they do (spread over
        them by worker index), while the PS hand tokens."""
        if not self.stepping_ids or not self._relaying():
            return None
        return self.stepping_ids[who.index % len(self.stepping_ids)]

    async def applied_step(self) -> int:
        """The step every PS has applied, without the lag of the loop above (at the end
        of training the last push can be acknowledged before the loop hears of it)."""
        if not self.stepping:
            return self._step
        body = o.WaitStep(0).to_wire()
        try:
            reps = await asyncio.gather(
                *(c.request("wait_step", body, timeout=5.0) for c in self.stepping)
            )
        except ZmqpsError:
            return self._step
        return max(self._step, min(int(r.body["step"]) for r in reps))

    async def take_token(self, who: o.Who, wait: float, have: Have) -> int:
        """A token for ``who`` (its value is the step to compute); NotReady after
        ``wait`` seconds. ``have``: the step the worker computed last, or a function
        that says it each time the poll is looked at again (it may change meanwhile)."""
        have_now = have if callable(have) else lambda: have

        memo = self._gone_memo
        if memo is not None and who.index in memo[1]:
            self._gone_memo = None  # it speaks: a look that holds it dead is out of date

        def grant() -> int | None:
            if not self.started:
                return None
            gone = self.gone()
            return self.tokens.take(who.index, who.incarnation, self.replicas(), have_now(), gone)

        return int(
            await self._long_wait(
                grant, wait, f"no token within {wait:g}s (global step {self._step})"
            )
        )

    def steps_planned(self) -> int:
        return self.members.max_steps_planned

    # ------------------------------------------------------------ status

    async def waiting_on(self, live: Sequence[int], skip: Sequence[Requester] = ()) -> list[int]:
        """Live workers whose gradient for the current step some PS has not received
        (``skip``: PS known not to answer, not asked)."""
        names = {f"worker:{i}": i for i in live}
        missing: set[int] = set()
        body = o.Status(sync_of=tuple(names)).to_wire()

        async def ask(k: int, c: Requester) -> None:
            try:
                rep = await c.request("status", body, timeout=2.0)
            except ZmqpsError:
                return  # an unreachable PS: zmqps status reports it under ps_down
            sync = rep.body.get("sync") or {}
            at = sync.get("step")
            if not (isinstance(at, int) and at > self._step):  # else applied: waits on nobody
                got = set(sync.get("contributors", []))
                missing.update(i for name, i in names.items() if name not in got)
            granted_of, granted = sync.get("granted_of"), sync.get("granted")
            if type(granted_of) is int and type(granted) is int and granted >= 0:
                self._count_relayed(k, granted_of, granted)

        # All PS at once: one cut off by a partition costs the status 2 s, not 2 s each.
        stepping = zip(self.stepping_ids, self.stepping, strict=True)
        await asyncio.gather(*(ask(k, c) for k, c in stepping if c not in skip))
        return sorted(missing)

    def status(self) -> dict[str, Any]:
        replicas = self.replicas()
        return {
            "mode": self.name,
            "replicas_to_aggregate": self.required or self.needed(),
            "total_replicas": replicas,
            "tokens_available": self.tokens.untaken(replicas, self.gone()) if self.started else 0,
            "tokens_discarded": self.tokens.discarded,
            "step_age_s": round(self.clock() - self.step_started_at, 3),
        }


def make_chief_mode(
    cfg: SyncConfig,
    members: Membership,
    ps: Sequence[Requester],
    clock: Callable[[], float] = time.monotonic,
) -> ChiefMode:
    """The strategy for ``cfg.mode``."""
    kinds: dict[str, type[ChiefMode]] = {"async": AsyncMode, "ssp": SspMode, "sync": SyncMode}
    return kinds[cfg.mode](cfg, members, ps, clock)
