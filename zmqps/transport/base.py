"""The transport contract shared by the ZeroMQ transport and the in-memory fake.

A server is given a :data:`Handler`; a client offers :class:`Requester`. Roles
depend on these two shapes only, so tests can swap the fake in.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from zmqps.wire import Message, Tensor
from zmqps.wire.errors import Busy, ShutdownError, ZmqpsError

__all__ = [
    "BUSY_PAUSE_S",
    "Handler",
    "Requester",
    "TransportObserver",
    "TransportStats",
    "cancel_and_wait",
    "retry_busy",
    "send_soon",
    "unless_set",
]

#: the first pause before a request answered ``busy`` is sent again (then doubled,
#: at most 1 s)
BUSY_PAUSE_S = 0.05

log = logging.getLogger("zmqps.transport")


async def retry_busy(send: Callable[[float], Awaitable[Message]], timeout: float) -> Message:
    """``send(seconds left)`` until it is not answered ``busy``, within ``timeout``.

    A server answers ``busy`` when its pending requests are at their bound, having
    done nothing, so sending the request again is always safe: a client rides out
    another peer's flood instead of failing (the last ``busy`` is raised when the
    time is up)."""
    end = time.monotonic() + timeout
    pause = BUSY_PAUSE_S
    left = timeout  # the first send has all of it (its deadline error names it)
    while True:
        try:
            return await send(left)
        except Busy:
            if end - time.monotonic() <= pause:
                raise
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)
            left = max(end - time.monotonic(), 0.001)


def send_soon(
    requester: Requester,
    op: str,
    body: Mapping[str, Any] | None = None,
    tensors: Sequence[Tensor] = (),
    *,
    timeout: float | None = None,
) -> asyncio.Future[Message]:
    """The future of the reply to one request, sent before this returns when the
    requester can (the ZeroMQ client's ``submit``), else by a task on the loop's
    next turn (the in-memory fake). A failure to send is the future's error, never
    raised here (a :class:`ShutdownError` when it is not a ZmqpsError)."""
    submit = getattr(requester, "submit", None)
    if submit is None:
        return asyncio.ensure_future(requester.request(op, body, tensors, timeout=timeout))
    try:
        fut: asyncio.Future[Message] = submit(op, body, tensors, timeout=timeout)
    except Exception as exc:  # never raised here: a caller may go on before it looks
        if not isinstance(exc, ZmqpsError):
            log.warning("%s to %s: not sent: %r", op, getattr(requester, "endpoint", "?"), exc)
            exc = ShutdownError(f"{op}: not sent: {exc}")
        fut = asyncio.get_running_loop().create_future()
        fut.set_exception(exc)
    return fut


class Handler(Protocol):
    """Serves one decoded request; returns the reply, or an awaitable of it.

    Raising a :class:`~zmqps.errors.ZmqpsError` becomes an error reply with its
    code; any other exception becomes an ``internal`` error reply (and is logged).
    """

    def __call__(self, msg: Message) -> Message | Awaitable[Message]: ...


class TransportObserver(Protocol):
    """Told about every served request (e.g. :class:`zmqps.metrics.Metrics`).

    ``status`` is ``ok`` or the error reply's code; called once per request, so
    implementations must be cheap.
    """

    def request_done(self, op: str, status: str, seconds: float) -> None: ...

    def bytes_in(self, n: int) -> None: ...

    def bytes_out(self, n: int) -> None: ...

    def auth_failure(self, reason: str) -> None:
        """A client was refused: ``refused`` (its key is not allowed) or ``handshake``
        (the CURVE handshake failed: a plaintext client or a wrong server key)."""

    def connection_refused(self) -> None:
        """A connection was shut down at once: its server socket held its bound
        (``transport/connections.py``)."""

    def seal_refused(self, reason: str) -> None:
        """A sealed message was refused (``transport/seal.py``): ``malformed``,
        ``unknown_key``, ``tampered``, ``replayed`` or ``exhausted``."""


class Requester(Protocol):
    """A client bound to one peer: many requests in flight, replies matched by id."""

    @property
    def endpoint(self) -> str: ...

    async def request(
        self,
        op: str,
        body: Mapping[str, Any] | None = None,
        tensors: Sequence[Tensor] = (),
        *,
        timeout: float | None = None,
        attempts: int = 1,
        slot: int | None = None,
    ) -> Message: ...

    async def close(self) -> None: ...


@dataclass
class TransportStats:
    """Counters a transport keeps; the metrics layer reads them."""

    requests: int = 0
    replies: int = 0
    errors: int = 0
    bad_messages: int = 0
    expired: int = 0
    unroutable: int = 0
    late_replies: int = 0
    timeouts: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    auth_failures: int = 0
    #: sealed messages refused: not authentic, replayed or reordered, of an unknown
    #: key, or a key that could seal no more (``transport/seal.py``)
    seal_refusals: int = 0
    #: messages sent sealed on the data connection (under CURVE)
    sealed: int = 0
    #: buffers of sealed replies opened straight into where their caller copies them
    landed: int = 0
    #: requests sent again when their connection came back (Client)
    resent: int = 0
    #: requests refused because too many of the peer's (or all) were pending (Server)
    busy: int = 0
    #: long polls dropped because the connection they came on closed (Server)
    gone: int = 0
    #: connections shut down at once because the server socket held its bound (Server)
    conn_refusals: int = 0
    by_op: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


T = TypeVar("T")

if sys.version_info >= (3, 11):

    async def within(aw: Awaitable[T], timeout: float) -> T:
        """``aw``'s result, or ``asyncio.TimeoutError`` past ``timeout`` seconds (``aw``
        then cancelled), as ``asyncio.wait_for``; but a cancellation of the caller is
        never lost. ``wait_for`` before Python 3.12 returned ``aw``'s result instead
        when ``aw`` ended in the loop turn its caller was cancelled in: a handler, a
        heartbeat loop or a request told to stop went on (a fault-schedule test saw a
        push's handler wait a whole minute for a backup after its client gave up)."""
        async with asyncio.timeout(timeout):
            return await aw

else:  # pragma: no cover - Python 3.10

    async def within(aw: Awaitable[T], timeout: float) -> T:
        """As above, without ``asyncio.timeout``."""
        task = asyncio.ensure_future(aw)
        try:
            await asyncio.wait((task,), timeout=max(0.0, timeout))
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
            if not task.cancelled() and task.exception() is None:
                return task.result()  # it ended as it was cancelled
            raise asyncio.TimeoutError
        return task.result()


async def waited(aw: Awaitable[Any], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``aw`` (:func:`within`): True when it ended,
    False when the time was up (its result is not needed: an event set, a future
    done)."""
    try:
        await within(aw, timeout)
    except asyncio.TimeoutError:
        return False
    return True


async def unless_set(
    event: asyncio.Event, step: Awaitable[T], *also: type[BaseException]
) -> tuple[bool, T | None]:
    """(True, ``step``'s result), or (False, None) with the step cancelled (and waited
    for, its errors ``also`` taken, see :func:`cancel_and_wait`) when ``event`` is set
    first. The caller cancelled meanwhile: the step is cancelled (and waited for) too."""
    running = asyncio.ensure_future(step)
    waiting = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait([running, waiting], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await cancel_and_wait(running, *also)
        raise
    finally:
        waiting.cancel()
    if running.done():
        return True, running.result()
    await cancel_and_wait(running, *also)
    return False, None


async def cancel_and_wait(task: asyncio.Future[Any], *also: type[BaseException]) -> None:
    """Cancel ``task`` and wait until it has ended; its ``CancelledError`` (and the
    exceptions ``also``) is taken. Unless the caller itself was cancelled while it
    waited: then the caller's ``CancelledError`` goes on. (``with
    suppress(CancelledError): await task`` took both, so a loop cancelled while it
    waited for a helper went on running: a task that could not be cancelled, and a
    shutdown that waited for it for ever.) A caller already being cancelled when it
    calls (a ``finally`` cleaning up) is not stopped by its own earlier cancellation."""
    me = asyncio.current_task()
    cancelling = getattr(me, "cancelling", None)  # Python 3.11+
    before = cancelling() if cancelling is not None else 0
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if cancelling is not None and cancelling() > before:
            raise
    except also:
        pass
