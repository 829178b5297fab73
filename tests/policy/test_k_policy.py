"""The k policy: whether an adaptive session drafts, how deep its drafts may run, and
the tokens a session expects of a round under a cap (pure)."""

from __future__ import annotations

import pytest

from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.sampling import SamplingParams
from specserve.policy.k_policy import (
    MAX_DEPTH_FLOOR,
    PROBE_EVERY,
    CostModel,
    KPolicy,
    expected_tokens,
)


def state(policy: KPolicy, *, max_new_tokens: int = 64, drafter: str = "model") -> DecodeState:
    return DecodeState(
        "s", [1, 2, 3], SamplingParams(), StopCriteria(max_new_tokens), policy, drafter=drafter
    )


def test_expected_tokens_is_leviathans_eq_1() -> None:
    assert expected_tokens(0.8, 0) == 1.0
    assert expected_tokens(0.8, 3) == pytest.approx(1 + 0.8 + 0.8**2 + 0.8**3)
    assert expected_tokens(1.0, 4) == 5.0


def test_a_plan_drafts_to_the_cap_while_first_drafts_pay_and_changes_nothing() -> None:
    policy = KPolicy(None, alpha0=0.95)
    assert policy.plan() == policy.k_max == 8  # the depth floor, not k, stops the round
    assert policy.plan(2) == 2
    assert policy.plan(0) == 0
    policy.first_alpha = 0.05  # first drafts nearly always rejected: plain decoding
    assert [policy.plan(8) for _ in range(16)] == [0] * 16  # no probe, no state
    probes = [policy.next_k(8) for _ in range(PROBE_EVERY)]
    assert probes == [0] * (PROBE_EVERY - 1) + [1]  # next_k probes
    assert [policy.next_k(0) for _ in range(8)] == [0] * 8  # never above the cap


def test_drafting_stops_when_kept_first_drafts_no_longer_pay_for_themselves() -> None:
    """A first draft costs a draft forward and a verified position (and drafting's fixed
    cost) and saves a plain round when kept: the session drafts while its running rate
    of kept first drafts is above that cost, and the rate moves slowly (two rejected
    rounds do not stop a good draft)."""
    cost = CostModel(draft_per_token=0.3, verify_per_token=0.15, fixed=0.05)
    policy = KPolicy(None, cost=cost, alpha0=0.7)
    policy.observe(4, 0)
    policy.observe(4, 0)
    assert policy.drafting_pays()  # 0.7 -> 0.63: still above 0.5
    rounds = 0
    while policy.drafting_pays():
        policy.observe(3, 0)
        rounds += 1
    assert 3 <= rounds <= 8 and policy.first_alpha <= 0.5
    while not policy.drafting_pays():
        policy.observe(1, 1)  # probes kept: drafting wins back
    assert policy.plan(8) == 8
    dear = KPolicy(None, cost=CostModel(0.3, 0.25, fixed=2.0), alpha0=0.99)
    assert dear.plan(8) == 0  # a fixed cost of two plain rounds: drafting never pays
    assert KPolicy(3, cost=CostModel(0.3, 0.25, fixed=2.0)).plan(8) == 3  # as asked


def test_the_depth_floor_rises_as_drafts_cost_more_or_are_kept_less() -> None:
    cost = CostModel(draft_per_token=0.3, verify_per_token=0.15)
    policy = KPolicy(None, cost=cost, alpha0=0.9)
    assert policy.depth_floor() == pytest.approx(0.45 / 0.9)
    assert policy.draft_confidence == policy.depth_floor()
    policy.observe(1, 0)  # a rejection: alpha falls, drafting further pays less
    assert policy.depth_floor() > 0.45 / 0.9
    policy.measured(CostModel(draft_per_token=0.1, verify_per_token=0.05))
    assert policy.depth_floor() < 0.45 / 0.9  # cheaper: draft deeper
    policy.alpha = 0.0
    assert policy.depth_floor() == MAX_DEPTH_FLOOR < 1.0  # a valid DraftInput floor
    assert KPolicy(4, cost=cost).draft_confidence == 0.0  # a requested k: drafted whole


def test_a_requested_k_is_drafted_under_any_cap() -> None:
    """A fixed k is what the request named: the load cap and k_max bound only adaptive k."""
    assert [KPolicy(3).next_k(cap) for cap in (8, 2, 0, None)] == [3, 3, 3, 3]
    assert KPolicy(12, k_max=8).next_k(4) == 12
    assert KPolicy(0).next_k(8) == 0


def test_a_plan_for_every_cap_is_the_plan_under_each() -> None:
    for alpha in (0.05, 0.5, 0.7, 0.9, 0.99, 1.0):
        policy = KPolicy(None, alpha0=alpha, k_max=6)
        assert policy.plans(9) == [policy.plan(cap) for cap in range(10)]
        assert policy.plans(9) == ([0] * 10 if alpha < 0.6 else [0, 1, 2, 3, 4, 5, 6, 6, 6, 6])
    assert KPolicy(3).plans(5) == [3] * 6


def test_a_session_expects_its_acceptance_at_the_k_it_would_draft() -> None:
    policy = KPolicy(None, alpha0=0.9)
    s = state(policy)
    outlook = s.outlook(8)
    assert [k for _, k in outlook] == [policy.plan(cap) for cap in range(9)]
    for cap in (0, 1, 2, 4, 8):
        assert outlook[cap][0] == pytest.approx(expected_tokens(0.9, policy.plan(cap)))
    assert outlook[0][0] == 1.0
    assert outlook[4][0] > outlook[2][0] > 1.0
    # Two tokens to go: at most one draft, whatever the cap.
    assert state(KPolicy(6, alpha0=0.9), max_new_tokens=2).outlook(8)[8] == pytest.approx((1.9, 1))
    assert state(KPolicy(None), drafter="none").outlook(8)[8] == (1.0, 0)
