"""Serving a unary method's calls over one long-lived connection, many at a time.

The data plane (the replicas' data-plane sockets, :mod:`specserve.serving.data_socket`)
carries many calls on one connection, so that a call costs one frame each way
instead of a whole unary RPC. A call is a :class:`~specserve.v1.common_pb2.CallHeader`
(request id, the call's own deadline in ms, W3C ``traceparent`` / ``tracestate``) and
the unary request; the answer is the request id and either the unary response or a
``CallError`` (status code and sentence); :mod:`specserve.serving.data_frames` lays
them out as bytes.

:func:`serve_calls` reads the connection and runs each call in a task of its own,
through the very coroutine the unary method runs (``StreamMethod.handle``), so
calls from several connections and unary callers still coalesce into one batch on
the model thread. Per call, as for a unary call:

* its error is mapped by :func:`~specserve.serving.errors.status_for` and
  answered under its request id; the connection stays open;
* a call with a request id already in flight is answered ``INVALID_ARGUMENT``;
  more than ``max_in_flight`` calls at once are answered ``RESOURCE_EXHAUSTED``;
* past its ``timeout_ms`` it is answered ``DEADLINE_EXCEEDED`` (its work is
  abandoned as a cancelled unary call's is);
* it runs in a SERVER span named after the unary method, child of the
  call's trace context (the connection itself has no span); a call whose trace the
  caller did not sample runs in the caller's context instead, with no span of its
  own (the parent-based sampler would drop it), so its log lines still name the
  trace.

Bytes that do not parse as a call (or exceed the byte limit) end the whole
connection with ``INVALID_ARGUMENT``: without a request id there is no call to
answer. Answers go out in the order calls finish. When the client closes its end,
or the server begins a graceful shutdown, the calls in flight are answered and the
connection ends (the client fails what it sent after that as lost, and reconnects);
when it breaks, the calls in flight are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
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

from specserve.serving.data_frames import Call, answer_frame, error_frame
from specserve.serving.errors import status_for
from specserve.serving.malformed import Malformed, Oversized
from specserve.v1 import common_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")

# Calls one connection may have in flight; past it a call is answered RESOURCE_EXHAUSTED.
# The orchestrator has at most one round per session in flight, so this is far above
# what it sends (and bounds what one client can make a replica hold).
MAX_IN_FLIGHT = 4096
# And request bytes: one connection's calls in flight hold at most this many maximal
# messages (``--max-message-bytes``) before it is read no further (InFlightBytes).
IN_FLIGHT_FRAMES = 4
# A replica's data-plane connections together, by default (``--max-in-flight-bytes``).
REPLICA_IN_FLIGHT_FRAMES = 16


@dataclass(frozen=True)
class StreamMethod(Generic[Req, Resp]):
    """One method served on a data-plane connection: what a call runs, and its span's
    attributes."""

    unary_method: str  # full name of the unary twin, e.g. "/specserve.v1.DraftService/Propose"
    handle: Callable[[Req], Awaitable[Resp]]  # the unary method's own path
    max_in_flight: int = MAX_IN_FLIGHT
    span_attributes: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        service, _, name = self.unary_method.lstrip("/").rpartition("/")
        attributes = {
            "rpc.system": "grpc",
            "rpc.service": service,
            "rpc.method": name,
            "specserve.transport": "socket",
        }
        object.__setattr__(self, "span_attributes", attributes)  # built once, not per call


def _parent_context(header: common_pb2.CallHeader) -> otel_context.Context:
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
    method: StreamMethod[Req, Resp], header: common_pb2.CallHeader
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
        attributes=method.span_attributes,
        record_exception=False,
        set_status_on_exception=False,
    )


async def _run_call(method: StreamMethod[Req, Resp], call: Call) -> bytes:
    """One call, answered: the frame of its response or its error, under its request id."""
    header = call.header
    request_id = header.request_id
    with _call_span(method, header) as span:
        timeout_s = header.timeout_ms / 1000 if header.timeout_ms else None
        deadline = asyncio.timeout(timeout_s)
        try:
            async with deadline:
                response = await method.handle(call.request)
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
                log.exception("%s (data-plane call %d) failed", method.unary_method, request_id)
        else:
            span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.OK.value[0])
            return answer_frame(request_id, response)  # type: ignore[arg-type]
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {text}"))
        return error_frame(request_id, code, text)


class InFlightBytes:
    """The request bytes of a connection's calls in flight, and a budget: past it the
    connection is read no further (the client's writes wait on the transport's flow control) until
    answers free some; one call always gets in.

    ``replica``: the budget every data-plane connection of the replica shares
    (``--max-in-flight-bytes``). A connection also waits for room there, so many
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


async def serve_calls(
    method: StreamMethod[Req, Resp],
    read: Callable[[], Awaitable[Call | Malformed | Oversized | None]],
    write: Callable[[bytes], Awaitable[None]],
    refuse_connection: Callable[[Malformed | Oversized], Awaitable[None]],
    draining: asyncio.Event | None = None,
    done: Callable[[Call], None] | None = None,
) -> None:
    """The calls of one connection: ``read()`` gives the next call (None at the client's
    end, :class:`Malformed` / :class:`Oversized` for bytes that are not one),
    ``write(frame)`` sends an answer's frame (one write at a time is made),
    ``refuse_connection(bad)`` ends the connection over bytes that are not a call (after
    it no more is read); ``done(call)`` hears of each call once it was answered,
    refused or cancelled. Returns once the client ended the connection, or ``draining``
    was set and the calls in flight were answered (see the module docstring)."""
    in_flight: dict[int, asyncio.Task[None]] = {}
    write_lock = asyncio.Lock()  # one write at a time on the connection

    async def answer(data: bytes) -> None:
        async with write_lock:
            await write(data)

    async def call(message: Call) -> None:
        try:
            await answer(await _run_call(method, message))
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
                await refuse_connection(message)
                return
            request_id = message.header.request_id
            if request_id in in_flight:
                await answer(
                    error_frame(
                        request_id,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"call {request_id} is already in flight on this connection: "
                        "give each call in flight its own request id",
                    )
                )
            elif len(in_flight) >= method.max_in_flight:
                await answer(
                    error_frame(
                        request_id,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"this connection has {len(in_flight)} calls in flight, the most it "
                        "takes; wait for answers before sending more",
                    )
                )
            else:
                in_flight[request_id] = asyncio.get_running_loop().create_task(call(message))
                continue
            if done is not None:  # refused at once
                done(message)

    loop = asyncio.get_running_loop()
    reader = loop.create_task(read_calls())
    # A graceful shutdown must not wait out its grace for a connection that never ends.
    stop = loop.create_task(draining.wait()) if draining is not None else None
    try:
        await asyncio.wait([reader] + ([stop] if stop else []), return_when=FIRST_COMPLETED)
        if reader.done():
            reader.result()  # the refusal of bytes that do not parse ends the connection here
        else:
            reader.cancel()
        if in_flight:
            await asyncio.gather(*in_flight.values(), return_exceptions=True)
    finally:
        for task in (reader, stop, *in_flight.values()):
            if task is not None:
                task.cancel()
