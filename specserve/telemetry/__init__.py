"""Tracing, metrics and logs shared by every specserve process.

* :mod:`~specserve.telemetry.config` — the flags and ``OTEL_*`` variables -> one frozen
  :class:`~specserve.telemetry.config.TelemetryConfig` per process;
* :mod:`~specserve.telemetry.tracing` — :func:`~specserve.telemetry.tracing.setup_tracing`
  (resource, sampler, exporter) and the gRPC and Redis instrumentation;
* :mod:`~specserve.telemetry.logs` — log lines with trace and span ids, text or JSON;
* :mod:`~specserve.telemetry.process` — all three once per process, and their shutdown;
* :mod:`~specserve.telemetry.histogram` and :mod:`~specserve.telemetry.prometheus` —
  plain counts kept by the servers, named and served at scrape time;
* :mod:`~specserve.telemetry.attributes` — span attribute names (GenAI conventions);
* :mod:`~specserve.telemetry.receiver` — a small OTLP/gRPC trace receiver for tests
  and benchmarks.
"""
