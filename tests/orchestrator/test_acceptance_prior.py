"""Where a new session's acceptance estimate starts (pure)."""

from __future__ import annotations

import statistics

import pytest

from specserve.engine.k_policy import KPolicy, updated_alpha
from specserve.orchestrator.acceptance_prior import DEFAULT_ALPHA, AcceptancePrior


def test_a_new_pool_starts_at_the_fixed_prior() -> None:
    prior = AcceptancePrior()
    assert prior.alpha("model", True) == DEFAULT_ALPHA == KPolicy(None).alpha
    assert prior.seen() == []
    prior.observe("model", True, 0, 0)  # k = 0 rounds judge no draft
    assert prior.seen() == []


def test_the_prior_follows_the_pools_trials_per_drafter_and_mode() -> None:
    prior = AcceptancePrior()
    for _ in range(200):  # code: 5 of 5 drafts kept, then 3 of 5 (4 trials, one failure)
        prior.observe("model", True, 5, 5)
        prior.observe("model", True, 5, 3)
    assert prior.alpha("model", True) == pytest.approx(8 / 9, abs=0.01)
    for _ in range(200):  # prose on the n-gram drafter: every draft rejected
        prior.observe("ngram", True, 2, 0)
    assert prior.alpha("ngram", True) < 0.05
    assert prior.alpha("model", False) == DEFAULT_ALPHA  # sampled sessions: not seen yet
    assert prior.seen() == [("model", True), ("ngram", True)]


def test_a_few_rounds_do_not_swing_a_new_pools_prior() -> None:
    prior = AcceptancePrior()
    prior.observe("model", True, 1, 0)  # one rejected trial
    assert prior.alpha("model", True) == pytest.approx(8 * DEFAULT_ALPHA / 9)


def test_the_prior_forgets_old_traffic() -> None:
    prior = AcceptancePrior(decay=0.99)
    for _ in range(300):
        prior.observe("model", True, 1, 1)
    for _ in range(300):
        prior.observe("model", True, 1, 0)
    assert prior.alpha("model", True) < 0.1


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="decay"):
        AcceptancePrior(decay=1.0)
    with pytest.raises(ValueError, match="turn_decay"):
        AcceptancePrior(turn_decay=0.0)


def test_each_judged_draft_is_one_trial_in_order() -> None:
    # 3 accepted then a rejection: three steps toward 1, one toward 0.
    a = 0.5
    for x in (1, 1, 1, 0):
        a = 0.8 * a + 0.2 * x
    assert updated_alpha(0.5, 5, 3, 0.2) == pytest.approx(a)
    assert updated_alpha(0.5, 3, 3, 0.2) == pytest.approx(1 - 0.5 * 0.8**3)  # no failure
    assert updated_alpha(0.5, 0, 0, 0.2) == 0.5


def test_one_rejection_after_a_run_of_acceptances_does_not_reset_k() -> None:
    # The replaced rule set alpha to 1.0 after 4 accepted drafts and to 0.7 at the next
    # rejection (k 8 -> 1); per-trial steps keep the estimate, and k, steady.
    policy = KPolicy(None, alpha0=0.9)
    for _ in range(10):
        policy.observe(4, 4)
    high = policy.alpha
    assert high < 1.0
    policy.observe(4, 0)
    assert policy.alpha > 0.6
    assert policy.plan() >= 2


def test_the_lowest_of_n_new_turns_is_expected_below_the_pool() -> None:
    """Turns of 0.62-1.0 around 0.85 (the Qwen pair's HumanEval turns): of 8 new turns
    the lowest is expected 1.43 standard deviations down, of 2 turns 0.59."""
    prior = AcceptancePrior(turn_decay=0.999)
    assert prior.shortfall("model", True, 8) == 0.0  # no turns seen: no spread known
    prior.observe_turn("model", True, 3, 5)  # too few trials to say anything
    turns = (0.62, 0.78, 0.82, 0.85, 0.87, 0.9, 0.92, 1.0)
    for a in turns[:2]:
        prior.observe_turn("model", True, round(a * 100), 100)
    assert prior.shortfall("model", True, 8) == 0.0  # 2 turns: not yet
    for a in turns[2:]:
        prior.observe_turn("model", True, round(a * 100), 100)
    sd = statistics.pstdev(turns)
    assert prior.shortfall("model", True, 8) == pytest.approx(1.43 * sd, rel=0.01)
    assert prior.shortfall("model", True, 2) == pytest.approx(0.59 * sd, rel=0.01)
    assert prior.shortfall("model", True, 1) == 0.0  # one turn is the mean's
    assert prior.shortfall("ngram", True, 8) == 0.0  # per drafter
