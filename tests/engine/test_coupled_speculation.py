"""Seeded sampled output equals target-only seeded output, token for token (coupled rule).

The local engine on tiny models (the draft a noisy copy of the target, so it agrees
often): every k from 1 to 8, adaptive k, the draft model and the n-gram drafter,
mixed batches. Each test also asserts that drafts were proposed and accepted, so it
cannot pass by never speculating. The rejection rule is the contrast: its tokens
change with k.
"""

from __future__ import annotations

import random

import pytest

from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.ngram import NgramDrafter
from specserve.engine.sampling import SamplingParams, SamplingRule
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.verifier import TargetVerifier
from specserve.policy.k_policy import KPolicy
from tests.support.tiny import noisy_copy, tiny_model

BUDGET = 8 << 20
N = 40


@pytest.fixture(scope="module")
def engine() -> SpeculativeEngine:
    target = tiny_model(3)
    draft = noisy_copy(target, noise=0.3, seed=103)
    return SpeculativeEngine(
        TargetVerifier(target, BUDGET),
        {"model": ModelDrafter(draft, BUDGET), "ngram": NgramDrafter()},
    )


def prompts(count: int = 3) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(256) for _ in range(4 + 2 * i)] * 3 for i in range(count)]


def params(i: int, temperature: float = 0.7, rule: SamplingRule = SamplingRule.COUPLED):
    return SamplingParams(temperature, top_k=40, top_p=0.95, seed=1000 + i, rule=rule)


def decode(
    engine: SpeculativeEngine,
    cases: list[tuple[list[int], SamplingParams, str, int | None]],  # prompt, params, drafter, k
) -> list[DecodeState]:
    """Decode the cases together in one batch; each session's states, in order."""
    states = [
        DecodeState(f"s{i}", p, sp, StopCriteria(N), KPolicy(k), drafter=d)
        for i, (p, sp, d, k) in enumerate(cases)
    ]
    engine.run(states)
    return states


def target_only(
    engine: SpeculativeEngine,
    rule: SamplingRule = SamplingRule.COUPLED,
    temperature: float = 0.7,
) -> list[list[int]]:
    cases = [(p, params(i, temperature, rule), "none", 0) for i, p in enumerate(prompts())]
    return [s.completion for s in decode(engine, cases)]


# Sampled text from a tiny random model repeats itself (and so feeds the n-gram
# drafter) only at a low temperature.
TEMPERATURE = {"model": 0.7, "ngram": 0.3}


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 8, None], ids=lambda k: f"k={k}")
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_coupled_output_is_target_only_output(engine: SpeculativeEngine, drafter: str, k) -> None:
    t = TEMPERATURE[drafter]
    want = target_only(engine, temperature=t)
    spec = decode(engine, [(p, params(i, t), drafter, k) for i, p in enumerate(prompts())])
    assert [s.completion for s in spec] == want
    assert sum(s.stats.drafted for s in spec) > 0
    assert sum(s.stats.accepted for s in spec) > 0


def test_batch_neighbours_change_nothing(engine: SpeculativeEngine) -> None:
    """One session alone, then beside greedy, rejection-rule and other-seed sessions."""
    p = prompts()[0]
    alone = decode(engine, [(p, params(0), "model", 4)])[0]
    crowd = decode(
        engine,
        [
            (prompts()[1], SamplingParams(), "model", 2),
            (p, params(0), "model", 4),
            (prompts()[2], params(5, 1.2, SamplingRule.REJECTION), "model", None),
            (p, params(9, 0.7), "ngram", 3),
            (prompts()[1], params(1), "none", 0),
        ],
    )
    assert crowd[1].completion == alone.completion
    assert alone.stats.accepted > 0 and crowd[1].stats.accepted > 0


def test_the_rejection_rule_stays_selectable_and_differs(engine: SpeculativeEngine) -> None:
    """Under the rejection rule the same seed gives other tokens than target-only
    sampling with k drafts (its draws depend on the rounds); coupled gives the same."""
    want = target_only(engine, SamplingRule.REJECTION)
    rule = SamplingRule.REJECTION
    spec = decode(engine, [(p, params(i, rule=rule), "model", 4) for i, p in enumerate(prompts())])
    assert [s.completion for s in spec] != want
    assert sum(s.stats.accepted for s in spec) > 0


def test_a_draft_that_is_the_target_is_almost_always_accepted() -> None:
    """Draft and target draw with the same noise at the same positions: with q = p the
    draft's choice is the target's (but for float ties), so nearly every draft is kept."""
    target = tiny_model(3)
    engine = SpeculativeEngine(
        TargetVerifier(target, BUDGET), {"model": ModelDrafter(target, BUDGET, max_support=256)}
    )
    spec = decode(engine, [(p, params(i, 1.0), "model", 4) for i, p in enumerate(prompts())])
    drafted = sum(s.stats.drafted for s in spec)
    assert drafted > 0
    assert sum(s.stats.accepted for s in spec) / drafted > 0.95
