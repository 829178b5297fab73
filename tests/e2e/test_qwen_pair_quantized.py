"""Slow: the real Qwen2.5-Coder pair with its GGUF blocks kept quantized, in local mode.

Run `specserve models fetch demo` first; skipped when the models are absent.
"""

from __future__ import annotations

import pytest
import torch

from specserve.engine.errors import NotFound
from specserve.engine.quantized_layers import quantized_bytes
from specserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
PROMPTS = [
    "def fibonacci(n):\n",
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same backwards."""\n',
    "Write a short note on why the sky is blue.\n",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def runner():
    from specserve.local import LocalConfig, LocalRunner
    from specserve.model_store import resolve

    try:
        resolve(TARGET)
        resolve(DRAFT)
    except NotFound as e:
        pytest.skip(str(e))
    torch.set_num_threads(2)
    r = LocalRunner(
        LocalConfig(target=f"{TARGET}:weights=quantized", draft=f"{DRAFT}:weights=quantized")
    )
    yield r
    torch.set_num_threads(1)


def test_quantized_pair_greedy_speculative_equals_target_only(runner) -> None:
    """Greedy speculative output equals target-only output with both models' blocks
    quantized; drafts were proposed and accepted."""
    # The target keeps its Q4_K / Q6_K blocks: about 1 GiB, not 6.6 GB of float32.
    assert 0.8e9 < quantized_bytes(runner.target) < 1.2e9
    greedy = SamplingParams()
    drafted = accepted = 0
    for prompt in PROMPTS:
        ids = runner.encode(prompt)
        plain = runner.generate(ids, greedy, max_new_tokens=NEW_TOKENS, drafter="none")
        spec = runner.generate(ids, greedy, max_new_tokens=NEW_TOKENS, drafter="model", k=4)
        print(
            f"{prompt[:24]!r}: acceptance {spec.acceptance_rate:.1%}, "
            f"{plain.tokens_per_second:.2f} -> {spec.tokens_per_second:.2f} tok/s"
        )
        assert spec.tokens == plain.tokens, prompt
        drafted += spec.stats.drafted
        accepted += spec.stats.accepted
    assert drafted > 0 and accepted > 0
