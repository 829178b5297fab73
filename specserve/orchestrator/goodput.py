"""The global k cap from measured goodput: the cap whose rounds committed the most.

The static curve (:class:`~specserve.orchestrator.scheduler.KCapCurve`) bounds k
by the target's batch, but where speculation stops paying depends on the
hardware: on a GPU a 5-token verify of 8 sessions costs about what a 1-token one
does, on a CPU it is compute-bound, and where draft and target share cores every
drafted token slows verification too. So under the curve's bound the
orchestrator *measures*: per target and batch size (in power-of-two buckets) it
keeps, for a few candidate caps ("arms": 0, 2, 4 and the bound), the tokens per
second per session its recent rounds committed, and runs the best one. Each arm
is tried once when a bucket is new; after that, every ``explore_every``-th round of
a bucket re-measures the arm measured longest ago among those that are due, so a
change (prose after code, more sessions) is noticed. An arm is due
``explore_every`` rounds after it last ran, and each time it is re-measured and
still loses, it waits twice as long (up to ``max_backoff`` times that): a cap that
keeps losing costs fewer and fewer rounds. Cap 0 is an arm, so a measured loss
turns speculation off, and adaptive speculation is worse than plain batched
decoding only for its exploration rounds, a share that shrinks as they keep losing.

An arm chosen to be measured stays the choice until a round at it *is* measured
(the runner does not measure rounds that prefill, or that would draft from cold
draft caches, which warm meanwhile), for at most ``4 * explore_every`` rounds: an
exploration is not spent on a round that says nothing about it. A cache that will
not warm (its warm-up would not repay itself) ends the exploration at once.

A new bucket starts from the nearest measured one's figures (a batch of 6 behaves
much like a batch of 8), so growing and shrinking batches do not explore from
scratch; starting from a larger batch, the caps above that batch's best start
untried (drafting pays at least as well in a smaller batch, and a figure measured
at another batch size would hold the better cap back until it is re-measured).
Rounds that include a prefill or a draft warm-up are not measured: they say
nothing about the cap. Pure Python, no clock: the round runner passes in what it
measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BASE_ARMS = (0, 2, 4)


@dataclass
class _Arm:
    rate: float = 0.0  # tokens per second per session (EMA)
    samples: int = 0
    last: int = 0  # the bucket's round count when this arm was last chosen
    wait: int = 0  # rounds from ``last`` until it is due to be re-measured (0: the base)


@dataclass
class _Bucket:
    arms: dict[int, _Arm] = field(default_factory=dict)
    rounds: int = 0
    pending: int | None = None  # an arm chosen to be measured, not measured yet
    pending_since: int = 0


def bucket_of(batch: int) -> int:
    """1 -> 1, 2 -> 2, 3-4 -> 3, 5-8 -> 4, 9-16 -> 5, ..."""
    return max(1, batch - 1).bit_length() + (batch > 1)


class GoodputCaps:
    """Chooses each round's k cap per target from the goodput measured at each cap."""

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
        self.patience = 4 * explore_every  # rounds an exploration waits to be measured
        self._buckets: dict[tuple[str, int], _Bucket] = {}

    @staticmethod
    def arms(limit: int) -> list[int]:
        """The candidate caps under the curve's bound ``limit``."""
        return sorted({a for a in BASE_ARMS if a <= limit} | {limit})

    def choose(self, target: str, batch: int, limit: int) -> int:
        """The cap for a round of ``batch`` sessions on ``target``, at most ``limit``."""
        if limit <= 0:
            return 0
        b = self._bucket(target, batch)
        b.rounds += 1
        arms = {a: b.arms.setdefault(a, _Arm()) for a in self.arms(limit)}
        gave_up = False
        if b.pending in arms:
            if b.rounds - b.pending_since < self.patience:
                return b.pending  # not measured yet: keep it
            self._back_off(arms[b.pending])  # never measured: try it again later, not next
            gave_up = True
        b.pending = None
        untried = [a for a, s in arms.items() if s.samples == 0]
        best = max(arms, key=lambda a: (arms[a].rate, -a))
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
            arms[best].last, arms[best].wait = b.rounds, 0
            return best
        arms[pick].last = b.rounds
        b.pending, b.pending_since = pick, b.rounds
        return pick

    def observe(self, target: str, batch: int, cap: int, tokens: int, seconds: float) -> None:
        """A round of ``batch`` sessions at cap ``cap`` committed ``tokens`` in ``seconds``."""
        if batch <= 0 or seconds <= 0:
            return
        b = self._bucket(target, batch)
        arm = b.arms.setdefault(cap, _Arm())
        rate = tokens / seconds / batch
        w = 1.0 if arm.samples == 0 else self.smoothing
        arm.rate = (1 - w) * arm.rate + w * rate
        arm.samples += 1
        if b.pending == cap:  # an exploration measured: back off if it lost again
            b.pending = None
            others = [s.rate for a, s in b.arms.items() if a != cap and s.samples]
            if others and arm.rate < max(others):
                self._back_off(arm)
            else:
                arm.wait = 0

    def give_up(self, target: str, batch: int, cap: int) -> None:
        """An exploration of ``cap`` cannot be measured (a session of the round will not
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

    def rates(self, target: str, batch: int) -> dict[int, float]:
        """Measured tokens/s per session by cap (for metrics and tests)."""
        b = self._buckets.get((target, bucket_of(batch)))
        if b is None:
            return {}
        return {a: s.rate for a, s in sorted(b.arms.items()) if s.samples}

    def forget(self, target: str) -> None:
        """Drop a target's figures (it left the pool; a new replica may differ)."""
        for key in [k for k in self._buckets if k[0] == target]:
            del self._buckets[key]

    def _bucket(self, target: str, batch: int) -> _Bucket:
        key = (target, bucket_of(batch))
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket()
            near = [k for k in self._buckets if k[0] == target and k != key]
            if near:  # start from the nearest measured batch size's figures
                src_key = min(near, key=lambda k: abs(k[1] - key[1]))
                src = self._buckets[src_key]
                measured = {a: s.rate for a, s in src.arms.items() if s.samples}
                # Drafting pays at least as well in a smaller batch: caps above the
                # larger batch's best start untried here (the bound first), not behind it.
                top = (
                    max(measured, key=lambda a: (measured[a], -a))
                    if measured and key[1] < src_key[1]
                    else None
                )
                b.arms = {
                    a: _Arm(s.rate, min(s.samples, 1))
                    for a, s in src.arms.items()
                    if top is None or a <= top
                }
        return b
