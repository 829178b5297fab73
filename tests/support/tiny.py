"""Tiny random model pairs for tests: seeded, float32, built from a config."""

from __future__ import annotations

import torch

from specserve.engine.config import ModelConfig
from specserve.engine.model import CausalLM

VOCAB = 256


def tiny_config(model_type: str = "qwen2", **overrides: object) -> ModelConfig:
    fields: dict[str, object] = {
        "model_type": model_type,
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "attention_bias": model_type == "qwen2",
        "rope_theta": 10000.0,
    }
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def tiny_model(seed: int, model_type: str = "qwen2", **overrides: object) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(tiny_config(model_type, **overrides)).eval()
    with torch.no_grad():  # sharper distributions than the default init: fewer near-ties
        model.lm_head.weight.mul_(4.0)
    return model


def noisy_copy(model: CausalLM, noise: float, seed: int) -> CausalLM:
    """A draft that agrees with ``model`` often but not always."""
    gen = torch.Generator().manual_seed(seed)
    draft = CausalLM(model.config).eval()
    draft.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp(min=1e-3))
    return draft
