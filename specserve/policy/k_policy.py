"""How many tokens to draft next: fixed, or adapted to the running acceptance.

A fixed k is drafted whole. An adaptive session decides two things:

* **Whether to draft this round.** Its first draft costs a draft forward and a
  verified position (``draft_per_token + verify_per_token`` of a one-token target
  forward, plus the ``fixed`` cost of drafting at all, :class:`CostModel`) and saves a
  plain round when kept. The session drafts while its slow running rate of kept first
  drafts (``first_alpha``, weight :data:`FIRST_SMOOTHING` a round) pays for that; below,
  it decodes plainly and probes with one draft every :data:`PROBE_EVERY` rounds so
  a session whose text turns predictable (code after prose) wins drafting back.
* **How deep.** Up to ``k_max`` drafts, stopped by the draft itself: the drafter
  multiplies the draft's top probabilities over the round (its estimate that every
  draft so far is kept; on the Qwen2.5-Coder pair a draft at top probability q was
  kept about q of the time) and drafts no further once that product falls below
  :meth:`KPolicy.depth_floor`, where the next draft's expected worth in plain rounds,
  product * ``alpha``, no longer pays for its draft forward and verified position
  (``alpha``: the running per-token acceptance, :func:`updated_alpha`).

Replayed offline on the quantized Qwen2.5-Coder 1.5B/0.5B pair's greedy outputs and
the draft's confidences (``bench/k_policy_replay.py``: HumanEval 0-19 + 6 prose
prompts, 128 tokens, measured forward costs, AMD EPYC AVX2), this ran 1.42x
target-only (prose 1.20x, no prompt below 1.10x) against 1.28x for the rule it
replaced (the k maximising Leviathan et al.'s expected tokens
``(1 - alpha**(k + 1)) / (1 - alpha)`` per unit of cost, with a per-draft cut at 0.5
past the first draft) and 1.35x for the best fixed k (2); an oracle 1.61x.

The costs start from a static guess (:class:`CostModel`'s defaults, measured for a
float32 draft) and are replaced by measured ones as soon as a runner has them
(:meth:`KPolicy.measured`): the local loop fits its own rounds with the one cost
fitter (:mod:`specserve.policy.round_cost`). In the orchestrator a session's
``KPolicy`` tracks its acceptance and sends its depth floor; its k is planned by
:mod:`specserve.policy` with :func:`expected_tokens` and the same fitter.
Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA0 = 0.7  # the acceptance a policy starts from when nothing better is known
# The weight of a round in the running rate of kept first drafts (whether to draft at
# all). Replayed: 0.05 1.42x target-only, 0.1 1.41x, 0.2 1.40x; deciding by the
# per-token acceptance instead 1.36x (prose 1.09x, a prompt at 0.98x).
FIRST_SMOOTHING = 0.05
PROBE_EVERY = 8  # a session that does not draft tries one draft every this many rounds
MAX_DEPTH_FLOOR = 0.99  # the floor's top: past the first draft, drafting stops at once


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


class KPolicy:
    """Per-session k: fixed when ``k`` is given, adaptive when it is ``None``.

    A fixed k is what the request asked for: no cap lowers it (neither ``k_max`` nor
    the orchestrator's load or measured cap, which bound only the adaptive choice);
    the session's remaining tokens still do (:meth:`DecodeState.next_k`). An adaptive
    session drafts up to its cap while drafting pays and stops each round's drafts at
    :meth:`depth_floor` (the module doc).
    """

    def __init__(
        self,
        k: int | None,
        *,
        k_max: int = 8,
        cost: CostModel | None = None,
        alpha0: float = ALPHA0,
        smoothing: float = 0.2,
        first_smoothing: float = FIRST_SMOOTHING,
    ) -> None:
        """``first_smoothing``: :data:`FIRST_SMOOTHING` unless an ablation sets it."""
        self.fixed = k
        self.k_max = k_max
        self.static = cost or CostModel()
        self.cost = self.static
        self.alpha = alpha0  # per judged draft: the chance the next one is kept
        self.first_alpha = alpha0  # per drafting round: the chance its first draft is kept
        self.smoothing = smoothing
        self.first_smoothing = first_smoothing
        self._probe = 0

    @property
    def draft_confidence(self) -> float:
        """What the drafter gets as the session's floor: 0 for a fixed k (drafted whole),
        :meth:`depth_floor` for an adaptive one."""
        return 0.0 if self.fixed is not None else self.depth_floor()

    def depth_floor(self) -> float:
        """The product of a round's draft top probabilities below which drafting further
        does not pay: ``(draft_per_token + verify_per_token) / alpha``, at most
        :data:`MAX_DEPTH_FLOOR`."""
        unit = self.cost.draft_per_token + self.cost.verify_per_token
        return min(MAX_DEPTH_FLOOR, unit / max(self.alpha, 1e-6))

    def drafting_pays(self) -> bool:
        """Whether a round's first draft, kept at the session's running rate, saves more
        than it costs (a kept first draft saves a plain round; a fixed k always drafts)."""
        if self.fixed is not None:
            return True
        c = self.cost
        return self.first_alpha > c.draft_per_token + c.verify_per_token + c.fixed

    def plans(self, limit: int) -> list[int]:
        """The k the policy would draft under each cap ``0 .. limit``, before any probe:
        one pass, no state changes. A fixed k is the same under every cap; an adaptive
        one is the cap (at most ``k_max``: the depth floor stops it) while drafting pays,
        else 0."""
        if self.fixed is not None:
            return [self.fixed] * (limit + 1)
        if not self.drafting_pays():
            return [0] * (limit + 1)
        return [min(cap, self.k_max) for cap in range(limit + 1)]

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
            if self._probe % PROBE_EVERY == 0:
                return 1
        return k

    def _cap(self, k_cap: int | None) -> int:
        return self.k_max if k_cap is None else max(0, min(k_cap, self.k_max))

    def measured(self, cost: CostModel | None) -> None:
        """Plan with ``cost``, what the runner measured, from the next round on; None
        (nothing measured yet, or no longer) goes back to the static costs."""
        self.cost = self.static if cost is None else cost

    def observe(self, drafted: int, accepted: int) -> None:
        """Update the acceptance estimates from one round: ``accepted`` of ``drafted``
        tokens kept.

        Each draft the target judged is one trial for ``alpha`` (the accepted ones, then
        the rejected one if any; drafts after a rejection were never judged), and each
        trial moves it by ``smoothing`` toward its outcome, in order: a round of many
        accepted drafts counts as many observations, not as a verdict that replaces
        alpha. A round that drafted moves ``first_alpha`` by ``first_smoothing``
        toward whether its first draft was kept.
        """
        self.alpha = updated_alpha(self.alpha, drafted, accepted, self.smoothing)
        if drafted:
            hit = 1.0 if accepted else 0.0
            self.first_alpha += self.first_smoothing * (hit - self.first_alpha)
