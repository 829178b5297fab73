"""Greedy speculative output equals target-only output, token for token.

Each test also asserts that drafts were proposed and some accepted, so it cannot
pass by never speculating.
"""

from __future__ import annotations

import pytest

from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.ngram import NgramDrafter
from specserve.engine.sampling import SamplingParams
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.verifier import TargetVerifier
from specserve.policy.k_policy import KPolicy
from specserve.policy.round_cost import RoundCosts
from tests.support.tiny import noisy_copy, tiny_model

BUDGET = 8 << 20
GREEDY = SamplingParams()


def _decode(engine: SpeculativeEngine, prompts, *, drafter: str, k: int | None, n: int = 40):
    states = [
        DecodeState(f"s{i}", p, GREEDY, StopCriteria(max_new_tokens=n), KPolicy(k), drafter=drafter)
        for i, p in enumerate(prompts)
    ]
    engine.run(states)
    return states


def _prompts(seed: int, count: int = 3) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    out = []
    for i in range(count):
        base = [rng.randrange(256) for _ in range(5 + 3 * i)]
        out.append(base * 3)  # repetition gives the n-gram drafter something to find
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 8])
def test_model_drafter_matches_target_only(seed: int, k: int) -> None:
    target = tiny_model(seed, "qwen2" if seed % 2 else "llama")
    draft = noisy_copy(target, noise=0.3, seed=seed + 100)
    engine = SpeculativeEngine(
        TargetVerifier(target, BUDGET), {"model": ModelDrafter(draft, BUDGET)}
    )
    prompts = _prompts(seed)
    plain = _decode(engine, prompts, drafter="none", k=0)
    spec = _decode(engine, prompts, drafter="model", k=k)
    for p, s in zip(plain, spec, strict=True):
        assert s.completion == p.completion
        assert p.stats.drafted == 0
    assert sum(s.stats.drafted for s in spec) > 0
    assert sum(s.stats.accepted for s in spec) > 0
    # Batched across sessions: the target saw several sessions per round.
    assert max(engine.timing.batch_sizes) == len(prompts)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_ngram_drafter_matches_target_only(seed: int, k: int) -> None:
    target = tiny_model(seed + 10, "mistral" if seed % 2 else "qwen2")
    engine = SpeculativeEngine(TargetVerifier(target, BUDGET), {"ngram": NgramDrafter()})
    prompts = _prompts(seed)
    plain = _decode(engine, prompts, drafter="none", k=0, n=60)
    spec = _decode(engine, prompts, drafter="ngram", k=k, n=60)
    for p, s in zip(plain, spec, strict=True):
        assert s.completion == p.completion
    assert sum(s.stats.drafted for s in spec) > 0
    assert sum(s.stats.accepted for s in spec) > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_adaptive_k_matches_target_only(seed: int) -> None:
    target = tiny_model(seed + 20)
    draft = noisy_copy(target, noise=0.2, seed=seed)
    engine = SpeculativeEngine(
        TargetVerifier(target, BUDGET), {"model": ModelDrafter(draft, BUDGET)}
    )
    prompts = _prompts(seed, count=2)
    plain = _decode(engine, prompts, drafter="none", k=0)
    spec = _decode(engine, prompts, drafter="model", k=None)
    assert [s.completion for s in spec] == [p.completion for p in plain]
    assert sum(s.stats.accepted for s in spec) > 0


def test_identical_draft_accepts_everything() -> None:
    target = tiny_model(7)
    engine = SpeculativeEngine(
        TargetVerifier(target, BUDGET), {"model": ModelDrafter(noisy_copy(target, 0.0, 0), BUDGET)}
    )
    (s,) = _decode(engine, _prompts(7, 1), drafter="model", k=4, n=40)
    assert s.stats.drafted == s.stats.accepted == 32
    assert s.stats.mean_acceptance_length == 5.0


def test_caches_are_released_after_a_run() -> None:
    target = tiny_model(8)
    verifier = TargetVerifier(target, BUDGET)
    drafter = ModelDrafter(noisy_copy(target, 0.3, 1), BUDGET)
    engine = SpeculativeEngine(verifier, {"model": drafter})
    _decode(engine, _prompts(8), drafter="model", k=3)
    assert verifier.kv_stats().blocks_used == 0 and drafter.kv_stats().blocks_used == 0
    assert drafter.sessions() == 0


def test_measured_round_costs_time_lone_decode_rounds_and_keep_the_output() -> None:
    target = tiny_model(21)
    draft = noisy_copy(target, 0.2, 3)
    # First a fit that never answers: k then follows acceptance alone, as with static
    # costs, so which rounds prefill is fixed and every other one must be timed.
    costs = RoundCosts(min_rounds=10**9)
    engine = SpeculativeEngine(
        TargetVerifier(target, BUDGET), {"model": ModelDrafter(draft, BUDGET)}, costs=costs
    )
    prompts = _prompts(3, count=2)
    plain = _decode(engine, prompts, drafter="none", k=0)  # a batch of two: not timed
    assert costs.rounds == 0
    drafted: list[list[int]] = []  # per session, each round's drafts
    propose = engine.drafters["model"].propose

    def recording(inputs):  # type: ignore[no-untyped-def]
        out = propose(inputs)
        drafted[-1].append(len(out[0].proposal.tokens) if out[0].proposal else 0)
        return out

    engine.drafters["model"].propose = recording  # type: ignore[method-assign]
    spec = []
    for p in prompts:
        drafted.append([])
        spec.append(_decode(engine, [p], drafter="model", k=None)[0])
    assert [s.completion for s in spec] == [p.completion for p in plain]
    assert sum(s.stats.drafted for s in spec) > 0 and sum(s.stats.accepted for s in spec) > 0
    # Every round but the prefills, and but a drafting round after a plain one (its draft
    # also catches up on the plain rounds' tokens).
    timed = [r for ks in drafted for r in range(1, len(ks)) if ks[r] == 0 or ks[r - 1] > 0]
    assert costs.rounds == len(timed)
    # Then the real fit: the policies plan with it once the rounds tell, output unchanged.
    engine.costs = RoundCosts()
    again = [_decode(engine, [p], drafter="model", k=None)[0] for p in prompts]
    assert [s.completion for s in again] == [p.completion for p in plain]
    assert engine.costs.model() is not None
    assert again[-1].k_policy.cost is not again[-1].k_policy.static
