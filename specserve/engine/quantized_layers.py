"""Block-quantized weights inside a :class:`~specserve.engine.model.CausalLM`.

A projection (``nn.Linear``) holds a :class:`QuantizedWeight` as its ``weight`` in
place of a parameter (:func:`set_quantized_weight`); the decoder passes it to
:mod:`specserve.engine.ops` as it passes any weight, and the ops dispatch on its
type. The embedding table is a :class:`QuantizedEmbedding`, which dequantizes only
the rows it gathers: a row dequantizes on its own, so the result is the row of the
dequantized table, bit for bit. A tied LM head shares the embedding's blocks.

Everything else (norms, biases) stays a float parameter.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from specserve.engine.quant import QuantizedWeight, dequantize


class QuantizedEmbedding(nn.Module):
    """An embedding table kept as quantized blocks; ``forward`` returns float32 rows."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = weight
        # The dtype the model's other matrices were loaded in (CausalLM.dtype reads it).
        self.dtype = dtype

    @property
    def device(self) -> torch.device:
        return self.weight.blocks.device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [tokens] -> [tokens, hidden]
        w = self.weight
        return dequantize(w.blocks.index_select(0, ids), w.ggml_type, w.in_features)


def set_quantized_weight(linear: nn.Linear, weight: QuantizedWeight) -> None:
    """Make ``weight`` the weight of ``linear`` (replacing its parameter)."""
    if tuple(weight.shape) != (linear.out_features, linear.in_features):
        raise ValueError(
            f"a quantized weight of shape {weight.shape} does not fit a linear layer "
            f"[{linear.out_features}, {linear.in_features}]"
        )
    if "weight" in linear._parameters:
        del linear._parameters["weight"]
    linear.weight = weight  # type: ignore[assignment]


def quantized_weights(model: nn.Module) -> Iterator[tuple[str, nn.Module, QuantizedWeight]]:
    """``(qualified name, owner module, weight)`` of every quantized weight, shared ones
    (a tied LM head) under each owner."""
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight):
            yield (f"{name}.weight" if name else "weight"), module, weight


def is_quantized(model: nn.Module) -> bool:
    """Whether any weight of ``model`` is block-quantized."""
    return next(quantized_weights(model), None) is not None


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the distinct quantized weights of ``model``."""
    return sum({id(w): w.nbytes for _, _, w in quantized_weights(model)}.values())


def held_bytes(model: nn.Module) -> int:
    """Bytes of every distinct tensor ``model`` holds: parameters, buffers and the
    blocks of its quantized weights (a tied head's once). A model that kept a float32
    copy of a quantized matrix (a cache, a stale parameter) would count it here."""
    storages: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [w.blocks for _, _, w in quantized_weights(model)]
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
