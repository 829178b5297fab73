"""How long one Verify may take before it counts as slow: from its work and the host.

A fixed timeout fails requests on a host slower than the one it was chosen on
(a busy 2-core machine, a throttled pod) and waits needlessly on a fast one. The
budget of a call is its rows (every position the target computes: the tokens it
has not seen, the drafts, the plain steps; a new prompt's whole length) times the
seconds per row measured on that target, times a margin, and never below the
floor (``--target-timeout-s``). A target that missed its budget once gets twice
as much for its next calls (the caller replays the round there), and the stretch
decays as its calls come back in time.

Pure bookkeeping: no grpc, no clock; the caller measures and reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# A row's measured cost is an average over many; one call may meet a cold cache, a
# long prompt's attention or a busy moment: this many times the mean still passes.
MARGIN = 8.0
EWMA = 0.2  # weight of the newest measurement in a running average (seconds per row, per round)
_MAX_STRETCH = 64.0  # doubling stops here (with a 60 s floor: an hour)


@dataclass
class VerifyBudget:
    """Per-target seconds per row and stretch; :meth:`timeout_s` is a call's budget."""

    floor_s: float  # --target-timeout-s: no call gets less
    margin: float = MARGIN
    per_row_s: dict[str, float] = field(default_factory=dict)
    stretch: dict[str, float] = field(default_factory=dict)

    def timeout_s(self, target: str, rows: int) -> float:
        """The budget of a call of ``rows`` rows on ``target``."""
        measured = self.margin * rows * self.per_row_s.get(target, 0.0)
        return max(self.floor_s, measured) * self.stretch.get(target, 1.0)

    def observe(self, target: str, rows: int, compute_s: float) -> None:
        """A call of ``rows`` rows came back having cost ``compute_s`` on the target."""
        if rows <= 0 or compute_s <= 0:
            return
        sample = compute_s / rows
        old = self.per_row_s.get(target)
        self.per_row_s[target] = sample if old is None else old + EWMA * (sample - old)
        if target in self.stretch:  # in time again: halve back towards 1
            self.stretch[target] /= 2
            if self.stretch[target] <= 1.0:
                del self.stretch[target]

    def missed(self, target: str) -> None:
        """A call on ``target`` ran past its budget: double the next ones'."""
        self.stretch[target] = min(_MAX_STRETCH, 2 * self.stretch.get(target, 1.0))

    def forget(self, target: str) -> None:
        """``target`` was lost: a replacement may be another machine."""
        self.per_row_s.pop(target, None)
        self.stretch.pop(target, None)


def rows_of(new_tokens: Sequence[int], drafts: int, steps: int) -> int:
    """Rows the target computes for one session: the tokens it has not seen (a
    whole history when it lost the cache), ``drafts`` draft tokens, and ``steps``
    plain steps past the first."""
    return len(new_tokens) + drafts + max(1, steps)
