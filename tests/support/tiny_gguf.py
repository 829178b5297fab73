"""Tiny GGUF files with block-quantized matrices, written in the test, nothing downloaded.

:func:`write_tiny_gguf` writes a 2-layer decoder (hidden 256, so that a row holds whole
256-value K-quant blocks) whose matrices use every block type the engine keeps as
blocks (Q8_0, Q5_0, Q4_K, Q6_K) plus F16, F32 and Q4_0 (a type dequantized at load),
with a 256-token byte-level tokenizer. Q8_0, Q5_0 and Q4_0 blocks come from the
``gguf`` package's quantizer applied to Gaussian weights; Q4_K and Q6_K blocks are
written directly: random quants under float16 scales of a realistic size.

For ``llama`` files the q/k rows are stored in llama.cpp's interleaved order (the
rows of blocks permuted), as its converter writes them, so the loader's
un-permutation is exercised on blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

HIDDEN, INTERMEDIATE, VOCAB, HEADS, KV_HEADS, LAYERS = 256, 512, 256, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS

_GGUF_NAMES = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}
_SHAPES = {  # [out, in]
    "q": (HEADS * HEAD_DIM, HIDDEN),
    "k": (KV_HEADS * HEAD_DIM, HIDDEN),
    "v": (KV_HEADS * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate": (INTERMEDIATE, HIDDEN),
    "up": (INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
}
_NORMS = (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"))
# Per layer: every kept block type on several projections, plus F16 and Q4_0.
TARGET_TYPES = (
    {"q": "Q4_K", "k": "Q6_K", "v": "Q8_0", "o": "Q5_0", "gate": "Q4_K", "up": "Q6_K",
     "down": "Q8_0"},
    {"q": "Q5_0", "k": "Q8_0", "v": "Q6_K", "o": "Q4_K", "gate": "F16", "up": "Q4_0",
     "down": "Q5_0"},
)  # fmt: skip
DRAFT_TYPES = tuple(dict.fromkeys(_GGUF_NAMES, "Q5_0") for _ in range(LAYERS))


def _k_blocks(rng: np.random.Generator, kind: str, rows: int, cols: int) -> np.ndarray:
    """Random Q4_K / Q6_K blocks ``[rows, cols / 256 * bytes]`` with realistic scales."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    if kind == "Q4_K":  # d, dmin first: values d*sc*q - dmin*m spread about 0 by ~0.05
        blocks[..., 0:2] = np.full((1,), 2e-4, np.float16).view(np.uint8)
        blocks[..., 2:4] = np.full((1,), 1.5e-3, np.float16).view(np.uint8)
    else:  # Q6_K: d last; values d*scale*(q - 32) with int8 scales
        blocks[..., 208:210] = np.full((1,), 2e-5, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _encode(
    rng: np.random.Generator,
    kind: str,
    shape: tuple[int, ...],
    mean_std: tuple[float, float],
    base: np.ndarray | None,
) -> tuple[np.ndarray, object]:
    """``(array, raw_dtype)`` for GGUFWriter.add_tensor: float32 ``base`` (or Gaussian
    values of ``mean_std``) in type ``kind``."""
    import gguf

    if kind in ("Q4_K", "Q6_K"):
        assert base is None, "K-quant blocks are written directly, not quantized"
        return _k_blocks(rng, kind, *shape), gguf.GGMLQuantizationType[kind]
    mean, std = mean_std
    values = base if base is not None else rng.normal(mean, std, size=shape).astype(np.float32)
    if kind == "F32":
        return values.astype(np.float32), None
    if kind == "F16":
        return values.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType[kind]
    return gguf.quants.quantize(values, qtype), qtype


def _permute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row interleaving (what the loader undoes)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, 2, half, -1).swapaxes(1, 2).reshape(rows.shape)


def add_byte_tokenizer(w: Any, *, merge: str = "a b", eos: int = 255, rows: int = 256) -> None:
    """A 256-token byte-level BPE tokenizer on a ``gguf.GGUFWriter``: 253 byte tokens,
    one merge (``merge``: "ab"), then ``<|endoftext|>`` (BOS, 254) and ``<|im_end|>``
    (EOS: ``eos``), then ``rows - 256`` padding entries as llama.cpp's converter writes
    them for embedding rows past the tokenizer (``[PAD256]``..., type unused)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    w.add_tokenizer_model("gpt2")
    merged = merge.replace(" ", "")
    tokens = [*list(bytes_to_unicode().values())[:253], merged, "<|endoftext|>", "<|im_end|>"]
    padding = [f"[PAD{i}]" for i in range(256, rows)]
    w.add_token_list(tokens + padding)
    w.add_token_types([1] * 254 + [3, 3] + [5] * len(padding))  # 3 = control, 5 = unused
    w.add_token_merges([merge])
    w.add_bos_token_id(254)
    w.add_eos_token_id(eos)


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "qwen2",
    seed: int = 0,
    types: tuple[dict[str, str], ...] = TARGET_TYPES,
    embed_type: str = "Q4_K",
    head_type: str | None = "Q6_K",
    base: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write a tiny decoder to ``path``; ``head_type=None`` ties the LM head to the
    embedding. ``base`` (Hugging Face names -> float32 tensors, e.g. a dequantized model
    plus noise) gives the values to quantize instead of random ones (no K-quant types)."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    add_byte_tokenizer(w)

    def put(name: str, hf: str, kind: str, shape: tuple[int, ...], std: float) -> None:
        given = None if base is None else base[hf].numpy().astype(np.float32)
        mean = 1.0 if hf.endswith("norm.weight") else 0.0
        array, raw = _encode(rng, kind, shape, (mean, std), given)
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            array = _permute_rows(array, HEADS if "q_proj" in hf else KV_HEADS)
        w.add_tensor(name, array, raw_dtype=raw)  # type: ignore[arg-type]

    put("token_embd.weight", "model.embed_tokens.weight", embed_type, (VOCAB, HIDDEN), 1.0)
    for layer, kinds in enumerate(types):
        prefix, hf = f"blk.{layer}", f"model.layers.{layer}"
        for short, gname in _GGUF_NAMES.items():
            module = "self_attn" if short in ("q", "k", "v", "o") else "mlp"
            hf_name = f"{hf}.{module}.{short}_proj.weight"
            put(f"{prefix}.{gname}.weight", hf_name, kinds[short], _SHAPES[short], 0.05)
        for norm, hf_norm in _NORMS:
            put(f"{prefix}.{norm}.weight", f"{hf}.{hf_norm}.weight", "F32", (HIDDEN,), 0.1)
        if arch == "qwen2":
            for short in ("q", "k", "v"):
                gname, rows = f"{prefix}.{_GGUF_NAMES[short]}.bias", _SHAPES[short][0]
                put(gname, f"{hf}.self_attn.{short}_proj.bias", "F32", (rows,), 0.02)
    put("output_norm.weight", "model.norm.weight", "F32", (HIDDEN,), 0.1)
    if head_type is not None:
        put("output.weight", "lm_head.weight", head_type, (VOCAB, HIDDEN), 0.2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
