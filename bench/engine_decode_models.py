"""The models :mod:`bench.engine_decode` compares, loaded over shared weight tensors.

transformers loads a model directory (or a GGUF file, dequantized to float32); the
engine's :class:`~specserve.engine.model.CausalLM` is built over the same tensors
(no copy), and with huge pages a second transformers model runs over the engine's
huge-page weights, so that the page-size gain and the engine's own gain show apart.
:func:`load_pair` is the plain pair that :mod:`bench.local_speedup` uses too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specserve.engine.hugepages import move_to_huge_pages
from specserve.engine.loader import read_config
from specserve.engine.model import CausalLM
from specserve.engine.rope import RotaryEmbedding

# The variants' names, as the tables and the results file spell them.
ENGINE, HF, HF_HUGE = "engine", "transformers", "transformers, huge pages"


@dataclass
class Models:
    """The engine and the transformers references, sharing weight tensors where possible."""

    engine: CausalLM
    transformers: dict[str, Any]  # variant name -> model
    moved_bytes: int


def hf_source(path: Path) -> dict[str, str]:
    """transformers' ``from_pretrained`` arguments for a model directory or a GGUF file
    (which transformers dequantizes to float32 as it loads)."""
    if path.is_file():
        return {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    return {"pretrained_model_name_or_path": str(path)}


def engine_over(hf: Any, directory: Path) -> CausalLM:
    """Our CausalLM over the weight tensors of a transformers model (no copy)."""
    cfg = read_config(directory)
    with torch.device("meta"):
        ours = CausalLM(cfg)
    ours.rope = RotaryEmbedding(cfg)  # plain tensors, not parameters: off the meta device
    state = {k: v for k, v in hf.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    missing, unexpected = ours.load_state_dict(state, strict=False, assign=True)
    tied_head = ["lm_head.weight"] if cfg.tie_word_embeddings else []
    assert sorted(missing) == tied_head and not unexpected, (missing, unexpected)
    if cfg.tie_word_embeddings:
        ours.lm_head.weight = ours.model.embed_tokens.weight
    return ours.eval()


def transformers_over(engine: CausalLM, like: Any) -> Any:
    """A transformers model of ``like``'s class and config over the engine's weights."""
    with torch.device("meta"):
        twin = type(like)(like.config)
    missing, unexpected = twin.load_state_dict(engine.state_dict(), strict=False, assign=True)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    if like.config.tie_word_embeddings:
        twin.tie_weights()
    twin.model.rotary_emb = like.model.rotary_emb  # non-persistent buffers: share the module
    twin.generation_config = like.generation_config
    return twin.eval()


def _available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def load_pair(directory: Path, huge_pages: bool = False) -> tuple[Any, CausalLM]:
    """transformers' model and our engine over one shared copy of the float32 weights.

    With ``huge_pages`` the weights move onto huge pages first (both models use them).
    """
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(**hf_source(directory), dtype=torch.float32).eval()
    if huge_pages:
        move_to_huge_pages(hf)
    return hf, engine_over(hf, directory)


def load_models(directory: Path, huge_pages: bool) -> Models:
    """transformers as loaded, our engine on huge pages, transformers over the engine's.

    Two copies of the weights (the loaded one, the engine's huge-page one) only when
    memory allows with room to spare; otherwise one, shared by all.
    """
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(**hf_source(directory), dtype=torch.float32).eval()
    ours = engine_over(hf, directory)
    if not huge_pages:
        return Models(ours, {HF: hf}, 0)
    size = sum(p.numel() * p.element_size() for p in ours.parameters())
    if _available_bytes() > size + (4 << 30):
        moved = move_to_huge_pages(ours)  # the engine gets its own copy; hf keeps its own
        return Models(ours, {HF: hf, HF_HUGE: transformers_over(ours, hf)}, moved)
    del ours  # it holds the old tensors: drop it so that they go as they move
    moved = move_to_huge_pages(hf)  # one copy only: everything on huge pages
    return Models(engine_over(hf, directory), {HF_HUGE: hf}, moved)


def weight_bytes_per_token(model: CausalLM) -> int:
    """Bytes of every weight a decode step reads: all but the embedding table.

    A tied LM head is the embedding table read in full, so it is counted once.
    """
    embed = model.model.embed_tokens.weight
    total = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if not name.startswith("model.embed_tokens.")
    )
    if model.lm_head.weight is embed:
        total += embed.numel() * embed.element_size()
    return total
