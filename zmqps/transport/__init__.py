"""Transport: the only package that imports zmq.

Layer map: wire <- transport <- roles. ``Server`` (ROUTER) dispatches decoded
requests to a handler; ``Client`` (DEALER, one per peer) pipelines requests and
matches replies by id; ``FakeNetwork`` implements the same contract in memory.
"""

from zmqps.transport.base import Handler, Requester, TransportStats
from zmqps.transport.client import Client
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
