"""Multi-step plain decoding through the whole stack: a round without drafts decodes
several tokens in one Verify, and the output is what one-step rounds give.

The orchestrator runs ``--devices separate`` (8 plain steps a round) against a twin
with ``--plain-steps 1``; greedy, coupled and rejection-rule seeded sampling must
give the tokens target-only decoding gives in this process, on both.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from specserve.client import Client
from specserve.engine.sampling import SamplingParams, SamplingRule
from tests.orchestrator.stack import Reference, Stack

pytestmark = pytest.mark.redis

CASES = [
    ({}, SamplingParams()),
    (
        {"temperature": 0.8, "seed": 71, "rule": "coupled"},
        SamplingParams(temperature=0.8, seed=71, rule=SamplingRule.COUPLED),
    ),
    (
        {"temperature": 0.8, "seed": 72, "rule": "rejection"},
        SamplingParams(temperature=0.8, seed=72, rule=SamplingRule.REJECTION),
    ),
]


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(9)]


@pytest.fixture(params=[8, 1], ids=["8-steps", "1-step"])
def stepped(stack: Stack, request: pytest.FixtureRequest) -> Iterator[tuple[Stack, int]]:
    """An orchestrator of its own (its metrics count this test's rounds) over the
    session's replicas."""
    args = ["--plain-steps", str(request.param)]
    s = Stack(stack.redis_url, orchestrator_args=args, replicas=stack)
    try:
        yield s.start(), request.param
    finally:
        s.stop()


def test_plain_rounds_of_several_steps_equal_target_only(
    stepped: tuple[Stack, int], reference: Reference
) -> None:
    stack, steps = stepped
    with Client(stack.address, timeout_s=60) as c:
        for i, (kw, params) in enumerate(CASES):
            p = prompt(i)
            want = reference.decode(p, 21, params=params)
            got = c.generate(p, max_new_tokens=21, drafter="none", **kw)
            assert got.token_ids == want, kw
            assert got.usage.rounds == 21  # a step is a round, as one-step rounds count
    rounds = sum(stack.metric("specserve_orchestrator_rounds").values())
    stepped_rounds = sum(stack.metric("specserve_orchestrator_multi_step_rounds").values())
    if steps == 8:  # 21 tokens: the prefill's, then 8 + 8 + 4 steps
        assert stepped_rounds >= 2 * len(CASES) and rounds <= 4 * len(CASES)
    else:
        assert stepped_rounds == 0 and rounds >= 21 * len(CASES)
