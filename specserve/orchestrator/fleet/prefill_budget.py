"""How much prefill a round may carry on its target: fitted so a round stays near its usual length.

A round that prefills a prompt whole holds every other session of its target for
the whole prefill (a 32k-token prompt: 47 s against a usual round of 50 ms). The
scheduler gives each round's prompts a token allowance instead
(:meth:`~specserve.orchestrator.fleet.scheduler.Scheduler.begin_round`), and this
module sizes it per target from what the runner measures:

* ``round_s``: a usual round's seconds (propose, verify, commit start), a running
  average over the rounds that prefilled nothing;
* a prefill's cost: the seconds a round that prefilled took past ``round_s``, fitted
  by least squares (older rounds' weights decayed by ``FIT_DECAY`` a round) to::

      extra = fixed + per_token * C + per_pair * C * (L + C / 2) + per_held * L

  for a prompt that sends ``C`` tokens with ``L`` of it already on the target (each
  of its tokens attends to the ``L`` held and to the chunk's earlier ones: ``L + C/2``
  on average). ``fixed`` is what a round pays for carrying a prefill at all;
  ``per_held`` what reading the prompt's cache costs a forward whatever the chunk's
  size (at 28k tokens a one-token chunk of the tiny model took two usual rounds);
  the pair term is attention's work over the prefix. Charged to the tokens alone,
  these shrank the chunks as the prompt grew while small chunks paid them again each
  round. The coefficients stay >= 0: the fit is the best of those over the subsets of
  the four terms whose coefficients are all >= 0. One round in ``USUAL_EVERY``
  carries no prefill, so ``round_s`` follows the host's load while a prompt prefills.

A prompt at ``L`` then gets the largest ``C`` whose predicted extra is at most
``(RATIO - 1) * round_s``: a round that carries it takes about ``RATIO`` usual rounds,
so the others' tokens come at most about that much further apart while it prefills
(the issue's bound is 3x; ``RATIO`` leaves room for the host's noise), and the prompt
gets the largest chunks that allows. Where the part that does not shrink with ``C``
(``fixed + per_held * L``) alone passes the allowance, the tokens get half of it.
Guards, since a fit extrapolates: a chunk is at most ``GROWTH`` times the last one
measured on its target and never more than ``cap`` (``--max-prefill-tokens``); until
``MIN_FIT_ROUNDS`` prefill rounds are measured the cost is per token only (their
extra over their tokens); before any, a token is charged a verify row's measured
compute on the target (``row_s``: a usual round's compute over its rows, which
overstates a prefill token: its fixed part is spread over few rows), so the first
chunk is conservative, and the ``cap`` only where nothing at all is measured.

Pure bookkeeping: no clock, no grpc; the runner measures and reports.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specserve.orchestrator.fleet.verify_budget import EWMA

# A chunk round may take this many usual rounds. The issue bounds the others' largest
# gap at 3 usual ones; a round's time on a busy host varies by a usual round or so.
RATIO = 2.0
FIT_DECAY = 0.05  # weight lost by each older prefill round in the fit (~20 rounds' memory)
MIN_FIT_ROUNDS = 3.0  # decayed weight of measured prefill rounds before the full fit
GROWTH = 2.0  # a chunk is at most this many times its target's last measured chunk
# One round in this many carries no prefill, so the usual round stays measured while a
# long prompt prefills (the host's load may change meanwhile; a stale usual round
# would read the change as the prefill's cost).
USUAL_EVERY = 8

log = logging.getLogger(__name__)

Prefill = tuple[int, int]  # one prompt in a round: (tokens the target held, tokens sent)
_TERMS = 4


def terms(prefills: Sequence[Prefill]) -> list[float]:
    """A round's regressors for its prompts: [fixed, tokens, token-context pairs, tokens
    held]."""
    tokens = sum(c for _, c in prefills)
    pairs = sum(c * (held + c / 2) for held, c in prefills)
    held = sum(h for h, _ in prefills)
    return [1.0 if prefills else 0.0, float(tokens), float(pairs), float(held)]


@dataclass
class _Fit:
    """Decayed sums of a least-squares fit of extra seconds to :func:`terms`."""

    xx: list[list[float]] = field(default_factory=lambda: [[0.0] * _TERMS for _ in range(_TERMS)])
    xy: list[float] = field(default_factory=lambda: [0.0] * _TERMS)
    weight: float = 0.0  # decayed count of rounds
    extra_s: float = 0.0  # decayed sums of extra seconds and of tokens (per-token cost)
    tokens: float = 0.0
    last_chunk: int = 0  # the largest prompt part of the latest prefill round

    def add(self, x: list[float], y: float) -> None:
        keep = 1 - FIT_DECAY
        for i in range(_TERMS):
            self.xy[i] = keep * self.xy[i] + x[i] * y
            for j in range(_TERMS):
                self.xx[i][j] = keep * self.xx[i][j] + x[i] * x[j]
        self.weight = keep * self.weight + 1
        self.extra_s = keep * self.extra_s + y
        self.tokens = keep * self.tokens + x[1]

    def coefficients(self) -> list[float]:
        """[fixed, per_token, per_pair, per_held] seconds, all >= 0 (the best non-negative subset
        fit; per token only until ``MIN_FIT_ROUNDS`` rounds are in)."""
        if self.weight < MIN_FIT_ROUNDS:
            per_token = max(0.0, self.extra_s) / self.tokens if self.tokens > 0 else 0.0
            return [0.0, per_token, 0.0, 0.0]
        best: tuple[float, list[float]] | None = None
        for n in range(1, _TERMS + 1):
            for subset in itertools.combinations(range(_TERMS), n):
                w = _solve(
                    [[self.xx[i][j] for j in subset] for i in subset], [self.xy[i] for i in subset]
                )
                if w is None or min(w) < 0:
                    continue
                full = [0.0] * _TERMS
                for i, wi in zip(subset, w, strict=True):
                    full[i] = wi
                # the weighted squared error, less the constant sum of y^2
                err = sum(
                    full[i] * full[j] * self.xx[i][j] for i in range(_TERMS) for j in range(_TERMS)
                ) - 2 * sum(full[i] * self.xy[i] for i in range(_TERMS))
                if best is None or err < best[0] - 1e-15:
                    best = (err, full)
        return best[1] if best is not None else [0.0] * _TERMS


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` for a symmetric ``a`` (normal equations), its terms scaled to a unit
    diagonal first (a round's terms differ by orders of magnitude), by Gaussian
    elimination with partial pivoting; None if singular."""
    n = len(b)
    if any(a[i][i] <= 0 for i in range(n)):
        return None
    d = [math.sqrt(a[i][i]) for i in range(n)]
    m = [[a[i][j] / (d[i] * d[j]) for j in range(n)] + [b[i] / d[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    y = [0.0] * n
    for r in reversed(range(n)):
        y[r] = (m[r][n] - sum(m[r][c] * y[c] for c in range(r + 1, n))) / m[r][r]
    return [y[i] / d[i] for i in range(n)]


@dataclass
class PrefillBudget:
    """Per target: a usual round's seconds, a prefill's fitted cost, the chunks they give."""

    cap: int  # --max-prefill-tokens: no chunk is larger
    # seconds a verify row costs on a target (measured compute over rows); None: unknown
    row_s: Callable[[str], float | None] = lambda target: None
    round_s: dict[str, float] = field(default_factory=dict)
    fits: dict[str, _Fit] = field(default_factory=dict)
    since_usual: dict[str, int] = field(default_factory=dict)  # prefill rounds in a row

    def __post_init__(self) -> None:
        if self.cap < 1:
            raise ValueError(f"the budget's cap must be >= 1, got {self.cap}")

    def coefficients(self, target: str) -> list[float] | None:
        """[fixed, per_token, per_pair, per_held] seconds on ``target``; None until a prefill round
        was measured."""
        fit = self.fits.get(target)
        return None if fit is None else fit.coefficients()

    def rows(self, target: str, held: int = 0) -> int:
        """The most tokens a prompt with ``held`` tokens already on ``target`` may send
        in its next round (at most ``cap``); 0: this round should carry no prefill (one
        in ``USUAL_EVERY``, to re-measure the usual round)."""
        usual = self.round_s.get(target)
        if usual is None:
            return self.cap
        if self.since_usual.get(target, 0) >= USUAL_EVERY - 1:
            return 0
        allowance = (RATIO - 1) * usual
        fit = self.fits.get(target)
        if fit is None:
            row = self.row_s(target)
            if row is None or row <= 0:
                return self.cap
            return max(1, min(self.cap, int(allowance / row)))
        fixed, per_token, per_pair, per_held = fit.coefficients()
        fixed += per_held * held  # what the round costs whatever the chunk's size
        room = allowance - fixed if fixed < allowance / 2 else allowance / 2
        # room >= per_pair / 2 * C^2 + (per_token + per_pair * held) * C
        linear = per_token + per_pair * held
        if per_pair > 0:
            chunk = (math.sqrt(linear * linear + 2 * per_pair * room) - linear) / per_pair
        elif linear > 0:
            chunk = room / linear
        else:
            chunk = math.inf
        limit = min(self.cap, int(GROWTH * fit.last_chunk)) if fit.last_chunk else self.cap
        return max(1, min(limit, int(chunk)) if math.isfinite(chunk) else limit)

    def observe(self, target: str, prefills: Sequence[Prefill], seconds: float) -> None:
        """A round on ``target`` that carried ``prefills`` (none: a usual round) took
        ``seconds`` (a round disturbed by a failover, a warm-up or an error is not
        reported)."""
        if seconds <= 0:
            return
        usual = self.round_s.get(target)
        if not prefills:
            self.round_s[target] = seconds if usual is None else usual + EWMA * (seconds - usual)
            self.since_usual[target] = 0
        elif usual is not None:
            self.since_usual[target] = self.since_usual.get(target, 0) + 1
            fit = self.fits.setdefault(target, _Fit())
            fit.add(terms(prefills), seconds - usual)
            fit.last_chunk = max(c for _, c in prefills)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "prefill round on %s: %s (held, sent) in %.4f s, usual %.4f s; fit %s",
                    target,
                    list(prefills),
                    seconds,
                    usual,
                    [f"{c:.3g}" for c in fit.coefficients()],
                )

    def forget(self, target: str) -> None:
        """``target`` was lost: a replacement may be another machine."""
        for figures in (self.round_s, self.fits, self.since_usual):
            figures.pop(target, None)
