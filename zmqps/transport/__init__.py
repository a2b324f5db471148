"""Transport: the only package that imports zmq (an import contract checks it).

Layer map: wire <- transport <- roles (and coordinator, bench, cli above them);
transport and core are side by side and do not import each other, and the
transport never imports metrics (it reports to a ``TransportObserver``).
``Server`` (ROUTER) dispatches decoded requests to a handler; ``Client`` (DEALER,
one per peer) pipelines requests and matches replies by id; ``FakeNetwork``
implements the same contract in memory. Everyone else makes its ZeroMQ context
with :func:`new_context` and annotates it as :data:`ZmqContext`.
"""

from zmqps.transport.base import Handler, Requester, TransportStats
from zmqps.transport.client import Client, Landing
from zmqps.transport.context import ZmqContext, new_context, zmq_versions
from zmqps.transport.fake import FakeClient, FakeNetwork
from zmqps.transport.loop import LoopThread
from zmqps.transport.options import SocketOptions, tcp_endpoint
from zmqps.transport.ports import free_ports
from zmqps.transport.security import CurveKeys, keygen, load_keys
from zmqps.transport.server import Server

__all__ = [
    "Client",
    "CurveKeys",
    "FakeClient",
    "FakeNetwork",
    "Handler",
    "Landing",
    "LoopThread",
    "Requester",
    "Server",
    "SocketOptions",
    "TransportStats",
    "ZmqContext",
    "free_ports",
    "keygen",
    "load_keys",
    "new_context",
    "tcp_endpoint",
    "zmq_versions",
]
