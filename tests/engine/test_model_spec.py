"""The one model-spec parser and the loader's spec entry point."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.engine.errors import InvalidArgument
from specserve.engine.loader import load_spec, load_spec_tokenizer
from specserve.engine.model_spec import ModelSpec, TinySpec
from specserve.engine.tiny import tiny_from_spec


def test_tiny_specs_parse_every_option() -> None:
    assert ModelSpec.parse("tiny:3").tiny == TinySpec(3)
    spec = ModelSpec.parse("tiny:7:llama:noise=0.3:vocab=1000:ctx=2048")
    assert spec.is_tiny and spec.text == "tiny:7:llama:noise=0.3:vocab=1000:ctx=2048"
    assert spec.tiny == TinySpec(7, "llama", noise=0.3, vocab=1000, ctx=2048)


def test_sources_are_kept_as_given() -> None:
    for text in ("qwen2.5-coder-1.5b-instruct", "./models/x", "org/name", "a.gguf", "tinyish"):
        spec = ModelSpec.parse(text)
        assert not spec.is_tiny and spec.source == text and str(spec) == text


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", r"non-empty string"),
        ("tiny:", r"bad tiny model spec 'tiny:'"),
        ("tiny:x", r"bad tiny model spec 'tiny:x'"),
        ("tiny:3:noise=abc", r"bad tiny model spec"),
        ("tiny:3:size=4", r"unknown option 'size'"),
        ("tiny:3:llama:qwen2", r"unexpected part 'qwen2'"),
        ("tiny:3:noise=-1", r"noise must be >= 0"),
        ("tiny:3:noise=nan", r"noise must be >= 0"),
        ("tiny:-1", r"seed must be >= 0"),
        ("tiny:3:vocab=1", r"vocab must be >= 2"),
        ("tiny:3:ctx=0", r"ctx must be >= 1"),
    ],
)
def test_malformed_specs_are_refused_with_a_reason(text: str, why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        ModelSpec.parse(text)


def test_tiny_builder_follows_the_parsed_spec() -> None:
    base = tiny_from_spec("tiny:3")
    assert base.config.vocab_size == 256
    wide = tiny_from_spec("tiny:3:vocab=300:ctx=64")
    assert wide.config.vocab_size == 300 and wide.config.max_position_embeddings == 64
    noisy = tiny_from_spec(ModelSpec.parse("tiny:3:noise=0.3").tiny or TinySpec(0))
    assert not torch.equal(noisy.lm_head.weight, base.lm_head.weight)
    with pytest.raises(InvalidArgument, match=r"not a tiny model spec"):
        tiny_from_spec("qwen2")


def test_load_spec_builds_tiny_models_without_locating() -> None:
    def no_locate(source: str) -> Path:
        raise AssertionError(f"a tiny spec was located: {source}")

    loaded = load_spec("tiny:3", "bf16", locate=no_locate)
    assert loaded.tokenizer is None and loaded.vocab == 256
    assert loaded.model.lm_head.weight.dtype == torch.bfloat16
    assert load_spec_tokenizer("tiny:3", locate=no_locate) is None
    with pytest.raises(InvalidArgument, match=r"dtype 'int4' is not supported"):
        load_spec("tiny:3", "int4", locate=no_locate)


def test_load_spec_reads_the_located_directory(tmp_path: Path) -> None:
    from tests.support.hf_tiny import save_hf_dir

    save_hf_dir("llama", tmp_path)
    asked: list[str] = []

    def locate(source: str) -> Path:
        asked.append(source)
        return tmp_path

    loaded = load_spec("my-model", torch.float32, locate=locate, tokenizer=False)
    assert asked == ["my-model"] and loaded.tokenizer is None
    assert loaded.model.config.model_type == "llama"
