"""Tiny random models for tests and demos without weights: seeded, float32.

Spec strings name them on the command line (parsed by
:class:`specserve.engine.model_spec.ModelSpec`):
``tiny:<seed>[:<model_type>][:noise=<x>][:vocab=<n>][:ctx=<n>]``. ``noise`` perturbs every
weight of the seed's model by ``x`` times its standard deviation, which makes a
draft that agrees with the ``noise``-free target often but not always. ``vocab``
widens the vocabulary (default 256), e.g. to 150000 to measure what a real
vocabulary costs on the wire. ``ctx`` sets the context (``max_position_embeddings``,
default 32768); the weights do not depend on it.
"""

from __future__ import annotations

import torch

from specserve.engine.config import ModelConfig
from specserve.engine.errors import InvalidArgument
from specserve.engine.families import FAMILIES
from specserve.engine.model import CausalLM
from specserve.engine.model_spec import TINY_VOCAB, ModelSpec, TinySpec

VOCAB = TINY_VOCAB


def tiny_config(model_type: str = "qwen2", **overrides: object) -> ModelConfig:
    """2 layers, hidden 64, 4 heads / 2 KV heads, vocab 256."""
    fields: dict[str, object] = {
        "model_type": model_type,
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
    }
    fam = FAMILIES.get(model_type)  # an unknown type: ModelConfig says which are known
    fields["attention_bias"] = fam is not None and fam.attention_bias
    if fam is not None:  # the family's structural features, as from_hf sets them
        fields.update(qk_norm=fam.qk_norm, norm_layout=fam.norm_layout)
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def tiny_model(seed: int, model_type: str = "qwen2", **overrides: object) -> CausalLM:
    """A seeded random model; the LM head is scaled up so distributions are peaked
    (near-ties between the top two logits would make greedy tests fragile)."""
    torch.manual_seed(seed)
    model = CausalLM(tiny_config(model_type, **overrides)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def noisy_copy(model: CausalLM, noise: float, seed: int) -> CausalLM:
    """A copy of ``model`` with Gaussian noise on every weight."""
    gen = torch.Generator().manual_seed(seed)
    draft = CausalLM(model.config).eval()
    draft.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp(min=1e-3))
    return draft


def tiny_from_spec(spec: str | TinySpec) -> CausalLM:
    """Build the model a ``tiny:...`` spec names (parsed by :class:`ModelSpec`)."""
    if isinstance(spec, str):
        parsed = ModelSpec.parse(spec).tiny
        if parsed is None:
            raise InvalidArgument(f"not a tiny model spec: {spec!r} (expected tiny:<seed>[...])")
        spec = parsed
    overrides = _spec_overrides(spec)
    model = tiny_model(spec.seed, spec.model_type, **overrides)
    return noisy_copy(model, spec.noise, spec.seed + 1000) if spec.noise else model


def tiny_spec_config(spec: TinySpec) -> ModelConfig:
    """The config of the model a parsed tiny spec names, without building it."""
    return tiny_config(spec.model_type, **_spec_overrides(spec))


def _spec_overrides(spec: TinySpec) -> dict[str, object]:
    overrides: dict[str, object] = {"vocab_size": spec.vocab}
    if spec.ctx is not None:
        overrides["max_position_embeddings"] = spec.ctx
    return overrides
