"""Serving a unary method's calls over one long-lived bidirectional stream.

The data plane (``DraftService.ProposeStream``, ``TargetService.VerifyStream``)
carries many calls on one stream, so that a call costs one message each way
instead of a whole unary RPC. Framing (``specserve/v1/*.proto``): a request
message holds a :class:`StreamCallHeader` (request id, the call's own deadline
in ms, W3C ``traceparent`` / ``tracestate``) and the unary request; the answer
holds the request id and either the unary response or a ``StreamCallError``
(status code and sentence).

:func:`serve_call_stream` reads the stream and runs each call in a task of its
own, through the very coroutine the unary method runs (``StreamMethod.handle``),
so calls from several streams and unary callers still coalesce into one batch on
the model thread. Per call, as for a unary call:

* its error is mapped by :func:`~specserve.serving.errors.status_for` and
  answered under its request id; the stream stays open;
* a message without a request, or with a request id already in flight, is
  answered ``INVALID_ARGUMENT``; more than ``max_in_flight`` calls at once are
  answered ``RESOURCE_EXHAUSTED``;
* past its ``timeout_ms`` it is answered ``DEADLINE_EXCEEDED`` (its work is
  abandoned as a cancelled unary call's is);
* it runs in a SERVER span named after the unary method, child of the
  message's trace context (the stream itself has no span: the tracing
  interceptors leave the stream methods out, see
  :mod:`specserve.telemetry.tracing`); a call whose trace the caller did not
  sample runs in the caller's context instead, with no span of its own (the
  parent-based sampler would drop it), so its log lines still name the trace.

Bytes that do not parse as the request message (or exceed the method's byte
limit) end the whole stream with ``INVALID_ARGUMENT``: without a request id
there is no call to answer. Answers go out in the order calls finish. When the
client half-closes, or the server begins a graceful shutdown, the calls in flight
are answered and the stream ends OK (the client fails what it sent after that as
lost, and reopens); when the client cancels (or the stream breaks), the calls in
flight are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
import grpc.aio
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from specserve.engine.errors import InvalidArgument
from specserve.serving.errors import status_for
from specserve.serving.malformed import Malformed, Oversized, refuse
from specserve.serving.stream_frames import answer_bytes
from specserve.v1 import common_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")

# Calls one stream may have in flight; past it a call is answered RESOURCE_EXHAUSTED.
# The orchestrator has at most one round per session in flight, so this is far above
# what it sends (and bounds what one client can make a replica hold).
MAX_IN_FLIGHT = 4096
# And request bytes: one stream's calls in flight hold at most this many maximal
# messages (``--max-message-bytes``) before it is read no further (InFlightBytes).
IN_FLIGHT_FRAMES = 4
# A replica's data-plane streams and sockets together, by default (``--max-in-flight-bytes``).
REPLICA_IN_FLIGHT_FRAMES = 16


@dataclass(frozen=True)
class StreamMethod(Generic[Req, Resp]):
    """One stream method: what a call runs, and how its answers are built."""

    unary_method: str  # full name of the unary twin, e.g. "/specserve.v1.DraftService/Propose"
    handle: Callable[[Req], Awaitable[Resp]]  # the unary method's own path
    answer_type: Callable[..., Any]  # the stream's response message class
    max_in_flight: int = MAX_IN_FLIGHT
    # per transport ("stream": the gRPC stream method; "socket": the data-plane socket)
    span_attributes: dict[str, dict[str, str]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        service, _, name = self.unary_method.lstrip("/").rpartition("/")
        attributes = {
            transport: {
                "rpc.system": "grpc",
                "rpc.service": service,
                "rpc.method": name,
                "specserve.transport": transport,
            }
            for transport in ("stream", "socket")
        }
        object.__setattr__(self, "span_attributes", attributes)  # built once, not per call

    def answer(self, request_id: int, response: Resp) -> bytes:
        """The answer's bytes (no copy of ``response`` into a wrapper message)."""
        return answer_bytes(request_id, response)  # type: ignore[arg-type]

    def refusal(self, request_id: int, code: grpc.StatusCode, message: str) -> Any:
        error = common_pb2.StreamCallError(code=code.value[0], message=message)
        return self.answer_type(request_id=request_id, error=error)


def _parent_context(header: common_pb2.StreamCallHeader) -> otel_context.Context:
    """The caller's trace context from the header (an empty context when not traced)."""
    if not header.traceparent:
        return otel_context.Context()
    carrier = {"traceparent": header.traceparent}
    if header.tracestate:
        carrier["tracestate"] = header.tracestate
    return propagate.extract(carrier, context=otel_context.Context())


def _unsampled_caller(traceparent: str) -> SpanContext | None:
    """The caller's span context if ``traceparent`` is a W3C version-00 header of a trace
    the caller did not sample; None otherwise (absent, sampled, or for the propagator to
    judge)."""
    parts = traceparent.split("-")
    if len(parts) != 4 or parts[0] != "00" or len(parts[3]) != 2:
        return None
    trace_hex, span_hex, flags_hex = parts[1], parts[2], parts[3]
    if len(trace_hex) != 32 or len(span_hex) != 16:
        return None
    try:
        trace_id, span_id, flags = int(trace_hex, 16), int(span_hex, 16), int(flags_hex, 16)
    except ValueError:
        return None
    if flags & TraceFlags.SAMPLED or not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))


def _call_span(
    method: StreamMethod[Req, Resp], header: common_pb2.StreamCallHeader, transport: str
) -> contextlib.AbstractContextManager[Span]:
    """What a call runs in: its SERVER span, child of the caller's context; or, where the
    caller did not sample its trace, the caller's span made current, no span made (every
    process's sampler is parent-based, :mod:`specserve.telemetry.tracing`: it would drop
    the call's span after parsing the header and making the span's ids)."""
    unsampled = _unsampled_caller(header.traceparent) if header.traceparent else None
    if unsampled is not None:
        return trace.use_span(
            NonRecordingSpan(unsampled), record_exception=False, set_status_on_exception=False
        )
    return tracer.start_as_current_span(
        method.unary_method,
        context=_parent_context(header),
        kind=SpanKind.SERVER,
        attributes=method.span_attributes[transport],
        record_exception=False,
        set_status_on_exception=False,
    )


async def _run_call(
    method: StreamMethod[Req, Resp], message: Any, transport: str = "stream"
) -> Any:
    """One call of the stream, answered: its response or its error, under its request id."""
    header = message.header
    request_id = header.request_id
    with _call_span(method, header, transport) as span:
        timeout_s = header.timeout_ms / 1000 if header.timeout_ms else None
        deadline = asyncio.timeout(timeout_s)
        try:
            if not message.HasField("request"):
                raise InvalidArgument(
                    f"stream call {request_id} carries no request: set the message's `request`"
                )
            async with deadline:
                response = await method.handle(message.request)
        except TimeoutError as error:
            if deadline.expired():
                code = grpc.StatusCode.DEADLINE_EXCEEDED
                text = (
                    f"the call's deadline of {header.timeout_ms} ms passed before it was answered"
                )
            else:
                code, text = status_for(error)
        except Exception as error:
            code, text = status_for(error)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s (stream call %d) failed", method.unary_method, request_id)
        else:
            span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.OK.value[0])
            return method.answer(request_id, response)
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {text}"))
        return method.refusal(request_id, code, text)


class InFlightBytes:
    """The request bytes of a stream's calls in flight, and a budget: past it the stream
    is read no further (the client's writes wait on the transport's flow control) until
    answers free some; one call always gets in.

    ``replica``: the budget every data-plane stream and socket of the replica shares
    (``--max-in-flight-bytes``). A stream also waits for room there, so many
    connections together cannot make a replica hold more than it either; where the
    replica holds nothing, one call gets in."""

    def __init__(self, budget: int, replica: InFlightBytes | None = None) -> None:
        self.budget = budget
        self.replica = replica
        self._held: dict[int, int] = {}  # id() of a call message in flight -> its bytes
        self._total = 0
        self._freed = asyncio.Event()

    @property
    def total(self) -> int:
        """Request bytes held by the calls in flight."""
        return self._total

    def _full(self) -> bool:
        return bool(self._held) and self._total >= self.budget

    async def room(self) -> None:
        while self._full():
            self._freed.clear()
            await self._freed.wait()
        if self.replica is not None:
            await self.replica.room()

    def try_hold(self, message: Any, size: int) -> bool:
        """:meth:`hold` if there is room now (as :meth:`room` would let it in); False if
        not: for a call whose bytes are already read (a unary call), to refuse it."""
        if self._full() or (self.replica is not None and self.replica._full()):
            return False
        self.hold(message, size)
        return True

    def hold(self, message: Any, size: int) -> None:
        self._held[id(message)] = size
        self._total += size
        if self.replica is not None:
            self.replica.hold(message, size)

    def done(self, message: Any) -> None:
        self._total -= self._held.pop(id(message), 0)
        self._freed.set()
        if self.replica is not None:
            self.replica.done(message)


async def serve_call_stream(
    method: StreamMethod[Req, Resp],
    context: grpc.aio.ServicerContext,
    draining: asyncio.Event | None = None,
    bytes_in_flight: int | None = None,
    replica_budget: InFlightBytes | None = None,
) -> None:
    """Serve one gRPC stream until the client half-closes it, or ``draining`` is set (the
    server is shutting down): then read no more, answer the calls in flight and end the
    stream OK. If it ends otherwise (the client cancels, the stream breaks), cancel the
    calls in flight. ``bytes_in_flight``: the request bytes its calls in flight may hold
    before it is read no further (:class:`InFlightBytes`; None: no limit but
    ``max_in_flight`` calls); ``replica_budget``: the replica's, shared with its other
    streams and sockets. See the module docstring."""
    budget = None
    if bytes_in_flight or replica_budget is not None:
        budget = InFlightBytes(bytes_in_flight or sys.maxsize, replica_budget)

    async def read() -> Any:
        if budget is not None:
            await budget.room()
        message = await context.read()
        if message is grpc.aio.EOF:
            return None
        if budget is not None and not isinstance(message, Malformed | Oversized):
            budget.hold(message, message.ByteSize())
        return message

    async def refuse_stream(bad: Malformed | Oversized) -> None:
        await refuse(method.unary_method + "Stream", bad, context)  # raises: ends the stream

    done = budget.done if budget is not None else None
    await serve_calls(method, read, context.write, refuse_stream, draining, "stream", done)


async def serve_calls(
    method: StreamMethod[Req, Resp],
    read: Callable[[], Awaitable[Any]],
    write: Callable[[Any], Awaitable[None]],
    refuse_stream: Callable[[Malformed | Oversized], Awaitable[None]],
    draining: asyncio.Event | None = None,
    transport: str = "stream",
    done: Callable[[Any], None] | None = None,
) -> None:
    """The calls of one stream, whatever carries it: ``read()`` gives the next call
    message (None at the client's end of the stream, :class:`Malformed` /
    :class:`Oversized` for bytes that are not one), ``write(answer)`` sends an answer
    (bytes or message; one write at a time is made), ``refuse_stream(bad)`` ends the
    stream over bytes that are not a call (it may raise; after it no more is read);
    ``transport`` names the carrier in the calls' spans (``specserve.transport``);
    ``done(message)`` hears of each call message once it was answered, refused or
    cancelled. Returns once the stream ended as :func:`serve_call_stream` describes."""
    in_flight: dict[int, asyncio.Task[None]] = {}
    write_lock = asyncio.Lock()  # one write at a time on the stream

    async def answer(message: Any) -> None:
        async with write_lock:
            await write(message)

    async def call(message: Any) -> None:
        try:
            await answer(await _run_call(method, message, transport))
        finally:
            in_flight.pop(message.header.request_id, None)
            if done is not None:
                done(message)

    async def read_calls() -> None:
        while True:
            message = await read()
            if message is None:
                return
            if isinstance(message, Malformed | Oversized):
                await refuse_stream(message)
                return
            request_id = message.header.request_id
            if request_id in in_flight:
                await answer(
                    method.refusal(
                        request_id,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"stream call {request_id} is already in flight on this stream: "
                        "give each call in flight its own request id",
                    )
                )
            elif len(in_flight) >= method.max_in_flight:
                await answer(
                    method.refusal(
                        request_id,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"this stream has {len(in_flight)} calls in flight, the most it takes; "
                        "wait for answers before sending more",
                    )
                )
            else:
                in_flight[request_id] = asyncio.get_running_loop().create_task(call(message))
                continue
            if done is not None:  # refused at once
                done(message)

    loop = asyncio.get_running_loop()
    reader = loop.create_task(read_calls())
    # A graceful shutdown must not wait out its grace for a stream that never ends.
    stop = loop.create_task(draining.wait()) if draining is not None else None
    try:
        await asyncio.wait([reader] + ([stop] if stop else []), return_when=FIRST_COMPLETED)
        if reader.done():
            reader.result()  # the refusal of bytes that do not parse ends the stream here
        else:
            reader.cancel()
        if in_flight:
            await asyncio.gather(*in_flight.values(), return_exceptions=True)
    finally:
        for task in (reader, stop, *in_flight.values()):
            if task is not None:
                task.cancel()
