"""The warm-up payback rule: measured gain over the remaining tokens vs measured cost."""

from __future__ import annotations

import pytest

from specserve.orchestrator.warm_payback import WarmPayback

# Cap 0 at 2 tokens/s per session, the best cap at 2.5: 0.1 s saved per token.
RATES = {0: 2.0, 2: 2.2, 4: 2.5}


def measured(seconds_per_token: float) -> WarmPayback:
    p = WarmPayback()
    p.observe("d", 100, 100 * seconds_per_token)
    return p


def test_until_both_sides_are_measured_a_warm_up_goes_ahead() -> None:
    assert WarmPayback().repays("d", behind=10_000, remaining=1, rates=RATES)
    assert measured(1.0).repays("d", behind=10_000, remaining=1, rates={})
    assert measured(1.0).repays("d", behind=10_000, remaining=1, rates={0: 2.0})
    assert measured(1.0).repays("d", behind=10_000, remaining=1, rates={4: 2.5})


def test_the_remaining_tokens_must_save_more_than_the_warm_up_costs() -> None:
    p = measured(0.02)  # 200 history tokens: 4 s
    assert p.repays("d", behind=200, remaining=64, rates=RATES)  # 6.4 s saved
    assert not p.repays("d", behind=200, remaining=32, rates=RATES)  # 3.2 s saved
    assert not p.repays("d", behind=200, remaining=39, rates=RATES)  # 3.9 s saved
    assert p.repays("d", behind=100, remaining=32, rates=RATES)  # 2 s to warm


def test_no_warm_up_where_speculation_is_measured_not_to_pay() -> None:
    p = measured(1e-6)
    assert not p.repays("d", behind=1, remaining=10_000, rates={0: 3.0, 2: 2.9, 4: 2.0})
    assert not p.repays("d", behind=1, remaining=10_000, rates={0: 3.0, 4: 3.0})


def test_the_cost_is_per_replica_smoothed_and_forgotten_with_it() -> None:
    p = WarmPayback(smoothing=0.5)
    p.observe("d", 100, 1.0)
    p.observe("d", 100, 3.0)
    p.observe("d", 0, 5.0)  # nothing prefilled: says nothing
    p.observe("d", 10, 0.0)
    assert p.cost("d") == pytest.approx(0.02)
    assert p.cost("other") is None
    p.forget("d")
    assert p.cost("d") is None


def test_smoothing_is_validated() -> None:
    with pytest.raises(ValueError, match="smoothing"):
        WarmPayback(smoothing=0)
