"""Prometheus metrics of the HTTP layer, per endpoint, served at ``GET /metrics``.

* ``specserve_http_requests_total{endpoint, status}``: answered requests by HTTP status
  (a stream counts when its headers go out; an error inside a stream is counted
  again with ``status="stream_error"``);
* ``specserve_http_request_seconds{endpoint}``: until the last byte;
* ``specserve_http_time_to_first_token_seconds{endpoint}``: streams, until the first
  text chunk is written;
* ``specserve_http_completion_tokens_total{endpoint}``: tokens delivered;
* ``specserve_http_in_flight{endpoint}``: requests being answered now.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

P = "specserve_http"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class HttpMetrics:
    """One registry per server (so tests may run several in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{P}_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.seconds = Histogram(
            f"{P}_request_seconds",
            "Request latency until the last byte",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            f"{P}_time_to_first_token_seconds",
            "Streams: time until the first text chunk is written",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            f"{P}_completion_tokens", "Completion tokens delivered", ["endpoint"], registry=r
        )
        self.in_flight = Gauge(
            f"{P}_in_flight", "Requests being answered now", ["endpoint"], registry=r
        )
