"""Telemetry settings: one frozen :class:`TelemetryConfig` per process, built from flags.

Every server (draft, target, orchestrator) takes the same flags. Their defaults
come from the standard OpenTelemetry variables where one exists, else from
``SPECSERVE_*``; the environment is read here, while the parser is built, and
nowhere deeper:

==========================  ======================================  ================
flag                        environment                             default
==========================  ======================================  ================
``--trace-exporter``        ``SPECSERVE_TRACE_EXPORTER``, else      none
                            ``OTEL_TRACES_EXPORTER``
``--otlp-protocol``         ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``,  grpc
                            else ``OTEL_EXPORTER_OTLP_PROTOCOL``
``--otlp-endpoint``         read by the exporter:                   the exporter's
                            ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``
``--trace-sample-ratio``    ``OTEL_TRACES_SAMPLER_ARG``             1.0
``--service-name``          ``OTEL_SERVICE_NAME``                   specserve-<pool>
``--log-format``            ``SPECSERVE_LOG_FORMAT``                text
``--log-level``             ``SPECSERVE_LOG_LEVEL``                 INFO
``--metrics-port``          ``SPECSERVE_METRICS_PORT``              off
==========================  ======================================  ================

The OTLP exporters also read the rest of the ``OTEL_EXPORTER_OTLP_*`` family
themselves (headers, certificates, compression, timeout), and the batch span
processor its ``OTEL_BSP_*`` settings.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

EXPORTERS = ("none", "otlp", "console")
PROTOCOLS = ("grpc", "http/protobuf")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class TracingConfig:
    """Where spans go and how many are kept."""

    exporter: str = "none"  # "none": no tracer provider, no instrumentation, no cost
    protocol: str = "grpc"  # OTLP transport: "grpc" or "http/protobuf"
    endpoint: str | None = None  # None = the exporter's own (OTEL_EXPORTER_OTLP_* or default)
    sample_ratio: float = 1.0  # of new traces; a sampled parent's children are always kept
    service_name: str | None = None  # None = "specserve-<pool>"

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ValueError(
                f"trace exporter must be one of {', '.join(EXPORTERS)}, got {self.exporter!r}"
            )
        if self.protocol not in PROTOCOLS:
            raise ValueError(
                f"OTLP protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}"
            )
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"trace sample ratio must be in [0, 1], got {self.sample_ratio}")

    @property
    def enabled(self) -> bool:
        return self.exporter != "none"


@dataclass(frozen=True)
class LogConfig:
    format: str = "text"  # "text" or "json" (one object per line)
    level: str = "INFO"

    def __post_init__(self) -> None:
        if self.format not in LOG_FORMATS:
            raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}")
        if self.level not in LOG_LEVELS:
            raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}")


@dataclass(frozen=True)
class TelemetryConfig:
    """Tracing, logs and the Prometheus port of one process."""

    tracing: TracingConfig = field(default_factory=TracingConfig)
    logs: LogConfig = field(default_factory=LogConfig)
    metrics_port: int | None = None  # None = no metrics endpoint; 0 = any free port

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics port must be in 0..65535, got {self.metrics_port}")


def _protocol_default(env: Mapping[str, str]) -> str:
    return env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )


def add_telemetry_arguments(
    parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None
) -> None:
    """Add the telemetry flags (a "telemetry" group) with defaults from ``env``."""
    env = os.environ if env is None else env
    g = parser.add_argument_group("telemetry")
    g.add_argument(
        "--trace-exporter",
        choices=EXPORTERS,
        default=env.get("SPECSERVE_TRACE_EXPORTER") or env.get("OTEL_TRACES_EXPORTER") or "none",
        help="where spans go: OTLP (endpoint from OTEL_EXPORTER_OTLP_*), console, or none",
    )
    g.add_argument(
        "--otlp-protocol",
        choices=PROTOCOLS,
        default=_protocol_default(env),
        help="OTLP transport (default grpc, as OTEL_EXPORTER_OTLP_PROTOCOL says)",
    )
    g.add_argument(
        "--otlp-endpoint",
        default=None,
        help="OTLP traces endpoint, overriding OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT "
        "(grpc: http://host:4317; http/protobuf: the full URL, http://host:4318/v1/traces)",
    )
    g.add_argument(
        "--trace-sample-ratio",
        type=float,
        default=float(env.get("OTEL_TRACES_SAMPLER_ARG") or 1.0),
        help="fraction of new traces kept (parent-based: a sampled caller's spans are kept)",
    )
    g.add_argument(
        "--service-name",
        default=env.get("OTEL_SERVICE_NAME") or None,
        help="service.name of this process's spans (default specserve-<pool>)",
    )
    g.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=env.get("SPECSERVE_LOG_FORMAT", "text"),
        help="text lines or one JSON object per line; both carry trace and span ids",
    )
    g.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=env.get("SPECSERVE_LOG_LEVEL", "INFO").upper(),
    )
    metrics = env.get("SPECSERVE_METRICS_PORT")
    g.add_argument(
        "--metrics-port",
        type=int,
        default=int(metrics) if metrics else None,
        help="serve Prometheus metrics over HTTP on this port (0 = any free port; "
        "default: no metrics endpoint)",
    )


def telemetry_config(args: argparse.Namespace) -> TelemetryConfig:
    """The telemetry config the parsed flags describe (raises ValueError on bad values)."""
    return TelemetryConfig(
        tracing=TracingConfig(
            exporter=args.trace_exporter,
            protocol=args.otlp_protocol,
            endpoint=args.otlp_endpoint or None,
            sample_ratio=args.trace_sample_ratio,
            service_name=args.service_name,
        ),
        logs=LogConfig(format=args.log_format, level=args.log_level),
        metrics_port=args.metrics_port,
    )
