"""The warm-up payback rule: measured gain over the remaining tokens vs measured cost."""

from __future__ import annotations

import logging

import pytest

from specserve.orchestrator.warm_payback import WarmPayback

# Cap 0 at 2 tokens/s per session, the best cap at 2.5: 0.1 s saved per token.
RATES = {0: 2.0, 2: 2.2, 4: 2.5}


def finish(remaining: int, rates: dict[int, float] = RATES) -> dict[int, float]:
    """Seconds to finish ``remaining`` tokens by cap at those tokens/s."""
    return {cap: remaining / r for cap, r in rates.items()}


def measured(seconds_per_token: float) -> WarmPayback:
    p = WarmPayback()
    p.observe("d", 100, 100 * seconds_per_token, inside=False)
    return p


def test_until_both_sides_are_measured_a_warm_up_goes_ahead() -> None:
    assert WarmPayback().repays("d", behind=10_000, finish=finish(1), inside=False)
    assert measured(1.0).repays("d", behind=10_000, finish=finish(1, {}), inside=False)
    assert measured(1.0).repays("d", behind=10_000, finish=finish(1, {0: 2.0}), inside=False)
    assert measured(1.0).repays("d", behind=10_000, finish=finish(1, {4: 2.5}), inside=False)


def test_the_remaining_tokens_must_save_more_than_the_warm_up_costs() -> None:
    p = measured(0.02)  # 200 history tokens: 4 s
    assert p.repays("d", behind=200, finish=finish(64), inside=False)  # 6.4 s saved
    assert not p.repays("d", behind=200, finish=finish(32), inside=False)  # 3.2 s saved
    assert not p.repays("d", behind=200, finish=finish(39), inside=False)  # 3.9 s saved
    assert p.repays("d", behind=100, finish=finish(32), inside=False)  # 2 s to warm


def test_each_decision_is_logged_with_its_figures(caplog: pytest.LogCaptureFixture) -> None:
    p = measured(0.02)
    with caplog.at_level(logging.DEBUG, logger="specserve.orchestrator.warm_payback"):
        assert not p.repays("d", behind=200, finish=finish(32), inside=True)
    assert "warm-up of 200 tokens on d (inside a round): saves 3.20 s" in caplog.text
    assert (
        "(the batch finishes in 12.80 s instead of 16.00 s), costs 4.00 s: declined" in caplog.text
    )


def test_no_warm_up_where_speculation_is_measured_not_to_pay() -> None:
    p = measured(1e-6)
    assert not p.repays(
        "d", behind=1, finish=finish(10_000, {0: 3.0, 2: 2.9, 4: 2.0}), inside=False
    )
    assert not p.repays("d", behind=1, finish=finish(10_000, {0: 3.0, 4: 3.0}), inside=False)


def test_the_cost_is_per_replica_smoothed_and_forgotten_with_it() -> None:
    p = WarmPayback(smoothing=0.5)
    p.observe("d", 100, 1.0, inside=False)
    p.observe("d", 100, 3.0, inside=False)
    p.observe("d", 0, 5.0, inside=False)  # nothing prefilled: says nothing
    p.observe("d", 10, -1.0, inside=False)
    assert p.cost("d", inside=False) == pytest.approx(0.02)
    assert p.cost("other", inside=False) is None
    p.forget("d")
    assert p.cost("d", inside=False) is None


def test_inside_and_beside_the_rounds_are_two_costs_each_standing_in_for_the_other() -> None:
    """A lone session's warm-up inside its round costs its wall time; one beside the
    rounds costs what they lost meanwhile: nothing where draft and target have their own
    devices, so there the warm-ups of a batch go ahead whatever an inside one took."""
    p = WarmPayback()
    p.observe("d", 100, 2.0, inside=True)  # 0.02 s a token, the round waiting
    assert p.cost("d", inside=False) == pytest.approx(0.02)  # borrowed until measured
    assert not p.repays("d", behind=200, finish=finish(32), inside=False)  # 4 > 3.2 s
    p.observe("d", 100, 0.0, inside=False)  # the rounds beside it lost nothing
    assert p.cost("d", inside=False) == 0.0
    assert p.cost("d", inside=True) == pytest.approx(0.02)
    assert p.repays("d", behind=200, finish=finish(32), inside=False)
    assert not p.repays("d", behind=200, finish=finish(32), inside=True)
    p.forget("d")
    assert p.cost("d", inside=True) is None and p.cost("d", inside=False) is None


def test_a_batch_warms_inside_a_round_only_where_that_was_measured_cheaper() -> None:
    p = WarmPayback()
    assert not p.cheaper_inside("d")  # nothing measured: beside the rounds
    p.observe("d", 100, 0.5, inside=True)
    assert not p.cheaper_inside("d")  # beside not measured: free on separate devices
    p.observe("d", 100, 5.0, inside=False)  # shared cores: the rounds lost 5 s
    assert p.cheaper_inside("d") and not p.cheaper_inside("other")
    p.forget("d")
    p.observe("d", 100, 0.5, inside=True)
    p.observe("d", 100, 0.1, inside=False)  # separate devices: beside costs little
    assert not p.cheaper_inside("d")


def test_smoothing_is_validated() -> None:
    with pytest.raises(ValueError, match="smoothing"):
        WarmPayback(smoothing=0)
