"""Model configuration: the subset of a Hugging Face config the decoder needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specserve.engine.errors import ModelLoadError
from specserve.engine.families import FAMILIES, NORM_LAYOUTS, QK_NORMS, family

# HF `model_type`s the decoder loads (their features: specserve.engine.families).
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(FAMILIES)


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the decoder, and the features that set a family apart.

    The features the forward reads (defaults: Llama's): ``qk_norm`` (None, or an RMSNorm
    of q and k per ``"head"`` or over the whole ``"projection"``, before RoPE);
    ``norm_layout`` (``"pre"``: a sublayer's input is normalized; ``"post"``: its
    output, before the residual add); ``embedding_multiplier`` (on the embedded
    tokens), ``residual_multiplier`` (on each sublayer's output before the residual
    add), ``attention_multiplier`` (the softmax scale; None: 1 / sqrt(head_dim)) and
    ``logits_scaling`` (the logits are divided by it). :meth:`from_hf` sets them from
    the Hugging Face config and the family (:mod:`specserve.engine.families`).
    """

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
    qk_norm: str | None = None
    norm_layout: str = "pre"
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0

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
        if self.qk_norm is not None and self.qk_norm not in QK_NORMS:
            raise ModelLoadError(f"qk_norm must be one of {QK_NORMS} or None, got {self.qk_norm!r}")
        if self.norm_layout not in NORM_LAYOUTS:
            raise ModelLoadError(f"norm_layout must be one of {NORM_LAYOUTS}")
        if not self.logits_scaling:
            raise ModelLoadError("logits_scaling must not be 0")

    @property
    def plain_layers(self) -> bool:
        """Whether every layer is a Llama layer (pre-norms, no q/k norm, no residual or
        attention multiplier): the layer the fused one-op path runs."""
        return (
            self.qk_norm is None
            and self.norm_layout == "pre"
            and self.residual_multiplier == 1.0
            and self.attention_multiplier is None
        )

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
        fam = family(model_type)
        _refuse_unsupported(hf)
        attention_bias = hf.get("attention_bias", fam.attention_bias)
        multiplier = hf.get("attention_multiplier")
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
            sliding_window=_sliding_window(hf, fam.window_needs_flag),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=fam.qk_norm,
            norm_layout=fam.norm_layout,
            embedding_multiplier=float(hf.get("embedding_multiplier") or 1.0),
            residual_multiplier=float(hf.get("residual_multiplier") or 1.0),
            attention_multiplier=None if multiplier is None else float(multiplier),
            logits_scaling=float(hf.get("logits_scaling") or 1.0),
        )


def _refuse_unsupported(hf: dict[str, Any]) -> None:
    """A clear error for settings of a supported family that the decoder does not run."""
    params = hf.get("rope_parameters")
    partial = hf.get("partial_rotary_factor")
    if isinstance(params, dict):
        partial = params.get("partial_rotary_factor", partial)
    if partial is not None and float(partial) != 1.0:
        raise ModelLoadError(
            f"partial rotary embeddings (partial_rotary_factor {partial}) are not supported"
        )
    if hf.get("mlp_bias"):
        raise ModelLoadError("MLP biases (mlp_bias) are not supported")


def _sliding_window(hf: dict[str, Any], needs_flag: bool) -> int | None:
    """Mistral and Phi-3 apply their window whenever one is set; Qwen only with
    ``use_sliding_window``."""
    window = hf.get("sliding_window")
    if not window or (needs_flag and not hf.get("use_sliding_window")):
        return None
    return int(window)
