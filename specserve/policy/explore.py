"""When the planner re-times the choice it did not make: the one owner of exploration.

Per (target, batch-size bucket) two things can be run: plain rounds (no session
drafts) and drafting rounds. The predictions choose one; the other is re-timed
every ``explore_every`` rounds once due, and each time it is re-timed and still
loses, twice as long (up to ``explore_every`` times the arm's backoff,
``PolicyConfig.backoff_of``), so a settled choice costs fewer and fewer rounds. When
the predictions change sides, the wait is cut to the newly re-timed arm's bound: the
backoff that plain decoding earned by losing is not charged to drafting. The
planner consults (and counts) only rounds that can be timed: none while the target
prefills a session or a draft warms beside the rounds, which follow the predictions.
An exploration stays the choice until a round of it is timed (one that warms a draft
inside is not), for at most ``4 * explore_every`` such rounds. Exploring drafting
also makes every adaptive session draft at least one token: how a session whose
acceptance fell wins speculation back.
Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.policy.config import PolicyConfig


@dataclass
class Schedule:
    """One bucket's exploration state (``True`` = drafting rounds, ``False`` = plain)."""

    rounds: int = 0
    interval: int = 0  # rounds between explorations now (0: not started)
    due_at: int = 0
    pending: bool | None = None  # the arm being explored, not timed yet
    pending_since: int = 0
    judge: bool | None = None  # an arm just timed: did the predictions then choose it?
    best: bool | None = None  # the arm the predictions chose in the last round counted

    def next_round(self, config: PolicyConfig, best: bool) -> bool | None:
        """Count a round whose predictions choose ``best``; returns the arm to explore in
        it instead (None: follow the predictions)."""
        if not self.interval:
            self.interval = self.due_at = config.explore_every
        self.rounds += 1
        if self.judge is not None:  # the explored arm was timed: did it win this time?
            won = self.judge == best
            self.interval = config.explore_every if won else self._longer(config, self.judge)
            self.due_at, self.judge = self.rounds + self.interval, None
        if self.best is not None and best != self.best and self.pending is None:
            # The other arm is now the one re-timed: no longer than its own bound.
            self.interval = min(self.interval, self._bound(config, not best))
            self.due_at = min(self.due_at, self.rounds + self.interval)
        self.best = best
        if self.pending is not None:
            if self.rounds - self.pending_since < 4 * config.explore_every:
                return self.pending  # not timed yet: keep it
            self.interval = self._longer(config, self.pending)
            self.due_at, self.pending = self.rounds + self.interval, None
            return None
        if self.rounds >= self.due_at:
            self.pending, self.pending_since = not best, self.rounds
            return self.pending
        return None

    def _longer(self, config: PolicyConfig, drafting: bool) -> int:
        """The interval after an exploration of ``drafting`` that lost: doubled, up to
        that arm's backoff."""
        return min(2 * self.interval, self._bound(config, drafting))

    @staticmethod
    def _bound(config: PolicyConfig, drafting: bool) -> int:
        """The longest interval between re-timings of ``drafting`` (or plain) rounds."""
        return config.explore_every * config.backoff_of(drafting)

    def more_steps(self, steps: int) -> None:
        """The last round decoded ``steps`` plain steps: it counts as that many rounds
        (the interval is in one-step rounds, so that multi-step rounds re-time drafting
        as often in tokens)."""
        self.rounds += max(0, steps - 1)

    def timed(self, drafting: bool) -> None:
        """A round of ``drafting`` (or plain) rounds was timed."""
        if self.pending is not None and self.pending == drafting:
            self.pending, self.judge = None, drafting
