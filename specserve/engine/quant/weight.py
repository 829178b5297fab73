"""A weight matrix kept as GGML quantized blocks (:mod:`specserve.engine.quant.formats`).

Layout: GGUF's own, unchanged. ``blocks`` is one contiguous ``torch.uint8`` tensor
``[out_features, bytes_per_row]``; row ``o`` of the weight is its ``in_features /
block_size`` blocks back to back, in order of the input index. GGUF stores a matrix
row-major with ``ne[0] = in_features``, so a tensor's data is this tensor as it lies in
the file. Dequantization, embeddings and tensor-parallel sharding read this layout; the
integer kernels read Q4_K, Q6_K and Q5_0 weights repacked 8 rows at a time, a copy that
:mod:`specserve.engine.ops` makes at the first product and keeps on the weight.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.engine.quant.formats import GGMLType, block_format, dequantize


@dataclass(frozen=True)
class QuantizedWeight:
    """The weight of a linear layer ``[out_features, in_features]`` as quantized blocks.

    ``blocks``: uint8 ``[out_features, bytes_per_row]``, contiguous, treated as read-only
    (it may share memory with a file mapping). Validated on construction.
    """

    ggml_type: GGMLType
    shape: tuple[int, int]  # (out_features, in_features)
    blocks: torch.Tensor  # [out_features, bytes_per_row] uint8

    def __post_init__(self) -> None:
        fmt = block_format(self.ggml_type)
        object.__setattr__(self, "ggml_type", fmt.ggml_type)
        out_features, in_features = self.shape
        if out_features <= 0 or in_features <= 0 or in_features % fmt.block_size:
            raise ValueError(
                f"a {fmt.ggml_type.name} weight needs out_features > 0 and in_features a "
                f"positive multiple of {fmt.block_size}, got shape {tuple(self.shape)}"
            )
        object.__setattr__(self, "shape", (int(out_features), int(in_features)))
        expected = [out_features, in_features // fmt.block_size * fmt.bytes_per_block]
        b = self.blocks
        if b.dtype != torch.uint8 or list(b.shape) != expected or not b.is_contiguous():
            raise ValueError(
                f"blocks of a {fmt.ggml_type.name} weight of shape {tuple(self.shape)} must be "
                f"contiguous uint8 {expected}, got {b.dtype} {list(b.shape)}"
                + ("" if b.is_contiguous() else " (not contiguous)")
            )

    @classmethod
    def from_gguf(
        cls,
        data: bytes | bytearray | memoryview | np.ndarray | torch.Tensor,
        ggml_type: int,
        ne: Sequence[int],
    ) -> QuantizedWeight:
        """The weight of a GGUF tensor: its raw bytes ``data`` (as stored; any shape,
        viewed without a copy where possible), its ``ggml_type`` number and its GGUF
        dimensions ``ne`` = ``(in_features, out_features)``.

        Raises ``ValueError`` for an unsupported type, a shape that is not a matrix of
        whole blocks, or a byte count that does not match.
        """
        if len(ne) != 2:
            raise ValueError(f"a quantized weight is a matrix; GGUF dimensions {list(ne)}")
        in_features, out_features = int(ne[0]), int(ne[1])
        fmt = block_format(ggml_type)
        if isinstance(data, torch.Tensor):
            raw = data.detach().reshape(-1)
            if raw.dtype != torch.uint8:
                raw = raw.contiguous().view(torch.uint8)
        else:
            array = (
                np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
            )
            array = array.reshape(-1).view(np.uint8)
            with warnings.catch_warnings():
                # A read-only mapping: the kernels never write to the blocks.
                warnings.filterwarnings("ignore", message=".*not writable.*")
                raw = torch.from_numpy(array)
        if in_features <= 0 or in_features % fmt.block_size:
            raise ValueError(
                f"{fmt.ggml_type.name} rows hold multiples of {fmt.block_size} values, "
                f"not {in_features}"
            )
        per_row = in_features // fmt.block_size * fmt.bytes_per_block
        if raw.numel() != out_features * per_row:
            raise ValueError(
                f"a {fmt.ggml_type.name} tensor with ne={list(ne)} holds "
                f"{out_features * per_row} bytes, got {raw.numel()}"
            )
        return cls(
            fmt.ggml_type, (out_features, in_features), raw.contiguous().view(out_features, per_row)
        )

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def bytes_per_row(self) -> int:
        return self.blocks.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks (what a product streams from memory)."""
        return self.blocks.numel()

    def dequantize(self) -> torch.Tensor:  # [out_features, in_features] float32
        """The float32 matrix these blocks stand for, bit for bit what the kernels use."""
        return dequantize(self.blocks, self.ggml_type, self.in_features)
