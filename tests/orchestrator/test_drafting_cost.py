"""The drafting cost fit: non-negative least squares over rounds of several batch sizes."""

from __future__ import annotations

import pytest

from specserve.orchestrator.drafting_cost import DraftingCost, Group, fit_drafting_cost


def group(t0: float, rounds: list[tuple[int, int, float]], weight: float = 1.0) -> Group:
    """Equal-weight moments of (1, depth, drafts, seconds) over ``rounds``."""
    m = [[0.0] * 4 for _ in range(4)]
    for depth, drafts, seconds in rounds:
        v = (1.0, depth, drafts, seconds)
        for i in range(4):
            for j in range(4):
                m[i][j] += v[i] * v[j] / len(rounds)
    return t0, m, weight


def test_nothing_to_fit_is_none() -> None:
    assert fit_drafting_cost([]) is None


def test_steps_and_drafted_tokens_are_told_apart_by_batch_size() -> None:
    truth = DraftingCost(fixed=0.01, per_step=0.04, per_token=0.02)
    one = group(0.2, [(d, d, 0.2 + truth.extra(d, d)) for d in (1, 2, 4, 8)])
    eight = group(0.26, [(d, 8 * d, 0.26 + truth.extra(d, 8 * d)) for d in (1, 2, 3)])
    fit = fit_drafting_cost([one, eight])
    assert fit is not None
    assert (fit.fixed, fit.per_step, fit.per_token) == pytest.approx((0.01, 0.04, 0.02))


def test_one_batch_size_puts_the_cost_per_drafted_token_and_never_below_zero() -> None:
    fit = fit_drafting_cost([group(0.26, [(1, 8, 0.42), (2, 16, 0.58)])])
    assert fit is not None and fit.per_step == 0.0  # steps and tokens: one reading
    assert fit.extra(1, 8) == pytest.approx(0.16) and fit.extra(2, 16) == pytest.approx(0.32)
    faster = fit_drafting_cost([group(0.3, [(1, 8, 0.2), (2, 16, 0.25)])])
    assert faster == DraftingCost()  # drafting measured cheaper than plain: adds nothing
