"""GGML block-quantization formats the engine keeps as they ship, and their reference
dequantization.

A quantized row of ``in_features`` values is ``in_features / block_size`` consecutive
blocks of ``bytes_per_block`` bytes each (GGUF's own layout, little-endian). Per type:

``Q8_0`` (32 values, 34 bytes)
    ``d`` (float16), ``qs[32]`` (int8). ``w[j] = qs[j] * d``.
``Q5_0`` (32 values, 22 bytes)
    ``d`` (float16), ``qh[4]`` (bit ``j`` of the little-endian 32-bit word is the
    fifth bit of value ``j``), ``qs[16]`` (value ``j`` < 16 in the low nibble of
    ``qs[j]``, value ``j + 16`` in its high nibble). ``w[j] = (q[j] - 16) * d``.
``Q4_K`` (256 values, 144 bytes)
    ``d``, ``dmin`` (float16), ``scales[12]`` (eight 6-bit scales ``sc`` and eight
    6-bit mins ``m``, packed as llama.cpp's ``get_scale_min_k4``), ``qs[128]``.
    Sub-block ``i`` (32 values) takes the low nibbles of ``qs[32 (i // 2) ...]`` for
    even ``i`` and the high nibbles for odd ``i``.
    ``w = (d * sc[i]) * q - (dmin * m[i])``.
``Q6_K`` (256 values, 210 bytes)
    ``ql[128]`` (low 4 bits), ``qh[64]`` (high 2 bits), ``scales[16]`` (int8, one per
    16 values), ``d`` (float16, last). In each half of 128 values, value
    ``32 s + l`` (``s`` in 0..3, ``l`` in 0..31) takes the nibble ``s // 2`` of
    ``ql[64 h + 32 (s % 2) + l]`` and bits ``2 s, 2 s + 1`` of ``qh[32 h + l]``.
    ``w = (d * scales[j // 16]) * (q - 32)``.

**The float operations are the contract.** Each product and difference above is one
IEEE float32 operation rounded to nearest, in the order written (``d * sc``, then
``* q``, then ``- m``), as in llama.cpp's ``dequantize_row_*`` and the ``gguf`` package.
:func:`dequantize` computes exactly these, and the CPU kernels
(:mod:`specserve.engine.cpu_kernels`) widen the blocks in registers with the same
operations, so "the float32 model dequantized from the same file" is one set of bits
for both. Every product here is exact in float32 (a float16 scale has 11 significant
bits and each integer factor at most 7, so no product needs more than 23), hence
neither the order of the multiplications nor a fused multiply-add can change a value;
Q4_K's subtraction is the one rounding, and it is one rounding either way.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch


class GGMLType(enum.IntEnum):
    """The block types the kernels read, numbered as GGUF's ``ggml_type``."""

    Q5_0 = 6
    Q8_0 = 8
    Q4_K = 12
    Q6_K = 14


# [n_blocks, bytes_per_block] uint8 -> [n_blocks, block_size] float32
DequantizeBlocks = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BlockFormat:
    """One block type: how many values a block holds, its bytes, and its dequantizer."""

    ggml_type: GGMLType
    block_size: int  # values per block
    bytes_per_block: int
    dequantize_blocks: DequantizeBlocks


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:  # [n, 1] float32
    """The float16 at byte ``at`` of every block, widened to float32 (exact)."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _low_high_nibbles(q: torch.Tensor) -> torch.Tensor:  # [n, 2 m] int32
    """``[low nibbles of q, high nibbles of q]`` of ``q`` [n, m] uint8."""
    q = q.to(torch.int32)
    return torch.cat([q & 0xF, q >> 4], dim=1)


def _bits(words: torch.Tensor) -> torch.Tensor:  # [n, 8 m] int32
    """Bit ``j`` of the little-endian bytes ``words`` [n, m] uint8 at column ``j``."""
    shifts = torch.arange(8, dtype=torch.int32)
    bits = (words.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [n, m, 8]
    return bits.reshape(words.shape[0], -1)


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = blocks[:, 2:34].contiguous().view(torch.int8)
    return q.float() * d


def _dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    high = _bits(blocks[:, 2:6])  # [n, 32]
    q = _low_high_nibbles(blocks[:, 6:22]) | (high << 4)
    return (q - 16).float() * d


def _q4_k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins ([n, 8] int32 each) of ``scales`` [n, 12]."""
    s = scales.to(torch.int32)
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    m = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    return sc, m


def _dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = _q4_k_scales_mins(blocks[:, 4:16])
    scale = (d * sc.float()).unsqueeze(-1)  # [n, 8, 1]
    minimum = (dmin * m.float()).unsqueeze(-1)  # [n, 8, 1]
    qs = blocks[:, 16:144].to(torch.int32).reshape(n, 4, 1, 32)
    q = ((qs >> torch.tensor([0, 4], dtype=torch.int32).view(1, 1, 2, 1)) & 0xF).reshape(n, 8, 32)
    return (scale * q.float() - minimum).reshape(n, 256)


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = blocks[:, 0:128].to(torch.int32).reshape(n, 2, 1, 64)
    qh = blocks[:, 128:192].to(torch.int32).reshape(n, 2, 1, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = _f16(blocks, 208)
    low = (ql >> torch.tensor([0, 4], dtype=torch.int32).view(1, 1, 2, 1)) & 0xF  # [n, 2, 2, 64]
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(1, 1, 4, 1)) & 3
    q = (low.reshape(n, 2, 4, 32) | (high << 4)) - 32  # [n, half, s, l]
    scale = (d * scales).unsqueeze(-1)  # [n, 16, 1]
    return (scale * q.reshape(n, 16, 16).float()).reshape(n, 256)


FORMATS: dict[GGMLType, BlockFormat] = {
    f.ggml_type: f
    for f in (
        BlockFormat(GGMLType.Q8_0, 32, 34, _dequantize_q8_0),
        BlockFormat(GGMLType.Q5_0, 32, 22, _dequantize_q5_0),
        BlockFormat(GGMLType.Q4_K, 256, 144, _dequantize_q4_k),
        BlockFormat(GGMLType.Q6_K, 256, 210, _dequantize_q6_k),
    )
}


def block_format(ggml_type: int) -> BlockFormat:
    """The format of GGUF type number ``ggml_type``; ``ValueError`` for a type not in
    :class:`GGMLType` (dequantize those at load instead)."""
    try:
        return FORMATS[GGMLType(ggml_type)]
    except ValueError:
        supported = ", ".join(t.name for t in GGMLType)
        raise ValueError(
            f"GGML type {ggml_type} is not one the kernels read (supported: {supported})"
        ) from None


def dequantize(
    blocks: torch.Tensor,  # [rows, in_features / block_size * bytes_per_block] uint8
    ggml_type: int,
    in_features: int,
) -> torch.Tensor:  # [rows, in_features] float32
    """The float32 matrix that quantized rows ``blocks`` stand for (module doc: the
    operations are the kernels' own)."""
    fmt = block_format(ggml_type)
    if in_features % fmt.block_size:
        raise ValueError(
            f"{fmt.ggml_type.name} rows hold multiples of {fmt.block_size} values, "
            f"not {in_features}"
        )
    per_row = in_features // fmt.block_size * fmt.bytes_per_block
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != per_row:
        raise ValueError(
            f"expected uint8 blocks [rows, {per_row}] for {in_features} {fmt.ggml_type.name} "
            f"values a row, got {blocks.dtype} {list(blocks.shape)}"
        )
    rows = blocks.shape[0]
    flat = blocks.contiguous().reshape(-1, fmt.bytes_per_block)
    return fmt.dequantize_blocks(flat).reshape(rows, in_features)
