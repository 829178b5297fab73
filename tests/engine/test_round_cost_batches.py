"""The round-cost fit across batch sizes (pure, synthetic rounds): drafting at all
costs each batch size its own, and a stretch of equally deep drafting rounds (a fixed
k) leaves no nonsense behind for the adaptive plans after it."""

from __future__ import annotations

import random

import pytest

from specserve.engine.k_policy import CostModel, best_k
from specserve.engine.round_cost import RoundCosts, bucket_of

STEP = 0.003  # seconds per draft step
PRIOR = CostModel(draft_per_token=0.17, verify_per_token=0.02, fixed=0.05)


def plain_s(batch: int) -> float:
    return 0.0155 + 0.0011 * batch


def propose_s(batch: int) -> float:
    """Drafting at all: a Propose whose cost grows with the sessions it carries."""
    return 0.002 + 0.0006 * batch


def truth(batch: int, depth: int) -> float:
    return plain_s(batch) + (depth > 0) * (propose_s(batch) + STEP * depth)


def feed(costs: RoundCosts, batch: int, depths: list[int], rng: random.Random) -> None:
    for depth in depths:
        noise = rng.gauss(0.0, 0.0003)
        costs.observe(batch, depth, batch * depth, truth(batch, depth) + noise)


def test_drafting_at_all_costs_each_batch_size_its_own() -> None:
    """One session, then 8, then 32 (mostly plain, explorations at the cap): the fit
    predicts every batch size's drafting rounds, where one fixed cost shared by all
    would push 32 sessions' dearer Propose into the slopes."""
    rng = random.Random(1)
    costs = RoundCosts(steps_first=True, prior=PRIOR)
    feed(costs, 1, [0, 1, 2, 3, 4, 5, 0, 3, 4, 2, 6, 0], rng)
    feed(costs, 8, [0, 2, 3, 4, 5, 0, 4, 3, 6, 2], rng)
    feed(costs, 32, [0, 0, 0, 8, 0, 0, 0, 8, 0, 0, 4, 0, 0, 8, 0, 5, 0, 0, 3, 0], rng)
    for batch in (1, 8, 32):
        model = costs.model(batch)
        assert model is not None
        for depth in (2, 4, 8):
            want = truth(batch, depth) / plain_s(batch)
            assert model.batch_round(depth, batch * depth) == pytest.approx(want, rel=0.05)
    model = costs.model(32)
    assert model is not None and best_k(0.75, 8, model) >= 3  # drafting pays at 32


def fixed_k_rounds(batch: int, k: int, rounds: int) -> list[tuple[int, int]]:
    """A fixed-k turn of ``batch`` sessions: every round at ``k``, the batch shrinking
    at the end as turns finish."""
    tail = [max(1, batch - i) for i in range(1, 4)]
    return [(batch, k)] * (rounds - len(tail)) + [(b, k) for b in tail]


def test_a_fixed_k_stretch_leaves_no_nonsense_behind() -> None:
    """Plain turns and fixed-k = 4 turns at 8 and 32 sessions: within a batch size every
    drafting round is equally deep, so the slopes cannot be told from the fixed cost.
    The fit holds the prior's slopes, keeps every intercept positive, predicts the
    rounds it saw, and the adaptive plans after it draft."""
    rng = random.Random(2)
    costs = RoundCosts(steps_first=True, prior=PRIOR)
    for batch in (8, 32):
        for b, depth in [(batch, 0)] * 20 + fixed_k_rounds(batch, 4, 20):
            costs.observe(b, depth, b * depth, truth(b, depth) + rng.gauss(0.0, 0.0003))
    fit = costs.fit()
    assert fit is not None
    assert min(fit.t0.values()) > 0 and min(fit.fixed.values()) >= 0
    for batch in (8, 32):
        assert fit.t0[bucket_of(batch)] == pytest.approx(plain_s(batch), rel=0.05)
        model = costs.model(batch)
        assert model is not None
        want = truth(batch, 4) / plain_s(batch)
        assert model.batch_round(4, 4 * batch) == pytest.approx(want, rel=0.1)
        assert best_k(0.85, 8, model) >= 3
