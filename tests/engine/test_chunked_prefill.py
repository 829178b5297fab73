"""Chunked prefill and key-blocked attention: exact where it matters, linear memory.

What holds, measured on the tiny models (float32, CPU):

* a forward of at most ``prefill_chunk_tokens`` new tokens is bit-identical with
  chunking on or off (the same code runs);
* a longer prompt run in chunks gives logits within 1e-5 of the one-forward run and
  the same greedy tokens (the chunks' products and attention sum in another order);
* :func:`blocked_attention` equals SDPA within 1e-5 (online softmax over blocks), and
  the explicit capped attention with a score soft-cap;
* the lossless property: speculative decoding equals target-only decoding, token for
  token, with chunking on (the same configuration on both sides), drafts accepted;
* a prompt sent over several verifies (the orchestrator's chunked prefill, chunks of
  any size, beside another session) decodes the greedy tokens of one prefill.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from specserve.engine.attention import blocked_attention, capped_attention
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.rejection import Proposal
from specserve.engine.sampling import SamplingParams
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.verifier import TargetVerifier, VerifyInput
from specserve.policy.k_policy import KPolicy
from tests.support.tiny import noisy_copy, tiny_model

BUDGET = 16 << 20


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def logits(model: CausalLM, chunk: int | None, seqs: list[tuple[str, list[int], int]]):
    model.prefill_chunk_tokens = chunk
    kv = model.new_kv_pool(BUDGET)
    kv.reserve({sid: len(t) for sid, t, _ in seqs})
    return model([SeqInput(sid, t, n) for sid, t, n in seqs], kv)


@pytest.mark.parametrize("n", [1, 64, 512])
def test_prompts_within_a_chunk_are_bit_identical(n: int) -> None:
    model = tiny_model(3)
    seqs = [("a", prompt(n), 1), ("b", prompt(max(1, n // 2), 1), 1)]
    assert torch.equal(logits(model, None, seqs), logits(model, 512, seqs))


@pytest.mark.parametrize(("n", "chunk"), [(600, 512), (1300, 256), (5000, 512)])
def test_chunked_prompts_match_the_one_forward_run(n: int, chunk: int) -> None:
    model = tiny_model(3)
    seqs = [("long", prompt(n), 5), ("short", prompt(30, 1), 3)]
    whole = logits(model, None, seqs)
    chunked = logits(model, chunk, seqs)
    diff = (whole - chunked).abs().max().item()
    print(f"{n} tokens in chunks of {chunk}: max |logit difference| {diff:.2e}")
    assert diff < 1e-5
    assert torch.equal(whole.argmax(-1), chunked.argmax(-1))


def test_a_chunk_keeps_the_logits_it_owes() -> None:
    """A session whose num_logits straddles a chunk boundary still gets them all."""
    model = tiny_model(3)
    seqs = [("s", prompt(130), 9)]
    whole = logits(model, None, seqs)
    chunked = logits(model, 64, seqs)  # 130 = 64 + 57 + 9: the last piece keeps 9 rows
    assert chunked.shape == whole.shape == (9, 256)
    assert (whole - chunked).abs().max().item() < 1e-5


@pytest.mark.parametrize("block", [7, 64, 1000])
def test_blocked_attention_equals_sdpa(block: int) -> None:
    gen = torch.Generator().manual_seed(0)
    b, heads, kv_heads, n, keys, d = 2, 4, 2, 37, 300, 16
    q = torch.randn(b, heads, n, d, generator=gen)
    k = torch.randn(b, kv_heads, keys, d, generator=gen)
    v = torch.randn(b, kv_heads, keys, d, generator=gen)
    q_pos = torch.arange(keys - n, keys).view(1, n, 1)
    mask = (torch.arange(keys).view(1, 1, keys) <= q_pos).expand(b, n, keys).clone()
    mask[1, :, 250:] = False  # a shorter session in the batch
    mask[1, :, 0] = True
    mask = mask.unsqueeze(1)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = blocked_attention(q, k, v, mask, block=block)
    assert (want - got).abs().max().item() < 1e-5
    # With a score soft-cap (Gemma 2): the explicit capped attention's function, and
    # the cap (scores here reach ~4 times it) changes the output. capped_attention with
    # no binding cap is SDPA.
    capped = capped_attention(3 * q, k, v, mask, 2.0)
    assert (
        capped - blocked_attention(3 * q, k, v, mask, block=block, softcap=2.0)
    ).abs().max() < 1e-5
    assert (capped - blocked_attention(3 * q, k, v, mask, block=block)).abs().max() > 1e-2
    assert (want - capped_attention(q, k, v, mask, 1e6)).abs().max().item() < 1e-5


def test_speculative_equals_target_only_with_chunked_prefill() -> None:
    target = tiny_model(5)
    draft = noisy_copy(target, noise=0.3, seed=105)
    target.prefill_chunk_tokens = draft.prefill_chunk_tokens = 128
    engine = SpeculativeEngine(
        TargetVerifier(target, BUDGET), {"model": ModelDrafter(draft, BUDGET)}
    )
    prompts = [prompt(700, 7), prompt(300, 8) * 2]

    def decode(drafter: str, k: int | None) -> list[DecodeState]:
        states = [
            DecodeState(
                f"{drafter}{i}",
                p,
                SamplingParams(),
                StopCriteria(max_new_tokens=40),
                KPolicy(k),
                drafter=drafter,
            )
            for i, p in enumerate(prompts)
        ]
        engine.run(states)
        return states

    plain = decode("none", 0)
    spec = decode("model", 4)
    for p, s in zip(plain, spec, strict=True):
        assert s.completion == p.completion
    assert sum(s.stats.drafted for s in spec) > 0
    assert sum(s.stats.accepted for s in spec) > 0


def greedy_after_prefill(
    verifier: TargetVerifier, sid: str, tokens: list[int], chunks: list[int], n: int
) -> list[int]:
    """Send ``tokens`` to the target a chunk per verify (the orchestrator's chunked
    prefill: each verdict dropped), then decode ``n`` tokens greedily, one verify each,
    beside another session decoding in the same batches."""
    assert sum(chunks) < len(tokens)
    tokens = list(tokens)
    other = [5, 6, 7]
    start = 0
    for c in chunks:
        part = VerifyInput(sid, start, tokens[start : start + c], Proposal([]), SamplingParams(), 0)
        bystander = VerifyInput(f"{sid}-other", 0, other, Proposal([]), SamplingParams(), 0)
        verifier.verify([part, bystander])
        start += c
    out = []
    for i in range(n):
        x = VerifyInput(sid, start, tokens[start:], Proposal([]), SamplingParams(), i)
        [outcome] = verifier.verify([x])
        assert outcome.verdict is not None
        start = len(tokens)
        tokens.append(outcome.verdict.next_token)
        out.append(outcome.verdict.next_token)
    return out


@pytest.mark.parametrize("chunks", [[1000, 1, 333, 2047], [512, 512, 512], [37] * 20])
def test_a_prompt_prefilled_over_several_verifies_decodes_as_one_prefill(
    chunks: list[int],
) -> None:
    """The orchestrator's chunks need not align with the engine's (512): the cache
    then differs from one prefill's by float32 rounding, and the greedy tokens agree."""
    model = tiny_model(3)
    tokens = prompt(4000, 11)
    whole = greedy_after_prefill(TargetVerifier(model, BUDGET), "s", tokens, [], 24)
    chunked = greedy_after_prefill(TargetVerifier(model, BUDGET), "s", tokens, chunks, 24)
    assert chunked == whole
