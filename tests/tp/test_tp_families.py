"""TP=2 on CPU for the families beyond Llama: each rank's shard, all-reduced, gives the
logits of the whole model (ragged prefills, a verify-sized step, single tokens), from a
Hugging Face directory and from a GGUF file of Q8_0 blocks, all in one group. A
mixture of experts (Qwen3-MoE, Mixtral) has every expert split as the dense MLP and
its router whole on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.hf_families import family_reference, write_family_gguf
from tests.tp import programs
from tests.tp.ranks import run_ranks

pytestmark = pytest.mark.tp

# OLMo 2 is refused under TP (tests/engine/test_families.py).
FAMILIES = ("qwen3", "granite", "phi3", "gemma2", "gemma3_text", "qwen3_moe", "mixtral")


def test_tp2_family_logits_match_tp1(tmp_path: Path) -> None:
    paths = []
    for model_type in FAMILIES:
        ref = family_reference(model_type)
        ref.save_pretrained(tmp_path / model_type)
        write_family_gguf(tmp_path / f"{model_type}.gguf", model_type, ref, "Q8_0")
        paths += [str(tmp_path / model_type), str(tmp_path / f"{model_type}.gguf")]
    assert run_ranks(programs.families_logits_program, 2, tmp_path, paths) == [0, 0]
    saved = torch.load(tmp_path / "families.pt")
    assert sorted(saved) == sorted(paths)
    for path, result in saved.items():
        assert result["kv_heads"] == (1, 2), path  # half the KV heads per rank
        for tp, ref in zip(result["tp"], result["ref"], strict=True):
            # Q8_0 blocks of 32 split whole between the ranks, and each block of the
            # activations quantizes alone: the sums differ by float32 rounding only.
            torch.testing.assert_close(tp, ref, rtol=0, atol=1e-5, msg=path)
