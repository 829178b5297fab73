"""A data-plane call's span: a child of the caller's sampled context, none for an unsampled one.

The handler runs in the context the call made current; its log lines name that
span (:mod:`specserve.telemetry.logs`).
"""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind

from specserve.serving import call_stream
from specserve.serving.call_stream import StreamMethod
from specserve.serving.data_frames import LENGTH_BYTES, Call, parse_answer
from specserve.v1 import common_pb2, draft_pb2
from tests.services.conftest import run

TRACE_ID, CALLER_SPAN_ID = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331


def traceparent(flags: str) -> str:
    return f"00-{TRACE_ID:032x}-{CALLER_SPAN_ID:016x}-{flags}"


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """Spans the data-plane calls make go here (their module tracer, not the global provider)."""
    exp = InMemorySpanExporter()
    provider = TracerProvider()  # parent-based, as every process's
    provider.add_span_processor(SimpleSpanProcessor(exp))
    monkeypatch.setattr(call_stream, "tracer", provider.get_tracer("test"))
    return exp


def call(header: common_pb2.CallHeader) -> SpanContext:
    """Run one Propose call with ``header``; the span context its handler ran in."""
    seen: list[SpanContext] = []

    async def handle(request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        seen.append(trace.get_current_span().get_span_context())
        return draft_pb2.ProposeResponse(replica_id="r")

    method = StreamMethod("/specserve.v1.DraftService/Propose", handle)
    frame = run(call_stream._run_call(method, Call(header, draft_pb2.ProposeRequest())))
    answer = parse_answer(frame[LENGTH_BYTES:], draft_pb2.ProposeResponse)
    assert answer.response.replica_id == "r"
    [context] = seen
    return context


def test_a_sampled_caller_gets_a_server_span_under_its_own(
    exporter: InMemorySpanExporter,
) -> None:
    context = call(common_pb2.CallHeader(request_id=1, traceparent=traceparent("01")))
    [span] = exporter.get_finished_spans()
    assert span.name == "/specserve.v1.DraftService/Propose" and span.kind == SpanKind.SERVER
    assert span.parent is not None and span.parent.span_id == CALLER_SPAN_ID
    assert span.context.trace_id == TRACE_ID and context.span_id == span.context.span_id
    assert span.attributes["rpc.grpc.status_code"] == 0


def test_an_unsampled_caller_gets_no_span_and_its_context_is_current(
    exporter: InMemorySpanExporter,
) -> None:
    context = call(common_pb2.CallHeader(request_id=2, traceparent=traceparent("00")))
    assert exporter.get_finished_spans() == ()
    assert (context.trace_id, context.span_id) == (TRACE_ID, CALLER_SPAN_ID)
    assert not context.trace_flags.sampled


@pytest.mark.parametrize("header", ["", "00-xyz-abc-00", f"00-{0:032x}-{1:016x}-00"])
def test_a_caller_without_a_readable_context_gets_a_root_span(
    exporter: InMemorySpanExporter, header: str
) -> None:
    context = call(common_pb2.CallHeader(request_id=3, traceparent=header))
    [span] = exporter.get_finished_spans()
    assert span.parent is None and context.span_id == span.context.span_id
