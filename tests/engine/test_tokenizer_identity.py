"""The pair rule: a draft must share its target's tokenizer, refused in one sentence.

Tiny Qwen3 GGUF files written offline (tests/support/hf_families.py) with the byte
tokenizer of tests/support/tiny_gguf.py, varied one way at a time: another EOS id,
another merged token, and the shipped pair's case, a target whose embedding has more
rows than the tokenizer has tokens (the converter's ``[PAD<id>]`` entries), which must
keep working: compared from GGUF metadata, from transformers' tokenizers, and through
the local loop.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.engine.errors import ModelLoadError
from specserve.engine.gguf_reader import GGUFCheckpoint
from specserve.engine.loader import check_compatible, load_tokenizer
from specserve.engine.sampling import SamplingParams
from specserve.engine.tokenizer_identity import (
    TokenizerIdentity,
    identity_of_gguf,
    identity_of_tokenizer,
    pair_difference,
)
from specserve.local import Completion, LocalConfig, LocalRunner
from tests.support.hf_families import family_reference, write_family_gguf

BUDGET = 8 << 20


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """target: 256 rows; padded: the same model with 64 more (zero) rows and padding
    entries; eos / merge: the target's tokenizer with another EOS id / merged token."""
    root = tmp_path_factory.mktemp("pairs")
    out = {name: root / f"{name}.gguf" for name in ("target", "padded", "eos", "merge")}
    padded = family_reference("qwen3", vocab_size=320)
    with torch.no_grad():  # rows no token reaches, zero as in a converted checkpoint
        padded.model.embed_tokens.weight[256:] = 0.0
        padded.lm_head.weight[256:] = 0.0
    ref = family_reference("qwen3")  # the padded model's first 256 rows: drafts accepted
    ref.load_state_dict(
        {k: v[:256] if v.shape[0] == 320 else v for k, v in padded.state_dict().items()}
    )
    write_family_gguf(out["target"], "qwen3", ref)
    write_family_gguf(out["padded"], "qwen3", padded)
    write_family_gguf(out["eos"], "qwen3", ref, tokenizer={"eos": 254})
    write_family_gguf(out["merge"], "qwen3", ref, tokenizer={"merge": "c d"})
    return out


def gguf_identity(path: Path) -> TokenizerIdentity:
    with GGUFCheckpoint(path) as checkpoint:
        identity = identity_of_gguf(checkpoint)
    assert identity is not None
    return identity


def one_sentence(text: str | None) -> str:
    assert text is not None and "\n" not in text and ". " not in text
    return text


def test_padding_rows_are_not_tokens(files: dict[str, Path]) -> None:
    """The shipped pair's case: one tokenizer, embeddings of 256 and 320 rows."""
    target, padded = gguf_identity(files["target"]), gguf_identity(files["padded"])
    assert target.vocab_size == padded.vocab_size == 256
    assert pair_difference(target, padded) is None
    assert pair_difference(padded, target) is None
    hf_target, hf_padded = load_tokenizer(files["target"]), load_tokenizer(files["padded"])
    assert (
        pair_difference(identity_of_tokenizer(hf_padded), identity_of_tokenizer(hf_target)) is None
    )
    assert check_compatible(hf_padded, hf_target) == hf_target.vocab_size


def test_another_eos_is_named(files: dict[str, Path]) -> None:
    text = pair_difference(gguf_identity(files["eos"]), gguf_identity(files["target"]))
    assert one_sentence(text) == (
        "draft and target tokenizers differ in their special tokens: "
        "EOS id 254 in the draft, 255 in the target"
    )


def test_another_token_is_named_by_its_id(files: dict[str, Path]) -> None:
    text = pair_difference(gguf_identity(files["merge"]), gguf_identity(files["target"]))
    assert one_sentence(text) == (
        "draft and target tokenizers differ: 1 of their 256 ids name other tokens, "
        "first id 253: 'cd' in the draft, 'ab' in the target"
    )


def test_another_vocabulary_size_is_named(files: dict[str, Path]) -> None:
    target = gguf_identity(files["target"])
    draft = TokenizerIdentity(target.tokens[:250], target.specials)
    text = pair_difference(draft, target)
    assert one_sentence(text) == (
        "draft and target tokenizers differ: the draft's has 250 tokens, the target's 256"
    )


def local(target: Path, draft: Path) -> LocalRunner:
    return LocalRunner(
        LocalConfig(
            str(target),
            str(draft),
            draft_dtype="float32",
            kv_budget_bytes=BUDGET,
            draft_kv_budget_bytes=BUDGET,
        )
    )


def test_local_loop_refuses_another_tokenizer(files: dict[str, Path]) -> None:
    with pytest.raises(ModelLoadError, match=r"^draft and target tokenizers differ"):
        local(files["target"], files["eos"])


def test_local_loop_keeps_a_pair_with_padded_rows(files: dict[str, Path]) -> None:
    """A draft of 256 rows for a target of 320 (the same model): speculation equals
    target-only, drafts accepted."""
    runner = local(files["padded"], files["target"])
    prompt = runner.encode("abc abc abc")

    def run(drafter: str, k: int) -> Completion:
        return runner.generate(
            prompt, SamplingParams(), max_new_tokens=12, drafter=drafter, k=k, ignore_eos=True
        )

    plain, spec = run("none", 0), run("model", 3)
    assert spec.tokens == plain.tokens
    assert spec.stats.drafted > 0 and spec.stats.accepted > 0
