"""Top-k and top-p: which ids of a row of tempered logits stay in its distribution.

The rules (:mod:`specserve.engine.sampling` states them): top-k keeps exactly k ids,
ties to the lower id; top-p keeps the smallest prefix, ranked by (logit desc, id
asc), whose probability reaches ``top_p``. Neither needs the whole vocabulary
ranked in the common case: a row keeps its survivors from a partial ranking of a
few hundred ids, and only when the survivors could reach past that ranking (a tie
across the k-th value; a nucleus wider than :data:`NUCLEUS_WIDTH` ids) does the row
take a pass over all of them. Which way a row takes depends on that row alone, and
both ways keep the same ids.
"""

from __future__ import annotations

import math

import torch

# Ids a top-p row ranks before it falls back to sorting its whole vocabulary.
NUCLEUS_WIDTH = 1024


def top_k_top_p(
    x: torch.Tensor,  # [r, vocab] float32 tempered logits
    top_k: torch.Tensor,  # [r] int64 on the host, 0 = off
    top_p: torch.Tensor,  # [r] float64 on the host, 1 = off
) -> torch.Tensor:
    """x with the logits outside the top-k and then the top-p nucleus set to -inf
    (in place where every row has a top-k)."""
    vocab, device = x.shape[1], x.device
    partial = (top_k > 0) & (top_k < vocab)
    if bool(partial.all()):  # every row has a top-k (top_k is on the host)
        keep = _keep_top_k_then_p(x, top_k.to(device), top_p.to(device), int(top_k.max()))
        return x.masked_fill_(~keep, -math.inf)
    keep = torch.ones(x.shape, dtype=torch.bool, device=device)  # [r, vocab]
    rows = partial.nonzero().squeeze(1)
    if rows.numel():
        width = int(top_k[rows].max())
        on = rows.to(device)
        keep[on] = _keep_top_k_then_p(x[on], top_k[rows].to(device), top_p[rows].to(device), width)
    rows = (~partial).nonzero().squeeze(1)
    if rows.numel():
        on = rows.to(device)
        keep[on] = _keep_nucleus(x[on], top_p[rows].to(device))
    return x.masked_fill(~keep, -math.inf)


def _keep_top_k_then_p(
    x: torch.Tensor,  # [r, vocab]
    top_k: torch.Tensor,  # [r] int64 in [1, vocab)
    top_p: torch.Tensor,  # [r] float64
    width: int,  # max(top_k)
) -> torch.Tensor:
    """Mask [r, vocab] of the top-k tokens (ties to the lower id), then their top-p nucleus.

    One partial ranking of ``width + 1`` values serves every row whose k-th and
    (k + 1)-th values differ: its top k are then exactly those ids, whichever way the
    ranking ordered ties inside them. Only a row with a tie across its k-th value
    takes the whole-vocabulary pass that picks the tied ids from the lowest up (on a
    GPU, whether any row does is one flag read back per call).
    """
    values, ids = x.topk(width + 1, dim=-1)  # [r, width + 1] descending
    kth = values.gather(1, (top_k - 1)[:, None])  # [r, 1] the k-th largest value
    tie = (kth == values.gather(1, top_k[:, None]))[:, 0]  # [r] a tie across the k-th
    rank = torch.arange(width, device=x.device)[None, :]  # [1, width]
    inside = rank < top_k[:, None]  # [r, width] the top k of each row
    cand_x = values[:, :width].masked_fill(~inside, -math.inf)
    cand_ids = ids[:, :width]
    keep = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    keep.scatter_(1, cand_ids, inside)
    if bool(tie.any()):
        rows = tie.nonzero().squeeze(1)
        tied_keep = _top_k_with_ties(x[rows], kth[rows], top_k[rows])
        keep[rows] = tied_keep
        cand_x[rows], cand_ids[rows] = x[rows].masked_fill(~tied_keep, -math.inf).topk(width, -1)
    cand_x, cand_ids = _rank(cand_x, cand_ids)
    # Survivors outside the nucleus are dropped; the -inf fillers have no mass either way.
    masses = torch.softmax(cand_x.double(), dim=-1)  # of the top k, renormalised
    in_nucleus = _nucleus(masses, top_p) | (cand_x == -math.inf)
    return keep.scatter_(1, cand_ids, keep.gather(1, cand_ids) & in_nucleus)


def _top_k_with_ties(
    x: torch.Tensor,  # [t, vocab]
    kth: torch.Tensor,  # [t, 1] each row's k-th largest value
    top_k: torch.Tensor,  # [t]
) -> torch.Tensor:
    """Mask [t, vocab] of exactly k ids per row: every id above the k-th value, then
    the ids equal to it from the lowest up until k are kept."""
    above = x > kth
    tied = x == kth
    room = top_k[:, None] - above.sum(dim=-1, keepdim=True)  # ties that still fit
    return above | (tied & (tied.cumsum(dim=-1) <= room))


def _keep_nucleus(
    x: torch.Tensor,  # [r, vocab] tempered logits, each row's maximum 0
    top_p: torch.Tensor,  # [r] float64 in (0, 1)
) -> torch.Tensor:
    """Mask [r, vocab] of each row's top-p nucleus over its whole distribution.

    An id's mass is its float32 exp(x) over the row's total summed in float64,
    accumulated in rank order in float64. A row ranks its :data:`NUCLEUS_WIDTH` + 1
    likeliest ids; if the ids strictly above the last of them already hold ``top_p``
    of the mass, nothing ranked lower (ties with that last id included) can be in
    the nucleus, and the ranked prefix decides it with the same sums a whole sort
    would make. Other rows sort the whole row.
    """
    vocab, device = x.shape[1], x.device
    e = x.exp()  # [r, vocab] float32 in [0, 1]
    total = e.sum(dim=-1, keepdim=True, dtype=torch.float64)  # [r, 1]
    keep = torch.zeros(x.shape, dtype=torch.bool, device=device)
    wide = torch.ones(x.shape[0], dtype=torch.bool, device=device)  # rows still to decide
    width = NUCLEUS_WIDTH
    if width + 1 < vocab:
        values, ids = x.topk(width + 1, dim=-1)  # [r, width + 1] descending
        bound = values[:, width:]  # [r, 1] the (width + 1)-th value
        cand_x, cand_ids = _rank(values[:, :width], ids[:, :width])
        masses = e.gather(1, cand_ids).double() / total
        above = (cand_x > bound).sum(dim=-1, keepdim=True)  # [r, 1] ids strictly above
        held = masses.cumsum(dim=-1).gather(1, (above - 1).clamp(min=0))
        wide = ~((above > 0) & (held >= top_p[:, None]))[:, 0]
        keep.scatter_(1, cand_ids, _nucleus(masses, top_p))
    if bool(wide.any()):
        rows = wide.nonzero().squeeze(1)
        order = x[rows].sort(dim=-1, descending=True, stable=True).indices
        masses = e[rows].gather(1, order).double() / total[rows]
        keep[rows] = torch.zeros_like(keep[rows]).scatter_(1, order, _nucleus(masses, top_p[rows]))
    return keep


def _rank(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` [r, w] and their ``ids`` reordered by (value desc, id asc)."""
    ids, by_id = ids.sort(dim=-1)
    values = values.gather(1, by_id)
    values, by_value = values.sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, by_value)


def _nucleus(
    masses: torch.Tensor,  # [r, w] float64 probabilities in rank order
    top_p: torch.Tensor,  # [r] float64
) -> torch.Tensor:
    """Mask [r, w]: the smallest prefix whose probability reaches top_p (all of it if 1)."""
    before = torch.cumsum(masses, dim=-1).roll(1, dims=-1)  # mass ranked strictly before
    before[:, 0] = 0.0
    keep = (before < top_p[:, None]) | (top_p[:, None] >= 1)
    keep[:, 0] = True
    return keep
