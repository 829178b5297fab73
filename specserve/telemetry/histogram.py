"""Plain histograms that servers keep and the Prometheus collectors read at scrape time.

The counting code imports nothing from Prometheus (the pattern of
:mod:`specserve.orchestrator.metrics`): a server observes values into a
:class:`Histogram` from any thread, a collector turns a :class:`Snapshot` into
a metric family when scraped.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass

# Bucket upper bounds. Seconds for one model call or queue wait (a tiny model's
# forward is ~1 ms, a 1.5B model's on a CPU ~0.2 s) ...
STEP_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# ... for time to first token and inter-token latency ...
TOKEN_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# ... for whole requests ...
REQUEST_SECONDS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# ... and sessions per batch.
BATCH_SESSIONS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Snapshot:
    """Cumulative counts per upper bound (the last bound is +Inf), sum and count."""

    buckets: tuple[tuple[float, int], ...]
    sum: float
    count: int


class Histogram:
    """Counts per bucket, a sum and a count; observed from any thread."""

    def __init__(self, bounds: Sequence[float]) -> None:
        assert list(bounds) == sorted(bounds) and bounds, "bounds must be sorted and non-empty"
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, times: int = 1) -> None:
        """Record ``value`` (``times`` times: e.g. once per token of a chunk)."""
        i = bisect.bisect_left(self.bounds, value)  # le semantics: value <= bound
        with self._lock:
            self._counts[i] += times
            self._sum += value * times

    def snapshot(self) -> Snapshot:
        with self._lock:
            counts = list(self._counts)
            total = self._sum
        cumulative, running = [], 0
        for bound, n in zip([*self.bounds, float("inf")], counts, strict=True):
            running += n
            cumulative.append((bound, running))
        return Snapshot(tuple(cumulative), total, running)
