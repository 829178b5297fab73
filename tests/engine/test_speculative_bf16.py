"""What holds in bfloat16.

In bfloat16 a (k + 1)-token verify forward and a one-token forward round
differently, so greedy speculative output may leave target-only output. The
acceptance rule itself stays exact with respect to the logits the verify forward
computed; the property tested here is that a divergence can only happen where
target-only decoding faced a near-tie (top-2 logit gap within bfloat16 rounding).

On a CPU with the engine's kernels a model loaded in bfloat16 keeps bfloat16
weights but computes in float32 (``CausalLM.compute_in_float32``): there the
verify forward and the one-token forward agree bit for bit, and greedy speculative
output equals target-only output exactly, as in float32.
"""

from __future__ import annotations

import pytest
import torch

from specserve.engine import cpu_kernels, ops
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.drafter import DraftInput
from specserve.engine.model import SeqInput
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.sampling import SamplingParams
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.verifier import TargetVerifier
from specserve.policy.k_policy import KPolicy
from tests.support.tiny import noisy_copy, tiny_model

BUDGET = 8 << 20


def _top2_gaps(model, tokens: list[int], prompt_len: int) -> list[float]:
    """Top-1 minus top-2 logit at each completion position (one full forward)."""
    kv = model.new_kv_pool(BUDGET)
    kv.reserve({"g": len(tokens)})
    n = len(tokens) - prompt_len
    logits = model([SeqInput("g", tokens[:-1], num_logits=n)], kv)  # [n, vocab]
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


@pytest.mark.parametrize("seed", range(6))
def test_bf16_divergence_only_at_near_ties(seed: int) -> None:
    target = tiny_model(seed).to(torch.bfloat16)
    draft = noisy_copy(tiny_model(seed), 0.3, seed).to(torch.bfloat16)
    engine = SpeculativeEngine(
        TargetVerifier(target, BUDGET),
        {"model": ModelDrafter(draft, BUDGET, bfloat16_prefill=seed % 2 == 0)},
    )
    prompt = [(seed * 37 + i * 11) % 256 for i in range(ops.MAX_KERNEL_ROWS + 8)]

    def run(drafter: str, k: int) -> DecodeState:
        s = DecodeState(
            "s", prompt, SamplingParams(), StopCriteria(48), KPolicy(k), drafter=drafter
        )
        engine.run([s])
        return s

    plain, spec = run("none", 0), run("model", 4)
    assert spec.stats.drafted > 0 and spec.stats.accepted > 0
    first = next(
        (
            i
            for i, (a, b) in enumerate(zip(plain.completion, spec.completion, strict=True))
            if a != b
        ),
        None,
    )
    if first is None:
        return
    gaps = _top2_gaps(target, plain.tokens, len(prompt))
    scale = max(abs(g) for g in gaps) + 1.0
    assert gaps[first] <= 0.05 * scale, (
        f"diverged at {first} where target-only had a clear winner (gap {gaps[first]:.3f})"
    )


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no CPU kernels (AVX-512 / AVX2)")
@pytest.mark.parametrize("seed", range(4))
def test_bf16_weights_computed_in_float32_are_exact(seed: int) -> None:
    """Greedy output with a bfloat16 target and draft (float32 compute) equals the
    target's alone; the draft's prefill multiplies in bfloat16 on even seeds (the prompt
    is longer than the kernels' rows), which changes its guesses, not the output."""
    arch = "qwen2" if seed % 2 else "llama"
    target = tiny_model(seed, arch).to(torch.bfloat16)
    draft = noisy_copy(tiny_model(seed, arch), 0.3, seed).to(torch.bfloat16)
    for model in (target, draft):
        model.compute_in_float32()
        assert model.dtype == torch.bfloat16 and model.activation_dtype == torch.float32
    engine = SpeculativeEngine(
        TargetVerifier(target, BUDGET), {"model": ModelDrafter(draft, BUDGET)}
    )
    prompt = [(seed * 37 + i * 11) % 256 for i in range(12)]
    runs = {}
    for drafter, k in (("none", 0), ("model", 4)):
        s = DecodeState(
            "s", prompt, SamplingParams(), StopCriteria(48), KPolicy(k), drafter=drafter
        )
        engine.run([s])
        runs[drafter] = s
    assert runs["model"].stats.drafted > 0 and runs["model"].stats.accepted > 0
    assert runs["model"].completion == runs["none"].completion


def test_a_bfloat16_draft_prefills_in_bfloat16_where_the_cpu_multiplies_it_natively() -> None:
    """By default a draft with bfloat16 weights computing in float32 on a CPU prefills in
    bfloat16 products where the CPU has AMX or AVX512-BF16; its prefill then writes other
    K/V bits than the float32 products do, and its few-row draft steps do not change."""
    draft = tiny_model(3, "qwen2").to(torch.bfloat16)
    draft.compute_in_float32()
    assert ModelDrafter(draft, BUDGET).bfloat16_prefill == ops.native_bfloat16()
    assert not ModelDrafter(tiny_model(3, "qwen2"), BUDGET).bfloat16_prefill  # float32
    history = [(i * 7) % 256 for i in range(ops.MAX_KERNEL_ROWS + 8)]
    caches = []
    for flag in (False, True):
        drafter = ModelDrafter(draft, BUDGET, bfloat16_prefill=flag)
        drafter.propose([DraftInput("s", 0, history, 3, SamplingParams(), 0)])
        caches.append(drafter.kv.k[0].clone())  # a fresh pool: the same slots each time
    assert not torch.equal(caches[0], caches[1])
    assert torch.allclose(caches[0], caches[1], rtol=0.05, atol=0.05)
