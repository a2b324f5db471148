"""``ZMQPS_MAX_CONNECTIONS``: the bound on a server socket's connections, from the
environment; a value that is not an integer is a configuration error (one line and
exit 2 from every task), not a traceback."""

from __future__ import annotations

import pytest

from zmqps.transport.connections import MAX_CONNECTIONS, default_max_connections
from zmqps.wire.errors import ConfigError


def test_the_bound_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZMQPS_MAX_CONNECTIONS", raising=False)
    assert default_max_connections() == MAX_CONNECTIONS
    monkeypatch.setenv("ZMQPS_MAX_CONNECTIONS", " 50 ")
    assert default_max_connections() == 50
    monkeypatch.setenv("ZMQPS_MAX_CONNECTIONS", "-3")
    assert default_max_connections() == 0  # no bound


def test_a_bound_that_is_not_an_integer_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ZMQPS_MAX_CONNECTIONS", "abc")
    with pytest.raises(ConfigError, match="ZMQPS_MAX_CONNECTIONS='abc'"):
        default_max_connections()
