"""The target replica's own counters: verified sessions, prefills, drafts and acceptances.

These count what this replica computed. A round replayed on another replica
after a failure is counted again there; the client-facing totals are the
orchestrator's (:mod:`specserve.orchestrator.metrics`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.engine.verifier import VerifyInput, VerifyOutcome


class TargetCounts:
    """Counted by the servicer after each Verify or Prefill (event loop), read at scrape."""

    def __init__(self) -> None:
        self.verified = 0  # sessions verified (a prefill is a verify with no drafts)
        self.prefills = 0  # of them, verified from position 0 (a cache built from scratch)
        self.input_tokens = 0  # committed tokens run through forwards
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.needs_history = 0
        self._lock = threading.Lock()  # the scrape runs on another thread

    def record(self, inputs: Sequence[VerifyInput], outcomes: Sequence[VerifyOutcome]) -> None:
        verified = prefills = tokens = drafted = accepted = stale = 0
        for x, o in zip(inputs, outcomes, strict=True):
            if o.stale or o.verdict is None:
                stale += 1
                continue
            verified += 1
            prefills += x.start == 0
            tokens += len(x.new_tokens)
            drafted += len(x.proposal.tokens)
            accepted += o.verdict.accepted
        with self._lock:
            self.verified += verified
            self.prefills += prefills
            self.input_tokens += tokens
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            self.needs_history += stale


class TargetCollector(Collector):
    def __init__(self, counts: TargetCounts) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        c = self.counts
        yield CounterMetricFamily(
            "specserve_target_verified_sessions",
            "Sessions verified (a Prefill counts as a verify with no drafts)",
            c.verified,
        )
        yield CounterMetricFamily(
            "specserve_target_prefills",
            "Sessions whose cache was built from position 0",
            c.prefills,
        )
        yield CounterMetricFamily(
            "specserve_target_input_tokens", "Committed tokens run through forwards", c.input_tokens
        )
        yield CounterMetricFamily(
            "specserve_target_draft_tokens",
            "Draft tokens received for verification",
            c.draft_tokens,
        )
        yield CounterMetricFamily(
            "specserve_target_accepted_tokens", "Draft tokens accepted here", c.accepted_tokens
        )
        yield CounterMetricFamily(
            "specserve_target_needs_history",
            "Sessions answered NEEDS_HISTORY (no cache here, or a stale one)",
            c.needs_history,
        )
