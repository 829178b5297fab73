"""A draft step's sampled tokens: every sampled row of the step drawn at once.

A sampled draft token is drawn from the sparse q of its row: the sampling
distribution (temperature, top-k, top-p) cut to its ``max_support`` likeliest ids and
renormalised. Under the coupled rule the token is the coupled choice among those ids
(:func:`coupling.choose_among`); under the rejection rule it is the inverse-CDF draw
of the row's ``Stream.DRAFT`` uniform for (seed, round, position), and the q goes to
the verifier with the token, which needs exactly the q the token was drawn from.

Row by row, these are a few dozen small tensor operations each; on an accelerator
every one is a kernel launch the host pays for. Here the whole step's rows share
one softmax, one top-m, one coupled choice and one search, so a step costs the
same number of launches at one session as at thirty-two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.engine import coupling
from specserve.engine.randomness import Stream, uniforms_batch
from specserve.engine.sampling import SamplingParams, batched_probabilities

SparseQ = tuple[torch.Tensor, torch.Tensor]  # ids int64 [m], probabilities float32 [m]


@dataclass(frozen=True)
class DrawRow:
    """One sampled row of a draft step: whose params, which round, which position."""

    params: SamplingParams  # not greedy
    round_index: int
    position: int  # absolute position of the token being drafted


def draw_rows(
    rows: Sequence[DrawRow],
    logits: torch.Tensor,  # [len(rows), vocab], row i is rows[i]'s
    max_support: int,
) -> tuple[list[int], list[SparseQ | None]]:
    """Each row's draft token, and its sparse q under the rejection rule (None if coupled).

    Equal to drawing the rows one at a time: each row's q is its own distribution's
    top ``max_support`` ids, renormalised, and its token depends on nothing but its row.
    """
    assert all(not r.params.greedy for r in rows), "greedy rows take the argmax"
    n = len(rows)
    if n == 0:
        return [], []
    probs = batched_probabilities(logits, [r.params for r in rows], [1] * n)  # [n, vocab]
    m = min(max_support, probs.shape[1])
    vals, ids = torch.topk(probs, m, dim=-1)  # [n, m], descending
    vals = vals / vals.sum(dim=-1, keepdim=True)
    tokens = [0] * n
    qs: list[SparseQ | None] = [None] * n
    coupled = [i for i, r in enumerate(rows) if r.params.coupled]
    if coupled:
        on = torch.tensor(coupled, device=probs.device)
        picked = coupling.choose_among(
            vals[on],
            ids[on],
            [rows[i].params.seed for i in coupled],
            [rows[i].position for i in coupled],
        ).tolist()
        for i, token in zip(coupled, picked, strict=True):
            tokens[i] = token
    drawn = [i for i, r in enumerate(rows) if not r.params.coupled]
    if drawn:
        on = torch.tensor(drawn, device=probs.device)
        q_ids, q_vals = ids[on], vals[on]  # [d, m]
        u = uniforms_batch(
            [rows[i].params.seed for i in drawn],
            [rows[i].round_index for i in drawn],
            [rows[i].position for i in drawn],
            Stream.DRAFT,
        ).to(probs.device)  # float64 [d]
        cdf = q_vals.double().cumsum(dim=-1)  # [d, m]
        pick = torch.searchsorted(cdf, (u[:, None] * cdf[:, -1:]).contiguous(), right=True)
        # Ids of zero mass sit at the end of the descending top-m: never emit one.
        with_mass = (q_vals > 0).sum(dim=-1, keepdim=True)  # [d, 1], at least 1
        pick = torch.minimum(pick, with_mass - 1)  # [d, 1]
        chosen = q_ids.gather(1, pick)[:, 0].tolist()
        q_probs = q_vals.float()
        for j, i in enumerate(drawn):
            tokens[i] = chosen[j]
            qs[i] = (q_ids[j], q_probs[j])
    return tokens, qs
