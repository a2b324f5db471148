"""One error hierarchy for zmqps.

Rule: errors are translated at exactly one boundary each.

* A bad request becomes an error *reply* in the server (``transport.server``):
  every :class:`ZmqpsError` carries a stable ``code`` that travels on the wire.
* An error reply becomes a typed exception in the client (``transport.client``)
  via :func:`error_from_code`.

Nothing else in zmqps catches broad exceptions to hide them.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "EXIT_CONFIG",
    "EXIT_RUN_FAILED",
    "Busy",
    "ConfigError",
    "DeadlineExceeded",
    "FencedError",
    "FunctionError",
    "InvalidArgument",
    "ModelMismatch",
    "NonFiniteGradient",
    "NotFound",
    "NotPrimary",
    "NotReady",
    "ProtocolError",
    "RemoteError",
    "RolledBack",
    "RunFailed",
    "ShutdownError",
    "Superseded",
    "ZmqpsError",
    "closest",
    "did_you_mean",
    "error_from_code",
]


class ZmqpsError(Exception):
    """Base class of every error zmqps raises on purpose."""

    code = "internal"


class ProtocolError(ZmqpsError):
    """A message violates the wire contract (framing, limits, schema, dtypes)."""

    code = "protocol"


class InvalidArgument(ZmqpsError):
    """A well-formed request asks for something impossible (bad shape, unknown optimizer...)."""

    code = "invalid_argument"


class NonFiniteGradient(InvalidArgument):
    """A pushed gradient holds NaN, an infinity, or a value so large that an update
    could overflow (``zmqps.core.finite.LIMITS``): the PS refused it before changing
    anything. The push's step was not trained; the worker goes on with its next batch
    (see the worker's ``--on-nonfinite``)."""

    code = "non_finite"


class NotFound(ZmqpsError):
    """A request names a shard, variable or task that does not exist."""

    code = "not_found"


class NotPrimary(NotFound):
    """The process holds only a backup of the PS state the request is for: send it to
    that state's primary (the placement's newer epoch names it)."""

    code = "not_primary"


class Superseded(NotPrimary):
    """A primary's entry or copy reached a copy that is the state's primary at a newer
    term: the sender was replaced (a fail-over while it was cut off or stopped). It
    stops shipping and refuses what would change the state (``not_primary``)."""

    code = "superseded"


class NotReady(ZmqpsError):
    """The cluster is not in a state to serve this yet (e.g. variables not created)."""

    code = "not_ready"


class FencedError(ZmqpsError):
    """A request comes from an old incarnation that has been replaced."""

    code = "fenced"


class ShutdownError(ZmqpsError):
    """The peer is shutting down or the client was closed."""

    code = "shutdown"


class RolledBack(ZmqpsError):
    """The cluster restored a checkpoint since the request's generation: what the
    request was based on (pulled values, a sync token) is gone. Re-pull (and, in sync
    mode, take a new token); do not retry the same push."""

    code = "rolled_back"


class DeadlineExceeded(ZmqpsError):
    """No reply arrived before the request's deadline."""

    code = "deadline_exceeded"


class Busy(ZmqpsError):
    """Too many requests of this peer (or of all peers) are pending on the server
    (long polls, waits): the new one is refused, nothing was done. Retry later."""

    code = "busy"


class FunctionError(ZmqpsError):
    """A scheduled function (coordinator mode) raised on the worker that ran it. The
    message is ``"ExceptionType: text"`` and then the tail of the worker's traceback."""

    code = "function_error"

    @property
    def exc_type(self) -> str:
        """The class name of the exception the function raised (e.g. ``ValueError``)."""
        return str(self).split(":", 1)[0]


class ModelMismatch(InvalidArgument):
    """Variables were asked for that differ from those the cluster holds (another
    model: a task with other job flags, a checkpoint of another model)."""

    code = "model_mismatch"


class ConfigError(ZmqpsError):
    """The cluster spec or command line is invalid; the message is one clear line."""

    code = "config"


class RunFailed(ZmqpsError):
    """The run ended in order but failed a check of its own (e.g. more of its steps
    had non-finite gradients than ``--max-nonfinite-share`` allows): the process exits
    with :data:`EXIT_RUN_FAILED`, which a supervisor must not retry."""

    code = "run_failed"


#: exit codes a task's supervisor never retries: the same task would fail the same way
EXIT_CONFIG = 2
EXIT_RUN_FAILED = 3


class RemoteError(ZmqpsError):
    """An error reply whose code is not one of ours (e.g. an internal server error)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


_BY_CODE: dict[str, type[ZmqpsError]] = {
    cls.code: cls
    for cls in (
        ProtocolError,
        InvalidArgument,
        NonFiniteGradient,
        ModelMismatch,
        ConfigError,
        NotFound,
        NotPrimary,
        Superseded,
        NotReady,
        FencedError,
        RolledBack,
        ShutdownError,
        DeadlineExceeded,
        Busy,
        FunctionError,
    )
}


def error_from_code(code: str, message: str) -> ZmqpsError:
    """Turn an error reply (code, message) into the matching typed exception."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return RemoteError(code, message)
    return cls(message)


#: how alike a mistyped word and a valid one must be to be suggested (difflib's ratio)
CUTOFF = 0.6
#: at most this many suggestions, each about as close as the best (within this ratio)
MAX_SUGGESTIONS = 3
AS_CLOSE = 0.1


def closest(word: str, candidates: Iterable[str]) -> list[str]:
    """The candidates closest to ``word``, compared without case: the best, and up to
    :data:`MAX_SUGGESTIONS` in all that are about as close; none when nothing is alike.
    What every "did you mean" of zmqps suggests (flags, choices, roles, names)."""
    folded: dict[str, str] = {}
    for c in candidates:
        folded.setdefault(c.lower(), c)  # the first spelling of each wins
    scored = []
    for key, c in folded.items():
        matcher = difflib.SequenceMatcher(None, word.lower(), key)
        if matcher.real_quick_ratio() >= CUTOFF and matcher.quick_ratio() >= CUTOFF:
            ratio = matcher.ratio()
            if ratio >= CUTOFF:
                scored.append((-ratio, c))
    scored.sort()
    if not scored:
        return []
    best = -scored[0][0]
    return [c for r, c in scored[:MAX_SUGGESTIONS] if -r >= best - AS_CLOSE]


def did_you_mean(word: str, candidates: Iterable[str], quote: bool = False) -> str:
    """``"; did you mean X?"`` (or ``X or Y``) for the candidates closest to ``word``
    (``quote``: each as its repr), or an empty string when none is close."""
    found = closest(word, candidates)
    if not found:
        return ""
    shown = [repr(f) if quote else f for f in found]
    return f"; did you mean {' or '.join(shown)}?"
