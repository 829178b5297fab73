"""The decoder families the engine loads, and what sets each apart.

One configurable decoder (:mod:`specserve.engine.model`, :mod:`specserve.engine.layers`)
serves every family: a family differs from Llama by a few features (a norm of q and k,
norms after the sublayers instead of before, scalar multipliers), which are fields of
:class:`~specserve.engine.config.ModelConfig` that the forward reads; nothing below
the loader asks which family a model is. A :class:`Family` holds what a Hugging Face
``model_type`` implies that its ``config.json`` does not state, and how its
checkpoints lay the weights out:

* the structural features (``qk_norm``, ``norm_layout``, the default q/k/v bias), which
  :meth:`ModelConfig.from_hf <specserve.engine.config.ModelConfig.from_hf>` copies into
  the config;
* fused matrices that the decoder keeps apart (Phi-3's ``qkv_proj`` and
  ``gate_up_proj``), split into their parts' rows at load (:func:`split_fused`), for a
  safetensors directory and a GGUF file alike, quantized blocks included (a split
  along rows keeps whole blocks);
* checkpoint names that differ from the decoder's (Mixtral's ``block_sparse_moe`` and
  its experts' ``w1``/``w3``/``w2``), renamed at load (:func:`checkpoint_name`);
* llama.cpp's names and assumptions: the GGUF ``general.architecture`` (the
  ``model_type`` but for Gemma 3's ``gemma3``, Qwen3-MoE's ``qwen3moe`` and Mixtral, a
  ``llama`` with experts), tensor names that differ from the shared map, whether its
  converter interleaved the q/k rows (the ``LlamaModel`` lineage: llama, granite,
  mixtral), and what llama.cpp assumes that the file does not state.

Adding a family: docs/models.md, "Adding a family".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from specserve.engine.config import ModelConfig

QKNorm = Literal["head", "projection"]
NormLayout = Literal["pre", "post", "sandwich"]
QK_NORMS: tuple[str, ...] = ("head", "projection")
NORM_LAYOUTS: tuple[str, ...] = ("pre", "post", "sandwich")
HIDDEN_ACTS: tuple[str, ...] = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class Family:
    """What a Hugging Face ``model_type`` implies beyond its config (see the module doc).

    ``qk_norm``: ``"head"`` is an RMSNorm over each head's ``head_dim`` values of q and
    k before RoPE (Qwen3), ``"projection"`` one over the whole q and the whole k
    projection (OLMo 2). ``norm_layout``: ``"pre"`` normalizes a sublayer's input
    (Llama); ``"post"`` its output before the residual add (OLMo 2); ``"sandwich"``
    both (Gemma 3). ``hidden_act``: the MLP's gate activation where the config names
    none (a GGUF file). ``norm_offset``: the checkpoint's norm weights are offsets
    from it (Gemma's ``1 + weight``; added at load, as llama.cpp's converter adds it to
    the GGUF file's). ``scale_embedding``: the embedded tokens are multiplied by
    sqrt(hidden). ``gguf_architecture``: llama.cpp's name where it differs from the
    ``model_type``; ``gguf_sliding_pattern`` / ``gguf_local_rope_theta``: what llama.cpp
    assumes for the family and its files do not state (every n-th layer global, the
    sliding layers' RoPE base; None: the global layers' base, Gemma 2's).
    ``window_needs_flag``: a ``sliding_window`` in the config applies only with
    ``use_sliding_window`` (Qwen). ``fused``: a checkpoint module (suffix) -> the
    decoder modules its rows split into, in order. ``gguf_layer_names``: llama.cpp
    tensor names (inside ``blk.N``) that map elsewhere than the shared map.
    ``tp_refusal``: why tensor parallelism cannot split the family (None: it can).
    ``renamed``: ``(pattern, replacement)`` regular expressions from checkpoint names to
    the decoder's (:func:`checkpoint_name`). ``topk_renormalized``: a mixture of
    experts' top-k weights always sum to 1 (Mixtral), or as ``norm_topk_prob`` says
    (None); ``gguf_norm_topk``: what llama.cpp assumes where a file states no
    ``expert_weights_norm``.
    """

    attention_bias: bool = False
    qk_norm: QKNorm | None = None
    norm_layout: NormLayout = "pre"
    window_needs_flag: bool = False
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    gguf_permuted_qk: bool = False
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    tp_refusal: str | None = None
    hidden_act: str = "silu"
    norm_offset: float = 0.0
    scale_embedding: bool = False
    gguf_architecture: str | None = None
    gguf_sliding_pattern: int | None = None
    gguf_local_rope_theta: float | None = None
    renamed: tuple[tuple[str, str], ...] = ()
    topk_renormalized: bool | None = None
    gguf_norm_topk: bool = False


_PHI3_FUSED = MappingProxyType(
    {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    }
)

# Mixtral's checkpoint names -> the decoder's (Qwen3-MoE's, the names transformers
# itself converts Mixtral's to).
_MIXTRAL_RENAMED = (
    (r"\.block_sparse_moe\.", ".mlp."),
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
    (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
    (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
)

# Hugging Face `model_type` -> its family. The GGUF architecture has the same name.
FAMILIES: Mapping[str, Family] = MappingProxyType(
    {
        "llama": Family(gguf_permuted_qk=True),
        "mistral": Family(),
        "qwen2": Family(attention_bias=True, window_needs_flag=True),
        "qwen3": Family(qk_norm="head", window_needs_flag=True),
        "granite": Family(gguf_permuted_qk=True),
        "olmo2": Family(
            qk_norm="projection",
            norm_layout="post",
            tp_refusal=(
                "its q/k norm spans every head of the projection, which a rank holds only "
                "part of (not yet supported)"
            ),
        ),
        "phi3": Family(
            fused=_PHI3_FUSED,
            gguf_layer_names=MappingProxyType({"ffn_up": "mlp.gate_up_proj"}),
        ),
        "gemma2": Family(  # Gemma 3's layer without the q/k norm, one RoPE base
            norm_layout="sandwich",
            hidden_act="gelu_pytorch_tanh",
            norm_offset=1.0,
            scale_embedding=True,
            gguf_layer_names=MappingProxyType({"ffn_norm": "pre_feedforward_layernorm"}),
            gguf_sliding_pattern=2,
        ),
        "gemma3_text": Family(
            qk_norm="head",
            norm_layout="sandwich",
            hidden_act="gelu_pytorch_tanh",
            norm_offset=1.0,
            scale_embedding=True,
            gguf_architecture="gemma3",
            gguf_layer_names=MappingProxyType({"ffn_norm": "pre_feedforward_layernorm"}),
            gguf_sliding_pattern=6,
            gguf_local_rope_theta=10000.0,
        ),
        "qwen3_moe": Family(
            qk_norm="head",
            window_needs_flag=True,
            gguf_architecture="qwen3moe",
            gguf_norm_topk=True,
        ),
        "mixtral": Family(
            gguf_permuted_qk=True,
            renamed=_MIXTRAL_RENAMED,
            topk_renormalized=True,
            gguf_architecture="llama",  # llama.cpp's llama with experts (see GGUF_MODEL_TYPES)
            gguf_norm_topk=True,
        ),
    }
)
# llama.cpp's `general.architecture` -> the Hugging Face `model_type` (of a file without
# experts; llama.cpp writes Mixtral as a `llama` with experts: GGUF_EXPERT_MODEL_TYPES).
GGUF_MODEL_TYPES: Mapping[str, str] = MappingProxyType(
    {fam.gguf_architecture or name: name for name, fam in FAMILIES.items() if name != "mixtral"}
)
# llama.cpp's architecture of a file whose `<arch>.expert_count` is > 0, where that makes
# it another model type.
GGUF_EXPERT_MODEL_TYPES: Mapping[str, str] = MappingProxyType({"llama": "mixtral"})


def family(model_type: str) -> Family:
    """The family of ``model_type`` (a supported one: the config checked it)."""
    return FAMILIES[model_type]


def checkpoint_name(fam: Family, name: str) -> str:
    """The decoder's name of the checkpoint tensor ``name`` (the family's renames
    applied; most families: ``name``)."""
    for pattern, replacement in fam.renamed:
        name = re.sub(pattern, replacement, name)
    return name


def projection_rows(cfg: ModelConfig) -> dict[str, int]:
    """Output rows of each projection a fused matrix may hold, by module suffix."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "self_attn.q_proj": q,
        "self_attn.k_proj": kv,
        "self_attn.v_proj": kv,
        "mlp.gate_proj": cfg.intermediate_size,
        "mlp.up_proj": cfg.intermediate_size,
    }


def split_fused(
    fam: Family, name: str, parts_rows: Mapping[str, int]
) -> list[tuple[str, int, int]] | None:
    """The parts of a fused checkpoint tensor ``name`` (e.g.
    ``model.layers.0.self_attn.qkv_proj.weight``) as ``(name, first row, end row)``,
    or None if ``name`` is not fused in ``fam``. ``parts_rows``: a decoder module
    suffix (``self_attn.q_proj``) -> its output rows."""
    module, dot, attr = name.rpartition(".")
    for fused, parts in fam.fused.items():
        if dot and module.endswith("." + fused):
            prefix = module[: -len(fused)]
            out, start = [], 0
            for part in parts:
                end = start + parts_rows[part]
                out.append((f"{prefix}{part}.{attr}", start, end))
                start = end
            return out
    return None
