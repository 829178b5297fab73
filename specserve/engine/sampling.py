"""Sampling parameters and the map from logits to the distribution tokens are drawn from.

The pipeline for one row of logits is temperature -> top-k -> top-p -> softmax:

* **temperature** divides the logits (after subtracting the row maximum, so a tiny
  temperature saturates to a point mass instead of overflowing to NaN);
* **top-k** keeps the k largest logits; ties are broken by the lower token id
  (a stable descending sort), so exactly k tokens survive;
* **top-p** keeps the smallest prefix of the top-k tokens, ranked as above, whose
  renormalised probability reaches ``top_p`` (a token is kept iff the mass ranked
  before it is still below ``top_p``; the most likely token is always kept);
* **greedy** (temperature 0) is a one-hot at ``torch.argmax`` of the raw logits
  (the first maximum wins); top-k and top-p cannot change it.

The same function computes the target's p and the draft's q, so both sides agree
on what a parameter means. Randomness is not drawn here: :func:`sample` takes the
uniform (see :mod:`specserve.engine.randomness`).

A sampled session picks one of two rules (:class:`SamplingRule`): **coupled** (the
default; :mod:`specserve.engine.coupling`), whose tokens depend on the seed and the
history only, so they equal target-only sampling whatever k, drafter, batch or
replica; or **rejection** (:mod:`specserve.engine.rejection`), the classic rule,
whose draws also depend on the round index, so the tokens change with the rounds'
split. Both are exact samples from the target's distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from specserve.engine.errors import InvalidArgument
from specserve.engine.filters import top_k_top_p


class SamplingRule(StrEnum):
    """How a sampled session's draft tokens are judged and its tokens drawn."""

    COUPLED = "coupled"  # Gumbel-max with noise fixed by (seed, position); drafts kept while equal
    REJECTION = "rejection"  # accept with min(1, p/q), resample from the residual


@dataclass(frozen=True)
class SamplingParams:
    """How a session turns logits into tokens. Validated on construction."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0  # any int; the randomness hash reduces it modulo 2**64
    rule: SamplingRule = SamplingRule.COUPLED  # ignored when greedy

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise InvalidArgument(f"temperature must be a number, got {self.temperature!r}.")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument(
                f"temperature must be a finite number >= 0 (0 means greedy), "
                f"got {self.temperature!r}."
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise InvalidArgument(f"top_k must be an integer, got {self.top_k!r}.")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 turns it off), got {self.top_k}.")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise InvalidArgument(f"top_p must be a number, got {self.top_p!r}.")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p!r}.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InvalidArgument(f"seed must be an integer, got {self.seed!r}.")
        if not isinstance(self.rule, SamplingRule):
            raise InvalidArgument(
                f"rule must be one of {', '.join(SamplingRule)}, got {self.rule!r}."
            )

    @property
    def greedy(self) -> bool:
        """Temperature 0: the token is the argmax, no randomness is drawn."""
        return self.temperature == 0

    @property
    def coupled(self) -> bool:
        """Sampled with the coupled rule: tokens are a function of (seed, history)."""
        return not self.greedy and self.rule == SamplingRule.COUPLED


_MIN_TEMPERATURE = 1e-30


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 probabilities [n, vocab] of logits [n, vocab] under one set of params."""
    return batched_probabilities(logits, [params], [logits.shape[0]])


def batched_probabilities(
    logits: torch.Tensor,  # [n, vocab], any float dtype
    params: Sequence[SamplingParams],  # [sessions]
    rows_per_param: Sequence[int],  # [sessions], sums to n
) -> torch.Tensor:
    """float32 probabilities [n, vocab]; session i owns ``rows_per_param[i]`` consecutive rows.

    Temperature and softmax run on all sampled rows at once; the ranking that top-k
    and top-p need runs only on the rows that ask for them.
    """
    if len(params) != len(rows_per_param):
        raise InvalidArgument(
            f"got {len(params)} sampling params but {len(rows_per_param)} row counts."
        )
    if logits.ndim != 2 or logits.shape[0] != sum(rows_per_param):
        raise InvalidArgument(
            f"logits of shape {tuple(logits.shape)} do not match the "
            f"{sum(rows_per_param)} rows the sessions own."
        )
    device = logits.device
    if logits.shape[0] == 0:
        return torch.zeros(logits.shape, dtype=torch.float32, device=device)
    counts = torch.tensor(list(rows_per_param), dtype=torch.long)

    def per_row(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:  # [n] on the host
        return torch.tensor(values, dtype=dtype).repeat_interleave(counts)

    # Which rows take which path is decided on the host, from the params: on a GPU a
    # test of a device tensor would wait for every kernel queued before it.
    greedy = per_row([p.greedy for p in params], torch.bool)  # [n]
    out: torch.Tensor | None = None  # made only when some rows are greedy
    if any(p.greedy for p in params):
        out = torch.zeros(logits.shape, dtype=torch.float32, device=device)
        rows = greedy.nonzero().squeeze(1).to(device)
        out[rows] = _one_hot_argmax(logits[rows])
        if all(p.greedy for p in params):
            return out

    sampled = (~greedy).nonzero().squeeze(1)  # [s]
    # Below _MIN_TEMPERATURE a float32 temperature would underflow to 0 (and 0/0 to NaN);
    # the distribution there is already a point mass on the maximum (shared by exact ties).
    temperatures = [max(p.temperature, _MIN_TEMPERATURE) for p in params]
    temperature = per_row(temperatures, torch.float32)[sampled].to(device)
    top_k = per_row([p.top_k for p in params], torch.long)[sampled]  # [s] on the host
    top_p = per_row([p.top_p for p in params], torch.float64)[sampled]  # [s] on the host
    sampled = sampled.to(device)

    x = (logits if out is None else logits[sampled]).float()  # [s, vocab]
    x = (x - x.amax(dim=-1, keepdim=True)) / temperature[:, None]
    vocab = x.shape[1]
    filtered = ((top_k > 0) & (top_k < vocab)) | (top_p < 1)  # [s]
    if bool(filtered.all()):
        x = top_k_top_p(x, top_k, top_p)
    elif bool(filtered.any()):
        rows = filtered.nonzero().squeeze(1)
        on = rows.to(device)
        x[on] = top_k_top_p(x[on], top_k[rows], top_p[rows])
    if out is None:  # every row sampled
        return torch.softmax(x, dim=-1)
    out[sampled] = torch.softmax(x, dim=-1)
    return out


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:  # [r, vocab] -> [r, vocab]
    one_hot = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return one_hot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)


def sample(probs: torch.Tensor, u: float | torch.Tensor) -> int | torch.Tensor:
    """Inverse-CDF sample: the first index whose float64 cumulative mass exceeds ``u * total``.

    ``probs`` need not be normalised. 1-D ``probs`` [vocab] with a scalar ``u`` gives an
    int; 2-D ``probs`` [n, vocab] with ``u`` a float or float [n] gives int64 [n]. A
    token of zero probability is never returned (its cdf equals its predecessor's),
    and rounding that pushes ``u * total`` to the top clamps to the last token with
    mass.
    """
    if probs.ndim == 1:
        u_row = torch.as_tensor(u, dtype=torch.float64).reshape(1)
        return int(sample(probs[None], u_row)[0])  # type: ignore[arg-type]
    assert probs.ndim == 2, f"probs must be [vocab] or [n, vocab], got {tuple(probs.shape)}"
    cdf = probs.double().cumsum(dim=-1)  # [n, vocab]
    total = cdf[:, -1:].contiguous()  # [n, 1]
    assert bool((total > 0).all()), "cannot sample from a row with no probability mass"
    u_col = torch.as_tensor(u, dtype=torch.float64, device=probs.device)
    u_col = u_col.expand(probs.shape[0]).reshape(-1, 1)  # [n, 1]
    index = torch.searchsorted(cdf, u_col * total, right=True)  # first cdf > u * total
    last = torch.searchsorted(cdf, total, right=False)  # first cdf >= total: last with mass
    return torch.minimum(index, last).squeeze(1)


def truncate(probs: torch.Tensor, max_support: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse form (ids int64 [n, m], probs float32 [n, m]) of probs [n, vocab], m = max_support.

    Every token with nonzero probability is kept, so the sparse form is the same
    distribution; ids ascend within a row and the rest is padded with id -1 and
    probability 0. The draft sends q this way; it must therefore sample from at most
    ``max_support`` tokens (top-k <= max_support, or greedy).
    """
    if isinstance(max_support, bool) or not isinstance(max_support, int) or max_support < 1:
        raise InvalidArgument(f"max_support must be an integer >= 1, got {max_support!r}.")
    assert probs.ndim == 2, f"probs must be [n, vocab], got {tuple(probs.shape)}"
    n, vocab = probs.shape
    support = int((probs > 0).sum(dim=-1).max()) if n else 0
    if support > max_support:
        raise InvalidArgument(
            f"the distribution has {support} tokens with nonzero probability but "
            f"max_support is {max_support}; sample the draft with top_k <= {max_support}."
        )
    width = min(max_support, vocab)
    values, ids = probs.float().topk(width, dim=-1)  # every nonzero lies in here
    ids = torch.where(values > 0, ids, -1)
    # Ascending ids, padding last: a canonical order whatever topk did with ties.
    key = torch.where(ids >= 0, ids, vocab)
    key, order = key.sort(dim=-1)
    ids = torch.where(key < vocab, key, -1)
    values = values.gather(1, order).masked_fill(ids < 0, 0.0)
    if width < max_support:
        pad = max_support - width
        ids = torch.nn.functional.pad(ids, (0, pad), value=-1)
        values = torch.nn.functional.pad(values, (0, pad), value=0.0)
    return ids, values
