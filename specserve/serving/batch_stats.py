"""What a model executor counts about its batches, per kind of work (read at scrape time).

One :class:`KindStats` per kind (``propose``, ``verify``): batches by sessions,
each call's wait in the queue, and each batch's compute time. The executor's
thread observes; a Prometheus collector reads (:mod:`specserve.serving.metrics`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from specserve.telemetry.histogram import BATCH_SESSIONS, STEP_SECONDS, Histogram


@dataclass
class KindStats:
    batch_sessions: Histogram = field(default_factory=lambda: Histogram(BATCH_SESSIONS))
    queue_wait_s: Histogram = field(default_factory=lambda: Histogram(STEP_SECONDS))
    compute_s: Histogram = field(default_factory=lambda: Histogram(STEP_SECONDS))


class BatchStats:
    """:class:`KindStats` by kind, created on first use."""

    def __init__(self) -> None:
        self._kinds: dict[str, KindStats] = {}
        self._lock = threading.Lock()

    def kind(self, name: str) -> KindStats:
        with self._lock:
            stats = self._kinds.get(name)
            if stats is None:
                stats = self._kinds[name] = KindStats()
            return stats

    def items(self) -> list[tuple[str, KindStats]]:
        with self._lock:
            return sorted(self._kinds.items())

    def observe(self, kind: str, sessions: int, waits_s: list[float], compute_s: float) -> None:
        stats = self.kind(kind)
        stats.batch_sessions.observe(sessions)
        for wait in waits_s:
            stats.queue_wait_s.observe(wait)
        stats.compute_s.observe(compute_s)
