"""The zmqps error hierarchy (defined in :mod:`zmqps.wire.errors`, the bottom layer)."""

from zmqps.wire.errors import (
    ConfigError,
    DeadlineExceeded,
    FencedError,
    InvalidArgument,
    NotFound,
    NotReady,
    ProtocolError,
    RemoteError,
    ShutdownError,
    ZmqpsError,
    error_from_code,
)

__all__ = [
    "ConfigError",
    "DeadlineExceeded",
    "FencedError",
    "InvalidArgument",
    "NotFound",
    "NotReady",
    "ProtocolError",
    "RemoteError",
    "ShutdownError",
    "ZmqpsError",
    "error_from_code",
]
