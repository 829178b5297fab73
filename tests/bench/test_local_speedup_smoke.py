"""bench.local_speedup runs end to end on a tiny target and draft checkpoint.

A full run loads the Qwen pair; here ``locate`` hands it two tiny transformers
checkpoints instead (the draft a noisy copy of the target, so that some drafts are
accepted) with the tiny character tokenizer, and ``main`` does the rest as it does
for real: HumanEval prompts, the engine and transformers over shared weights, every
kind of variant, the check that each variant's tokens equal target-only's, the
table and the plot (into a temporary directory).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from bench import local_speedup
from specserve.engine.tiny import noisy_copy
from specserve.engine.tiny_tokenizer import write_tiny_tokenizer
from tests.support.hf_tiny import hf_reference, save_hf_dir

# Prompts 2 and 3 fit the tiny models' 512 positions, one character a token.
ARGV = ["--prompts", "2-3", "--new-tokens", "8", "--ks", "2", "--bf16-ks", "2"]
ARGV += ["--fp32-ks", "auto", "--threads", "1", "--name", "tiny_speedup"]
VARIANTS = [
    local_speedup.BASELINE,
    "engine spec k=2 (draft bf16)",
    "engine spec k=auto (draft fp32)",
    "engine n-gram k=4",
    "transformers generate",
    "transformers assisted k=4",
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model name -> a tiny llama checkpoint directory (the target's with a tokenizer)."""
    target = tmp_path_factory.mktemp("target")
    draft = tmp_path_factory.mktemp("draft")
    tokenizer = write_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # not its config.json
        shutil.copy(tokenizer / name, target / name)
    model = save_hf_dir("llama", target)
    hf_reference("llama", noisy_copy(model, 0.3, seed=7)).save_pretrained(draft)
    return {local_speedup.TARGET: target, local_speedup.DRAFT: draft}


def test_the_command_line_keeps_its_defaults() -> None:
    args = local_speedup.parser().parse_args([])
    assert (args.prompts, args.new_tokens, args.ks) == ("0-19", 128, [2, 3, 4, 5, 6])
    assert args.variants.split(",") == ["fp32", "bf16", "ngram", "hf", "hf-assisted"]
    assert (args.bf16_ks, args.fp32_ks) == (["2", "3", "4", "5", "6", "auto"], ["4", "auto"])


def test_a_tiny_run_times_every_kind_of_variant_and_reports_it(
    checkpoints: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    written: dict[str, Any] = {}

    def capture(name: str, markdown: str, data: dict[str, Any]) -> tuple[Path, Path]:
        written.update(name=name, markdown=markdown, data=data)
        return tmp_path / f"{name}.md", tmp_path / f"{name}.json"

    monkeypatch.setattr(local_speedup, "locate", checkpoints.__getitem__)
    monkeypatch.setattr(local_speedup, "write_results", capture)
    monkeypatch.setattr(local_speedup, "RESULTS_DIR", tmp_path)
    local_speedup.main(ARGV)

    assert written["name"] == "tiny_speedup"
    rows = written["data"]["rows"]
    assert [r["variant"] for r in rows] == VARIANTS
    for r in rows:
        assert r["wrong_prompts"] == [], r  # every variant makes target-only's tokens
        assert r["tokens_per_s"] > 0
    spec = [r for r in rows if r["variant"].startswith("engine spec")]
    assert all(r["acceptance_rate"] > 0 and r["mean_acceptance_length"] > 1 for r in spec)
    md = written["markdown"]
    assert "| engine target-only | " in md and "| transformers assisted k=4 | " in md
    assert "Best engine speculative: **engine spec k=" in md
    assert "vs transformers assisted k=4: " in md
    out = capsys.readouterr().out
    for v in VARIANTS:
        assert f"prompt 1 {v}: " in out
    assert (tmp_path / "tiny_speedup.png").stat().st_size > 0
