"""How many tokens to draft next: fixed, or adapted to the running acceptance.

The adaptive policy keeps an exponential moving average of the per-token
acceptance probability alpha (the chance that a draft token is accepted given its
predecessors were). With k drafts a round emits on average
``(1 - alpha**(k + 1)) / (1 - alpha)`` tokens (Leviathan et al., eq. 1) and costs
``k * c_draft + c_verify(k)``, with ``c_verify(k) = 1 + beta * k`` in units of a
one-token target forward. The policy picks the k in ``[0, k_max]`` that maximises
tokens per unit cost; k = 0 (plain decoding) wins when the draft guesses badly.
Pure Python: the orchestrator uses the same class per session.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    """Relative costs measured for a model pair (see bench/local_speedup.py)."""

    draft_per_token: float = 0.3  # one draft forward / one target forward
    verify_per_token: float = 0.25  # extra cost of each verified position (beta)


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens emitted by a round with k drafts at per-token acceptance alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, k_max: int, cost: CostModel, k_min: int = 0) -> int:
    """The k in ``[k_min, k_max]`` with the most tokens per unit of cost."""

    def rate(k: int) -> float:
        return expected_tokens(alpha, k) / (
            1.0 + cost.verify_per_token * k + cost.draft_per_token * k
        )

    return max(range(k_min, k_max + 1), key=rate)


class KPolicy:
    """Per-session k: fixed when ``k`` is given, adaptive when it is ``None``."""

    def __init__(
        self,
        k: int | None,
        *,
        k_max: int = 8,
        cost: CostModel | None = None,
        alpha0: float = 0.7,
        smoothing: float = 0.3,
    ) -> None:
        self.fixed = k
        self.k_max = k_max
        self.cost = cost or CostModel()
        self.alpha = alpha0
        self.smoothing = smoothing
        self._probe = 0

    def plan(self, k_cap: int | None = None) -> int:
        """The k the policy would draft under ``k_cap``, before any probe (no state
        changes: the orchestrator asks this of every cap it weighs)."""
        cap = self.k_max if k_cap is None else min(k_cap, self.k_max)
        if self.fixed is not None:
            return min(self.fixed, cap)
        return best_k(self.alpha, cap, self.cost)

    def next_k(self, k_cap: int | None = None) -> int:
        """The k for the next round, at most ``k_cap`` (the orchestrator's load cap)."""
        k = self.plan(k_cap)
        cap = self.k_max if k_cap is None else min(k_cap, self.k_max)
        if k == 0 and self.fixed is None and cap > 0:
            # Probe with one draft every few rounds so a session whose text turns
            # predictable (code after prose) can win speculation back.
            self._probe += 1
            if self._probe % 8 == 0:
                return 1
        return k

    def observe(self, drafted: int, accepted: int) -> None:
        """Update alpha from one round: ``accepted`` of ``drafted`` tokens kept."""
        if drafted == 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)
        sample = accepted / trials
        w = min(1.0, self.smoothing * trials)
        self.alpha = (1 - w) * self.alpha + w * sample
