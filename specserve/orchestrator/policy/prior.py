"""Where a new turn's acceptance estimate starts: the pool's recent acceptance.

A fixed starting acceptance is wrong both ways: a code-serving pool whose drafts are
accepted 85-95% of the time would plan a new turn at one draft a round, a prose pool
at 40% would start out drafting for nothing. So (with ``acceptance_prior`` on) a new
turn starts from what the pool's recent rounds saw, per drafter and decoding mode
(greedy and sampled acceptance differ): the exponentially weighted mean outcome of
the last draft trials (a round's accepted drafts, then its rejected one if any),
with ``prior_pseudo_trials`` trials at ``alpha0`` so that a new pool does not swing
on its first rounds. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.orchestrator.policy.config import PolicyConfig


@dataclass
class _Trials:
    accepted: float = 0.0  # exponentially weighted accepted trials
    total: float = 0.0  # exponentially weighted trials


class AcceptancePrior:
    """Per (drafter, greedy) running acceptance of the pool's draft trials."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._trials: dict[tuple[str, bool], _Trials] = {}

    def observe(self, drafter: str, greedy: bool, drafted: int, accepted: int) -> None:
        """A session's round verified ``drafted`` drafts and kept ``accepted``."""
        if drafted <= 0:
            return
        t = self._trials.setdefault((str(drafter), greedy), _Trials())
        decay = self.config.prior_decay
        for x in [1.0] * accepted + ([0.0] if accepted < drafted else []):
            t.accepted = decay * t.accepted + x
            t.total = decay * t.total + 1.0

    def seen(self) -> list[tuple[str, bool]]:
        """The (drafter, greedy) pairs with observed trials."""
        return sorted(self._trials)

    def alpha(self, drafter: str, greedy: bool) -> float:
        """The acceptance a new turn of this drafter and mode starts from (``alpha0``
        with the prior switched off)."""
        n0, a0 = self.config.prior_pseudo_trials, self.config.alpha0
        if not self.config.acceptance_prior:
            return a0
        t = self._trials.get((str(drafter), greedy), _Trials())
        return (t.accepted + n0 * a0) / (t.total + n0)
