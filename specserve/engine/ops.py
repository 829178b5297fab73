"""Matrix products and the small ops around them, chosen for the hardware they run on.

Every projection of the decoder goes through :func:`linear`, :func:`linears` or
:func:`gate_up_silu`, every norm through :func:`rms_norm`, and the attention of a
decode or verify step can take :func:`rope_cache_attention`, so a faster kernel is
one change here.

On a CPU with AVX-512 or AVX2, float32 products of at most :data:`MAX_KERNEL_ROWS`
rows go to :mod:`specserve.engine.cpu_kernels`, which reads each weight once for all
rows (MKL re-reads it every ~3 rows) and gives every row the same bits whatever the
row count. Larger products (prefill) on a CPU go to torch's GEMM one tile of weight
rows at a time (:mod:`specserve.engine.tiled_products`); other dtypes and devices, and
anything that needs autograd, use ``F.linear``. The choice depends only on shapes,
dtypes and devices, so it is deterministic per row count.

Weights may be :class:`~specserve.engine.quant.QuantizedWeight` (GGML blocks): with the
kernels, a product of any row count is multiplied in integers against 8-bit activation
blocks (``q8_linears``; Q4_K, Q6_K and Q5_0 repacked once by :func:`packed_blocks`), every
row with the bits it has alone (batch invariance, docs/exactness.md), close to but not
the dequantized float32 model. Without the kernels, a product of few rows dequantizes
the whole weight and calls ``F.linear``, a larger one goes tile by tile: the bits of the
float32 model dequantized from the same file.

Weights may be bfloat16 under float32 activations (a model loaded in bfloat16 on
such a CPU, see :meth:`CausalLM.compute_in_float32`): the kernels widen each weight
as they read it (half the bytes from memory, the same bits as the float32 copy of
those weights), and the torch path widens the weight (a tile at a time past
:data:`MAX_KERNEL_ROWS` rows) before the GEMM.

A decode step is ~200 of these calls, each after a weight stream that has flushed
the caches, so the checks are cheap and the glue between products is kept to few
ops (:func:`gate_up_silu`, :func:`rms_norm`, :func:`rope_cache_attention`):
measured, a cold torch op costs ~100-250 us here against ~10 us warm, and these cut
the time of a 1.5B decode step outside the products from ~23 ms to ~7 ms.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from specserve.engine import cpu_kernels, tiled_products
from specserve.engine.cpu_kernels import Kernels
from specserve.engine.quant.formats import GGMLType
from specserve.engine.quant.weight import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight

# Up to this many rows the kernel beats MKL on the projections of a 1.5B model (2 threads,
# MKL time / kernel time measured: 1.02 at 1 row, 1.07 at 3, 1.9 at 5, 2.2 at 9, 1.7 at
# 16, 1.3 at 32, ~1.0 at 48, 0.8 at 96); past it MKL's blocked GEMM wins. Verify batches
# of several sessions fit.
MAX_KERNEL_ROWS = 32

# Weight dtypes the kernels read (activations are float32 either way).
KERNEL_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)

_enabled = [True]
_bfloat16_products = [False]


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX tiles or AVX512-BF16), where
    torch's bfloat16 products run several times faster than float32 ones."""
    cpu = torch.cpu
    return any(
        getattr(cpu, probe, lambda: False)()
        for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    )


@contextmanager
def bfloat16_products(enabled: bool = True) -> Iterator[None]:
    """Inside the block, a product the kernels do not take (more rows than
    :data:`MAX_KERNEL_ROWS`: a prefill) of a bfloat16 weight under float32 activations
    multiplies in bfloat16 — the activations rounded to bfloat16, float32 accumulation,
    the result rounded to bfloat16 and widened — instead of widening the weight. A
    quantized weight's tiles (:mod:`specserve.engine.tiled_products`) are rounded to
    bfloat16 and multiplied so too.

    For a draft model's prefill (:class:`~specserve.engine.model_drafter.ModelDrafter`):
    its products differ from the float32 ones by bfloat16 rounding, which changes how
    well the draft guesses, never what the target commits. Widening wrote every weight
    out in float32 on each call (2 GB for a 0.5B draft's prefill) and ran float32
    GEMMs: 221 ms against 36 ms in bfloat16 for 24 [4864, 896] weights by 150 rows on
    a Xeon with AMX (2 threads). Decode and verify steps (few rows) are unchanged."""
    before = _bfloat16_products[0]
    _bfloat16_products[0] = enabled
    try:
        yield
    finally:
        _bfloat16_products[0] = before


@contextmanager
def kernels_enabled(enabled: bool) -> Iterator[None]:
    """Turn the CPU kernels on or off inside the block (for A/B benchmarks and tests)."""
    before = _enabled[0]
    _enabled[0] = enabled
    try:
        yield
    finally:
        _enabled[0] = before


def kernels_on() -> bool:
    """Whether the CPU kernels may be used here (not turned off by :func:`kernels_enabled`)."""
    return _enabled[0]


def _quantized(weights: Sequence[Weight]) -> bool:
    return any(isinstance(w, QuantizedWeight) for w in weights)


def _kernels_for(x: torch.Tensor, weights: Sequence[Weight]) -> Kernels | None:
    """The kernels if they may compute ``x`` against ``weights``, else ``None``. Quantized
    weights take the integer kernels at any row count; float ones up to
    :data:`MAX_KERNEL_ROWS` rows."""
    if not _enabled[0] or x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2:
        return None
    plain = [w for w in weights if not isinstance(w, QuantizedWeight)]
    if plain and x.shape[0] > MAX_KERNEL_ROWS:
        return None
    for w in plain:
        if w.dtype not in KERNEL_WEIGHT_DTYPES or not w.is_cpu:
            return None
    if any(isinstance(w, QuantizedWeight) and not w.blocks.is_cpu for w in weights):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in plain)):
        return None  # the kernels have no backward
    return cpu_kernels.kernels()


# Block types the integer kernels read repacked, 8 rows interleaved (cpu_kernels_int8.cpp).
REPACKED = {
    GGMLType.Q4_K: "repack_q4_k_x8",
    GGMLType.Q6_K: "repack_q6_k_x8",
    GGMLType.Q5_0: "repack_q5_0_x8",
}
_X8 = 1 << 16  # the repacked form's type code: the GGML type with this bit


def packed_blocks(kern: Kernels, weight: QuantizedWeight) -> tuple[torch.Tensor, int]:
    """The blocks and type code the integer kernels read for ``weight``: a Q4_K, Q6_K or
    Q5_0 weight repacked once (rows padded to a multiple of 8; kept on the weight beside the
    file's blocks, which dequantization, embeddings and sharding read), other types as
    they are."""
    repack = REPACKED.get(weight.ggml_type)
    if repack is None:
        return weight.blocks, int(weight.ggml_type)
    packed = weight.__dict__.get("_x8")
    if packed is None:
        packed = getattr(kern, repack)(weight.blocks, weight.in_features)
        object.__setattr__(weight, "_x8", packed)  # a cache on a frozen dataclass
    return packed, _X8 | int(weight.ggml_type)


def padded_bias(bias: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``bias`` zero-padded to ``rows`` (a repacked weight's padded rows)."""
    if bias is None or bias.shape[0] == rows:
        return bias
    return F.pad(bias, (0, rows - bias.shape[0]))


def dequantized(weight: QuantizedWeight) -> torch.Tensor:  # [out, in] float32
    """The float32 matrix of ``weight``: the kernels' widening where they run (fast, in
    parallel), else the torch reference; the same bits either way."""
    kern = cpu_kernels.kernels() if _enabled[0] and weight.blocks.is_cpu else None
    if kern is None:  # (blocks on a GPU: the reference, there)
        return weight.dequantize()
    return kern.dequantize(weight.blocks, int(weight.ggml_type), weight.in_features)


def _torch_linear(
    x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear``, widening a weight of a narrower dtype than ``x`` (bfloat16 weights
    under float32 activations) to ``x``'s dtype first: the same values, float32 arithmetic
    (inside :func:`bfloat16_products`: bfloat16 arithmetic, a float32 result). A
    quantized weight is dequantized first. Past :data:`MAX_KERNEL_ROWS` rows on a CPU
    the product goes tile by tile (:mod:`specserve.engine.tiled_products`) instead, so
    that no weight is widened whole.
    """
    if x.dim() == 2 and x.shape[0] > MAX_KERNEL_ROWS and tiled_products.applies(x, weight):
        quantized = isinstance(weight, QuantizedWeight)
        if quantized or not (_bfloat16_products[0] and weight.dtype == torch.bfloat16):
            bf16 = quantized and _bfloat16_products[0]
            return tiled_products.tiled_linear(x, weight, bias, bfloat16=bf16)
    if isinstance(weight, QuantizedWeight):
        weight = dequantized(weight)
    if weight.dtype != x.dtype:
        if _bfloat16_products[0] and weight.dtype == torch.bfloat16:
            y = F.linear(x.to(torch.bfloat16), weight).to(x.dtype)
            return y if bias is None else y + bias
        weight = weight.to(x.dtype)
    return F.linear(x, weight, bias)


def linear(
    x: torch.Tensor,  # [rows, in]
    weight: Weight,  # [out, in]
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [rows, out]
    """``x @ weight.T + bias``, as ``torch.nn.functional.linear``."""
    return linears(x, [weight], [bias])[0]


def linears(
    x: torch.Tensor,  # [rows, in]
    weights: Sequence[Weight],  # each [out_i, in]
    biases: Sequence[torch.Tensor | None],  # each [out_i] or None
) -> list[torch.Tensor]:  # each [rows, out_i]
    """Several projections of the same input (q/k/v) in one call.

    With the CPU kernel this is one pass over all the weights (one thread split, one
    output buffer, of which the results are column views); otherwise one
    ``F.linear`` each. The results equal ``[linear(x, w, b) for w, b in ...]``.
    """
    quantized = [isinstance(w, QuantizedWeight) for w in weights]
    if any(quantized) and not all(quantized):  # mixed: each kind its own call
        return [linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    kern = _kernels_for(x, weights)
    if kern is None:
        return [_torch_linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    if all(quantized):
        operands = [packed_blocks(kern, w) for w in weights]  # type: ignore[arg-type]
        padded = [padded_bias(b, t.shape[0]) for b, (t, _) in zip(biases, operands, strict=True)]
        ys = kern.q8_linears(x, [t for t, _ in operands], [c for _, c in operands], padded)
        return [y[:, : w.shape[0]] for y, w in zip(ys, weights, strict=True)]
    return kern.linears(x, weights, biases)


def gate_up_silu(
    x: torch.Tensor,  # [rows, hidden]
    gate: Weight,  # [intermediate, hidden]
    up: Weight,  # [intermediate, hidden]
) -> torch.Tensor:  # [rows, intermediate]
    """``silu(x @ gate.T) * (x @ up.T)``, the first half of a SwiGLU MLP, in one call."""
    if isinstance(gate, QuantizedWeight) and isinstance(up, QuantizedWeight):
        kern = _kernels_for(x, (gate, up))
        if kern is not None:
            (g, tg), (u, tu) = packed_blocks(kern, gate), packed_blocks(kern, up)
            if g.shape[0] == u.shape[0]:  # (padded alike)
                return kern.q8_gate_up_silu(x, g, tg, u, tu)[:, : gate.shape[0]]
            return F.silu(linear(x, gate)) * linear(x, up)
    elif not _quantized((gate, up)) and gate.dtype == up.dtype:
        kern = _kernels_for(x, (gate, up))
        if kern is not None:
            return kern.gate_up_silu(x, gate, up)
    return F.silu(_torch_linear(x, gate)) * _torch_linear(x, up)


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden], dtype of x
    """``weight * (x * rsqrt(mean(x ** 2) + eps))``, computed in float32."""
    if (
        _enabled[0]
        and x.dtype == torch.float32
        and x.is_cpu
        and weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        kern = cpu_kernels.kernels()
        if kern is not None:
            return kern.rms_norm(x, weight, eps)
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_cache_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim] before RoPE
    k: torch.Tensor,  # [tokens, kv_heads, head_dim] before RoPE
    v: torch.Tensor,  # [tokens, kv_heads, head_dim]
    positions: torch.Tensor,  # [tokens] absolute position of each new token
    inv_freq: torch.Tensor,  # [head_dim // 2] RoPE inverse frequencies (scaling applied)
    rope_scale: float,  # factor on cos and sin
    k_cache: torch.Tensor,  # [slots, kv_heads, head_dim], written at write_slots
    v_cache: torch.Tensor,  # [slots, kv_heads, head_dim], written at write_slots
    write_slots: torch.Tensor,  # [tokens] cache slot of each new token
    read_slots: torch.Tensor,  # [batch, max_len] each session's slots by position
    token_session: torch.Tensor,  # [tokens] row of read_slots each token belongs to
    sliding_window: int | None,
    softcap: float | None = None,  # each score s -> softcap * tanh(s / softcap); None: none
) -> torch.Tensor | None:  # [tokens, heads * head_dim], or None: use the torch path
    """RoPE, the KV-cache write and causal (GQA) attention of a decode/verify step, one op.

    Between two weight streams the torch path runs ~35 small ops per layer, each paying
    cache misses; this is one. Every token's attention is computed alone (its dot
    products and softmax in a fixed order), so a token's output does not depend on how
    many tokens share the call. Returns ``None`` where the kernel does not apply (more
    than :data:`MAX_KERNEL_ROWS` tokens: a prefill, whose long contexts torch's
    vectorized softmax serves faster; a head size that is not a multiple of 8; not
    float32 on CPU; kernels off); the caller then
    runs its torch path, which computes the same up to float32 rounding (and whose bits
    depend on the token count: :meth:`CausalLM.forward` runs a prompt's rows without
    logits apart, so drafts appended to a prompt never change them).
    """
    if (
        not _enabled[0]
        or q.shape[0] > MAX_KERNEL_ROWS
        or q.shape[-1] % 8
        or q.dtype != torch.float32
        or not q.is_cpu
        or k_cache.dtype != torch.float32
        or not k_cache.is_cpu
        or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    ):
        return None
    kern = cpu_kernels.kernels()
    if kern is None:
        return None
    return kern.rope_cache_attention(
        q,
        k,
        v,
        positions,
        inv_freq,
        rope_scale,
        k_cache,
        v_cache,
        write_slots,
        read_slots,
        token_session,
        sliding_window or 0,
        softcap or 0.0,
    )
