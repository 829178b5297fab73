"""What drafting adds to a round over plain decoding, fitted to measured rounds.

A round's wall time over the plain time of its batch size is modelled as::

    extra(depth, drafts) = fixed + per_step * depth + per_token * drafts

``depth`` is the most drafts any session of the round makes (the draft's sequential
steps), ``drafts`` all of them (the tokens they add to the verify). The three are
fitted by non-negative least squares (by enumeration of the unknowns' subsets,
exact for three) to the smoothed moments of the drafting rounds of several batch
sizes at once (:class:`~specserve.orchestrator.goodput.GoodputCaps` keeps them);
rounds of one session (drafts = depth) and of eight (drafts = 8 * depth) tell the
two slopes apart. Pure Python.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

Group = tuple[float, list[list[float]], float]
"""(plain time t0, moments of (1, depth, drafts, seconds), weight): rounds of one
batch size."""

# The fit's unknowns, in the order of its regressors (1, depth, drafts).
FIXED, PER_STEP, PER_TOKEN = 0, 1, 2
# Subsets of them the fit tries (non-negative least squares by enumeration), in the
# order it prefers where the rounds fit several equally well: the cost per drafted
# token first (the dearer reading for a larger batch), fewer unknowns first, the
# fixed cost last.
_SUBSETS: tuple[tuple[int, ...], ...] = tuple(
    sorted(
        (c for n in (1, 2, 3) for c in itertools.combinations((FIXED, PER_STEP, PER_TOKEN), n)),
        key=lambda c: (PER_TOKEN not in c, len(c), FIXED in c),
    )
)


@dataclass(frozen=True)
class DraftingCost:
    """What drafting adds to a round of a target over its plain time."""

    fixed: float = 0.0
    per_step: float = 0.0  # seconds per draft step (the round's depth)
    per_token: float = 0.0  # seconds per drafted token of the whole batch

    def extra(self, depth: int, drafts: int) -> float:
        if depth <= 0:
            return 0.0
        return self.fixed + self.per_step * depth + self.per_token * drafts

    def __str__(self) -> str:
        return f"+{self.fixed:.3f} s + {self.per_step:.3f} s/step + {self.per_token:.4f} s/draft"


def fit_drafting_cost(groups: Sequence[Group]) -> DraftingCost | None:
    """Non-negative least squares of drafting rounds' time over their plain time on
    (1, depth, drafts), pooled over ``groups`` of rounds (one per batch size): each a
    plain time ``t0``, the rounds' moments of (1, depth, drafts, seconds) and a weight.
    None without rounds."""
    a = [[0.0] * 3 for _ in range(3)]  # sum of w * E[x x^T], x = (1, depth, drafts)
    c = [0.0] * 3  # sum of w * E[x y], y = seconds - t0
    yy = 0.0
    for t0, m, w in groups:
        for i in range(3):
            for j in range(3):
                a[i][j] += w * m[i][j]
            c[i] += w * (m[i][3] - t0 * m[i][0])
        yy += w * (m[3][3] - 2 * t0 * m[0][3] + t0 * t0)
    if a[0][0] <= 0:
        return None
    best: tuple[float, dict[int, float]] | None = None
    tolerance = 1e-9 * max(yy, 1e-12)  # residuals this close are one fit said twice
    for subset in _SUBSETS:
        beta = _solve([[a[i][j] for j in subset] for i in subset], [c[i] for i in subset])
        if beta is None or any(x < 0 for x in beta):
            continue
        residual = yy - sum(x * c[i] for x, i in zip(beta, subset, strict=True))
        if best is None or residual < best[0] - tolerance:
            best = (residual, dict(zip(subset, beta, strict=True)))
    if best is None:
        return DraftingCost()  # drafting never measured dearer than plain decoding
    coef = best[1]
    return DraftingCost(coef.get(FIXED, 0.0), coef.get(PER_STEP, 0.0), coef.get(PER_TOKEN, 0.0))


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """``m x = v`` by Gaussian elimination with partial pivoting; None if singular."""
    n = len(v)
    rows = [[*m[i], v[i]] for i in range(n)]
    scale = max((abs(x) for row in m for x in row), default=0.0)
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
