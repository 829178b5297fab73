"""The data-plane socket's protocol: a replica's round calls as length-prefixed TCP frames.

A message on a ``grpc.aio`` stream passes through gRPC's poller thread and the event
loop at each end, several thread hops each way; a socket is read and written by the
replica's model thread itself (:mod:`specserve.serving.socket_plane`), so a call
costs its bytes, its conversion and its batch. ``bench.rpc_overhead`` times both. So
the orchestrator sends ``Propose`` and ``Verify`` to each replica over one TCP
connection (TLS when the replica serves TLS, with the same certificates, and the
same client-certificate check under ``--tls-ca``), and everything else over gRPC.
This module holds the protocol and the helpers both ends share.

**Protocol** (docs/api.md#the-data-plane-socket). Every frame is a 4-byte
little-endian length and that many bytes.

1. The client's first frame names the unary method its calls stand for, in UTF-8
   (``/specserve.v1.DraftService/Propose`` on a draft replica,
   ``/specserve.v1.TargetService/Verify`` on a target). The replica answers an
   empty frame; or, for a method it does not serve, a ``StreamCallError``
   (``UNIMPLEMENTED``) and closes.
2. Then each client frame is one call, a ``ProposeStreamRequest`` /
   ``VerifyStreamRequest`` (header with request id, deadline and trace context,
   and the unary request), and each replica frame one answer, a
   ``ProposeStreamResponse`` / ``VerifyStreamResponse``, exactly as on the gRPC
   stream methods (:mod:`specserve.serving.call_stream`: the same code serves
   both: calls coalesce with every other caller's and fail per call).
3. An answer with request id 0 and an error ends the connection: a frame that
   does not parse (``INVALID_ARGUMENT``), one past the size limit (the server's
   ``--max-message-bytes``, refused before it is read), or a graceful shutdown
   (``UNAVAILABLE``, after the calls in flight were answered). The replica then
   closes; the client fails what it sent after that as lost, and reconnects.

A connection is read no further while its calls in flight hold more request bytes
than its budget, ``IN_FLIGHT_FRAMES`` maximal frames on a replica (one frame always
gets in), or while the calls in flight of all the replica's data-plane connections
(sockets and gRPC streams) hold more than the replica's (``--max-in-flight-bytes``):
the client's writes then wait on TCP, and no number of clients can make a replica
hold more than that however fast they send. A client that sends no hello within
``HELLO_TIMEOUT_S`` is disconnected. Both ends
turn on TCP keepalive, so a peer that vanished without a FIN is noticed in about
half a minute rather than never.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable
from typing import Any

import grpc

from specserve.serving.malformed import Oversized, RateLimitedWarning
from specserve.serving.tls import ServerTls
from specserve.v1 import common_pb2

log = logging.getLogger(__name__)
_warning = RateLimitedWarning(log)

LENGTH_BYTES = 4
HELLO_TIMEOUT_S = 10.0
KEEPALIVE = {"TCP_KEEPIDLE": 15, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}


def frame(payload: bytes) -> bytes:
    """``payload`` with its length in front."""
    return len(payload).to_bytes(LENGTH_BYTES, "little") + payload


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes | Oversized | None:
    """The next frame's bytes; None at a clean end of the stream (between frames);
    :class:`Oversized` for a frame longer than ``max_bytes`` (its bytes are not read)."""
    try:
        head = await reader.readexactly(LENGTH_BYTES)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise ConnectionError("the connection closed inside a frame's length") from None
    size = int.from_bytes(head, "little")
    if size > max_bytes:
        return Oversized(size, max_bytes)
    return await reader.readexactly(size)


def tune(sock: socket.socket | None) -> None:
    """No Nagle delay (a call is one write); keepalive probes on an idle connection."""
    if sock is None:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE.items():
        option = getattr(socket, name, None)
        if option is not None:  # Linux; elsewhere the system's keepalive timing applies
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def server_context(tls: ServerTls) -> ssl.SSLContext:
    """The replica's TLS: its certificate; client certificates checked under a CA."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.client_ca_file is not None:
        context.load_verify_locations(tls.client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def error_frame(answer_type: Callable[..., Any], code: grpc.StatusCode, text: str) -> bytes:
    """The frame that ends a connection: request id 0, an error."""
    error = common_pb2.StreamCallError(code=code.value[0], message=text)
    return frame(answer_type(request_id=0, error=error).SerializeToString())
