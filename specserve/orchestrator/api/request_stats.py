"""What the orchestrator counts about requests: latencies, outcomes, tokens (read at scrape).

* time to first token: from the request's arrival to its first committed token;
* inter-token latency: a round delivers several tokens at once, so the gap
  since the previous delivery is split evenly over the tokens it brought (each
  token is one observation); tokens of the first delivery after the first token
  are not counted;
* request duration: arrival to the last chunk, by finish reason (``error`` for
  a failed request, ``cancelled`` also for a client that left).
"""

from __future__ import annotations

import collections
import threading

from specserve.orchestrator.types import Usage
from specserve.telemetry.histogram import REQUEST_SECONDS, TOKEN_SECONDS, Histogram


class RequestStats:
    def __init__(self) -> None:
        self.time_to_first_token_s = Histogram(TOKEN_SECONDS)
        self.inter_token_latency_s = Histogram(TOKEN_SECONDS)
        self.duration_s = Histogram(REQUEST_SECONDS)
        self.finished: collections.Counter[str] = collections.Counter()  # by finish reason
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._lock = threading.Lock()  # scrapes read from another thread

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token_s.observe(seconds)

    def delivered(self, gap_s: float, tokens: int) -> None:
        """A later delivery of ``tokens`` tokens, ``gap_s`` after the previous one."""
        if tokens > 0:
            self.inter_token_latency_s.observe(gap_s / tokens, tokens)

    def ended(self, reason: str, duration_s: float, usage: Usage | None) -> None:
        self.duration_s.observe(duration_s)
        with self._lock:
            self.finished[reason] += 1
            if usage is not None:
                self.prompt_tokens += usage.prompt_tokens
                self.completion_tokens += usage.completion_tokens

    def finished_counts(self) -> list[tuple[str, int]]:
        with self._lock:
            return sorted(self.finished.items())
