"""The executor's telemetry: a coalesced batch's span joins its callers' traces; stats count it."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specserve.serving import executor as executor_module
from tests.services.conftest import run
from tests.services.test_executor import Backend, started


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """Spans the executor makes go here (its module tracer, not the global provider)."""
    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    monkeypatch.setattr(executor_module, "tracer", provider.get_tracer("test"))
    return exp


def test_coalesced_batch_span_parents_to_the_first_caller_and_links_the_others(
    exporter: InMemorySpanExporter,
) -> None:
    tracer = executor_module.tracer

    async def call(ex, name: str, payload: str):  # type: ignore[no-untyped-def]
        with tracer.start_as_current_span(name) as span:
            done = await ex.submit(
                Backend.echo, payload, key="v", sessions=[payload], kind="verify"
            )
            return span.get_span_context(), done

    async def go() -> None:
        ex, backend, _ = await started(window_s=0.3)
        (first, d1), (second, d2) = await asyncio.gather(
            call(ex, "rpc-a", "a"), call(ex, "rpc-b", "b")
        )
        assert backend.batches == [["a", "b"]]  # one forward for both
        assert d1.queue_s >= 0 and d2.queue_s >= 0 and d1.batch_jobs == 2
        # Untraced callers and calls without a kind make no span.
        await ex.submit(Backend.echo, "c", key="v", sessions=["c"], kind="verify")
        with tracer.start_as_current_span("rpc-release"):
            await ex.submit(Backend.echo, "d", sessions=["d"])
        await ex.close()
        batch = [s for s in exporter.get_finished_spans() if s.name == "specserve.test.verify"]
        assert len(batch) == 1
        [span] = batch
        assert span.parent is not None and span.parent.span_id == first.span_id
        assert span.context.trace_id == first.trace_id
        assert [ln.context.span_id for ln in span.links] == [second.span_id]
        assert span.attributes["specserve.batch_size"] == 2
        assert span.attributes["specserve.batch_calls"] == 2
        assert span.attributes["specserve.op"] == "verify"
        # Stats: two batches of kind "verify" (sizes 2 and 1), three waits; "release" uncounted.
        [(kind, stats)] = ex.stats.items()
        assert kind == "verify"
        sizes = stats.batch_sessions.snapshot()
        assert sizes.count == 2 and sizes.sum == 3
        assert stats.queue_wait_s.snapshot().count == 3
        assert stats.compute_s.snapshot().count == 2

    run(go())
