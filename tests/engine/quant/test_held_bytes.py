"""What a GGUF model in the quantized form holds: the file's blocks for the matrices it
keeps, float32 for the rest, and nothing else, before and after a prefill whose
products (LM head included) go tile by tile."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from specserve.engine import tiled_products
from specserve.engine.gguf_reader import GGUFCheckpoint
from specserve.engine.gguf_weights import keeps_blocks
from specserve.engine.loader import load_model
from specserve.engine.model import SeqInput
from specserve.engine.quantized_layers import held_bytes, quantized_bytes
from tests.support.tiny_gguf import write_tiny_gguf


def _file_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the blocks the quantized form keeps, float32 bytes of every other
    tensor) as the file's tensor table gives them."""
    blocks = floats = 0
    with GGUFCheckpoint(path) as checkpoint:
        for t in checkpoint.tensors():
            if keeps_blocks(t):
                blocks += t.data.nbytes
            else:
                floats += 4 * math.prod(t.shape)
    return blocks, floats


@pytest.mark.parametrize(("arch", "head_type"), [("qwen2", "Q6_K"), ("llama", None)])
def test_a_quantized_model_holds_its_blocks_and_float_vectors_only(
    tmp_path: Path, arch: str, head_type: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch=arch, seed=3, head_type=head_type)  # llama: tied head
    model, _ = load_model(path, torch.float32, huge_pages=False, weights="quantized")
    blocks, floats = _file_bytes(path)
    assert quantized_bytes(model) == blocks > 0
    assert held_bytes(model) == blocks + floats
    # A prefill with logits at every row: the LM head's product goes tile by tile too.
    monkeypatch.setattr(tiled_products, "TILE_FLOATS", 64 * 256)
    kv = model.new_kv_pool(1 << 20)
    kv.reserve({"s": 40})
    with torch.no_grad():
        logits = model([SeqInput("s", list(range(40)), num_logits=40)], kv)
    assert logits.shape == (40, model.config.vocab_size) and torch.isfinite(logits).all()
    assert held_bytes(model) == blocks + floats
