"""Draft and target servers in separate processes reproduce the local engine exactly.

The round client drives a batch of sessions over real loopback channels; greedy
output, and every per-session count (rounds, drafted, accepted), must equal the
in-process :class:`SpeculativeEngine` on the same tiny models — and the output
must equal target-only decoding. Each test asserts drafts were accepted.
"""

from __future__ import annotations

import random

import pytest

from bench.round_client import RoundClient, RpcTiming
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.ngram import NgramDrafter
from specserve.engine.sampling import SamplingParams
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.tiny import tiny_from_spec
from specserve.engine.verifier import TargetVerifier
from specserve.policy.k_policy import KPolicy
from specserve.serving.launch import ServerProcess
from tests.services.conftest import DRAFT, TARGET, Stubs, run, sid

BUDGET = 8 << 20
NEW_TOKENS = 24


def prompts(seed: int, count: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        base = [rng.randrange(256) for _ in range(4 + 3 * i)]
        out.append(base * 3)  # repetition gives the n-gram drafter something to find
    return out


def states(drafter: str, k: int | None, seed: int = 0) -> list[DecodeState]:
    return [
        DecodeState(
            sid(), p, SamplingParams(), StopCriteria(NEW_TOKENS), KPolicy(k), drafter=drafter
        )
        for p in prompts(seed)
    ]


@pytest.fixture(scope="module")
def local() -> SpeculativeEngine:
    target = tiny_from_spec(TARGET)
    drafters = {
        "model": ModelDrafter(tiny_from_spec(DRAFT), BUDGET),
        "ngram": NgramDrafter(),
    }
    return SpeculativeEngine(TargetVerifier(target, BUDGET), drafters)


def remote(
    pair: tuple[ServerProcess, ServerProcess], sessions: list[DecodeState]
) -> list[RpcTiming]:
    calls: list[RpcTiming] = []

    async def go() -> None:
        async with Stubs(*pair) as stubs:
            await RoundClient(stubs.target, stubs.draft, on_rpc=calls.append).run(sessions)

    run(go())
    return calls


@pytest.mark.parametrize(("drafter", "k"), [("model", 4), ("model", None), ("ngram", 3)])
def test_remote_rounds_match_the_local_engine(
    pair: tuple[ServerProcess, ServerProcess], local: SpeculativeEngine, drafter: str, k: int | None
) -> None:
    expected = states(drafter, k)
    local.run(expected)
    plain = states("none", 0)
    local.run(plain)
    got = states(drafter, k)
    calls = remote(pair, got)

    for e, g, p in zip(expected, got, plain, strict=True):
        assert g.completion == e.completion == p.completion
        assert (g.stats.rounds, g.stats.drafted, g.stats.accepted) == (
            e.stats.rounds,
            e.stats.drafted,
            e.stats.accepted,
        )
    assert sum(s.stats.drafted for s in got) > 0
    assert sum(s.stats.accepted for s in got) > 0
    # One batched RPC per phase: the first round carried every session.
    assert calls[0].method == "Propose" and calls[0].sessions == len(got)
    assert calls[1].method == "Verify" and calls[1].batch_size >= len(got)


def test_prefill_then_rounds_match_target_only(
    pair: tuple[ServerProcess, ServerProcess], local: SpeculativeEngine
) -> None:
    plain = states("none", 0, seed=5)
    local.run(plain)
    got = states("model", 4, seed=5)

    async def go() -> list[list[int]]:
        async with Stubs(*pair) as stubs:
            client = RoundClient(stubs.target, stubs.draft)
            first = [tokens for _, tokens in await client.prefill(got)]
            await client.run(got)
            return first

    first = run(go())
    assert [f[0] for f in first] == [p.completion[0] for p in plain]
    assert [g.completion for g in got] == [p.completion for p in plain]
    assert sum(s.stats.accepted for s in got) > 0


def test_sampled_rounds_match_the_local_engine(
    pair: tuple[ServerProcess, ServerProcess], local: SpeculativeEngine
) -> None:
    """Sampled drafting sends sparse q over the wire; seeded draws match the local engine."""

    def sampled() -> list[DecodeState]:
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
        return [
            DecodeState(sid(), p, params, StopCriteria(NEW_TOKENS), KPolicy(4), drafter="model")
            for p in prompts(9, count=3)
        ]

    expected, got = sampled(), sampled()
    local.run(expected)
    remote(pair, got)
    assert [s.completion for s in got] == [s.completion for s in expected]
    assert [s.stats.accepted for s in got] == [s.stats.accepted for s in expected]
    assert sum(s.stats.accepted for s in got) > 0
