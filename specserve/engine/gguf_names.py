"""llama.cpp's tensor names -> the Hugging Face names the decoder loads by, and the one
row order llama.cpp changes (the q/k interleaving of the ``LlamaModel`` lineage).

Used by :mod:`specserve.engine.gguf_reader`; a family's own names
(:attr:`Family.gguf_layer_names <specserve.engine.families.Family.gguf_layer_names>`)
take precedence over the shared map.
"""

from __future__ import annotations

import numpy as np

from specserve.engine.families import GGUF_MODEL_TYPES, family

# llama.cpp tensor name (inside blk.N) -> Hugging Face module path.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_gate_inp": "mlp.gate",
}
# llama.cpp's stacked experts (inside blk.N: [experts, out, in]) -> one expert's module.
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (with the
    names that differ in ``architecture``'s family); a name this decoder does not know
    comes back unchanged (and is reported as unexpected)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk":
        names = family(GGUF_MODEL_TYPES[architecture]).gguf_layer_names
        module = names.get(parts[2]) or _LAYER_NAMES.get(parts[2])
        if module is not None:
            return f"model.layers.{parts[1]}.{module}.{parts[3]}"
    return gguf_name


def expert_template(gguf_name: str) -> str | None:
    """``blk.3.ffn_up_exps.weight`` -> ``model.layers.3.mlp.experts.{}.up_proj.weight``
    (a template for the expert's index); None for a tensor that is not stacked experts."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _EXPERT_NAMES:
        return f"model.layers.{parts[1]}.mlp.experts.{{}}.{_EXPERT_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleaving (as transformers' ``_reverse_permute_weights``):
    within each head, rows ``[0, 2, 4, ..., 1, 3, 5, ...]`` go back to ``[0, 1, 2, ...]``."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, -1).swapaxes(2, 1).reshape(rows.shape)
