"""Model configuration: the subset of a Hugging Face config the decoder needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specserve.engine.errors import ModelLoadError
from specserve.engine.families import FAMILIES, HIDDEN_ACTS, NORM_LAYOUTS, QK_NORMS, family

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
    add), ``attention_multiplier`` (the softmax scale; None: 1 / sqrt(head_dim)),
    ``logits_scaling`` (the logits are divided by it), ``final_logit_softcapping``
    (logits -> tanh(logits / c) * c), ``attn_logit_softcapping`` (each attention score
    s -> tanh(s / c) * c before the mask and the softmax, Gemma 2), ``hidden_act`` (the
    MLP's gate activation), ``sliding_layers`` (the layers ``sliding_window`` applies
    to; None: all of them) with ``local_rope_theta`` (their RoPE base; None:
    ``rope_theta``). :meth:`from_hf` sets them from the Hugging Face config and the
    family (:mod:`specserve.engine.families`).

    A mixture of experts (Qwen3-MoE, Mixtral; :mod:`specserve.engine.moe`) has
    ``num_experts`` > 0: every layer's feed-forward is a router over that many SwiGLU
    experts of ``expert_intermediate_size`` each, ``num_experts_per_tok`` of them per
    token, their weights the softmax of the router's logits at the chosen experts,
    renormalized to sum to 1 where ``norm_topk_prob``. 0 experts: the dense MLP of
    ``intermediate_size``.
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
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    hidden_act: str = "silu"
    sliding_layers: tuple[int, ...] | None = None
    local_rope_theta: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False

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
        if self.attn_logit_softcapping is not None and self.attn_logit_softcapping <= 0:
            raise ModelLoadError(
                f"attn_logit_softcapping must be positive, got {self.attn_logit_softcapping}"
            )
        if not self.logits_scaling:
            raise ModelLoadError("logits_scaling must not be 0")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ModelLoadError(
                f"the MLP activation {self.hidden_act!r} is not supported; supported: "
                f"{', '.join(HIDDEN_ACTS)}"
            )
        if self.num_experts and not (
            0 < self.num_experts_per_tok <= self.num_experts and self.expert_intermediate_size > 0
        ):
            raise ModelLoadError(
                f"a mixture of {self.num_experts} experts needs 1 to {self.num_experts} experts "
                f"per token (got {self.num_experts_per_tok}) and a positive expert "
                f"intermediate size (got {self.expert_intermediate_size})"
            )

    @property
    def plain_layers(self) -> bool:
        """Whether every layer is a Llama layer (pre-norms, no q/k norm, no residual or
        attention multiplier, no attention soft-cap, a dense MLP): the layer the fused
        one-op path runs."""
        return (
            self.qk_norm is None
            and self.norm_layout == "pre"
            and self.residual_multiplier == 1.0
            and self.attention_multiplier is None
            and self.attn_logit_softcapping is None
            and self.hidden_act == "silu"
            and not self.num_experts
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
        local_theta = hf.get("rope_local_base_freq")
        # transformers 5 moves theta and scaling into `rope_parameters`, one set per
        # layer type where they differ (Gemma 3: the global layers' and the sliding ones').
        params = hf.get("rope_parameters")
        if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
            local = params.get("sliding_attention")
            local_theta = local.get("rope_theta") if isinstance(local, dict) else local_theta
            if isinstance(local, dict) and local.get("rope_type", "default") != "default":
                raise ModelLoadError("RoPE scaling on sliding-window layers is not supported")
            params = params["full_attention"]
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
        if hf.get("query_pre_attn_scalar"):  # Gemma: the softmax scale's own setting
            multiplier = float(hf["query_pre_attn_scalar"]) ** -0.5
        window = _sliding_window(hf, fam.window_needs_flag)
        sliding_layers = _sliding_layers(hf, window)
        if sliding_layers == ():
            window = None
        experts = _experts(hf, fam.topk_renormalized)
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
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=fam.qk_norm,
            norm_layout=fam.norm_layout,
            embedding_multiplier=(
                hidden**0.5 if fam.scale_embedding else float(hf.get("embedding_multiplier") or 1.0)
            ),
            residual_multiplier=float(hf.get("residual_multiplier") or 1.0),
            attention_multiplier=None if multiplier is None else float(multiplier),
            logits_scaling=float(hf.get("logits_scaling") or 1.0),
            final_logit_softcapping=_float_or_none(hf.get("final_logit_softcapping")),
            attn_logit_softcapping=_float_or_none(hf.get("attn_logit_softcapping") or None),
            hidden_act=str(hf.get("hidden_activation") or hf.get("hidden_act") or fam.hidden_act),
            sliding_layers=sliding_layers or None,
            local_rope_theta=None if sliding_layers is None else _float_or_none(local_theta),
            **experts,
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


def _experts(hf: dict[str, Any], renormalized: bool | None) -> dict[str, Any]:
    """The mixture-of-experts fields of a Hugging Face config (none for a dense model).
    ``renormalized``: the family always renormalizes the top-k weights (Mixtral: True),
    or reads ``norm_topk_prob`` (None). Layers that keep a dense MLP among MoE ones
    (Qwen3-MoE's ``mlp_only_layers``, ``decoder_sparse_step`` > 1) and shared experts
    are refused."""
    count = hf.get("num_experts") or hf.get("num_local_experts")
    if not count:
        return {}
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step") or 1) != 1:
        raise ModelLoadError(
            "dense MLP layers among the expert layers (mlp_only_layers, decoder_sparse_step) "
            "are not supported"
        )
    if hf.get("shared_expert_intermediate_size") or hf.get("n_shared_experts"):
        raise ModelLoadError("shared experts are not supported")
    size = hf.get("moe_intermediate_size") or hf["intermediate_size"]
    norm = bool(hf.get("norm_topk_prob", False)) if renormalized is None else renormalized
    return {
        "num_experts": int(count),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok") or 0),
        "expert_intermediate_size": int(size),
        "norm_topk_prob": norm,
    }


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _sliding_layers(hf: dict[str, Any], window: int | None) -> tuple[int, ...] | None:
    """The layers a sliding ``window`` applies to, where ``layer_types`` mixes sliding and
    global layers (Gemma 3); None where it applies to every layer (or there is none);
    ``()`` where the config has a window but no layer uses it."""
    types = hf.get("layer_types")
    if window is None or not isinstance(types, list):
        return None
    sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    return None if len(sliding) == len(types) else sliding


def _sliding_window(hf: dict[str, Any], needs_flag: bool) -> int | None:
    """Mistral and Phi-3 apply their window whenever one is set; Qwen only with
    ``use_sliding_window``."""
    window = hf.get("sliding_window")
    if not window or (needs_flag and not hf.get("use_sliding_window")):
        return None
    return int(window)
