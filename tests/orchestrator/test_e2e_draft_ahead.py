"""Draft-ahead through the stack: the draft replica drafts ahead while the target verifies,
and greedy output still equals target-only decoding.

The draft is the target itself, so every draft is accepted and every bonus guess is
right: the rounds can start from ahead drafts, and the draft replica's metrics must
show that they did.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from specserve.client import Client
from tests.orchestrator.redis_server import free_port
from tests.orchestrator.stack import TARGET, Reference, Stack, scrape

pytestmark = pytest.mark.redis


@pytest.fixture
def ahead_stack(redis_url: str) -> Iterator[tuple[Stack, int]]:
    """A stack whose draft drafts ahead; and the port of the draft's metrics."""
    draft_metrics = free_port()
    s = Stack(
        redis_url,
        draft_model=TARGET,
        draft_args=["--draft-ahead", "5", "--metrics-port", str(draft_metrics)],
    )
    try:
        yield s.start(), draft_metrics
    finally:
        s.stop()


def test_greedy_output_with_draft_ahead_equals_target_only(
    ahead_stack: tuple[Stack, int], reference: Reference
) -> None:
    stack, metrics_port = ahead_stack
    rng = random.Random(11)
    prompt = [rng.randrange(256) for _ in range(10)]
    expected = reference.decode(prompt, 48)
    with Client(stack.address, timeout_s=60) as c:
        got = c.generate(prompt, max_new_tokens=48, drafter="model", k=4)
    assert got.token_ids == expected
    assert got.usage.drafted_tokens > 0 and got.usage.accepted_tokens > 0

    def counter(name: str) -> float:
        return scrape(metrics_port, name)[""]

    assert counter("specserve_draft_ahead_tokens") > 0
    assert counter("specserve_draft_ahead_hits") > 0
    assert counter("specserve_draft_ahead_used_tokens") > 0
