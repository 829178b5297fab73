"""A round's prefill allowance from measured round times (pure: no clock, no grpc)."""

from __future__ import annotations

import itertools

import pytest

from specserve.orchestrator.fleet.prefill_budget import (
    GROWTH,
    RATIO,
    USUAL_EVERY,
    PrefillBudget,
    terms,
)

USUAL = 0.010  # a usual round's seconds in these tests


def cost(
    held: int, sent: int, fixed: float, per_token: float, per_pair: float, per_held: float = 0
) -> float:
    """What a chunk adds to a round under the model the budget fits."""
    return fixed + per_token * sent + per_pair * sent * (held + sent / 2) + per_held * held


def prefill(b: PrefillBudget, length: int, coefficients: tuple[float, ...]) -> list[int]:
    """Prefill a prompt of ``length`` tokens as the budget sizes it (a round it keeps
    usual takes the usual time); the chunks sent."""
    held, chunks = 0, []
    while held < length:
        if b.rows("t", held) == 0:
            b.observe("t", [], USUAL)
            continue
        sent = min(b.rows("t", held), length - held)
        b.observe("t", [(held, sent)], USUAL + cost(held, sent, *coefficients))
        chunks.append(sent)
        held += sent
    return chunks


def test_nothing_measured_the_cap_and_a_first_chunk_from_a_verify_row() -> None:
    assert PrefillBudget(cap=512).rows("t") == 512  # no usual round yet
    b = PrefillBudget(cap=512, row_s={"t": 0.001}.get)
    b.observe("t", [(0, 100)], 1.0)  # a prefill round before any usual one tells nothing
    assert b.coefficients("t") is None
    b.observe("t", [], USUAL)
    # (RATIO - 1) usual rounds of verify rows: a row's cost overstates a prompt token's
    assert b.rows("t") == int((RATIO - 1) * USUAL / 0.001)
    assert PrefillBudget(cap=512, round_s={"t": USUAL}).rows("t") == 512  # no row measured


def test_the_fit_finds_a_fixed_a_per_token_and_two_context_parts() -> None:
    truth = (0.002, 2e-5, 1e-8, 5e-8)
    b = PrefillBudget(cap=4096, row_s=lambda t: 1e-4)
    b.observe("t", [], USUAL)
    chunks = prefill(b, 32_000, truth)
    assert b.coefficients("t") == pytest.approx(truth, rel=0.01)
    # every chunk after the first few keeps its round within RATIO usual rounds, and
    # no chunk is more than GROWTH times the one before
    late = [(h, c) for h, c in zip(_helds(chunks), chunks, strict=True)][6:-1]
    assert all(USUAL + cost(h, c, *truth) <= RATIO * USUAL * 1.01 for h, c in late)
    assert all(b2 <= GROWTH * a for a, b2 in itertools.pairwise(chunks))
    # the context part shrinks the chunks as the prompt grows, but not to nothing
    assert chunks[5] > chunks[-2] > 10


def test_one_round_in_a_few_carries_no_prefill_and_re_measures_the_usual_round() -> None:
    b = PrefillBudget(cap=512, row_s=lambda t: 1e-4)
    b.observe("t", [], USUAL)
    for i in range(USUAL_EVERY - 1):
        assert b.rows("t", 100 * i) > 0
        b.observe("t", [(100 * i, 100)], 2 * USUAL)
    assert b.rows("t", 700) == 0  # the next round decodes only
    b.observe("t", [], 3 * USUAL)  # the host got busier: the usual round follows
    assert b.round_s["t"] > USUAL and b.rows("t", 700) > 0


def test_a_per_token_model_would_spend_the_allowance_on_the_fixed_part() -> None:
    """The earlier budget charged a round's whole extra to its tokens: with a fixed part
    of 40 % of the allowance, its chunks came out about half as large as they may be."""
    truth = (0.004, 1e-5, 0.0)
    b = PrefillBudget(cap=100_000, row_s=lambda t: 1e-4)
    b.observe("t", [], USUAL)
    prefill(b, 20_000, truth)
    room = (RATIO - 1) * USUAL - truth[0]
    assert b.rows("t", 20_000) == pytest.approx(room / truth[1], rel=0.02)  # 600 tokens


def test_a_fixed_part_past_the_allowance_leaves_the_tokens_half_of_it() -> None:
    b = PrefillBudget(cap=100_000, row_s=lambda t: 1e-4)
    b.observe("t", [], USUAL)
    prefill(b, 10_000, (0.02, 1e-5, 0.0))  # a prefill round costs 2 usual rounds at once
    assert b.rows("t", 10_000) == pytest.approx((RATIO - 1) * USUAL / 2 / 1e-5, rel=0.02)


def test_the_budget_stays_within_one_token_the_cap_and_its_growth() -> None:
    b = PrefillBudget(cap=256, row_s=lambda t: 1e-6)
    b.observe("t", [], USUAL)
    assert b.rows("t") == 256  # a cheap row: the cap
    b.observe("t", [(0, 10)], USUAL)  # no slower than a usual round: as cheap as can be
    assert b.rows("t") == int(GROWTH * 10)  # but no more than twice the last chunk
    b.forget("t")
    b.observe("t", [], USUAL)
    b.observe("t", [(0, 40)], 100.0)  # a token costs more than a round: still one a round
    assert b.rows("t") == 1
    b.forget("t")
    assert b.rows("t") == 256 and b.coefficients("t") is None
    assert b.rows("other") == 256  # per target


def test_the_terms_of_a_round_add_its_prompts() -> None:
    assert terms([]) == [0.0, 0.0, 0.0, 0.0]
    assert terms([(0, 10), (100, 4)]) == [1.0, 14.0, 10 * 5 + 4 * 102, 100.0]


def test_the_usual_round_is_a_running_average() -> None:
    b = PrefillBudget(cap=1_000_000)
    for _ in range(50):
        b.observe("t", [], 0.1)
    b.observe("t", [], 1.1)  # one slow round moves it by a fifth of the difference
    assert b.round_s["t"] == pytest.approx(0.3)


def test_the_cap_is_validated() -> None:
    with pytest.raises(ValueError, match="cap"):
        PrefillBudget(cap=0)


def _helds(chunks: list[int]) -> list[int]:
    held, out = 0, []
    for c in chunks:
        out.append(held)
        held += c
    return out
