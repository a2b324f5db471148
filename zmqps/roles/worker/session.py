"""A worker-side process's membership in the cluster: one owner for the chief
connection, the identity, the generation, heartbeats and the recovery policy.

Rules of this module:

* :class:`Session` is the only holder of the cluster generation on its side: the
  parameter client, the step modes and the evaluator read it here, and only the
  session changes it (a heartbeat that hears of a restore, or :meth:`recover`).
  Whoever must act on a restore registers a listener (:meth:`on_restored`).
* Every request to the chief goes through :meth:`call` / :meth:`long_poll`: a chief
  that does not know this task (it restarted) gets a registration first, then the
  request again. Long polls are resendable: when the connection to a restarted
  chief comes back they are sent again at once (the transport does it), and every
  long poll is idempotent (a token request says which step it computed last).
* The recovery policy is written once, here: :meth:`retrying` runs a data request
  through restores (wait for the chief to report a newer generation, then run it
  again); :meth:`delivering` runs a push until it is delivered, sending it again
  while no restore came, and gives it up when the cluster was restored meanwhile,
  its gradient being of values that no longer exist (:meth:`dropping`: counted).
* A push is sent again, not dropped, when its PS state moved (a fail-over: the
  request was routed by an older placement epoch) or its PS was cut off and is back
  (a request timed out while the chief hears every PS and no restore is under way):
  the same messages with the same sequence numbers
  (:class:`~zmqps.roles.channels.Delivery`), so a PS that has one already answers it
  as a duplicate, and it is applied at most once. Dropping it instead would lose a
  gradient no PS acknowledged, and in sync mode leave its step waiting for ever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from zmqps.roles.channels import RECOVERABLE, Delivery
from zmqps.transport import Requester
from zmqps.wire import ops as o
from zmqps.wire.errors import (
    EXIT_CONFIG,
    ConfigError,
    DeadlineExceeded,
    NotFound,
    NotPrimary,
    NotReady,
    ProtocolError,
    RolledBack,
    ShutdownError,
    ZmqpsError,
)

__all__ = ["RECOVERABLE", "RunEnded", "Session", "cut_off"]

log = logging.getLogger("zmqps.worker")

T = TypeVar("T")
B = TypeVar("B", bound=o.Body)

#: A task that left with its work done waits for the run's end as long as the chief
#: answers; this many heartbeat intervals of silence (at least 10 s) end the wait.
LINGER_SILENCE = 10
#: ... and after this many heartbeats in a row went unanswered (each waits an interval
#: and 2 s): a process stopped and continued does not leave on the one it sent before
LINGER_UNANSWERED = 3


#: a worker waiting for its chief says so at most this often (seconds)
REGISTER_NOTE_S = 5.0
#: a worker done with its work, waiting for the run's end, says so this often (seconds)
LINGER_NOTE_S = 60.0


class RunEnded(Exception):
    """At registration: the chief says the run ended before it started (it was started
    again on the run's final checkpoint, the summary of that step beside it). Nothing
    is left for this task to do: it ends, exit code 0, with this line."""

    def __init__(self, checkpoint: str, step: int) -> None:
        super().__init__(f"the run already finished ({checkpoint}, step {step})")
        #: the run's final checkpoint (its name) and its global step
        self.checkpoint = checkpoint
        self.step = step


class Session:
    """One task (``who``) of the cluster whose chief is reached through ``chief``."""

    def __init__(
        self,
        chief: Requester,
        who: o.Who,
        *,
        steps_planned: int = 0,
        recovery_timeout: float = 300.0,
        progress: Callable[[], tuple[int, int, float | None, int]] | None = None,
        chief_timeout: float | None = None,
        on_stop: Callable[[str, int], None] | None = None,
        job: Mapping[str, str] | None = None,
    ) -> None:
        self.chief = chief
        #: the job flags this task runs with, sent when it registers: the chief refuses
        #: a worker of another cluster layout or model (:mod:`zmqps.roles.agreement`)
        self.job = dict(job) if job else None
        self.who = who
        self.steps_planned = steps_planned
        self.recovery_timeout = recovery_timeout
        #: a chief that answers nothing this long is gone for good (None: never said)
        self.chief_timeout = chief_timeout
        #: ``on_stop(reason, exit code)``: the chief stopped the run, or is gone
        self.on_stop = on_stop
        #: the placement epoch known here; ``on_placement()`` runs when a heartbeat
        #: names a newer one (a fail-over moved PS states: re-route to them)
        self.epoch = 0
        self.on_placement: Callable[[], Awaitable[None]] | None = None
        self.chief_gone = False
        #: ``(steps, examples, last loss)`` of this process, for heartbeats and leave
        #: (steps, examples, last loss, steps refused as not finite) of this task
        self.progress = progress or (lambda: (0, 0, None, 0))
        #: the examples of the batches this task resumed after, when it knows them
        #: exactly (its data says them), for heartbeats and leave; None: the chief
        #: counts them from what earlier incarnations said
        self.examples_before: Callable[[], int | None] = lambda: None
        #: restores so far, as this process knows; data requests carry it
        self.gen = 0
        #: batches this task's earlier incarnations did, as the chief said at the start
        self.steps_done: int | None = None
        self.info: o.ClusterInfo | None = None
        #: what the last heartbeat said
        self.recovering = False
        self.finished = False
        self.ps_down: tuple[int, ...] = ()
        self.last_contact = time.monotonic()
        #: pushes dropped because the cluster was restored meanwhile
        self.rolled_back = 0
        #: pushes sent again (their PS state moved, or their PS was cut off)
        self.resent = 0
        #: the batch cursor the last restore went back to, until taken (take_rewind)
        self.rewind: int | None = None
        self._listeners: list[Callable[[int], None]] = []
        self._heartbeats: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.who.name

    def on_restored(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(gen)`` whenever the cluster is found restored."""
        self._listeners.append(listener)

    def enter(self, gen: int, rewind: int | None = None) -> None:
        """The cluster is at generation ``gen`` now (a heartbeat or a status said so,
        no restore under way): every listener hears of it once. ``rewind``: the restore
        went back to a checkpoint holding this task's batches up to that cursor."""
        if gen == self.gen:
            return
        self.gen = gen
        self.rewind = rewind
        for listener in self._listeners:
            listener(gen)

    # ------------------------------------------------------------------ the chief

    async def open(self, connect_timeout: float) -> o.ClusterInfo:
        """Register with the chief, waiting up to ``connect_timeout`` for it;
        :class:`RunEnded` when the chief says its run ended before it started."""
        info = await self._register(connect_timeout)
        if info.ended is not None:
            raise RunEnded(info.ended, info.global_step)
        self.gen = info.gen
        self.steps_done = info.steps_done
        return info

    async def _register(self, connect_timeout: float) -> o.ClusterInfo:
        deadline = time.monotonic() + connect_timeout
        # registering again (the chief restarted): say where this incarnation started
        body = o.Register(
            self.who,
            self.steps_planned,
            steps_done=self.steps_done,
            epoch=self.epoch or None,
            job=self.job,
        ).to_wire()
        said, why = float("-inf"), ""
        while True:
            try:
                rep = await self.chief.request("register", body, timeout=2.0)
                self.info = o.ClusterInfo.parse(rep.body, "register reply")
                self.last_contact = time.monotonic()
                return self.info
            except ProtocolError as exc:
                if "does not serve 'register'" in str(exc):  # a PS (or another server)
                    server = str(exc).split(" does not serve", 1)[0]
                    raise ConfigError(
                        f"the chief's address {self.chief.endpoint} is {server}'s, not the"
                        " chief's (pass the chief's address: the cluster spec's chief,"
                        " --chief-host)"
                    ) from None
                if "job" not in body or "unknown field 'job'" not in str(exc):
                    raise
                # a chief of an older zmqps: it compares no job flags
                log.info("%s: the chief does not compare job flags (an older zmqps)", self.name)
                self.job = None
                body = {k: v for k, v in body.items() if k != "job"}
            except (DeadlineExceeded, NotReady) as exc:
                # a chief that answers NotReady is up and starting (e.g. waiting for its
                # PS): its own words, not "no answer" (which sends users to the network)
                now_why = f"the chief is not ready: {exc}" if isinstance(exc, NotReady) else ""
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        f"chief at {self.chief.endpoint} did not answer within {connect_timeout:g}s"
                        " (is it running at that address? a cluster started with CURVE keys"
                        " answers only clients with theirs: --keys DIR or ZMQPS_KEYS)"
                        if not now_why
                        else f"chief at {self.chief.endpoint} was not ready within"
                        f" {connect_timeout:g}s ({exc})"
                    ) from None
                if now_why != why or time.monotonic() - said >= REGISTER_NOTE_S:
                    said, why = time.monotonic(), now_why  # at most one line per 5 s
                    log.info(
                        "%s: waiting for the chief at %s%s",
                        self.name,
                        self.chief.endpoint,
                        f" ({now_why})" if now_why else "",
                    )
                if isinstance(exc, NotReady):  # it answers, and is starting: ask again soon
                    await asyncio.sleep(0.2)

    async def _reregister(self) -> None:
        log.warning("%s: the chief does not know this task (restarted?): registering", self.name)
        info = await self._register(self.recovery_timeout)
        if info.ended is not None:
            # started again after the run's end: it admits no one, and would answer
            # every request again with "not registered"
            raise RunEnded(info.ended, info.global_step)
        if info.gen != self.gen:
            log.warning("%s: the cluster is at generation %d now", self.name, info.gen)

    async def call(
        self,
        op: str,
        body: o.Body,
        reply: type[B],
        *,
        timeout: float,
        attempts: int = 1,
    ) -> B:
        """A request to the chief; a chief that does not know this task (it restarted)
        hears a registration first, then the request again."""
        wire = body.to_wire()
        while True:
            try:
                rep = await self.chief.request(op, wire, timeout=timeout, attempts=attempts)
                self.last_contact = time.monotonic()
                return reply.parse(rep.body, f"{op} reply")
            except NotFound:
                await self._reregister()

    async def long_poll(
        self, op: str, body: Callable[[], o.Body], reply: type[B], poll: float
    ) -> B:
        """A long poll to the chief, repeated until it answers (the chief holds each
        poll open ``poll`` seconds). Resendable: after a lost connection it is sent
        again at once; a poll with no answer in time is asked again, its body made
        afresh by ``body()`` (a restore meanwhile changes what this task has done)."""
        while True:
            try:
                return await self.call(op, body(), reply, timeout=poll + 10.0, attempts=2)
            except NotReady:
                continue  # nothing yet: ask again (the chief holds each poll open)
            except DeadlineExceeded:
                log.warning("%s: the chief did not answer %s; retrying", self.name, op)

    # ------------------------------------------------------------------ heartbeats

    def _beat(self) -> dict[str, Any]:
        step, examples, loss, nonfinite = self.progress()
        beat = o.Heartbeat(
            self.who,
            step,
            examples=examples,
            nonfinite=nonfinite or None,
            examples_before=self.examples_before(),
        )
        out = beat.to_wire()
        if loss is not None and np.isfinite(loss):
            out["loss"] = float(loss)
        return out

    async def heartbeat(self, timeout: float = 5.0) -> o.HeartbeatReply:
        """One heartbeat round trip (re-registering with a restarted chief)."""
        while True:
            try:
                # resendable: a heartbeat in flight when the chief died is sent again
                # to the restarted one as soon as the connection is back, instead of
                # waiting out its deadline (fault schedule 8 of run 11: 5 s)
                rep = await self.chief.request(
                    "heartbeat", self._beat(), timeout=timeout, attempts=2
                )
                self.last_contact = time.monotonic()
                beat = o.HeartbeatReply.parse(rep.body, "heartbeat reply")
                break
            except NotFound:
                await self._reregister()
        self.recovering, self.finished, self.ps_down = beat.recovering, beat.finished, beat.ps_down
        if beat.epoch is not None and beat.epoch > self.epoch:
            if self.on_placement is not None:
                await self.on_placement()  # the links follow the moved states first
            self.epoch = max(self.epoch, beat.epoch)
        if beat.stop and self.on_stop is not None:
            self.on_stop("the chief is stopping the run", 0)
        return beat

    def _silence(self) -> None:
        """No answer from the chief: past ``chief_timeout`` it is gone for good."""
        silent = time.monotonic() - self.last_contact
        if self.chief_timeout is None or silent < self.chief_timeout or self.chief_gone:
            return
        self.chief_gone = True
        log.error("%s: no answer from the chief for %.0fs: it is gone", self.name, silent)
        if self.on_stop is not None:
            self.on_stop(f"no answer from the chief for {silent:.0f}s", 1)

    def start_heartbeats(self, interval: float) -> None:
        self._heartbeats = asyncio.ensure_future(self._heartbeat_loop(interval))

    async def _heartbeat_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                beat = await self.heartbeat(timeout=max(2.0, interval * 3))
            except DeadlineExceeded:
                log.warning("%s: the chief did not answer a heartbeat", self.name)
                self._silence()
                continue
            except (ShutdownError, RunEnded):
                return
            except ConfigError as exc:
                # registered again with a chief restarted with other flags, which refuses
                # this task: it stops (exit code 2), it does not go on without heartbeats
                if self.on_stop is not None:
                    self.on_stop(str(exc), EXIT_CONFIG)
                return
            if beat.gen != self.gen and not beat.recovering:
                log.warning("%s: the cluster was restored (generation %d)", self.name, beat.gen)
                self.enter(beat.gen, beat.rewind)  # requests waiting on a lost PS fail now

    # ------------------------------------------------------------------ recovery

    async def recover(self, error: Exception, made_in: int | None = None) -> None:
        """A PS refused or failed a data request (made in generation ``made_in``;
        default: the current one): wait until the chief has restored the cluster into a
        newer generation (or say why not). A heartbeat may have heard of the restore
        already: then this returns after one round trip."""
        old = self.gen if made_in is None else made_in
        #: the placement epoch the request was routed by: once a newer one is known,
        #: its PS state moved (a fail-over, a move) and the request goes to the new primary
        routed = getattr(error, "epoch", None)
        if routed is not None and routed < self.epoch:
            return
        log.warning("%s: %s; waiting for the cluster to recover", self.name, error)
        started = time.monotonic()
        deadline = started + self.recovery_timeout
        while True:
            try:
                beat = await self.heartbeat()
            except DeadlineExceeded:
                log.warning("%s: the chief does not answer; retrying", self.name)
                self._silence()
                beat = None
            if beat is not None:
                if beat.gen != old and not beat.recovering:
                    break
                if routed is not None and routed < self.epoch and not beat.recovering:
                    log.warning("%s: its PS moved (fail-over, move): sending again", self.name)
                    return
                if cut_off(error, beat, old):
                    log.warning("%s: every PS answers the chief again: retrying", self.name)
                    return
            if self.chief_gone:
                raise DeadlineExceeded(f"{self.name}: the chief is gone ({error})") from error
            if time.monotonic() > deadline:
                raise DeadlineExceeded(
                    f"{self.name}: the cluster did not recover within"
                    f" {self.recovery_timeout:g}s ({error})"
                ) from error
            # a state handed over to another process (not_primary) is served again
            # within milliseconds: asked again soon for the first second
            soon = isinstance(error, NotPrimary) and time.monotonic() < started + 1.0
            await asyncio.sleep(0.02 if soon else 0.2)
        self.enter(beat.gen, beat.rewind)
        log.warning("%s: resuming in generation %d", self.name, beat.gen)

    def take_rewind(self) -> int | None:
        """The batch cursor a restore went back to since the last call (None: none)."""
        rewind, self.rewind = self.rewind, None
        return rewind

    async def retrying(self, request: Callable[[], Awaitable[T]]) -> T:
        """Run a data request; through a restore, recover and run it again."""
        while True:
            gen = self.gen
            try:
                return await request()
            except RECOVERABLE as e:
                await self.recover(e, gen)

    async def delivering(
        self,
        push: Callable[[Delivery], Awaitable[bool]],
        made_in: int | None = None,
        delivery: Delivery | None = None,
    ) -> bool | None:
        """Run ``push`` (given the :class:`Delivery` that keeps its messages) of
        gradients of values of generation ``made_in`` (default: the current one) until
        it is delivered: through a fail-over or a healed partition it is sent again
        (the same messages, those answered skipped). Returns whether it was applied,
        or None when the cluster was restored meanwhile (its values no longer exist:
        dropped; the next pull is of the new ones). Past the recovery timeout,
        ``DeadlineExceeded``. ``delivery``: one made by the caller, saying what the
        push asks for beyond applying (sync: a token, the values of after the step),
        where what its replies brought is read after."""
        gen = self.gen if made_in is None else made_in
        delivery = Delivery() if delivery is None else delivery
        while True:
            try:
                return await push(delivery)
            except RECOVERABLE as e:
                await self.recover(e, gen)
                if self.gen != gen:
                    return None
                delivery.again += 1
                delivery.fresh_steps.clear()  # values come from those sent this time
                self.resent += 1
                log.info("%s: sending a push again (%s)", self.name, e)

    async def dropping(
        self,
        push: Callable[[Delivery], Awaitable[bool]],
        made_in: int | None = None,
        delivery: Delivery | None = None,
    ) -> bool:
        """:meth:`delivering`, a push dropped by a restore counted (``rolled_back``).
        False when dropped."""
        applied = await self.delivering(push, made_in, delivery)
        if applied is None:
            self.dropped()
            return False
        return applied

    def dropped(self) -> None:
        """A step's push was dropped: the cluster was restored meanwhile (counted)."""
        self.rolled_back += 1

    # ------------------------------------------------------------------ the end

    async def leave(self, reason: str, timeout: float = 10.0, waits: bool = False) -> bool | None:
        """Tell the chief this task leaves (``done``: its work is finished; ``waits``:
        it then waits for the run's end, see :meth:`linger`). False when the chief did
        not acknowledge it; None when it refused a ``done`` for the cluster was restored
        since (this task's batches may have been taken back): the session is then in
        the new generation (its rewind waiting in :meth:`take_rewind`), heartbeats
        going again, and the task has not left."""
        heartbeats = self._heartbeats
        if heartbeats is not None:
            heartbeats.cancel()
        step, examples, _, nonfinite = self.progress()
        body = o.Leave(
            self.who,
            step,
            reason,
            examples,
            waits,
            nonfinite or None,
            self.gen,
            examples_before=self.examples_before(),
        )
        try:
            await self.call(
                "leave", body, o.StepReply, timeout=timeout, attempts=2 if timeout >= 5 else 1
            )
        except DeadlineExceeded:
            log.warning("%s: the chief did not acknowledge leave", self.name)
            return False
        except RolledBack as e:
            log.warning("%s: %s: not leaving yet", self.name, e)
            await self.recover(e)
            if heartbeats is not None:
                self.start_heartbeats(self.info.heartbeat_interval if self.info else 1.0)
            return None
        return True

    async def linger(self, position: int, stop: Callable[[], bool]) -> int | None:
        """After leaving with the work done: wait for the run's end (the chief says
        ``finished``), heartbeating, so that a restore which takes this task's last
        batches back (a PS lost before the final checkpoint) finds it. Returns the
        position to train again from when one does (heartbeats start again: this task
        is a member at work again); None when the run finished, ``stop()`` became true,
        the chief refused this task (a newer incarnation replaced it), or the chief was
        silent ``LINGER_SILENCE`` heartbeat intervals (at least 10 s: a chief restarted
        by its supervisor answers within about one). A restarted chief that does not
        know this task hears the leave again (:meth:`_leave_again`): where it lost
        some of this task's work with its PS, it sends the task back to train it."""
        interval = self.info.heartbeat_interval if self.info is not None else 1.0
        silence = max(10.0, LINGER_SILENCE * interval)
        started = said = time.monotonic()
        unanswered = 0  # heartbeats in a row the chief did not answer
        while not stop():
            if time.monotonic() - said >= LINGER_NOTE_S:  # never silent while it waits
                said = time.monotonic()
                log.info(
                    "%s: its work done, waiting %.0fs for the run's end (other workers"
                    " still training, or the chief's last checkpoint; `zmqps status` says"
                    " who it waits on)",
                    self.name,
                    said - started,
                )
            sent = time.monotonic()
            # the chief holds this heartbeat until the run's end (or a restore), one
            # interval at most: the end is heard at once, not at the next heartbeat
            beat_body = {**self._beat(), "wait": interval}
            try:
                rep = await self.chief.request("heartbeat", beat_body, timeout=interval + 2.0)
            except DeadlineExceeded:
                # (from the linger's start: a leave the chief did not answer took its
                # own time before it), and heartbeats in a row: one sent before this
                # process was stopped (SIGSTOP) times out as it goes on, however long
                # ago the chief last answered, and the chief may have been up since
                unanswered += 1
                quiet = time.monotonic() - max(self.last_contact, started)
                if quiet > silence and unanswered >= LINGER_UNANSWERED:
                    log.warning("%s: no word from the chief for %.0fs: leaving", self.name, quiet)
                    return None
                continue
            except NotFound:
                # a restarted chief that does not know this task (or knows it from the PS
                # or its record only): it hears again that this task's work is done (the
                # task registers first). The PS may have lost some of that work with the
                # chief: it then refuses the leave, and this task trains those batches
                # again from where the cluster went back to.
                unanswered = 0
                log.info("%s: the chief does not know this task: telling it again", self.name)
                try:
                    back = await self._leave_again(position, interval)
                except RunEnded as e:  # a chief started again after the run's end
                    log.info("%s: %s", self.name, e)
                    return None
                except ZmqpsError as e:  # the cluster did not recover in time, say
                    log.warning("%s: %s: leaving", self.name, e)
                    return None
                if back is not None:
                    return back
                continue
            except ZmqpsError as e:
                # replaced by a newer incarnation, or refused: the run's end is no more
                # this task's concern
                log.info("%s: the chief answers %s: leaving", self.name, e)
                return None
            self.last_contact, unanswered = time.monotonic(), 0
            beat = o.HeartbeatReply.parse(rep.body, "heartbeat reply")
            if beat.finished or beat.stop:
                return None
            if beat.gen != self.gen and not beat.recovering:
                self.enter(beat.gen, beat.rewind)
                if self.rewind is not None and self.rewind < position:
                    self.start_heartbeats(interval)
                    return self.rewind
            # an answer held the whole interval goes on at once; one answered early
            # (nothing to hold for, or a chief that does not hold) waits the rest
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - sent)))
        return None

    async def _leave_again(self, position: int, interval: float) -> int | None:
        """:meth:`linger`'s leave to a chief that did not know this task: the position to
        train again from when the chief refused it for a restore that took batches of
        this task back (heartbeats going again); None when it was taken (or not
        answered: the linger goes on, and says so again)."""
        while True:
            left = await self.leave("done", waits=True)
            if left is not None:
                return None
            if self.rewind is not None and self.rewind < position:
                if self._heartbeats is None or self._heartbeats.done():
                    self.start_heartbeats(interval)
                return self.rewind
            # a restore that took nothing of this task back: its work stands, it leaves
            # again in the new generation

    async def close(self) -> None:
        if self._heartbeats is not None:
            self._heartbeats.cancel()
        await self.chief.close()


def cut_off(error: Exception, beat: o.HeartbeatReply, old: int) -> bool:
    """A request timed out, yet the cluster was not restored and the chief hears every
    PS: the PS was cut off (a partition) with its shards intact, not lost. No restore
    will come, so waiting for one would wait forever: retry instead."""
    return (
        isinstance(error, DeadlineExceeded)
        and beat.gen == old
        and not beat.recovering
        and not beat.ps_down
    )
