"""The planner (pure): k per session, the cap, warm-ups, exploration and what it learns."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import pytest

from specserve.policy import (
    BatchPlan,
    Cache,
    Devices,
    Planner,
    PolicyConfig,
    RoundOutcome,
    SessionView,
    WarmWhere,
)
from specserve.policy.explore import Schedule
from specserve.policy.k_policy import CostModel, expected_tokens


def view(sid: str = "a", **kw: object) -> SessionView:
    """A warm adaptive session with 64 tokens to go that has drafted this turn."""
    base = SessionView(sid, "model", None, 64, 0.85, turn_drafted=8, turn_accepted=7)
    return replace(base, **kw)  # type: ignore[arg-type]


def batch(n: int, **kw: object) -> list[SessionView]:
    return [view(str(i), **kw) for i in range(n)]


def test_a_lone_new_session_warms_inside_its_first_round_and_drafts_in_it() -> None:
    for devices in Devices:
        p = Planner(PolicyConfig(devices=devices))
        new = view(cache=Cache.COLD, target_behind=100, turn_drafted=0)
        plan = p.plan("t", 1, [new])
        assert plan.k["a"] >= 1 and plan.warm == {"a": WarmWhere.INSIDE}
        assert not plan.timeable  # its round prefills: not timed


def test_separate_devices_draft_a_batch_that_shared_cores_decode_plain() -> None:
    """Before any round is timed the declared devices' prior decides: on separate
    devices a wider verify is nearly free, on shared cores every drafted token of 8
    sessions slows the verify."""
    sessions = batch(8)
    separate = Planner(PolicyConfig(devices=Devices.SEPARATE)).plan("t", 8, sessions)
    shared = Planner(PolicyConfig(devices=Devices.SHARED)).plan("t", 8, sessions)
    assert min(separate.k.values()) >= 3 and separate.cap >= 3
    assert shared.cap == 0 and set(shared.k.values()) == {0}
    drafting = view("0", alpha=0.9, turn_drafted=40, turn_accepted=36, turn_rejections=4)
    lone = Planner(PolicyConfig(devices=Devices.SHARED)).plan("t", 1, [drafting])
    assert lone.k["0"] >= 2  # one session on shared cores drafts


class Priced(Planner):
    """A planner whose round costs are given (as if measured)."""

    def __init__(self, config: PolicyConfig, cost: CostModel) -> None:
        super().__init__(config)
        self.cost = cost

    def cost_model(self, target: str, batch: int) -> CostModel:
        return self.cost


def test_on_separate_devices_a_shallow_session_drafts_to_the_batchs_depth_where_it_pays() -> None:
    """The deepest sessions set the draft's steps; another session's extra draft then
    costs only a verified position, worth it while its next draft's chance of being kept
    beats the round's average token per unit of cost."""
    deep = [view(str(i), alpha=0.9, turn_drafted=40, turn_accepted=36) for i in range(7)]
    shallow = view("s", alpha=0.6, turn_drafted=40, turn_accepted=24, turn_rejections=16)
    near_end = view("e", alpha=0.6, turn_drafted=40, turn_accepted=24, tokens_left=3)
    sessions = [*deep, shallow, near_end]

    def plan(devices: Devices, load: int) -> BatchPlan:
        cost = CostModel(draft_per_token=0.17, verify_per_token=0.001, fixed=0.05)
        return Priced(PolicyConfig(devices=devices), cost).plan("t", load, sessions)

    filled = plan(Devices.SEPARATE, 9)
    depth = max(filled.k.values())
    assert depth >= 4
    assert filled.k["s"] == depth  # a verified position is about free: drafts to depth
    assert filled.k["e"] == 2  # never past its tokens left - 1
    own = plan(Devices.SHARED, 1)  # shared cores (no load bound here): its own best k
    assert max(own.k.values()) == depth and own.k["s"] < depth


def drafting_rounds(devices: Devices, rounds: int = 80) -> list[int]:
    """Which of ``rounds`` rounds of 4 sessions drafted, where drafting costs a plain
    round per drafted token of the batch (plain decoding wins once measured)."""
    p = Planner(PolicyConfig(devices=devices, explore_every=4, max_backoff=4, fixed_k=None))
    sessions = batch(4)
    drafted = []
    for i in range(rounds):
        plan = p.plan("t", 1 if devices is Devices.SHARED else 4, sessions)
        drafts = sum(plan.k.values())
        outcome = RoundOutcome(plan.k, plan.k, 0.1 * (1 + drafts), clean=True)
        p.observe("t", sessions, plan, outcome)
        if plan.cap > 0:
            drafted.append(i)
    return drafted


def test_measured_rounds_turn_drafting_off_where_it_is_slower_and_exploration_retimes_it() -> None:
    """Plain decoding wins once measured; drafting is re-timed now and then. On
    separate devices that stays every ``explore_every`` rounds (acceptance moves with
    the text, and a drafting round costs about a plain step there); on shared cores
    each lost re-timing doubles the interval, up to ``explore_every * max_backoff``."""
    separate = drafting_rounds(Devices.SEPARATE)
    assert separate[0] == 0  # the prior said draft
    late = [i for i in separate if i >= 20]
    assert 10 <= len(late) <= 16  # about one round in five: four plain, one drafting
    assert max(b - a for a, b in pairwise(late)) <= 5
    shared = drafting_rounds(Devices.SHARED)
    late = [i for i in shared if i >= 20]
    gaps = [b - a for a, b in pairwise(late)]
    assert late and len(late) <= 6 and max(gaps, default=16) >= 8  # backing off


def test_a_requested_or_fixed_k_is_drafted_whatever_the_cap() -> None:
    p = Planner(PolicyConfig(devices=Devices.SHARED))
    plan = p.plan("t", 8, [*batch(7), view("asked", requested_k=5)])
    assert plan.k["asked"] == 5
    fixed = Planner(PolicyConfig(fixed_k=3)).plan("t", 40, batch(2))  # past the curve's zero
    assert set(fixed.k.values()) == {3}
    assert Planner().plan("t", 1, [view(requested_k=5, tokens_left=3)]).k["a"] == 2  # 3 left


def test_a_warming_session_verifies_at_k_zero_and_makes_the_round_untimed() -> None:
    plan = Planner().plan("t", 2, [view("w", cache=Cache.WARMING), view("x")])
    assert plan.k["w"] == 0 and plan.k["x"] > 0 and not plan.timeable


def test_a_batchs_cold_session_warms_beside_its_targets_prefill_on_separate_devices() -> None:
    """On separate devices a batch's cold session warms its draft beside the rounds
    while its target still prefills it (the two devices prefill at once); on shared
    hardware it waits for the target's prefill, then warms inside the round."""
    prefilling = view("c", cache=Cache.COLD, target_behind=100)
    separate = Planner(PolicyConfig(devices=Devices.SEPARATE))
    plan = separate.plan("t", 2, [view("x"), prefilling])
    assert plan.warm == {"c": WarmWhere.BESIDE} and plan.k["c"] == 0 and plan.k["x"] > 0
    shared = Planner(PolicyConfig(devices=Devices.SHARED, fixed_k=3))
    waits = shared.plan("t", 2, [view("x"), prefilling])
    assert waits.k["c"] == 0 and waits.warm == {}  # the target prefills it first
    ready = replace(prefilling, target_behind=1)
    inside = shared.plan("t", 2, [view("x"), ready])
    assert inside.warm == {"c": WarmWhere.INSIDE} and inside.k["c"] > 0


def test_a_sessions_acceptance_is_its_judged_drafts_with_the_targets_pool_as_prior() -> None:
    p = Planner(PolicyConfig(alpha0=0.6, explore_every=1000))  # the predictions alone
    fresh = view(turn_drafted=0, turn_accepted=0)
    first = p.plan("t", 1, [fresh]).k["a"]  # no pool yet: alpha0
    for _ in range(50):  # the pool's drafts: 9 of 10 accepted
        p.observe(
            "t", batch(1), BatchPlan(8, {"0": 10}), RoundOutcome({"0": 10}, {"0": 9}, 0.2, True)
        )
    assert p._pools["t"].rate(0.6) == pytest.approx(0.9)
    # A new turn starts at the pool's rate, not alpha0 (nor its running estimate).
    assert p.plan("t", 1, [fresh]).k["a"] > first
    assert p.plan("t", 1, [replace(fresh, alpha=0.01)]).k == p.plan("t", 1, [fresh]).k
    # Two unlucky rounds (its running estimate alone: k = 1) leave it drafting more;
    # many rejected ones stop it.
    unlucky = view(alpha=0.45, turn_drafted=10, turn_accepted=1, turn_rejections=2)
    assert p.plan("t", 1, [unlucky]).k["a"] >= 3
    poor = view(alpha=0.05, turn_drafted=80, turn_accepted=3, turn_rejections=40)
    assert p.plan("t", 1, [poor]).k["a"] == 0
    p.forget("t")
    assert p.plan("t", 1, [fresh]).k["a"] == first


def test_observe_learns_only_from_clean_timeable_rounds_and_forget_drops_a_target() -> None:
    p = Planner(PolicyConfig(devices=Devices.SHARED))
    s = batch(1)
    for depth in (0, 1, 2, 3, 4, 1):  # drafting nearly free here: 0.001 s a token
        plan = BatchPlan(depth, {"0": depth})
        p.observe("t", s, plan, RoundOutcome({"0": depth}, {"0": depth}, 0.2 + 0.001 * depth, True))
    measured = p.cost_model("t", 1)
    assert measured != p.config.prior_costs and measured.round(4) < 1.1
    p.observe("u", s, BatchPlan(1, {"0": 1}, timeable=False), RoundOutcome({"0": 1}, {}, 9.0, True))
    p.observe("u", s, BatchPlan(1, {"0": 1}), RoundOutcome({"0": 1}, {}, 9.0, clean=False))
    assert p.cost_model("u", 1) == p.config.prior_costs
    p.forget("t")
    assert p.cost_model("t", 1) == p.config.prior_costs


def test_expected_tokens_is_the_papers_formula() -> None:
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_an_exploration_waits_for_a_round_that_can_time_it() -> None:
    """An exploration is only worth the round it costs if that round is timed: while a
    session prefills on the target (or warms its draft beside the rounds) no round is,
    so the predictions are followed; the first round that can be timed explores."""
    p = Planner(PolicyConfig(devices=Devices.SEPARATE, explore_every=4))
    warm = batch(8)
    admitting = [*batch(7), view("new", target_behind=200, turn_drafted=0)]

    def round_of(sessions: list[SessionView]) -> BatchPlan:
        plan = p.plan("t", 8, sessions)
        seconds = 0.03 + 0.003 * max(plan.k.values())  # drafting pays: the prior says so
        p.observe("t", sessions, plan, RoundOutcome(plan.k, plan.k, seconds, clean=True))
        return plan

    assert all(round_of(warm).cap > 0 for _ in range(3))
    untimed = [round_of(admitting) for _ in range(12)]  # the exploration falls due here
    assert all(plan.cap > 0 and not plan.timeable for plan in untimed)
    explored = round_of(warm)
    assert explored.exploring and explored.cap == 0 and explored.timeable  # timed: resolved
    assert all(round_of(warm).cap > 0 for _ in range(3))


def lone_sessions_measured_plain(devices: Devices) -> tuple[Planner, list[SessionView]]:
    """A planner whose timed lone-session rounds say plain decoding is faster (drafting
    costs more than it brings), and the warm lone session it timed them on."""
    p = Planner(PolicyConfig(devices=devices, explore_every=4, max_backoff=2))
    warm = batch(1)
    for _ in range(30):  # drafting here costs more than it brings
        plan = p.plan("t", 1, warm)
        drafts = sum(plan.k.values())
        p.observe("t", warm, plan, RoundOutcome(plan.k, plan.k, 0.1 * (1 + drafts), clean=True))
    return p, warm


def test_re_timing_drafting_never_pays_for_a_warm_up_that_stalls_the_round() -> None:
    """Once measured rounds say a lone session on shared cores decodes faster plain, a
    new turn's cold draft is never warmed just to re-time drafting: the warm-up of its
    whole history would stall the round. A session whose draft is warm, or that has
    drafted this turn, still re-times it now and then."""
    p, warm = lone_sessions_measured_plain(Devices.SHARED)
    cold = [view(cache=Cache.COLD, turn_drafted=0, alpha=0.7)]
    plans = [p.plan("t", 1, cold) for _ in range(40)]
    assert all(plan.cap == 0 and not plan.warm and not plan.exploring for plan in plans)
    assert any(p.plan("t", 1, warm).exploring for _ in range(12))  # a warm draft re-times
    behind = [view(cache=Cache.COLD, turn_drafted=4)]  # drafted this turn, fell behind
    assert any(p.plan("t", 1, behind).exploring for _ in range(70))


def test_a_lone_new_turn_on_separate_devices_still_re_times_drafting() -> None:
    """On separate devices a lone session's warm-up inside its round is a prefill on
    the draft's own device: once measured rounds say plain decoding is faster, a new
    turn's cold draft is still warmed now and then to re-time drafting, so a lone
    session whose first timings went wrong does not decode plain for good."""
    p, _ = lone_sessions_measured_plain(Devices.SEPARATE)
    cold = [view(cache=Cache.COLD, turn_drafted=0, alpha=0.7)]
    plans = [p.plan("t", 1, cold) for _ in range(12)]
    explored = [plan for plan in plans if plan.exploring]
    assert explored and all(plan.cap == 0 or plan.exploring for plan in plans)
    assert all(plan.warm == {"a": WarmWhere.INSIDE} and plan.k["a"] >= 1 for plan in explored)
    assert all(not plan.timeable for plan in explored)  # the warm-up's round is not timed


def test_a_round_without_drafts_decodes_several_steps_up_to_each_sessions_tokens_left() -> None:
    """Plain rounds decode ``steps_of_plain`` tokens per Verify (8 on separate devices,
    1 on shared cores), never past a session's max tokens; a drafting round runs one."""
    plain = [view("0", drafter="none"), view("1", drafter="none", tokens_left=3)]
    separate = Planner(PolicyConfig(devices=Devices.SEPARATE)).plan("t", 2, plain)
    assert separate.steps == {"0": 8, "1": 3}
    assert Planner(PolicyConfig(devices=Devices.SHARED)).plan("t", 2, plain).steps == {}
    four = Planner(PolicyConfig(devices=Devices.SHARED, plain_steps=4)).plan("t", 2, plain)
    assert four.steps == {"0": 4, "1": 3}
    mixed = Planner(PolicyConfig(devices=Devices.SEPARATE)).plan("t", 2, [plain[0], view("2")])
    assert mixed.k["2"] > 0 and mixed.steps == {}  # someone drafts: one step each


def test_a_multi_step_plain_round_is_timed_per_step() -> None:
    """The cost model's plain round is what one plain token costs: a round of 8 steps
    taking 8 x 10 ms teaches the same plain round as one step of 10 ms."""
    fits = []
    for steps in (1, 8):
        p = Planner(PolicyConfig(devices=Devices.SEPARATE, cost_min_rounds=2))
        s = batch(2)
        for i in range(12):
            depth = 4 * (i % 2)
            k = {v.sid: depth for v in s}
            plan = BatchPlan(depth, k)
            seconds = 0.010 + 0.002 * depth if depth else 0.010 * steps
            outcome = RoundOutcome(k, k, seconds, True, steps=1 if depth else steps)
            p.observe("t", s, plan, outcome)
        fit = p.fit("t")
        assert fit is not None
        fits.append(fit.plain(2))
    assert fits[0] == pytest.approx(0.010, rel=1e-6) and fits[1] == pytest.approx(0.010, rel=1e-6)


def test_a_round_that_only_retimes_plain_decoding_runs_one_step() -> None:
    """An exploration at cap 0 times a plain round; eight steps of it would cost a
    drafting session eight tokens at the plain rate instead of one."""
    p = Planner(PolicyConfig(devices=Devices.SEPARATE, explore_every=2, max_backoff=2))
    s = [view("0", alpha=0.95, turn_drafted=40, turn_accepted=38, turn_rejections=2)]
    seen = []
    for _ in range(12):
        plan = p.plan("t", 1, s)
        seen.append((plan.exploring, plan.cap, dict(plan.steps)))
        drafts = plan.k["0"]
        outcome = RoundOutcome(plan.k, plan.k, 0.012 + 0.002 * drafts, True)
        p.observe("t", s, plan, outcome)
    retimed = [x for x in seen if x[0] and x[1] == 0]
    assert retimed, seen  # plain decoding was re-timed
    assert all(steps == {} for _, _, steps in retimed)


def test_a_plain_round_runs_one_step_where_more_would_hold_something_up() -> None:
    """Sessions waiting for admission (or in another lane), a prefill in the round and a
    draft warming beside it each keep a plain round at one step."""
    p = Planner(PolicyConfig(devices=Devices.SEPARATE))
    plain = view("0", drafter="none")
    assert p.plan("t", 1, [plain]).steps == {"0": 8}
    assert p.plan("t", 4, [plain], waiting=3).steps == {}
    assert p.plan("t", 1, [replace(plain, target_behind=40)]).steps == {}
    warming = view("1", cache=Cache.WARMING)
    assert p.plan("t", 2, [plain, warming]).steps == {}


def test_multi_step_rounds_re_time_drafting_as_often_in_tokens() -> None:
    """Exploration's interval counts one-step rounds: a session decoding plain in rounds
    of 8 steps re-times drafting within about ``explore_every`` tokens, not 8 times as
    many (a fresh stack's first request, whose first drafts were all rejected, would
    otherwise decode its whole turn plain)."""
    p = Planner(PolicyConfig(devices=Devices.SEPARATE, explore_every=8))
    s = [view("0", alpha=0.05, turn_drafted=60, turn_accepted=0, turn_rejections=40)]
    plain_rounds = 0
    while not (plan := p.plan("t", 1, s)).exploring and plain_rounds < 8:
        assert plan.cap == 0 and plan.steps == {"0": 8}
        p.observe("t", s, plan, RoundOutcome(plan.k, plan.k, 0.1, True, steps=8))
        plain_rounds += 1
    assert plan.exploring and plan.k["0"] >= 1 and plain_rounds <= 2, plain_rounds


def test_a_one_step_plain_round_is_timed_as_a_token_of_a_multi_step_round() -> None:
    """Where plain rounds decode 8 steps, a one-step plain round (an exploration, a round
    that kept sessions waiting) of 18 ms with 6 ms of target compute says a plain token
    costs (18 + 7 x 6) / 8 = 7.5 ms: its call's cost spread over the 8 steps a plain
    round runs. Timed as 18 ms, drafting looked worth its rounds where it was not."""
    p = Planner(PolicyConfig(devices=Devices.SEPARATE, cost_min_rounds=2))
    s = batch(3)
    for i in range(12):
        depth = 4 * (i % 2)
        k = {v.sid: depth for v in s}
        seconds = 0.030 if depth else 0.018
        p.observe("t", s, BatchPlan(depth, k), RoundOutcome(k, k, seconds, True, compute_s=0.006))
    fit = p.fit("t")
    assert fit is not None and fit.plain(3) == pytest.approx(0.0075, rel=1e-6)
    shared = Planner(PolicyConfig(devices=Devices.SHARED, cost_min_rounds=2))  # one step
    for i in range(12):
        depth = 4 * (i % 2)
        k = {v.sid: depth for v in s}
        seconds = 0.030 if depth else 0.018
        outcome = RoundOutcome(k, k, seconds, True, compute_s=0.006)
        shared.observe("t", s, BatchPlan(depth, k), outcome)
    fit = shared.fit("t")
    assert fit is not None and fit.plain(3) == pytest.approx(0.018, rel=1e-6)


def test_a_flip_to_plain_re_times_drafting_within_its_own_bound() -> None:
    """While drafting wins, each lost re-timing of plain decoding doubles the wait (up to
    ``explore_every * max_backoff``). When the predictions then choose plain (a turn's
    first drafts rejected), drafting is re-timed within its own bound on separate
    devices (``explore_every`` rounds), not after plain's backoff: a session whose text
    turns predictable wins speculation back within a few tokens."""
    config = PolicyConfig(devices=Devices.SEPARATE, explore_every=8, max_backoff=8)
    schedule = Schedule()
    for _ in range(400):  # drafting predicted best; every plain re-timing loses
        if schedule.next_round(config, True) is False:
            schedule.timed(False)
    assert schedule.interval == 64  # plain's backoff, earned
    waited = 0
    while schedule.next_round(config, False) is not True:
        waited += 1
        assert waited <= 8, "drafting was not re-timed within explore_every rounds"
    flipped = Schedule()
    for _ in range(400):  # on shared cores drafting backs off as plain does: no change
        if flipped.next_round(replace(config, devices=Devices.SHARED), True) is False:
            flipped.timed(False)
    assert flipped.interval == 64


def test_a_drafting_round_that_catches_a_draft_up_on_plain_rounds_is_not_timed() -> None:
    """After plain rounds a drafting round's draft also reads their tokens, a cost that is
    not drafting's: the round is planned untimed (its time never reaches the cost fit),
    and an exploration of drafting is timed on its next round, the draft then synced."""
    p = Planner(PolicyConfig(devices=Devices.SHARED, explore_every=4))
    behind = view(draft_synced=False, alpha=0.9, turn_drafted=40, turn_accepted=36)
    drafting = 0
    for _ in range(20):  # were they learnt, these would make a fit (and drafting dear)
        plan = p.plan("t", 1, [behind])
        if plan.k["a"]:  # not an exploration of plain rounds
            assert not plan.timeable
            drafting += 1
        p.observe("t", [behind], plan, RoundOutcome(plan.k, plan.k, 9.0, clean=True))
    assert drafting >= 10 and p.fit("t") is None  # nothing learnt of drafting's cost
    synced = p.plan("t", 1, [replace(behind, draft_synced=True)])
    assert synced.k["a"] > 0 and synced.timeable
    plain = p.plan("t", 1, [replace(behind, drafter="none")])
    assert plain.timeable  # a plain round catches nothing up
