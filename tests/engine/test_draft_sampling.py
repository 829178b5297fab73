"""A draft step's sampled rows drawn together equal the rows drawn one at a time."""

from __future__ import annotations

import torch

from specserve.engine import coupling
from specserve.engine.draft_sampling import DrawRow, draw_rows
from specserve.engine.randomness import Stream, uniform
from specserve.engine.sampling import SamplingParams, SamplingRule, probabilities

VOCAB = 300
SUPPORT = 16


def mixed_rows() -> list[DrawRow]:
    rule = SamplingRule.REJECTION
    return [
        DrawRow(SamplingParams(0.8, top_k=40, top_p=0.95, seed=1), 0, 17),
        DrawRow(SamplingParams(1.0, seed=2, rule=rule), 3, 40),
        DrawRow(SamplingParams(0.7, top_p=0.9, seed=3, rule=rule), 1, 9),
        DrawRow(SamplingParams(1.3, top_k=5, seed=4), 2, 120),
        DrawRow(SamplingParams(0.5, top_k=3, seed=5, rule=rule), 7, 33),
    ]


def one_at_a_time(row: DrawRow, logits: torch.Tensor) -> tuple[int, tuple | None]:
    """The per-row rule, written out: top-m of the row's distribution, renormalised;
    the coupled choice, or the first id whose cumulative mass passes u."""
    probs = probabilities(logits[None], row.params)[0]
    vals, ids = torch.topk(probs, SUPPORT)
    vals = vals / vals.sum()
    if row.params.coupled:
        seeds, positions = [row.params.seed], [row.position]
        return int(coupling.choose_among(vals[None], ids[None], seeds, positions)[0]), None
    u = uniform(row.params.seed, row.round_index, row.position, Stream.DRAFT)
    cdf = torch.cumsum(vals.double(), 0)
    pick = min(int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True)), SUPPORT - 1)
    while vals[pick] == 0:
        pick -= 1
    return int(ids[pick]), (ids, vals.float())


def test_a_batch_draws_what_each_row_draws_alone() -> None:
    rows = mixed_rows()
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    tokens, qs = draw_rows(rows, logits, SUPPORT)
    for i, row in enumerate(rows):
        token, q = one_at_a_time(row, logits[i])
        assert tokens[i] == token, i
        if q is None:
            assert qs[i] is None and row.params.coupled
        else:
            got = qs[i]
            assert got is not None
            torch.testing.assert_close(got[0], q[0], rtol=0, atol=0)
            torch.testing.assert_close(got[1], q[1], rtol=1e-6, atol=1e-7)
            assert q[1][q[0] == token].item() > 0


def test_a_rows_token_does_not_depend_on_its_neighbours() -> None:
    rows = mixed_rows()
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(1))
    together, _ = draw_rows(rows, logits, SUPPORT)
    reversed_tokens, _ = draw_rows(rows[::-1], logits.flip(0), SUPPORT)
    assert together == reversed_tokens[::-1]
    assert together[1:] == draw_rows(rows[1:], logits[1:], SUPPORT)[0]


def test_ids_outside_the_support_are_never_drawn() -> None:
    """top-k 2 under a support of 16: 14 of the q's ids have no mass, whatever u is."""
    params = SamplingParams(1.0, top_k=2, seed=9, rule=SamplingRule.REJECTION)
    rows = [DrawRow(params, r, p) for r in range(8) for p in range(8)]
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2)).expand(64, -1)
    tokens, qs = draw_rows(rows, logits, SUPPORT)
    allowed = set(logits[0].topk(2).indices.tolist())
    assert set(tokens) <= allowed and len(set(tokens)) == 2  # both drawn, nothing else
    for q in qs:
        assert q is not None and int((q[1] > 0).sum()) == 2


def test_no_rows_draw_nothing() -> None:
    assert draw_rows([], torch.zeros(0, VOCAB), SUPPORT) == ([], [])
