"""Loader: HF checkpoint directories (single and sharded), dtypes, the tiny random
models they are written from, and every error path of loading a model.

GGUF files, tokenizers and the real fetched models: ``test_loader_gguf_tokenizers.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import model_store
from specserve.engine import cpu_kernels, loader
from specserve.engine.dtypes import parse_dtype
from specserve.engine.errors import InvalidArgument, ModelLoadError, NotFound
from specserve.engine.hugepages import huge_pages_available
from specserve.engine.loader import load_model
from specserve.engine.model import CausalLM
from tests.support.hf_tiny import (
    PROMPT,
    hf_reference,
    prefill_logits,
    save_hf_dir,
    tiny_random_hf_config,
    tiny_random_model,
)

FAMILIES = ["llama", "qwen2", "mistral", "smollm2"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CausalLM]:
    path = tmp_path_factory.mktemp("llama")
    return path, save_hf_dir("llama", path)


def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# --- tiny random models -----------------------------------------------------------


@pytest.mark.parametrize("model_type", FAMILIES)
def test_tiny_model_matches_transformers(model_type: str) -> None:
    model, cfg = tiny_random_model(model_type, seed=0)
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (2, 64, 256)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (4, 2, 128)
    assert model.dtype == torch.float32
    with torch.no_grad():
        ref = hf_reference(model_type, model)(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prefill_logits(model), ref, atol=1e-5, rtol=0)


def test_tiny_model_is_seeded_and_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a, _ = tiny_random_model("qwen2", seed=3)
    b, _ = tiny_random_model("qwen2", seed=3)
    c, _ = tiny_random_model("qwen2", seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_tiny_model_overrides_and_ties() -> None:
    model, cfg = tiny_random_model("smollm2", seed=0, num_hidden_layers=3)
    assert cfg.num_layers == 3 and len(model.model.layers) == 3
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    _, qcfg = tiny_random_model("qwen2", seed=0)
    assert qcfg.attention_bias


def test_tiny_model_unknown_type() -> None:
    with pytest.raises(InvalidArgument, match=r"no tiny model of type 'gpt2'"):
        tiny_random_model("gpt2", seed=0)


# --- HF directories ---------------------------------------------------------------


def mapped_files() -> set[str]:
    """Paths of the files this process has mapped (Linux)."""
    with open("/proc/self/maps") as maps:
        return {line.split(maxsplit=5)[5].strip() for line in maps if len(line.split()) > 5}


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages here")
def test_loaded_weights_leave_the_checkpoint_mapping(tmp_path: Path) -> None:
    """Once the weights are on huge pages nothing may keep the checkpoint mapped: one
    small tensor left on it kept the whole file resident beside the copy (a 1.5B
    float32 target server held 7 GB of file pages on top of its 9 GB)."""
    import gc

    save_hf_dir("qwen2", tmp_path)
    checkpoint = str((tmp_path / "model.safetensors").resolve())
    model, _ = load_model(tmp_path, torch.float32)
    gc.collect()
    assert checkpoint not in mapped_files()
    assert torch.equal(
        prefill_logits(model), prefill_logits(load_model(tmp_path, torch.float32)[0])
    )
    # Without huge pages the weights stay on the mapping: one copy, paged in lazily.
    kept, _ = load_model(tmp_path, torch.float32, huge_pages=False)
    assert checkpoint in mapped_files()
    del kept


@pytest.mark.parametrize("model_type", FAMILIES)
def test_round_trip_hf_directory(model_type: str, tmp_path: Path) -> None:
    original = save_hf_dir(model_type, tmp_path)
    model, cfg = load_model(tmp_path, torch.float32)
    assert cfg.model_type == tiny_random_hf_config(model_type).model_type
    assert torch.equal(prefill_logits(model), prefill_logits(original))
    assert not any(p.is_meta for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sharded_index(tmp_path: Path) -> None:
    original = save_hf_dir("qwen2", tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, _ = load_model(tmp_path)
    assert torch.equal(prefill_logits(model), prefill_logits(original))


def test_sharded_index_missing_shard(tmp_path: Path) -> None:
    save_hf_dir("llama", tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(ModelLoadError, match=rf"shard {re.escape(shard)} named in .* is missing"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, 0.0), (torch.bfloat16, 0.3), (torch.float16, 0.05)]
)
def test_dtype_choice(llama_dir: tuple[Path, CausalLM], dtype: torch.dtype, atol: float) -> None:
    path, original = llama_dir
    model, _ = load_model(path, dtype)
    assert model.dtype == dtype
    assert all(p.dtype == dtype for p in model.parameters() if p.dim() == 2)
    if dtype == torch.bfloat16 and cpu_kernels.kernels() is not None:
        # bfloat16 matrices under float32 activations, norms, biases and KV cache
        assert model.activation_dtype == torch.float32
        assert all(p.dtype == torch.float32 for p in model.parameters() if p.dim() == 1)
        assert model.new_kv_pool(1 << 20).dtype == torch.float32
    else:
        assert all(p.dtype == dtype for p in model.parameters())
        assert model.new_kv_pool(1 << 20).dtype == dtype
    torch.testing.assert_close(prefill_logits(model), prefill_logits(original), atol=atol, rtol=0)


def test_bad_dtype(llama_dir: tuple[Path, CausalLM]) -> None:
    with pytest.raises(InvalidArgument, match=r"not supported"):
        load_model(llama_dir[0], torch.int8)
    assert parse_dtype("bf16") is torch.bfloat16
    assert parse_dtype("float32") is torch.float32
    assert parse_dtype("FP16") is torch.float16
    with pytest.raises(InvalidArgument, match=r"dtype 'int4' is not supported; choose from"):
        parse_dtype("int4")


def test_generation_config_eos_is_merged(llama_dir: tuple[Path, CausalLM], tmp_path: Path) -> None:
    path = copy_dir(llama_dir[0], tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert loader.read_config(path).eos_token_ids == (2, 7)


# --- error paths ------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match=r"is not a model directory"):
        load_model(tmp_path / "nope")
    with pytest.raises(NotFound, match=r"is not a directory, a GGUF file, a fetched model name"):
        model_store.locate(str(tmp_path / "nope"), tmp_path)
    with pytest.raises(NotFound, match=r"is not a directory"):
        model_store.locate("./no/such/model.gguf", tmp_path)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"has no config.json, so it is not a model directory"):
        load_model(tmp_path)


def _with_config(llama: Path, dst: Path, config: str) -> Path:
    path = copy_dir(llama, dst)
    (path / "config.json").write_text(config)
    return path


def test_bad_config_json(llama_dir: tuple[Path, CausalLM], tmp_path: Path) -> None:
    path = _with_config(llama_dir[0], tmp_path / "m", "{not json")
    with pytest.raises(ModelLoadError, match=r"config.json is not readable JSON"):
        load_model(path)


def test_unsupported_architecture(llama_dir: tuple[Path, CausalLM], tmp_path: Path) -> None:
    hf = json.loads((llama_dir[0] / "config.json").read_text()) | {"model_type": "gpt2"}
    path = _with_config(llama_dir[0], tmp_path / "m", json.dumps(hf))
    with pytest.raises(ModelLoadError, match=r"model type 'gpt2' is not supported; supported:"):
        load_model(path)


def test_config_missing_key(llama_dir: tuple[Path, CausalLM], tmp_path: Path) -> None:
    hf = json.loads((llama_dir[0] / "config.json").read_text())
    del hf["hidden_size"]
    path = _with_config(llama_dir[0], tmp_path / "m", json.dumps(hf))
    with pytest.raises(ModelLoadError, match=r"lacks or has a bad value for 'hidden_size'"):
        load_model(path)


def test_no_weights(llama_dir: tuple[Path, CausalLM], tmp_path: Path) -> None:
    path = copy_dir(llama_dir[0], tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"has no \*\.safetensors weights"):
        load_model(path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(llama_dir: tuple[Path, CausalLM], tmp_path: Path, damage: str) -> None:
    path = copy_dir(llama_dir[0], tmp_path / "m")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\x07" * 64 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"is not a valid safetensors file"):
        load_model(path)


def _edit_weights(llama: Path, dst: Path, edit: object) -> Path:
    path = copy_dir(llama, dst)
    tensors = load_file(path / "model.safetensors")
    edit(tensors)  # type: ignore[operator]
    save_file(tensors, path / "model.safetensors")
    return path


def test_missing_weight(llama_dir: tuple[Path, CausalLM], tmp_path: Path) -> None:
    path = _edit_weights(
        llama_dir[0], tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")
    )
    with pytest.raises(ModelLoadError, match=r"lacks 1 weights, e.g. model.layers.1.mlp.up_proj"):
        load_model(path)


def test_unexpected_weight(llama_dir: tuple[Path, CausalLM], tmp_path: Path) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.up_proj.bias"] = torch.zeros(128)

    path = _edit_weights(llama_dir[0], tmp_path / "m", add)
    with pytest.raises(ModelLoadError, match=r"1 weights a llama decoder does not use, e.g. "):
        load_model(path)


def test_wrong_shape(llama_dir: tuple[Path, CausalLM], tmp_path: Path) -> None:
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.norm.weight"] = torch.ones(32)

    path = _edit_weights(llama_dir[0], tmp_path / "m", shrink)
    with pytest.raises(ModelLoadError, match=r"model.norm.weight .* has shape \(32,\), .*\(64,\)"):
        load_model(path)


def test_integer_weights(llama_dir: tuple[Path, CausalLM], tmp_path: Path) -> None:
    def quantize(t: dict[str, torch.Tensor]) -> None:
        t["model.norm.weight"] = torch.ones(64, dtype=torch.int8)

    path = _edit_weights(llama_dir[0], tmp_path / "m", quantize)
    with pytest.raises(ModelLoadError, match=r"is torch.int8; only float checkpoints"):
        load_model(path)


def test_plain_file_is_not_a_model(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 100)
    with pytest.raises(ModelLoadError, match=r"is a file but not a GGUF file"):
        model_store.locate(str(path), tmp_path)
    with pytest.raises(ModelLoadError, match=r"is a file but not a GGUF file"):
        load_model(path)


def test_hub_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(**_: object) -> str:
        raise OSError("We couldn't connect to the hub.\nmore detail")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelLoadError, match=r"could not fetch 'some-org/some-model' from the"):
        model_store.locate("some-org/some-model")


def test_store_name_not_fetched(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match=r"run `specserve models fetch smollm2`"):
        model_store.locate("smollm2-135m-instruct", tmp_path)
