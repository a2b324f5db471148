"""The consistency mode on a worker, as a strategy chosen once at registration.

Rules of this module:

* :meth:`StepMode.begin` is where a worker waits before a step: async not at all;
  ssp until the slowest live worker is close enough (``ssp_clock``); sync until it
  holds a token of the current global step (``take_token``), whose value tags the
  step's pushes (:meth:`StepMode.tag`).
* A sync worker says which step it computed last (``have``): a token request resent
  after a lost connection gets the same token again, never a second one of a step,
  and a new incarnation starts from what its earlier ones computed.
* A token taken before a restore is void: the next step takes a new one.
* A token names where to ask for the next one: a PS (it hands the tokens the chief
  releases, so the chief hears no request per worker and step) or the chief. A PS
  that does not answer with a token (none released within the poll, a PS restarted or
  moved, any error) sends the request to the chief, whose answer always holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from zmqps.roles.worker.session import Session
from zmqps.transport import Requester
from zmqps.wire import ops as o
from zmqps.wire.errors import InvalidArgument, NotReady, ZmqpsError

log = logging.getLogger("zmqps.worker")

#: the link to PS state ``k`` (None: not known yet)
Links = Callable[[int], Requester | None]

__all__ = ["AsyncSteps", "SspSteps", "StepMode", "SyncSteps", "make_step_mode"]


class StepMode:
    name = ""
    #: values for the next step may travel while this one computes (async only:
    #: sync needs the token step's values, ssp's clock wait is what bounds staleness)
    pulls_ahead = False

    def __init__(self, session: Session) -> None:
        self.session = session

    async def begin(self, completed: int, poll: float) -> int:
        """Wait until the next step may start; returns its step (async, ssp: this
        worker's local step ``completed``; sync: the token's value)."""
        return completed

    def tag(self) -> int | None:
        """The step a push belongs to (sync: the token's value), or None."""
        return None

    def step_done(self) -> None:
        """This worker pushed its step's gradients (every PS answered, or a restore
        dropped them)."""

    @property
    def voided(self) -> bool:
        """A restore voided the step being computed (sync: its token)."""
        return False

    def push_asks(self) -> int | None:
        """The PS state whose reply to this step's push may bring the next token
        (sync), or None."""
        return None

    def ready(self) -> int | None:
        """The next step's value if it may start now with nothing to wait for or send
        (sync: the token the last push's reply brought), taken; else None: call
        :meth:`begin`. Called from the caller's thread, not the I/O loop."""
        return None

    def offered(self, token: tuple[int, int, int | None] | None) -> None:
        """The next token a push reply brought, as (step, generation, PS), or None."""


class AsyncSteps(StepMode):
    name = "async"
    pulls_ahead = True


class SspSteps(StepMode):
    name = "ssp"

    async def begin(self, completed: int, poll: float) -> int:
        def body() -> o.SspClock:
            return o.SspClock(self.session.who, completed, poll)

        await self.session.long_poll("ssp_clock", body, o.SspGrant, poll)
        return completed


class SyncSteps(StepMode):
    name = "sync"

    def __init__(self, session: Session, last_step: int = -1, links: Links | None = None) -> None:
        super().__init__(session)
        self.links = links
        #: the PS that hands this worker its next token (the last token named it)
        self.token_ps: int | None = None
        self.from_ps = 0  # tokens a PS handed (the others came from the chief)
        self.token: int | None = None  # the step this worker is computing
        self.token_gen = 0  # the generation the token was handed out in
        #: the step of the last token this worker computed (its earlier incarnations'
        #: when it just started)
        self.have = last_step
        self.have_gen = session.gen  # the generation ``have`` belongs to
        self._voided = False
        self.from_push = 0  # tokens a push reply brought (counted in ``from_ps`` too)
        #: the PS states that said they answer a push asking for the next token
        self.by_push: set[int] = set()
        #: the next token the last push's reply brought (step, generation, PS)
        self._next: tuple[int, int, int | None] | None = None
        session.on_restored(self._restored)

    def _restored(self, gen: int) -> None:
        self._next = None  # a token of before the restore is void
        self.have, self.have_gen = -1, gen  # the steps went back with the restore
        if self.token is not None and self.token_gen != gen:
            self.token = None  # a token of before the restore is void
            self._voided = True

    @property
    def voided(self) -> bool:
        return self._voided

    async def begin(self, completed: int, poll: float) -> int:
        def body() -> o.TakeToken:
            # made afresh for every poll: a restore meanwhile resets ``have``, and a poll
            # saying a step of before the restore would never be given a token
            return o.TakeToken(self.session.who, poll, self.have, self.have_gen)

        token = self._pushed()
        if token is None:
            token = await self._from_ps(body(), poll)
        if token is None:
            token = await self.session.long_poll("take_token", body, o.Token, poll)
        else:
            self.from_ps += 1
        self._take(token)
        return token.step

    def _take(self, token: o.Token) -> None:
        self.token_ps = token.ps
        self.token, self.token_gen, self._voided = token.step, token.gen, False

    def ready(self) -> int | None:
        token = self._pushed()
        if token is None:
            return None
        self._take(token)
        if self.session.gen != token.gen:
            # a restore heard of meanwhile (in the I/O loop, whose listener may have run
            # before the token was taken): void, as that listener would have made it
            self.token, self._voided = None, True
            return None
        self.from_ps += 1
        return token.step

    def push_asks(self) -> int | None:
        k = self.token_ps
        return k if self.token is not None and k in self.by_push else None

    def offered(self, token: tuple[int, int, int | None] | None) -> None:
        self._next = token

    def _pushed(self) -> o.Token | None:
        """The token the last push's reply brought, if it still holds: a step after the
        one this worker computed, of the generation it computed it in (a restore since
        voided it)."""
        got, self._next = self._next, None
        if got is None:
            return None
        step, gen, ps = got
        if gen != self.session.gen or gen != self.have_gen or step <= self.have:
            return None
        self.from_push += 1
        return o.Token(step, gen, ps=ps)

    async def _from_ps(self, body: o.TakeToken, poll: float) -> o.Token | None:
        """The token from the PS the last one named, or None: ask the chief."""
        k = self.token_ps
        link = None if k is None or self.links is None else self.links(k)
        if link is None:
            return None
        try:
            rep = await link.request("take_token", body.to_wire(), timeout=poll + 10.0, attempts=2)
            token = o.Token.parse(rep.body, "token")
            if token.by_push and token.ps is not None:
                self.by_push.add(token.ps)
            return token
        except NotReady:
            return None  # none released within the poll: the chief says why, or hands it
        except ZmqpsError as exc:
            log.debug("%s: no token from ps %d (%s): asking the chief", self.session.name, k, exc)
            return None

    def tag(self) -> int | None:
        if self.token is None:
            raise InvalidArgument("sync mode: call begin_step() before pushing")
        return self.token

    def step_done(self) -> None:
        # every PS has this step's gradient (a push is sent again until each answered
        # it, see Session.delivering), or a restore voided the step
        if self.token is not None and self.token > self.have:
            self.have, self.have_gen = self.token, self.token_gen


def make_step_mode(
    name: str, session: Session, last_step: int = -1, links: Links | None = None
) -> StepMode:
    """The strategy for the cluster's mode ``name`` (``links``: to the PS states, for
    sync tokens handed by a PS)."""
    if name == "sync":
        return SyncSteps(session, last_step, links)
    if name == "ssp":
        return SspSteps(session)
    if name == "async":
        return AsyncSteps(session)
    raise InvalidArgument(f"the chief runs in an unknown mode {name!r}")
