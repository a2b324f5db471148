"""zmqps: a parameter server for distributed training over ZeroMQ.

Layer map (DESIGN §10)::

    wire/       sans-IO messages, codec, schemas           (imports nothing of zmqps)
    core/       sans-IO state: shard store, optimizers,     (imports wire)
                initializers, partitioning, membership
    transport/  the only importer of zmq: ROUTER server,    (imports wire)
                DEALER client, in-memory fake
    metrics/    Prometheus catalogue + /metrics exporter    (imports prometheus_client only)
    roles/      ps, chief, worker: transport + core         (imports core, transport, metrics)
    cli/        argument parsing, launch                     (imports roles)

The public API for training loops is :class:`Worker` with :class:`VariableDef`.
"""

from zmqps.core.variables import Placement, VariableDef
from zmqps.errors import (
    ConfigError,
    DeadlineExceeded,
    FencedError,
    InvalidArgument,
    NotFound,
    NotReady,
    ProtocolError,
    RemoteError,
    ZmqpsError,
)
from zmqps.roles.worker import Worker
from zmqps.version import __version__ as __version__

__all__ = [
    "ConfigError",
    "DeadlineExceeded",
    "FencedError",
    "InvalidArgument",
    "NotFound",
    "NotReady",
    "Placement",
    "ProtocolError",
    "RemoteError",
    "VariableDef",
    "Worker",
    "ZmqpsError",
]
