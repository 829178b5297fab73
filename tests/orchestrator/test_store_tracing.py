"""The Redis instrumentation covers every store call, on fakeredis and on a real Redis.

Each call (a script, a pipelined batch of commits) is one CLIENT span, the child
of whatever span was current: in the orchestrator, the request or the commit phase.
"""

from __future__ import annotations

import asyncio
import uuid

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from specserve.telemetry.config import TracingConfig
from specserve.telemetry.tracing import instrument_redis
from specserve.v1 import generate_pb2, session_pb2
from tests.orchestrator.conftest import StoreFactory


def test_store_calls_are_spans_under_the_current_span(make_store: StoreFactory) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    sids = [uuid.uuid4().hex for _ in range(2)]

    async def body() -> None:
        store = make_store()
        instrument_redis(store.redis, TracingConfig("console"), provider)
        try:
            with tracer.start_as_current_span("request") as request:
                written = [
                    await store.create(
                        session_pb2.SessionRecord(
                            session_id=s,
                            state=generate_pb2.SESSION_STATE_ACTIVE,
                            tokens=[1, 2],
                            turn_starts=[0],
                        )
                    )
                    for s in sids
                ]
                with tracer.start_as_current_span("specserve.commit") as commit:
                    results = await store.commit_many(written)
                    written = [w for _, w in results]
                with tracer.start_as_current_span("specserve.commit") as second:
                    results = await store.commit_many(written, after=written)
            assert all(status.value == "ok" for status, _ in results)
            for s in sids:
                await store.delete(s)
        finally:
            await store.close()
        spans = exporter.get_finished_spans()
        redis = [s for s in spans if s.kind is SpanKind.CLIENT]

        def children(parent):  # type: ignore[no-untyped-def]
            return [s for s in redis if s.parent and s.parent.span_id == parent.context.span_id]

        under_request = children(request)
        # the two creates (the first one also loads the script: NOSCRIPT, SCRIPT LOAD, again)
        assert sum(s.name == "EVALSHA" for s in under_request) >= 2
        under_commit = children(commit)
        [pipeline] = [s for s in under_commit if "EVALSHA" in s.name]
        assert pipeline.attributes["db.redis.pipeline_length"] == 2  # one round trip for both
        # ... and nothing else once the script is loaded (no SCRIPT EXISTS before each)
        [again] = children(second)
        assert "EVALSHA" in again.name and again.attributes["db.redis.pipeline_length"] == 2
        assert all(s.context.trace_id == request.context.trace_id for s in under_commit)
        # Values never reach the spans: the statement is sanitized.
        statements = [str(s.attributes.get("db.statement", "")) for s in redis]
        assert not any(s in text for s in sids for text in statements)

    asyncio.run(body())
