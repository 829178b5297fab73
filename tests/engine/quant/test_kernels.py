"""The CPU kernels on quantized weights: bit for bit the float32 kernel on the
dequantized matrix, for every block type, 1..32 rows and more, on each instruction set
this machine has; and the widening equals the reference dequantization."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from specserve.engine import cpu_kernels
from specserve.engine.quant import GGMLType, QuantizedWeight
from specserve.engine.quant.synthetic import random_weight

# The instruction sets whose code this CPU runs (an AVX-512 CPU runs the AVX2 build too).
_ISAS = {"AVX512": ["AVX512", "AVX2"], "AVX2": ["AVX2"]}.get(
    torch.backends.cpu.get_cpu_capability(), []
)


@pytest.fixture(scope="module", params=["AVX512", "AVX2"])
def lib(request: pytest.FixtureRequest) -> Iterator[SimpleNamespace]:
    """The kernels built for one instruction set; skipped (with the reason) where this
    machine cannot run or build them."""
    isa = request.param
    if isa not in _ISAS:
        pytest.skip(f"this CPU does not run {isa} code")
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja to build the kernels")
    try:
        name = cpu_kernels.compile_for(isa)
    except Exception as exc:  # a failed build is a skip with its reason, not an error
        pytest.skip(f"the {isa} kernels did not build: {exc}")
    ops = getattr(torch.ops, name)
    yield SimpleNamespace(
        linears=ops.linears.default,
        typed_linears=ops.typed_linears.default,
        gate_up_silu=ops.gate_up_silu.default,
        typed_gate_up_silu=ops.typed_gate_up_silu.default,
        dequantize=ops.dequantize.default,
    )


# (type, out, in): output rows that leave a tail past every blocking (37, 13), several
# K chunks of 256 values, and the smallest K.
SHAPES = [
    (GGMLType.Q8_0, 37, 96),
    (GGMLType.Q8_0, 13, 608),
    (GGMLType.Q5_0, 37, 96),
    (GGMLType.Q5_0, 13, 608),
    (GGMLType.Q4_K, 37, 256),
    (GGMLType.Q4_K, 13, 768),
    (GGMLType.Q6_K, 37, 256),
    (GGMLType.Q6_K, 13, 768),
]


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("ggml_type", "out", "k"), SHAPES)
def test_widening_equals_the_reference_dequantization(
    lib: SimpleNamespace, ggml_type: GGMLType, out: int, k: int
) -> None:
    w = random_weight(ggml_type, out, k, seed=out + k)
    got = lib.dequantize(w.blocks, int(ggml_type), k)
    want = w.dequantize()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # Bit for bit, the sign of zero included (a zero quant times a negative scale is -0.0;
    # torch.equal alone would take +0.0 for it).
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert (want.view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).any() or (
        ggml_type == GGMLType.Q4_K  # its scales are never negative
    )


@pytest.mark.parametrize(("ggml_type", "out", "k"), SHAPES)
def test_products_are_the_float32_kernels_bits_at_every_row_count(
    lib: SimpleNamespace, ggml_type: GGMLType, out: int, k: int
) -> None:
    w = random_weight(ggml_type, out, k, seed=2 * out + k)
    wide = w.dequantize()
    bias = torch.randn(out, generator=torch.Generator().manual_seed(9))
    x = _x(40, k, seed=k)
    singles = [
        lib.typed_linears(x[i : i + 1], [w.blocks], [int(ggml_type)], [bias])[0] for i in range(40)
    ]
    for rows in [*range(1, 33), 40]:
        got = lib.typed_linears(x[:rows], [w.blocks], [int(ggml_type)], [bias])[0]
        want = lib.linears(x[:rows], [wide], [bias])[0]
        assert torch.equal(got, want), f"{rows} rows"
        assert torch.equal(got, torch.cat(singles[:rows])), f"{rows} rows against one-row calls"
    assert got.abs().max() > 0


def test_mixed_weights_in_one_call_and_gate_up(lib: SimpleNamespace) -> None:
    """q/k/v of several types (and a float32 one) share x; gate and up of two types."""
    k = 512
    ws: list[QuantizedWeight | torch.Tensor] = [
        random_weight(GGMLType.Q4_K, 45, k, seed=1),
        random_weight(GGMLType.Q6_K, 9, k, seed=2),
        torch.randn(7, k, generator=torch.Generator().manual_seed(3)),
        random_weight(GGMLType.Q8_0, 16, k, seed=4),
        random_weight(GGMLType.Q5_0, 3, k, seed=5),
    ]
    tensors = [w.blocks if isinstance(w, QuantizedWeight) else w for w in ws]
    types = [int(w.ggml_type) if isinstance(w, QuantizedWeight) else 0 for w in ws]
    wide = [w.dequantize() if isinstance(w, QuantizedWeight) else w for w in ws]
    biases = [torch.randn(45), None, torch.randn(7), None, torch.randn(3)]
    gate, up = (
        random_weight(GGMLType.Q4_K, 29, k, seed=6),
        random_weight(GGMLType.Q6_K, 29, k, seed=7),
    )
    for rows in (1, 3, 5, 17):
        x = _x(rows, k, seed=rows)
        got = lib.typed_linears(x, tensors, types, biases)
        want = lib.linears(x, wide, biases)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        gu = lib.typed_gate_up_silu(
            x, gate.blocks, int(gate.ggml_type), up.blocks, int(up.ggml_type)
        )
        assert torch.equal(gu, lib.gate_up_silu(x, gate.dequantize(), up.dequantize()))


@pytest.mark.parametrize(
    ("blocks", "ggml_type", "k", "message"),
    [
        (torch.zeros(4, 34, dtype=torch.uint8), 8, 64, "uint8 blocks"),
        (torch.zeros(4, 18, dtype=torch.uint8), 2, 32, "not one the kernels read"),
        (torch.zeros(4, 144, dtype=torch.int8), 12, 256, "uint8 blocks"),
    ],
)
def test_bad_blocks_are_refused(
    lib: SimpleNamespace, blocks: torch.Tensor, ggml_type: int, k: int, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        lib.typed_linears(torch.zeros(1, k), [blocks], [ggml_type], [None])
