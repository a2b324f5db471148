"""Log lines that cannot flood, nor be forged: one line per interval for an event that
repeats, and one line per record.

A peer that sends the same bad request in a loop, or a training loop that meets the
same bad value every few steps, must not write a line each time: the first one is
logged at once, later ones at most once per interval, each saying how many were not
logged since. Events are told apart by a key (the peer, the operation); the keys
kept are bounded (the oldest is forgotten first). Where keys come from the network
(a peer's routing id, an address), keys of one kind (a tuple key's first item, such
as ``("expired", peer)``; every other key is of one kind) write at most
``lines_per_kind`` lines per interval in all (:data:`LINES_PER_KIND` for the
transport's logs): a client that takes a new identity for every request (a new
connection each time) cannot write a line each time by being a new key each time.
Logs whose keys the code bounds (a worker's index) keep one line per key.

A record's message may hold what a peer sent (a worker's name, a reason): its
control characters (a newline, a carriage return, an escape sequence) are written
escaped (:class:`OneLineFormatter`), so a peer can never make a line of its own
appear in a log or on the operator's terminal. A traceback stays as it is.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["LINES_PER_KIND", "OneLineFormatter", "RateLimitedLog"]

#: keys remembered at most (a key forgotten logs its next event at once)
MAX_KEYS = 1024

#: lines of one kind of key per interval, whatever the keys
LINES_PER_KIND = 20


#: control characters (C0, DEL, C1 and the Unicode line breaks) -> their escapes
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))} | {
    ord("\n"): "\\n",
    ord("\r"): "\\r",
    ord("\t"): "\t",
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}


class OneLineFormatter(logging.Formatter):
    """A formatter whose every record is one line: control characters in the message
    are escaped (a tab is kept); an exception's traceback follows as usual."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = record.message.translate(_ESCAPES)
        return super().formatMessage(record)


class RateLimitedLog:
    """``logger``'s lines, at most one per ``interval`` seconds per key."""

    def __init__(
        self,
        logger: logging.Logger,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = MAX_KEYS,
        lines_per_kind: int | None = None,
    ) -> None:
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self.max_keys = max_keys
        self.lines_per_kind = lines_per_kind
        #: per key: (when its last line was logged, events not logged since)
        self._keys: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()
        #: per kind: (when its interval began, lines logged in it, events not logged
        #: for the kind's bound); kinds are the code's own names (bounded)
        self._kinds: dict[Hashable, tuple[float, int, int]] = {}

    def log(
        self, level: int, msg: str, *args: Any, key: Hashable = None, exc_info: bool = False
    ) -> bool:
        """Log ``msg % args`` unless a line of ``key`` was logged less than an interval
        ago (then it is counted, and the next line logged says how many). True if
        logged."""
        now = self.clock()
        last = self._keys.get(key)
        if last is not None and now - last[0] < self.interval:
            self._keys[key] = (last[0], last[1] + 1)
            return False
        held, held_since = 0, now
        if self.lines_per_kind is not None:
            kind = key[0] if isinstance(key, tuple) and key else None
            began, lines, held = self._kinds.get(kind, (now, 0, 0))
            held_since = began
            if now - began >= self.interval:
                began, lines = now, 0
            if lines >= self.lines_per_kind:  # this kind's lines of the interval are written
                self._kinds[kind] = (began, lines, held + 1)
                return False
            self._kinds[kind] = (began, lines + 1, 0)
        more = held + (last[1] if last is not None else 0)
        if more:
            since = now - min(last[0] if last is not None else now, held_since if held else now)
            msg += " (%d more like it in the last %.0f s)"
            args = (*args, more, since)
        self._keys[key] = (now, 0)
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def warning(self, msg: str, *args: Any, key: Hashable = None) -> bool:
        return self.log(logging.WARNING, msg, *args, key=key)

    def error(self, msg: str, *args: Any, key: Hashable = None, exc_info: bool = False) -> bool:
        return self.log(logging.ERROR, msg, *args, key=key, exc_info=exc_info)
