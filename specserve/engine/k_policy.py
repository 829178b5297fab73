"""How many tokens to draft next: fixed, or adapted to the running acceptance.

The adaptive policy keeps an exponential moving average of the per-token
acceptance probability alpha (the chance that a draft token is accepted given its
predecessors were), one step per judged draft (:func:`updated_alpha`; replayed
on the Qwen pair's measured acceptance in ``bench/k_policy_replay.py`` with the
float32 draft's round times, a weight of 0.2 per trial ran 1.011x the best fixed k,
the weight of ``0.3 * trials`` per round it replaced 0.988x). With k drafts a round
emits on average ``(1 - alpha**(k + 1)) / (1 - alpha)`` tokens (Leviathan et al.,
eq. 1) and costs ``k * c_draft + c_verify(k)``, with ``c_verify(k) = 1 + beta * k`` in units of a
one-token target forward, plus a fixed cost of drafting at all (k >= 1). The policy
picks the k in ``[0, k_max]`` that maximises tokens per unit cost; k = 0 (plain
decoding) wins when the draft guesses badly.

The costs start from a static guess (:class:`CostModel`'s defaults, measured for a
float32 draft) and are replaced by measured ones as soon as a runner has them
(:meth:`KPolicy.measured`): the local loop fits its own rounds with the one cost
fitter (:mod:`specserve.engine.round_cost`). In the orchestrator a session's
``KPolicy`` tracks its acceptance; its k is planned by
:mod:`specserve.orchestrator.policy` with the same formulas and fitter.
Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA0 = 0.7  # the acceptance a policy starts from when nothing better is known
# An adaptive session's drafts stop past a round's first where the draft's top
# probability is below this (ModelDrafter): rounds run deep where the draft is sure (code)
# and stop early where it is not, under the k the policy allows. Adaptive k ran
# 1.19-1.22x target-only with it against 1.11-1.13x without (Qwen2.5-Coder 1.5B/0.5B
# Q4_K_M, HumanEval 0-11 + 5 prose prompts, 64 tokens, AMD EPYC AVX2, 2 threads; 0.4:
# 1.18x, 0.6: 1.19-1.20x, 0.7: 1.17x). A fixed k is drafted whole.
DRAFT_CONFIDENCE = 0.5


@dataclass(frozen=True)
class CostModel:
    """A round's cost relative to a plain round (one target forward of one token).

    The defaults are the static guess, measured for a float32 draft
    (bench/local_speedup.py); runners replace them with measured ones.
    """

    draft_per_token: float = 0.3  # one draft forward / one target forward
    verify_per_token: float = 0.25  # extra cost of each verified position (beta)
    fixed: float = 0.0  # what drafting at all adds (a call, a step's setup), k >= 1

    def round(self, k: int) -> float:
        """The cost of a round with ``k`` drafts, in plain rounds."""
        if k <= 0:
            return 1.0
        return 1.0 + self.fixed + (self.verify_per_token + self.draft_per_token) * k

    def batch_round(self, depth: int, drafts: int) -> float:
        """The cost of a batch's round, in plain rounds of that batch: its deepest
        session drafts ``depth`` (the draft's sequential steps), all of them ``drafts``
        (the tokens added to the verify). For one session it is :meth:`round`."""
        if depth <= 0:
            return 1.0
        return 1.0 + self.fixed + self.draft_per_token * depth + self.verify_per_token * drafts


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens emitted by a round with k drafts at per-token acceptance alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def updated_alpha(alpha: float, drafted: int, accepted: int, smoothing: float) -> float:
    """``alpha`` moved by ``smoothing`` toward each trial's outcome of a round in which
    ``accepted`` of ``drafted`` drafts were kept: the accepted ones, then the rejected
    one if any (drafts after a rejection were never judged)."""
    if drafted == 0:
        return alpha
    keep = 1.0 - smoothing
    alpha = 1.0 - (1.0 - alpha) * keep**accepted  # accepted successes
    return alpha * keep if accepted < drafted else alpha  # then one failure


def _rate(alpha: float, k: int, cost: CostModel) -> float:
    """Tokens per unit of cost of a round with k drafts."""
    return expected_tokens(alpha, k) / cost.round(k)


def best_k(alpha: float, k_max: int, cost: CostModel, k_min: int = 0) -> int:
    """The k in ``[k_min, k_max]`` with the most tokens per unit of cost."""
    return max(range(k_min, k_max + 1), key=lambda k: _rate(alpha, k, cost))


class KPolicy:
    """Per-session k: fixed when ``k`` is given, adaptive when it is ``None``.

    A fixed k is what the request asked for: no cap lowers it (neither ``k_max`` nor
    the orchestrator's load or measured cap, which bound only the adaptive choice);
    the session's remaining tokens still do (:meth:`DecodeState.next_k`).
    """

    def __init__(
        self,
        k: int | None,
        *,
        k_max: int = 8,
        cost: CostModel | None = None,
        alpha0: float = ALPHA0,
        smoothing: float = 0.2,
    ) -> None:
        self.fixed = k
        self.k_max = k_max
        self.static = cost or CostModel()
        self.cost = self.static
        self.alpha = alpha0
        self.smoothing = smoothing
        self._probe = 0

    @property
    def draft_confidence(self) -> float:
        """The draft confidence below which a round's later drafts stop: 0 for a fixed
        k (drafted whole), :data:`DRAFT_CONFIDENCE` for an adaptive one."""
        return 0.0 if self.fixed is not None else DRAFT_CONFIDENCE

    def plans(self, limit: int) -> list[int]:
        """The k the policy would draft under each cap ``0 .. limit``, before any probe:
        one pass, no state changes (the orchestrator weighs every cap each round). A
        fixed k is the same under every cap."""
        if self.fixed is not None:
            return [self.fixed] * (limit + 1)
        top = min(limit, self.k_max)
        ks, best, best_rate = [], 0, -1.0  # best_k under each cap: the best over 0 .. cap
        for k in range(top + 1):
            rate = _rate(self.alpha, k, self.cost)
            if rate > best_rate:  # ties keep the smaller k, as best_k does
                best, best_rate = k, rate
            ks.append(best)
        return ks + ks[-1:] * (limit - top)

    def plan(self, k_cap: int | None = None) -> int:
        """The k the policy would draft under ``k_cap``, before any probe."""
        if self.fixed is not None:
            return self.fixed
        cap = self._cap(k_cap)
        return self.plans(cap)[cap]

    def next_k(self, k_cap: int | None = None) -> int:
        """The k for the next round: a fixed k, or the adaptive one at most ``k_cap`` (the
        orchestrator's load cap)."""
        k = self.plan(k_cap)
        if k == 0 and self.fixed is None and self._cap(k_cap) > 0:
            # Probe with one draft every few rounds so a session whose text turns
            # predictable (code after prose) can win speculation back.
            self._probe += 1
            if self._probe % 8 == 0:
                return 1
        return k

    def _cap(self, k_cap: int | None) -> int:
        return self.k_max if k_cap is None else max(0, min(k_cap, self.k_max))

    def measured(self, cost: CostModel | None) -> None:
        """Plan with ``cost``, what the runner measured, from the next round on; None
        (nothing measured yet, or no longer) goes back to the static costs."""
        self.cost = self.static if cost is None else cost

    def observe(self, drafted: int, accepted: int) -> None:
        """Update alpha from one round: ``accepted`` of ``drafted`` tokens kept.

        Each draft the target judged is one trial (the accepted ones, then the
        rejected one if any; drafts after a rejection were never judged), and each
        trial moves alpha by ``smoothing`` toward its outcome, in order. A round of
        many accepted drafts thus counts as many observations, not as a verdict that
        replaces alpha (which made k swing from the most to 1 at every rejection).
        """
        self.alpha = updated_alpha(self.alpha, drafted, accepted, self.smoothing)
