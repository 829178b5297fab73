"""One call on the data-plane socket, on the model thread: from its frame to its answer.

See :mod:`specserve.serving.socket_plane` for the rules it follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from specserve.engine.errors import InvalidArgument
from specserve.serving.call_stream import call_span
from specserve.serving.errors import status_for
from specserve.serving.executor_job import Done, Job, Submission

if TYPE_CHECKING:
    from specserve.serving.socket_plane import _Connection as Connection

log = logging.getLogger(__name__)


class SocketCallState:
    """One call on a data-plane connection, from its frame to its answer.

    ``connection`` is the :class:`~specserve.serving.socket_plane.SocketPlane`'s
    connection it came on: it writes the answer and frees the call's bytes
    (``finished``). Every method runs on the model thread."""

    def __init__(self, connection: Connection, message: Any) -> None:
        self.connection = connection
        self.message = message
        self.header = message.header
        self.request_id: int = message.header.request_id
        self.answered = False
        self.span: Span | None = None
        self.context: otel_context.Context | None = None
        self.submission: Submission[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        method = self.connection.method
        self.span = call_span(method, self.header, "socket")
        if self.span.get_span_context().is_valid:
            self.context = trace.set_span_in_context(self.span)
        if self.header.timeout_ms:
            loop = self.connection.plane.executor.model_loop
            self.timer = loop.call_later(self.header.timeout_ms / 1000, self.expire)
        try:
            if not self.message.HasField("request"):
                raise InvalidArgument(
                    f"stream call {self.request_id} carries no request: set the message's `request`"
                )
            assert method.prepare is not None
            with self._in_span():
                call = self.submission = method.prepare(self.message.request)
            job = Job(call.op, call.payload, call.key, call.sessions, None, None, call.kind)
            job.context, job.on_done = self.context, self.done
            self.connection.plane.executor.enqueue(job)
        except Exception as error:
            self.fail(error)

    def done(self, value: Done[Any] | BaseException) -> None:
        """The batch's result, on the model thread: answer it (unless answered already)."""
        if self.answered:
            return
        if isinstance(value, BaseException):
            self.fail(value)
            return
        assert self.submission is not None
        try:
            with self._in_span():
                response = self.submission.finish(value)
            answer = self.connection.method.answer(self.request_id, response)
        except Exception as error:
            self.fail(error)
            return
        self._answer(answer, grpc.StatusCode.OK, "")

    def fail(self, error: BaseException) -> None:
        code, text = status_for(error)
        if code == grpc.StatusCode.INTERNAL:
            log.error(
                "%s (socket call %d) failed",
                self.connection.method.unary_method,
                self.request_id,
                exc_info=error,
            )
        refusal = self.connection.method.refusal(self.request_id, code, text)
        self._answer(refusal.SerializeToString(), code, text)

    def expire(self) -> None:
        """Past the call's ``timeout_ms``: answered DEADLINE_EXCEEDED."""
        self.timer = None
        code = grpc.StatusCode.DEADLINE_EXCEEDED
        text = f"the call's deadline of {self.header.timeout_ms} ms passed before it was answered"
        refusal = self.connection.method.refusal(self.request_id, code, text)
        self._answer(refusal.SerializeToString(), code, text)

    def abandon(self) -> None:
        """The connection is gone: end the span, free the bytes; the batch's result (if it
        still comes) is dropped."""
        if not self.answered:
            self._settle(grpc.StatusCode.CANCELLED, "the connection closed")
            self.connection.finished(self)

    def _answer(self, payload: bytes, code: grpc.StatusCode, text: str) -> None:
        """Settle the call (its span ended, its bytes freed: before the client can read
        the answer), then write the answer."""
        if self.answered:
            return
        self._settle(code, text)
        self.connection.write(payload)
        self.connection.finished(self)

    def _settle(self, code: grpc.StatusCode, text: str) -> None:
        self.answered = True
        self.connection.budget.done(self)
        if self.timer is not None:
            self.timer.cancel()
        span = self.span
        if span is not None and span.is_recording():
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code != grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, f"{code.name}: {text}"))
            span.end()

    def _in_span(self) -> contextlib.AbstractContextManager[object]:
        if self.context is None:
            return contextlib.nullcontext()
        return _attached(self.context)


@contextlib.contextmanager
def _attached(context: otel_context.Context) -> Any:
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)
