"""The draft replica's own counters: drafts, draft tokens and drafting ahead (beside the
shared replica set)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.draft_service.backend import DraftCall
from specserve.engine.draft_ahead import AheadCounts
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
    """The servicer's counts, and the model drafter's ahead counts once it is loaded
    (``ahead`` returns None until then, or on an n-gram-only replica: zeros)."""

    def __init__(
        self, counts: DraftCounts, ahead: Callable[[], AheadCounts | None] = lambda: None
    ) -> None:
        self.counts = counts
        self.ahead = ahead

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
        ahead = self.ahead()
        forwards, drafted, hits, used = ahead.snapshot() if ahead is not None else (0, 0, 0, 0)
        yield CounterMetricFamily(
            "specserve_draft_ahead_forwards",
            "Forwards run while idle to draft ahead (--draft-ahead)",
            forwards,
        )
        yield CounterMetricFamily(
            "specserve_draft_ahead_tokens",
            "Tokens drafted ahead while idle: bonus guesses and the drafts after them",
            drafted,
        )
        yield CounterMetricFamily(
            "specserve_draft_ahead_hits",
            "Proposals that started from ahead tokens (the bonus guess was right)",
            hits,
        )
        yield CounterMetricFamily(
            "specserve_draft_ahead_used_tokens",
            "Draft tokens proposed from ahead tokens (drafted before the call came)",
            used,
        )
