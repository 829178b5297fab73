"""Products of many rows (prefill) go tile by tile where torch multiplies them: bfloat16
weights (with the kernels and without) and quantized weights without the kernels (with
them, the integer kernels take every row count: test_kernels.py): bit for bit the float32
weight's product (which takes the same tiles), and never a whole float32 copy of the
weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.engine import cpu_kernels, ops, tiled_products
from specserve.engine.quant import GGMLType, QuantizedWeight
from specserve.engine.quant.synthetic import random_weight

# (type, out, in) whose out is not a multiple of the tile (a tail tile), K of several
# blocks; at [512, 1024] MKL's tiles do not give the bits of one whole-matrix GEMM here
# (40 and 150 rows), so a quantized path that skipped the tiling would fail.
SHAPES = [
    (GGMLType.Q8_0, 200, 320),
    (GGMLType.Q5_0, 200, 320),
    (GGMLType.Q4_K, 150, 512),
    (GGMLType.Q6_K, 150, 512),
    (GGMLType.Q4_K, 512, 1024),
]
MANY = [ops.MAX_KERNEL_ROWS + 1, 40, 150]


@pytest.fixture(params=[True, False], ids=["kernels", "torch"])
def kernels(request: pytest.FixtureRequest) -> bool:
    if request.param and cpu_kernels.kernels() is None:
        pytest.skip("the CPU kernels are not available here")
    return request.param


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of 48 weight rows of 512 values (64 of 320, 16 of 1024): several per weight."""
    monkeypatch.setattr(tiled_products, "TILE_FLOATS", 48 * 512)


def test_tile_rows() -> None:
    assert tiled_products.tile_rows(8960, 1536) == 160  # about 1 MiB of float32
    assert tiled_products.tile_rows(1536, 8960) == 16
    assert tiled_products.tile_rows(151936, 896) == 288
    assert tiled_products.tile_rows(100, 896) == 100  # one tile: the whole weight
    assert tiled_products.tile_rows(10**6, 10**7) == 16  # never fewer than 16 rows


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(("ggml_type", "out", "k"), SHAPES)
def test_a_prefill_of_quantized_weights_is_the_float32_weights_bits(
    ggml_type: GGMLType, out: int, k: int
) -> None:
    kernels = False
    w = random_weight(ggml_type, out, k, seed=out + k)
    wide = w.dequantize()
    bias = torch.randn(out, generator=torch.Generator().manual_seed(1))
    assert tiled_products.tile_rows(out, k) < out
    for rows in MANY:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        with ops.kernels_enabled(kernels):
            for b in (bias, None):
                got = ops.linear(x, w, b)
                assert torch.equal(got, ops.linear(x, wide, b)), f"{rows} rows, {b is None}"
                whole = F.linear(x, wide, b)  # to rounding: the order differs
                assert ((got - whole).norm() / whole.norm()).item() < 1e-5
            qkv = ops.linears(x, [w, wide, w], [bias, None, None])
            assert torch.equal(qkv[0], ops.linear(x, wide, bias))
            assert torch.equal(qkv[1], qkv[2])
            assert torch.equal(ops.gate_up_silu(x, w, w), ops.gate_up_silu(x, wide, wide))


@pytest.mark.usefixtures("small_tiles")
def test_a_prefill_of_bfloat16_weights_is_their_float32_copys_bits(kernels: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 512, generator=gen).bfloat16()
    bias = torch.randn(200, generator=gen)
    x = torch.randn(64, 512, generator=gen)
    with ops.kernels_enabled(kernels):
        assert torch.equal(ops.linear(x, w, bias), ops.linear(x, w.float(), bias))


@pytest.mark.usefixtures("small_tiles")
def test_a_prefill_never_widens_a_whole_quantized_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the kernels, past MAX_KERNEL_ROWS rows the product dequantizes tiles of at
    most ``tile_rows`` rows into one buffer; a whole-matrix dequantization fails this test."""
    kernels = False
    w = random_weight(GGMLType.Q4_K, 200, 512, seed=5)
    wide = w.dequantize()
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(6))
    want = ops.linear(x, wide)
    widened: list[int] = []
    real = tiled_products.dequantize

    def counted(blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
        widened.append(blocks.shape[0])
        return real(blocks, ggml_type, k)

    def whole(*_: object) -> torch.Tensor:
        raise AssertionError("a whole quantized matrix was dequantized")

    monkeypatch.setattr(tiled_products, "dequantize", counted)
    monkeypatch.setattr(QuantizedWeight, "dequantize", whole)
    monkeypatch.setattr(ops, "dequantized", whole)
    with ops.kernels_enabled(kernels):
        assert torch.equal(ops.linear(x, w), want)
        assert torch.equal(ops.gate_up_silu(x, w, w), ops.gate_up_silu(x, wide, wide))
    rows = tiled_products.tile_rows(200, 512)
    assert rows == 48
    assert widened == [48, 48, 48, 48, 8] * 3  # the reference dequantizer, once per tile


@pytest.mark.usefixtures("small_tiles")
def test_bfloat16_products_round_a_quantized_prefills_tiles() -> None:
    """Inside ``ops.bfloat16_products`` (a draft's prefill without the integer kernels)
    the tiles of a quantized weight multiply in bfloat16: close to the float32 product,
    not its bits; outside, the float32 bits again."""
    kernels = False
    w = random_weight(GGMLType.Q5_0, 200, 320, seed=8)
    bias = torch.randn(200, generator=torch.Generator().manual_seed(9))
    x = torch.randn(64, 320, generator=torch.Generator().manual_seed(10))
    with ops.kernels_enabled(kernels):
        want = ops.linear(x, w.dequantize(), bias)
        with ops.bfloat16_products():
            got = ops.linear(x, w, bias)
        assert torch.equal(ops.linear(x, w, bias), want)
    assert got.dtype == torch.float32 and not torch.equal(got, want)
    assert ((got - want).norm() / want.norm()).item() < 2e-2
