"""Coupled sampling: the noise is the defined function of (seed, position, id), and the
tokens it draws follow p — at one position and jointly at two.

The statistical checks are Pearson chi-square tests against p (after temperature,
top-k and top-p) with N sessions, one seed each, drawn in one vectorised call. A
correct sampler fails a check with probability ALPHA; the seeds are fixed, so every
run draws the same tokens. The broken twins at the end put the noise before the
temperature, or reuse one position's noise at every position (which the single-position
check cannot see and the pair check must), and must fail the same checks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.engine import coupling, cpu_kernels, ops
from specserve.engine.rejection import Proposal, verify
from specserve.engine.sampling import SamplingParams, batched_probabilities, probabilities

ALPHA = 1e-6
N = 40_000
VOCAB = 8
LOGITS = torch.tensor(
    [
        [2.0, 1.5, 1.0, 0.7, 0.2, -0.3, -1.0, -2.0],  # position 0
        [0.1, 1.8, -0.5, 1.1, 0.6, -1.5, 0.9, 0.0],  # position 1
    ]
)
CPU = torch.device("cpu")


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    """P(X >= the Pearson statistic) for X ~ chi-square, df = the cells with mass - 1.

    Cells of zero probability must have zero counts (a count there is a certain failure).
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    live = probs > 0
    expected = n * probs[live]
    stat = ((counts[live] - expected) ** 2 / expected).sum()
    df = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


def draws(params: SamplingParams, n: int, positions: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """The coupled tokens int64 [n, 2] of n sessions (seed = index) at two positions,
    as target-only decoding draws them: one verify with no drafts per position."""
    out = []
    for row, position in zip(LOGITS, positions, strict=True):
        seeds = [params.seed + s for s in range(n)]
        verdicts = verify(
            row.expand(n, VOCAB),
            [Proposal(tokens=[])] * n,
            [SamplingParams(params.temperature, params.top_k, params.top_p, s) for s in seeds],
            [0] * n,
            [position] * n,
        )
        out.append(torch.tensor([v.next_token for v in verdicts]))
    return torch.stack(out, dim=1)


def marginal_p_values(tokens: torch.Tensor, params: SamplingParams) -> list[float]:
    p = probabilities(LOGITS, params)  # [2, vocab]
    return [
        chi_square_p_value(torch.bincount(tokens[:, j], minlength=VOCAB), p[j], len(tokens))
        for j in range(2)
    ]


def pair_p_value(tokens: torch.Tensor, params: SamplingParams) -> float:
    p = probabilities(LOGITS, params)
    joint = p[0][:, None] * p[1][None, :]  # independent positions: the product
    cells = torch.bincount(tokens[:, 0] * VOCAB + tokens[:, 1], minlength=VOCAB * VOCAB)
    return chi_square_p_value(cells, joint, len(tokens))


# ------------------------------------------------------------------------ the noise


def test_noise_is_the_defined_function_of_seed_position_and_id() -> None:
    coords = [(5, 0), (2**64 - 1, 17), (0, 123_456), (-3, 9)]
    keys = coupling.keys([s for s, _ in coords], [p for _, p in coords])
    rows = coupling.noise(keys, 1001, CPU)  # [4, 1001]
    for r, (seed, position) in enumerate(coords):
        for token in (0, 1, 2, 511, 999, 1000):
            want = coupling.reference_noise(seed, position, token)
            assert rows[r, token].item() == pytest.approx(want, abs=2e-6)
    ids = torch.tensor([[0, 5, 1000], [3, 4, 7], [999, 2, 1], [1, 0, 640]])
    assert torch.equal(coupling.noise_at(keys, ids), rows.gather(1, ids))
    # A row does not depend on the rows beside it, nor on the vocabulary width.
    assert torch.equal(coupling.noise(keys[1:2], 1001, CPU)[0], rows[1])
    assert torch.equal(coupling.noise(keys, 300, CPU), rows[:, :300])


def test_noise_is_standard_gumbel_and_bounded() -> None:
    g = coupling.noise(coupling.keys(list(range(64)), [7] * 64), 4096, CPU).double()
    assert bool(torch.isfinite(g).all())
    assert float(g.mean()) == pytest.approx(0.5772, abs=0.01)  # Euler-Mascheroni
    assert float(g.std()) == pytest.approx(torch.pi / 6**0.5, abs=0.01)
    assert float(g.min()) > -2.8 and float(g.max()) < 16.7


def test_a_token_depends_only_on_seed_and_position() -> None:
    """The round index and the batch make no difference (unlike the rejection rule)."""
    params = [SamplingParams(1.0, seed=s) for s in (3, 4, 3)]
    rows = LOGITS[0].expand(3, VOCAB)
    a = verify(rows, [Proposal(tokens=[])] * 3, params, [0, 5, 9], [40, 40, 40])
    b = verify(rows[:1], [Proposal(tokens=[])], params[:1], [123], [40])
    assert a[0].next_token == a[2].next_token == b[0].next_token


# ------------------------------------------------------------------- the statistics


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.8, top_p=0.85),
        SamplingParams(temperature=1.3, top_k=6, top_p=0.9),
    ],
    ids=["t0.7", "t1.0", "top-k", "top-p", "top-k+top-p"],
)
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu kernel", "torch ops"])
def test_coupled_tokens_follow_p_at_each_position_and_in_pairs(
    params: SamplingParams, kernels: bool
) -> None:
    with ops.kernels_enabled(kernels):
        tokens = draws(params, N)
    assert min(marginal_p_values(tokens, params)) > ALPHA
    assert pair_p_value(tokens, params) > ALPHA


def test_drafts_change_no_token() -> None:
    """Whatever the draft proposes, the verdict emits the target-only token of each position."""
    n, params = 2000, SamplingParams(temperature=1.0)
    alone = draws(params, n)  # [n, 2]
    rows = LOGITS.repeat(n, 1)  # session i: rows 2i (position 0), 2i + 1 (bonus, position 1)
    for guess in (alone[:, 0], (alone[:, 0] + 1) % VOCAB):  # right, then wrong, drafts
        verdicts = verify(
            rows,
            [Proposal(tokens=[int(t)]) for t in guess],
            [SamplingParams(1.0, seed=s) for s in range(n)],
            [7] * n,
            [0] * n,
        )
        emitted = [alone[i, 1] if v.accepted else alone[i, 0] for i, v in enumerate(verdicts)]
        assert [v.next_token for v in verdicts] == [int(t) for t in emitted]
        right = (guess == alone[:, 0]).long().tolist()
        assert [v.accepted for v in verdicts] == right


# ------------------------------------------------------------------ the broken twins


def test_noise_added_before_the_temperature_fails_the_check() -> None:
    params = SamplingParams(temperature=0.7)
    keys = coupling.keys(list(range(N)), [0] * N)
    g = coupling.noise(keys, VOCAB, CPU)  # [N, vocab]
    wrong = (LOGITS[0] + g).argmax(dim=-1)  # argmax((l + g) / T): samples softmax(l), not l / T
    right = (probabilities(LOGITS[:1], params).log() + g).argmax(dim=-1)
    p0 = probabilities(LOGITS[:1], params)[0]
    assert chi_square_p_value(torch.bincount(right, minlength=VOCAB), p0, N) > ALPHA
    assert chi_square_p_value(torch.bincount(wrong, minlength=VOCAB), p0, N) < ALPHA


def test_one_noise_for_every_position_passes_the_marginals_but_fails_the_pairs() -> None:
    params = SamplingParams(temperature=1.0)
    reused = draws(params, N, positions=(3, 3))  # position 1 drawn with position 0's noise
    assert min(marginal_p_values(reused, params)) > ALPHA
    assert pair_p_value(reused, params) < ALPHA


def test_choose_among_candidates_is_choose_over_the_truncated_distribution() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 300, generator=gen) * 3
    p = batched_probabilities(logits, [SamplingParams(1.0, top_k=20)], [64])
    values, ids = p.topk(32, dim=-1)  # 20 candidates with mass, 12 padding of mass 0
    seeds, positions = np.arange(64), np.full(64, 11)
    dense = coupling.choose(p, seeds, positions)
    assert torch.equal(coupling.choose_among(values, ids, seeds, positions), dense)


def test_the_cpu_kernel_chooses_what_the_torch_ops_choose() -> None:
    """The fused kernel (a logarithm only where an id may win) and the torch ops (noise
    for every id) give the same tokens; rows with and without top-k / top-p filtering."""
    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(96, 5003, generator=gen) * 4
    params = [SamplingParams(1.0), SamplingParams(0.7, top_k=50), SamplingParams(1.3, top_p=0.9)]
    p = batched_probabilities(logits, params, [32, 32, 32])
    seeds, positions = np.arange(96) * 7, np.arange(96) + 1000
    fused = coupling.choose(p, seeds, positions)
    with ops.kernels_enabled(False):
        plain = coupling.choose(p, seeds, positions)
    assert torch.equal(fused, plain)
    assert bool((p.gather(1, fused[:, None]) > 0).all())
