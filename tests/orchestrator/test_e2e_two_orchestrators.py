"""Two orchestrator replicas on one Redis: sessions move between them, cancel reaches across."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from specserve.client import Client
from specserve.orchestrator.launch import OrchestratorProcess
from tests.orchestrator.stack import ENV, Reference, Stack, redis_keys

pytestmark = pytest.mark.redis

PROMPT = [40, 41, 42, 40, 41, 42]


@pytest.fixture
def second(stack: Stack) -> Iterator[OrchestratorProcess]:
    """Another orchestrator over the same replicas and the same Redis."""
    assert stack.draft is not None
    args = [
        "--target",
        stack.target_procs[0].address,
        "--draft",
        stack.draft.address,
        "--redis-url",
        stack.redis_url,
    ]
    proc = OrchestratorProcess(args, env=ENV)
    try:
        proc.start().wait_serving()
        yield proc
    finally:
        proc.stop()


def test_a_session_continues_on_another_replica(
    stack: Stack, second: OrchestratorProcess, reference: Reference
) -> None:
    first = reference.decode(PROMPT, 10)
    then = reference.decode([*PROMPT, *first, 3, 4], 10)
    with Client(stack.address, timeout_s=60) as a, Client(second.address, timeout_s=60) as b:
        t1 = a.generate(PROMPT, max_new_tokens=10, keep_session=True, k=3)
        assert t1.token_ids == first
        info = b.get_session(t1.session_id)
        assert info.tokens == len(PROMPT) + 10 and info.seed == a.get_session(t1.session_id).seed
        t2 = b.generate([3, 4], session_id=t1.session_id, max_new_tokens=10, keep_session=True)
        assert t2.token_ids == then
        assert t2.usage.accepted_tokens > 0
        assert a.close_session(t1.session_id)


def test_cancel_on_one_replica_stops_a_generation_on_the_other(
    stack: Stack, second: OrchestratorProcess
) -> None:
    before = redis_keys(stack.redis_url)
    with Client(stack.address, timeout_s=60) as a, Client(second.address, timeout_s=60) as b:
        stream = iter(a.stream(PROMPT, max_new_tokens=4000, drafter="none"))
        sid = next(stream).session_id
        assert b.get_session(sid).state == 1  # ACTIVE
        assert b.cancel(sid)
        rest = list(stream)
        assert rest[-1].finish_reason == "cancelled"
    assert redis_keys(stack.redis_url) == before
