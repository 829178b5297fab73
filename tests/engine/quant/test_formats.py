"""formats / weight: the vectorised dequantization against a per-block one written from
the format descriptions (llama.cpp's ``dequantize_row_*``), and the weight container."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.engine.quant import FORMATS, GGMLType, QuantizedWeight, dequantize
from specserve.engine.quant.synthetic import random_blocks

# The float type the spec computes in: float32 as the formats say, float64 to show
# that no product rounds.
Real = type[np.floating]


def _f16(block: np.ndarray, at: int, real: Real) -> np.floating:
    return real(block[at : at + 2].view(np.float16)[0])


def _spec_q8_0(b: np.ndarray, real: Real = np.float32) -> list[np.floating]:
    d = _f16(b, 0, real)
    return [real(int(q)) * d for q in b[2:34].view(np.int8)]


def _spec_q5_0(b: np.ndarray, real: Real = np.float32) -> list[np.floating]:
    d = _f16(b, 0, real)
    qh = int.from_bytes(b[2:6].tobytes(), "little")
    qs = b[6:22]
    out = [real(0)] * 32
    for j in range(16):
        x0 = (int(qs[j]) & 0xF) | (((qh >> j) & 1) << 4)
        x1 = (int(qs[j]) >> 4) | (((qh >> (j + 16)) & 1) << 4)
        out[j] = real(x0 - 16) * d
        out[j + 16] = real(x1 - 16) * d
    return out


def _scale_min_k4(j: int, s: np.ndarray) -> tuple[int, int]:
    s = [int(v) for v in s]
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def _spec_q4_k(b: np.ndarray, real: Real = np.float32) -> list[np.floating]:
    d, dmin = _f16(b, 0, real), _f16(b, 2, real)
    scales, qs = b[4:16], b[16:144]
    out: list[np.floating] = []
    for pair in range(4):
        q = qs[32 * pair : 32 * pair + 32]
        for nibble in range(2):
            sc, m = _scale_min_k4(2 * pair + nibble, scales)
            d1, m1 = d * real(sc), dmin * real(m)
            out += [d1 * real((int(v) >> (4 * nibble)) & 0xF) - m1 for v in q]
    return out


def _spec_q6_k(b: np.ndarray, real: Real = np.float32) -> list[np.floating]:
    ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), _f16(b, 208, real)
    out = [real(0)] * 256
    for half in range(2):
        for j in range(32):
            h = int(qh[32 * half + j])
            lo, hi = int(ql[64 * half + j]), int(ql[64 * half + j + 32])
            qs = (
                (lo & 0xF) | ((h & 3) << 4),
                (hi & 0xF) | (((h >> 2) & 3) << 4),
                (lo >> 4) | (((h >> 4) & 3) << 4),
                (hi >> 4) | (((h >> 6) & 3) << 4),
            )
            for s, q in enumerate(qs):
                i = 128 * half + 32 * s + j
                out[i] = d * real(int(sc[i // 16])) * real(q - 32)
    return out


SPEC = {
    GGMLType.Q8_0: _spec_q8_0,
    GGMLType.Q5_0: _spec_q5_0,
    GGMLType.Q4_K: _spec_q4_k,
    GGMLType.Q6_K: _spec_q6_k,
}


@pytest.mark.parametrize("ggml_type", list(GGMLType))
def test_dequantize_equals_the_per_block_spec(ggml_type: GGMLType) -> None:
    fmt = FORMATS[ggml_type]
    blocks = random_blocks(ggml_type, 24, seed=int(ggml_type))
    expected = np.array([v for b in blocks for v in SPEC[ggml_type](b)], dtype=np.float32)
    got = dequantize(torch.from_numpy(blocks).reshape(6, -1), ggml_type, 4 * fmt.block_size)
    assert got.dtype == torch.float32 and got.shape == (6, 4 * fmt.block_size)
    assert torch.equal(got.reshape(-1), torch.from_numpy(expected))
    assert got.abs().max() > 0


@pytest.mark.parametrize("ggml_type", list(GGMLType))
def test_dequantized_products_are_exact_in_float32(ggml_type: GGMLType) -> None:
    """The spec's arithmetic in float64, rounded once at the end, gives the same bits:
    no product rounds, so neither their order nor a fused multiply-add matters."""
    blocks = random_blocks(ggml_type, 8, seed=200 + int(ggml_type))
    spec = SPEC[ggml_type]
    narrow = np.array([v for b in blocks for v in spec(b)], dtype=np.float32)
    wide = np.array([v for b in blocks for v in spec(b, np.float64)], dtype=np.float64)
    assert np.array_equal(wide.astype(np.float32), narrow)


@pytest.mark.parametrize("ggml_type", list(GGMLType))
def test_dequantize_equals_the_gguf_package(ggml_type: GGMLType) -> None:
    quants = pytest.importorskip("gguf.quants")
    blocks = random_blocks(ggml_type, 16, seed=100 + int(ggml_type))
    fmt = FORMATS[ggml_type]
    theirs = quants.dequantize(blocks.reshape(-1), int(ggml_type)).astype(np.float32)
    ours = dequantize(torch.from_numpy(blocks).reshape(1, -1), ggml_type, 16 * fmt.block_size)
    assert torch.equal(ours.reshape(-1), torch.from_numpy(theirs.reshape(-1)))


def test_weight_from_gguf_bytes_views_rows_of_blocks() -> None:
    blocks = random_blocks(GGMLType.Q4_K, 3 * 2, seed=7)
    w = QuantizedWeight.from_gguf(blocks.tobytes(), 12, (512, 3))
    assert w.ggml_type is GGMLType.Q4_K
    assert w.shape == (3, 512) and w.out_features == 3 and w.in_features == 512
    assert w.bytes_per_row == 288 and w.nbytes == 3 * 288
    assert torch.equal(w.blocks, torch.from_numpy(blocks).reshape(3, 288))
    per_row = dequantize(torch.from_numpy(blocks).reshape(6, 144), GGMLType.Q4_K, 256)
    assert torch.equal(w.dequantize(), per_row.reshape(3, 512))


def test_weight_from_a_read_only_array_shares_its_memory() -> None:
    blocks = random_blocks(GGMLType.Q8_0, 8, seed=3)
    blocks.setflags(write=False)
    w = QuantizedWeight.from_gguf(blocks, GGMLType.Q8_0, (64, 4))
    assert w.blocks.data_ptr() == blocks.ctypes.data


@pytest.mark.parametrize(
    ("ggml_type", "ne", "nbytes", "message"),
    [
        (2, (32, 1), 18, "not one the kernels read"),
        (GGMLType.Q4_K, (128, 2), 144, "multiples of 256"),
        (GGMLType.Q8_0, (64, 2), 34 * 4 - 1, "holds 136 bytes"),
        (GGMLType.Q8_0, (64, 2, 1), 136, "matrix"),
    ],
)
def test_weight_from_gguf_refuses_bad_input(
    ggml_type: int, ne: tuple[int, ...], nbytes: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        QuantizedWeight.from_gguf(bytes(nbytes), ggml_type, ne)


def test_weight_refuses_blocks_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match="contiguous uint8"):
        QuantizedWeight(GGMLType.Q8_0, (2, 64), torch.zeros(2, 67, dtype=torch.uint8))
