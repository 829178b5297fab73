"""Telemetry of one process: set up once at start, flushed once at exit."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from opentelemetry.sdk.trace import TracerProvider

from specserve.telemetry.config import TelemetryConfig
from specserve.telemetry.logs import setup_logging
from specserve.telemetry.tracing import ServiceIdentity, setup_tracing

log = logging.getLogger(__name__)


@dataclass
class ProcessTelemetry:
    """What :func:`setup_telemetry` installed; :meth:`shutdown` exports what is queued."""

    config: TelemetryConfig
    provider: TracerProvider | None

    def shutdown(self) -> None:
        """Flush and stop the span exporter (call once, at exit; no-op when tracing is off)."""
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = None


def setup_telemetry(config: TelemetryConfig, identity: ServiceIdentity) -> ProcessTelemetry:
    """Logs first (so that tracing's own messages are formatted), then tracing."""
    setup_logging(config.logs, config.tracing.service_name or f"specserve-{identity.pool}")
    return ProcessTelemetry(config, setup_tracing(config.tracing, identity))
