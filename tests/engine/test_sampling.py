"""Sampling parameters, logits -> probabilities, inverse-CDF sampling, truncation, randomness."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from specserve.engine.errors import InvalidArgument
from specserve.engine.randomness import Stream, _mix, uniform, uniforms, uniforms_batch
from specserve.engine.sampling import (
    SamplingParams,
    batched_probabilities,
    probabilities,
    sample,
    truncate,
)

# ----------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
        ({"temperature": math.nan}, "temperature must be a finite number >= 0"),
        ({"temperature": math.inf}, "temperature must be a finite number >= 0"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_k": -1}, r"top_k must be >= 0 \(0 turns it off\), got -1"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_p": math.nan}, r"top_p must be in \(0, 1\]"),
        ({"seed": 1.5}, "seed must be an integer"),
    ],
)
def test_params_reject_bad_values_with_a_sentence(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        SamplingParams(**kwargs)


def test_params_defaults_are_greedy_and_valid() -> None:
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=-3).greedy
    assert SamplingParams(temperature=1).temperature == 1  # ints are numbers too


# ----------------------------------------------------------------------- probabilities


def test_temperature_scales_logits_before_softmax() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    got = probabilities(logits, SamplingParams(temperature=0.5))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.softmax(logits / 0.5, dim=-1))


def test_greedy_is_one_hot_at_first_max() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 5.0, 5.0]])
    got = probabilities(logits, SamplingParams(top_k=1, top_p=0.1))
    assert got.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_top_k_keeps_exactly_k_with_ties_to_the_lower_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, -1.0]])
    got = probabilities(logits, SamplingParams(temperature=1.0, top_k=3))
    kept = (got[0] > 0).nonzero().squeeze(1).tolist()
    assert kept == [1, 2, 3]  # 2.0, 2.0, then the first of the two 1.0s
    expected = torch.softmax(torch.tensor([2.0, 1.0, 2.0]), dim=0)
    torch.testing.assert_close(got[0, [1, 2, 3]], expected)


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    p = torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05])
    logits = p.log()[None]
    # 0.4 + 0.3 = 0.7 < 0.75, so 0.2 is needed as well; the 0.05s are not.
    got = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.75))[0]
    torch.testing.assert_close(got, torch.tensor([0, 0.4, 0.3, 0.2, 0]) / 0.9)
    # Exactly reaching p stops the nucleus there (the mass before 0.2 is 0.7 >= 0.7).
    got = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))[0]
    torch.testing.assert_close(got, torch.tensor([0, 0.4, 0.3, 0, 0]) / 0.7)
    # A tiny top_p still keeps the most likely token.
    got = probabilities(logits, SamplingParams(temperature=1.0, top_p=1e-9))[0]
    assert got.tolist() == [0, 1, 0, 0, 0]


def test_top_p_applies_to_the_top_k_renormalised_distribution() -> None:
    p = torch.tensor([0.5, 0.3, 0.2])
    # top-k 2 -> (0.625, 0.375); top-p 0.6 then keeps only the first.
    got = probabilities(p.log()[None], SamplingParams(temperature=1.0, top_k=2, top_p=0.6))
    assert got[0].tolist() == [1, 0, 0]


def reference_support(row: list[float], top_k: int, top_p: float) -> list[int]:
    """Kept ids: rank by (logit desc, id asc), cut to k, then the smallest prefix reaching p."""
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))
    if top_k:
        order = order[:top_k]
    weights = [math.exp(row[i] - row[order[0]]) for i in order]
    kept, mass = [], 0.0
    for i, w in zip(order, weights, strict=True):
        if kept and top_p < 1 and mass >= top_p:
            break
        kept.append(i)
        mass += w / sum(weights)
    return sorted(kept)


@pytest.mark.parametrize("top_k", [0, 1, 3, 7, 19])
@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.6, 0.3])
def test_filters_match_a_reference_on_tie_heavy_logits(top_k: int, top_p: float) -> None:
    gen = torch.Generator().manual_seed(top_k)
    logits = torch.randint(0, 4, (40, 24), generator=gen).float()  # many ties
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    got = probabilities(logits, params)
    for row, probs in zip(logits.tolist(), got, strict=True):
        kept = reference_support(row, top_k, top_p)
        assert (probs > 0).nonzero().squeeze(1).tolist() == kept
        torch.testing.assert_close(probs[kept], torch.softmax(torch.tensor(row)[kept], dim=0))


def test_a_batch_of_top_k_rows_with_and_without_ties_at_the_kth_value() -> None:
    """Rows whose k-th value is unique take the partial ranking alone; a row with a
    tie across it (planted: ids 3 and 17 share the 5th value, only id 3 fits) takes
    the whole-row pass; in one batch, each row keeps what the reference keeps."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen)
    order = logits[4].argsort(descending=True)
    logits[4, 3] = logits[4, 17] = logits[4, order[4]]
    params = [SamplingParams(1.0, top_k=k, top_p=p) for k, p in ((1, 1), (5, 1), (40, 0.9))]
    params += [SamplingParams(1.0, top_k=3, top_p=0.5), SamplingParams(1.0, top_k=5)]
    params += [SamplingParams(0.7, top_k=49)]
    got = batched_probabilities(logits, params, [1] * 6)
    for row, probs, p in zip(logits.tolist(), got, params, strict=True):
        tempered = [v / p.temperature for v in row]
        kept = reference_support(tempered, p.top_k, p.top_p)
        assert (probs > 0).nonzero().squeeze(1).tolist() == kept
        expected = torch.softmax(torch.tensor(tempered)[kept], dim=0)
        torch.testing.assert_close(probs[kept], expected)
    assert got[4, 3] > 0 and got[4, 17] == 0


def test_tiny_temperature_and_padding_stay_finite() -> None:
    logits = torch.tensor([[1.0, 1.0 + 1e-3, -math.inf, 0.5]])
    for temperature in (1e-12, 1e-300):
        got = probabilities(logits, SamplingParams(temperature=temperature))
        assert got.tolist() == [[0, 1, 0, 0]]
    tied = probabilities(torch.tensor([[2.0, 0.0, 2.0]]), SamplingParams(temperature=1e-300))
    assert tied.tolist() == [[0.5, 0, 0.5]]
    got = probabilities(logits, SamplingParams(temperature=1.0, top_k=3))
    assert torch.isfinite(got).all() and got[0, 2] == 0


def test_batched_probabilities_equals_per_session_calls() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 50, generator=gen) * 3
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0),
    ]
    rows = [2, 3, 1, 3]
    got = batched_probabilities(logits, params, rows)
    start = 0
    for p, n in zip(params, rows, strict=True):
        torch.testing.assert_close(
            got[start : start + n], probabilities(logits[start : start + n], p)
        )
        start += n


def test_batched_probabilities_rejects_mismatched_rows() -> None:
    with pytest.raises(InvalidArgument, match="2 sampling params but 1 row counts"):
        batched_probabilities(torch.zeros(2, 4), [SamplingParams()] * 2, [2])
    with pytest.raises(InvalidArgument, match=r"shape \(3, 4\) do not match the 2 rows"):
        batched_probabilities(torch.zeros(3, 4), [SamplingParams()], [2])


# ------------------------------------------------------------------------------ sample


def test_sample_is_the_inverse_cdf() -> None:
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25, 0.0])
    assert sample(probs, 0.0) == 1  # never the leading zero
    assert sample(probs, 0.2499) == 1
    assert sample(probs, 0.25) == 3  # first cdf strictly greater than u
    assert sample(probs, 0.7499) == 3
    assert sample(probs, 0.75) == 4
    assert sample(probs, 1.0 - 2**-53) == 4  # never the trailing zero


def test_sample_accepts_unnormalised_rows_and_clamps_rounding() -> None:
    probs = torch.tensor([0.0, 3.0, 1.0, 0.0])
    assert sample(probs, 0.74) == 1 and sample(probs, 0.76) == 2
    # u * total rounding up to total must not walk onto the zero tail.
    assert sample(torch.tensor([0.1, 0.2, 0.0]), 1.0) == 1


def test_sample_vectorised_matches_scalar() -> None:
    gen = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(64, 30, generator=gen), dim=-1)
    probs[probs < 0.02] = 0.0
    u = torch.rand(64, dtype=torch.float64, generator=gen)
    got = sample(probs, u)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int64
    assert got.tolist() == [sample(probs[i], float(u[i])) for i in range(64)]
    assert bool((probs[torch.arange(64), got] > 0).all())
    assert sample(probs, 0.0).tolist() == (probs > 0).int().argmax(dim=-1).tolist()


# ---------------------------------------------------------------------------- truncate


def test_truncate_keeps_the_whole_support_in_id_order() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3], [1.0, 0.0, 0.0, 0.0, 0.0]])
    ids, q = truncate(probs, 4)
    assert ids.dtype == torch.int64 and q.dtype == torch.float32
    assert ids.tolist() == [[1, 3, 4, -1], [0, -1, -1, -1]]
    torch.testing.assert_close(q, torch.tensor([[0.5, 0.2, 0.3, 0], [1, 0, 0, 0]]))
    dense = torch.zeros_like(probs).scatter_add_(1, ids.clamp(min=0), q)
    torch.testing.assert_close(dense, probs)


def test_truncate_pads_past_the_vocabulary() -> None:
    ids, q = truncate(torch.tensor([[0.6, 0.4]]), 4)
    assert ids.tolist() == [[0, 1, -1, -1]] and q.tolist()[0][2:] == [0, 0]


def test_truncate_refuses_to_drop_mass() -> None:
    probs = probabilities(torch.randn(2, 10), SamplingParams(temperature=1.0, top_k=5))
    assert truncate(probs, 5)[0].shape == (2, 5)
    with pytest.raises(InvalidArgument, match="5 tokens with nonzero probability but max_support"):
        truncate(probs, 4)
    with pytest.raises(InvalidArgument, match="max_support must be an integer >= 1"):
        truncate(probs, 0)


# -------------------------------------------------------------------------- randomness


def test_splitmix64_finaliser_matches_the_published_sequence() -> None:
    # SplitMix64 seeded with 0 yields 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, ...
    gamma = 0x9E3779B97F4A7C15
    assert _mix(gamma) == 0xE220A8397B1DCDAF
    assert _mix(2 * gamma % 2**64) == 0x6E789E6AA1B965F4


def test_uniform_values_are_pinned() -> None:
    # A change here breaks replay of seeded requests across versions: do it on purpose.
    assert uniform(0, 0, 0, Stream.ACCEPT) == 0.16526896395580137
    assert uniform(42, 7, 100, Stream.RESAMPLE) == 0.2542720724448869
    assert uniform(2**64 - 1, 1, 2, Stream.DRAFT) == 0.774595694338004
    assert uniform(-1, 1, 2, Stream.DRAFT) == uniform(2**64 - 1, 1, 2, Stream.DRAFT)


def test_vectorised_uniforms_match_the_reference() -> None:
    rng = random.Random(3)
    seeds = [rng.randrange(-(2**63), 2**64) for _ in range(200)]
    rounds = [rng.randrange(0, 2**32) for _ in range(200)]
    positions = [rng.randrange(0, 2**20) for _ in range(200)]
    got = uniforms_batch(seeds, np.asarray(rounds), positions, Stream.ACCEPT)
    assert got.dtype == torch.float64
    expected = [uniform(*c, Stream.ACCEPT) for c in zip(seeds, rounds, positions, strict=True)]
    assert got.tolist() == expected
    assert uniforms(5, 2, [0, 1, 9], Stream.RESAMPLE).tolist() == [
        uniform(5, 2, x, Stream.RESAMPLE) for x in (0, 1, 9)
    ]


def test_every_coordinate_changes_the_draw() -> None:
    base = (11, 3, 40, Stream.ACCEPT)
    draws = {
        uniform(*base),
        uniform(12, 3, 40, Stream.ACCEPT),
        uniform(11, 4, 40, Stream.ACCEPT),
        uniform(11, 3, 41, Stream.ACCEPT),
        uniform(11, 3, 40, Stream.RESAMPLE),
        uniform(11, 3, 40, Stream.DRAFT),
    }
    assert len(draws) == 6


def test_uniforms_look_uniform_and_independent_across_streams() -> None:
    n = 200_000
    positions = np.arange(n)
    a = uniforms_batch(np.arange(n), 0, positions, Stream.ACCEPT)
    b = uniforms_batch(np.arange(n), 0, positions, Stream.RESAMPLE)
    assert float(a.min()) >= 0 and float(a.max()) < 1
    # Kolmogorov-Smirnov: sup |F_n - F| <= sqrt(ln(2 / 1e-9) / (2n)) with prob 1 - 1e-9.
    sorted_a = a.sort().values
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = torch.maximum(grid - sorted_a, sorted_a - (grid - 1 / n)).max()
    assert float(ks) < math.sqrt(math.log(2 / 1e-9) / (2 * n))
    # Correlation of two streams: |r| <= 6 / sqrt(n) is a six-sigma bound.
    r = torch.corrcoef(torch.stack([a, b]))[0, 1]
    assert abs(float(r)) < 6 / math.sqrt(n)
