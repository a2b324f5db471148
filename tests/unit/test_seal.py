"""The sealing layer of bulk frames under CURVE (``zmqps/transport/seal.py``), sans-IO:
what it refuses (tampered, replayed, reordered, another key's, malformed), that no
nonce repeats, that a key refuses before its counter wraps, and the server's bounded
sessions."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from zmqps.transport import seal
from zmqps.transport.seal import (
    COUNTER_LIMIT,
    OVERHEAD,
    Keyring,
    Opener,
    Sealer,
    SealRefused,
    credential,
    derive,
)


def pair(limit: int = COUNTER_LIMIT) -> tuple[Sealer, Opener]:
    c2s, _ = derive(os.urandom(32), os.urandom(32), b"k" * 8)
    return Sealer(c2s, b"k" * 8, limit), Opener(c2s, b"k" * 8)


def frames() -> list[object]:
    return [b"header", np.arange(1000, dtype=np.float32), np.ones((3, 4), np.int64)]


def refused(opener: Opener, sealed: list[object], *reasons: str) -> None:
    with pytest.raises(SealRefused) as info:
        opener.open(sealed)
    assert info.value.reason in reasons


def test_a_sealed_message_opens_to_its_frames() -> None:
    sealer, opener = pair()
    sealed = sealer.seal(frames())
    assert [s.nbytes for s in sealed] == [6 + OVERHEAD, 4000 + OVERHEAD, 96 + OVERHEAD]
    plain = opener.open([bytes(s) for s in sealed])  # read-only frames: copied out
    assert bytes(plain[0]) == b"header"
    assert np.array_equal(np.frombuffer(plain[1], np.float32), np.arange(1000))
    # writable frames (received ZeroMQ frames) are opened in place where the
    # installed cryptography allows it (47 to 50 do, 51 refuses overlapping buffers:
    # then into a buffer of their own), and open either way
    again = sealer.seal(frames())
    plain = opener.open(again)
    assert np.array_equal(np.frombuffer(plain[1], np.float32), np.arange(1000))
    assert np.array_equal(np.frombuffer(plain[2], np.int64), np.ones(12))
    assert np.shares_memory(np.frombuffer(plain[1], np.uint8), again[1]) == seal._IN_PLACE


def test_a_frame_opens_into_its_own_buffer_where_the_library_refuses_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(seal, "_IN_PLACE", False)
    sealer, opener = pair()
    again = sealer.seal(frames())
    before = [bytes(f) for f in again]
    plain = opener.open(again)
    assert np.array_equal(np.frombuffer(plain[1], np.float32), np.arange(1000))
    assert not np.shares_memory(np.frombuffer(plain[1], np.uint8), again[1])
    assert [bytes(f) for f in again] == before  # the received frames left alone


def test_the_plaintext_is_not_on_the_wire() -> None:
    sealer, _ = pair()
    secret = b"the model's weights" * 10
    (sealed,) = sealer.seal([secret])
    assert b"the model" not in bytes(sealed)


@pytest.mark.parametrize("where", [0, 7, 8, 15, 16, 40, -1])
def test_a_tampered_frame_is_refused_and_the_next_message_still_opens(where: int) -> None:
    sealer, opener = pair()
    sealed = [bytearray(s) for s in sealer.seal(frames())]
    sealed[1][where] ^= 0x01
    # the key id (bytes 0..7): not this session's; the counter (8..15): not
    # authentic, or not past the frame before; the ciphertext and tag: not authentic
    if 0 <= where < 8:
        refused(opener, sealed, "unknown_key")
    elif 0 <= where < 16:
        refused(opener, sealed, "tampered", "replayed")
    else:
        refused(opener, sealed, "tampered")
    assert opener.last == -1  # nothing accepted
    assert opener.open(sealer.seal(frames()))


def test_a_replayed_message_is_refused() -> None:
    sealer, opener = pair()
    first = [bytes(s) for s in sealer.seal(frames())]
    opener.open(first)
    refused(opener, first, "replayed")
    opener.open(sealer.seal(frames()))
    refused(opener, first, "replayed")


def test_a_reordered_message_is_refused_a_gap_is_not() -> None:
    sealer, opener = pair()
    a = [bytes(s) for s in sealer.seal(frames())]
    b = sealer.seal(frames())
    c = sealer.seal(frames())
    opener.open(b)  # a was lost on the way (or is held back): a gap is allowed
    refused(opener, a, "replayed")  # but a older message after a newer one is not
    opener.open(c)


def test_frames_moved_within_or_between_messages_are_refused() -> None:
    sealer, opener = pair()
    # read-only copies: a writable frame refused is left garbled (opened in place)
    m = [bytes(f) for f in sealer.seal(frames())]
    refused(opener, [m[0], m[2], m[1]], "tampered", "replayed")  # moved within it
    refused(opener, [m[0], m[1]], "tampered")  # a frame dropped: the count is in the tag
    n = [bytes(f) for f in sealer.seal(frames())]
    refused(opener, [m[0], m[1], n[2]], "tampered")  # spliced from another message
    opener.open(n)


def test_another_key_is_refused() -> None:
    sealer, _ = pair()
    _, opener = pair()  # same key id, another key
    refused(opener, sealer.seal(frames()), "tampered")
    other = Opener(os.urandom(32), b"x" * 8)
    refused(other, sealer.seal(frames()), "unknown_key")


def test_malformed_messages_are_refused() -> None:
    _, opener = pair()
    refused(opener, [], "malformed")
    refused(opener, [b"short"], "malformed")
    refused(opener, [b"\0" * (OVERHEAD - 1)], "malformed")


def test_no_nonce_is_used_twice_across_many_frames() -> None:
    sealer, _ = pair()
    counters = []
    for _ in range(2000):
        for s in sealer.seal([b"x", b"yy", b""]):
            counters.append(struct.unpack_from(">Q", s, 8)[0])
    assert counters == list(range(len(counters)))  # each counter (the nonce) once
    assert sealer.next == 6000
    # and every one opened in turn
    sealer2, opener2 = pair()
    for _ in range(100):
        opener2.open(sealer2.seal([b"a", b"b"]))
    assert opener2.last == 199


def test_a_key_refuses_before_its_counter_wraps() -> None:
    sealer, opener = pair(limit=5)
    opener.open(sealer.seal([b"a", b"b", b"c"]))
    with pytest.raises(SealRefused) as info:
        sealer.seal([b"d", b"e", b"f"])  # would use counters 3, 4, 5: past the limit
    assert info.value.reason == "exhausted"
    assert sealer.next == 3  # nothing was used up
    opener.open(sealer.seal([b"d", b"e"]))
    with pytest.raises(SealRefused):
        sealer.seal([b"x"])
    # the real limit: a 64-bit counter never reaches 2^64 - 1
    full, _ = pair()
    full.next = COUNTER_LIMIT - 1
    full.seal([b"last"])
    with pytest.raises(SealRefused):
        full.seal([b"one too many"])


def test_the_keyring_opens_with_the_session_the_frame_names_and_is_bounded() -> None:
    ring = Keyring(max_sessions=4, max_per_peer=2)
    client = os.urandom(32)
    key_id, server = ring.agree("worker0", client)
    c2s, s2c = derive(client, server, key_id)
    session, plain = ring.open(Sealer(c2s, key_id).seal([b"hello"]))
    assert session.peer == "worker0" and bytes(plain[0]) == b"hello"
    # the reply sealed by the session opens with the client's s2c key
    assert bytes(Opener(s2c, key_id).open(session.sealer.seal([b"hi"]))[0]) == b"hi"
    with pytest.raises(SealRefused) as info:
        ring.open([b"?" * 8 + bytes(40)])
    assert info.value.reason == "unknown_key"
    # bounded per peer (the least recently used goes first) and in all
    ring.agree("worker0", os.urandom(32))
    ring.agree("worker0", os.urandom(32))
    assert len(ring) == 2
    with pytest.raises(SealRefused) as info:
        ring.open(Sealer(c2s, key_id).seal([b"hello"]))
    assert info.value.reason == "unknown_key"
    for i in range(6):
        ring.agree(f"worker{i + 1}", os.urandom(32))
    assert len(ring) == 4


def test_the_two_directions_have_distinct_keys() -> None:
    c2s, s2c = derive(os.urandom(32), os.urandom(32), b"k" * 8)
    assert c2s != s2c and len(c2s) == len(s2c) == 32
    with pytest.raises(ValueError):
        derive(b"short", os.urandom(32), b"k" * 8)


def test_the_data_credential_is_derived_apart_from_the_keys() -> None:
    client, server, key_id = os.urandom(32), os.urandom(32), b"k" * 8
    cred = credential(client, server, key_id)
    c2s, s2c = derive(client, server, key_id)
    # 32 bytes of its own label: neither key, and the same on both sides
    assert len(cred) == 32 and cred not in (c2s, s2c)
    assert credential(client, server, key_id) == cred
    assert credential(client, server, b"j" * 8) != cred  # the key id is its salt
    assert credential(server, client, key_id) != cred
    with pytest.raises(ValueError):
        credential(b"short", server, key_id)


def test_the_keyring_admits_only_a_live_sessions_credentials() -> None:
    ring = Keyring(max_sessions=4, max_per_peer=1)
    client = os.urandom(32)
    key_id, server = ring.agree("worker0", client)
    user, password = key_id.hex().encode(), credential(client, server, key_id).hex().encode()
    session = ring.admit(user, password)
    assert session is not None and session.peer == "worker0" and session.key_id == key_id
    # a wrong password, another session's id, garbage, nothing: refused
    wrong = bytearray(password)
    wrong[-1] ^= 0x01
    assert ring.admit(user, bytes(wrong)) is None
    assert ring.admit(user, password[:-2]) is None
    assert ring.admit(user, b"") is None
    assert ring.admit(b"00" * 8, password) is None
    assert ring.admit(b"not hex", password) is None
    assert ring.admit("é".encode(), password) is None
    assert ring.admit(b"", b"") is None
    # the AEAD keys are not credentials
    c2s, s2c = derive(client, server, key_id)
    assert ring.admit(user, c2s.hex().encode()) is None
    assert ring.admit(user, s2c.hex().encode()) is None
    # retired only by the name that agreed it (a client replacing its session)
    assert not ring.retire("worker1", key_id) and ring.admit(user, password) is not None
    assert ring.retire("worker0", key_id) and ring.admit(user, password) is None
    assert not ring.retire("worker0", key_id)
    # a forgotten session (here: its peer agreed more than it may hold) neither
    client = os.urandom(32)
    key_id, server = ring.agree("worker0", client)
    user, password = key_id.hex().encode(), credential(client, server, key_id).hex().encode()
    assert ring.admit(user, password) is not None
    ring.agree("worker0", os.urandom(32))
    assert ring.admit(user, password) is None


def test_frames_open_where_the_landing_says() -> None:
    sealer, opener = pair()
    values = np.arange(1000, dtype=np.float32)
    dest = np.zeros(1000, np.float32)
    wrong_size = np.zeros(10, np.float32)
    seen: list[bytes] = []

    def land(header: memoryview) -> list[object]:
        seen.append(bytes(header))
        return [dest, wrong_size]

    plain = opener.open(sealer.seal([b"header", values, values[:20]]), land)
    assert seen == [b"header"]
    assert np.array_equal(dest, values)  # opened straight into it
    assert np.shares_memory(np.frombuffer(plain[1], np.float32), dest)
    # a buffer of another size is not used: that frame opens in place
    assert np.array_equal(np.frombuffer(plain[2], np.float32), values[:20])
    assert not wrong_size.any()


def test_zmqps_seal_off_turns_sealing_off() -> None:
    from zmqps.config import seal_bulk

    assert seal_bulk({}) and seal_bulk({"ZMQPS_SEAL": "on"})
    for off in ("off", "0", "no", "FALSE", " Off "):
        assert not seal_bulk({"ZMQPS_SEAL": off})
