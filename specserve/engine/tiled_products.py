"""Products of many rows (a prefill) on a CPU, one tile of weight rows at a time.

Past :data:`~specserve.engine.ops.MAX_KERNEL_ROWS` rows a product goes to torch's GEMM
(MKL), which needs the weight's float32 values in memory. A weight that does not hold
them as one matrix (GGML blocks, or bfloat16 under float32 activations) would have to
be widened whole for every such call: 0.93 GB of float32 for the 1.5B's quantized LM
head, 55 MB for each of its gate/up projections. Instead :func:`tiled_linear` cuts the
output into tiles of :func:`tile_rows` weight rows (about :data:`TILE_FLOATS` values);
each tile's float32 values are written into one buffer that all tiles of the call
reuse (the reference dequantization for blocks, a copy for bfloat16; a float32
weight's tile is a view of it) and multiplied by every row of ``x`` with one
``torch.addmm`` into the tile's columns of the result.

Exactness: a float32 weight takes the same path (same tiles, whose bounds depend only
on the weight's shape; same GEMM calls on the same float32 values), so a quantized or
bfloat16 weight gives the bits of the float32 weight holding its dequantized or widened
values, at every row count. What this does not promise, as one ``F.linear`` call did
not: a tile's product is not the matching columns of a whole-matrix GEMM (MKL blocks
by shape; measured here, 300 rows by [1536, 1536] differ in the last bit), and the
rows of a prefill are not rounded as one-token steps are. Greedy exactness needs
neither: it rests on verify forwards of at most ``MAX_KERNEL_ROWS`` rows (the CPU
kernels) being bit-identical to one-token steps, and on every run of a prompt
prefilling it the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.engine.quant.formats import dequantize
from specserve.engine.quant.weight import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight

# About 1 MiB of float32 per tile: the tile stays in a core's L2 while MKL packs it,
# and a call makes few enough tiles (7 for the 1.5B's [1536, 1536] q/o) that the Python
# per tile (~20 us) stays a few percent of a 64-row product.
TILE_FLOATS = 1 << 18
# Tile bounds are multiples of this many rows (whole cache lines of any output row).
TILE_ROW_MULTIPLE = 16


def tile_rows(out_features: int, in_features: int) -> int:
    """Weight rows per tile for a weight ``[out_features, in_features]``: about
    :data:`TILE_FLOATS` values, a multiple of :data:`TILE_ROW_MULTIPLE`, at most the
    whole weight."""
    rows = TILE_FLOATS // max(in_features, 1) // TILE_ROW_MULTIPLE * TILE_ROW_MULTIPLE
    return min(max(rows, TILE_ROW_MULTIPLE), out_features)


def applies(x: torch.Tensor, weight: Weight) -> bool:
    """Whether :func:`tiled_linear` takes this product: a float32 CPU matrix ``x`` and a
    float32, bfloat16 or quantized CPU weight, no autograd."""
    if x.dim() != 2 or x.dtype != torch.float32 or not x.is_cpu:
        return False
    if isinstance(weight, QuantizedWeight):
        return weight.blocks.is_cpu and not (torch.is_grad_enabled() and x.requires_grad)
    return (
        weight.dim() == 2
        and weight.is_cpu
        and weight.dtype in (torch.float32, torch.bfloat16)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def _is_float32(weight: Weight) -> bool:
    return not isinstance(weight, QuantizedWeight) and weight.dtype == torch.float32


def _write_tile(
    weight: Weight, o0: int, o1: int, buf: torch.Tensor
) -> torch.Tensor:  # [o1 - o0, in] float32: a view of buf, or of a float32 weight
    """The float32 values of weight rows ``[o0, o1)``."""
    if isinstance(weight, QuantizedWeight):
        tile = buf[: o1 - o0]
        return tile.copy_(dequantize(weight.blocks[o0:o1], weight.ggml_type, weight.in_features))
    if weight.dtype == torch.float32:
        return weight[o0:o1]
    return buf[: o1 - o0].copy_(weight[o0:o1])  # bfloat16 -> float32: exact


def tiled_linear(
    x: torch.Tensor,  # [rows, in] float32
    weight: Weight,  # [out, in]
    bias: torch.Tensor | None,  # [out] float32
    bfloat16: bool = False,
) -> torch.Tensor:  # [rows, out] float32
    """``x @ weight.T + bias`` tile by tile (module doc).

    ``bfloat16``: multiply in bfloat16 instead (each tile and ``x`` rounded to bfloat16,
    float32 results; :func:`~specserve.engine.ops.bfloat16_products`, a draft's prefill):
    not the float32 bits, and no twin takes this path."""
    out_features, in_features = weight.shape
    rows = tile_rows(out_features, in_features)
    # One buffer for every tile of the call; a float32 weight's tiles are views of it.
    buf = torch.empty(0 if _is_float32(weight) else rows, in_features)
    x16 = x.bfloat16() if bfloat16 else x
    if rows == out_features and not bfloat16:  # one tile: one F.linear call, as untiled
        return F.linear(x, _write_tile(weight, 0, out_features, buf), bias)
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    for o0 in range(0, out_features, rows):
        o1 = min(o0 + rows, out_features)
        tile = _write_tile(weight, o0, o1, buf)
        if bfloat16:
            y[:, o0:o1] = torch.mm(x16, tile.bfloat16().t())
            if bias is not None:
                y[:, o0:o1] += bias[o0:o1]
        elif bias is None:
            torch.mm(x, tile.t(), out=y[:, o0:o1])
        else:
            torch.addmm(bias[o0:o1], x, tile.t(), out=y[:, o0:o1])
    return y
