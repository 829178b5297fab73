"""The k policy's plan and the tokens a session expects of a round under a cap (pure)."""

from __future__ import annotations

import pytest

from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.k_policy import KPolicy, expected_tokens
from specserve.engine.sampling import SamplingParams


def state(policy: KPolicy, *, max_new_tokens: int = 64, drafter: str = "model") -> DecodeState:
    return DecodeState(
        "s", [1, 2, 3], SamplingParams(), StopCriteria(max_new_tokens), policy, drafter=drafter
    )


def test_expected_tokens_is_leviathans_eq_1() -> None:
    assert expected_tokens(0.8, 0) == 1.0
    assert expected_tokens(0.8, 3) == pytest.approx(1 + 0.8 + 0.8**2 + 0.8**3)
    assert expected_tokens(1.0, 4) == 5.0


def test_a_plan_follows_acceptance_and_the_cap_and_changes_nothing() -> None:
    policy = KPolicy(None, alpha0=0.95)
    assert policy.plan() > 2
    assert policy.plan(2) == 2
    assert policy.plan(0) == 0
    policy.alpha = 0.05  # drafts nearly always rejected: plain decoding
    assert [policy.plan(8) for _ in range(16)] == [0] * 16  # no probe, no state
    assert [policy.next_k(8) for _ in range(8)] == [0] * 7 + [1]  # next_k probes
    assert [policy.next_k(0) for _ in range(8)] == [0] * 8  # never above the cap


def test_a_requested_k_is_drafted_under_any_cap() -> None:
    """A fixed k is what the request named: the load cap and k_max bound only adaptive k."""
    assert [KPolicy(3).next_k(cap) for cap in (8, 2, 0, None)] == [3, 3, 3, 3]
    assert KPolicy(12, k_max=8).next_k(4) == 12
    assert KPolicy(0).next_k(8) == 0


def test_a_plan_for_every_cap_is_the_plan_under_each() -> None:
    for alpha in (0.05, 0.5, 0.7, 0.9, 0.99, 1.0):
        policy = KPolicy(None, alpha0=alpha, k_max=6)
        assert policy.plans(9) == [policy.plan(cap) for cap in range(10)]
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
