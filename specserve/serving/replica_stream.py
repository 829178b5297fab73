"""The client end of the data plane: many calls to one replica over one connection.

:class:`ReplicaStream` sends each call as one message on a long-lived connection to
the replica, its data-plane socket (:mod:`specserve.serving.socket_call`, when given a
:class:`~specserve.serving.socket_call.SocketDial`) or its ``ProposeStream`` /
``VerifyStream`` gRPC method (framing in :mod:`specserve.serving.call_stream`), and
hands back the answer with the same request id, so any number of callers can share
the stream. It behaves, for its callers, like the unary stub method it
replaces: ``await stream.call(request, timeout)`` returns the response or raises
:class:`grpc.aio.AioRpcError` with the code and sentence the unary call would
have ended with, so failure handling written for unary calls applies unchanged.

* The stream opens lazily, on the first call.
* ``timeout`` is the call's deadline: sent in the message (the server gives up
  past it) and waited for here; past it the call raises ``DEADLINE_EXCEEDED``.
  A late answer is dropped.
* A stream that breaks (the replica restarts, the connection drops, the server
  ends it) fails every call in flight on it with the stream's status
  (``UNAVAILABLE`` when it ended without one), as a lost unary call fails. The
  next call opens a new stream, after a backoff that doubles with breaks in a row
  (``backoff_s`` up to ``max_backoff_s``; an answer resets it); a call that
  cannot wait that long fails ``UNAVAILABLE`` at once.
* A cancelled call is forgotten here; the replica finishes its work and the
  answer is dropped.
* Tracing: each call has its own CLIENT span, named after the unary method, and
  its trace context travels in the message (the stream itself is untraced).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import grpc
import grpc.aio
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from specserve.serving.socket_call import STATUS_CODES, SocketCall, SocketDial, rpc_error
from specserve.serving.stream_frames import call_bytes
from specserve.v1 import common_pb2, draft_pb2, target_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class ReplicaStream(Generic[Req, Resp]):
    """Calls of one method to one replica over one shared bidirectional stream.

    ``open_stream`` opens the stream: a channel's stream-stream method that takes
    bytes (calls are written framed, :mod:`specserve.serving.stream_frames`) and
    parses the stream's response message; ``unary_method`` the full name of the
    unary twin (the calls' span name). :meth:`propose` and :meth:`verify` build
    the two the services offer.
    """

    def __init__(
        self,
        open_stream: Callable[[], grpc.aio.StreamStreamCall],
        unary_method: str,
        *,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.open_stream = open_stream
        self.unary_method = unary_method
        service, _, name = unary_method.lstrip("/").rpartition("/")
        self._span_attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.opened = 0  # streams opened so far (the first, and each reopening)
        self._ids = itertools.count(1)
        self._stream: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._write_lock = asyncio.Lock()
        self._breaks = 0  # breaks in a row without an answer in between
        self._reopen_at = 0.0
        self._closed = False

    @classmethod
    def propose(
        cls, channel: grpc.aio.Channel, socket: SocketDial | None = None, **backoff: float
    ) -> ReplicaStream[draft_pb2.ProposeRequest, draft_pb2.ProposeResponse]:
        """Propose calls over the draft replica's data-plane socket when ``socket`` says
        how to reach it (and the replica has one), else over ``DraftService.ProposeStream``
        on ``channel``."""
        return cls._over(
            channel,
            socket,
            "/specserve.v1.DraftService/Propose",
            draft_pb2.ProposeStreamResponse,
            **backoff,
        )

    @classmethod
    def verify(
        cls, channel: grpc.aio.Channel, socket: SocketDial | None = None, **backoff: float
    ) -> ReplicaStream[target_pb2.VerifyRequest, target_pb2.VerifyResponse]:
        """Verify calls over the target replica's data-plane socket when ``socket`` says
        how to reach it (and the replica has one), else over ``TargetService.VerifyStream``
        on ``channel``."""
        return cls._over(
            channel,
            socket,
            "/specserve.v1.TargetService/Verify",
            target_pb2.VerifyStreamResponse,
            **backoff,
        )

    @classmethod
    def _over(
        cls,
        channel: grpc.aio.Channel,
        socket: SocketDial | None,
        unary_method: str,
        answer_type: Any,
        **backoff: float,
    ) -> ReplicaStream[Any, Any]:
        grpc_stream = channel.stream_stream(
            unary_method + "Stream",
            request_serializer=None,  # calls are written as framed bytes
            response_deserializer=answer_type.FromString,
        )
        if socket is None:
            return ReplicaStream(grpc_stream, unary_method, **backoff)

        def open_socket() -> Any:
            return SocketCall(channel, socket, unary_method, answer_type, grpc_stream)

        return ReplicaStream(open_socket, unary_method, **backoff)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def call(self, request: Req, timeout: float | None = None) -> Resp:
        """One call: its response, or the :class:`grpc.aio.AioRpcError` the unary call
        would raise (see the module docstring)."""
        with tracer.start_as_current_span(
            self.unary_method, kind=SpanKind.CLIENT, attributes=self._span_attributes
        ) as span:
            try:
                response: Resp = await self._call(request, timeout)
            except grpc.aio.AioRpcError as e:
                span.set_attribute("rpc.grpc.status_code", e.code().value[0])
                span.set_status(Status(StatusCode.ERROR, f"{e.code().name}: {e.details()}"))
                raise
            span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.OK.value[0])
            return response

    async def _call(self, request: Req, timeout: float | None) -> Resp:
        if self._closed:
            raise rpc_error(grpc.StatusCode.CANCELLED, f"the {self.unary_method} stream is closed")
        end = None if timeout is None else time.monotonic() + timeout
        stream = await self._open(end)
        request_id = next(self._ids)
        header = common_pb2.StreamCallHeader(request_id=request_id)
        if timeout is not None:
            header.timeout_ms = max(1, math.ceil(timeout * 1000))
        if trace.get_current_span().get_span_context().is_valid:  # else nothing to carry
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            header.traceparent = carrier.get("traceparent", "")
            header.tracestate = carrier.get("tracestate", "")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Any] = loop.create_future()
        self._pending[request_id] = answer
        expiry: asyncio.TimerHandle | None = None
        try:
            if stream.done():  # ended before this call could join it; its reader says why
                await asyncio.sleep(0)
                if not answer.done():
                    raise rpc_error(
                        grpc.StatusCode.UNAVAILABLE, f"the {self.unary_method} stream ended"
                    )
                return self._outcome(answer.result())
            try:
                async with self._write_lock:
                    await stream.write(call_bytes(header, request))  # type: ignore[arg-type]
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
                if answer.done():  # the reader saw the break first: its error says why
                    return self._outcome(answer.result())
                why = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                raise rpc_error(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the {self.unary_method} stream broke while sending: {why}",
                ) from None
            if end is not None and not answer.done():
                # One timer, not wait_for(shield()): a task and two futures per call.
                expiry = loop.call_at(
                    loop.time() + max(0.0, end - time.monotonic()), _expire, answer
                )
            message = await answer
            if message is _EXPIRED:
                raise rpc_error(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{self.unary_method} on the stream got no answer within {timeout:g} s",
                )
            return self._outcome(message)
        finally:
            if expiry is not None:
                expiry.cancel()
            self._pending.pop(request_id, None)

    def _outcome(self, message: Any) -> Resp:
        if isinstance(message, grpc.aio.AioRpcError):  # the stream broke
            raise message
        if message.WhichOneof("outcome") == "response":
            return message.response  # type: ignore[no-any-return]
        if message.WhichOneof("outcome") != "error":
            raise rpc_error(
                grpc.StatusCode.INTERNAL,
                f"the replica answered {self.unary_method} call {message.request_id} with "
                "neither a response nor an error",
            )
        code = STATUS_CODES.get(message.error.code, grpc.StatusCode.UNKNOWN)
        raise rpc_error(code, message.error.message)

    async def _open(self, end: float | None) -> grpc.aio.StreamStreamCall:
        """The open stream; a new one when there is none (after the backoff, if any)."""
        if self._stream is not None:
            return self._stream
        wait = self._reopen_at - time.monotonic()
        if wait > 0:
            if end is not None and time.monotonic() + wait > end:
                raise rpc_error(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the {self.unary_method} stream broke {self._breaks} time(s) in a row; "
                    f"it reopens in {wait:.2f} s, after this call's deadline",
                )
            await asyncio.sleep(wait)
            if self._stream is not None:  # another call reopened it meanwhile
                return self._stream
        stream = self.open_stream()
        self._stream = stream
        self.opened += 1
        self._reader = asyncio.get_running_loop().create_task(self._read(stream))
        return stream

    async def _read(self, stream: grpc.aio.StreamStreamCall) -> None:
        """Hand each answer to its caller until the stream ends; then fail the rest."""
        why: grpc.aio.AioRpcError | None = None
        try:
            while True:
                message = await stream.read()
                if message is grpc.aio.EOF:
                    break
                self._breaks = 0
                answer = self._pending.get(message.request_id)
                if answer is not None and not answer.done():
                    answer.set_result(message)
        except grpc.aio.AioRpcError as e:
            why = e
        except asyncio.CancelledError:
            why = rpc_error(grpc.StatusCode.CANCELLED, f"the {self.unary_method} stream closed")
        finally:
            if self._stream is stream:
                self._stream = None
                self._breaks += 1
                backoff = min(self.max_backoff_s, self.backoff_s * 2 ** (self._breaks - 1))
                self._reopen_at = time.monotonic() + backoff
            if why is None:
                code = await _final_code(stream)
                why = rpc_error(
                    grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.OK else code,
                    f"the replica ended the {self.unary_method} stream ({code.name})",
                )
            else:
                why = rpc_error(
                    why.code(), f"the {self.unary_method} stream broke: {why.details()}"
                )
            for answer in self._pending.values():
                if not answer.done():
                    answer.set_result(why)
            if self._pending:
                log.info(
                    "%s stream ended with %d calls in flight: %s",
                    self.unary_method,
                    len(self._pending),
                    why.details(),
                )

    async def close(self) -> None:
        """Cancel the stream; calls in flight fail ``CANCELLED``, later ones too."""
        self._closed = True
        stream, reader = self._stream, self._reader
        if stream is not None:
            stream.cancel()
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


_EXPIRED = object()  # what a call's future holds when its deadline passed first


def _expire(answer: asyncio.Future[Any]) -> None:
    if not answer.done():
        answer.set_result(_EXPIRED)


async def _final_code(stream: grpc.aio.StreamStreamCall) -> grpc.StatusCode:
    try:
        return await asyncio.wait_for(stream.code(), 1.0)
    except (TimeoutError, grpc.aio.AioRpcError):
        return grpc.StatusCode.UNKNOWN
