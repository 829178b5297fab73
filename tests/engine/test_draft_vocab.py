"""A draft head over a reduced vocabulary: its kept logits are the full head's bits, the
others -inf; the vocabulary holds the special tokens and the corpus's frequent ones;
speculation with such a draft still equals target-only output (and drafts are
proposed and accepted), the draft proposing kept tokens only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from specserve.engine import model_drafter
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.draft_vocab import draft_vocabulary, kept_ids, reduce_draft_head
from specserve.engine.drafter import DraftInput
from specserve.engine.loader import load_tokenizer
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.quant import GGMLType
from specserve.engine.quant.synthetic import random_weight
from specserve.engine.sampling import SamplingParams, SamplingRule
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.tiny_tokenizer import EOS_ID, write_tiny_tokenizer
from specserve.engine.verifier import TargetVerifier
from specserve.policy.k_policy import KPolicy
from tests.support.tiny import noisy_copy, tiny_model

KEPT = [*range(0, 256, 2), 1, 3, 255]


def _logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    kv = model.new_kv_pool(1 << 20)
    kv.reserve({"s": len(ids)})
    return model([SeqInput("s", ids, num_logits=3)], kv)


@pytest.mark.parametrize("head", ["float32", "quantized"])
def test_a_restricted_head_keeps_the_bits_of_its_rows(head: str) -> None:
    model = tiny_model(0, "qwen2", hidden_size=256, intermediate_size=512, head_dim=64)
    if head == "quantized":
        del model.lm_head.weight
        model.lm_head.weight = random_weight(GGMLType.Q8_0, 256, 256, seed=1, scales=(1e-4, 1e-2))
    ids = [5, 9, 200, 17, 3, 44, 81]
    full = _logits(model, ids)
    model.restrict_head(KEPT)
    cut = _logits(model, ids)
    kept = torch.tensor(sorted(set(KEPT)))
    dropped = torch.ones(256, dtype=torch.bool)
    dropped[kept] = False
    assert torch.equal(cut[:, kept], full[:, kept])
    assert torch.isneginf(cut[:, dropped]).all()
    kv = model.new_kv_pool(1 << 20)
    kv.reserve({"s": len(ids)})
    only = model([SeqInput("s", ids, num_logits=3)], kv, kept_only=True)
    assert model.head_ids is not None and torch.equal(model.head_ids, kept)
    assert torch.equal(only, full[:, kept])  # the kept ids' columns, nothing else
    model.restrict_head(None)
    assert torch.equal(_logits(model, ids), full)
    with pytest.raises(ValueError, match="head token ids"):
        model.restrict_head([0, 256])


def test_the_draft_vocabulary_keeps_special_tokens_and_its_size(tmp_path: Path) -> None:
    tok = load_tokenizer(write_tiny_tokenizer(tmp_path / "tok"))
    ids = draft_vocabulary(tok, 64, 256)
    assert ids is not None and len(ids) == 64 and ids == sorted(set(ids))
    assert {0, 1, 2} <= set(ids) and max(ids) < 256
    # The corpus (Python sources) is mostly ASCII letters, spaces and newlines.
    assert {tok.encode(c)[0] for c in "e t\n"} <= set(ids)
    assert draft_vocabulary(tok, 0, 256) is None and draft_vocabulary(tok, 256, 256) is None
    model = tiny_model(0)
    assert reduce_draft_head(model, tok, 256, 256) == 256 and model._head_ids is None
    assert reduce_draft_head(model, None, 64, 256) == 256
    assert reduce_draft_head(model, tok, 64, 256) == 64 and model._head_ids is not None


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "coupled"])
def test_speculation_with_a_restricted_draft_head_equals_target_only(
    seed: int, sampled: bool
) -> None:
    """Greedy, and seeded sampling under the coupled rule (which commits the target-only
    sample whatever the draft proposed)."""
    target = tiny_model(seed, "qwen2" if seed else "llama")
    draft = noisy_copy(target, noise=0.1, seed=seed + 100)
    assert isinstance(draft.lm_head, nn.Linear)
    draft.restrict_head(KEPT)
    drafter = ModelDrafter(draft, 8 << 20)
    engine = SpeculativeEngine(TargetVerifier(target, 8 << 20), {"model": drafter})
    proposed: list[int] = []
    propose = drafter.propose

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = propose(*args, **kwargs)
        proposed.extend(t for o in out for t in o.proposal.tokens)
        return out

    drafter.propose = spy  # type: ignore[method-assign]
    prompt = [7, 8, 9, 10, 11, 12] * 3

    def run(kind: str, k: int) -> DecodeState:
        stop = StopCriteria(max_new_tokens=48, eos_ids=frozenset({EOS_ID}))
        params = (
            SamplingParams(0.7, top_k=40, top_p=0.95, seed=1000 + seed, rule=SamplingRule.COUPLED)
            if sampled
            else SamplingParams()
        )
        state = DecodeState(f"{kind}{k}", prompt, params, stop, KPolicy(k), drafter=kind)
        engine.run([state])
        return state

    plain, spec = run("none", 0), run("model", 4)
    assert spec.completion == plain.completion
    assert spec.stats.drafted > 0 and spec.stats.accepted > 0
    assert proposed and set(proposed) <= set(KEPT)


@pytest.mark.parametrize("vocab_limit", [None, 200])
def test_greedy_drafts_from_the_kept_ids_equal_drafts_from_the_full_rows(
    vocab_limit: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A greedy draft step reads only the kept ids' logits (argmax mapped back through
    the ascending ids; the confidence floor's top probability from them): the same drafts,
    stopped at the same floor, as the full rows give (``kept_ids`` forced to None)."""
    model = tiny_model(3, "qwen2")
    model.restrict_head(KEPT)
    limited = kept_ids(model.head_ids, vocab_limit)
    assert limited is not None and (vocab_limit is None) == (limited.columns is None)
    prompt = [7, 8, 9, 10, 11, 12] * 3

    def drafts(full: bool) -> list[list[int]]:
        if full:
            monkeypatch.setattr(model_drafter, "kept_ids", lambda *_: None)
        drafter = ModelDrafter(model, 8 << 20, vocab_limit=vocab_limit)
        out = []
        for floor in (0.0, 0.05, 0.3):
            x = DraftInput(f"s{floor}", 0, prompt, 6, SamplingParams(), 0, min_confidence=floor)
            out.append(drafter.propose([x])[0].proposal.tokens)
        monkeypatch.undo()
        return out

    kept, full = drafts(False), drafts(True)
    assert kept == full
    assert kept[0] and len(kept[0]) == 6 and any(len(d) < 6 for d in kept[1:]), kept
    assert all(t in KEPT and (vocab_limit is None or t < vocab_limit) for d in kept for t in d)
