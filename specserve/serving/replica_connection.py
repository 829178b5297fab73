"""The client end of the data plane: many calls to one replica over one connection.

:class:`ReplicaConnection` sends each call as one frame on a long-lived connection to
the replica's data-plane socket (:mod:`specserve.serving.socket_call`; the bytes in
:mod:`specserve.serving.data_frames`) and hands back the answer with the same
request id, so any number of callers share the connection. It
behaves, for its callers, like the unary stub method it replaces:
``await connection.call(request, timeout)`` returns the response or raises
:class:`grpc.aio.AioRpcError` with the code and sentence the unary call would
have ended with, so failure handling written for unary calls applies unchanged.

* The connection opens lazily, on the first call.
* ``timeout`` is the call's deadline: sent in the message (the server gives up
  past it) and waited for here; past it the call raises ``DEADLINE_EXCEEDED``.
  A late answer is dropped.
* A connection that breaks (the replica restarts, the connection drops, the server
  ends it, or it cannot be made: no data port, an unreachable socket) fails every
  call in flight on it with its status (``UNAVAILABLE`` when it ended without
  one), as a lost unary call fails. The next call opens a new connection, after a
  backoff that doubles with breaks in a row
  (``backoff_s`` up to ``max_backoff_s``; an answer resets it); a call that
  cannot wait that long fails ``UNAVAILABLE`` at once.
* A cancelled call is forgotten here; the replica finishes its work and the
  answer is dropped.
* Tracing: each call has its own CLIENT span, named after the unary method, and
  its trace context travels in the call's header (the connection is untraced).
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

from specserve.serving.data_frames import Answer, call_frame
from specserve.serving.socket_call import STATUS_CODES, SocketCall, SocketDial, rpc_error
from specserve.v1 import common_pb2, draft_pb2, target_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class ReplicaConnection(Generic[Req, Resp]):
    """Calls of one method to one replica over one shared data-plane connection.

    ``connect`` opens the connection (a :class:`SocketCall`, or anything with its
    ``write`` / ``read`` / ``done`` / ``cancel`` / ``code``); ``unary_method`` the full
    name of the unary twin (the calls' span name). :meth:`propose` and :meth:`verify`
    build the two the services offer.
    """

    def __init__(
        self,
        connect: Callable[[], SocketCall],
        unary_method: str,
        *,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.connect = connect
        self.unary_method = unary_method
        service, _, name = unary_method.lstrip("/").rpartition("/")
        self._span_attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.opened = 0  # connections opened so far (the first, and each reopening)
        self._ids = itertools.count(1)
        self._connection: SocketCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._write_lock = asyncio.Lock()
        self._breaks = 0  # breaks in a row without an answer in between
        self._reopen_at = 0.0
        self._closed = False

    @classmethod
    def propose(
        cls, channel: grpc.aio.Channel, socket: SocketDial, **backoff: float
    ) -> ReplicaConnection[draft_pb2.ProposeRequest, draft_pb2.ProposeResponse]:
        """Propose calls over the draft replica's data-plane socket (``channel`` asks
        the replica where it is)."""
        return cls._over(
            channel,
            socket,
            "/specserve.v1.DraftService/Propose",
            draft_pb2.ProposeResponse,
            **backoff,
        )

    @classmethod
    def verify(
        cls, channel: grpc.aio.Channel, socket: SocketDial, **backoff: float
    ) -> ReplicaConnection[target_pb2.VerifyRequest, target_pb2.VerifyResponse]:
        """Verify calls over the target replica's data-plane socket (``channel`` asks
        the replica where it is)."""
        return cls._over(
            channel,
            socket,
            "/specserve.v1.TargetService/Verify",
            target_pb2.VerifyResponse,
            **backoff,
        )

    @classmethod
    def _over(
        cls,
        channel: grpc.aio.Channel,
        socket: SocketDial,
        unary_method: str,
        response_type: Any,
        **backoff: float,
    ) -> ReplicaConnection[Any, Any]:
        def open_socket() -> SocketCall:
            return SocketCall(channel, socket, unary_method, response_type)

        return ReplicaConnection(open_socket, unary_method, **backoff)

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
            raise rpc_error(
                grpc.StatusCode.CANCELLED, f"the {self.unary_method} connection is closed"
            )
        end = None if timeout is None else time.monotonic() + timeout
        socket_call = await self._open(end)
        request_id = next(self._ids)
        header = common_pb2.CallHeader(request_id=request_id)
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
            if socket_call.done():  # ended before this call could join it; its reader says why
                await asyncio.sleep(0)
                if not answer.done():
                    raise rpc_error(
                        grpc.StatusCode.UNAVAILABLE, f"the {self.unary_method} connection ended"
                    )
                return self._outcome(answer.result())
            try:
                async with self._write_lock:
                    await socket_call.write(call_frame(header, request))  # type: ignore[arg-type]
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
                if answer.done():  # the reader saw the break first: its error says why
                    return self._outcome(answer.result())
                why = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                raise rpc_error(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the {self.unary_method} connection broke while sending: {why}",
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
                    f"{self.unary_method} got no answer on its connection within {timeout:g} s",
                )
            return self._outcome(message)
        finally:
            if expiry is not None:
                expiry.cancel()
            self._pending.pop(request_id, None)

    def _outcome(self, message: Answer | grpc.aio.AioRpcError) -> Resp:
        if isinstance(message, grpc.aio.AioRpcError):  # the connection broke
            raise message
        if message.error is None:
            return message.response  # type: ignore[no-any-return]
        code = STATUS_CODES.get(message.error.code, grpc.StatusCode.UNKNOWN)
        raise rpc_error(code, message.error.message)

    async def _open(self, end: float | None) -> SocketCall:
        """The open connection; a new one when there is none (after the backoff, if any)."""
        if self._connection is not None:
            return self._connection
        wait = self._reopen_at - time.monotonic()
        if wait > 0:
            if end is not None and time.monotonic() + wait > end:
                raise rpc_error(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the {self.unary_method} connection broke {self._breaks} time(s) in a row; "
                    f"it reopens in {wait:.2f} s, after this call's deadline",
                )
            await asyncio.sleep(wait)
            if self._connection is not None:  # another call reopened it meanwhile
                return self._connection
        socket_call = self.connect()
        self._connection = socket_call
        self.opened += 1
        self._reader = asyncio.get_running_loop().create_task(self._read(socket_call))
        return socket_call

    async def _read(self, socket_call: SocketCall) -> None:
        """Hand each answer to its caller until the connection ends; then fail the rest."""
        why: grpc.aio.AioRpcError | None = None
        try:
            while True:
                message = await socket_call.read()
                if message is grpc.aio.EOF:
                    break
                self._breaks = 0
                answer = self._pending.get(message.request_id)
                if answer is not None and not answer.done():
                    answer.set_result(message)
        except grpc.aio.AioRpcError as e:
            why = e
        except asyncio.CancelledError:
            why = rpc_error(grpc.StatusCode.CANCELLED, f"the {self.unary_method} connection closed")
        finally:
            if self._connection is socket_call:
                self._connection = None
                self._breaks += 1
                backoff = min(self.max_backoff_s, self.backoff_s * 2 ** (self._breaks - 1))
                self._reopen_at = time.monotonic() + backoff
            if why is None:
                code = await _final_code(socket_call)
                why = rpc_error(
                    grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.OK else code,
                    f"the replica ended the {self.unary_method} connection ({code.name})",
                )
            else:
                why = rpc_error(
                    why.code(), f"the {self.unary_method} connection broke: {why.details()}"
                )
            for answer in self._pending.values():
                if not answer.done():
                    answer.set_result(why)
            if self._pending:
                log.info(
                    "%s connection ended with %d calls in flight: %s",
                    self.unary_method,
                    len(self._pending),
                    why.details(),
                )

    async def close(self) -> None:
        """Close the connection; calls in flight fail ``CANCELLED``, later ones too."""
        self._closed = True
        socket_call, reader = self._connection, self._reader
        if socket_call is not None:
            socket_call.cancel()
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


_EXPIRED = object()  # what a call's future holds when its deadline passed first


def _expire(answer: asyncio.Future[Any]) -> None:
    if not answer.done():
        answer.set_result(_EXPIRED)


async def _final_code(socket_call: SocketCall) -> grpc.StatusCode:
    try:
        return await asyncio.wait_for(socket_call.code(), 1.0)
    except (TimeoutError, grpc.aio.AioRpcError):
        return grpc.StatusCode.UNKNOWN
