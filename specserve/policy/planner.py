"""The planner: a batch's k per session and its draft warm-ups, from plain data.

Each round the runner hands :meth:`Planner.plan` the target's load and one
:class:`~specserve.policy.views.SessionView` per session, does the I/O
the :class:`~specserve.policy.views.BatchPlan` asks for, and hands
:meth:`Planner.observe` what the round did. Nothing here knows of gRPC, Redis or
asyncio.

**Cost model.** A round's cost in plain rounds of its batch (one cost model,
:class:`~specserve.policy.round_cost.RoundCosts`, fitted per target to the clean
rounds; before it has a fit, the prior for the declared ``devices``)::

    round(depth, drafts) = 1 + fixed + per_step * depth + per_token * drafts

Where the rounds cannot tell ``per_step`` from ``per_token`` (one batch size), the
declared devices read them: as the draft's sequential steps on ``separate`` devices
(a batch drafts in the same forwards; a wider verify costs about nothing), as tokens
the verify waits for on ``shared`` cores.

**Acceptance.** A session's per-token acceptance ``a`` is its running estimate
(``alpha``, which follows its recent drafts) weighed by the trials it judged this
turn (``n``: accepted drafts, and a failed trial per rejection) against
``alpha_prior_trials`` (``m``) trials at the target's pooled rate (every session's
judged drafts there, decayed by ``acceptance_decay`` a round; ``alpha0`` before any)::

    a = (n * alpha + m * pooled) / (n + m)

A new turn starts at the pool's rate, and two unlucky rounds do not stop a session's
drafting for the rest of its turn (with k = 0 it judges nothing and could not win
drafting back); a draft that is poor for this session's text still loses it.

**k.** A session's k is the one with the most expected tokens
``(1 - a**(k + 1)) / (1 - a)`` per unit of cost at its acceptance ``a``, at most the
round's cap; a request's own k, or ``fixed_k``,
is drafted as given. The cap is, under the load curve's bound (on ``separate``
devices no curve bounds it unless one is set), the cap with the most expected
tokens per unit of the batch's round time (its goodput)::

    goodput(cap) = sum over sessions of expected tokens / round(depth, drafts)

(ties: the smaller cap). A session whose acceptance fell drafts little or nothing
under any cap (but see below) and pays the batch's longer round; the others' tokens outweigh it,
as they would not under a rule that waits for the batch's slowest turn. On
``separate`` devices the round's deepest session sets the draft's steps, so another
session's extra draft costs only a verified position: each session's k is then raised
toward that depth while ``a ** (k + 1)`` (its next draft's chance of being kept) beats
``verify_per_token`` times the round's tokens per unit of cost. One owner of
exploration (:mod:`~specserve.policy.explore`) re-times the choice not
made, in rounds that can be timed (no prefill, no warm-up beside them, and no drafting
session whose draft missed its last round: that round would also catch the draft up on
the plain rounds' tokens, a cost that is not drafting's). On shared
hardware, where a warm-up inside the round stalls it, re-timing drafting waits for a
session whose draft is warm or has drafted this turn: an exploration never pays for a
new turn's first warm-up of its whole history there. On separate devices a lone
session's exploration warms its draft inside its round (a prefill on the draft's
device) and drafts.

**Plain steps.** A round in which no session drafts decodes ``steps_of_plain``
tokens per session in its one Verify (multi-step decoding,
:mod:`~specserve.target_service.multi_step`; at most a session's tokens left), and
is timed per token: the cost model's plain round is then a plain token's cost (a
round of fewer steps, e.g. an exploration, counts the steps it did not run at its
target's compute per step, so one call's cost is spread as it would be). One
step only where more would hold something up: a round that re-times plain decoding
(an exploration), prefills or warms a draft (the session drafts once warm), or
leaves sessions of its target waiting (for admission, or past ``max_batch``).

**Warm-ups.** A cold session (its draft replica lacks a long history) that would
draft is warmed: inside the round when it is alone or draft and target share
hardware (the round waits, then it drafts in it), beside the rounds otherwise (it
verifies at k = 0 until warm), from the round its target starts prefilling it. On
shared hardware a batch's session waits until its target has prefilled it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.policy.config import Devices, PolicyConfig
from specserve.policy.explore import Schedule
from specserve.policy.k_policy import CostModel, KPolicy, expected_tokens
from specserve.policy.round_cost import RoundCosts, RoundFit, bucket_of
from specserve.policy.views import (
    BatchPlan,
    Cache,
    RoundOutcome,
    SessionView,
    WarmWhere,
)


@dataclass(frozen=True)
class _Session:
    """A session's plan under every cap ``0 .. bound``."""

    view: SessionView
    alpha: float
    ks: list[int]  # k by cap
    expect: list[float]  # tokens its round is expected to emit, by cap (at ks[cap])
    adaptive: bool  # its k follows the cap (not a requested or fixed k)


class Planner:
    """Plans every round of every target this orchestrator drives."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self._costs: dict[str, RoundCosts] = {}
        self._pools: dict[str, _Pool] = {}  # per target: every session's judged drafts
        self._schedules: dict[tuple[str, int], Schedule] = {}

    # -- sessions ----------------------------------------------------------------------

    def session_policy(self, k: int | None) -> KPolicy:
        """The acceptance tracker of a new turn (the request's ``k``, or adaptive)."""
        c = self.config
        return KPolicy(k, k_max=c.k_max, alpha0=c.alpha0, smoothing=c.alpha_smoothing)

    def cost_model(self, target: str, batch: int) -> CostModel:
        """What drafting costs in plain rounds of ``batch`` on ``target``: measured, or
        the declared devices' prior until the rounds tell."""
        costs = self._costs.get(target)
        measured = None if costs is None else costs.model(batch)
        return measured or self.config.prior_costs

    def fit(self, target: str) -> RoundFit | None:
        """The round times fitted for ``target`` so far (None: none yet)."""
        costs = self._costs.get(target)
        return None if costs is None else costs.fit()

    def forget(self, target: str) -> None:
        """Drop a target's figures (it left the pool; a replacement may differ)."""
        self._costs.pop(target, None)
        self._pools.pop(target, None)
        for key in [k for k in self._schedules if k[0] == target]:
            del self._schedules[key]

    # -- planning ----------------------------------------------------------------------

    def plan(
        self, target: str, load: int, sessions: Sequence[SessionView], waiting: int = 0
    ) -> BatchPlan:
        """The round's plan for ``sessions`` on ``target``, which ``load`` sessions use
        (``waiting`` of them still to decode, outside this round)."""
        c = self.config
        bound = c.curve_cap(load)
        cost = self.cost_model(target, len(sessions))
        pool = self._pools.get(target)
        pooled = c.alpha0 if pool is None else pool.rate(c.alpha0)
        each = [self._session(v, bound, cost, pooled) for v in sessions]
        adaptive = [s for s in each if s.adaptive and s.view.drafter != "none"]
        goodput = {cap: _goodput(each, cap, cost) for cap in range(bound + 1)}
        cap = max(goodput, key=lambda x: (goodput[x], -x)) if adaptive else bound
        exploring: bool | None = None
        # An exploration only pays if its round is timed: none while the target
        # prefills a session or a draft warms beside the rounds (neither round counts).
        untimed = any(s.view.target_behind > 1 or s.view.cache is Cache.WARMING for s in each)
        if adaptive and bound > 0 and c.fixed_k is None and not untimed:
            best = any(s.ks[cap] > 0 for s in adaptive)
            # Re-timing drafting never pays for a new turn's first warm-up (its whole
            # history) where it stalls the round on shared hardware: it needs a session
            # whose draft is warm or has drafted this turn, or warm-ups that run beside
            # the rounds. On separate devices a lone session's warm-up inside its round
            # is a prefill on the draft's own device, and re-times drafting.
            stalls = c.devices is Devices.SHARED
            started = any(s.view.cache is Cache.WARM or s.view.turn_drafted for s in adaptive)
            if best or not stalls or started:
                key = (target, bucket_of(len(sessions)))
                exploring = self._schedules.setdefault(key, Schedule()).next_round(c, best)
        if exploring is not None:
            cap = bound if exploring else 0
        ks = [s.ks[cap] for s in each]
        if c.devices is Devices.SEPARATE and not exploring:
            ks = _filled(each, cap, cost.verify_per_token * goodput[cap], c.k_max)
        k = {}
        for s, chosen in zip(each, ks, strict=True):
            k[s.view.sid] = chosen
            if exploring and s.adaptive and s.view.drafter != "none" and s.view.tokens_left > 1:
                k[s.view.sid] = max(1, k[s.view.sid])  # re-time drafting, win it back
        warm = self._warm_ups(each, k)
        # A drafting round that also catches a draft up on plain rounds' tokens would read
        # as a fixed cost of drafting (and keep drafting off): an exploration of drafting
        # stays the choice until its next round, which is timed.
        catching_up = any(k[s.view.sid] and not s.view.draft_synced for s in each)
        timeable = not untimed and not catching_up and not any(s.view.sid in warm for s in each)
        steps: dict[str, int] = {}
        # A plain round decodes several steps, unless it only re-times plain decoding
        # (an exploration: one step tells the time, more would cost drafting's tokens),
        # prefills, warms a draft (its session drafts once warm) or keeps sessions waiting.
        several = c.steps_of_plain > 1 and exploring is None and timeable and not waiting
        if several and not any(k.values()):
            steps = {v.sid: max(1, min(c.steps_of_plain, v.tokens_left)) for v in sessions}
        return BatchPlan(cap, k, warm, timeable, exploring is not None, steps)

    def _session(self, v: SessionView, bound: int, cost: CostModel, pooled: float) -> _Session:
        """``v``'s k under each cap up to ``bound``; ``pooled``: the target's acceptance."""
        c = self.config
        left = max(1, v.tokens_left)
        m, judged = c.alpha_prior_trials, v.turn_accepted + v.turn_rejections
        alpha = (judged * v.alpha + m * pooled) / (judged + m)
        fixed = v.requested_k if v.requested_k is not None else c.fixed_k
        expect = [expected_tokens(alpha, k) for k in range(max(bound, fixed or 0) + 1)]
        if v.drafter == "none" or v.cache is Cache.WARMING:
            ks = [0] * (bound + 1)
        elif fixed is not None:
            ks = [fixed] * (bound + 1)
        else:
            ks, best, best_rate = [], 0, -1.0
            for k in range(bound + 1):  # the best k under each cap: the best over 0 .. cap
                if k <= c.k_max:
                    rate = expect[k] / cost.round(k)
                    if rate > best_rate:  # ties keep the smaller k
                        best, best_rate = k, rate
                ks.append(best)
        ks = [max(0, min(k, left - 1)) for k in ks]
        adaptive = v.requested_k is None and c.fixed_k is None
        return _Session(v, alpha, ks, [expect[k] for k in ks], adaptive)

    def _warm_ups(self, each: list[_Session], k: dict[str, int]) -> dict[str, WarmWhere]:
        """Which cold sessions warm, and where; a cold session not warmed inside verifies
        at k = 0 (``k`` is updated)."""
        c = self.config
        alone = len(each) == 1
        where = self._warm_where(each)
        cold = [s for s in each if s.view.cache is Cache.COLD and k[s.view.sid] > 0]
        # On shared hardware a batch's session warms once its target has prefilled it;
        # on separate devices its draft prefills while the target does.
        overlap = alone or c.devices is Devices.SEPARATE
        ready = [s for s in cold if overlap or s.view.target_behind <= c.warm_above_tokens]
        for s in cold:
            k[s.view.sid] = 0 if where is WarmWhere.BESIDE or s not in ready else k[s.view.sid]
        return {s.view.sid: where for s in ready}

    def _warm_where(self, each: list[_Session]) -> WarmWhere:
        """Where this batch's warm-ups run: inside the round when the session is alone or
        draft and target share hardware (the round waits for it), beside otherwise."""
        if len(each) == 1 or self.config.devices is Devices.SHARED:
            return WarmWhere.INSIDE
        return WarmWhere.BESIDE

    # -- learning ----------------------------------------------------------------------

    def observe(
        self, target: str, sessions: Sequence[SessionView], plan: BatchPlan, outcome: RoundOutcome
    ) -> None:
        """What a round planned by :meth:`plan` did: its acceptance and, where it is
        clean and timeable, its time."""
        self._pools.setdefault(target, _Pool()).add(outcome, self.config.acceptance_decay)
        schedule = self._schedules.get((target, bucket_of(len(sessions))))
        if schedule is not None:
            schedule.more_steps(outcome.steps)
        if not (outcome.clean and plan.timeable):
            return
        c = self.config
        costs = self._costs.get(target)
        if costs is None:
            steps_first = c.devices is Devices.SEPARATE  # a wider verify is about free there
            costs = self._costs[target] = RoundCosts(
                min_rounds=c.cost_min_rounds, decay=c.cost_decay, steps_first=steps_first
            )
        seconds = outcome.seconds
        if outcome.depth == 0:
            seconds = _plain_token_seconds(outcome, c.steps_of_plain)
        costs.observe(len(sessions), outcome.depth, outcome.drafts, seconds)
        if schedule is not None:
            schedule.timed(outcome.depth > 0)


@dataclass
class _Pool:
    """Judged drafts of every session on one target, decayed a round at a time."""

    accepted: float = 0.0
    judged: float = 0.0  # accepted drafts, and a failed trial per rejection

    def add(self, outcome: RoundOutcome, decay: float) -> None:
        accepted = judged = 0
        for sid, drafted in outcome.drafted.items():
            if drafted > 0:
                kept = outcome.accepted.get(sid, 0)
                accepted += kept
                judged += kept + (kept < drafted)
        self.accepted = decay * self.accepted + accepted
        self.judged = decay * self.judged + judged

    def rate(self, default: float) -> float:
        """The pooled acceptance; ``default`` until a trial is in it."""
        return self.accepted / self.judged if self.judged >= 1 else default


def _plain_token_seconds(outcome: RoundOutcome, steps: int) -> float:
    """What one plain token costs when plain rounds decode ``steps`` steps: a round of n
    steps costs its call once and its compute n times, so a round of fewer steps (an
    exploration, a round that kept sessions waiting) counts the steps it did not run at
    its compute per step (without the compute reported, its time per step)."""
    if outcome.steps >= steps or outcome.compute_s <= 0:
        return outcome.seconds / outcome.steps
    per_step = min(outcome.compute_s, outcome.seconds) / outcome.steps
    return (outcome.seconds + (steps - outcome.steps) * per_step) / steps


def _filled(each: list[_Session], cap: int, average: float, k_max: int) -> list[int]:
    """The sessions' k under ``cap``, each adaptive one's raised toward the round's depth
    while its next draft is expected to cost less than ``average``, the round's average
    token (``verify_per_token`` x its goodput): in a batch whose deepest session sets the
    draft's steps, a shallower session's extra draft adds only a verified position and
    ``a ** (k + 1)`` expected tokens."""
    out = [s.ks[cap] for s in each]
    depth = max(out, default=0)
    for i, s in enumerate(each):
        if not s.adaptive or s.view.drafter == "none" or s.view.cache is Cache.WARMING:
            continue
        top = min(depth, k_max, s.view.tokens_left - 1)
        while out[i] < top and s.alpha ** (out[i] + 1) > average:
            out[i] += 1
    return out


def _goodput(each: list[_Session], cap: int, cost: CostModel) -> float:
    """Expected tokens of the batch's round under ``cap`` per plain round of it."""
    if not each:
        return 0.0
    ks = [s.ks[cap] for s in each]
    return sum(s.expect[cap] for s in each) / cost.batch_round(max(ks), sum(ks))
