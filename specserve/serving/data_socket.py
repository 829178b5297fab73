"""The data-plane socket: a replica's round calls as length-prefixed frames over TCP.

The orchestrator sends ``Propose`` and ``Verify`` to each replica over one TCP
connection (TLS when the replica serves TLS, with the same certificates, and the
same client-certificate check under ``--tls-ca``), and everything else over gRPC.
A call on a socket is one frame each way, written and read by the event loop
itself; a unary gRPC call (and a message on a ``grpc.aio`` stream) passes through
gRPC's poller thread and the event loop at each end. ``bench.rpc_overhead`` times
both in one run (docs/benchmarks.md): the socket is the one data-plane transport.
Unary ``Propose`` / ``Verify`` stay on the gRPC port for other clients.

**Protocol** (docs/api.md#the-data-plane-socket). Every frame is a 4-byte
little-endian length and that many bytes; calls and answers are laid out in
:mod:`specserve.serving.data_frames` (a header message and the unary message, each
length-delimited, each serialized on its own).

1. The client's first frame names the unary method its calls stand for, in UTF-8
   (``/specserve.v1.DraftService/Propose`` on a draft replica,
   ``/specserve.v1.TargetService/Verify`` on a target), followed, when the
   deployment has an internal token (:mod:`specserve.serving.internal_token`), by
   a newline and the token. The replica answers an empty frame; or, for a method it
   does not serve, an error answer (``UNIMPLEMENTED``), and for a replica with a
   token a hello without it or with another one (``UNAUTHENTICATED``), and closes.
2. Then each client frame is one call (``CallHeader`` with request id, deadline
   and trace context, and the unary request), and each replica frame one answer
   (``AnswerHeader`` with the request id, and the unary response or an error),
   served by :func:`specserve.serving.call_stream.serve_calls`: calls coalesce with
   every other caller's and fail per call, with the unary call's codes.
3. An answer with request id 0 and an error ends the connection: a frame that
   does not parse (``INVALID_ARGUMENT``), one past the size limit (the server's
   ``--max-message-bytes``, refused before it is read), or a graceful shutdown
   (``UNAVAILABLE``, after the calls in flight were answered). The replica then
   closes; the client fails what it sent after that as lost, and reconnects.

A connection is read no further while its calls in flight hold more request bytes
than its budget, ``IN_FLIGHT_FRAMES`` maximal frames on a replica (one frame always
gets in), or while the calls in flight of all the replica's data-plane connections
hold more than the replica's (``--max-in-flight-bytes``, shared with the unary
calls): the client's writes then wait on TCP, and no number of clients can make a
replica hold more than that however fast they send. A client that sends no hello
within ``HELLO_TIMEOUT_S`` is disconnected. Both ends turn on TCP keepalive, so a
peer that vanished without a FIN is noticed in about half a minute rather than
never.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from typing import Any

import grpc

from specserve.serving.call_stream import InFlightBytes, StreamMethod, serve_calls
from specserve.serving.data_frames import Call, call_parser, error_frame, frame, read_frame
from specserve.serving.internal_token import HEADER, refusal
from specserve.serving.malformed import Malformed, Oversized, RateLimitedWarning
from specserve.serving.tls import ServerTls

log = logging.getLogger(__name__)
_warning = RateLimitedWarning(log)

HELLO_TIMEOUT_S = 10.0
KEEPALIVE = {"TCP_KEEPIDLE": 15, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}


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


class DataSocketServer:
    """Serves one :class:`StreamMethod` on a TCP port (see the module docstring)."""

    def __init__(
        self,
        method: StreamMethod[Any, Any],
        request_type: Any,
        *,
        max_bytes: int,
        draining: asyncio.Event,
        bytes_in_flight: int,
        replica_budget: InFlightBytes | None = None,
    ) -> None:
        self.method = method
        self.parse = call_parser(request_type)
        self.max_bytes = max_bytes
        # Request bytes one connection may have in flight before it is read no further.
        self.bytes_in_flight = bytes_in_flight
        self.replica_budget = replica_budget  # shared with the replica's other connections
        self.draining = draining
        self.token: str | None = None  # set by start
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    async def start(
        self, host: str, port: int, tls: ServerTls | None, token: str | None = None
    ) -> int:
        """Listen on ``host:port`` (0: any free port); the bound port. ``token``: the
        internal token every hello must carry (None: none asked)."""
        self.token = token
        context = server_context(tls) if tls is not None else None
        self._server = await asyncio.start_server(
            self._serve, host, port, ssl=context, reuse_address=True
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening; connections end once their calls are answered (``draining``
        must be set) or within a second."""
        if self._server is not None:
            self._server.close()
        if self._connections:
            _, slow = await asyncio.wait(self._connections, timeout=1.0)
            for task in slow:
                task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        tune(writer.get_extra_info("socket"))
        try:
            if await self._hello(reader, writer):
                await self._calls(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, TimeoutError):
            pass  # the client went away (or never spoke): nothing to answer
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        hello = await asyncio.wait_for(read_frame(reader, 1024), HELLO_TIMEOUT_S)
        wanted = self.method.unary_method
        method, _, token = hello.partition(b"\n") if isinstance(hello, bytes) else (b"", b"", b"")
        if method == wanted.encode() and self.token is not None:
            why = refusal(self.token, [(HEADER, token)] if token else [])
            if why is not None:
                writer.write(error_frame(0, grpc.StatusCode.UNAUTHENTICATED, why))
                return False
        if method == wanted.encode():
            writer.write(frame(b""))
            return True
        if hello is not None:
            said = repr(method[:200]) if isinstance(hello, bytes) else "a frame too long"
            writer.write(
                error_frame(
                    0,
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"this replica's data-plane socket serves {wanted}; the hello named {said}",
                )
            )
        return False

    async def _calls(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        budget = InFlightBytes(self.bytes_in_flight, self.replica_budget)

        async def read() -> Call | Malformed | Oversized | None:
            await budget.room()  # past the budget, TCP backpressure
            data = await read_frame(reader, self.max_bytes)
            if data is None or isinstance(data, Oversized):
                return data
            call = self.parse(data)
            if not isinstance(call, Malformed):
                budget.hold(call, len(data))
            return call

        async def write(data: bytes) -> None:
            writer.write(data)  # a whole frame
            await writer.drain()  # returns at once unless the client stopped reading

        async def refuse(bad: Malformed | Oversized) -> None:
            writer.write(error_frame(0, *self._refusal(writer, bad)))

        await serve_calls(self.method, read, write, refuse, self.draining, budget.done)
        if self.draining.is_set():
            writer.write(
                error_frame(
                    0,
                    grpc.StatusCode.UNAVAILABLE,
                    "the replica is shutting down; the calls sent before this were "
                    "answered, send the rest to another replica",
                )
            )
        await writer.drain()

    def _refusal(
        self, writer: asyncio.StreamWriter, bad: Malformed | Oversized
    ) -> tuple[grpc.StatusCode, str]:
        if isinstance(bad, Oversized):
            return grpc.StatusCode.INVALID_ARGUMENT, (
                f"a frame of {bad.size} bytes exceeds this replica's limit of {bad.limit} "
                "(--max-message-bytes); the connection ends"
            )
        _warning.warn(
            f"{self.method.unary_method} socket: refused a frame of {bad.size} bytes from "
            f"{writer.get_extra_info('peername')} that is not a {bad.message} ({bad.why})"
        )
        return grpc.StatusCode.INVALID_ARGUMENT, (
            f"a frame of {bad.size} bytes does not parse as a {bad.message} message; "
            "the connection ends"
        )
