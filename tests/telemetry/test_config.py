"""Telemetry flags: OTEL_* and SPECSERVE_* defaults, validation, and what setup installs."""

from __future__ import annotations

import argparse

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from specserve.orchestrator import config as orchestrator_config
from specserve.serving.cli_args import add_server_arguments, server_options
from specserve.telemetry.config import (
    TelemetryConfig,
    TracingConfig,
    add_telemetry_arguments,
    telemetry_config,
)
from specserve.telemetry.tracing import (
    ServiceIdentity,
    client_interceptors,
    make_exporter,
    make_provider,
    resource_for,
    server_interceptors,
    setup_tracing,
)


def parse(argv: list[str], env: dict[str, str]) -> TelemetryConfig:
    parser = argparse.ArgumentParser()
    add_telemetry_arguments(parser, env)
    return telemetry_config(parser.parse_args(argv))


def test_defaults_are_off() -> None:
    cfg = parse([], {})
    assert cfg.tracing == TracingConfig()
    assert not cfg.tracing.enabled and cfg.metrics_port is None
    assert cfg.logs.format == "text" and cfg.logs.level == "INFO"
    assert server_interceptors(cfg.tracing) == [] and client_interceptors(cfg.tracing) == []
    assert setup_tracing(cfg.tracing, ServiceIdentity("draft", "m")) is None


def test_standard_otel_variables_are_the_defaults() -> None:
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "OTEL_SERVICE_NAME": "edge-draft",
        "SPECSERVE_METRICS_PORT": "9100",
        "SPECSERVE_LOG_FORMAT": "json",
    }
    cfg = parse([], env)
    assert cfg.tracing == TracingConfig("otlp", "http/protobuf", None, 0.25, "edge-draft")
    assert cfg.metrics_port == 9100 and cfg.logs.format == "json"
    # The traces-specific protocol wins over the general one; SPECSERVE_ over OTEL_; flags win.
    env |= {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "SPECSERVE_TRACE_EXPORTER": "console"}
    assert parse([], env).tracing.protocol == "grpc"
    assert parse([], env).tracing.exporter == "console"
    cfg = parse(["--trace-exporter", "none", "--trace-sample-ratio", "1"], env)
    assert not cfg.tracing.enabled and cfg.tracing.sample_ratio == 1.0


@pytest.mark.parametrize(
    "bad",
    [
        {"exporter": "jaeger"},
        {"protocol": "http/json"},
        {"sample_ratio": 1.5},
        {"sample_ratio": -0.1},
    ],
)
def test_bad_tracing_values_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        TracingConfig(**bad)  # type: ignore[arg-type]


def test_every_server_takes_the_telemetry_flags() -> None:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser, kv_budget="1MiB", env={})
    args = parser.parse_args(["--trace-exporter", "console", "--metrics-port", "0"])
    options = server_options(args)
    assert options.telemetry.tracing.exporter == "console"
    assert options.telemetry.metrics_port == 0
    parser = argparse.ArgumentParser()
    orchestrator_config.add_arguments(parser, env={})
    args = parser.parse_args(["--target", "127.0.0.1:1", "--trace-exporter", "otlp"])
    cfg = orchestrator_config.from_args(args)
    assert cfg.server.telemetry.tracing.exporter == "otlp"
    assert cfg.metrics_port is None and cfg.model_name == "specserve"


def test_resource_names_pool_model_and_replica() -> None:
    identity = ServiceIdentity("target", "tiny:3", "10.0.0.7:50052")
    attrs = resource_for(TracingConfig("console"), identity).attributes
    assert attrs["service.name"] == "specserve-target"
    assert attrs["service.instance.id"] == "10.0.0.7:50052"
    assert attrs["specserve.pool"] == "target" and attrs["specserve.model"] == "tiny:3"
    named = resource_for(TracingConfig("console", service_name="verifier"), identity)
    assert named.attributes["service.name"] == "verifier"
    assert ServiceIdentity("draft", "m").instance_id()  # hostname:pid when no replica id


def test_sampling_is_by_ratio_for_new_traces_and_follows_a_sampled_caller() -> None:
    config = TracingConfig("console", sample_ratio=0.0)
    provider = make_provider(config, ServiceIdentity("target", "m"))
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("new trace") as root:  # ratio 0: dropped
        assert not root.is_recording()
    # A caller that sampled its trace (e.g. the orchestrator, over gRPC): kept here too.
    caller = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(1))
    ctx = trace.set_span_in_context(NonRecordingSpan(caller))
    with tracer.start_as_current_span("child", context=ctx) as child:
        assert child.is_recording()
    [kept] = exporter.get_finished_spans()
    assert kept.name == "child" and kept.context.trace_id == 0x1234
    assert kept.resource.attributes["specserve.pool"] == "target"
    everything = make_provider(TracingConfig("console"), ServiceIdentity("target", "m"))
    with everything.get_tracer("t").start_as_current_span("new trace") as root:
        assert root.is_recording()


def test_the_exporter_follows_protocol_and_endpoint() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    http = make_exporter(TracingConfig("otlp", "http/protobuf", "http://collector:4318/v1/traces"))
    assert isinstance(http, HttpExporter)
    assert http._endpoint == "http://collector:4318/v1/traces"
    assert isinstance(make_exporter(TracingConfig("otlp", "grpc")), GrpcExporter)
    assert isinstance(make_exporter(TracingConfig("console")), ConsoleSpanExporter)
