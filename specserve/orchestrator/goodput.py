"""The global k cap from measured goodput: the cap whose rounds committed the most.

The static curve (:class:`~specserve.orchestrator.scheduler.KCapCurve`) bounds k
by the target's batch, but where speculation stops paying depends on the
hardware: on a GPU a 5-token verify of 8 sessions costs about what a 1-token one
does, on a CPU it is compute-bound, and where draft and target share cores every
drafted token slows verification too. So under the curve's bound the
orchestrator *measures*: per target and batch size (in power-of-two buckets) it
keeps, for a few candidate caps ("arms": 0, 2, 4 and the bound), the tokens per
second per session its recent rounds committed, and runs the best one. Each arm
is tried once when a bucket is new, and every ``explore_every``-th round of a
bucket runs the arm measured longest ago, so a change (prose after code, more
sessions) is noticed. Cap 0 is an arm, so a measured loss turns speculation off:
adaptive speculation does not make aggregate throughput worse than plain batched
decoding for longer than its exploration rounds.

A new bucket starts from the nearest measured one's figures (a batch of 6 behaves
much like a batch of 8), so growing and shrinking batches do not explore from
scratch. Rounds that include a prefill or a draft warm-up are not measured: they
say nothing about the cap. Pure Python, no clock: the round runner passes in
what it measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BASE_ARMS = (0, 2, 4)


@dataclass
class _Arm:
    rate: float = 0.0  # tokens per second per session (EMA)
    samples: int = 0
    last: int = 0  # the bucket's round count when this arm was last chosen


@dataclass
class _Bucket:
    arms: dict[int, _Arm] = field(default_factory=dict)
    rounds: int = 0


def bucket_of(batch: int) -> int:
    """1 -> 1, 2 -> 2, 3-4 -> 3, 5-8 -> 4, 9-16 -> 5, ..."""
    return max(1, batch - 1).bit_length() + (batch > 1)


class GoodputCaps:
    """Chooses each round's k cap per target from the goodput measured at each cap."""

    def __init__(self, *, explore_every: int = 8, smoothing: float = 0.3) -> None:
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2, got {explore_every}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.explore_every = explore_every
        self.smoothing = smoothing
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
        untried = [a for a, s in arms.items() if s.samples == 0]
        if untried:
            pick = max(untried)  # the bound first: most sessions start out drafting well
        elif b.rounds % self.explore_every == 0:
            pick = min(arms, key=lambda a: arms[a].last)
        else:
            pick = max(arms, key=lambda a: (arms[a].rate, -a))
        arms[pick].last = b.rounds
        return pick

    def observe(self, target: str, batch: int, cap: int, tokens: int, seconds: float) -> None:
        """A round of ``batch`` sessions at cap ``cap`` committed ``tokens`` in ``seconds``."""
        if batch <= 0 or seconds <= 0:
            return
        arm = self._bucket(target, batch).arms.setdefault(cap, _Arm())
        rate = tokens / seconds / batch
        w = 1.0 if arm.samples == 0 else self.smoothing
        arm.rate = (1 - w) * arm.rate + w * rate
        arm.samples += 1

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
                src = self._buckets[min(near, key=lambda k: abs(k[1] - key[1]))]
                b.arms = {a: _Arm(s.rate, min(s.samples, 1)) for a, s in src.arms.items()}
        return b
