"""OpenTelemetry tracing: one :func:`setup_tracing` per process, and the instrumentation.

:func:`setup_tracing` installs the global tracer provider: a resource naming the
service, its pool (``draft``, ``target``, ``orchestrator``), replica and model;
a parent-based trace-id-ratio sampler; and a batch span processor feeding the
configured exporter (OTLP over gRPC or HTTP, or the console). With the exporter
``none`` it installs nothing: the API's no-op tracer then makes every span call
free, and :func:`server_interceptors` / :func:`client_interceptors` return no
interceptors.

One request is one trace because the context travels with every call: the gRPC
client interceptors (on the orchestrator's channels) inject the W3C
``traceparent`` header, the server interceptor (on every server) extracts it,
and model work that runs on an executor thread re-attaches the caller's
context there (:mod:`specserve.serving.executor`). :func:`instrument_redis`
wraps one store client, so each Redis command or pipeline is a span as well.
Health checks and reflection are left out of traces. The data-plane sockets are
not gRPC: each call on them is traced on its own, its context carried in the call's
header (:mod:`specserve.serving.call_stream`, :mod:`specserve.serving.replica_connection`).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from specserve.telemetry.config import TracingConfig

log = logging.getLogger(__name__)

# Calls that would only clutter traces: health probes and reflection.
UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")


@dataclass(frozen=True)
class ServiceIdentity:
    """Who emits the spans: the resource attributes of one process."""

    pool: str  # "draft", "target" or "orchestrator"
    model: str  # what it serves (a model spec, or the served model name)
    replica_id: str = ""  # empty = <hostname>:<pid>

    def instance_id(self) -> str:
        return self.replica_id or f"{socket.gethostname()}:{os.getpid()}"


def resource_for(config: TracingConfig, identity: ServiceIdentity) -> Resource:
    """The process's resource; ``OTEL_RESOURCE_ATTRIBUTES`` adds to it (ours win)."""
    return Resource.create(
        {
            "service.name": config.service_name or f"specserve-{identity.pool}",
            "service.namespace": "specserve",
            "service.instance.id": identity.instance_id(),
            "specserve.pool": identity.pool,
            "specserve.model": identity.model,
        }
    )


def make_exporter(config: TracingConfig) -> SpanExporter:
    """The span exporter the config names (OTLP reads OTEL_EXPORTER_OTLP_* for the rest)."""
    if config.exporter == "console":
        return ConsoleSpanExporter()
    assert config.exporter == "otlp", config.exporter
    kwargs: dict[str, Any] = {}
    if config.endpoint:
        kwargs["endpoint"] = config.endpoint
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(**kwargs)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpOTLPSpanExporter,
    )

    return HttpOTLPSpanExporter(**kwargs)


def make_provider(config: TracingConfig, identity: ServiceIdentity) -> TracerProvider:
    """A provider with the process's resource and sampler (no processor, not installed)."""
    return TracerProvider(
        resource=resource_for(config, identity),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
    )


def setup_tracing(config: TracingConfig, identity: ServiceIdentity) -> TracerProvider | None:
    """Install the process's tracer provider; None (and nothing installed) when off.

    Call once, before the servers start. The caller shuts the provider down at
    exit so that the spans still queued are exported.
    """
    if not config.enabled:
        return None
    provider = make_provider(config, identity)
    provider.add_span_processor(BatchSpanProcessor(make_exporter(config)))
    trace.set_tracer_provider(provider)
    log.info(
        "tracing: %s exporter%s, sample ratio %g",
        config.exporter,
        f" ({config.protocol})" if config.exporter == "otlp" else "",
        config.sample_ratio,
    )
    return provider


def _untraced_filter() -> Any:
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.any_of(*(filters.service_name(s) for s in UNTRACED_SERVICES)))


def server_interceptors(config: TracingConfig) -> list[Any]:
    """Interceptors for a ``grpc.aio`` server: one SERVER span per call (none when off)."""
    if not config.enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(filter_=_untraced_filter())]


def client_interceptors(config: TracingConfig) -> list[Any]:
    """Interceptors for a ``grpc.aio`` channel: one CLIENT span per call, context injected."""
    if not config.enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(filter_=_untraced_filter()))


def instrument_redis(
    client: Any, config: TracingConfig, provider: trace.TracerProvider | None = None
) -> None:
    """Trace every command and pipeline of one ``redis.asyncio`` client (or fakeredis).

    ``provider`` defaults to the global one (the one :func:`setup_tracing` installed).
    """
    if not config.enabled:
        return
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    RedisInstrumentor.instrument_client(client, tracer_provider=provider)
