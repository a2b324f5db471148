"""Shared-memory regions for the same-host fast path.

When a worker and a PS share a machine, tensor bytes move through a region of
shared memory that both map, and ZeroMQ carries only the small control
messages (DESIGN §9: beat torch RPC's same-host copies).

Rules of this module:

* The client creates a region (``/dev/shm/zmqps-<its pid><random>``, 32 hex digits,
  mode 0600,
  space reserved with ``posix_fallocate`` so a full ``/dev/shm`` is an error at
  creation, never a SIGBUS later) and writes a random token at its start.
* The server attaches by name only if the name has exactly that form, the file
  is a regular file owned by the server's own user, and its size is the size
  announced; it answers with the token it read, which proves both sides see the
  same memory. Then the client unlinks the name: the mapping lives on in both
  processes and nothing leaks if either dies. A client killed between creating a
  region and unlinking it leaves the name behind: :func:`sweep` removes the regions
  of this user whose creator is gone (a worker does it before it creates its own,
  ``zmqps launch`` when its children have exited).
* Every access is bounds-checked against the region's size by :meth:`Region.view`.
* Anything that fails (another host, another container's ``/dev/shm``, no space)
  means "no fast path": callers fall back to TCP.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.wire.errors import InvalidArgument, NotFound

__all__ = ["SHM_DIR", "TOKEN_BYTES", "Region", "attach_region", "create_region", "sweep"]

SHM_DIR = "/dev/shm"
TOKEN_BYTES = 16
HEADER_BYTES = 64  # token + padding: data starts cache-line aligned
_NAME = re.compile(r"zmqps-[0-9a-f]{32}")


@dataclass
class Region:
    name: str
    size: int
    token: bytes
    _mmap: mmap.mmap

    @property
    def data_bytes(self) -> int:
        return self.size - HEADER_BYTES

    def view(self, offset: int, dtype: np.dtype[Any], count: int) -> npt.NDArray[Any]:
        """``count`` elements of ``dtype`` at data byte ``offset`` (bounds-checked, aligned)."""
        nbytes = count * dtype.itemsize
        if offset < 0 or count < 0 or offset % dtype.itemsize or offset + nbytes > self.data_bytes:
            raise InvalidArgument(
                f"shm region {self.name}: [{offset}, {offset + nbytes}) outside"
                f" [0, {self.data_bytes}) or misaligned"
            )
        return np.frombuffer(self._mmap, dtype=dtype, count=count, offset=HEADER_BYTES + offset)

    def close(self) -> None:
        # BufferError: arrays still view it; the mapping goes when they do.
        with contextlib.suppress(BufferError):
            self._mmap.close()


def create_region(data_bytes: int) -> Region:
    """A new region with ``data_bytes`` of room (OSError if shared memory is unavailable)."""
    name = f"zmqps-{os.getpid() & 0xFFFFFFFF:08x}{secrets.token_hex(12)}"
    size = HEADER_BYTES + max(0, data_bytes)
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.unlink(path)
            raise
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    token = secrets.token_bytes(TOKEN_BYTES)
    mm[:TOKEN_BYTES] = token
    return Region(name, size, token, mm)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def sweep(directory: str = SHM_DIR) -> list[str]:
    """Remove the regions this user's dead processes left (their creator's pid is in
    the name); returns their names. A region of a live process is never touched."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        if not _NAME.fullmatch(name) or _alive(int(name[6:14], 16)):
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid == uid:
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue
    return removed


def unlink_region(region: Region) -> None:
    """Remove the region's name (both mappings stay valid)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, region.name))


def attach_region(name: str, size: int, *, max_bytes: int) -> Region:
    """Map the region a client created. NotFound when it is not visible from here."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgument("shm: bad region name")
    if not HEADER_BYTES <= size <= max_bytes:
        raise InvalidArgument(f"shm: region size {size} outside [{HEADER_BYTES}, {max_bytes}]")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
    except OSError as exc:
        raise NotFound(f"shm region {name} not visible here ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != size:
            raise InvalidArgument(f"shm region {name}: not a {size}-byte file of this user")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return Region(name, size, bytes(mm[:TOKEN_BYTES]), mm)
