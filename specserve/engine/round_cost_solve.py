"""The round-cost fit's least squares (pure): decayed moments of drafting rounds in,
the slopes per draft step and per drafted token out.

Each group (one batch-size bucket's drafting rounds) is centred on its own mean, and
on its own line in the batch size where the batch varies within it, so its intercept
(a plain round plus what drafting at all adds there, growing with the sessions) is
partialled out in closed form; the slopes solve a 2 x 2 system, or one unknown of it.
A drafted-token count that only follows the batch size (a fixed k, a batch shrinking as
its turns finish) therefore identifies nothing: that is the plain round growing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

T_MIN = 2.0  # standard errors a kept slope lies above zero
_WIDTH = 5  # (1, batch, depth, drafts, seconds)
# (per_step, per_token) subsets in the order the fit prefers them, by which it names
# first: a later one replaces an earlier one only if it fits strictly better.
_ORDER = {0: ((), (0,), (0, 1), (1,)), 1: ((), (1,), (0, 1), (0,))}


@dataclass
class Moments:
    """Decayed sums of x x^T over (1, batch, depth, drafts, seconds)."""

    m: list[list[float]] = field(default_factory=lambda: [[0.0] * _WIDTH for _ in range(_WIDTH)])

    @property
    def weight(self) -> float:
        return self.m[0][0]

    def mean(self, i: int) -> float:
        """The weighted mean of regressor ``i`` (1 batch, 2 depth, 3 drafts, 4 seconds)."""
        return self.m[0][i] / self.m[0][0] if self.m[0][0] > 0 else 0.0

    def add(self, v: tuple[float, ...]) -> None:
        for i in range(_WIDTH):
            row = self.m[i]
            for j in range(_WIDTH):
                row[j] += v[i] * v[j]

    def scale(self, decay: float) -> None:
        for row in self.m:
            for j in range(_WIDTH):
                row[j] *= decay


def fit_slopes(
    groups: Sequence[Moments],
    first: int,
    ok: Callable[[float, float], bool],
    t_min: float = T_MIN,
) -> tuple[float, float] | None:
    """(per_step, per_token) in seconds fitted to ``groups`` (each centred on its own
    mean), or None where the groups do not vary in depth or drafted tokens at all.

    A candidate subset is kept if its coefficients are positive, each ``t_min``
    standard errors from zero (where the rounds leave a degree of freedom to tell),
    and ``ok`` accepts them; the empty subset (no slope) stands where none is and every
    slope fitted alone comes out at or below zero. A slope positive but within its
    errors of zero is not told yet: None."""
    a = [[0.0] * 2 for _ in range(2)]
    c = [0.0] * 2
    ryy = dof_base = scale = 0.0
    for g in groups:
        if g.weight <= 0:
            continue
        reduced, partialled = _partialled(g)
        dof_base += g.weight - partialled
        scale = max(scale, g.weight, *(abs(g.m[2 + j][2 + k]) for j in range(2) for k in range(2)))
        for j in range(2):
            c[j] += reduced[j][2]
            for k in range(2):
                a[j][k] += reduced[j][k]
        ryy += reduced[2][2]
    if all(a[j][j] <= 1e-9 * scale for j in range(2)):
        return None  # every drafting round of a bucket alike: the slopes cannot be told
    best: tuple[float, tuple[float, float]] | None = None
    alone: list[float] = []  # each slope fitted alone, where it can be
    tolerance = 1e-9 * max(abs(ryy), 1e-12)
    for subset in _ORDER[first]:
        sub = [[a[r][s] for s in subset] for r in subset]
        inverse = _inverse(sub, scale)
        if inverse is None:
            continue
        beta = [
            sum(inverse[i][j] * c[subset[j]] for j in range(len(subset)))
            for i in range(len(subset))
        ]
        if len(subset) == 1:
            alone.append(beta[0])
        if any(x <= 0 for x in beta):
            continue
        residual = ryy - sum(x * c[r] for x, r in zip(beta, subset, strict=True))
        dof = dof_base - len(subset)
        if dof >= 1 and residual > 0:
            sigma2 = residual / dof
            if any(x < t_min * math.sqrt(sigma2 * inverse[i][i]) for i, x in enumerate(beta)):
                continue
        coef = dict(zip(subset, beta, strict=True))
        slopes = (coef.get(0, 0.0), coef.get(1, 0.0))
        if not ok(*slopes):
            continue
        if best is None or residual < best[0] - tolerance:
            best = (residual, slopes)
    if best is None or (best[1] == (0.0, 0.0) and any(x > 0 for x in alone)):
        return None  # positive but uncertain slopes: not told yet, not zero
    return best[1]


def _partialled(g: Moments) -> tuple[list[list[float]], int]:
    """The moments of (depth, drafts, seconds) with the group's own line in the batch
    size partialled out (its mean alone where the batch does not vary), and how many
    unknowns that took."""
    m, w = g.m, g.weight
    rows = range(2, _WIDTH)  # depth, drafts, seconds
    centred = [[m[i][j] - m[0][i] * m[0][j] / w for j in rows] for i in rows]
    spread = m[1][1] - m[0][1] ** 2 / w  # the batch size's own
    if spread <= 1e-9 * max(m[1][1], 1.0):
        return centred, 1
    cross = [m[1][j] - m[0][1] * m[0][j] / w for j in rows]
    return [[centred[i][j] - cross[i] * cross[j] / spread for j in range(3)] for i in range(3)], 2


def _inverse(m: list[list[float]], scale: float) -> list[list[float]] | None:
    """The inverse of a 0 x 0, 1 x 1 or 2 x 2 matrix; None if singular (a pivot or
    determinant at most ``1e-9 * scale`` of its scale)."""
    if not m:
        return []
    if len(m) == 1:
        return None if m[0][0] <= 1e-9 * scale else [[1.0 / m[0][0]]]
    det = m[0][0] * m[1][1] - m[0][1] * m[1][0]
    if min(m[0][0], m[1][1]) <= 1e-9 * scale or det <= 1e-9 * m[0][0] * m[1][1]:
        return None
    return [[m[1][1] / det, -m[0][1] / det], [-m[1][0] / det, m[0][0] / det]]
