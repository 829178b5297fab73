"""Tiny random models paired with a transformers config, for parity tests.

The engine's own tiny models (``tiny:<seed>`` specs) live in
:mod:`specserve.engine.tiny`; these add the matching transformers config so a test
can build transformers' reference model with the same weights
(:func:`hf_reference`), write it as a real checkpoint directory
(:func:`save_hf_dir`) and compare prefill logits (:func:`prefill_logits`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specserve.engine.config import ModelConfig
from specserve.engine.errors import InvalidArgument
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.rope import RotaryEmbedding

# Test family -> (transformers model_type, settings on top of _TINY).
TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {"sliding_window": None}),
    "smollm2": ("llama", {"tie_word_embeddings": True}),
}
PROMPT = [5, 17, 99, 3, 200, 7, 64, 1]  # token ids every tiny vocabulary holds
_TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_random_hf_config(model_type: str, **overrides: Any) -> Any:
    """transformers config of the tiny ``model_type`` ("llama", "qwen2", "mistral", "smollm2").

    2 layers, hidden 64, vocab 256, 4 heads, 2 KV heads, intermediate 128;
    ``overrides`` are transformers config fields.
    """
    if model_type not in TINY_FAMILIES:
        raise InvalidArgument(
            f"no tiny model of type {model_type!r}; choose from {', '.join(TINY_FAMILIES)}"
        )
    from transformers import AutoConfig  # heavy; tests only

    hf_type, family = TINY_FAMILIES[model_type]
    return AutoConfig.for_model(hf_type, **{**_TINY, **family, **overrides})


def tiny_random_model(
    model_type: str, seed: int = 0, **overrides: Any
) -> tuple[CausalLM, ModelConfig]:
    """A seeded random float32 :class:`CausalLM` of :func:`tiny_random_hf_config` and its config.

    Weights come from a private generator (the global RNG is untouched), scaled
    so next-token distributions are peaked but not one-hot. Its ``state_dict``
    loads by name into the transformers model of the same config.
    """
    hf = tiny_random_hf_config(model_type, **overrides)
    cfg = ModelConfig.from_hf(hf.to_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.rope = RotaryEmbedding(cfg)
    for name, meta in list(model.named_parameters()):
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(meta.shape, generator=gen)
        elif name.endswith("bias"):
            value = 0.1 * torch.randn(meta.shape, generator=gen)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            value = 0.5 * torch.randn(meta.shape, generator=gen)
        else:  # projections: unit-variance outputs for unit-variance inputs
            value = torch.randn(meta.shape, generator=gen) / math.sqrt(meta.shape[-1])
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, nn.Parameter(value, requires_grad=False))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval(), cfg


def prefill_logits(model: CausalLM, ids: list[int] = PROMPT) -> torch.Tensor:
    """Float32 logits of every position of ``ids`` in one prefill: [len(ids), vocab]."""
    kv = model.new_kv_pool(64 * model.config.kv_bytes_per_token)
    kv.reserve({"s": len(ids)})
    return model([SeqInput("s", ids, num_logits=len(ids))], kv)


def hf_reference(model_type: str, model: CausalLM) -> nn.Module:
    """The transformers model of the tiny config, holding ``model``'s weights."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(tiny_random_hf_config(model_type)).eval()
    ref.load_state_dict(model.state_dict(), strict=True)
    return ref


def save_hf_dir(model_type: str, path: Path, **save_kwargs: object) -> CausalLM:
    """Write a tiny random model as a real transformers checkpoint directory; return ours."""
    model, _ = tiny_random_model(model_type, seed=1)
    hf_reference(model_type, model).save_pretrained(path, **save_kwargs)
    return model
