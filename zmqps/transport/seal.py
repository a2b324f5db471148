"""Sealed bulk frames: AES-256-GCM with per-connection keys agreed over CURVE (sans-IO).

Under CURVE, a client and a server agree on a session over the authenticated,
encrypted CURVE connection (``seal_hello``: each side sends 32 random bytes; the
server names the session with an 8-byte key id). Both derive two 256-bit keys
with HKDF-SHA256 from the two random strings (:func:`derive`): one per direction.
Bulk requests and their replies then travel on a second, plaintext TCP
connection, every frame sealed:

    frame = key id (8) | counter (8, big-endian) | AES-256-GCM(frame bytes) | tag (16)

* The nonce is 4 zero bytes and the 64-bit counter. A :class:`Sealer` hands out
  each counter once, in order, per key (a key seals one direction of one session),
  so no nonce is ever used twice with a key; it refuses (:class:`SealRefused`
  ``exhausted``) before the counter wraps, and the client agrees a new session
  long before (:data:`REKEY_AFTER`).
* The associated data is the frame's 16-byte prefix, its index in its message
  and the message's count of frames: a frame moved, dropped from or added to a
  message fails its tag.
* A message's frames have consecutive counters (a sealer seals a message at once).
  An :class:`Opener` takes a message only if its first counter is past the last
  counter it accepted and the others follow it: a replayed frame or one that comes
  after a later one is refused (``replayed``), frames of several messages put
  together are not authentic (``tampered``: with the index and count in the tag,
  only a whole message sealed as such opens); a gap between two messages (one
  dropped on the way) is allowed. Nothing is accepted, and no counter moves, until every
  frame of the message authenticates.
* Every refusal is a :class:`SealRefused` with a ``reason``: ``malformed``,
  ``unknown_key``, ``tampered``, ``replayed``, ``exhausted``.
* The data connection itself is admitted at its ZeroMQ handshake (PLAIN, checked by
  the ZAP handler): the username is the session's key id in hex, the password a
  credential HKDF derives from the same secret under its own label
  (:func:`credential`; never one of the AEAD keys, which nothing can compute from
  it). :meth:`Keyring.admit` checks it, in constant time, against the live
  sessions: a peer without one sends nothing there, not a single frame.

Nothing here does IO: the transport's client and server call it.
"""

from __future__ import annotations

import hmac
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from zmqps.wire.errors import ProtocolError

__all__ = [
    "KEY_ID_BYTES",
    "MAX_SESSIONS",
    "MAX_SESSIONS_PER_PEER",
    "NOTICE",
    "OVERHEAD",
    "RANDOM_BYTES",
    "REASONS",
    "REKEY_AFTER",
    "Keyring",
    "Opener",
    "SealRefused",
    "Sealer",
    "Session",
    "credential",
    "derive",
]

KEY_ID_BYTES = 8
RANDOM_BYTES = 32
_PREFIX = struct.Struct(">8sQ")
_AAD_TAIL = struct.Struct(">II")
TAG_BYTES = 16
#: bytes a sealed frame has over its plaintext
OVERHEAD = _PREFIX.size + TAG_BYTES
#: the last counter a key may seal with is ``COUNTER_LIMIT - 1`` (a 64-bit counter
#: never wraps: the sealer refuses first)
COUNTER_LIMIT = 2**64 - 1
#: frames a client seals with one key before it agrees a new session (far below the
#: counter's limit and below AES-GCM's per-key bounds for 4 MiB frames)
REKEY_AFTER = 2**32
#: sessions a server holds at once, and per peer (allow-list name): past either the
#: least recently used one (of that peer first) is forgotten; its frames are then
#: refused ``unknown_key`` and its client agrees a new one
MAX_SESSIONS = 4096
MAX_SESSIONS_PER_PEER = 64
#: first frame of a server's plaintext answer to a refused sealed message:
#: ``[NOTICE, key id, reason]`` (not authenticated: a client only logs and counts it,
#: and agrees a new session)
NOTICE = b"zmqps-seal-refused"
REASONS = ("malformed", "unknown_key", "tampered", "replayed", "exhausted")
_INFO = b"zmqps seal v1 "
#: HKDF's label of the data connection's PLAIN password (not a key's: see above)
_CREDENTIAL_INFO = b"zmqps seal v1 data-credential"
#: the version of ``cryptography`` seals into and opens into a given buffer (no copy)
_INTO = hasattr(AESGCM, "encrypt_into") and hasattr(AESGCM, "decrypt_into")


def _opens_in_place() -> bool:
    """Whether this ``cryptography`` opens a frame into its own bytes (``decrypt_into``
    with the plaintext at the ciphertext's start): releases 47 to 50 let OpenSSL do
    it; 51 refuses any overlap (``ValueError``), and a frame is then opened into a
    buffer of its own. (Before 47 there is no ``decrypt_into``.)"""
    if not _INTO:
        return False
    aead, nonce = AESGCM(bytes(32)), bytes(12)
    buf = memoryview(bytearray(aead.encrypt(nonce, b"\x5a" * 16, b"")))
    try:
        aead.decrypt_into(nonce, buf, b"", buf[:16])
    except (ValueError, TypeError):
        return False
    return bytes(buf[:16]) == b"\x5a" * 16


#: a received frame is opened in place (else into a buffer of its own)
_IN_PLACE = _opens_in_place()


class SealRefused(ProtocolError):
    """A sealed message refused (or a key that can seal no more): ``reason`` is one
    of :data:`REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"sealed frame refused ({reason}): {message}")
        self.reason = reason


def derive(client_random: bytes, server_random: bytes, key_id: bytes) -> tuple[bytes, bytes]:
    """The session's two keys: (client to server, server to client)."""
    if len(client_random) != RANDOM_BYTES or len(server_random) != RANDOM_BYTES:
        raise ValueError(f"each side contributes {RANDOM_BYTES} random bytes")
    out = []
    for direction in (b"c2s", b"s2c"):
        hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=key_id, info=_INFO + direction)
        out.append(hkdf.derive(client_random + server_random))
    return out[0], out[1]


def credential(client_random: bytes, server_random: bytes, key_id: bytes) -> bytes:
    """The session's credential for the data connection's handshake (PLAIN password,
    sent in hex): HKDF-SHA256 of the same secret as :func:`derive`, its own label."""
    if len(client_random) != RANDOM_BYTES or len(server_random) != RANDOM_BYTES:
        raise ValueError(f"each side contributes {RANDOM_BYTES} random bytes")
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=key_id, info=_CREDENTIAL_INFO)
    return hkdf.derive(client_random + server_random)


def _nonce(counter: int) -> bytes:
    return b"\0\0\0\0" + counter.to_bytes(8, "big")


def _flat(frame: Any) -> memoryview:
    view = frame if isinstance(frame, memoryview) else memoryview(frame)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B") if view.nbytes else memoryview(b"")
    return view


class Sealer:
    """Seals the frames of one direction of one session with its key."""

    def __init__(self, key: bytes, key_id: bytes, limit: int = COUNTER_LIMIT) -> None:
        if len(key_id) != KEY_ID_BYTES:
            raise ValueError(f"a key id is {KEY_ID_BYTES} bytes")
        self._aead = AESGCM(key)
        self.key_id = key_id
        #: the counter the next frame is sealed with (each used once, never again)
        self.next = 0
        self.limit = min(limit, COUNTER_LIMIT)

    def seal(self, frames: Sequence[Any]) -> list[npt.NDArray[np.uint8]]:
        """One message's frames sealed, in order (raises ``exhausted`` rather than
        reach the counter's limit)."""
        n = len(frames)
        if self.next + n > self.limit:
            raise SealRefused("exhausted", f"key {self.key_id.hex()} has sealed {self.next} frames")
        out = []
        for i, frame in enumerate(frames):
            counter = self.next
            self.next = counter + 1
            view = _flat(frame)
            prefix = _PREFIX.pack(self.key_id, counter)
            # not zeroed (a bytearray is: one more pass over the bytes)
            sealed = np.empty(_PREFIX.size + view.nbytes + TAG_BYTES, np.uint8)
            sealed[: _PREFIX.size] = np.frombuffer(prefix, np.uint8)
            aad = prefix + _AAD_TAIL.pack(i, n)
            if _INTO:
                self._aead.encrypt_into(_nonce(counter), view, aad, sealed.data[_PREFIX.size :])
            else:  # pragma: no cover - cryptography without encrypt_into
                sealed[_PREFIX.size :] = np.frombuffer(
                    self._aead.encrypt(_nonce(counter), view, aad), np.uint8
                )
            out.append(sealed)
        return out


def key_id_of(frame: Any) -> bytes | None:
    """The key id a sealed frame names (None: too short to be one)."""
    view = _flat(frame)
    if view.nbytes < OVERHEAD:
        return None
    return bytes(view[:KEY_ID_BYTES])


class Opener:
    """Opens the frames of one direction of one session: authenticated, each counter
    past the last one accepted."""

    def __init__(self, key: bytes, key_id: bytes) -> None:
        self._aead = AESGCM(key)
        self.key_id = key_id
        #: the highest counter accepted so far (-1: none)
        self.last = -1

    def open(
        self,
        frames: Sequence[Any],
        land: Callable[[memoryview], Sequence[Any]] | None = None,
    ) -> list[memoryview]:
        """The plaintext of one message's sealed frames, or :class:`SealRefused`
        (nothing accepted: the counter does not move). A writable frame (a received
        ZeroMQ frame) is opened in place where this ``cryptography`` allows it
        (:data:`_IN_PLACE`): its plaintext is a view of it, nothing is copied, and a
        refused message's writable frames are left garbled; else each frame is
        opened into a buffer of its own.

        ``land``, given the first frame's plaintext (a header), may name where each
        later frame is opened instead (a writable buffer of exactly its plaintext's
        size, or None): where its bytes would be copied to anyway. Such a buffer holds
        the bytes of a frame that did not authenticate when the message is refused."""
        n = len(frames)
        if n == 0:
            raise SealRefused("malformed", "an empty message")
        out: list[memoryview] = []
        last = self.last
        dests: Sequence[Any] = ()
        for i, frame in enumerate(frames):
            if i == 1 and land is not None:
                try:
                    dests = land(out[0])
                except ProtocolError:
                    dests = ()  # the header is refused whole later, where it is decoded
            view = _flat(frame)
            if view.nbytes < OVERHEAD:
                raise SealRefused("malformed", f"frame {i} of {view.nbytes} bytes")
            key_id, counter = _PREFIX.unpack_from(view)
            if key_id != self.key_id:
                raise SealRefused("unknown_key", f"frame {i} names key {key_id.hex()}")
            if counter <= last:
                raise SealRefused(
                    "replayed",
                    f"frame {i} has counter {counter}, not past {last} (replayed or reordered)",
                )
            if i and counter != last + 1:  # a message's frames have consecutive counters
                raise SealRefused("tampered", f"frame {i} (counter {counter}) is not after {last}")
            aad = bytes(view[: _PREFIX.size]) + _AAD_TAIL.pack(i, n)
            body = view[_PREFIX.size :]
            dest = dests[i - 1] if 0 < i <= len(dests) else None
            if dest is not None:
                dest = _flat(dest)
                if dest.readonly or dest.nbytes != view.nbytes - OVERHEAD:
                    dest = None
            try:
                if _INTO and dest is not None:
                    plain = dest
                    self._aead.decrypt_into(_nonce(counter), body, aad, plain)
                elif _IN_PLACE and not view.readonly:  # same start: OpenSSL allows it
                    plain = view[_PREFIX.size : view.nbytes - TAG_BYTES]
                    self._aead.decrypt_into(_nonce(counter), body, aad, plain)
                elif _INTO:  # a buffer of its own, not zeroed first (written whole)
                    plain = np.empty(view.nbytes - OVERHEAD, np.uint8).data
                    self._aead.decrypt_into(_nonce(counter), body, aad, plain)
                else:  # pragma: no cover - cryptography without decrypt_into
                    plain = memoryview(self._aead.decrypt(_nonce(counter), body, aad))
            except InvalidTag:
                raise SealRefused("tampered", f"frame {i} (counter {counter})") from None
            last = counter
            out.append(plain)
        self.last = last
        return out


@dataclass
class Session:
    """A server's side of one agreed session."""

    key_id: bytes
    #: the allow-list name of the client that agreed it (its requests are that peer's)
    peer: str
    opener: Opener
    sealer: Sealer
    #: the data connection's PLAIN password for this session (:func:`credential`, hex)
    password: bytes = b""


#: what an unknown key id's password is compared with (no credential is 65 bytes)
_NO_PASSWORD = b"-" * 65


class Keyring:
    """A server's sessions by key id, bounded (:data:`MAX_SESSIONS`, and
    :data:`MAX_SESSIONS_PER_PEER` per peer; the least recently used goes first)."""

    def __init__(
        self, max_sessions: int = MAX_SESSIONS, max_per_peer: int = MAX_SESSIONS_PER_PEER
    ) -> None:
        self.max_sessions = max_sessions
        self.max_per_peer = max_per_peer
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()
        self._by_peer: dict[str, OrderedDict[bytes, None]] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def agree(self, peer: str, client_random: bytes) -> tuple[bytes, bytes]:
        """A new session for ``peer``: ``(key id, the server's random bytes)``."""
        server_random = os.urandom(RANDOM_BYTES)
        key_id = os.urandom(KEY_ID_BYTES)
        while key_id in self._sessions:  # pragma: no cover - 2^-64
            key_id = os.urandom(KEY_ID_BYTES)
        c2s, s2c = derive(client_random, server_random, key_id)
        mine = self._by_peer.setdefault(peer, OrderedDict())
        if len(mine) >= self.max_per_peer:
            self.forget(next(iter(mine)))
        if len(self._sessions) >= self.max_sessions:
            self.forget(next(iter(self._sessions)))
        password = credential(client_random, server_random, key_id).hex().encode()
        self._sessions[key_id] = Session(
            key_id, peer, Opener(c2s, key_id), Sealer(s2c, key_id), password
        )
        self._by_peer.setdefault(peer, mine)[key_id] = None
        return key_id, server_random

    def forget(self, key_id: bytes) -> None:
        session = self._sessions.pop(key_id, None)
        if session is None:
            return
        mine = self._by_peer.get(session.peer)
        if mine is not None:
            mine.pop(key_id, None)
            if not mine:
                del self._by_peer[session.peer]

    def admit(self, username: bytes, password: bytes) -> Session | None:
        """The live session a data connection's PLAIN credentials name (username: its
        key id in hex; password: its :func:`credential` in hex), or None. The password
        is compared in constant time (against a dummy when no session has that id)."""
        try:
            key_id = bytes.fromhex(username.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            key_id = b""
        session = self._sessions.get(key_id) if len(key_id) == KEY_ID_BYTES else None
        expected = session.password if session is not None else _NO_PASSWORD
        if hmac.compare_digest(expected, password) and session is not None:
            return session
        return None

    def retire(self, peer: str, key_id: bytes) -> bool:
        """Forget session ``key_id`` if ``peer`` agreed it (its client replaced it)."""
        session = self._sessions.get(key_id)
        if session is None or session.peer != peer:
            return False
        self.forget(key_id)
        return True

    def open(self, frames: Sequence[Any]) -> tuple[Session, list[memoryview]]:
        """The session a sealed message belongs to, and its plaintext frames."""
        if not frames:
            raise SealRefused("malformed", "an empty message")
        key_id = key_id_of(frames[0])
        if key_id is None:
            raise SealRefused("malformed", "a frame too short to be sealed")
        session = self._sessions.get(key_id)
        if session is None:
            raise SealRefused("unknown_key", f"no session {key_id.hex()}")
        plain = session.opener.open(frames)
        self._sessions.move_to_end(key_id)
        self._by_peer[session.peer].move_to_end(key_id)
        return session, plain
