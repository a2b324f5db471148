"""Free TCP ports for local clusters (``zmqps launch``, the benchmarks, the tests).

A port is picked some time before its task binds it (the task is a process still
starting). A port the kernel hands out for ``bind(0)`` lies in the ephemeral range,
which every outgoing connection of the machine draws its local port from too: on a
machine that opens many connections (a client pool, a load test) one of them takes
the picked port meanwhile, and the task fails to bind ("Address already in use")
however often it is restarted. Ports are therefore picked below the ephemeral range,
at random (two launches at once rarely meet), each checked free by binding it; the
kernel's choice is the fallback when none is found there.

``ZMQPS_PORT_RANGE=LO-HI`` picks them in that range instead (a firewall's opening;
launches or test processes on one machine each given a range of their own can never
pick one another's ports: a port picked is free for some seconds before its task binds
it, and another's task taking it meanwhile joins a worker to the wrong cluster).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
from pathlib import Path

from zmqps.wire.errors import ConfigError

__all__ = ["PORT_RANGE_ENV", "free_ports", "port_range"]

#: the environment variable of the range ports are picked in (``LO-HI``, inclusive)
PORT_RANGE_ENV = "ZMQPS_PORT_RANGE"

#: the lowest port picked (below: well-known and registered services' usual ports)
LOWEST = 20000
#: the ephemeral range when the kernel does not say (Linux's default start)
EPHEMERAL_START = 32768
#: ports tried below the ephemeral range before the kernel picks
ATTEMPTS = 64


def _ephemeral_start() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_START


def port_range() -> tuple[int, int, bool]:
    """The ports picked from, ``[lo, hi)``, and whether they are the only ones (given
    by ``ZMQPS_PORT_RANGE``: no fallback to the kernel's choice)."""
    text = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not text:
        return LOWEST, _ephemeral_start(), False
    lo_text, sep, hi_text = text.partition("-")
    try:
        lo, hi = int(lo_text), int(hi_text)
    except ValueError:
        lo = hi = -1
    if not sep or not 1 <= lo <= hi <= 65535:
        raise ConfigError(
            f"{PORT_RANGE_ENV}={text!r}: expected LO-HI, two ports 1-65535 (e.g. 40000-40999)"
        )
    return lo, hi + 1, True


def _bound(host: str, port: int) -> socket.socket | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free TCP ports on ``host`` (held open together while picking),
    below the ephemeral range where it leaves room, or in ``ZMQPS_PORT_RANGE``."""
    socks: list[socket.socket] = []
    lowest, top, only = port_range()
    rng = random.SystemRandom()
    try:
        tries = 0
        while len(socks) < n:
            port = 0
            if (only or top - lowest > 4 * n) and tries < ATTEMPTS * n:
                tries += 1
                port = rng.randrange(lowest, top)
            elif only:
                raise OSError(
                    f"no {n} free TCP ports on {host} in {PORT_RANGE_ENV}={lowest}-{top - 1}"
                )
            s = _bound(host, port)
            if s is None:
                if port == 0:
                    raise OSError(f"no free TCP port on {host}")
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()
