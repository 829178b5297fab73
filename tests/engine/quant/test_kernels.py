"""The CPU kernels on quantized weights: the integer products equal the exact product
of the weight and the 8-bit activations up to float32 rounding, give every row the same
bits at every row count and thread count (batch invariance), and the widening equals the
reference dequantization; on each instruction set this machine runs."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from specserve.engine import cpu_kernels, ops
from specserve.engine.quant import GGMLType, QuantizedWeight
from specserve.engine.quant.activations import quantize_rows, reference_product
from specserve.engine.quant.synthetic import random_weight
from tests.support.isa import runnable_builds

# The builds whose code this CPU runs (an AVX-512 CPU runs the AVX2 build too).
_RUNS = runnable_builds()


def _compiler() -> bool:
    return shutil.which("c++") is not None and shutil.which("ninja") is not None


@pytest.fixture(scope="module", params=list(cpu_kernels.CAPABILITIES))
def lib(request: pytest.FixtureRequest) -> Iterator[SimpleNamespace]:
    """The kernels built for one instruction set; skipped (with the reason) where this
    machine cannot run or build them."""
    isa = request.param
    if isa not in _RUNS:
        pytest.skip(f"this CPU does not run {isa} code")
    if not _compiler():
        pytest.skip("no C++ compiler or ninja to build the kernels")
    try:
        name = cpu_kernels.compile_for(isa)
    except Exception as exc:  # a failed build is a skip with its reason, not an error
        pytest.skip(f"the {isa} kernels did not build: {exc}")
    ops_ = getattr(torch.ops, name)
    yield SimpleNamespace(
        isa=isa,
        q8_linears=ops_.q8_linears.default,
        q8_gate_up_silu=ops_.q8_gate_up_silu.default,
        dequantize=ops_.dequantize.default,
        repack={
            12: ops_.repack_q4_k_x8.default,
            14: ops_.repack_q6_k_x8.default,
            6: ops_.repack_q5_0_x8.default,
        },
    )


def _operand(lib: SimpleNamespace, w: QuantizedWeight, form: str) -> tuple[torch.Tensor, int]:
    """``w`` as the kernels take it: the file's blocks, or repacked 8 rows at a time (Q4_K,
    Q6_K and Q5_0; the engine's form for them, rows padded to a multiple of 8)."""
    if form == "x8":
        return lib.repack[int(w.ggml_type)](w.blocks, w.in_features), (1 << 16) | int(w.ggml_type)
    return w.blocks, int(w.ggml_type)


def _forms(shapes: list[tuple[GGMLType, int, int]]) -> list[tuple[GGMLType, int, int, str]]:
    """Each shape in the file's layout, and repacked where the type has that form."""
    return [(*sh, "blocks") for sh in shapes] + [
        (*sh, "x8") for sh in shapes if sh[0] in (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q5_0)
    ]


# (type, out, in): output rows that leave a tail past every blocking (37 = 2 x 16 + 5),
# several blocks per row, and the smallest K.
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


@pytest.mark.parametrize(("ggml_type", "out", "k", "form"), _forms(SHAPES))
def test_products_are_the_exact_product_with_8_bit_activations(
    lib: SimpleNamespace, ggml_type: GGMLType, out: int, k: int, form: str
) -> None:
    """Against the float64 product of the dequantized weight and the 8-bit activations:
    within float32 rounding of the sums (a wrong index or scale would be off by O(1))."""
    w = random_weight(ggml_type, out, k, seed=3 * out + k)
    t, code = _operand(lib, w, form)
    bias = torch.randn(t.shape[0], generator=torch.Generator().manual_seed(9))
    bias[out:] = 0.0
    x = _x(11, k, seed=k)
    x[3] = 0.0  # an all-zero row: scale 0, no division by zero
    x[4, : k // 2] *= 1e-3  # blocks of very different magnitudes in one row
    full = lib.q8_linears(x, [t], [code], [bias])[0]
    got = full[:, :out]
    assert torch.equal(full[:, out:], torch.zeros_like(full[:, out:]))  # padding rows: 0
    exact, magnitude = reference_product(x, w.blocks, ggml_type)
    err = (got.double() - bias[:out].double() - exact).abs()
    assert (err <= 2e-6 * magnitude + 1e-6).all(), float((err / (magnitude + 1e-30)).max())
    assert got.abs().max() > 0 and torch.equal(got[3], bias[:out])


@pytest.mark.parametrize(("ggml_type", "out", "k", "form"), _forms(SHAPES))
def test_every_row_has_its_one_row_bits_at_every_row_count(
    lib: SimpleNamespace, ggml_type: GGMLType, out: int, k: int, form: str
) -> None:
    """Batch invariance: 1..64 rows (every register tile and its tail) and a prefill's
    100, each row bit for bit its own one-row product; and the thread count changes
    nothing."""
    w = random_weight(ggml_type, out, k, seed=2 * out + k)
    t, code = _operand(lib, w, form)
    out = t.shape[0]
    bias = torch.randn(out, generator=torch.Generator().manual_seed(9))
    x = _x(100, k, seed=k)
    args = ([t], [code], [bias])
    singles = torch.cat([lib.q8_linears(x[i : i + 1], *args)[0] for i in range(100)])
    assert lib.q8_linears(x[:0], *args)[0].shape == (0, out)  # a forward with no logits
    for rows in [*range(1, 65), 100]:
        got = lib.q8_linears(x[:rows], *args)[0]
        assert torch.equal(got, singles[:rows]), f"{rows} rows against one-row calls"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lib.q8_linears(x, *args)[0], singles)
    finally:
        torch.set_num_threads(threads)


def test_mixed_types_in_one_call_and_gate_up(lib: SimpleNamespace) -> None:
    """q/k/v of several types share x (each weight's columns equal its own call); gate
    and up of two types equal silu(gate) * up of the same products."""
    k = 512
    ws = [
        random_weight(GGMLType.Q4_K, 45, k, seed=1),
        random_weight(GGMLType.Q6_K, 9, k, seed=2),
        random_weight(GGMLType.Q8_0, 16, k, seed=4),
        random_weight(GGMLType.Q5_0, 3, k, seed=5),
    ]
    tensors, types = [w.blocks for w in ws], [int(w.ggml_type) for w in ws]
    biases = [torch.randn(45), None, None, torch.randn(3)]
    gate, up = (
        random_weight(GGMLType.Q4_K, 29, k, seed=6),
        random_weight(GGMLType.Q6_K, 29, k, seed=7),
    )
    for rows in (1, 3, 9, 17, 40):
        x = _x(rows, k, seed=rows)
        got = lib.q8_linears(x, tensors, types, biases)
        for g, t, typ, b in zip(got, tensors, types, biases, strict=True):
            assert torch.equal(g, lib.q8_linears(x, [t], [typ], [b])[0])
        gu = lib.q8_gate_up_silu(x, gate.blocks, int(gate.ggml_type), up.blocks, int(up.ggml_type))
        g = lib.q8_linears(x, [gate.blocks], [int(gate.ggml_type)], [None])[0]
        u = lib.q8_linears(x, [up.blocks], [int(up.ggml_type)], [None])[0]
        assert torch.allclose(gu, F.silu(g) * u, rtol=1e-5, atol=1e-6)
        assert torch.equal(
            gu,
            torch.cat(
                [
                    lib.q8_gate_up_silu(x[i : i + 1], gate.blocks, 12, up.blocks, 14)
                    for i in range(rows)
                ]
            ),
        )


def test_the_activation_blocks_are_the_references() -> None:
    """quantize_rows (the reference) rounds half to even and keeps [-127, 127]."""
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0] + [0.0] * 27])
    q, d = quantize_rows(x, 32)
    assert q[0, :5].tolist() == [127, 0, 2, -2, -127] and d.item() == 1.0


def test_ops_route_quantized_weights_to_the_integer_kernels() -> None:
    """ops.linears: quantized weights at any row count (past MAX_KERNEL_ROWS too), a
    float32 weight beside them in its own call; the kernels off: the dequantized
    reference."""
    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU kernels are not available here")
    k = 256
    q = random_weight(GGMLType.Q4_K, 20, k, seed=1)
    f = torch.randn(7, k, generator=torch.Generator().manual_seed(3))
    x = _x(ops.MAX_KERNEL_ROWS + 9, k, seed=2)
    got_q, got_f = ops.linears(x, [q, f], [None, None])
    kern = cpu_kernels.kernels()
    assert kern is not None
    packed = kern.repack_q4_k_x8(q.blocks, k)  # the engine's form of a Q4_K weight
    assert torch.equal(got_q, kern.q8_linears(x, [packed], [(1 << 16) | 12], [None])[0][:, :20])
    up = random_weight(GGMLType.Q6_K, 20, k, seed=4)  # 20 rows: padded to 24 when repacked
    gu = ops.gate_up_silu(x, q, up)
    assert gu.shape == (x.shape[0], 20)
    assert torch.allclose(gu, F.silu(got_q) * ops.linear(x, up), rtol=1e-5, atol=1e-6)
    assert torch.allclose(got_f, x @ f.T, rtol=1e-5, atol=1e-5)
    with ops.kernels_enabled(False):
        ref = ops.linear(x, q)
    assert torch.allclose(ref, x @ q.dequantize().T, rtol=1e-5, atol=1e-5)
    assert not torch.equal(ref, got_q)  # the 8-bit activations: close, not equal
    assert torch.allclose(ref, got_q, rtol=0.05, atol=0.05 * float(ref.abs().mean()))


@pytest.mark.parametrize(
    ("blocks", "ggml_type", "k", "message"),
    [
        (torch.zeros(4, 34, dtype=torch.uint8), 8, 64, "uint8 blocks"),
        (torch.zeros(4, 18, dtype=torch.uint8), 2, 32, "not one the kernels read"),
        (torch.zeros(4, 144, dtype=torch.int8), 12, 256, "uint8 blocks"),
        (torch.zeros(4, 144, dtype=torch.uint8), 0, 256, "quantized weights only"),
    ],
)
def test_bad_blocks_are_refused(
    lib: SimpleNamespace, blocks: torch.Tensor, ggml_type: int, k: int, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        lib.q8_linears(torch.zeros(1, k), [blocks], [ggml_type], [None])
