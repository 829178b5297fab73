"""What a round costs, fitted to timed rounds: the one cost fitter of the project.

A round of ``batch`` sessions, whose deepest session drafts ``depth`` tokens and
whose sessions draft ``drafts`` tokens together, is modelled as::

    seconds = t0[b] + fixed[b] * (depth > 0) + per_step * depth + per_token * drafts

with ``b = bucket(batch)`` (1, 2, 3-4, 5-8, ...). ``t0[b]`` is a plain round's time
and ``fixed[b]`` what drafting at all adds at that batch size (a Propose call, whose
cost grows with the sessions it carries); ``per_step`` is each of the draft's
sequential steps (on separate accelerators most of the cost: a verify a few tokens
wider costs about nothing), ``per_token`` each drafted token of the batch added to
the verify (on a compute-bound CPU most of it). Rounds of one session (drafts =
depth) and of eight (drafts = 8 * depth) tell the two slopes apart.

**Fit.** Least squares over exponentially decayed moments of every timed round
(``decay`` of weight kept by the older rounds at each new one). Each bucket's plain
and drafting rounds are centred on their own means (drafting rounds also on their own
line in the batch size, where a shrinking batch varies it), so the slopes come only
from how drafting rounds of one bucket differ in depth and drafted tokens, and
``t0[b]`` and ``fixed[b]`` are the bucket's plain mean and what its drafting rounds
add to it.
Which slopes it keeps: a subset of (``per_step``, ``per_token``) whose coefficients
are positive and at least ``T_MIN`` standard errors from zero (where there is a
prior or an earlier fit to hold instead; without, the point estimate), every bucket's
intercept positive; no slope where each slope fitted alone comes out at or below
zero (deeper rounds no dearer); a slope positive but within its errors of zero is not
told yet (held, below); where a subset cannot be told from a smaller one (one batch size:
steps and tokens collinear) the one the caller names first (``steps_first``) wins.

**What it cannot identify, it holds.** Slopes the rounds cannot tell (every
drafting round equally deep, as under a fixed k) keep their last identified values,
else the ``prior``'s (relative to each bucket's plain time), else what a bucket's
drafting rounds add to its plain ones is read as the slope named first;
held slopes that alone exceed what a bucket's drafting rounds add are scaled down to
it (the rounds measured the sum).
A bucket's ``fixed`` is identified only where it has both plain and drafting rounds
(``MIN_SIDE`` of weight each); otherwise it keeps that bucket's last identified value,
else the prior's share, else 0. Intercepts are never negative: a ``fixed`` the rounds
would make negative is 0, and a slope that would leave a bucket's plain time at or
below 0 is not kept. ``model(batch)`` is None (the caller plans with its prior) until
``min_rounds`` rounds were timed and the slopes are identified or can be held.

The local loop (:mod:`specserve.engine.speculative`) feeds it a lone session's rounds
(no prior); the orchestrator's planner (:mod:`specserve.orchestrator.policy`) one
instance per target, with the declared devices' prior. Pure Python, no clock: the
caller passes in what it timed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.engine.k_policy import CostModel
from specserve.engine.round_cost_solve import T_MIN, Moments, fit_slopes

MIN_ROUNDS = 4
DECAY = 0.98  # weight kept by older rounds at each new one (about 50 rounds)
MIN_SIDE = 0.5  # weight (rounds, decayed) of plain and of drafting rounds to identify fixed[b]

PER_STEP, PER_TOKEN = 0, 1  # the slopes, in the order of their regressors


def bucket_of(batch: int) -> int:
    """1 -> 1, 2 -> 2, 3-4 -> 3, 5-8 -> 4, 9-16 -> 5, ..."""
    return max(1, batch - 1).bit_length() + (batch > 1)


@dataclass(frozen=True)
class BucketFit:
    """One bucket's fitted round times, in seconds."""

    t0: float
    fixed: float
    per_step: float
    per_token: float


@dataclass(frozen=True)
class RoundFit:
    """The fitted round times by bucket; ``slopes_identified``: the slopes come from
    these rounds (not held from earlier ones or the prior)."""

    buckets: dict[int, BucketFit]
    slopes_identified: bool = True

    @property
    def t0(self) -> dict[int, float]:
        return {b: f.t0 for b, f in self.buckets.items()}

    @property
    def fixed(self) -> dict[int, float]:
        return {b: f.fixed for b, f in self.buckets.items()}

    def at(self, batch: int) -> BucketFit | None:
        """``batch``'s bucket, else the nearest fitted one (the larger on a tie)."""
        if not self.buckets:
            return None
        b = bucket_of(batch)
        return self.buckets[min(self.buckets, key=lambda x: (abs(x - b), -x))]

    def plain(self, batch: int) -> float | None:
        """A plain round's seconds at ``batch``."""
        got = self.at(batch)
        return None if got is None else got.t0

    def relative(self, batch: int) -> CostModel | None:
        """What drafting costs in plain rounds of ``batch`` (a session charged as if its
        drafts set the round's depth); None where no positive plain time is fitted."""
        got = self.at(batch)
        if got is None or got.t0 <= 0:
            return None
        return CostModel(
            draft_per_token=got.per_step / got.t0,
            verify_per_token=got.per_token / got.t0,
            fixed=got.fixed / got.t0,
        )

    def __str__(self) -> str:
        return "; ".join(
            f"bucket {b}: t0 {f.t0:.4f} s +{f.fixed:.4f} s + {f.per_step:.4f} s/step "
            f"+ {f.per_token:.5f} s/draft"
            for b, f in sorted(self.buckets.items())
        )


@dataclass
class _Bucket:
    """A bucket's decayed moments: plain rounds and drafting rounds apart."""

    plain: Moments = field(default_factory=Moments)
    drafting: Moments = field(default_factory=Moments)

    def scale(self, decay: float) -> None:
        self.plain.scale(decay)
        self.drafting.scale(decay)


class RoundCosts:
    """Timed rounds in, the fitted :class:`RoundFit` out (None until the rounds tell)."""

    def __init__(
        self,
        *,
        min_rounds: int = MIN_ROUNDS,
        decay: float = DECAY,
        steps_first: bool = False,
        prior: CostModel | None = None,
    ) -> None:
        """``steps_first``: where the rounds cannot tell the draft's steps from the
        verify's drafted tokens, read drafting's cost as steps (separate devices), not
        as drafted tokens (shared cores, the default). ``prior``: what drafting costs
        in plain rounds before the rounds tell, and for what they never do."""
        if min_rounds < 2 or not 0.0 < decay <= 1.0:
            raise ValueError(f"need min_rounds >= 2 and 0 < decay <= 1, got {min_rounds}, {decay}")
        self.min_rounds = min_rounds
        self.decay = decay
        self.prior = prior
        self._first = PER_STEP if steps_first else PER_TOKEN
        self.rounds = 0
        self._buckets: dict[int, _Bucket] = {}
        self._slopes: tuple[float, float] | None = None  # last identified, seconds
        self._fixed: dict[int, float] = {}  # last identified fixed[b], seconds
        self._fit: RoundFit | None = None

    def observe(self, batch: int, depth: int, drafts: int, seconds: float) -> None:
        """A round of ``batch`` sessions, deepest draft ``depth``, ``drafts`` drafted in all,
        took ``seconds`` (propose and verify). Impossible rounds are ignored."""
        if batch <= 0 or seconds <= 0 or depth < 0 or drafts < depth:
            return
        key = bucket_of(batch)
        for b in self._buckets.values():  # every round ages every round before it
            b.scale(self.decay)
        bucket = self._buckets.setdefault(key, _Bucket())
        (bucket.drafting if depth > 0 else bucket.plain).add((1.0, batch, depth, drafts, seconds))
        self.rounds += 1
        self._fit = self._refit() if self.rounds >= self.min_rounds else None

    def fit(self) -> RoundFit | None:
        return self._fit

    def model(self, batch: int = 1) -> CostModel | None:
        """What drafting costs in plain rounds of ``batch``; None until the rounds tell."""
        return None if self._fit is None else self._fit.relative(batch)

    def _refit(self) -> RoundFit | None:
        heaviest = max(b.plain.weight + b.drafting.weight for b in self._buckets.values())
        live = {
            k: b
            for k, b in self._buckets.items()
            if b.plain.weight + b.drafting.weight >= 1e-3 * heaviest  # not aged out
        }
        groups = [b.drafting for b in live.values() if b.drafting.weight > 0]
        # Uncertain slopes are not kept where something else can be held instead.
        holdable = self.prior is not None or self._slopes is not None
        t_min = T_MIN if holdable else 0.0
        slopes = fit_slopes(groups, self._first, _intercepts_positive(live), t_min)
        identified = slopes is not None
        if slopes is None:
            slopes = self._slopes
        buckets = {}
        for key, b in live.items():
            if slopes is None and self.prior is None:  # nothing identified, nothing held
                got = self._gap_as_slope(b)
                if got is not None:
                    buckets[key] = got
                continue
            got = self._bucket(key, b, slopes, identified)
            if got is not None:
                buckets[key] = got
        if identified:
            self._slopes = slopes
        return RoundFit(buckets, identified) if buckets else None

    def _gap_as_slope(self, b: _Bucket) -> BucketFit | None:
        """Without a prior: what a bucket's drafting rounds add to its plain ones, read
        as the slope named first (the fewest unknowns that explain the rounds); None
        where the bucket lacks either kind of round."""
        if b.plain.weight <= 0 or b.drafting.weight <= 0:
            return None
        t0 = b.plain.mean(4)
        gap = max(0.0, b.drafting.mean(4) - t0)
        if self._first == PER_STEP:
            return BucketFit(t0, 0.0, gap / b.drafting.mean(2), 0.0)
        return BucketFit(t0, 0.0, 0.0, gap / b.drafting.mean(3))

    def _bucket(
        self, key: int, b: _Bucket, slopes: tuple[float, float] | None, identified: bool
    ) -> BucketFit | None:
        """``key``'s fit under ``slopes`` (seconds; None: the prior's, relative), which
        these rounds ``identified`` or which are held."""
        prior = self.prior or CostModel(draft_per_token=0.0, verify_per_token=0.0, fixed=0.0)
        share = prior.fixed
        plain, drafting = b.plain, b.drafting
        if slopes is None:  # the prior's slopes, relative to this bucket's plain time
            if plain.weight > 0:
                t0 = plain.mean(4)
            else:
                rel = prior.draft_per_token * drafting.mean(2)
                rel += prior.verify_per_token * drafting.mean(3)
                t0 = drafting.mean(4) / (1.0 + share + rel)
            step, token = prior.draft_per_token * t0, prior.verify_per_token * t0
        else:
            step, token = slopes
            t0 = plain.mean(4) if plain.weight > 0 else 0.0
        if drafting.weight <= 0:  # plain rounds only
            return BucketFit(t0, self._fixed.get(key, share * t0), step, token)
        adds = drafting.mean(4) - step * drafting.mean(2) - token * drafting.mean(3)
        if min(plain.weight, drafting.weight) >= MIN_SIDE:
            gap = drafting.mean(4) - t0  # what drafting adds here: measured
            if adds < t0 and not identified and gap > 0:
                # Held slopes that alone exceed it are scaled down to it: these rounds
                # measured the sum, not its parts.
                scale = gap / (gap + t0 - adds)
                step, token, adds = step * scale, token * scale, t0
            fixed = max(0.0, adds - t0)
            self._fixed[key] = fixed
            return BucketFit(t0, fixed, step, token)
        if plain.weight > 0:
            return BucketFit(t0, self._fixed.get(key, max(0.0, adds - t0)), step, token)
        if adds <= 0:
            return None
        held = self._fixed.get(key)
        if held is None or held >= adds:
            held = adds * share / (1.0 + share)
        return BucketFit(adds - held, held, step, token)


def _intercepts_positive(live: dict[int, _Bucket]) -> Callable[[float, float], bool]:
    """The check :func:`fit_slopes` applies to a candidate: every bucket without plain
    rounds keeps a positive intercept (what its drafting rounds leave)."""
    only_drafting = [b.drafting for b in live.values() if b.plain.weight <= 0]

    def ok(step: float, token: float) -> bool:
        return all(m.mean(4) - step * m.mean(2) - token * m.mean(3) > 0 for m in only_drafting)

    return ok
