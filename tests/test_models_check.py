"""``specserve models check``, and ``up``'s and ``generate --local``'s pair refusal, on tiny
offline models.

A tiny Qwen3 and a tiny Gemma 3 (tests/support/hf_families.py), as a Hugging Face
directory and as F16 / Q8_0 GGUF files: the facts the check reports are those of the
model the loader builds (parameters, resident bytes, KV bytes per token); a family the
engine does not load is refused with the loader's sentence; a pair with another
tokenizer with the pair rule's. Exit status 0 / 1 / 2 as documented.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve import cli
from specserve.engine.kv_cache import KVPool
from specserve.engine.loader import load_model
from specserve.engine.model_check import inspect_model
from specserve.engine.model_spec import ModelSpec
from specserve.engine.tiny import tiny_from_spec
from tests.support.hf_families import family_reference, write_family_gguf


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("check")
    qwen3, gemma = family_reference("qwen3"), family_reference("gemma3_text")
    out = {
        "hf": root / "qwen3-hf",
        "f16": root / "qwen3-f16.gguf",
        "q8": root / "qwen3-q8.gguf",
        "gemma": root / "gemma-q8.gguf",
        "eos": root / "qwen3-eos.gguf",
        "unsupported": root / "neox",
    }
    qwen3.save_pretrained(out["hf"])
    write_family_gguf(out["f16"], "qwen3", qwen3, "F16")
    write_family_gguf(out["q8"], "qwen3", qwen3, "Q8_0")
    write_family_gguf(out["gemma"], "gemma3_text", gemma, "Q8_0")
    write_family_gguf(out["eos"], "qwen3", qwen3, "Q8_0", tokenizer={"eos": 254})
    out["unsupported"].mkdir()
    hf_config = json.loads((out["hf"] / "config.json").read_text())
    hf_config["model_type"] = "gpt_neox"
    (out["unsupported"] / "config.json").write_text(json.dumps(hf_config))
    return out


def check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(["models", "check", *argv])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("name", ["hf", "f16", "q8", "gemma"])
def test_facts_are_those_of_the_loaded_model(models: dict[str, Path], name: str) -> None:
    path = models[name]
    facts = inspect_model(ModelSpec.parse(f"{path}:weights=dequantized"), path)
    model, cfg = load_model(path, torch.float32, weights="dequantized", huge_pages=False)
    assert facts.config == cfg
    assert facts.parameters == sum(p.numel() for p in model.parameters())
    assert facts.resident_bytes == 4 * facts.parameters  # every tensor in float32
    pool = KVPool.for_model(cfg, 1 << 20, torch.float32, "cpu")
    assert facts.kv_bytes_per_token == pool.bytes_per_block // pool.block_size


def test_quantized_form_keeps_the_blocks_bytes(models: dict[str, Path]) -> None:
    facts = inspect_model(ModelSpec.parse(f"{models['q8']}:weights=quantized"), models["q8"])
    assert set(facts.tensor_types) == {"Q8_0", "F32"}
    # Q8_0: 34 bytes per 32 values; the norms stay float32
    assert facts.resident_bytes < facts.parameters * 4 * 0.5
    assert facts.weight_format == "GGUF" and facts.file_bytes <= facts.resident_bytes


def test_tiny_spec(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = check(capsys, "tiny:3:vocab=300")
    model = tiny_from_spec("tiny:3:vocab=300")
    assert code == 0
    params = sum(p.numel() for p in model.parameters())
    assert f"parameters {params / 1e6:,.1f} M" in out and "vocabulary 300" in out
    assert out.rstrip().endswith("will load")


def test_report_of_a_gguf_file(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out = check(capsys, str(models["q8"]))
    assert code == 0
    assert "family qwen3: 2 layers" in out
    assert "weights GGUF: " in out and "Q8_0" in out
    assert "per token (float32)" in out and "will load" in out
    assert len(out.splitlines()) <= 24  # one screen


def test_unsupported_family_gets_the_loaders_sentence(
    models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = check(capsys, str(models["unsupported"]))
    assert code == 1
    assert "will not load: model type 'gpt_neox' is not supported; supported: " in out


def test_missing_model_will_not_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = check(capsys, str(tmp_path / "nothing.gguf"))
    assert code == 1 and "will not load: " in out


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "check", "tiny:x"]) == 2
    assert "bad tiny model spec" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["models", "check"])
    assert exit_info.value.code == 2


def test_pair_with_one_tokenizer(
    models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = check(capsys, str(models["f16"]), "--draft", str(models["q8"]))
    assert code == 0
    assert out.splitlines()[0].startswith("target: ") and "draft: " in out
    assert out.rstrip().endswith("pair: one tokenizer; will load as a pair")


def test_pair_with_another_tokenizer(
    models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = check(capsys, str(models["q8"]), "--draft", str(models["eos"]))
    assert code == 1
    assert out.rstrip().endswith(
        "pair: will not load: draft and target tokenizers differ in their special tokens: "
        "EOS id 254 in the draft, 255 in the target"
    )


def test_up_refuses_the_pair_before_starting_anything(
    models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["up", "--target", str(models["q8"]), "--draft", str(models["eos"])])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [
        "specserve: draft and target tokenizers differ in their special tokens: "
        "EOS id 254 in the draft, 255 in the target"
    ]


def test_generate_local_refuses_the_pair(
    models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--local", "--target", str(models["q8"]), "--draft", str(models["eos"])]
    code = cli.main([*argv, "abc"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2
    assert err[0].startswith("loading target ") and len(err) == 2  # no traceback
    assert err[1] == (
        "specserve: draft and target tokenizers differ in their special tokens: "
        "EOS id 254 in the draft, 255 in the target"
    )


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_mixture_of_experts_counts_every_expert(
    tmp_path: Path, model_type: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mixture of experts' parameters and resident bytes hold every expert (what
    transformers' own model holds), from its directory and from a Q8_0 GGUF file whose
    experts are stacked; the report names the parameters a token multiplies."""
    ref = family_reference(model_type)
    ref.save_pretrained(tmp_path / "hf")
    write_family_gguf(tmp_path / "q8.gguf", model_type, ref, "Q8_0")
    everything = sum(p.numel() for p in ref.parameters())
    cfg = ref.config
    idle_expert = 3 * cfg.hidden_size * (getattr(cfg, "moe_intermediate_size", None) or 128)
    active = everything - cfg.num_hidden_layers * (4 - 2) * idle_expert
    for path in (tmp_path / "hf", tmp_path / "q8.gguf"):
        facts = inspect_model(ModelSpec.parse(f"{path}:weights=dequantized"), path)
        model, _ = load_model(path, torch.float32, weights="dequantized", huge_pages=False)
        assert facts.parameters == everything == sum(p.numel() for p in model.parameters())
        assert facts.resident_bytes == 4 * everything
        assert facts.active_parameters == active
    quantized = inspect_model(ModelSpec.parse(f"{tmp_path / 'q8.gguf'}"), tmp_path / "q8.gguf")
    assert quantized.resident_bytes < everything * 4 * 0.5  # the experts kept as Q8_0 blocks
    code, out = check(capsys, str(tmp_path / "q8.gguf"))
    assert code == 0
    assert (
        f"parameters {everything / 1e6:,.1f} M (every expert; {active / 1e6:,.1f} M active "
        f"per token: 2 of 4 experts of " in out
    )
