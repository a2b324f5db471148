"""Ports for local clusters are picked below the ephemeral range, where no outgoing
connection of the machine can take one between the pick and the task's bind."""

from __future__ import annotations

import socket

import pytest

from zmqps.transport import free_ports
from zmqps.transport import ports as ports_module
from zmqps.wire.errors import ConfigError


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    start = ports_module._ephemeral_start()
    for _ in range(20):
        picked = free_ports(6)
        assert len(set(picked)) == 6
        assert all(ports_module.LOWEST <= p < start for p in picked), picked
        held = []
        try:
            for p in picked:  # each can be bound (and listened on) now
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)
                s.bind(("127.0.0.1", p))
                s.listen()
        finally:
            for s in held:
                s.close()


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the range below the ephemeral one a few ports wide and all but one of them
    taken, that one is picked; with none free there, the kernel picks."""
    monkeypatch.delenv(ports_module.PORT_RANGE_ENV, raising=False)  # the default range
    taken = []
    try:
        base = free_ports(1)[0]
        for p in (base, base + 1):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                s.close()
                pytest.skip(f"port {p} is in use here")
            s.listen()
            taken.append(s)
        monkeypatch.setattr(ports_module, "LOWEST", base)
        monkeypatch.setattr(ports_module, "_ephemeral_start", lambda: base + 2)
        picked = free_ports(1)  # no room below: the kernel's choice
        assert picked[0] not in (base, base + 1)
        taken.pop().close()  # base + 1 is free again
        monkeypatch.setattr(ports_module, "_ephemeral_start", lambda: base + 10)
        for _ in range(10):
            got = free_ports(1)[0]
            assert got != base
    finally:
        for s in taken:
            s.close()


def test_a_range_given_is_the_only_one_picked_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ZMQPS_PORT_RANGE``: every port in it (no kernel's choice past it); one too
    small for what is asked, or taken, is an error that names it."""
    base = free_ports(1)[0]
    monkeypatch.setenv(ports_module.PORT_RANGE_ENV, f"{base}-{base + 7}")
    for _ in range(10):
        picked = free_ports(4)
        assert len(set(picked)) == 4 and all(base <= p <= base + 7 for p in picked), picked
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        try:
            held.bind(("127.0.0.1", base))
        except OSError:
            pytest.skip(f"port {base} is in use here")
        monkeypatch.setenv(ports_module.PORT_RANGE_ENV, f"{base}-{base}")
        with pytest.raises(OSError, match=f"ZMQPS_PORT_RANGE={base}-{base}"):
            free_ports(1)
    finally:
        held.close()


@pytest.mark.parametrize("text", ["40000", "a-b", "0-10", "500-400", "1-70000", "-5"])
def test_a_range_that_is_not_one_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv(ports_module.PORT_RANGE_ENV, text)
    with pytest.raises(ConfigError, match=r"ZMQPS_PORT_RANGE.*expected LO-HI"):
        free_ports(1)
