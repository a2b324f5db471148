"""A bound on the connections one server socket keeps, and file descriptors in reserve.

A server's peers cost it one file descriptor and some memory each (~25 KB of
buffers, and up to ``RCVHWM`` messages read ahead), and a server sends no ZMTP pings
(``HEARTBEAT_IVL`` 0, :mod:`zmqps.transport.options`): a peer that completes its
handshake and then stays silent is kept for good. 20,000 of them ran a chief out of
descriptors (``EMFILE`` on its checkpoint writes: it died) and stopped a PS taking
connections. So each server socket keeps at most ``max_connections``
(:data:`MAX_CONNECTIONS` unless ``SocketOptions.max_connections`` or the
``ZMQPS_MAX_CONNECTIONS`` environment variable says otherwise; 0: no bound).

How, and why this way:

* The connections are counted from the socket monitor: a set of descriptors, added
  on ``EVENT_ACCEPTED`` (its value is the descriptor) and removed on
  ``EVENT_DISCONNECTED`` (libzmq sends it for every connection it closes, a failed
  handshake included). A set heals itself when the kernel gives a closed
  connection's number to a new one. libzmq 4.3.5 never drops a monitor event: at the
  monitor pipe's high-water mark its I/O thread waits (the whole socket stalls), so
  the pipe is unbounded here (``RCVHWM`` 0 on the reading end) and read as soon as
  an event comes.
* A connection accepted past the bound is shut down (``shutdown(2)`` on its
  descriptor: libzmq sees the end of the stream, closes it and frees the descriptor;
  the descriptor is never closed behind libzmq's back). A zmqps client refused so
  reconnects after its reconnect interval (0.1 s, backing off to 2 s) and is let in
  once a connection closed. Before shutting one down, the descriptor is checked to
  be a connected TCP socket on this server's port: a number the monitor said was
  accepted but that something else got since is left alone.
* At the bound, a connection that said nothing makes room before a new one is
  refused: one client holding 4,200 idle connections shut every other client out
  until it let go. The server notes which connection each message came from
  (:meth:`Connections.heard`, the frame's ``SRCFD``); a new connection past the
  bound shuts down the oldest one that never sent a message and was accepted
  :data:`QUIET_GRACE_S` ago or more, else the one silent longest if that is
  :data:`SILENT_EVICT_S` or more, and only then is refused. A zmqps client sends its
  first request at once and keeps talking (heartbeats, pushes, polls); one shut
  down reconnects and sends its resendable requests again.
* At the bound, the set is audited first (at most once per :data:`AUDIT_EVERY_S`):
  a descriptor that is no longer a connection on this server's port is dropped
  from it. A missed disconnect therefore costs at most an audit, never a lockout.
* Not ZAP. libzmq does consult a ZAP handler for the NULL mechanism when the socket
  has a ZAP domain, and a 400 makes it send a ZMTP ERROR, but it does not close the
  connection when the peer's READY came before the ZAP reply (the usual order): a
  silent peer keeps its descriptor until ``HANDSHAKE_IVL``. It would also make every
  plaintext handshake wait on the event loop (the ZAP handler runs there), where a
  shutdown from the monitor fails open: a loop that is stuck lets connections in,
  it never locks clients out.
* :func:`reserve_descriptors`: servers raise the process's ``RLIMIT_NOFILE`` soft
  limit (up to its hard limit) to leave room for all their connections plus
  :data:`FD_RESERVE`, so that checkpoint files and imports do not meet ``EMFILE``
  because of peers; a hard limit too low for that is logged.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, KeysView
from typing import Any

import zmq

from zmqps.logs import LINES_PER_KIND, RateLimitedLog
from zmqps.wire.errors import ConfigError

__all__ = [
    "AUDIT_EVERY_S",
    "FD_RESERVE",
    "MAX_CONNECTIONS",
    "Connections",
    "default_max_connections",
    "monitor_socket",
    "release_descriptors",
    "reserve_descriptors",
]

log = logging.getLogger("zmqps.transport")

#: Connections one server socket keeps by default. A worker holds one connection to
#: the chief and one to each PS (two under CURVE with sealed bulk frames: its data
#: connection is another socket, bounded on its own), so a 1,000-worker cluster needs
#: about 1,000 on the chief; 4,096 leaves four times that, with evaluators, status
#: tools and reconnects, and costs ~100 MB of connection buffers at most.
MAX_CONNECTIONS = 4096
#: Descriptors kept for the process's own work (checkpoint files, imports, its own
#: client connections, libzmq's internal pipes) above its servers' connections.
FD_RESERVE = 1024
#: Seconds between two audits of a socket's set of connections (only at its bound).
AUDIT_EVERY_S = 1.0
#: Seconds between two log lines about refused connections on one server.
LOG_EVERY_S = 30.0
#: At the bound, a connection that never sent a message, accepted this long ago, is
#: shut down to let a new one in.
QUIET_GRACE_S = 10.0
#: At the bound, failing that, the connection silent longest is, past this long.
SILENT_EVICT_S = 60.0
#: Monitor endpoints: one per monitored socket of the process.
_MONITORS = itertools.count()


def default_max_connections() -> int:
    """``ZMQPS_MAX_CONNECTIONS`` when set (an integer, 0: no bound), else
    :data:`MAX_CONNECTIONS`."""
    text = os.environ.get("ZMQPS_MAX_CONNECTIONS", "").strip()
    if not text:
        return MAX_CONNECTIONS
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(
            f"ZMQPS_MAX_CONNECTIONS={text!r}: expected an integer (0: no bound)"
        ) from None
    return max(value, 0)


def monitor_socket(sock: zmq.Socket[Any], events: int) -> zmq.Socket[Any]:
    """A (synchronous) monitor socket of ``sock`` for ``events``, its pipe unbounded:
    libzmq's I/O thread waits at a full monitor pipe rather than dropping an event."""
    address = f"inproc://zmqps.monitor.{os.getpid()}.{next(_MONITORS)}"
    sock.monitor(address, events)
    mon: zmq.Socket[Any] = zmq.Socket(sock.context, zmq.PAIR)
    try:
        mon.setsockopt(zmq.RCVHWM, 0)
        mon.setsockopt(zmq.LINGER, 0)
        mon.connect(address)
    except BaseException:
        mon.close(linger=0)
        raise
    return mon


@contextlib.contextmanager
def _probe(fd: int) -> Iterator[socket.socket | None]:
    """A socket object on a duplicate of descriptor ``fd`` (None: not a socket any
    more); closing it closes the duplicate only, never libzmq's descriptor."""
    try:
        probe = socket.socket(fileno=os.dup(fd))
    except OSError:
        yield None
        return
    try:
        yield probe
    finally:
        probe.close()


def _ours(probe: socket.socket | None, port: int) -> bool:
    """Whether ``probe`` is a connected TCP socket whose local port is ``port`` (a
    connection accepted on this server's port, not its listener nor a client's)."""
    if probe is None or probe.type != socket.SOCK_STREAM:
        return False
    if probe.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        if probe.getsockname()[1] != port:
            return False
        probe.getpeername()  # raises ENOTCONN on a listener
    except OSError:
        return False
    return True


class Connections:
    """The connections one server socket holds (descriptors, from its monitor), and
    the bound on them (``bound`` 0: none)."""

    def __init__(
        self,
        name: str,
        bound: int,
        on_refused: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._name = name
        self.bound = bound
        self._on_refused = on_refused
        self._clock = clock
        #: the descriptors of the connections open now, each with when it was accepted,
        #: and when it last sent a message (absent: never)
        self._accepted: dict[int, float] = {}
        self._heard: dict[int, float] = {}
        self.evicted = 0
        #: the server's port (0 until bound: nothing is refused before)
        self.port = 0
        self.refused = 0
        self._audited = -AUDIT_EVERY_S
        self._log = RateLimitedLog(log, LOG_EVERY_S, lines_per_kind=LINES_PER_KIND)

    def __len__(self) -> int:
        return len(self._accepted)

    @property
    def fds(self) -> KeysView[int]:
        """The descriptors of the connections open now."""
        return self._accepted.keys()

    def accepted(self, fd: int) -> None:
        """The monitor's ``EVENT_ACCEPTED`` of descriptor ``fd``."""
        if fd < 0:
            return
        now = self._clock()
        self._accepted[fd] = now
        self._heard.pop(fd, None)  # a number closed and given again
        if not self.bound or len(self) <= self.bound or not self.port:
            return
        if now - self._audited >= AUDIT_EVERY_S:
            self._audited = now
            self.audit()
            if len(self) <= self.bound:
                return
        idle = self._idlest(fd, now)
        shut = None if idle is None else self._shut(idle)
        if idle is None or shut is False:
            self._refuse(fd)
            return
        why = "never sent a message" if idle not in self._heard else "the longest"
        self._forget(idle)  # shut down, or gone already: room for the new one
        if shut:
            self.evicted += 1
            self._log.warning(
                "%s: at its bound of %d connections: one that was silent (%s) shut"
                " down to let a new one in; %d so far",
                self._name,
                self.bound,
                why,
                self.evicted,
                key="evicted",
            )

    def is_open(self, fd: int) -> bool:
        """Whether descriptor ``fd`` is a connection on this server's port now (not
        closed, nor given to something else since)."""
        with _probe(fd) as probe:
            return _ours(probe, self.port)

    def heard(self, fd: int) -> None:
        """A message came from connection ``fd`` (its frame's ``SRCFD``)."""
        if fd in self._accepted:
            self._heard[fd] = self._clock()

    def gone(self, fd: int) -> None:
        """The monitor's ``EVENT_DISCONNECTED`` (or ``EVENT_CLOSED``) of ``fd``."""
        self._forget(fd)

    def _forget(self, fd: int) -> None:
        self._accepted.pop(fd, None)
        self._heard.pop(fd, None)

    def _idlest(self, new: int, now: float) -> int | None:
        """The connection to shut down for ``new`` (None: none may be): the oldest that
        never sent a message, past :data:`QUIET_GRACE_S`; else the one silent longest,
        past :data:`SILENT_EVICT_S`. (A scan, at the bound only.)"""
        quiet = [
            (at, fd)
            for fd, at in self._accepted.items()
            if fd != new and fd not in self._heard and now - at >= QUIET_GRACE_S
        ]
        if quiet:
            return min(quiet)[1]
        if not self._heard:
            return None
        at, fd = min((at, fd) for fd, at in self._heard.items() if fd != new)
        return fd if now - at >= SILENT_EVICT_S else None

    def audit(self) -> int:
        """Drop the descriptors that are no longer connections on this server's port
        (a missed disconnect); returns how many."""
        stale = set()
        for fd in self._accepted:
            with _probe(fd) as probe:
                if not _ours(probe, self.port):
                    stale.add(fd)
        for fd in stale:
            self._forget(fd)
        if stale:
            log.info(
                "%s: %d connections counted were gone (a missed disconnect event)",
                self._name,
                len(stale),
            )
        return len(stale)

    def _shut(self, fd: int) -> bool | None:
        """``shutdown(2)`` connection ``fd`` (libzmq sees the end and closes it): False
        when that failed, None when ``fd`` is no longer one of this server's."""
        with _probe(fd) as probe:
            if probe is None or not _ours(probe, self.port):
                return None  # closed already, its number given to something else since
            try:
                probe.shutdown(socket.SHUT_RDWR)
            except OSError as exc:
                return exc.errno == errno.ENOTCONN
        return True

    def _refuse(self, fd: int) -> None:
        self._forget(fd)  # its disconnect comes; until then it is not one we keep
        shut = self._shut(fd)
        if shut is None:
            return
        with_error = not shut
        self.refused += 1
        self._on_refused()
        self._log.warning(
            "%s: refused a connection: %d open, the bound (raise it with"
            " ZMQPS_MAX_CONNECTIONS, 0 for none, within the file limit); %d refused so far%s",
            self._name,
            self.bound,
            self.refused,
            " (its shutdown failed)" if with_error else "",
            key="refused",
        )


#: descriptors the servers of this process asked to have room for (their bounds)
_asked = 0
_warned = False


def release_descriptors(connections: int) -> None:
    """A server socket that asked :func:`reserve_descriptors` for room is closed."""
    global _asked
    _asked = max(0, _asked - connections)


def reserve_descriptors(connections: int) -> None:
    """Leave room for ``connections`` more (a server socket's bound) plus
    :data:`FD_RESERVE`: raise the ``RLIMIT_NOFILE`` soft limit toward the hard one
    (never lowered); log once when the hard limit leaves no such room."""
    global _asked, _warned
    try:
        import resource
    except ImportError:  # not on this platform
        return
    _asked += connections
    needed = _asked + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                log.info("open files limit raised from %d to %d", soft, target)
                soft = target
            except (ValueError, OSError) as exc:
                log.warning("cannot raise the open files limit from %d: %s", soft, exc)
    if soft != resource.RLIM_INFINITY and soft < needed and not _warned:
        _warned = True
        log.warning(
            "open files limit %d (hard %s) is below %d: servers' connections (%d) plus"
            " %d in reserve; peers may exhaust descriptors the process needs (raise"
            " `ulimit -n`, or lower ZMQPS_MAX_CONNECTIONS)",
            soft,
            hard,
            needed,
            _asked,
            FD_RESERVE,
        )
