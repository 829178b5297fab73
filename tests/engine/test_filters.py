"""Top-p over a partial ranking keeps exactly what sorting the whole row keeps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.engine import filters
from specserve.engine.sampling import SamplingParams, batched_probabilities
from tests.engine.test_sampling import reference_support

VOCAB = 5000


def rows() -> torch.Tensor:
    """Peaked rows (the nucleus fits the ranked prefix), flat rows (it does not), a row
    whose likeliest ids tie across the ranked prefix's end, and a row of one id."""
    gen = torch.Generator().manual_seed(4)
    peaked = torch.randn(4, VOCAB, generator=gen) * 6
    flat = torch.randn(2, VOCAB, generator=gen) * 0.1
    tie_at_the_end = torch.full((1, VOCAB), -20.0)
    tie_at_the_end[0, :900] = torch.linspace(5, 4, 900)
    tie_at_the_end[0, 1000:1400] = 4.0  # 400 ids tied with id 899, across rank 1025
    one = torch.full((1, VOCAB), -30.0)
    one[0, 77] = 10.0
    return torch.cat([peaked, flat, tie_at_the_end, one])


def whole_sort(
    x: torch.Tensor, top_p: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(filters, "NUCLEUS_WIDTH", VOCAB)  # no partial ranking
        return filters._keep_nucleus(x, top_p)


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99, 0.999999])
def test_the_partial_ranking_keeps_what_a_whole_sort_keeps(
    top_p: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = rows()
    p = torch.full((x.shape[0],), top_p, dtype=torch.float64)
    got = filters._keep_nucleus(x, p)
    assert torch.equal(got, whole_sort(x, p, monkeypatch))
    assert got.sum(dim=-1).min() >= 1


def test_both_ways_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peaked rows are decided by the ranked prefix; flat rows and the tied row sort
    (the partial answer alone would be wrong for them)."""
    x = rows()
    p = torch.full((x.shape[0],), 0.9, dtype=torch.float64)
    sorted_rows: list[int] = []
    real_sort = torch.Tensor.sort

    def spy(self: torch.Tensor, *args: object, **kwargs: object) -> object:
        if self.shape[-1] == VOCAB:
            sorted_rows.append(self.shape[0])
        return real_sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", spy)
    filters._keep_nucleus(x, p)
    assert sorted_rows == [3]  # two flat rows and the tied one


def test_top_p_rows_through_batched_probabilities_match_a_softmax() -> None:
    x = rows()
    params = [SamplingParams(1.0, top_p=0.9, seed=i) for i in range(x.shape[0])]
    probs = batched_probabilities(x, params, [1] * x.shape[0])
    for row, got in zip(x, probs, strict=True):
        kept = got > 0
        torch.testing.assert_close(got[kept], torch.softmax(row[kept], dim=0))
        assert row[kept].min() >= row[~kept].max()  # a prefix of the ranking


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.sampled_from([3, 40, 1025, 1026, 3000]),
    levels=st.sampled_from([0, 3, 50]),  # 0: continuous logits; else that many distinct values
    top_k=st.sampled_from([0, 1, 2, 17, 1024, 1025, 2999]),
    # No value a sum of equal masses can hit exactly: there the float sums decide.
    top_p=st.sampled_from([1.0, 0.9990001, 0.9000001, 0.6180339, 1e-6]),
    scale=st.sampled_from([0.05, 1.0, 8.0]),
)
def test_any_row_keeps_what_the_reference_keeps(
    seed: int, vocab: int, levels: int, top_k: int, top_p: float, scale: float
) -> None:
    """Random rows (ties or not, flat or peaked, vocabularies on both sides of the
    partial ranking's width) against the rule written out in plain Python."""
    gen = torch.Generator().manual_seed(seed)
    if levels:
        x = torch.randint(0, levels, (2, vocab), generator=gen).float() * scale
    else:
        x = torch.randn(2, vocab, generator=gen) * scale
    params = SamplingParams(1.0, top_k=top_k, top_p=top_p)
    got = batched_probabilities(x, [params], [2])
    for row, probs in zip(x.tolist(), got, strict=True):
        kept = reference_support(row, top_k if top_k < vocab else 0, top_p)
        assert (probs > 0).nonzero().squeeze(1).tolist() == kept
