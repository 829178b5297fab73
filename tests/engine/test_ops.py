"""ops: the few-row CPU kernels against torch, and their fallbacks."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from specserve.engine import cpu_kernels, ops
from specserve.engine.hugepages import huge_pages_available, move_to_huge_pages
from specserve.engine.model import SeqInput
from tests.support.hf_tiny import tiny_random_model

# Where the kernels can be built they must be: a failed build would otherwise only show
# up as a silent fall back to torch (test_kernels_build).
CAN_BUILD = (
    torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2")
    and shutil.which("c++") is not None
    and shutil.which("ninja") is not None
)
needs_kernel = pytest.mark.skipif(
    not CAN_BUILD, reason="no AVX-512 or AVX2 CPU, C++ compiler or ninja"
)


@needs_kernel
def test_kernels_build() -> None:
    assert cpu_kernels.kernels() is not None


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().clamp_min(1e-30)
    return float((y.double() - ref).abs().max() / scale)


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 6, 7, 9, 12, 16, 32])
@pytest.mark.parametrize(("out", "k"), [(64, 64), (13, 100), (255, 1537), (9, 7), (6, 520)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_float64(rows: int, out: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(out, k, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    y = ops.linear(x, w, b)
    assert y.shape == (rows, out) and y.dtype == torch.float32
    if rows:
        assert _rel_err(y, _reference(x, w, b)) <= 1e-5
        assert _rel_err(y, F.linear(x, w, b).double()) <= 1e-5


@needs_kernel
def test_rows_do_not_change_each_others_bits() -> None:
    """A row's result is the same bits whatever rows come with it (verify == decode)."""
    gen = torch.Generator().manual_seed(0)
    k = 600  # several K chunks and a masked tail: 600 = 2 * 256 + 5 * 16 + 8
    x = torch.randn(ops.MAX_KERNEL_ROWS, k, generator=gen)
    ws = [torch.randn(n, k, generator=gen) for n in (37, 8, 64)]
    bs = [torch.randn(37, generator=gen), None, torch.randn(64, generator=gen)]
    singles = [ops.linears(x[i : i + 1], ws, bs) for i in range(x.shape[0])]
    gate_up = [ops.gate_up_silu(x[i : i + 1], ws[2], ws[2].flip(0)) for i in range(x.shape[0])]
    for rows in range(1, ops.MAX_KERNEL_ROWS + 1):
        many = ops.linears(x[:rows], ws, bs)
        many_gate_up = ops.gate_up_silu(x[:rows], ws[2], ws[2].flip(0))
        for i in range(rows):
            for got, alone in zip(many, singles[i], strict=True):
                assert torch.equal(got[i : i + 1], alone)
            assert torch.equal(many_gate_up[i : i + 1], gate_up[i])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 32])
def test_bfloat16_weights_give_the_bits_of_their_float32_copies(rows: int) -> None:
    """bfloat16 weights under float32 x: widened exactly as they load, so the product is
    bit for bit the float32 kernel's on ``w.float()`` (row invariance carries over)."""
    gen = torch.Generator().manual_seed(rows)
    k = 600  # K chunks and a masked tail (the bfloat16 tail load is its own code)
    x = torch.randn(rows, k, generator=gen)
    ws = [torch.randn(n, k, generator=gen).bfloat16() for n in (37, 8, 64)]
    bs = [torch.randn(37, generator=gen), None, torch.randn(64, generator=gen)]
    wide = [w.float() for w in ws]
    mixed = [ws[0], wide[1], ws[2]]  # each weight its own dtype in one call
    for got in (ops.linears(x, ws, bs), ops.linears(x, mixed, bs)):
        for y, want in zip(got, ops.linears(x, wide, bs), strict=True):
            assert y.dtype == torch.float32 and torch.equal(y, want)
    gate, up = ws[2], ws[2].flip(0)
    y = ops.gate_up_silu(x, gate, up)
    assert torch.equal(y, ops.gate_up_silu(x, gate.float(), up.float()))
    assert torch.equal(ops.gate_up_silu(x[-1:], gate, up), y[-1:])
    # gate and up of two dtypes: not the kernel's case, torch computes it
    torch_gate_up = F.silu(F.linear(x, gate.float())) * F.linear(x, up.float())
    assert torch.equal(ops.gate_up_silu(x, gate, up.float()), torch_gate_up)
    assert _rel_err(ops.linear(x, ws[0], bs[0]), _reference(x, wide[0], bs[0])) <= 1e-5
    with ops.kernels_enabled(False):  # torch widens the weight first: float32 arithmetic
        assert torch.equal(ops.linear(x, ws[0], bs[0]), F.linear(x, wide[0], bs[0]))
        assert torch.equal(
            ops.gate_up_silu(x, gate, up), F.silu(x @ gate.float().T) * (x @ up.float().T)
        )


def test_bfloat16_products_round_only_a_prefills_products() -> None:
    """Inside ``bfloat16_products`` a many-row product of a bfloat16 weight multiplies in
    bfloat16 (close to the float32 product, not its bits); a product of few rows, or of a
    float32 weight, is unchanged, and outside the block nothing changes."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, 300, generator=gen).bfloat16()
    b = torch.randn(48, generator=gen)
    many = torch.randn(ops.MAX_KERNEL_ROWS + 8, 300, generator=gen)
    wide = F.linear(many, w.float(), b)
    with ops.bfloat16_products():
        got = ops.linear(many, w, b)
        few = ops.linear(many[:3], w, b)
        gate_up = ops.gate_up_silu(many, w, w.flip(0))
        wide_w = ops.linear(many, w.float(), b)
    assert got.dtype == torch.float32
    assert torch.equal(got, F.linear(many.bfloat16(), w).float() + b)
    assert not torch.equal(got, wide)
    assert _rel_err(got, wide) < 2e-2
    assert _rel_err(gate_up, ops.gate_up_silu(many, w.float(), w.flip(0).float())) < 5e-2
    if cpu_kernels.kernels() is not None:  # few rows: the kernels', as outside the block
        assert torch.equal(few, ops.linear(many[:3], w, b))
    assert torch.equal(wide_w, F.linear(many, w.float(), b))  # a float32 weight: float32
    assert torch.equal(ops.linear(many, w, b), wide)  # outside: the weight is widened


@needs_kernel
def test_thread_count_does_not_change_bits() -> None:
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 300, generator=gen), torch.randn(999, 300, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.linear(x, w)
        torch.set_num_threads(max(2, before))
        two = ops.linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_linears_equal_separate_linears() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 96, generator=gen)
    ws = [torch.randn(n, 96, generator=gen) for n in (96, 32, 32)]
    bs = [torch.randn(n, generator=gen) for n in (96, 32, 32)]
    fused = ops.linears(x, ws, bs)
    for y, w, b in zip(fused, ws, bs, strict=True):
        assert torch.equal(y, ops.linear(x, w, b))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 5, 7, 13])
@pytest.mark.parametrize("inter", [64, 30])
def test_gate_up_silu_matches_torch(rows: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(rows + inter)
    x = torch.randn(rows, 40, generator=gen)
    gate, up = torch.randn(inter, 40, generator=gen), torch.randn(inter, 40, generator=gen)
    ref = F.silu(_reference(x, gate, None)) * _reference(x, up, None)
    y = ops.gate_up_silu(x, gate, up)
    assert y.shape == (rows, inter)
    assert _rel_err(y, ref) <= 1e-5
    # the row-count invariance of linears carries over
    assert torch.equal(ops.gate_up_silu(x[-1:], gate, up), y[-1:])


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1536), (5, 64), (3, 2, 40), (0, 16), (200, 33)])
def test_rms_norm_matches_torch(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(len(shape))
    x = 3 * torch.randn(shape, generator=gen)
    w = torch.randn(shape[-1], generator=gen)
    ref = w.double() * (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6))
    y = ops.rms_norm(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == torch.float32
    if x.numel():
        assert _rel_err(y, ref) <= 1e-5
    with ops.kernels_enabled(False):
        assert _rel_err(ops.rms_norm(x, w, 1e-6), ref) <= 1e-5 if x.numel() else True


@needs_kernel
def test_strided_inputs() -> None:
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(6, 2 * 80, generator=gen)
    x = big[:, :80]  # row stride 160
    w = torch.randn(80, 40, generator=gen).t()  # column stride 40: copied to unit stride
    assert _rel_err(ops.linear(x, w), _reference(x, w, None)) <= 1e-5
    assert _rel_err(ops.linear(big[:, ::2], w), _reference(big[:, ::2], w, None)) <= 1e-5


@pytest.mark.parametrize(
    "case",
    ["many_rows", "bfloat16", "grad", "disabled", "three_dims"],
)
def test_fallbacks_are_torch(case: str) -> None:
    """Everything the kernel does not take goes to F.linear unchanged."""
    gen = torch.Generator().manual_seed(4)
    rows = ops.MAX_KERNEL_ROWS + 1 if case == "many_rows" else 3
    x = torch.randn(rows, 48, generator=gen)
    w = torch.randn(24, 48, generator=gen)
    b = torch.randn(24, generator=gen)
    if case == "bfloat16":
        x, w, b = x.bfloat16(), w.bfloat16(), b.bfloat16()
    if case == "three_dims":
        x = x.view(1, rows, 48)
    if case == "grad":
        w.requires_grad_(True)
        y = ops.linear(x, w, b)
        y.sum().backward()
        assert w.grad is not None
        assert torch.equal(y.detach(), F.linear(x, w.detach(), b))
        return
    if case == "disabled":
        with ops.kernels_enabled(False):
            y = ops.linear(x, w, b)
            ys = ops.linears(x, [w, w], [b, None])
        assert torch.equal(ys[1], F.linear(x, w))
    else:
        y = ops.linear(x, w, b)
    assert torch.equal(y, F.linear(x, w, b))


@needs_kernel
def test_model_logits_same_with_and_without_kernel() -> None:
    model, _ = tiny_random_model("qwen2", seed=5)
    prompt = list(range(3, 40))

    def logits(kernels: bool) -> torch.Tensor:
        kv = model.new_kv_pool(budget_bytes=1 << 22)
        kv.reserve({"s": len(prompt) + 5})
        with ops.kernels_enabled(kernels):
            model([SeqInput("s", prompt)], kv)
            return model([SeqInput("s", [7, 8, 9, 10, 11], num_logits=5)], kv)

    on, off = logits(True), logits(False)
    assert (on - off).abs().max() <= 1e-4 * off.abs().max()


@needs_kernel
def test_verify_logits_match_decode_logits() -> None:
    """k + 1 tokens in one forward give the logits of k + 1 one-token forwards."""
    model, _ = tiny_random_model("qwen2", seed=6)
    prompt, new = list(range(5, 30)), [40, 41, 42, 43, 44]
    kv = model.new_kv_pool(budget_bytes=1 << 22)
    kv.reserve({"a": 40, "b": 40})
    model([SeqInput("a", prompt)], kv)
    model([SeqInput("b", prompt)], kv)
    verify = model([SeqInput("a", new, num_logits=len(new))], kv)
    decode = torch.cat([model([SeqInput("b", [t])], kv) for t in new])
    assert torch.allclose(verify, decode, rtol=0, atol=1e-5 * float(decode.abs().max()))
    assert torch.equal(verify.argmax(-1), decode.argmax(-1))


@needs_kernel
@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("qwen2", {}),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 0}),
        ("smollm2", {"num_key_value_heads": 4}),
    ],
)
def test_fused_attention_matches_torch_path(family: str, overrides: dict[str, object]) -> None:
    """Ragged batch of sessions (decode + verify) with the kernels on and off."""
    model, cfg = tiny_random_model(family, seed=7, **overrides)
    assert (cfg.sliding_window is not None) == ("sliding_window" in overrides)
    prompts = {"a": list(range(3, 20)), "b": list(range(50, 59)), "c": [5, 6]}
    steps = [
        {"a": [1, 2, 3, 4, 5], "b": [9], "c": [7, 8, 9]},  # verify-sized and decode mixed
        {"a": [6], "b": [10, 11], "c": [12]},
    ]

    def run(kernels: bool) -> list[torch.Tensor]:
        kv = model.new_kv_pool(budget_bytes=1 << 22)
        kv.reserve({s: 40 for s in prompts})
        outs = []
        with ops.kernels_enabled(kernels):
            model([SeqInput(s, p) for s, p in prompts.items()], kv)
            for step in steps:
                seqs = [SeqInput(s, t, num_logits=len(t)) for s, t in step.items()]
                outs.append(model(seqs, kv))
        return outs

    for on, off in zip(run(True), run(False), strict=True):
        assert (on - off).abs().max() <= 1e-4 * off.abs().max()


@needs_kernel
@pytest.mark.parametrize("context", [203, 517])
def test_fused_attention_long_context_matches_torch_and_is_batch_invariant(context: int) -> None:
    """Past a few hundred cached tokens (key groups of 8 with a short last one, value rows
    in several passes): a 5-token verify through the kernels is within float32 rounding
    of the torch path, and each of its rows has the bits of that token's one-token step."""
    model, _ = tiny_random_model("qwen2", seed=11)
    prompt, new = [3 + i % 200 for i in range(context)], [40, 41, 42, 43, 44]

    def run(kernels: bool, one_by_one: bool) -> torch.Tensor:
        kv = model.new_kv_pool(budget_bytes=1 << 23)
        kv.reserve({"s": context + len(new)})
        with ops.kernels_enabled(kernels):
            model([SeqInput("s", prompt)], kv)
            if one_by_one:
                return torch.cat([model([SeqInput("s", [t])], kv) for t in new])
            return model([SeqInput("s", new, num_logits=len(new))], kv)

    verify, steps, torch_path = run(True, False), run(True, True), run(False, False)
    assert torch.equal(verify, steps)
    assert (verify - torch_path).abs().max() <= 1e-4 * torch_path.abs().max()


@needs_kernel
def test_fused_attention_is_used_for_few_tokens_only() -> None:
    t, h, kh, d = 3, 4, 2, 16
    q, k, v = torch.randn(t, h, d), torch.randn(t, kh, d), torch.randn(t, kh, d)
    cache_k, cache_v = torch.zeros(32, kh, d), torch.zeros(32, kh, d)
    args = (torch.arange(t), torch.ones(d // 2), 1.0, cache_k, cache_v, torch.arange(t))
    tail = (torch.arange(t).view(1, t), torch.zeros(t, dtype=torch.long), None)
    assert ops.rope_cache_attention(q, k, v, *args, *tail) is not None
    assert torch.equal(cache_v[:t], v)  # V lands in the cache as is
    with ops.kernels_enabled(False):
        assert ops.rope_cache_attention(q, k, v, *args, *tail) is None
    many = ops.MAX_KERNEL_ROWS + 1
    big = torch.randn(many, h, d)
    assert ops.rope_cache_attention(big, *([torch.randn(many, kh, d)] * 2), *args, *tail) is None
    odd = torch.randn(t, h, 12)  # the kernel takes head sizes that are multiples of 8
    assert ops.rope_cache_attention(odd, odd[:, :kh], odd[:, :kh], *args, *tail) is None


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages here")
def test_move_to_huge_pages_keeps_weights_and_ties() -> None:
    model, _ = tiny_random_model("smollm2", seed=8)  # tied embeddings
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kv = model.new_kv_pool(budget_bytes=1 << 22)
    kv.reserve({"s": 12})
    want = model([SeqInput("s", list(range(1, 12)))], kv)
    size = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    assert move_to_huge_pages(model, min_bytes=0) >= size
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
        assert value.data_ptr() % 64 == 0
    kv.truncate("s", 0)
    kv.reserve({"s": 12})
    assert torch.equal(model([SeqInput("s", list(range(1, 12)))], kv), want)


@needs_kernel
def test_fused_attention_soft_cap_matches_torch_and_is_batch_invariant() -> None:
    """With a score soft-cap (Gemma 2) the kernel is within float32 rounding of the torch
    path's explicit capped attention (its vectorized tanh against torch's), the cap
    changes the output, and each of 5 tokens sharing a call has the bits of its own
    one-token call. RoPE is the identity here (inverse frequencies 0), so the reference
    reads the cache as written."""
    from specserve.engine.attention import capped_attention

    gen = torch.Generator().manual_seed(3)
    t, h, kh, d, past, cap = 5, 4, 2, 16, 37, 5.0
    length = past + t
    q = 3 * torch.randn(t, h, d, generator=gen)  # scores ~ N(0, 9^2): most pass the cap
    k, v = 3 * torch.randn(t, kh, d, generator=gen), torch.randn(t, kh, d, generator=gen)
    cache_k, cache_v = torch.zeros(length, kh, d), torch.zeros(length, kh, d)
    cache_k[:past] = 3 * torch.randn(past, kh, d, generator=gen)
    cache_v[:past] = torch.randn(past, kh, d, generator=gen)
    positions = torch.arange(past, length)
    read = torch.arange(length).view(1, length)

    def call(rows: slice, kc: torch.Tensor, vc: torch.Tensor, sc: float | None) -> torch.Tensor:
        n = rows.stop - rows.start
        out = ops.rope_cache_attention(
            q[rows], k[rows], v[rows], positions[rows], torch.zeros(d // 2), 1.0, kc, vc,
            positions[rows], read, torch.zeros(n, dtype=torch.long), None, sc,
        )  # fmt: skip
        assert out is not None
        return out

    kc, vc = cache_k.clone(), cache_v.clone()
    together = call(slice(0, t), kc, vc, cap)
    kc1, vc1 = cache_k.clone(), cache_v.clone()
    alone = torch.cat([call(slice(i, i + 1), kc1, vc1, cap) for i in range(t)])
    assert torch.equal(together, alone)

    mask = (torch.arange(length)[None, :] <= positions[:, None]).view(1, 1, t, length)
    keys, values = kc.transpose(0, 1)[None], vc.transpose(0, 1)[None]  # [1, kh, L, d]
    ref = capped_attention(q.transpose(0, 1)[None], keys, values, mask, cap)  # [1, h, t, d]
    ref = ref[0].transpose(0, 1).reshape(t, h * d)
    assert (together - ref).abs().max() <= 1e-5 * ref.abs().max()
    uncapped = call(slice(0, t), cache_k.clone(), cache_v.clone(), None)
    assert (uncapped - ref).abs().max() > 1e-2 * ref.abs().max()
