"""The global k cap from measured round times and the sessions' acceptance.

The static curve (:class:`~specserve.orchestrator.scheduler.KCapCurve`) bounds k
by the target's batch, but where speculation stops paying depends on the
hardware: on a GPU a 5-token verify of 8 sessions costs about what a 1-token one
does, on a CPU it is compute-bound, and where draft and target share cores every
drafted token slows verification too. So under the curve's bound the
orchestrator chooses among a few candidate caps ("arms": 0, 2, 4 and the bound)
by their predicted goodput::

    rate(cap) = expected(cap) / seconds(cap)

``seconds(cap)`` is *measured*: per target and batch size (in power-of-two
buckets), the smoothed wall time of a round (propose and verify) at that cap.
``expected(cap)`` is *predicted* when the round is chosen: the tokens the batch is
expected to commit, each session's ``(1 - a**(k + 1)) / (1 - a)`` at the k its
policy would draft under the cap and its running per-token acceptance ``a``
(Leviathan et al., eq. 1; the same figure SmartSpec's goodput uses). The two
halves have different noise: a round's time at a given cap and batch is steady,
while the tokens one round commits swing with every rejection; judging an arm by
the tokens its last rounds happened to commit lets one unlucky round at a good cap
send it into back-off for dozens of rounds. Acceptance is averaged over the
sessions and their rounds instead, and when it changes (prose after code) every
arm's prediction moves at once, without re-measuring any.

Each arm is timed once when a bucket is new; after that, every
``explore_every``-th round of a bucket re-times the arm timed longest ago among
those that are due, so a change in what a round costs is noticed. An arm is due
``explore_every`` rounds after it last ran, and each time it is re-timed and still
loses, it waits twice as long (up to ``max_backoff`` times that): a cap that keeps
losing costs fewer and fewer rounds. Cap 0 is an arm, so a predicted loss turns
speculation off, and adaptive speculation is worse than plain batched decoding only
for its exploration rounds, a share that shrinks as they keep losing.

An arm chosen to be timed stays the choice until a round at it *is* timed (the
runner does not time rounds that prefill, or that would draft from cold draft
caches, which warm meanwhile), for at most ``4 * explore_every`` rounds: an
exploration is not spent on a round that says nothing about it. A cache that will
not warm (its warm-up would not repay itself) ends the exploration at once.

A new bucket starts from the nearest timed one's figures (the ratios of round
times at a batch of 6 are much those at 8), so growing and shrinking batches do
not explore from scratch; starting from a larger batch, the caps above that
batch's best start untimed (drafting pays at least as well in a smaller batch,
and a figure from another batch size would hold the better cap back until it is
re-timed). Pure Python, no clock: the round runner passes in what it measured and
what its sessions expect.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

BASE_ARMS = (0, 2, 4)

Expected = Callable[[int], float]
"""cap -> the tokens a round of the batch is expected to commit under that cap."""


@dataclass
class _Arm:
    seconds: float = 0.0  # a round's wall time at this cap (EMA)
    samples: int = 0
    last: int = 0  # the bucket's round count when this arm was last chosen
    wait: int = 0  # rounds from ``last`` until it is due to be re-timed (0: the base)


@dataclass
class _Bucket:
    arms: dict[int, _Arm] = field(default_factory=dict)
    rounds: int = 0
    pending: int | None = None  # an arm chosen to be timed, not timed yet
    pending_since: int = 0
    judge: int | None = None  # an exploration just timed: back it off if it lost


def bucket_of(batch: int) -> int:
    """1 -> 1, 2 -> 2, 3-4 -> 3, 5-8 -> 4, 9-16 -> 5, ..."""
    return max(1, batch - 1).bit_length() + (batch > 1)


class GoodputCaps:
    """Chooses each round's k cap per target from timed rounds and expected tokens."""

    def __init__(
        self, *, explore_every: int = 8, smoothing: float = 0.3, max_backoff: int = 32
    ) -> None:
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2, got {explore_every}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if max_backoff < 1:
            raise ValueError(f"max_backoff must be >= 1, got {max_backoff}")
        self.explore_every = explore_every
        self.smoothing = smoothing
        self.max_wait = explore_every * max_backoff
        self.patience = 4 * explore_every  # rounds an exploration waits to be timed
        self._buckets: dict[tuple[str, int], _Bucket] = {}

    @staticmethod
    def arms(limit: int) -> list[int]:
        """The candidate caps under the curve's bound ``limit``."""
        return sorted({a for a in BASE_ARMS if a <= limit} | {limit})

    def choose(self, target: str, batch: int, limit: int, expected: Expected) -> int:
        """The cap for a round of ``batch`` sessions on ``target``, at most ``limit``,
        whose sessions expect to commit ``expected(cap)`` tokens under a cap."""
        if limit <= 0:
            return 0
        b = self._bucket(target, batch, expected)
        b.rounds += 1
        arms = {a: b.arms.setdefault(a, _Arm()) for a in self.arms(limit)}
        rate = _rates(arms, expected)
        if b.judge is not None:  # an exploration timed last round: did it lose again?
            judged, b.judge = b.judge, None
            if judged in rate and rate[judged] < max(rate.values()):
                self._back_off(arms[judged])
            elif judged in arms:
                arms[judged].wait = 0
        gave_up = False
        if b.pending in arms:
            if b.rounds - b.pending_since < self.patience:
                return b.pending  # not timed yet: keep it
            self._back_off(arms[b.pending])  # never timed: try it again later, not next
            gave_up = True
        b.pending = None
        untried = [a for a in arms if a not in rate]
        best = _best(rate)
        due = [
            a
            for a in arms
            if a != best and b.rounds - arms[a].last >= max(arms[a].wait, self.explore_every)
        ]
        if untried:
            pick = max(untried)  # the bound first: most sessions start out drafting well
        elif due and not gave_up and b.rounds % self.explore_every == 0:
            pick = min(due, key=lambda a: arms[a].last)
        else:
            assert best is not None
            arms[best].last, arms[best].wait = b.rounds, 0
            return best
        arms[pick].last = b.rounds
        b.pending, b.pending_since = pick, b.rounds
        return pick

    def observe(self, target: str, batch: int, cap: int, seconds: float) -> None:
        """A round of ``batch`` sessions at cap ``cap`` took ``seconds`` (propose and
        verify)."""
        if batch <= 0 or seconds <= 0:
            return
        b = self._buckets.get((target, bucket_of(batch)))
        if b is None:
            return  # never chosen for this batch (the cap came from the curve alone)
        arm = b.arms.setdefault(cap, _Arm())
        w = 1.0 if arm.samples == 0 else self.smoothing
        arm.seconds = (1 - w) * arm.seconds + w * seconds
        arm.samples += 1
        if b.pending == cap:  # an exploration timed: judged with the next round's sessions
            b.pending, b.judge = None, cap

    def give_up(self, target: str, batch: int, cap: int) -> None:
        """An exploration of ``cap`` cannot be timed (a session of the round will not
        warm its draft cache, :mod:`~specserve.orchestrator.warm_payback`): stop it now
        rather than after its patience, and try the arm again later, not next."""
        b = self._buckets.get((target, bucket_of(batch)))
        if b is None or b.pending != cap:
            return
        b.pending = None
        self._back_off(b.arms[cap])

    def _back_off(self, arm: _Arm) -> None:
        """Double the rounds before ``arm`` is due again (from the base, up to the most)."""
        arm.wait = min(2 * max(arm.wait, self.explore_every), self.max_wait)

    def rates(self, target: str, batch: int, expected: Expected) -> dict[int, float]:
        """Predicted tokens/s per session by timed cap, for a batch of ``batch`` sessions
        that expect ``expected(cap)`` tokens a round (for the warm-up rule and tests)."""
        b = self._buckets.get((target, bucket_of(batch)))
        if b is None:
            return {}
        return {a: r / batch for a, r in sorted(_rates(b.arms, expected).items())}

    def seconds(self, target: str, batch: int) -> dict[int, float]:
        """A round's timed seconds by cap (for tests and debugging)."""
        b = self._buckets.get((target, bucket_of(batch)))
        if b is None:
            return {}
        return {a: s.seconds for a, s in sorted(b.arms.items()) if s.samples}

    def forget(self, target: str) -> None:
        """Drop a target's figures (it left the pool; a new replica may differ)."""
        for key in [k for k in self._buckets if k[0] == target]:
            del self._buckets[key]

    def _bucket(self, target: str, batch: int, expected: Expected) -> _Bucket:
        key = (target, bucket_of(batch))
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket()
            near = [k for k in self._buckets if k[0] == target and k != key]
            if near:  # start from the nearest timed batch size's figures
                src_key = min(near, key=lambda k: abs(k[1] - key[1]))
                src = self._buckets[src_key].arms
                rate = _rates(src, expected)
                # Drafting pays at least as well in a smaller batch: caps above the
                # larger batch's best start untimed here (the bound first), not behind it.
                top = _best(rate) if key[1] < src_key[1] else None
                b.arms = {
                    a: _Arm(s.seconds, min(s.samples, 1))
                    for a, s in src.items()
                    if top is None or a <= top
                }
        return b


def _rates(arms: dict[int, _Arm], expected: Expected) -> dict[int, float]:
    """Predicted tokens per second of the whole batch, by timed arm."""
    return {a: expected(a) / s.seconds for a, s in arms.items() if s.samples and s.seconds > 0}


def _best(rate: dict[int, float]) -> int | None:
    """The arm with the best predicted goodput (the smaller cap of a tie: fewer drafts
    for the same tokens); None when none is timed."""
    return max(rate, key=lambda a: (rate[a], -a)) if rate else None
