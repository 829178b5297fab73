"""The one round-cost fitter (pure): plain time by batch bucket, drafting's cost by
depth and drafted tokens; and the k policy planning with what it measured."""

from __future__ import annotations

import pytest

from specserve.policy.k_policy import CostModel, KPolicy
from specserve.policy.round_cost import RoundCosts, bucket_of

T0, FIXED, STEP, TOKEN = 0.25, 0.01, 0.04, 0.02  # seconds: plain round, drafting's


def seconds(batch: int, depth: int, t0: float = T0, step: float = STEP) -> float:
    """A round of ``batch`` sessions each drafting ``depth``."""
    if depth == 0:
        return t0
    return t0 + FIXED + step * depth + TOKEN * batch * depth


def feed(costs: RoundCosts, rounds: list[tuple[int, int]], **kw: float) -> None:
    for batch, depth in rounds:
        costs.observe(batch, depth, batch * depth, seconds(batch, depth, **kw))


def test_the_fit_recovers_every_coefficient_from_two_batch_sizes() -> None:
    costs = RoundCosts(decay=1.0)
    feed(costs, [(1, 0), (1, 1), (1, 3), (4, 0), (4, 2), (4, 4), (1, 2), (4, 1)])
    fit = costs.fit()
    assert fit is not None
    assert fit.fixed == pytest.approx(FIXED)
    assert fit.per_step == pytest.approx(STEP)
    assert fit.per_token == pytest.approx(TOKEN)
    assert fit.t0 == {bucket_of(1): pytest.approx(T0), bucket_of(4): pytest.approx(T0)}
    model = costs.model(4)
    assert model is not None
    assert model.batch_round(2, 8) == pytest.approx(seconds(4, 2) / T0)
    assert model.round(3) == pytest.approx((T0 + FIXED + 3 * (STEP + TOKEN)) / T0)


def test_a_lone_session_without_plain_rounds_is_fitted_per_drafted_token() -> None:
    """The local loop's rounds: one batch size (steps and tokens not told apart) and no
    plain round (the fixed cost not told from t0): the fit keeps the dearer reading."""
    costs = RoundCosts()
    feed(costs, [(1, 1), (1, 2), (1, 3), (1, 4), (1, 2), (1, 1)])
    model = costs.model()
    assert model is not None
    assert model.fixed == 0.0 and model.draft_per_token == 0.0
    assert model.verify_per_token == pytest.approx((STEP + TOKEN) / (T0 + FIXED))


def test_steps_first_reads_one_batch_sizes_rounds_as_the_drafts_sequential_steps() -> None:
    """Separate devices: the same lone-session rounds are read as draft steps, so a batch
    of eight drafting as deep costs what one does, not eight times its drafted tokens;
    rounds of two batch sizes are fitted alike either way."""
    lone = [(1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 2), (1, 1)]
    steps = RoundCosts(steps_first=True)
    feed(steps, lone)
    fit = steps.fit()
    assert fit is not None and fit.per_token == 0.0
    assert fit.per_step == pytest.approx(STEP + TOKEN) and fit.fixed == pytest.approx(FIXED)
    tokens = RoundCosts()
    feed(tokens, lone)
    dear = tokens.fit()
    assert (
        dear is not None and dear.per_step == 0.0 and dear.per_token == pytest.approx(STEP + TOKEN)
    )
    both = [*lone, (8, 0), (8, 2), (8, 3), (8, 1)]
    fits = []
    for costs in (RoundCosts(steps_first=True, decay=1.0), RoundCosts(decay=1.0)):
        feed(costs, both)
        fits.append(costs.fit())
    assert fits[0] is not None and fits[1] is not None
    assert fits[0].per_token == pytest.approx(fits[1].per_token) == pytest.approx(TOKEN)
    assert fits[0].per_step == pytest.approx(fits[1].per_step) == pytest.approx(STEP)


def test_no_fit_before_enough_rounds_or_while_k_has_not_varied() -> None:
    costs = RoundCosts(min_rounds=4)
    feed(costs, [(1, 1), (1, 2), (1, 3)])
    assert costs.model() is None  # three rounds
    same = RoundCosts()
    feed(same, [(1, 4)] * 10)
    assert same.model() is None  # one k, no plain round: intercept and slope not told apart
    plain_then_one_k = RoundCosts()
    feed(plain_then_one_k, [(1, 0), (1, 0), (1, 4), (1, 4), (1, 4)])
    model = plain_then_one_k.model()
    assert model is not None  # told apart by the plain rounds: all of it per drafted token
    assert model.round(4) == pytest.approx(seconds(1, 4) / T0)


def test_a_slope_the_rounds_would_make_negative_is_held_at_zero() -> None:
    costs = RoundCosts(decay=1.0)
    for k, s in [(0, 0.25), (1, 0.30), (2, 0.29), (3, 0.28), (4, 0.27)]:
        costs.observe(1, k, k, s)  # noise: deeper rounds look cheaper
    fit = costs.fit()
    assert fit is not None and fit.per_step == fit.per_token == 0.0
    assert fit.fixed == pytest.approx(0.285 - 0.25)  # drafting all fixed, by the mean


def test_newer_rounds_outweigh_older_ones() -> None:
    costs = RoundCosts(decay=0.8)
    rounds = [(1, 0), (1, 1), (1, 2), (1, 4)]
    feed(costs, rounds * 3, step=0.10)
    feed(costs, rounds * 10, step=0.01)  # the machine got faster at drafting
    model = costs.model()
    assert model is not None
    assert model.round(2) == pytest.approx(seconds(1, 2, step=0.01) / T0, rel=0.02)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_rounds"):
        RoundCosts(min_rounds=1)
    with pytest.raises(ValueError, match="decay"):
        RoundCosts(decay=0.0)


def test_the_policy_plans_with_measured_costs_and_goes_back_to_its_static_ones() -> None:
    policy = KPolicy(None, alpha0=0.85)
    static_floor = policy.depth_floor()
    cheap = CostModel(draft_per_token=0.15, verify_per_token=0.08, fixed=0.0)
    policy.measured(cheap)
    assert policy.cost is cheap
    assert policy.depth_floor() < static_floor  # drafting costs less than guessed: deeper
    assert policy.plans(8) == [policy.plan(cap) for cap in range(9)]
    policy.measured(None)
    assert policy.cost is policy.static and policy.depth_floor() == static_floor
    dear = CostModel(draft_per_token=0.3, verify_per_token=0.25, fixed=2.0)
    policy.measured(dear)
    assert policy.plan(8) == 0  # a fixed cost of two plain rounds: drafting never pays
    fixed = KPolicy(3)
    fixed.measured(dear)
    assert fixed.plan(8) == 3  # a fixed k is what was asked for


def test_the_fit_is_the_least_squares_fit_of_every_unknown_at_once() -> None:
    """The bucket intercepts are partialled out in closed form: the coefficients are still
    those of one least-squares fit of all of them (numpy's, on noisy rounds of three
    batch sizes)."""
    import random

    import numpy as np

    rng = random.Random(5)
    costs = RoundCosts(decay=1.0)
    rows, ys = [], []
    buckets = [bucket_of(b) for b in (1, 8, 32)]
    for _ in range(60):
        batch = rng.choice((1, 8, 32))
        depth = rng.choice((0, 1, 2, 3, 4, 6))
        drafts = depth * rng.randint(max(1, batch // 2), batch) if depth else 0
        y = seconds(batch, depth) + rng.gauss(0, 0.003)
        costs.observe(batch, depth, drafts, y)
        rows.append([float(bucket_of(batch) == b) for b in buckets] + [depth > 0, depth, drafts])
        ys.append(y)
    beta, *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(ys), rcond=None)
    fit = costs.fit()
    assert fit is not None and min(beta[3:]) > 0  # all three identified and positive
    assert [fit.t0[b] for b in buckets] == pytest.approx(list(beta[:3]))
    assert [fit.fixed, fit.per_step, fit.per_token] == pytest.approx(list(beta[3:]))
