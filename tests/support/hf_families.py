"""Tiny random models of the families beyond Llama, for parity tests; nothing downloaded.

:func:`family_reference` builds transformers' own model of a family from its own config
class (2 layers, hidden 64, 4 heads / 2 KV heads, vocabulary 256) with the family's
features switched on (:data:`FAMILY_SETTINGS`), seeded random weights that float16
holds exactly (so an F16 GGUF file is the same model), and scaled so next-token
distributions are peaked. :func:`write_family_gguf` writes it as llama.cpp's converter
would: its architecture, tensor names from the ``gguf`` package's own name map (q/k
rows interleaved for the Llama lineage, fused matrices kept fused), the family's
metadata (Gemma 2's soft-caps and window as its converter writes them), and F16 or
Q8_0 matrices; a mixture of experts as llama.cpp stacks it
(``ffn_gate_inp``, ``ffn_{gate,up,down}_exps`` ``[experts, out, in]``, the
``expert_count`` metadata; Mixtral as a ``llama`` with experts).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tests.support.hf_tiny import _TINY
from tests.support.tiny_gguf import _permute_rows, add_byte_tokenizer

# transformers model_type -> the settings that switch its features on, over _TINY.
FAMILY_SETTINGS: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 16},  # q/k RMSNorm per head (Qwen3Config's head_dim is 128)
    "granite": {
        "embedding_multiplier": 3.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 0.5,
    },
    "olmo2": {"pad_token_id": None},  # post-norms, q/k norm over the whole projection
    "phi3": {"sliding_window": 16, "pad_token_id": None},  # fused qkv and gate_up
    "gemma2": {  # Gemma 3's layer without q/k norm; attention scores soft-capped
        "head_dim": 16,
        "query_pre_attn_scalar": 16,  # llama.cpp's scale for every Gemma 2 but the 27B
        "sliding_window": 4,  # a sliding and a global layer, as llama.cpp assumes
        "layer_types": ["sliding_attention", "full_attention"],
        "attn_logit_softcapping": 2.0,  # small: scores of ~N(0, 1) often pass it
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
    },
    "gemma3_text": {  # sandwich norms, GeGLU, (1 + w) norms, q/k norm, scaled embedding
        "head_dim": 16,
        "query_pre_attn_scalar": 16,  # llama.cpp's scale for every Gemma 3 but the 27B
        "sliding_window": 4,  # a sliding and a global layer, each with its RoPE base
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
    },
    "qwen3_moe": {  # 4 experts of 64, top-2 renormalized; q/k RMSNorm per head
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,  # whole Q8_0 blocks per rank at TP=2
        "norm_topk_prob": True,
        "eos_token_id": None,  # this seed's greedy continuation meets id 2 before 33 tokens
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},  # experts of 128
}
# transformers model_type -> llama.cpp's architecture, where they differ.
_GGUF_ARCH = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "mixtral": "llama"}
# Families whose norm weights llama.cpp's converter shifts (Gemma's 1 + w).
_NORM_SHIFT = {"gemma2": 1.0, "gemma3_text": 1.0}
# Families whose GGUF q/k rows llama.cpp's converter interleaves (LlamaModel lineage).
_PERMUTED = ("granite", "mixtral")


def family_config(model_type: str, **overrides: Any) -> Any:
    """transformers' config of the tiny ``model_type`` with its features on (and
    ``overrides``, e.g. ``vocab_size``)."""
    from transformers import AutoConfig  # heavy; tests only

    settings = {**_TINY, **FAMILY_SETTINGS[model_type], **overrides}
    return AutoConfig.for_model(model_type, **settings)


def family_reference(model_type: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """transformers' tiny ``model_type`` with seeded, float16-exact random weights."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        ref = AutoModelForCausalLM.from_config(family_config(model_type, **overrides))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                value = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif "embed_tokens" in name:
                value = 0.5 * torch.randn(p.shape, generator=gen)
            elif "lm_head" in name:  # peaked next-token distributions: no near-ties
                value = 2.0 * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
            else:  # projections: unit-variance outputs for unit-variance inputs
                value = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
            p.copy_(value.half().float())
    return ref.eval()


def write_family_gguf(
    path: Path,
    model_type: str,
    ref: nn.Module,
    matrices: str = "F16",
    tokenizer: dict[str, Any] | None = None,
) -> None:
    """Write ``ref`` (a :func:`family_reference` model) as a GGUF file with ``matrices``
    ("F16" or "Q8_0") for every matrix and F32 norms; ``tokenizer``: the byte
    tokenizer's options (:func:`~tests.support.tiny_gguf.add_byte_tokenizer`), its rows
    the model's vocabulary by default."""
    import gguf

    cfg = ref.config
    arch_name = _GGUF_ARCH.get(model_type, model_type)
    arch = gguf.MODEL_ARCH[arch_name.upper()]
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch_name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    params = cfg.rope_parameters  # the global layers' RoPE (Gemma 3: one per layer type)
    w.add_rope_freq_base(params.get("full_attention", params)["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if model_type == "granite":  # as the converter renames Granite's multipliers
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if model_type == "phi3":
        w.add_sliding_window(cfg.sliding_window or 0)
    if model_type == "gemma2":  # as the converter: no layer pattern (llama.cpp assumes 2)
        w.add_sliding_window(cfg.sliding_window)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if model_type == "gemma3_text":
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if model_type == "qwen3_moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    add_byte_tokenizer(w, **{"rows": cfg.vocab_size, **(tokenizer or {})})
    for hf_name, tensor in _llama_cpp_tensors(ref.state_dict()):
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the file has no output.weight
        module, _, attr = hf_name.rpartition(".")
        gguf_name = hf_name if hf_name.startswith("blk.") else f"{names.get_name(module)}.{attr}"
        values = tensor.float().numpy()
        if hf_name.endswith("norm.weight"):
            values = values + _NORM_SHIFT.get(model_type, 0.0)
        if model_type in _PERMUTED and module.endswith(("q_proj", "k_proj")):
            heads = (
                cfg.num_attention_heads if module.endswith("q_proj") else cfg.num_key_value_heads
            )
            values = _permute_rows(values, heads)
        if values.ndim == 1:
            w.add_tensor(gguf_name, values.astype(np.float32))
        elif matrices == "F16":
            w.add_tensor(gguf_name, values.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[matrices]
            w.add_tensor(gguf_name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _llama_cpp_tensors(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``state`` with transformers' fused experts (``mlp.experts.gate_up_proj``
    ``[experts, 2 * inter, hidden]``, ``mlp.experts.down_proj``) and router as llama.cpp
    names and stacks them (``blk.N.ffn_gate_exps.weight`` ``[experts, inter, hidden]``,
    ...); other tensors under their own names."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in state.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out += [(f"blk.{layer}.ffn_gate_exps.weight", gate)]
            out += [(f"blk.{layer}.ffn_up_exps.weight", up)]
        elif name.endswith("mlp.experts.down_proj"):
            out.append((f"blk.{layer}.ffn_down_exps.weight", tensor))
        elif name.endswith("mlp.gate.weight"):
            out.append((f"blk.{layer}.ffn_gate_inp.weight", tensor))
        else:
            out.append((name, tensor))
    return out
