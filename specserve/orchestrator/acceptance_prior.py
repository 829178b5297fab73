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
swing it.

Turns differ around that mean: on the Qwen pair's HumanEval turns of 64 tokens the
acceptance of a turn ran from 0.62 to 1.0 around 0.85 (standard deviation 0.08).
A batch finishes with its slowest turn (:mod:`~specserve.orchestrator.goodput`), and
a batch of n new turns is expected to hold one near the low end: :meth:`shortfall`
is how far below the mean the lowest of n turns drawn from the spread of the last
turns' acceptance is expected to be (a normal's expected minimum of n, Blom's
approximation: 0.59 standard deviations for 2, 1.05 for 4, 1.43 for 8). Pure
Python; the round runner feeds it every verdict and every turn's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

from specserve.engine.k_policy import ALPHA0

# Turns with fewer draft trials than this say more about chance than about the turn.
MIN_TURN_TRIALS = 8

DEFAULT_ALPHA = ALPHA0  # KPolicy's own default: the prior before any round is seen


@dataclass
class _Trials:
    accepted: float = 0.0  # exponentially weighted accepted trials
    total: float = 0.0  # exponentially weighted trials


@dataclass
class _Turns:
    """Exponentially weighted moments of the turns' acceptance."""

    weight: float = 0.0
    mean: float = 0.0
    square: float = 0.0
    count: int = 0

    def add(self, x: float, decay: float) -> None:
        self.weight = decay * self.weight + 1.0
        w = 1.0 / self.weight
        self.mean += w * (x - self.mean)
        self.square += w * (x * x - self.square)
        self.count += 1

    @property
    def sd(self) -> float:
        return max(0.0, self.square - self.mean * self.mean) ** 0.5


class AcceptancePrior:
    """Per (drafter, greedy) running acceptance of the pool's draft trials."""

    def __init__(
        self,
        *,
        decay: float = 0.995,
        pseudo_trials: float = 8.0,
        default: float = DEFAULT_ALPHA,
        turn_decay: float = 0.95,
    ) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        if not 0 < turn_decay < 1:
            raise ValueError(f"turn_decay must be in (0, 1), got {turn_decay}")
        self.decay = decay
        self.pseudo_trials = pseudo_trials
        self.default = default
        self.turn_decay = turn_decay
        self._trials: dict[tuple[str, bool], _Trials] = {}
        self._turns: dict[tuple[str, bool], _Turns] = {}

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

    def observe_turn(self, drafter: str, greedy: bool, accepted: int, trials: int) -> None:
        """A turn ended whose draft trials (accepted drafts and rejections) numbered
        ``trials``, ``accepted`` of them accepted."""
        if trials < MIN_TURN_TRIALS:
            return
        t = self._turns.setdefault((drafter, greedy), _Turns())
        t.add(accepted / trials, self.turn_decay)

    def shortfall(self, drafter: str, greedy: bool, n: int) -> float:
        """How far below the pool's acceptance the lowest of ``n`` new turns is expected
        to fall: the expected lowest of ``n`` draws from the spread of recent turns (0
        until 3 turns were seen)."""
        t = self._turns.get((drafter, greedy))
        if n <= 1 or t is None or t.count < 3:
            return 0.0
        return NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) * t.sd
