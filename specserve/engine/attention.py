"""Attention over a long KV cache in key blocks, so memory grows linearly with the context.

``scaled_dot_product_attention`` with a mask (what a prefill chunk needs) materializes
the scores ``[batch, heads, queries, keys]`` on a CPU: 512 queries over 131,072 keys
of 28 heads is 7.5 GB. :func:`blocked_attention` walks the keys in blocks of
``block`` and merges the blocks with the running-maximum ("online") softmax of
FlashAttention, so the largest temporary is ``[batch, heads, queries, block]``.

It computes the same function as SDPA; the float32 sums run in another order
(per block, then merged), so results differ from SDPA by float32 rounding (the
equality tests measure it). The model uses it only where the cache is longer than
:data:`BLOCKED_ABOVE_KEYS`, so ordinary prompts keep SDPA's exact bits.

Attention logit soft-capping (Gemma 2: each score ``s -> c * tanh(s / c)`` before the
mask and the softmax) is something SDPA cannot do: :func:`capped_attention` computes
the scores, caps, masks, normalizes and weights the values as explicit ops, for a
model with a cap below :data:`BLOCKED_ABOVE_KEYS` keys, and :func:`blocked_attention`
caps each block's scores above it.
"""

from __future__ import annotations

import math

import torch

# Key length from which a multi-query attention runs in blocks (below it, SDPA: its
# temporaries are at most queries x 4096 scores per head, ~32 MB per head for 2048
# queries).
BLOCKED_ABOVE_KEYS = 4096
KEY_BLOCK = 2048


def blocked_attention(
    q: torch.Tensor,  # [batch, heads, queries, head_dim]
    keys: torch.Tensor,  # [batch, kv_heads, keys, head_dim]
    values: torch.Tensor,  # [batch, kv_heads, keys, head_dim]
    mask: torch.Tensor | None,  # [batch, 1, queries, keys] bool, True = attend
    block: int = KEY_BLOCK,
    softcap: float | None = None,
) -> torch.Tensor:  # [batch, heads, queries, head_dim]
    """Softmax attention (GQA: heads a multiple of kv_heads) over keys in blocks, each
    score soft-capped to ``softcap * tanh(score / softcap)`` first where ``softcap`` is set.

    Every query row must be allowed at least one key (the model's masks guarantee it).
    """
    b, heads, n, d = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    assert group * kv_heads == heads, (heads, kv_heads)
    # Queries of one KV head side by side: [batch, kv_heads, group * queries, head_dim].
    qg = q.reshape(b, kv_heads, group * n, d) * (1.0 / math.sqrt(d))
    dtype = torch.float32
    run_max = torch.full((b, kv_heads, group * n, 1), -math.inf, dtype=dtype, device=q.device)
    run_sum = torch.zeros((b, kv_heads, group * n, 1), dtype=dtype, device=q.device)
    acc = torch.zeros((b, kv_heads, group * n, d), dtype=dtype, device=q.device)
    for start in range(0, keys.shape[2], block):
        end = min(start + block, keys.shape[2])
        scores = (qg @ keys[:, :, start:end].transpose(-1, -2)).to(dtype)  # [b, kvh, g*n, blk]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            allowed = mask[:, :, :, start:end]  # [b, 1, n, blk] -> [b, 1, g*n, blk]
            allowed = allowed.expand(b, group, n, end - start).reshape(b, 1, group * n, -1)
            scores = scores.masked_fill(~allowed, -math.inf)
        new_max = torch.maximum(run_max, scores.amax(-1, keepdim=True))
        # A row that has seen no allowed key yet keeps max -inf: shift by 0 instead (its
        # exp terms are all 0 either way) so that no -inf - -inf makes a NaN.
        shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        probs = torch.exp(scores - shift)
        rescale = torch.exp(run_max - shift)
        run_sum = run_sum * rescale + probs.sum(-1, keepdim=True)
        acc = acc * rescale + probs.to(values.dtype) @ values[:, :, start:end]
        run_max = new_max
    out = acc / run_sum
    return out.reshape(b, heads, n, d).to(q.dtype)


def capped_attention(
    q: torch.Tensor,  # [batch, heads, queries, head_dim]
    keys: torch.Tensor,  # [batch, kv_heads, keys, head_dim]
    values: torch.Tensor,  # [batch, kv_heads, keys, head_dim]
    mask: torch.Tensor | None,  # [batch, 1, queries, keys] bool, True = attend
    softcap: float,
) -> torch.Tensor:  # [batch, heads, queries, head_dim]
    """``softmax(cap(q k^T / sqrt(head_dim)) masked) v`` with ``cap(s) = softcap *
    tanh(s / softcap)`` (GQA: heads a multiple of kv_heads), as Gemma 2's eager attention
    computes it; the scores and the softmax in float32. Materializes the scores
    ``[batch, heads, queries, keys]``: for caches up to :data:`BLOCKED_ABOVE_KEYS` keys
    (above, :func:`blocked_attention` with ``softcap``)."""
    group = q.shape[1] // keys.shape[1]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    scores = (q @ keys.transpose(-1, -2)).float() * (1.0 / math.sqrt(q.shape[-1]))
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return (torch.softmax(scores, dim=-1).to(values.dtype) @ values).to(q.dtype)
