"""What a lone session's round costs, fitted to the local loop's own rounds.

The k policy (:mod:`specserve.engine.k_policy`) weighs the tokens a round with k
drafts is expected to commit against what the round costs, in plain rounds. Its
static guess was measured for a float32 draft; a bfloat16 draft on a CPU with AMX
costs half as much a token, another machine or model pair something else again.
:class:`RoundCosts` measures it where the local loop runs: each decode round of a
lone session gives the draft phase's and the verify phase's wall time at the k it
drafted, and two lines are fitted by least squares over the recent rounds::

    verify(k) = t0 + verify_per_token * k      (k >= 0; t0 is a plain round's)
    draft(k)  = fixed + draft_per_token * k    (k >= 1; at k = 0 no draft runs)

so the cost of a round with k >= 1 drafts is ``1 + fixed/t0 + (draft_per_token +
verify_per_token)/t0 * k`` plain rounds (:class:`~specserve.engine.k_policy.CostModel`).
The policy's own k moves with acceptance, so the rounds come at several k and
tell intercept from slope; until they do (fewer than ``min_rounds`` rounds, or all
at one k) there is no fit and the policy keeps its static guess. A coefficient the
rounds would make negative is held at 0 and the other refitted. Rounds weigh
``decay`` less with each newer one, so a machine that slows down is followed.
Rounds that prefill (the target's or the draft's) are not decode rounds and are
not given to it. Pure Python, no clock: the loop passes in what it timed.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.engine.k_policy import CostModel

MIN_ROUNDS = 4
DECAY = 0.98  # weight kept by the older rounds at each new one (about 50 rounds)
MIN_K_SPREAD = 0.1  # the weighted variance of k below which k is taken as one value


@dataclass
class _Line:
    """Decayed least-squares moments of (k, seconds) for ``y = a + b * k``."""

    w: float = 0.0
    k: float = 0.0
    kk: float = 0.0
    y: float = 0.0
    ky: float = 0.0

    def add(self, k: int, y: float, decay: float) -> None:
        self.w = self.w * decay + 1.0
        self.k = self.k * decay + k
        self.kk = self.kk * decay + k * k
        self.y = self.y * decay + y
        self.ky = self.ky * decay + k * y

    def fit(self) -> tuple[float, float] | None:
        """(a, b), both >= 0; None while k has not varied."""
        if self.w <= 0:
            return None
        spread = self.kk / self.w - (self.k / self.w) ** 2
        if spread < MIN_K_SPREAD:
            return None
        b = (self.w * self.ky - self.k * self.y) / (self.w * self.kk - self.k * self.k)
        a = (self.y - b * self.k) / self.w
        if b < 0:
            return self.y / self.w, 0.0
        if a < 0:
            return 0.0, self.ky / self.kk
        return a, b


class RoundCosts:
    """Measured round costs of a lone session: fed timed decode rounds, gives the
    :class:`~specserve.engine.k_policy.CostModel` they imply (None until they do)."""

    def __init__(self, *, min_rounds: int = MIN_ROUNDS, decay: float = DECAY) -> None:
        if min_rounds < 2 or not 0.0 < decay <= 1.0:
            raise ValueError(f"need min_rounds >= 2 and 0 < decay <= 1, got {min_rounds}, {decay}")
        self.min_rounds = min_rounds
        self.decay = decay
        self.rounds = 0
        self._verify = _Line()
        self._draft = _Line()

    def observe(self, k: int, draft_s: float, verify_s: float) -> None:
        """One decode round of a lone session that drafted ``k`` tokens."""
        self.rounds += 1
        self._verify.add(k, verify_s, self.decay)
        if k > 0:
            self._draft.add(k, draft_s, self.decay)

    def model(self) -> CostModel | None:
        """The costs the rounds so far imply, in plain rounds; None until they tell."""
        if self.rounds < self.min_rounds:
            return None
        verify, draft = self._verify.fit(), self._draft.fit()
        if verify is None or verify[0] <= 0:
            return None
        t0, per_verified = verify
        if draft is None:  # drafts at one k only: all of it per token (the dearer reading)
            if self._draft.k <= 0:
                return None
            fixed, per_draft = 0.0, self._draft.y / self._draft.k
        else:
            fixed, per_draft = draft
        return CostModel(
            draft_per_token=per_draft / t0, verify_per_token=per_verified / t0, fixed=fixed / t0
        )
