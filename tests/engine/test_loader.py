"""Loader: HF directories (single and sharded), GGUF, dtypes, tokenizers, every error path."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import model_store
from specserve.engine import cpu_kernels, loader
from specserve.engine.dtypes import parse_dtype
from specserve.engine.errors import InvalidArgument, ModelLoadError, NotFound
from specserve.engine.hugepages import huge_pages_available
from specserve.engine.loader import Tokenizer, check_compatible, load_model, load_tokenizer
from specserve.engine.model import CausalLM, SeqInput
from tests.support.hf_tiny import tiny_random_hf_config, tiny_random_model

FAMILIES = ["llama", "qwen2", "mistral", "smollm2"]
PROMPT = [5, 17, 99, 3, 200, 7, 64, 1]


def logits(model: CausalLM, ids: list[int] = PROMPT) -> torch.Tensor:
    """Float32 logits of every position of ``ids`` in one prefill: [len(ids), vocab]."""
    kv = model.new_kv_pool(64 * model.config.kv_bytes_per_token)
    kv.reserve({"s": len(ids)})
    return model([SeqInput("s", ids, num_logits=len(ids))], kv)


def reference(model_type: str, model: CausalLM) -> torch.nn.Module:
    """The transformers model of the tiny config, holding ``model``'s weights."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(tiny_random_hf_config(model_type)).eval()
    ref.load_state_dict(model.state_dict(), strict=True)
    return ref


def save_hf_dir(model_type: str, path: Path, **save_kwargs: object) -> CausalLM:
    """Write a tiny random model as a real transformers checkpoint directory; return ours."""
    model, _ = tiny_random_model(model_type, seed=1)
    reference(model_type, model).save_pretrained(path, **save_kwargs)
    return model


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
        ref = reference(model_type, model)(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits(model), ref, atol=1e-5, rtol=0)


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
    assert torch.equal(logits(model), logits(load_model(tmp_path, torch.float32)[0]))
    # Without huge pages the weights stay on the mapping: one copy, paged in lazily.
    kept, _ = load_model(tmp_path, torch.float32, huge_pages=False)
    assert checkpoint in mapped_files()
    del kept


@pytest.mark.parametrize("model_type", FAMILIES)
def test_round_trip_hf_directory(model_type: str, tmp_path: Path) -> None:
    original = save_hf_dir(model_type, tmp_path)
    model, cfg = load_model(tmp_path, torch.float32)
    assert cfg.model_type == tiny_random_hf_config(model_type).model_type
    assert torch.equal(logits(model), logits(original))
    assert not any(p.is_meta for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sharded_index(tmp_path: Path) -> None:
    original = save_hf_dir("qwen2", tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, _ = load_model(tmp_path)
    assert torch.equal(logits(model), logits(original))


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
    torch.testing.assert_close(logits(model), logits(original), atol=atol, rtol=0)


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


# --- GGUF -------------------------------------------------------------------------


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for llama GGUF files (transformers undoes it on load)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_tiny_gguf(path: Path, model_type: str, arch: str | None = None) -> CausalLM:
    """Write a tiny random model, with a 256-token byte-level tokenizer, as float32 GGUF."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    model, cfg = tiny_random_model(model_type, seed=2)
    arch = arch or ("qwen2" if model_type == "qwen2" else "llama")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    tokens = [*list(bytes_to_unicode().values())[:253], "ab", "<|endoftext|>", "<|im_end|>"]
    w.add_token_list(tokens)
    w.add_token_types([1] * 254 + [3, 3])  # 3 = control
    w.add_token_merges(["a b"])
    w.add_bos_token_id(254)
    w.add_eos_token_id(255)
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    for key, value in model.state_dict().items():
        array = value.numpy().astype(np.float32)
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if key in top:
            name = top[key]
        else:
            _, _, layer, rest = key.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            name = f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_heads if module == "self_attn.q_proj" else cfg.num_kv_heads
                array = _permute(array, heads)
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def test_gguf_loads_directly(tmp_path: Path) -> None:
    """A llama GGUF (tied, q/k permuted) loads from the file itself: nothing is converted
    or written, and the model equals the one written."""
    gguf_file = tmp_path / "tiny-llama.gguf"
    original = write_tiny_gguf(gguf_file, "smollm2")
    home = tmp_path / "home"
    assert model_store.locate(str(gguf_file), home) == gguf_file
    model, cfg = load_model(gguf_file)
    assert cfg.tie_word_embeddings and cfg.model_type == "llama"
    torch.testing.assert_close(logits(model), logits(original), atol=1e-5, rtol=0)
    tok = load_tokenizer(gguf_file)
    assert set(tok.eos_token_ids) == {255, 254}
    assert tok.decode(tok.encode("abc")) == "abc"
    assert not home.exists() and sorted(p.name for p in tmp_path.iterdir()) == [gguf_file.name]


def test_gguf_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match=r"is not a GGUF file .*GGUF magic"):
        load_model(model_store.locate(str(path), tmp_path))


def test_gguf_truncated(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path, "qwen2")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"is truncated or corrupt"):
        load_model(model_store.locate(str(path), tmp_path))
    path.write_bytes(data[:200])
    with pytest.raises(ModelLoadError, match=r"is truncated or corrupt"):
        load_model(model_store.locate(str(path), tmp_path))


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path, "llama", arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"holds a 'gpt2' model; supported architectures"):
        load_model(model_store.locate(str(path), tmp_path))


# --- tokenizers -------------------------------------------------------------------


def tiny_tokenizer(words: list[str], specials: list[str], eos: str | None = None) -> Tokenizer:
    """A word-level fast tokenizer built with the tokenizers library."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", *words])}
    raw = RawTokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    hf.add_special_tokens({"additional_special_tokens": specials})
    if eos:
        hf.eos_token = eos
    return Tokenizer(hf, config_eos_ids=[0])


WORDS = ["hello", "world", "def", "return"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_eos_ids_include_config_tokenizer_and_chat_end() -> None:
    tok = tiny_tokenizer(WORDS, SPECIALS, eos="<|im_start|>")
    vocab = tok.hf.get_vocab()
    want = [0, vocab["<|im_start|>"], vocab["<|endoftext|>"], vocab["<|im_end|>"]]
    assert tok.eos_token_ids == tuple(want)
    assert tok.vocab_size == 1 + len(WORDS) + len(SPECIALS)
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_compatible_tokenizers() -> None:
    a = tiny_tokenizer(WORDS, SPECIALS)
    b = tiny_tokenizer(WORDS, SPECIALS)
    assert check_compatible(a, b) == 1 + len(WORDS) + len(SPECIALS)


def test_incompatible_vocabulary() -> None:
    a = tiny_tokenizer(WORDS, SPECIALS)
    b = tiny_tokenizer(["hello", "world", "return", "def"], SPECIALS)
    with pytest.raises(
        ModelLoadError, match=r"tokenizers differ: .*token 'def' is id 3 in the draft, 4 in the"
    ):
        check_compatible(a, b)
    c = tiny_tokenizer([*WORDS, "extra"], SPECIALS)
    with pytest.raises(ModelLoadError, match=r"the draft has 8 tokens, the target 9"):
        check_compatible(a, c)


def test_incompatible_special_tokens() -> None:
    a = tiny_tokenizer(WORDS, SPECIALS)
    b = tiny_tokenizer(WORDS, [])
    b.hf.add_tokens(SPECIALS)  # same strings and ids, but not special
    with pytest.raises(ModelLoadError, match=r"different special tokens"):
        check_compatible(a, b)


def test_tokenizer_of_missing_source(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        load_tokenizer(tmp_path / "missing")


def test_store_resolution_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetched model name loads from the store's verified GGUF file."""
    name = "smollm2-135m-instruct"
    path = model_store.gguf_path(name, tmp_path)
    path.parent.mkdir(parents=True)
    original = write_tiny_gguf(path, "smollm2")
    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    pinned = replace(model_store.MODELS[name], size=len(data), sha256=sha)
    monkeypatch.setitem(model_store.MODELS, name, pinned)
    with pytest.raises(NotFound, match=r"is not fetched"):  # not verified yet
        model_store.locate(name, tmp_path)
    marker = model_store.verified_marker(name, tmp_path)
    marker.write_text(json.dumps({"sha256": sha, "size": len(data)}))
    model, _ = load_model(model_store.locate(name, tmp_path))
    torch.testing.assert_close(logits(model), logits(original), atol=1e-5, rtol=0)


# --- real models (slow; skipped unless `specserve models fetch` ran) ----------------


def store_dir(name: str) -> Path:
    """The fetched model's GGUF file, or skip the test."""
    try:
        return model_store.resolve(name)
    except NotFound as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_real_model_matches_transformers(name: str) -> None:
    """Our decoder on a GGUF file, dequantized at load, agrees with transformers' within
    1e-4 (fp32)."""
    from transformers import AutoModelForCausalLM

    path = store_dir(name)
    model, cfg = load_model(path, torch.float32, weights="dequantized")
    tok = load_tokenizer(path)
    ids = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    ours = logits(model, ids)
    del model
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape == (len(ids), cfg.vocab_size)
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.slow
def test_qwen_pair_tokenizers_are_compatible() -> None:
    draft = load_tokenizer(store_dir("qwen2.5-coder-0.5b-instruct"))
    target = load_tokenizer(store_dir("qwen2.5-coder-1.5b-instruct"))
    vocab = target.hf.get_vocab()
    assert check_compatible(draft, target) == target.vocab_size
    for tok in (draft, target):
        assert {vocab["<|endoftext|>"], vocab["<|im_end|>"]} <= set(tok.eos_token_ids)
    ids = target.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[-1] != vocab["<|im_end|>"] and target.decode(ids).endswith("assistant\n")
