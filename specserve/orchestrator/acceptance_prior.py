"""Where a new session's acceptance estimate starts: the pool's recent acceptance.

A session's :class:`~specserve.engine.k_policy.KPolicy` adapts to its own
acceptance, but its first rounds, and whether its draft cache is worth warming at
all (:mod:`~specserve.orchestrator.warm_payback`), are planned from the estimate it
starts with. A fixed prior (0.7) is wrong both ways: a code-serving pool whose
drafts are accepted 85-95% of the time plans a new session at one draft a round,
whose predicted gain can then fail to repay the warm-up, so the session never
drafts and its estimate never moves; a prose pool at 40% starts out drafting for
nothing. So a new turn starts from what the pool's recent rounds saw: per drafter
and per decoding mode (greedy and sampled acceptance differ), the mean outcome of
the last few hundred draft trials (each round's accepted drafts, then its rejected
one; the trials :class:`KPolicy` counts), exponentially weighted, with a few
pseudo-trials at the fixed prior so that the first rounds of a new pool do not
swing it. Pure Python; the round runner feeds it every verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.engine.k_policy import ALPHA0

DEFAULT_ALPHA = ALPHA0  # KPolicy's own default: the prior before any round is seen


@dataclass
class _Trials:
    accepted: float = 0.0  # exponentially weighted accepted trials
    total: float = 0.0  # exponentially weighted trials


class AcceptancePrior:
    """Per (drafter, greedy) running acceptance of the pool's draft trials."""

    def __init__(
        self, *, decay: float = 0.995, pseudo_trials: float = 8.0, default: float = DEFAULT_ALPHA
    ) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.pseudo_trials = pseudo_trials
        self.default = default
        self._trials: dict[tuple[str, bool], _Trials] = {}

    def observe(self, drafter: str, greedy: bool, drafted: int, accepted: int) -> None:
        """A session's round verified ``drafted`` drafts and kept ``accepted``."""
        if drafted <= 0:
            return
        t = self._trials.setdefault((drafter, greedy), _Trials())
        outcomes = [1.0] * accepted + ([0.0] if accepted < drafted else [])
        for x in outcomes:
            t.accepted = self.decay * t.accepted + x
            t.total = self.decay * t.total + 1.0

    def seen(self) -> list[tuple[str, bool]]:
        """The (drafter, greedy) pairs with observed trials."""
        return sorted(self._trials)

    def alpha(self, drafter: str, greedy: bool) -> float:
        """The acceptance a new session of this drafter and mode starts from."""
        t = self._trials.get((drafter, greedy), _Trials())
        n0 = self.pseudo_trials
        return (t.accepted + n0 * self.default) / (t.total + n0)
