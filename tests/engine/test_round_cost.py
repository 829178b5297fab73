"""Round costs measured in the local loop, and the k policy planning with them (pure)."""

from __future__ import annotations

import pytest

from specserve.engine.k_policy import CostModel, KPolicy
from specserve.engine.round_cost import RoundCosts

T0, FIXED, DRAFT, VERIFY = 0.25, 0.01, 0.04, 0.02  # seconds: plain round, drafting's


def feed(costs: RoundCosts, ks: list[int], t0: float = T0, draft: float = DRAFT) -> None:
    for k in ks:
        costs.observe(k, (FIXED + draft * k) if k else 0.0, t0 + VERIFY * k)


def test_the_fit_recovers_the_rounds_lines_in_plain_rounds() -> None:
    costs = RoundCosts()
    feed(costs, [1, 2, 3, 4, 2, 1])
    model = costs.model()
    assert model is not None
    assert model.draft_per_token == pytest.approx(DRAFT / T0)
    assert model.verify_per_token == pytest.approx(VERIFY / T0)
    assert model.fixed == pytest.approx(FIXED / T0)
    assert model.round(0) == 1.0
    assert model.round(3) == pytest.approx((T0 + FIXED + 3 * (DRAFT + VERIFY)) / T0)


def test_no_fit_before_enough_rounds_or_while_k_has_not_varied() -> None:
    costs = RoundCosts(min_rounds=4)
    feed(costs, [1, 2, 3])
    assert costs.model() is None  # three rounds
    same = RoundCosts()
    feed(same, [4] * 10)
    assert same.model() is None  # one k: intercept and slope not told apart
    plain_then_one_k = RoundCosts()
    feed(plain_then_one_k, [0, 0, 4, 4, 4])  # the verify line is told; drafting per token
    model = plain_then_one_k.model()
    assert model is not None
    assert model.fixed == 0.0
    assert model.draft_per_token == pytest.approx((FIXED + 4 * DRAFT) / 4 / T0)


def test_a_slope_the_rounds_would_make_negative_is_held_at_zero() -> None:
    costs = RoundCosts(decay=1.0)
    for k, seconds in [(1, 0.30), (2, 0.29), (3, 0.28), (4, 0.27)]:
        costs.observe(k, 0.05, seconds)  # noise: verify looks cheaper with more drafts
    model = costs.model()
    assert model is not None and model.verify_per_token == 0.0
    assert model.fixed == pytest.approx(0.05 / 0.285)  # drafting all fixed, by the mean


def test_newer_rounds_outweigh_older_ones() -> None:
    costs = RoundCosts(decay=0.8)
    feed(costs, [1, 2, 3, 4] * 3, draft=0.10)
    feed(costs, [1, 2, 3, 4] * 10, draft=0.02)  # the machine got faster at drafting
    model = costs.model()
    assert model is not None
    assert model.draft_per_token == pytest.approx(0.02 / T0, rel=0.02)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_rounds"):
        RoundCosts(min_rounds=1)
    with pytest.raises(ValueError, match="decay"):
        RoundCosts(decay=0.0)


def test_the_policy_plans_with_measured_costs_and_goes_back_to_its_static_ones() -> None:
    policy = KPolicy(None, alpha0=0.85)
    static_plan = policy.plan(8)
    cheap = CostModel(draft_per_token=0.15, verify_per_token=0.08, fixed=0.0)
    policy.measured(cheap)
    assert policy.cost is cheap
    assert policy.plan(8) > static_plan  # drafting costs less than guessed: draft more
    assert policy.plans(8) == [policy.plan(cap) for cap in range(9)]
    policy.measured(None)
    assert policy.cost is policy.static and policy.plan(8) == static_plan
    dear = CostModel(draft_per_token=0.3, verify_per_token=0.25, fixed=2.0)
    policy.measured(dear)
    assert policy.plan(8) == 0  # a fixed cost of two plain rounds: drafting never pays
    fixed = KPolicy(3)
    fixed.measured(dear)
    assert fixed.plan(8) == 3  # a fixed k is what was asked for
