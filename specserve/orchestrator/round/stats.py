"""The round runner's plain counts, which the metrics collector reads."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class RunnerStats:
    """Plain counts the metrics collector reads (:mod:`specserve.orchestrator.metrics`).

    The session-round counts grow exactly as the sessions' usage does
    (:class:`~specserve.engine.decode_state.SessionStats`): one per committed
    verdict, whether or not the store then accepted the commit.
    """

    rounds: int = 0  # batch rounds (one Verify per lane round)
    session_rounds: int = 0  # verdicts: one per session per round
    drafts: int = 0  # session rounds that verified at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # Draft position (1 = the first draft token) -> tokens drafted / accepted there.
    drafted_by_position: collections.Counter[int] = field(default_factory=collections.Counter)
    accepted_by_position: collections.Counter[int] = field(default_factory=collections.Counter)
    # Sessions per target forward, as the target reported them (its calls coalesce).
    verify_batch_sizes: collections.Counter[int] = field(default_factory=collections.Counter)
    draft_fallbacks: int = 0  # session rounds that wanted drafts but verified at k = 0
    draft_warmups: int = 0  # sessions whose draft cache was rebuilt beside the rounds
    k_caps: collections.Counter[int] = field(default_factory=collections.Counter)  # by cap
    target_failovers: int = 0  # sessions moved to another target mid-round
    replayed_rounds: int = 0  # Verify batches replayed on another target after a loss
    slow_verifies: int = 0  # Verify batches past the target timeout on a SERVING target
    target_history_resends: int = 0  # sessions a target asked for the whole history
    multi_step_rounds: int = 0  # batch rounds whose Verify decoded several plain steps
    prefill_chunks: int = 0  # session rounds that sent a prompt in part (emitting nothing)

    def note_verdict(self, drafted: int, accepted: int, steps: int = 1) -> None:
        """A committed verdict; a multi-step one counts as its ``steps`` plain rounds."""
        self.session_rounds += steps
        self.drafts += drafted > 0
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        for position in range(1, drafted + 1):
            self.drafted_by_position[position] += 1
        for position in range(1, accepted + 1):
            self.accepted_by_position[position] += 1
