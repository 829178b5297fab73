"""Both servers on ``--device cuda``: the greedy tokens of the in-process engine on CUDA.

Marked ``gpu``: skipped where ``torch.cuda.is_available()`` is false. float32 on both
sides, so that the remote rounds can be compared draw for draw with the local engine
on the same device; the output must also equal target-only decoding, with drafts
accepted (docs/devices.md says what is claimed on CUDA).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from bench.round_client import RoundClient
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.sampling import SamplingParams
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.tiny import tiny_from_spec
from specserve.engine.verifier import TargetVerifier
from specserve.policy.k_policy import KPolicy
from specserve.serving.launch import ServerProcess
from tests.services.conftest import DRAFT, TARGET, Stubs, run, sid, start_all

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BUDGET = 8 << 20
NEW_TOKENS = 24
ON_CUDA = ["--threads", "1", "--kv-budget", "8MiB", "--dtype", "float32", "--device", "cuda"]


@pytest.fixture(scope="module")
def cuda_pair() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    target = ServerProcess("target", ["--model", TARGET, *ON_CUDA])
    draft = ServerProcess("draft", ["--model", DRAFT, *ON_CUDA])
    try:
        start_all(target, draft)
        yield target, draft
    finally:
        target.stop()
        draft.stop()


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(4 + 3 * i)] * 3 for i in range(3)]


def states(drafter: str, k: int) -> list[DecodeState]:
    return [
        DecodeState(
            sid(), p, SamplingParams(), StopCriteria(NEW_TOKENS), KPolicy(k), drafter=drafter
        )
        for p in prompts()
    ]


def test_both_servers_on_cuda_give_the_local_engines_greedy_tokens(
    cuda_pair: tuple[ServerProcess, ServerProcess],
) -> None:
    local = SpeculativeEngine(
        TargetVerifier(tiny_from_spec(TARGET).cuda(), BUDGET),
        {"model": ModelDrafter(tiny_from_spec(DRAFT).cuda(), BUDGET)},
    )
    plain, expected, got = states("none", 0), states("model", 4), states("model", 4)
    local.run(plain)
    local.run(expected)

    async def go() -> None:
        async with Stubs(*cuda_pair) as stubs:
            await RoundClient(stubs.target, stubs.draft).run(got)

    run(go())
    for g, e, p in zip(got, expected, plain, strict=True):
        assert g.completion == e.completion == p.completion
        assert g.stats.accepted == e.stats.accepted
    assert sum(s.stats.drafted for s in got) > 0
    assert sum(s.stats.accepted for s in got) > 0
