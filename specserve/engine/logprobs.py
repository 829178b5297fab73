"""Log-probabilities of emitted tokens and their most likely alternatives.

What the OpenAI ``logprobs`` / ``top_logprobs`` fields report, computed on the
target from the distribution it draws each token from: the session's temperature,
top-k and top-p applied (:func:`specserve.engine.sampling.probabilities`). A greedy
session's distribution is a one-hot that says nothing, so greedy sessions report
the raw model distribution (temperature 1) instead. Alternatives are only tokens
that distribution can draw (probability > 0), most likely first, ties to the lower id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.engine.sampling import SamplingParams, probabilities

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log p and up to N (token id, log p) alternatives."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(
    logits: torch.Tensor,  # [len(emitted), vocab]: the rows the emitted tokens were drawn from
    emitted: Sequence[int],  # [len(emitted)]
    params: SamplingParams,
    top: int,
) -> tuple[TokenLogprob, ...]:
    """Each emitted token's :class:`TokenLogprob` with ``top`` alternatives (0..20)."""
    assert 0 <= top <= MAX_TOP_LOGPROBS, top
    assert logits.shape[0] == len(emitted), (logits.shape, len(emitted))
    if params.greedy:
        logp = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    else:
        logp = torch.log(probabilities(logits, params))  # [n, vocab], -inf off the support
    # Everything read back from the device in two copies, not a few per token.
    index = torch.tensor(list(emitted), dtype=torch.long, device=logp.device)[:, None]
    chosen = logp.gather(1, index)[:, 0].tolist()  # [n]
    top_ids: list[list[int]] = [[] for _ in emitted]
    top_values: list[list[float]] = [[] for _ in emitted]
    if top:
        # a stable descending sort: equal probabilities rank the lower id first
        values, ids = torch.sort(logp, dim=-1, descending=True, stable=True)
        top_ids, top_values = ids[:, :top].tolist(), values[:, :top].tolist()
    return tuple(
        TokenLogprob(
            float(logp_token),
            tuple(
                (int(t), float(v))
                for t, v in zip(ids_row, values_row, strict=True)
                if math.isfinite(v)
            ),
        )
        for logp_token, ids_row, values_row in zip(chosen, top_ids, top_values, strict=True)
    )
