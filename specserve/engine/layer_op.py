"""A decoder layer of quantized weights as one op (``decoder_layer``, cpu_kernels_layer.cpp).

:class:`~specserve.engine.model.DecoderLayer` packs its operands once
(:func:`pack_layer`: the weights as the integer kernels read them, biases padded alike)
and, where :func:`layer_kernels` says a forward may, runs the layer with one call
(:func:`run_layer`) instead of ~15 Python-level ops: the same kernel functions in the
same order, so the same bits as :mod:`specserve.engine.ops` called one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specserve.engine import cpu_kernels, ops
from specserve.engine.cpu_kernels import Kernels
from specserve.engine.ops import MAX_KERNEL_ROWS, Weight
from specserve.engine.quant.weight import QuantizedWeight


def layer_kernels(h: torch.Tensor, k_cache: torch.Tensor) -> Kernels | None:
    """The kernels if a forward of the packed new tokens ``h`` may run each decoder layer
    as one op (:func:`run_layer`), else ``None``: kernels on, float32 CPU activations and
    cache, at most :data:`MAX_KERNEL_ROWS` tokens (where :func:`rope_cache_attention`
    applies), no autograd."""
    if (
        not ops.kernels_on()
        or h.shape[0] > MAX_KERNEL_ROWS
        or h.dtype != torch.float32
        or not h.is_cpu
        or k_cache.dtype != torch.float32
        or not k_cache.is_cpu
        or (torch.is_grad_enabled() and h.requires_grad)
    ):
        return None
    return cpu_kernels.kernels()


@dataclass(frozen=True)
class PackedLayer:
    """A decoder layer's operands as ``decoder_layer`` takes them (:func:`pack_layer`)."""

    ws: list[torch.Tensor]  # q, k, v, o, gate, up, down: blocks as the kernels read them
    types: list[int]  # their type codes
    outs: list[int]  # their output widths before any row padding
    biases: list[torch.Tensor | None]  # q, k, v (padded as their weights)
    norms: list[torch.Tensor]  # input and post-attention norm weights
    eps: float
    head_dim: int
    sources: tuple[object, ...]  # what it was packed from, compared by identity


def pack_layer(
    kern: Kernels,
    weights: Sequence[Weight],  # q, k, v, o, gate, up, down
    biases: Sequence[torch.Tensor | None],  # q, k, v
    norms: Sequence[torch.Tensor],  # input, post-attention
    eps: float,
    head_dim: int,
) -> PackedLayer | None:
    """The layer's operands for :func:`run_layer`, or ``None`` where it cannot run as one
    op: a weight that is not quantized, gate and up padded differently, a bias or norm
    weight that is not a float32 CPU vector. Repacks weights as
    :func:`~specserve.engine.ops.linears` would."""
    if not all(isinstance(w, QuantizedWeight) and w.blocks.is_cpu for w in weights):
        return None
    vectors = [*norms, *(b for b in biases if b is not None)]
    if any(v.dtype != torch.float32 or not v.is_cpu or v.dim() != 1 for v in vectors):
        return None
    packed = [ops.packed_blocks(kern, w) for w in weights]  # type: ignore[arg-type]
    if packed[4][0].shape[0] != packed[5][0].shape[0]:
        return None
    return PackedLayer(
        ws=[t for t, _ in packed],
        types=[c for _, c in packed],
        outs=[w.shape[0] for w in weights],
        biases=[
            ops.padded_bias(b, t.shape[0]) for b, (t, _) in zip(biases, packed[:3], strict=True)
        ],
        norms=list(norms),
        eps=float(eps),
        head_dim=int(head_dim),
        sources=(*weights, *biases, *norms),
    )


def run_layer(
    kern: Kernels,
    h: torch.Tensor,  # [tokens, hidden]
    layer: PackedLayer,
    attention: Sequence[Any],
) -> torch.Tensor:  # [tokens, hidden]
    """``h`` through one decoder layer (norm, q/k/v, attention, output projection,
    residual, norm, SwiGLU, down projection, residual) in one op: the bits of those ops
    called one by one. ``attention``: :func:`~specserve.engine.ops.rope_cache_attention`'s
    arguments after q, k and v, in its order (the sliding window last, None for none)."""
    *head, window = attention
    return kern.decoder_layer(
        h,
        layer.ws,
        layer.types,
        layer.outs,
        layer.biases,
        layer.norms,
        layer.eps,
        layer.head_dim,
        *head,
        window or 0,
    )
