"""zmqps: a parameter server for distributed training over ZeroMQ.

Layer map (each layer imports only those below it; ``|``: side by side, not
importing each other). ``lint-imports`` checks it with the other import contracts
of pyproject.toml ``[tool.importlinter]``; ARCHITECTURE.md explains them::

    __main__
    cli/                   argument parsing, launch, the commands
    bench/                 zmqps against raw pyzmq and torch.distributed.rpc
    coordinator/           coordinator mode: schedules functions onto workers
    roles/                 ps, chief, worker, evaluator: transport + core
    adapters/ | export     the PyTorch binding | exported models
    models/                the built-in models
    checkpoint/ | data/ | device/ | metrics/
    core/ | transport/ | config | errors | malloc | process | version
    wire/                  sans-IO messages, codec, schemas (imports nothing of zmqps)

Only ``transport`` imports zmq, only ``device`` cupy, only ``adapters`` torch,
only ``metrics`` prometheus_client; ``wire`` and ``core`` import no I/O. This
module (the package root) re-exports the public API, so it imports the roles:
nothing below them imports it (``__version__`` lives in :mod:`zmqps.version`).

The public API for training loops is :class:`Worker` with :class:`VariableDef`.
"""

from typing import TYPE_CHECKING, Any

from zmqps.version import __version__ as __version__

if TYPE_CHECKING:
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

#: where each name of the public API lives: imported when first used, so that
#: ``import zmqps`` (every command's first step) is light, and a Ctrl-C while a
#: command's heavy imports run reaches its entry point (``zmqps.cli.entry``)
_LAZY = {
    "Placement": "zmqps.core.variables",
    "VariableDef": "zmqps.core.variables",
    "Worker": "zmqps.roles.worker",
    **dict.fromkeys(
        (
            "ConfigError",
            "DeadlineExceeded",
            "FencedError",
            "InvalidArgument",
            "NotFound",
            "NotReady",
            "ProtocolError",
            "RemoteError",
            "ZmqpsError",
        ),
        "zmqps.errors",
    ),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zmqps' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
