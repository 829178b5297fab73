"""A round's token budget from measured round times (pure: no clock, no grpc)."""

from __future__ import annotations

import pytest

from specserve.orchestrator.fleet.prefill_budget import PrefillBudget


def test_the_cap_until_a_usual_round_and_a_prefill_were_measured() -> None:
    b = PrefillBudget(cap=512)
    assert b.rows("t") == 512
    b.observe("t", 100, 1.0)  # a prefill round before any usual one tells nothing
    assert b.rows("t") == 512 and b.token_s("t") is None
    b.observe("t", 0, 0.050)
    assert b.rows("t") == 512  # no prefill measured yet


def test_a_prefill_token_is_charged_what_it_adds_to_a_usual_round() -> None:
    b = PrefillBudget(cap=10_000)
    b.observe("t", 0, 0.050)
    b.observe("t", 1000, 0.050 + 1000 * 0.0005)  # 0.5 ms a token
    assert b.rows("t") == 100  # 100 tokens add one usual round: about twice its length
    for _ in range(30):  # later chunks attend to more: dearer, and the budget follows
        b.observe("t", b.rows("t"), 0.050 + b.rows("t") * 0.001)
    assert b.rows("t") == pytest.approx(50, abs=1)
    assert b.rows("other") == 10_000  # per target


def test_a_small_chunk_lost_in_noise_moves_the_budget_little() -> None:
    b = PrefillBudget(cap=10_000)
    b.observe("t", 0, 0.050)
    b.observe("t", 500, 0.050 + 500 * 0.0005)
    b.observe("t", 2, 0.050 + 0.020)  # 2 tokens in a round 20 ms slow for other reasons
    assert 60 <= b.rows("t") <= 100


def test_the_budget_stays_within_one_token_and_the_cap() -> None:
    b = PrefillBudget(cap=256)
    b.observe("t", 0, 0.010)
    b.observe("t", 64, 0.005)  # no slower than a usual round: cheap, the cap
    assert b.rows("t") == 256
    b.forget("t")
    b.observe("t", 0, 0.010)
    b.observe("t", 10, 100.0)  # a token costs more than a round: still one a round
    assert b.rows("t") == 1
    b.forget("t")
    assert b.rows("t") == 256 and b.token_s("t") is None


def test_the_usual_round_is_a_running_average() -> None:
    b = PrefillBudget(cap=1_000_000)
    for _ in range(50):
        b.observe("t", 0, 0.1)
    b.observe("t", 0, 1.1)  # one slow round moves it by a fifth of the difference
    assert b.round_s["t"] == pytest.approx(0.3)


def test_the_cap_is_validated() -> None:
    with pytest.raises(ValueError, match="cap"):
        PrefillBudget(cap=0)
