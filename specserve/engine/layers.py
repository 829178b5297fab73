"""The decoder's layers: attention, MLP, RMSNorm and the decoder layer, for every family.

:class:`DecoderLayer` is the Llama layer (pre-norms, SwiGLU, grouped-query attention)
that Llama, Qwen2, Mistral and SmolLM2 use, and the one a layer of quantized weights
can run as one op (:mod:`specserve.engine.layer_op`). :class:`FamilyDecoderLayer` adds
what other families need, each feature read from the config
(:class:`~specserve.engine.config.ModelConfig`: a q/k norm, norms after the sublayers,
residual and attention multipliers) and each skipped where the config does not ask
for it; :func:`decoder_layer` picks the class once, at construction, so a Llama
layer's forward is exactly what it was. Every projection still goes through
:mod:`specserve.engine.ops` and attention through the same op, so a family gains
whatever those gain.

Module names follow the Hugging Face checkpoints so weights load by name. The layers
know nothing of tensor parallelism: :mod:`specserve.engine.tp` shards the
projections after loading and adds the all-reduce as forward hooks on
:class:`Attention` and :class:`MLP` (or :class:`~specserve.engine.moe.MoE`); head counts
are read from weight shapes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.engine.attention import BLOCKED_ABOVE_KEYS, blocked_attention, capped_attention
from specserve.engine.config import ModelConfig
from specserve.engine.cpu_kernels import Kernels
from specserve.engine.forward_plan import ForwardPlan
from specserve.engine.layer_op import PackedLayer, pack_layer, run_layer
from specserve.engine.moe import MoE
from specserve.engine.ops import gate_up_silu, linear, linears, rms_norm, rope_cache_attention
from specserve.engine.rope import RotaryEmbedding


def _cache_attention_args(
    plan: ForwardPlan, rope: RotaryEmbedding, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[Any, ...]:
    """What :func:`~specserve.engine.ops.rope_cache_attention` (and a layer as one op)
    take after the new tokens: positions, RoPE, the layer's caches and the slots."""
    return (
        plan.positions,
        rope.inv_freq,
        rope.scale,
        k_cache,
        v_cache,
        plan.write_slots,
        plan.read_slots,
        plan.token_session,
        plan.sliding_window,
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        if cfg.qk_norm is not None:  # RMSNorm of q and k before RoPE (Qwen3, OLMo 2)
            per_head = cfg.qk_norm == "head"
            self.q_norm = RMSNorm(hd if per_head else cfg.num_heads * hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd if per_head else cfg.num_kv_heads * hd, cfg.rms_norm_eps)
        # q is multiplied by this before attention, whose softmax scale is 1 / sqrt(hd):
        # the family's own scale (Granite's attention multiplier); None for 1.
        self._q_scale = (
            None if cfg.attention_multiplier is None else cfg.attention_multiplier * math.sqrt(hd)
        )
        # Whether q and k need more than the projection: False for a Llama layer, whose
        # forward pays one attribute read for the families that do.
        self._qk_extra = cfg.qk_norm is not None or self._q_scale is not None
        # Each score s -> c * tanh(s / c) before the softmax (Gemma 2); None: no cap.
        self._softcap = cfg.attn_logit_softcapping

    def forward(
        self,
        x: torch.Tensor,  # [tokens, hidden]
        plan: ForwardPlan,
        rope: RotaryEmbedding,
        k_cache: torch.Tensor,  # [slots, kv_heads, head_dim]
        v_cache: torch.Tensor,  # [slots, kv_heads, head_dim]
    ) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        # One pass over the three weights (see ops.linears); results as if fused.
        q, k, v = linears(
            x,
            [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight],
            [self.q_proj.bias, self.k_proj.bias, self.v_proj.bias],
        )
        if self._qk_extra:
            q, k = self._prepare_qk(q, k)
        q, k, v = q.view(t, -1, hd), k.view(t, -1, hd), v.view(t, -1, hd)
        out = rope_cache_attention(
            q, k, v, *_cache_attention_args(plan, rope, k_cache, v_cache), softcap=self._softcap
        )
        if out is not None:  # the CPU kernel did all of the below in one op
            return linear(out, self.o_proj.weight)
        q, k = rope(q, k, plan.positions, plan.max_position)
        k_cache.index_copy_(0, plan.write_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, plan.write_slots, v.to(v_cache.dtype))

        b, n = plan.batch, plan.max_new
        heads = q.shape[1]
        if plan.pad_index is not None:
            q_pad = q.new_zeros(b * n, heads, hd)
            q_pad.index_copy_(0, plan.pad_index, q)
            q = q_pad
        q = q.view(b, n, heads, hd).transpose(1, 2)  # [batch, heads, max_new, head_dim]
        # [batch, kv_heads, max_len, head_dim]
        # index_select on flat slots: ~3x cheaper than advanced indexing with a 2-D index.
        slots, shape = plan.read_slots.view(-1), (*plan.read_slots.shape, *k_cache.shape[1:])
        keys = k_cache.index_select(0, slots).view(shape).transpose(1, 2).to(q.dtype)
        values = v_cache.index_select(0, slots).view(shape).transpose(1, 2).to(q.dtype)
        if n > 1 and keys.shape[2] > BLOCKED_ABOVE_KEYS:  # a chunk over a long cache
            out = blocked_attention(q, keys, values, plan.mask, softcap=self._softcap)
        elif self._softcap is not None:  # SDPA cannot cap the scores
            out = capped_attention(q, keys, values, plan.mask, self._softcap)
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=plan.mask, enable_gqa=heads != keys.shape[1]
            )
        out = out.transpose(1, 2).reshape(b * n, heads * hd)  # [batch * max_new, q_dim]
        if plan.pad_index is not None:
            out = out.index_select(0, plan.pad_index)
        return linear(out, self.o_proj.weight)

    def _prepare_qk(
        self,
        q: torch.Tensor,  # [tokens, heads * head_dim]
        k: torch.Tensor,  # [tokens, kv_heads * head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the same shapes
        """q and k after the family's q/k norm (per head, or over the whole projection)
        and q's scale, in the order of the Hugging Face models (norm, then RoPE, whose
        rotation commutes with the scale)."""
        q_norm: RMSNorm | None = self._modules.get("q_norm")  # type: ignore[assignment]
        k_norm: RMSNorm | None = self._modules.get("k_norm")  # type: ignore[assignment]
        if q_norm is not None and k_norm is not None:
            t, hd = q.shape[0], self.head_dim
            if q_norm.weight.shape[0] == hd:  # per head
                q = rms_norm(q.view(t, -1, hd), q_norm.weight, q_norm.eps).view(t, -1)
                k = rms_norm(k.view(t, -1, hd), k_norm.weight, k_norm.eps).view(t, -1)
            else:
                q, k = q_norm(q), k_norm(k)
        if self._q_scale is not None:
            q = q * self._q_scale
        return q, k


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, hidden]
        return linear(
            gate_up_silu(x, self.gate_proj.weight, self.up_proj.weight), self.down_proj.weight
        )


class GeluMLP(MLP):
    """The MLP with a tanh-approximated GELU gate (GeGLU, Gemma): the gate and up
    products in one pass over both weights, then the activation and the down product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, hidden]
        gate, up = linears(x, [self.gate_proj.weight, self.up_proj.weight], [None, None])
        return linear(F.gelu(gate, approximate="tanh") * up, self.down_proj.weight)


def _feed_forward(cfg: ModelConfig) -> nn.Module:
    """The layer's feed-forward: the experts where the config has them
    (:class:`~specserve.engine.moe.MoE`), else the SwiGLU or GeGLU MLP."""
    if cfg.num_experts:
        return MoE(cfg)
    return MLP(cfg) if cfg.hidden_act == "silu" else GeluMLP(cfg)


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _tensor(module: nn.Module, name: str) -> Any:
    """``module.<name>`` (a parameter, a plain attribute such as a quantized weight, or
    None) without nn.Module's attribute lookup."""
    found = module.__dict__.get(name)
    return found if found is not None else module._parameters.get(name)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = _feed_forward(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._packed: PackedLayer | None = None

    def forward(
        self,
        h: torch.Tensor,  # [tokens, hidden]
        plan: ForwardPlan,
        rope: RotaryEmbedding,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kern: Kernels | None = None,
    ) -> torch.Tensor:
        """``h`` through the layer. With ``kern`` (:func:`~specserve.engine.layer_op.layer_kernels`
        said the forward may) a layer of quantized weights whose modules carry no hooks
        runs as one op, with the bits of the modules' own forwards."""
        packed = self._packed_layer(kern) if kern is not None else None
        if packed is not None and kern is not None:
            return run_layer(kern, h, packed, _cache_attention_args(plan, rope, k_cache, v_cache))
        h = h + self.self_attn(self.input_layernorm(h), plan, rope, k_cache, v_cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def _packed_layer(self, kern: Kernels) -> PackedLayer | None:
        """The layer's operands for one op, packed once and again whenever a module,
        weight, bias or norm was replaced; ``None`` where its modules must run
        themselves: a forward hook or a replaced ``forward`` (tensor parallelism's
        all-reduce, a counter), or weights the op does not take. Runs once per layer of
        every step, so it reads the modules' dictionaries directly (nn.Module's
        attribute lookup is ~1 us a name)."""
        mods = self._modules
        attn, mlp = mods["self_attn"], mods["mlp"]
        norm_in, norm_post = mods["input_layernorm"], mods["post_attention_layernorm"]
        parts = (attn, mlp, norm_in, norm_post)
        if any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in parts):
            return None
        linears = (*(attn._modules[n] for n in _ATTENTION), *(mlp._modules[n] for n in _MLP))
        sources = (
            *(_tensor(m, "weight") for m in linears),
            *(_tensor(m, "bias") for m in linears[:3]),
            _tensor(norm_in, "weight"),
            _tensor(norm_post, "weight"),
        )
        packed = self._packed
        if packed is None or any(x is not y for x, y in zip(packed.sources, sources, strict=True)):
            packed = pack_layer(
                kern, sources[:7], sources[7:10], sources[10:], norm_in.eps, attn.head_dim
            )
            self._packed = packed
        return packed


class FamilyDecoderLayer(DecoderLayer):
    """A decoder layer with the features of a family beyond Llama's, read from the config:
    norms after the sublayers (``norm_layout="post"``, OLMo 2: ``post_attention_layernorm``
    and ``post_feedforward_layernorm`` on the sublayers' outputs, no input norm), before
    and after them (``"sandwich"``, Gemma 3: ``input_layernorm`` and
    ``pre_feedforward_layernorm`` on the inputs, the two ``post_`` ones on the outputs),
    a GeGLU MLP (:class:`GeluMLP`) or a mixture of experts
    (:class:`~specserve.engine.moe.MoE`), chosen by the layer at construction, and a
    ``residual_multiplier`` on each sublayer's output (Granite). Attention's own features
    (q/k norm, scale, Gemma 2's score soft-cap) live in :class:`Attention`. Always runs
    its modules one by one (the one-op layer is the Llama layer's)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self._layout = cfg.norm_layout
        if self._layout == "post":
            del self.input_layernorm
        if self._layout == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self._layout in ("post", "sandwich"):
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._residual = None if cfg.residual_multiplier == 1.0 else cfg.residual_multiplier

    def forward(
        self,
        h: torch.Tensor,  # [tokens, hidden]
        plan: ForwardPlan,
        rope: RotaryEmbedding,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kern: Kernels | None = None,
    ) -> torch.Tensor:
        """``h`` through the layer (``kern`` is not used: see the class doc)."""
        if self._layout == "post":
            h = h + self.post_attention_layernorm(self.self_attn(h, plan, rope, k_cache, v_cache))
            return h + self.post_feedforward_layernorm(self.mlp(h))
        if self._layout == "sandwich":
            a = self.self_attn(self.input_layernorm(h), plan, rope, k_cache, v_cache)
            h = h + self.post_attention_layernorm(a)
            m = self.mlp(self.pre_feedforward_layernorm(h))
            return h + self.post_feedforward_layernorm(m)
        a = self.self_attn(self.input_layernorm(h), plan, rope, k_cache, v_cache)
        h = h + a if self._residual is None else h + a * self._residual
        m = self.mlp(self.post_attention_layernorm(h))
        return h + m if self._residual is None else h + m * self._residual


def decoder_layer(cfg: ModelConfig) -> DecoderLayer:
    """The layer class ``cfg`` needs: the Llama layer where its features are Llama's,
    else :class:`FamilyDecoderLayer`."""
    return DecoderLayer(cfg) if cfg.plain_layers else FamilyDecoderLayer(cfg)
