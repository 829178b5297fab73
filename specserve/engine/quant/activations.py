"""The 8-bit activation blocks the integer kernels multiply quantized weights with, in
torch: the reference for tests and for measuring what the rounding costs.

Each row of ``x`` is cut into blocks of ``block`` values (256 against Q4_K / Q6_K weights,
32 against Q5_0 / Q8_0, as llama.cpp's Q8_K and Q8_0) and each block quantized alone,
in float32 operations the kernels perform identically::

    amax = max |x_i|;   id = 127 / amax (0 if amax == 0);   d = amax / 127
    q_i  = round-half-even(x_i * id)        (in [-127, 127])

so ``d * q`` stands for ``x``. A product of a quantized weight with ``x`` in the kernels
is, up to float32 rounding of its sums, ``dequantize(w) @ (d * q).T`` computed exactly
(:func:`reference_product`): the weight's own values, the activations' 8-bit ones.
"""

from __future__ import annotations

import torch

from specserve.engine.quant.formats import GGMLType, block_format

# Activation block size against each weight type.
ACTIVATION_BLOCK = {
    GGMLType.Q4_K: 256,
    GGMLType.Q6_K: 256,
    GGMLType.Q5_0: 32,
    GGMLType.Q8_0: 32,
}


def quantize_rows(
    x: torch.Tensor,  # [rows, K] float32, K a multiple of block
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # q [rows, K] int8, d [rows, K / block] float32
    """The 8-bit blocks of ``x`` (module doc), the kernels' values bit for bit."""
    rows, k = x.shape
    if x.dtype != torch.float32 or k % block:
        raise ValueError(f"x must be float32 with a multiple of {block} columns")
    blocks = x.reshape(rows, k // block, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # [rows, nb, 1]
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv).to(torch.int8)  # torch.round: half to even
    return q.reshape(rows, k), (amax / torch.tensor(127.0)).reshape(rows, k // block)


def dequantized_rows(x: torch.Tensor, block: int) -> torch.Tensor:  # [rows, K] float64
    """``d * q`` of :func:`quantize_rows`, exactly (float64)."""
    q, d = quantize_rows(x, block)
    rows, k = x.shape
    return (q.double().reshape(rows, k // block, block) * d.double().unsqueeze(-1)).reshape(rows, k)


def reference_product(
    x: torch.Tensor,  # [rows, K] float32
    blocks: torch.Tensor,  # [out, bytes per row] uint8
    ggml_type: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [rows, out] float64 each
    """The exact product the integer kernels round (float64), and the sum of the
    magnitudes of its terms (what a float32 rounding bound scales with)."""
    fmt = block_format(ggml_type)
    k = x.shape[1]
    w = fmt.dequantize_blocks(blocks.reshape(-1, fmt.bytes_per_block)).reshape(-1, k).double()
    xq = dequantized_rows(x, ACTIVATION_BLOCK[fmt.ggml_type])
    return xq @ w.T, xq.abs() @ w.abs().T
