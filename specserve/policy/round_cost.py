"""What a round costs, fitted to timed rounds: the one cost fitter of the project.

A round of ``batch`` sessions, whose deepest session drafts ``depth`` tokens and
whose sessions draft ``drafts`` tokens together, is modelled as::

    seconds = t0[bucket(batch)] + fixed * (depth > 0) + per_step * depth + per_token * drafts

``t0`` is a plain round's time (one per batch-size bucket: 1, 2, 3-4, 5-8, ...),
``fixed`` what drafting at all adds (a call, a step's setup), ``per_step`` each of
the draft's sequential steps (on separate accelerators most of the cost: a verify a
few tokens wider costs about nothing), ``per_token`` each drafted token of the batch
added to the verify (on a compute-bound CPU most of it). Rounds of one session
(drafts = depth) and of eight (drafts = 8 * depth) tell the two slopes apart.

The unknowns are fitted by least squares to exponentially decayed moments of every
timed round (``decay`` of weight kept by the older rounds at each new one), the
drafting coefficients held non-negative (by enumeration of their subsets, exact for
three). Where the rounds cannot tell two unknowns apart (no plain round: ``t0`` and
``fixed``; one batch size: ``per_step`` and ``per_token``) the fit keeps the one it
prefers: the slope the caller names first (``steps_first``), fewer unknowns, the
fixed cost last. Per drafted token (the default) is the dearer reading for a larger
batch, right where draft and target share cores; per step is right on separate
devices, where the draft's sequential forwards are on the round's path and a verify a
few tokens wider costs about nothing. Until ``min_rounds`` rounds were timed and some
drafting coefficient is identified, there is no fit.

The local loop (:mod:`specserve.engine.speculative`) feeds it a lone session's rounds;
the orchestrator's planner (:mod:`specserve.policy`) one instance per
target. Pure Python, no clock: the caller passes in what it timed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from specserve.policy.k_policy import CostModel

MIN_ROUNDS = 4
DECAY = 0.98  # weight kept by older rounds at each new one (about 50 rounds)

# The drafting unknowns, in the order of their regressors after the bucket's intercept.
FIXED, PER_STEP, PER_TOKEN = 0, 1, 2


def _subsets(first: int) -> tuple[tuple[int, ...], ...]:
    """The drafting unknowns' subsets in the order the fit prefers them (a later one
    replaces an earlier one only if it fits strictly better): with slope ``first``,
    fewer unknowns, without the fixed cost."""
    every = (c for n in (1, 2, 3) for c in itertools.combinations((FIXED, PER_STEP, PER_TOKEN), n))
    return tuple(sorted(every, key=lambda c: (first not in c, len(c), FIXED in c)))


_SUBSETS = {PER_TOKEN: _subsets(PER_TOKEN), PER_STEP: _subsets(PER_STEP)}
_WIDTH = 5  # regressors and target: (1, drafting, depth, drafts, seconds)


def bucket_of(batch: int) -> int:
    """1 -> 1, 2 -> 2, 3-4 -> 3, 5-8 -> 4, 9-16 -> 5, ..."""
    return max(1, batch - 1).bit_length() + (batch > 1)


@dataclass(frozen=True)
class RoundFit:
    """The fitted round times: ``t0`` by bucket and what drafting adds."""

    t0: dict[int, float]
    fixed: float = 0.0
    per_step: float = 0.0  # seconds per draft step (the round's depth)
    per_token: float = 0.0  # seconds per drafted token of the whole batch

    def plain(self, batch: int) -> float | None:
        """A plain round's seconds at ``batch``: its bucket's, else the nearest fitted one's."""
        if not self.t0:
            return None
        b = bucket_of(batch)
        return self.t0[min(self.t0, key=lambda x: (abs(x - b), -x))]

    def relative(self, batch: int) -> CostModel | None:
        """What drafting costs in plain rounds of ``batch`` (a session charged as if its
        drafts set the round's depth); None where no positive plain time is fitted."""
        t0 = self.plain(batch)
        if t0 is None or t0 <= 0:
            return None
        return CostModel(
            draft_per_token=self.per_step / t0,
            verify_per_token=self.per_token / t0,
            fixed=self.fixed / t0,
        )

    def __str__(self) -> str:
        t0 = ", ".join(f"bucket {b}: {s:.3f} s" for b, s in sorted(self.t0.items()))
        return (
            f"t0 ({t0}) +{self.fixed:.3f} s + {self.per_step:.3f} s/step "
            f"+ {self.per_token:.4f} s/draft"
        )


@dataclass
class _Moments:
    """Decayed sums of x x^T over (1, drafting, depth, drafts, seconds)."""

    m: list[list[float]] = field(default_factory=lambda: [[0.0] * _WIDTH for _ in range(_WIDTH)])

    def add(self, v: tuple[float, ...], decay: float) -> None:
        for i in range(_WIDTH):
            row = self.m[i]
            for j in range(_WIDTH):
                row[j] = decay * row[j] + v[i] * v[j]

    def scale(self, decay: float) -> None:
        for row in self.m:
            for j in range(_WIDTH):
                row[j] *= decay


class RoundCosts:
    """Timed rounds in, the fitted :class:`RoundFit` out (None until the rounds tell)."""

    def __init__(
        self, *, min_rounds: int = MIN_ROUNDS, decay: float = DECAY, steps_first: bool = False
    ) -> None:
        """``steps_first``: where the rounds cannot tell the draft's steps from the
        verify's drafted tokens, read drafting's cost as steps (separate devices), not
        as drafted tokens (shared cores, the default)."""
        if min_rounds < 2 or not 0.0 < decay <= 1.0:
            raise ValueError(f"need min_rounds >= 2 and 0 < decay <= 1, got {min_rounds}, {decay}")
        self.min_rounds = min_rounds
        self.decay = decay
        self._order = _SUBSETS[PER_STEP if steps_first else PER_TOKEN]
        self.rounds = 0
        self._buckets: dict[int, _Moments] = {}
        self._fit: RoundFit | None = None

    def observe(self, batch: int, depth: int, drafts: int, seconds: float) -> None:
        """A round of ``batch`` sessions, deepest draft ``depth``, ``drafts`` drafted in all,
        took ``seconds`` (propose and verify). Impossible rounds are ignored."""
        if batch <= 0 or seconds <= 0 or depth < 0 or drafts < depth:
            return
        key = bucket_of(batch)
        for k, moments in self._buckets.items():  # every round ages every bucket's rounds
            if k != key:
                moments.scale(self.decay)
        v = (1.0, float(depth > 0), float(depth), float(drafts), seconds)
        self._buckets.setdefault(key, _Moments()).add(v, self.decay)
        self.rounds += 1
        self._fit = _fit(self._buckets, self._order) if self.rounds >= self.min_rounds else None

    def fit(self) -> RoundFit | None:
        return self._fit

    def model(self, batch: int = 1) -> CostModel | None:
        """What drafting costs in plain rounds of ``batch``; None until the rounds tell."""
        return None if self._fit is None else self._fit.relative(batch)


def _fit(buckets: dict[int, _Moments], order: tuple[tuple[int, ...], ...]) -> RoundFit | None:
    heaviest = max(b.m[0][0] for b in buckets.values())
    keys = sorted(k for k, b in buckets.items() if b.m[0][0] >= 1e-3 * heaviest)  # not aged out
    # Least squares over (t0 of each bucket, fixed, per_step, per_token). Each t0 is its
    # bucket's own intercept, so it is partialled out in closed form (t0 = bucket mean of
    # what drafting leaves): the drafting unknowns solve a 3 x 3 system (or a subset's),
    # not one with a row per bucket, and the residuals differ from the full system's by
    # the same constant for every subset. This runs after every timed round.
    a = [[0.0] * 3 for _ in range(3)]
    raw = [[0.0] * 3 for _ in range(3)]  # the full system's drafting block
    c = [0.0] * 3
    yy = reduced_yy = 0.0
    scale = 0.0  # the full system's largest entry: what "singular" is judged against
    for key in keys:
        m = buckets[key].m
        w, wy = m[0][0], m[0][4]
        scale = max(scale, w, *(abs(x) for x in m[0][1:4]))
        for j in range(3):
            mj = m[0][1 + j] / w
            c[j] += m[1 + j][4] - mj * wy
            for k in range(3):
                raw[j][k] += m[1 + j][1 + k]
                a[j][k] += m[1 + j][1 + k] - mj * m[0][1 + k]
        yy += m[4][4]
        reduced_yy += m[4][4] - wy * wy / w
    scale = max(scale, *(abs(x) for row in raw for x in row))
    best: tuple[float, list[float], tuple[int, ...]] | None = None
    tolerance = 1e-9 * max(yy, 1e-12)
    for subset in order:
        beta = _solve([[a[r][s] for s in subset] for r in subset], [c[r] for r in subset], scale)
        if beta is None or any(x < 0 for x in beta):
            continue
        residual = reduced_yy - sum(x * c[r] for x, r in zip(beta, subset, strict=True))
        if best is None or residual < best[0] - tolerance:
            best = (residual, beta, subset)
    if best is None:
        return None  # no drafting coefficient is identified yet
    _, beta, subset = best
    coef = dict(zip(subset, beta, strict=True))
    t0 = {}
    for key in keys:
        m = buckets[key].m
        drafting = sum(m[0][1 + j] * x for j, x in coef.items())
        t0[key] = (m[0][4] - drafting) / m[0][0]
    return RoundFit(
        t0=t0,
        fixed=coef.get(FIXED, 0.0),
        per_step=coef.get(PER_STEP, 0.0),
        per_token=coef.get(PER_TOKEN, 0.0),
    )


def _solve(m: list[list[float]], v: list[float], scale: float) -> list[float] | None:
    """``m x = v`` by Gaussian elimination with partial pivoting; None if singular (a
    pivot at most ``1e-9 * scale``)."""
    n = len(v)
    rows = [[*m[i], v[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= 1e-9 * scale:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(n):
            if r != col:
                f = rows[r][col] / rows[col][col]
                rows[r] = [x - f * y for x, y in zip(rows[r], rows[col], strict=True)]
    return [rows[i][n] / rows[i][i] for i in range(n)]
