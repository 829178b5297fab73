"""Model configuration: the subset of a Hugging Face config the decoder needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specserve.engine.errors import ModelLoadError

# HF `model_type` -> whether q/k/v projections carry a bias.
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "llama": False,
    "mistral": False,
    "qwen2": True,
}


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama, Qwen2, Mistral, SmolLM2)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise ModelLoadError(
                f"model type {self.model_type!r} is not supported; supported: {supported}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, for 4-byte elements (scale by dtype)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dictionary."""
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise ModelLoadError(
                f"model type {model_type!r} is not supported; supported: {supported}"
            )
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_theta = hf.get("rope_theta")
        rope_scaling = hf.get("rope_scaling")
        # transformers 5 moves theta and scaling into `rope_parameters`.
        params = hf.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            kind = params.get("rope_type", "default")
            rope_scaling = None if kind == "default" else dict(params)
        if isinstance(rope_scaling, dict):
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling = None if kind == "default" else dict(rope_scaling, rope_type=kind)
        attention_bias = hf.get("attention_bias", SUPPORTED_ARCHITECTURES[model_type])
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(attention_bias),
            sliding_window=_sliding_window(hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _sliding_window(hf: dict[str, Any]) -> int | None:
    """Mistral applies its window whenever one is set; Qwen2 only with ``use_sliding_window``."""
    window = hf.get("sliding_window")
    if window is None or (hf.get("model_type") == "qwen2" and not hf.get("use_sliding_window")):
        return None
    return int(window)
