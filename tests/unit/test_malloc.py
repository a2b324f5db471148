"""zmqps.malloc: glibc's thresholds raised and one arena kept, once per process,
unless told not to."""

from __future__ import annotations

import platform

import pytest

from zmqps import malloc


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(malloc, "_tuned", None)
    monkeypatch.delenv("ZMQPS_MALLOC", raising=False)


def test_zmqps_malloc_default_leaves_the_allocator_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZMQPS_MALLOC", " Default ")
    assert malloc.tune_malloc() is False
    monkeypatch.delenv("ZMQPS_MALLOC")
    assert malloc.tune_malloc() is False  # decided once per process


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_the_thresholds_and_the_arena_count() -> None:
    assert malloc.tune_malloc() is True
    assert malloc.tune_malloc() is True


def test_a_c_library_without_mallopt_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoMallopt:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

    monkeypatch.setattr(malloc.ctypes, "CDLL", NoMallopt)
    assert malloc.tune_malloc() is False
