"""Loader: GGUF files (read directly, every error path), tokenizers (EOS ids,
compatibility of a draft's with a target's), a store name resolved to its verified
GGUF file, and the real fetched models (slow).

HF checkpoint directories, dtypes and their error paths: ``test_loader.py``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from specserve import model_store
from specserve.engine.errors import ModelLoadError, NotFound
from specserve.engine.loader import Tokenizer, check_compatible, load_model, load_tokenizer
from specserve.engine.model import CausalLM
from tests.support.hf_tiny import prefill_logits, tiny_random_model
from tests.support.tiny_gguf import add_byte_tokenizer

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
    add_byte_tokenizer(w)
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
    torch.testing.assert_close(prefill_logits(model), prefill_logits(original), atol=1e-5, rtol=0)
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


@pytest.mark.parametrize("model_type", ["granite", "olmo2"])
def test_gguf_tokenizer_of_an_architecture_transformers_does_not_load(
    tmp_path: Path, model_type: str
) -> None:
    """transformers' AutoTokenizer refuses a granite or olmo2 GGUF file (it reads the
    model config first); the loader builds the tokenizer from the metadata alone, with
    the token ids of the same byte tokenizer in a qwen3 file (which AutoTokenizer loads)."""
    from tests.support.hf_families import family_reference, write_family_gguf

    for fam in (model_type, "qwen3"):
        write_family_gguf(tmp_path / f"{fam}.gguf", fam, family_reference(fam), "F16")
    tok, ref = (
        load_tokenizer(tmp_path / f"{model_type}.gguf"),
        load_tokenizer(tmp_path / "qwen3.gguf"),
    )
    text = "def f(x):\n    return x + 1  # é"
    assert tok.encode(text) == ref.encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == ref.vocab_size and tok.eos_token_ids == ref.eos_token_ids


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
        ModelLoadError,
        match=r"tokenizers differ: 2 of their 8 ids name other tokens, first id 3: "
        r"'def' in the draft, 'return' in the target$",
    ):
        check_compatible(a, b)
    c = tiny_tokenizer([*WORDS, "extra"], SPECIALS)
    with pytest.raises(ModelLoadError, match=r"the draft's has 8 tokens, the target's 9$"):
        check_compatible(a, c)


def test_incompatible_special_tokens() -> None:
    a = tiny_tokenizer(WORDS, SPECIALS)
    b = tiny_tokenizer(WORDS, [])
    b.hf.add_tokens(SPECIALS)  # same strings and ids, but not special
    with pytest.raises(ModelLoadError, match=r"differ in which tokens are special"):
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
    torch.testing.assert_close(prefill_logits(model), prefill_logits(original), atol=1e-5, rtol=0)


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
    ours = prefill_logits(model, ids)
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
