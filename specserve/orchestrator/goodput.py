"""The global k cap from measured round times and the sessions' acceptance.

The static curve (:class:`~specserve.orchestrator.scheduler.KCapCurve`) bounds k
by the target's batch, but where speculation stops paying depends on the
hardware: on a GPU a 5-token verify of 8 sessions costs about what a 1-token one
does, on a CPU it is compute-bound, and where draft and target share cores every
drafted token slows verification too. So under the curve's bound the
orchestrator runs the cap with the best predicted goodput::

    rate(cap) = expected(cap) / seconds(depth(cap))

``expected(cap)`` and ``depth(cap)`` are *predicted* from the round's sessions when
the cap is chosen: the tokens the batch is expected to commit, each session's
``(1 - a**(k + 1)) / (1 - a)`` at the k its policy would draft under the cap and its
running per-token acceptance ``a`` (Leviathan et al., eq. 1; the figure SmartSpec's
goodput uses), and the most drafts any session would make (the draft's sequential
steps; the verify's width grows with it). ``seconds(depth)`` is *measured*: per
target and batch size (in power-of-two buckets), the smoothed wall time (propose
and verify) of rounds without drafts, ``t0``, and of rounds with drafts by their
depth, which give the line ``t0 + fixed + slope * depth``: ``fixed`` is what
drafting costs at any depth (the Propose call, the draft's step setup, the wider
verify's overhead), ``slope`` what each draft adds. Both are fitted once the
drafting rounds span depths (their moments, over a longer window than plain rounds:
a running mean, then a third of the smoothing); from rounds at one depth they
cannot be told apart, and the line runs through ``t0`` (``fixed`` 0). Charging all of it per
draft makes deeper caps look dearer than they are and shallower ones cheaper: on the
Xeon 8 sessions' rounds took 0.55 s at depth 1, 0.76 s at 2 and 0.93 s at 3 against
0.30 s plain (a fixed 0.06 s and 0.19 s a draft), and the line through ``t0`` and the
depth-2 rounds predicted depth 1 at 0.45 s. The two halves have
different noise: a round's time at a given depth and batch is steady, while the
tokens one round commits swing with every rejection (judging a cap by the tokens
its last rounds happened to commit let one unlucky round at a good cap send it into
back-off). And the time is modelled by depth, not by cap: a
cap's rounds are as deep as their sessions' policies make them, so a fresh session
that drafts 1 token is not charged the time of the 4-token rounds a warmed-up one
ran at the same cap. Every cap under the bound is weighed each round, and a change
in acceptance (prose after code) moves every prediction at once.

Two things are timed, rounds without drafts and rounds with them, and each is timed
once when a bucket is new (drafting first, at the bound: most sessions start out
drafting well). After that the one the predictions do not choose is re-timed every
``explore_every``-th round of the bucket once it is due: ``explore_every`` rounds
after it last ran, and each time it is re-timed and still loses, twice as long (up
to ``max_backoff`` times that), so a settled choice costs fewer and fewer rounds.
Plain decoding is one of the two, so a predicted loss turns speculation off, and
adaptive speculation is worse than plain batched decoding only for its exploration
rounds, a share that shrinks as they keep losing.

An exploration stays the choice until a round of it *is* timed (the runner does not
time rounds that prefill, that run beside a draft warm-up, or that would draft from
cold draft caches, which warm meanwhile), for at most ``4 * explore_every`` rounds:
an exploration is not spent on a round that says nothing about it. A cache that will
not warm (its warm-up would not repay itself) ends the exploration at once.

A new bucket starts from the nearest timed one's figures, so growing and shrinking
batches do not explore from scratch. Starting from a larger batch, drafting starts
untimed and is timed first: its slope at the larger batch is steeper (wider verifies)
and would hold a smaller batch at plain decoding until re-timed. Any figure carried
over corrects itself: a stale figure makes its side look better than it is, so that
side runs and is re-timed. Pure Python, no clock: the round runner passes in what it
measured and what its sessions expect.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

Outlook = Callable[[int], tuple[float, int]]
"""cap -> (the tokens a round of the batch is expected to commit under that cap, the
most drafts any of its sessions would make)."""

log = logging.getLogger(__name__)

PLAIN, DRAFTING = False, True  # the two things timed: rounds without drafts, with them


# The spread of the drafting rounds' depths (their variance, EMA) from which the
# drafting time is fitted as a fixed cost plus a slope rather than a slope alone.
MIN_DEPTH_VARIANCE = 0.25


@dataclass
class _Arm:
    seconds: float = 0.0  # a round's wall time (EMA)
    depth: float = 0.0  # the most drafts per session in those rounds (EMA; 0 for plain)
    depth_sq: float = 0.0  # depth ** 2 (EMA), for the fit of the drafting line
    depth_seconds: float = 0.0  # depth * seconds (EMA), likewise
    samples: int = 0
    last: int = 0  # the bucket's round count when this arm was last chosen
    wait: int = 0  # rounds from ``last`` until it is due to be re-timed (0: the base)

    def add(self, depth: int, seconds: float, weight: float) -> None:
        keep = 1 - weight
        self.seconds = keep * self.seconds + weight * seconds
        self.depth = keep * self.depth + weight * depth
        self.depth_sq = keep * self.depth_sq + weight * depth * depth
        self.depth_seconds = keep * self.depth_seconds + weight * depth * seconds
        self.samples += 1


@dataclass
class _Bucket:
    arms: dict[bool, _Arm] = field(default_factory=lambda: {PLAIN: _Arm(), DRAFTING: _Arm()})
    rounds: int = 0
    pending: int | None = None  # the cap of an exploration not timed yet
    pending_since: int = 0
    judge: bool | None = None  # an exploration just timed: back it off if it lost

    def seconds(self, depth: int) -> float | None:
        """Predicted wall time of a round whose deepest session drafts ``depth``."""
        plain = self.arms[PLAIN]
        if not plain.samples:
            return None
        if depth == 0:
            return plain.seconds
        line = self.drafting_line()
        if line is None:
            return None
        fixed, slope = line
        return plain.seconds + fixed + slope * depth

    def drafting_line(self) -> tuple[float, float] | None:
        """(fixed, slope): a drafting round's time over a plain one's, ``fixed + slope *
        depth``. Fitted (least squares on the smoothed moments) once the drafting rounds
        span depths; a fit that puts drafting below plain decoding or makes depth free
        is noise, and with one depth the two cannot be told apart: then the line runs
        through the plain time, all of the difference per draft (deeper rounds look
        dearer than they are, shallower ones cheaper, until other depths are timed)."""
        plain, drafting = self.arms[PLAIN], self.arms[DRAFTING]
        if not plain.samples or not drafting.samples or drafting.depth <= 0:
            return None
        spread = drafting.depth_sq - drafting.depth**2
        if spread >= MIN_DEPTH_VARIANCE:
            slope = (drafting.depth_seconds - drafting.depth * drafting.seconds) / spread
            fixed = drafting.seconds - slope * drafting.depth - plain.seconds
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return 0.0, max(0.0, (drafting.seconds - plain.seconds) / drafting.depth)


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

    def choose(self, target: str, batch: int, limit: int, outlook: Outlook) -> int:
        """The cap for a round of ``batch`` sessions on ``target``, at most ``limit``,
        whose sessions expect ``outlook(cap)`` of a round under a cap."""
        if limit <= 0:
            return 0
        b = self._bucket(target, batch)
        b.rounds += 1
        rate = _rates(b, limit, outlook)
        best = _best(rate)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "k caps on %s, batch %d: t0 %s, drafting %s, line %s, tokens/s by cap %s",
                target,
                batch,
                _arm_text(b.arms[PLAIN]),
                _arm_text(b.arms[DRAFTING]),
                _line_text(b.drafting_line()),
                {c: round(r, 2) for c, r in rate.items()},
            )
        drafting = _best({c: r for c, r in rate.items() if c > 0}) or limit
        if b.judge is not None:  # an exploration timed last round: did it lose again?
            judged, b.judge = b.arms[b.judge], None
            if best is not None and (best > 0) != (judged is b.arms[DRAFTING]):
                self._back_off(judged)
            else:
                judged.wait = 0
        gave_up = False
        if b.pending is not None:
            if b.rounds - b.pending_since < self.patience:
                return min(b.pending, limit)  # not timed yet: keep it
            self._back_off(b.arms[b.pending > 0])  # never timed: try again later, not next
            gave_up = True
        b.pending = None
        if not b.arms[DRAFTING].samples:
            pick = limit  # drafting first, at the bound: most sessions start out drafting well
        elif not b.arms[PLAIN].samples:
            pick = 0
        else:
            assert best is not None  # both timed: every cap has a prediction
            other = b.arms[best == 0]
            due = b.rounds - other.last >= max(other.wait, self.explore_every)
            if not (due and not gave_up and b.rounds % self.explore_every == 0):
                b.arms[best > 0].last, b.arms[best > 0].wait = b.rounds, 0
                return best
            pick = drafting if best == 0 else 0
        b.arms[pick > 0].last = b.rounds
        b.pending, b.pending_since = pick, b.rounds
        return pick

    def observe(self, target: str, batch: int, depth: int, seconds: float) -> None:
        """A round of ``batch`` sessions whose deepest session drafted ``depth`` tokens
        took ``seconds`` (propose and verify)."""
        if batch <= 0 or seconds <= 0 or depth < 0:
            return
        b = self._buckets.get((target, bucket_of(batch)))
        if b is None:
            return  # never chosen for this batch (the cap came from the curve alone)
        arm = b.arms[depth > 0]
        # Drafting rounds are averaged over a longer window (a running mean, then at
        # most a third of the smoothing): their fit needs rounds at several depths in it.
        weight = self.smoothing if depth == 0 else max(1 / (arm.samples + 1), self.smoothing / 3)
        arm.add(depth, seconds, 1.0 if arm.samples == 0 else weight)
        if b.pending is not None and (b.pending > 0) == (depth > 0):
            b.pending, b.judge = None, depth > 0  # judged with the next round's sessions

    def give_up(self, target: str, batch: int, cap: int) -> None:
        """An exploration of ``cap`` cannot be timed (a session of the round will not
        warm its draft cache, :mod:`~specserve.orchestrator.warm_payback`): stop it now
        rather than after its patience, and try it again later, not next."""
        b = self._buckets.get((target, bucket_of(batch)))
        if b is None or b.pending is None or b.pending != cap:
            return
        b.pending = None
        self._back_off(b.arms[cap > 0])

    def _back_off(self, arm: _Arm) -> None:
        """Double the rounds before ``arm`` is due again (from the base, up to the most)."""
        arm.wait = min(2 * max(arm.wait, self.explore_every), self.max_wait)

    def rates(self, target: str, batch: int, limit: int, outlook: Outlook) -> dict[int, float]:
        """Predicted tokens/s per session by cap up to ``limit``, for a batch of
        ``batch`` sessions that expect ``outlook(cap)`` (for the warm-up rule and tests)."""
        b = self._buckets.get((target, bucket_of(batch)))
        if b is None:
            return {}
        return {c: r / batch for c, r in _rates(b, limit, outlook).items()}

    def seconds(self, target: str, batch: int, depth: int) -> float | None:
        """A round's predicted seconds at ``depth`` (for tests and debugging)."""
        b = self._buckets.get((target, bucket_of(batch)))
        return None if b is None else b.seconds(depth)

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
            if near:  # start from the nearest timed batch size's figures
                src_key = min(near, key=lambda k: abs(k[1] - key[1]))
                for side, arm in self._buckets[src_key].arms.items():
                    if side is DRAFTING and key[1] < src_key[1]:
                        continue  # a smaller batch times drafting first (see the module doc)
                    b.arms[side] = replace(arm, samples=min(arm.samples, 1), last=0, wait=0)
        return b


def _rates(b: _Bucket, limit: int, outlook: Outlook) -> dict[int, float]:
    """Predicted tokens per second of the whole batch, by cap up to ``limit`` (the caps
    whose round time can be predicted)."""
    rate = {}
    for cap in range(limit + 1):
        tokens, depth = outlook(cap)
        seconds = b.seconds(depth)
        if seconds is not None and seconds > 0:
            rate[cap] = tokens / seconds
    return rate


def _arm_text(arm: _Arm) -> str:
    if not arm.samples:
        return "untimed"
    return f"{arm.seconds:.3f} s at depth {arm.depth:.1f} ({arm.samples} rounds)"


def _line_text(line: tuple[float, float] | None) -> str:
    return "none" if line is None else f"+{line[0]:.3f} s + {line[1]:.3f} s/draft"


def _best(rate: dict[int, float]) -> int | None:
    """The cap with the best predicted goodput (the smaller cap of a tie: fewer drafts
    for the same tokens); None when none is predicted."""
    return max(rate, key=lambda a: (rate[a], -a)) if rate else None
