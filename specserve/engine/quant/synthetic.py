"""Random GGML blocks with realistic scales, for tests and benchmarks (no real model)."""

from __future__ import annotations

import numpy as np
import torch

from specserve.engine.quant import GGMLType, QuantizedWeight, block_format

# Byte offsets of each type's float16 scales within a block.
_F16_AT = {
    GGMLType.Q8_0: (0,),
    GGMLType.Q5_0: (0,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q6_K: (208,),
}


def random_blocks(
    ggml_type: GGMLType, n_blocks: int, seed: int, scales: tuple[float, float] = (1e-4, 3e-2)
) -> np.ndarray:
    """``[n_blocks, bytes_per_block]`` uint8: random quants, float16 scales log-uniform in
    ``scales`` (the size a real model has; either sign for the block scale), never inf or
    NaN."""
    fmt = block_format(ggml_type)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, fmt.bytes_per_block), dtype=np.uint8)
    for at in _F16_AT[ggml_type]:
        scale = np.exp(rng.uniform(np.log(scales[0]), np.log(scales[1]), size=n_blocks))
        if (at == 0 and ggml_type != GGMLType.Q4_K) or at == 208:
            scale *= rng.choice([-1.0, 1.0], size=n_blocks)
        blocks[:, at : at + 2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return blocks


def random_weight(
    ggml_type: GGMLType,
    out_features: int,
    in_features: int,
    seed: int,
    scales: tuple[float, float] = (1e-4, 3e-2),
) -> QuantizedWeight:
    """A weight ``[out_features, in_features]`` of random blocks (``random_blocks``)."""
    fmt = block_format(ggml_type)
    n = out_features * in_features // fmt.block_size
    blocks = random_blocks(ggml_type, n, seed, scales)
    return QuantizedWeight.from_gguf(
        torch.from_numpy(blocks), ggml_type, (in_features, out_features)
    )
