"""The target's choice per row in static shapes: greedy argmax, or the coupled draw.

What :mod:`specserve.engine.rejection` computes for greedy and coupled sessions
(``_choices``), written for a step that must not read a value back to the host nor
branch on one (:mod:`specserve.engine.static_step`): the sampling parameters are
per-row tensors, and every row takes the same ops.

* :func:`probabilities` is :func:`~specserve.engine.sampling.batched_probabilities`
  for sampled rows (temperature, top-k, top-p, softmax) with the ranking done by one
  stable descending sort of each whole row, instead of the eager filter's partial
  ranking with a fallback that a data test picks. The rules are the same (top-k keeps
  exactly k ids, ties to the lower id; top-p the smallest prefix of the rank order
  whose mass reaches ``top_p``) and so are the masses' formulas (the top-k's
  renormalised in float64; without a top-k each id's float32 ``exp`` over the row's
  float64 total), so the kept ids are the same; where float64 sums over a different
  length round differently in the last bit, an id lying exactly on the top-p
  boundary could fall the other way.
* :func:`choices` is the argmax of the logits on greedy rows and
  ``argmax(p / E)`` (:mod:`specserve.engine.coupling`) on coupled rows, with ``E``
  made on the device from each row's 64-bit key; on a CPU with the engine's kernels
  the coupled rows take ``coupled_argmax`` (a torch op, traced by ``torch.compile``
  through its fake, :mod:`specserve.engine.kernel_fakes`), as the eager path does.
"""

from __future__ import annotations

import math

import torch

from specserve.engine import coupling, cpu_kernels, ops

_MIN_TEMPERATURE = 1e-30  # as sampling.batched_probabilities


def probabilities(
    logits: torch.Tensor,  # [r, vocab] float32
    temperature: torch.Tensor,  # [r] float32, > 0
    top_k: torch.Tensor,  # [r] int64, 0 = off
    top_p: torch.Tensor,  # [r] float64, 1 = off
) -> torch.Tensor:  # [r, vocab] float32
    """The sampled distribution of every row (see the module doc)."""
    x = logits.float()
    x = (x - x.amax(dim=-1, keepdim=True)) / temperature[:, None]
    vocab = x.shape[1]
    values, ids = x.sort(dim=-1, descending=True, stable=True)  # [r, vocab] rank order
    rank = torch.arange(vocab, device=x.device)[None, :]
    k_on = (top_k > 0) & (top_k < vocab)  # [r]
    in_k = rank < torch.where(k_on, top_k, vocab)[:, None]  # [r, vocab] in rank order
    topk_masses = torch.softmax(values.double().masked_fill(~in_k, -math.inf), dim=-1)
    total = x.exp().sum(dim=-1, keepdim=True, dtype=torch.float64)  # [r, 1]
    all_masses = values.exp().double() / total
    masses = torch.where(k_on[:, None], topk_masses, all_masses)
    # Mass ranked strictly before each id (filters._nucleus: cumsum, rolled by one).
    cum = masses.cumsum(dim=-1)
    before = torch.cat((torch.zeros_like(cum[:, :1]), cum[:, :-1]), dim=-1)
    in_p = (before < top_p[:, None]) | (top_p[:, None] >= 1) | (rank == 0)
    keep = torch.zeros_like(in_k).scatter_(1, ids, in_k & in_p)  # [r, vocab] by id
    filtered = (k_on | (top_p < 1))[:, None]
    return torch.softmax(x.masked_fill(filtered & ~keep, -math.inf), dim=-1)


def choices(
    logits: torch.Tensor,  # [r, vocab] float32
    sampled: bool,  # whether any row may be coupled (a static choice: the step's bucket)
    coupled: torch.Tensor,  # [r] bool, coupled rows (the rest greedy)
    temperature: torch.Tensor,  # [r] float32
    top_k: torch.Tensor,  # [r] int64
    top_p: torch.Tensor,  # [r] float64
    keys: torch.Tensor,  # [r] int64: coupling.keys(seed, position) of each row, as int64 bits
    support: int = 0,  # > 0: a draft's choice among the row's support likeliest ids
) -> torch.Tensor:  # [r] int64
    """The target's own token of every row: argmax, or argmax(log p + g) where coupled
    (with ``support``: the draft's coupled draw, ``draft_sampling.draw_rows``: among the
    top ``support`` ids renormalised)."""
    greedy = logits.argmax(dim=-1)  # first max wins
    if not sampled:
        return greedy
    probs = probabilities(logits, temperature.clamp(min=_MIN_TEMPERATURE), top_k, top_p)
    if support > 0:
        vals, ids = torch.topk(probs, min(support, probs.shape[1]), dim=-1)  # [r, m]
        vals = vals / vals.sum(dim=-1, keepdim=True)
        g = coupling.noise_at_keys(keys[:, None], ids)  # [r, m]
        pick = (vals.float().log() + g).argmax(dim=-1, keepdim=True)
        return torch.where(coupled, ids.gather(1, pick)[:, 0], greedy)
    kern = cpu_kernels.kernels() if probs.is_cpu and ops.kernels_on() else None
    if kern is not None:
        drawn = kern.coupled_argmax(probs.contiguous(), keys)
    else:
        drawn = (probs / coupling.exponentials(keys[:, None], probs.shape[1])).argmax(dim=-1)
    return torch.where(coupled, drawn, greedy)
