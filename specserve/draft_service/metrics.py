"""The draft replica's own counters: drafts and draft tokens (beside the shared replica set)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.draft_service.backend import DraftCall
from specserve.engine.drafter import DraftOutcome


class DraftCounts:
    """Counted by the servicer after each Propose (event loop), read by the collector."""

    def __init__(self) -> None:
        self.proposals = 0  # sessions drafted for
        self.tokens = 0  # draft tokens proposed
        self.needs_history = 0  # sessions answered NEEDS_HISTORY
        self._lock = threading.Lock()  # the scrape runs on another thread

    def record(self, calls: Sequence[DraftCall], outcomes: Sequence[DraftOutcome]) -> None:
        proposals = tokens = stale = 0
        for o in outcomes:
            if o.stale or o.proposal is None:
                stale += 1
            else:
                proposals += 1
                tokens += len(o.proposal.tokens)
        with self._lock:
            self.proposals += proposals
            self.tokens += tokens
            self.needs_history += stale


class DraftCollector(Collector):
    def __init__(self, counts: DraftCounts) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        c = self.counts
        yield CounterMetricFamily(
            "specserve_draft_proposals", "Drafts made (one per session per Propose)", c.proposals
        )
        yield CounterMetricFamily("specserve_draft_tokens", "Draft tokens proposed", c.tokens)
        yield CounterMetricFamily(
            "specserve_draft_needs_history",
            "Sessions answered NEEDS_HISTORY (no cache here, or a stale one)",
            c.needs_history,
        )
