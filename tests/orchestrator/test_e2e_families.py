"""Families beyond Llama through the whole stack: each as GGUF files, an F16 target and
a Q8_0 draft (blocks kept) of the same tiny model, served by the target and draft
servers behind the orchestrator on a real Redis. Greedy and seeded (coupled) output
through client -> orchestrator -> draft + target equals target-only decoding of the
target file in this process, with drafts proposed and accepted.

Qwen3 (q/k norm per head) and the mixture of experts Mixtral run with the suite; the
other families (Granite, OLMo 2, Phi-3, Gemma 2, Gemma 3, Qwen3-MoE) are marked
``slow`` (``make slow``, ``-m slow``) so that ``make test``'s time does not grow; one
stack at a time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specserve.client import Client
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.loader import load_model
from specserve.engine.sampling import SamplingParams
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.verifier import TargetVerifier
from specserve.policy.k_policy import KPolicy
from tests.orchestrator.stack import Stack
from tests.support.hf_families import family_reference, write_family_gguf

pytestmark = pytest.mark.redis

PROMPTS = [[5, 17, 99, 3, 200, 7, 64, 1], [9, 8, 7, 6, 5] * 3]
N = 24


SLOW_FAMILIES = ("granite", "olmo2", "phi3", "gemma2", "gemma3_text", "qwen3_moe")


@pytest.fixture(
    scope="module",
    params=["qwen3", "mixtral", *(pytest.param(f, marks=pytest.mark.slow) for f in SLOW_FAMILIES)],
)
def family_files(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """An F16 target and a Q8_0 draft GGUF file of the tiny family."""
    root = tmp_path_factory.mktemp(request.param)
    ref = family_reference(request.param)
    write_family_gguf(root / "target.gguf", request.param, ref, "F16")
    write_family_gguf(root / "draft.gguf", request.param, ref, "Q8_0")
    return root / "target.gguf", root / "draft.gguf"


@pytest.fixture(scope="module")
def family_stack(redis_url: str, family_files: tuple[Path, Path]) -> Iterator[Stack]:
    """The family's stack; pytest stops one family's before it starts the next's."""
    target, draft = family_files
    s = Stack(redis_url, target_model=str(target), draft_model=str(draft))
    try:
        yield s.start()
    finally:
        s.stop()


def target_only(target: Path, prompt: list[int], params: SamplingParams) -> list[int]:
    model, _ = load_model(target, torch.float32, huge_pages=False)
    engine = SpeculativeEngine(TargetVerifier(model, 8 << 20), {})
    state = DecodeState("ref", prompt, params, StopCriteria(N), KPolicy(0), drafter="none")
    engine.run([state])
    return state.completion


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_family_through_the_stack_equals_target_only(
    family_stack: Stack, family_files: tuple[Path, Path], seeded: bool
) -> None:
    """Mixtral: a mixture of experts served on the servers' eager path (no static step,
    no one-op layer), experts routed per row, drafts verified in batches."""
    drafted = accepted = 0
    with Client(family_stack.address, timeout_s=120) as c:
        for i, p in enumerate(PROMPTS):
            sampled = {"temperature": 0.7, "top_k": 40, "seed": 300 + i} if seeded else {}
            got = c.generate(p, max_new_tokens=N, drafter="model", k=4, **sampled)
            params = SamplingParams(0.7, 40, seed=300 + i) if seeded else SamplingParams()
            assert got.token_ids == target_only(family_files[0], p, params)
            drafted += got.usage.drafted_tokens
            accepted += got.usage.accepted_tokens
    assert drafted > 0 and accepted > 0
