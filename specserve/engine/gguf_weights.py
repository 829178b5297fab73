"""A GGUF file's tensors into a :class:`CausalLM`: block-quantized, or dequantized at load.

Two forms (:class:`~specserve.engine.model_spec.WeightForm`):

``quantized``
    The matrices of the types the engine reads as blocks
    (:class:`~specserve.engine.quant.GGMLType`: Q8_0, Q5_0, Q4_K, Q6_K) stay blocks: the
    seven projections of every layer (a mixture of experts: attention's four and every
    expert's three; its router is dequantized) and the LM head as a
    :class:`~specserve.engine.quant.QuantizedWeight` on their ``nn.Linear``, the
    embedding table as a :class:`~specserve.engine.quantized_layers.QuantizedEmbedding`
    (rows dequantized as they are gathered). Every other tensor (F32 norms and biases,
    F16/BF16 matrices, other quantization types) is dequantized at load to ``dtype``.
``dequantized``
    Every tensor is dequantized at load to ``dtype``; the supported block types with
    :func:`~specserve.engine.quant.dequantize`, the same operations the quantized
    products use, so in float32 this is "the float32 model dequantized from the same
    file" that the quantized form is exact against. Other types go through the
    ``gguf`` package's dequantizer.

Without a form named, :func:`default_weight_form` picks one for the device.

Quantized blocks are copied out of the file mapping into the process's memory at
load (``prepare`` then moves them onto huge pages), so the file can be closed and
the resident set is the model's own bytes.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specserve.engine import cpu_kernels
from specserve.engine.errors import ModelLoadError
from specserve.engine.gguf_reader import GGUFCheckpoint, GGUFTensor
from specserve.engine.model import CausalLM
from specserve.engine.model_spec import DEFAULT_WEIGHT_FORM, WeightForm
from specserve.engine.quant import GGMLType, QuantizedWeight, dequantize
from specserve.engine.quantized_layers import QuantizedEmbedding, set_quantized_weight

# Tensors kept as blocks in the quantized form: the matrices of products and the embedding.
_BLOCK_SUFFIXES = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)
_EMBEDDING = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"


def default_weight_form(device: torch.device) -> WeightForm:
    """The form of a GGUF file whose spec names none: :data:`DEFAULT_WEIGHT_FORM`
    (``quantized``) on a CPU with the engine's kernels, which read the blocks; elsewhere
    (a GPU, a CPU without AVX2 or a compiler) nothing reads blocks, and every product
    would dequantize its whole matrix again, so ``dequantized``: once, at load."""
    if device.type == "cpu" and cpu_kernels.kernels() is not None:
        return DEFAULT_WEIGHT_FORM
    return WeightForm.DEQUANTIZED


def keeps_blocks(t: GGUFTensor) -> bool:
    """Whether the quantized form keeps ``t`` as blocks (a projection, the embedding or
    the LM head, in a type the kernels read)."""
    if len(t.shape) != 2 or t.ggml_type not in GGMLType._value2member_map_:
        return False
    return t.name in (_EMBEDDING, _LM_HEAD) or t.name.endswith(_BLOCK_SUFFIXES)


def _dequantized(t: GGUFTensor) -> torch.Tensor:
    """The float32 values of ``t`` in its torch shape."""
    if t.ggml_type in GGMLType._value2member_map_:
        values = dequantize(torch.from_numpy(t.data.copy()), t.ggml_type, t.shape[-1])
    else:
        import gguf  # every other type: F32, F16, BF16, Q4_0, Q4_1, ...

        try:
            array = gguf.quants.dequantize(t.data, t.ggml_type)
        except NotImplementedError as exc:
            raise ModelLoadError(f"tensor {t.gguf_name}: {exc}") from exc
        # A copy: an F32 tensor comes back as a view of the (read-only) file mapping.
        values = torch.from_numpy(np.array(array, dtype=np.float32))
    return values.reshape(t.shape)


def _blocks(t: GGUFTensor, device: torch.device) -> QuantizedWeight:
    """``t`` as blocks in memory of its own (a copy out of the file mapping)."""
    blocks = torch.from_numpy(t.data.copy()).to(device)
    return QuantizedWeight(t.ggml_type, (t.shape[0], t.shape[1]), blocks)


def fill_from_gguf(
    model: CausalLM,
    checkpoint: GGUFCheckpoint,
    dtype: torch.dtype,
    device: torch.device,
    form: WeightForm,
) -> None:
    """Replace the meta parameters of ``model`` by ``checkpoint``'s tensors, one at a time."""
    cfg = model.config
    expected = dict(model.named_parameters())  # a tied lm_head is listed once, as embed_tokens
    seen: set[str] = set()
    unexpected: list[str] = []
    embedding: QuantizedWeight | None = None
    for t in checkpoint.tensors():
        if t.name not in expected:
            if not (t.name == _LM_HEAD and cfg.tie_word_embeddings):
                unexpected.append(t.gguf_name)
            continue
        want = tuple(expected[t.name].shape)
        if t.shape != want:
            raise ModelLoadError(
                f"tensor {t.gguf_name} of {checkpoint.path.name} has shape {t.shape}, "
                f"the config implies {want}"
            )
        owner_name, _, attr = t.name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if form is WeightForm.QUANTIZED and keeps_blocks(t):
            weight = _blocks(t, device)
            if t.name == _EMBEDDING:
                embedding = weight
                model.model.embed_tokens = QuantizedEmbedding(weight, dtype)
            else:
                assert isinstance(owner, nn.Linear), t.name
                set_quantized_weight(owner, weight)
        else:
            values = _dequantized(t).to(device=device, dtype=dtype)
            setattr(owner, attr, nn.Parameter(values, requires_grad=False))
        seen.add(t.name)
    if unexpected:
        raise ModelLoadError(
            f"{checkpoint.path.name} has {len(unexpected)} tensors a {cfg.model_type} decoder "
            f"does not use, e.g. {unexpected[0]}"
        )
    missing = sorted(set(expected) - seen)
    if missing:
        raise ModelLoadError(
            f"{checkpoint.path.name} lacks {len(missing)} tensors, e.g. {missing[0]}"
        )
    if cfg.tie_word_embeddings:
        if embedding is not None:
            set_quantized_weight(model.lm_head, embedding)
        else:
            model.lm_head.weight = model.model.embed_tokens.weight
