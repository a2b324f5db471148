"""Wire layer (sans-IO): messages, the codec and its schemas. Imports nothing else of zmqps.

Layer map: wire <- core <- roles <- cli; wire <- transport <- roles.
"""

from zmqps.wire.codec import DTYPES, Limits, decode, encode, wire_dtype
from zmqps.wire.errors import ProtocolError
from zmqps.wire.messages import (
    ERROR,
    OK,
    PROTOCOL_VERSION,
    Message,
    Tensor,
    as_wire_array,
    error_reply,
    reply,
    request,
)

__all__ = [
    "DTYPES",
    "ERROR",
    "OK",
    "PROTOCOL_VERSION",
    "Limits",
    "Message",
    "ProtocolError",
    "Tensor",
    "as_wire_array",
    "decode",
    "encode",
    "error_reply",
    "reply",
    "request",
    "wire_dtype",
]
