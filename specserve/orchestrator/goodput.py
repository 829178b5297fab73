"""The global k cap from measured round times and the sessions' acceptance.

The static curve (:class:`~specserve.orchestrator.scheduler.KCapCurve`) bounds k
by the target's batch, but where speculation stops paying depends on the
hardware: on a GPU a 5-token verify of 8 sessions costs about what a 1-token one
does, on a CPU it is compute-bound, and where draft and target share cores every
drafted token slows verification too. So under the curve's bound the
orchestrator runs the cap whose predicted time to finish the batch's slowest turn
is least::

    finish(cap) = rounds(cap) * seconds(depth(cap), drafts(cap))
    rounds(cap) = max over sessions of remaining / expected(cap)

A batch's rounds move together, so its sessions finish no sooner than its slowest
one: the goodput of the whole batch (expected tokens / round time, SmartSpec's
figure) can rise while its slowest session, one the draft guesses badly for, makes
one token a round at the longer round time of the others' drafts. Seen at 8
sessions on the Xeon: drafting rounds raised the batch's tokens/s 17% while its
last session (acceptance 0.6) made a token a round at 0.6-1.2 s instead of 0.27 s,
so the batch finished no sooner than plain decoding (17.3 s both) and its draft
warm-ups made it 0.92x. For one session, or sessions alike, it is the goodput.
``remaining`` is a turn's ``max_new_tokens`` left (a stop or EOS can end it sooner).

``expected(cap)``, ``depth(cap)`` and ``drafts(cap)`` are *predicted* from the round's
sessions when the cap is chosen: the tokens each session is expected to commit,
``(1 - a**(k + 1)) / (1 - a)`` at the k its policy would draft under the cap and its
running per-token acceptance ``a`` (Leviathan et al., eq. 1), the most drafts any
session would make (the draft's sequential steps) and the drafts of all of them
together (the tokens the verify adds); a session that has judged no drafts yet this
turn is counted at the low end of the pool's spread of acceptance
(:meth:`~specserve.orchestrator.acceptance_prior.AcceptancePrior.shortfall`).
``seconds(depth, drafts)`` is *measured*: per target and batch size (in power-of-two
buckets) the median wall time (propose and verify) of the last rounds without
drafts, ``t0`` (a median: a few rounds slowed by something else on shared cores
moved a smoothed ``t0`` from 0.27 s to 0.33 s, plain decoding looked 20% slower than
it was, and a batch's warm-ups went ahead), and per target what drafting adds to it::

    seconds(depth, drafts) = t0 + fixed + per_step * depth + per_token * drafts

``fixed`` is what drafting costs at any depth (the Propose call, the step setup),
``per_step`` what each of the draft's sequential steps adds (on a GPU most of it: a
verify a few tokens wider costs about nothing), ``per_token`` what each drafted token
adds to the verify (on a compute-bound CPU most of it). They are fitted by
non-negative least squares (:mod:`~specserve.orchestrator.drafting_cost`) to the
drafting rounds of every batch size of the target
(each batch size's smoothed moments over a longer window than plain rounds: a
running mean, then a third of the smoothing; its rounds taken over its own ``t0``),
so rounds of 1 session (drafts = depth) and of 8 (drafts = 8 * depth) tell the two
slopes apart, and a batch size not timed yet is predicted from the others. Where the
rounds cannot tell them apart (one batch size, one depth) the cost goes per drafted
token, the dearer reading for a larger batch. Measured on the Xeon (2 shared cores;
run 7 of ``bench.concurrency``, 1-8 sessions): a round's time over ``t0`` was 0.037
s a step plus 0.019 s a drafted token, predicting every timed drafting round within
0.014 s on average (each before it was seen); a line in depth alone, fitted per
bucket, was off by 0.06-0.08 s, and at 8 sessions predicted a depth-1 round at 0.40
s against 0.44 s measured, which made drafting look 20% faster than plain decoding
where it was 5% faster. The two halves have different noise: a round's time at a
given depth and batch is steady, while the tokens one round commits swing with every
rejection (judging a cap by the tokens its last rounds happened to commit let one
unlucky round at a good cap send it into back-off). And the time is modelled by
depth, not by cap: a cap's rounds are as deep as their sessions' policies make them,
so a fresh session that drafts 1 token is not charged the time of the 4-token rounds
a warmed-up one ran at the same cap. Every cap under the bound is weighed each
round, and a change in acceptance (prose after code) moves every prediction at once.

Two things are timed, rounds without drafts and rounds with them. While nothing
says what drafting costs on the target, a bucket times drafting first, at the bound
(most sessions start out drafting well), then plain rounds; a bucket with no ``t0``
(its own or carried) times plain rounds first.
After that the one the predictions do not choose is re-timed every
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

A new bucket starts from the nearest timed one's ``t0``, so growing and shrinking
batches do not explore from scratch (what drafting adds is the target's fit). A
carried ``t0`` is not the bucket's own: the bucket's drafting rounds join the fit once
its plain rounds are timed. It corrects itself: from a smaller batch it is too
small, plain decoding looks better than it is, so it runs and is timed. Pure Python,
no clock: the round runner passes in what it measured and what its sessions expect.
"""

from __future__ import annotations

import collections
import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from specserve.engine.k_policy import CostModel
from specserve.orchestrator.drafting_cost import DraftingCost, fit_drafting_cost


class Prospect(NamedTuple):
    """A round of the batch under one cap, as its sessions expect it."""

    tokens: float  # the tokens the batch is expected to commit
    depth: int  # the most drafts any session would make
    drafts: int  # the drafts of all of them
    rounds: float  # the rounds its slowest turn needs: max of remaining / expected tokens


Outlook = Callable[[int], Prospect]
"""cap -> the round the batch's sessions expect under that cap."""

log = logging.getLogger(__name__)

PLAIN, DRAFTING = False, True  # the two things timed: rounds without drafts, with them


@dataclass
class _Arm:
    """Rounds of one kind in one bucket: how many, when last chosen, and (drafting
    rounds) the smoothed moments of (1, depth, drafts, seconds), so the mean of each and
    the sums of products the fit needs."""

    moments: list[list[float]] = field(default_factory=lambda: [[0.0] * 4 for _ in range(4)])
    samples: int = 0
    last: int = 0  # the bucket's round count when this arm was last chosen
    wait: int = 0  # rounds from ``last`` until it is due to be re-timed (0: the base)

    @property
    def seconds(self) -> float:
        return self.moments[0][3]

    @property
    def depth(self) -> float:
        return self.moments[0][1]

    def add(self, depth: int, drafts: int, seconds: float, weight: float) -> None:
        v = (1.0, float(depth), float(drafts), seconds)
        keep = 1 - weight
        for i in range(4):
            for j in range(4):
                self.moments[i][j] = keep * self.moments[i][j] + weight * v[i] * v[j]
        self.samples += 1


# Plain rounds whose median is a bucket's t0.
T0_ROUNDS = 9


@dataclass
class _Bucket:
    arms: dict[bool, _Arm] = field(default_factory=lambda: {PLAIN: _Arm(), DRAFTING: _Arm()})
    plain: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=T0_ROUNDS)
    )  # the last plain rounds' seconds
    carried_t0: float | None = None  # the nearest bucket's t0, until this one has its own
    rounds: int = 0
    pending: int | None = None  # the cap of an exploration not timed yet
    pending_since: int = 0
    judge: bool | None = None  # an exploration just timed: back it off if it lost

    @property
    def own_t0(self) -> float | None:
        return statistics.median(self.plain) if self.plain else None

    @property
    def t0(self) -> float | None:
        own = self.own_t0
        return own if own is not None else self.carried_t0

    def seconds(self, depth: int, drafts: int, cost: DraftingCost | None) -> float | None:
        """Predicted wall time of a round whose deepest session drafts ``depth`` and
        whose sessions draft ``drafts`` together."""
        t0 = self.t0
        if t0 is None:
            return None
        if depth <= 0:
            return t0
        return None if cost is None else t0 + cost.extra(depth, drafts)


def _fit(buckets: Sequence[_Bucket], window: float) -> DraftingCost | None:
    """What drafting adds, fitted to the drafting rounds of the buckets with their own
    ``t0`` (each bucket weighted by its rounds, up to ``window``)."""
    return fit_drafting_cost(
        [
            (t0, b.arms[DRAFTING].moments, min(float(b.arms[DRAFTING].samples), window))
            for b in buckets
            if (t0 := b.own_t0) is not None and b.arms[DRAFTING].samples
        ]
    )


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
        self._cost: dict[str, DraftingCost | None] = {}  # per target, refitted on observe

    def choose(self, target: str, batch: int, limit: int, outlook: Outlook) -> int:
        """The cap for a round of ``batch`` sessions on ``target``, at most ``limit``,
        whose sessions expect ``outlook(cap)`` of a round under a cap."""
        if limit <= 0:
            return 0
        b = self._bucket(target, batch)
        b.rounds += 1
        cost = self._cost.get(target)
        finish = _finish(b, cost, limit, outlook)
        drafts = {c: outlook(c).drafts for c in finish}
        best = _best(finish, drafts)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "k caps on %s, batch %d: t0 %s, drafting %s, cost %s, seconds to finish by cap %s",
                target,
                batch,
                _t0_text(b),
                _arm_text(b.arms[DRAFTING]),
                cost or "untimed",
                {c: round(f, 2) for c, f in finish.items()},
            )
        drafting = _best({c: f for c, f in finish.items() if c > 0}, drafts) or limit
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
        if cost is None and not b.arms[DRAFTING].samples:
            pick = limit  # drafting first, at the bound: most sessions start out drafting well
        elif cost is None or b.t0 is None:
            pick = 0  # then plain: the fit needs the drafting rounds' own t0
        else:
            assert best is not None  # t0 and the cost: every cap has a prediction
            other = b.arms[best == 0]
            due = b.rounds - other.last >= max(other.wait, self.explore_every)
            if not (due and not gave_up and b.rounds % self.explore_every == 0):
                b.arms[best > 0].last, b.arms[best > 0].wait = b.rounds, 0
                return best
            pick = drafting if best == 0 else 0
        b.arms[pick > 0].last = b.rounds
        b.pending, b.pending_since = pick, b.rounds
        return pick

    def observe(self, target: str, batch: int, depth: int, drafts: int, seconds: float) -> None:
        """A round of ``batch`` sessions whose deepest session drafted ``depth`` tokens,
        ``drafts`` tokens drafted by all of them, took ``seconds`` (propose and verify)."""
        if batch <= 0 or seconds <= 0 or depth < 0 or drafts < depth:
            return
        b = self._buckets.get((target, bucket_of(batch)))
        if b is None:
            return  # never chosen for this batch (the cap came from the curve alone)
        arm = b.arms[depth > 0]
        if depth == 0:  # t0 is the median of the last plain rounds
            b.plain.append(seconds)
            arm.samples += 1
        else:  # smoothed over a longer window: the fit needs rounds at several depths
            weight = max(1 / (arm.samples + 1), self.smoothing / 3)  # a running mean first
            arm.add(depth, drafts, seconds, weight)
        buckets = [v for k, v in self._buckets.items() if k[0] == target]
        self._cost[target] = _fit(buckets, 3 / self.smoothing)
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

    def finish_times(
        self, target: str, batch: int, limit: int, outlook: Outlook
    ) -> dict[int, float]:
        """Predicted seconds to finish the slowest turn by cap up to ``limit``, for a
        batch of ``batch`` sessions that expect ``outlook(cap)`` (for the warm-up rule
        and tests)."""
        b = self._buckets.get((target, bucket_of(batch)))
        return {} if b is None else _finish(b, self._cost.get(target), limit, outlook)

    def seconds(self, target: str, batch: int, depth: int, drafts: int) -> float | None:
        """A round's predicted seconds at ``depth`` with ``drafts`` drafted tokens."""
        b = self._buckets.get((target, bucket_of(batch)))
        return None if b is None else b.seconds(depth, drafts, self._cost.get(target))

    def cost(self, target: str) -> DraftingCost | None:
        """What drafting is fitted to add to a round of ``target`` (None: not timed)."""
        return self._cost.get(target)

    def relative_cost(self, target: str, batch: int) -> CostModel | None:
        """What drafting is fitted to cost in a round of ``batch`` sessions on
        ``target``, in plain rounds of that batch: the costs each session's k policy
        plans with (:meth:`~specserve.engine.k_policy.KPolicy.measured`), so the k it
        would draft under a cap, which the outlook weighs, comes from this machine's
        rounds, not the policy's static guess. A session is charged as if its drafts
        set the round's depth. None until both the fit and the batch's ``t0`` exist."""
        b = self._buckets.get((target, bucket_of(batch)))
        cost = self._cost.get(target)
        t0 = None if b is None else b.t0
        if cost is None or t0 is None or t0 <= 0:
            return None
        return CostModel(
            draft_per_token=cost.per_step / t0,
            verify_per_token=cost.per_token / t0,
            fixed=cost.fixed / t0,
        )

    def forget(self, target: str) -> None:
        """Drop a target's figures (it left the pool; a new replica may differ)."""
        for key in [k for k in self._buckets if k[0] == target]:
            del self._buckets[key]
        self._cost.pop(target, None)

    def _bucket(self, target: str, batch: int) -> _Bucket:
        key = (target, bucket_of(batch))
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket()
            near = [k for k, v in self._buckets.items() if k[0] == target and v.t0 is not None]
            if near:  # start from the nearest timed batch size's plain time
                b.carried_t0 = self._buckets[min(near, key=lambda k: abs(k[1] - key[1]))].t0
        return b


def _finish(
    b: _Bucket, cost: DraftingCost | None, limit: int, outlook: Outlook
) -> dict[int, float]:
    """Predicted seconds to finish the batch's slowest turn, by cap up to ``limit`` (the
    caps whose round time can be predicted)."""
    finish = {}
    for cap in range(limit + 1):
        p = outlook(cap)
        seconds = b.seconds(p.depth, p.drafts, cost)
        if seconds is not None and seconds > 0:
            finish[cap] = p.rounds * seconds
    return finish


def _t0_text(b: _Bucket) -> str:
    own = b.own_t0
    if own is not None:
        return f"{own:.3f} s (median of {len(b.plain)} rounds)"
    return "untimed" if b.carried_t0 is None else f"{b.carried_t0:.3f} s (carried)"


def _arm_text(arm: _Arm) -> str:
    if not arm.samples:
        return "untimed"
    return f"{arm.seconds:.3f} s at depth {arm.depth:.1f} ({arm.samples} rounds)"


def _best(finish: dict[int, float], drafts: dict[int, int]) -> int | None:
    """The cap predicted to finish soonest; of a tie, the one with fewer drafts, then
    the smaller, but the larger where no session would draft under it (None when none
    is predicted). Where the sessions' policies plan k = 0 every cap predicts the same
    round, and cap 0 would also stop the policies' probes (one draft every few rounds,
    how a session whose acceptance fell wins speculation back): a lone session on the
    Xeon sat at k = 0 for 20 rounds that the local loop, probing, spent drafting (4.71
    tokens/s against the local loop's 6.43 on the same prompt)."""
    if not finish:
        return None
    return min(finish, key=lambda c: (finish[c], drafts.get(c, 0), -c if not drafts.get(c) else c))
