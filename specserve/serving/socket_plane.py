"""The data-plane socket, served on the model thread.

The protocol is :mod:`specserve.serving.data_socket`'s.

The orchestrator's Propose and Verify calls reach a replica on its data-plane
socket, and that socket is served by the model thread's own event loop
(:attr:`ModelExecutor.model_loop <specserve.serving.executor.ModelExecutor>`).
Between batches the loop reads what arrived, parses each call and makes it ready
(``StreamMethod.prepare``: validation and conversion), and queues it on the
executor; the batch hands each call's result to it on the model thread, where the
answer is built, serialised and written to the connection. No thread hop and no
task per call: the critical path of a round is its bytes, their conversion and its
batch. Calls from every connection (and gRPC callers) still coalesce into one
batch, and a batch's window lets the loop read more calls while it waits.

Per call, as on the gRPC stream (:mod:`specserve.serving.call_stream`): a SERVER
span named after the unary method, child of the header's trace context (or the
caller's span current, unsampled); its error mapped by
:func:`~specserve.serving.errors.status_for` and answered under its request id; a
request id already in flight, a message without a request, or more than
``max_in_flight`` calls are answered with an error; past its ``timeout_ms`` it is
answered ``DEADLINE_EXCEEDED`` (a batch that ran it later is not answered again).
A connection is read no further (TCP backpressure) while its calls in flight hold
its byte budget or the replica's (:class:`~specserve.serving.in_flight.InFlightBytes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from typing import Any

import grpc

from specserve.serving import data_socket
from specserve.serving.call_stream import StreamMethod
from specserve.serving.data_socket import error_frame, frame, server_context, tune
from specserve.serving.executor import ModelExecutor
from specserve.serving.in_flight import InFlightBytes
from specserve.serving.malformed import Malformed, RateLimitedWarning, tolerant
from specserve.serving.socket_plane_call import SocketCallState
from specserve.serving.tls import ServerTls

log = logging.getLogger(__name__)
_warning = RateLimitedWarning(log)
HELLO_MAX_BYTES = 1024
CLOSE_WAIT_S = 1.0  # a graceful close waits this long for connections to answer


class SocketPlane:
    """Serves one :class:`StreamMethod` (which must have ``prepare``) on a TCP port, on
    ``executor``'s model loop. Bind on the server's loop; serving starts when the model
    loop runs (after the model loaded: connections wait in the listen backlog)."""

    def __init__(
        self,
        method: StreamMethod[Any, Any],
        request_type: Any,
        executor: ModelExecutor[Any],
        *,
        max_bytes: int,
        bytes_in_flight: int,
        replica_budget: InFlightBytes | None = None,
    ) -> None:
        assert method.prepare is not None, "the socket serves prepared calls"
        self.method = method
        self.parse = tolerant(request_type.FromString)
        self.executor = executor
        self.max_bytes = max_bytes
        self.bytes_in_flight = bytes_in_flight  # per connection, before it is read no further
        self.replica_budget = replica_budget  # shared with the replica's other connections
        self.connections: set[_Connection] = set()  # model loop only
        self._listener: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._closing = False

    def bind(self, host: str, port: int, tls: ServerTls | None) -> int:
        """Listen on ``host:port`` (0: any free port) and serve there once the model loop
        runs; the bound port."""
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
        self._listener = listener
        context = server_context(tls) if tls is not None else None
        self.executor.model_loop.call_soon_threadsafe(self._serve, listener, context)
        return int(listener.getsockname()[1])

    def _serve(self, listener: socket.socket, context: ssl.SSLContext | None) -> None:
        async def serve() -> None:
            self._server = await loop.create_server(
                lambda: _Connection(self), sock=listener, ssl=context
            )

        loop = self.executor.model_loop
        if not self._closing:
            loop.create_task(serve())

    async def close(self) -> None:
        """Stop listening; each connection answers its calls in flight, then ends with
        ``UNAVAILABLE`` (within :data:`CLOSE_WAIT_S`, else it is dropped). From the
        server's loop."""
        self._closing = True
        loop = self.executor.model_loop
        if not loop.is_running():  # never served (the model did not load): nothing to drain
            if self._listener is not None:
                self._listener.close()
            return
        drained = asyncio.run_coroutine_threadsafe(self._drain(), loop)
        with contextlib.suppress(TimeoutError, RuntimeError):
            await asyncio.wait_for(asyncio.wrap_future(drained), CLOSE_WAIT_S + 1.0)

    async def _drain(self) -> None:
        if self._server is not None:
            self._server.close()
        elif self._listener is not None:
            self._listener.close()
        for connection in list(self.connections):
            connection.end_gracefully()
        for _ in range(int(CLOSE_WAIT_S / 0.01)):
            if not self.connections:
                return
            await asyncio.sleep(0.01)
        for connection in list(self.connections):
            connection.drop()


class _Connection(asyncio.Protocol):
    """One client connection: the hello, then calls (see the module docstring)."""

    def __init__(self, plane: SocketPlane) -> None:
        self.plane = plane
        self.method = plane.method
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.greeted = False
        self.calls: dict[int, SocketCallState] = {}  # request id -> call in flight
        self.budget = InFlightBytes(plane.bytes_in_flight, plane.replica_budget)
        self.paused = False  # read no further until answers free bytes
        self.ending = False  # read no more: answer what is in flight, then close
        self.closed = False
        self._hello_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        tune(transport.get_extra_info("socket"))
        self.plane.connections.add(self)
        loop = self.plane.executor.model_loop
        self._hello_timer = loop.call_later(data_socket.HELLO_TIMEOUT_S, self.drop)
        if self.plane._closing:
            self.end_gracefully()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._take_frames()

    def eof_received(self) -> bool:
        self.ending = True  # the client sends no more: answer what it sent, then close
        self._close_if_done()
        return True  # keep the connection open for the answers

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        for call in list(self.calls.values()):
            call.abandon()
        self.plane.connections.discard(self)

    # -- frames -------------------------------------------------------------------------

    def _take_frames(self) -> None:
        """Handle every whole frame in the buffer, as far as the budget allows."""
        buffer = self.buffer
        while not self.ending and not self.closed and len(buffer) >= data_socket.LENGTH_BYTES:
            size = int.from_bytes(buffer[: data_socket.LENGTH_BYTES], "little")
            limit = self.plane.max_bytes if self.greeted else HELLO_MAX_BYTES
            if size > limit:
                self._oversized(size, limit)
                return
            if self.greeted and not self.budget.has_room():
                self._pause()
                return
            end = data_socket.LENGTH_BYTES + size
            if len(buffer) < end:
                return
            data = bytes(buffer[data_socket.LENGTH_BYTES : end])
            del buffer[:end]
            if self.greeted:
                self._call(data)
            else:
                self._hello(data)

    def _hello(self, data: bytes) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        wanted = self.method.unary_method
        if data == wanted.encode():
            self.greeted = True
            self.write(b"")
            return
        self.end(
            grpc.StatusCode.UNIMPLEMENTED,
            f"this replica's data-plane socket serves {wanted}; the hello named {data[:200]!r}",
        )

    def _oversized(self, size: int, limit: int) -> None:
        if not self.greeted:
            wanted = self.method.unary_method
            self.end(
                grpc.StatusCode.UNIMPLEMENTED,
                f"this replica's data-plane socket serves {wanted}; the hello named a frame "
                "too long",
            )
            return
        self.end(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a frame of {size} bytes exceeds this replica's limit of {limit} "
            "(--max-message-bytes); the connection ends",
        )

    def _call(self, data: bytes) -> None:
        message = self.plane.parse(data)  # type: ignore[misc]
        if isinstance(message, Malformed):
            _warning.warn(
                f"{self.method.unary_method} socket: refused a frame of {message.size} bytes "
                f"from {self._peer()} that is not a {message.message} ({message.why})"
            )
            self.end(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a frame of {message.size} bytes does not parse as a {message.message} "
                "message; the connection ends",
            )
            return
        request_id = message.header.request_id
        if request_id in self.calls:
            self._refuse(
                request_id,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"stream call {request_id} is already in flight on this stream: give each "
                "call in flight its own request id",
            )
        elif len(self.calls) >= self.method.max_in_flight:
            self._refuse(
                request_id,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this stream has {len(self.calls)} calls in flight, the most it takes; wait "
                "for answers before sending more",
            )
        else:
            call = SocketCallState(self, message)
            self.calls[request_id] = call
            self.budget.hold(call, len(data))
            call.start()

    def _refuse(self, request_id: int, code: grpc.StatusCode, text: str) -> None:
        self.write(self.method.refusal(request_id, code, text).SerializeToString())

    # -- flow -----------------------------------------------------------------------------

    def _pause(self) -> None:
        """Past the budget: read no further; resume when answers free bytes (ours free
        them in :meth:`finished`; the replica's other connections through ``freed``)."""
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        replica = self.plane.replica_budget
        if replica is not None and not replica.has_room():
            replica.freed().add_done_callback(lambda _: self._resume())

    def _resume(self) -> None:
        if not self.paused or self.closed:
            return
        if not self.budget.has_room():
            self._pause()
            return
        self.paused = False
        assert self.transport is not None
        self.transport.resume_reading()
        self._take_frames()

    def finished(self, call: SocketCallState) -> None:
        """``call`` was answered (or abandoned; its bytes freed): free its request id."""
        if self.calls.get(call.request_id) is call:
            del self.calls[call.request_id]
        self._resume()
        self._close_if_done()

    def write(self, payload: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(frame(payload))

    def end(self, code: grpc.StatusCode, text: str) -> None:
        """End the connection with a request-id-0 error; its calls in flight are dropped."""
        if not self.closed and self.transport is not None:
            self.transport.write(error_frame(self.method.answer_type, code, text))
        self.ending = True
        if self.transport is not None:
            self.transport.close()  # after the buffered writes

    def end_gracefully(self) -> None:
        """Read no more; once the calls in flight are answered, end ``UNAVAILABLE``."""
        self.ending = True
        self._close_if_done()

    def _close_if_done(self) -> None:
        if not self.ending or self.calls or self.closed or self.transport is None:
            return
        if self.transport.is_closing():
            return
        if self.plane._closing:
            self.end(
                grpc.StatusCode.UNAVAILABLE,
                "the replica is shutting down; the calls sent before this were answered, "
                "send the rest to another replica",
            )
        else:
            self.transport.close()

    def drop(self) -> None:
        """Close at once (a silent client; a close that waited too long)."""
        if self.transport is not None and not self.closed:
            self.transport.abort()

    def _peer(self) -> object:
        return self.transport.get_extra_info("peername") if self.transport else None
