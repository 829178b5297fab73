"""Plain histograms and their Prometheus form: buckets are cumulative, le is inclusive."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from specserve.telemetry.histogram import Histogram
from specserve.telemetry.prometheus import histogram_family


def test_buckets_are_cumulative_and_inclusive() -> None:
    h = Histogram([1, 2, 4])
    for v in (0.5, 1.0, 1.5, 4.0, 9.0):
        h.observe(v)
    h.observe(2.0, times=3)  # e.g. three tokens of one delivery
    snap = h.snapshot()
    assert snap.buckets == ((1.0, 2), (2.0, 6), (4.0, 7), (float("inf"), 8))
    assert snap.count == 8 and snap.sum == 0.5 + 1.0 + 1.5 + 4.0 + 9.0 + 6.0


def test_concurrent_observations_are_all_counted() -> None:
    h = Histogram([0.5])
    threads = [
        threading.Thread(target=lambda: [h.observe(1.0) for _ in range(2000)]) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.snapshot().count == 8000 and h.snapshot().sum == 8000.0


def test_exposition_text() -> None:
    h = Histogram([0.005, 1, 2.5])
    h.observe(0.001)
    h.observe(2.0)

    class One(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            yield histogram_family("x_seconds", "doc", [(("verify",), h.snapshot())], ["op"])

    registry = CollectorRegistry()
    registry.register(One())
    text = generate_latest(registry).decode()
    assert 'x_seconds_bucket{le="0.005",op="verify"} 1.0' in text
    assert 'x_seconds_bucket{le="1",op="verify"} 1.0' in text
    assert 'x_seconds_bucket{le="2.5",op="verify"} 2.0' in text
    assert 'x_seconds_bucket{le="+Inf",op="verify"} 2.0' in text
    assert 'x_seconds_count{op="verify"} 2.0' in text
    assert 'x_seconds_sum{op="verify"} 2.001' in text
