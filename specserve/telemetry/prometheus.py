"""Serving collectors over HTTP, and turning :class:`Snapshot` values into metric families.

Every process serves its own registry (never the library's global one) on
``--metrics-port``: ``/metrics`` in the Prometheus text format.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from specserve.telemetry.histogram import Snapshot


def histogram_family(
    name: str,
    documentation: str,
    samples: Iterable[tuple[Sequence[str], Snapshot]],
    labels: Sequence[str] = (),
) -> HistogramMetricFamily:
    """One histogram family with a series per label-value tuple."""
    family = HistogramMetricFamily(name, documentation, labels=list(labels))
    for values, snap in samples:
        buckets = [("+Inf" if math.isinf(b) else _bound(b), n) for b, n in snap.buckets]
        family.add_metric(list(values), buckets, snap.sum)
    return family


def _bound(bound: float) -> str:
    return str(int(bound)) if bound == int(bound) and bound >= 1 else repr(bound)


def serve(collectors: Sequence[Collector], host: str, port: int) -> int:
    """Serve ``collectors`` on ``host:port`` in a daemon thread; returns the bound port."""
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
