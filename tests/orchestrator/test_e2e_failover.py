"""Degradation end to end: a frozen or killed draft costs only speed; a lost target fails over.

The output must not change: greedy output equals target-only decoding whatever
happens to the replicas, and the client never sees an error.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from specserve.client import Client
from tests.orchestrator.stack import Reference, Stack, kv_used, redis_keys, stored_record

pytestmark = pytest.mark.redis

PROMPT = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]
LONG = 800


@pytest.fixture
def draft_stack(redis_url: str) -> Iterator[Stack]:
    s = Stack(redis_url, orchestrator_args=["--draft-timeout-s", "0.3"])
    try:
        yield s.start()
    finally:
        if s.draft is not None and s.draft.proc is not None:
            s.draft.proc.send_signal(signal.SIGCONT)
        s.stop()


def test_frozen_then_killed_draft_changes_nothing(draft_stack: Stack, reference: Reference) -> None:
    expected = reference.decode(PROMPT, LONG)
    draft = draft_stack.draft
    assert draft is not None and draft.proc is not None
    with Client(draft_stack.address, timeout_s=120) as c:
        stream = iter(c.stream(PROMPT, max_new_tokens=LONG, k=4))
        deltas = [next(stream)]
        draft.proc.send_signal(signal.SIGSTOP)  # past its deadline from now on
        deltas.append(next(stream))
        deltas.append(next(stream))
        draft.proc.kill()  # and then gone
        deltas.extend(stream)
        tokens = [t for d in deltas for t in d.token_ids]
        assert tokens == expected
        usage = deltas[-1].usage
        assert usage is not None and usage.accepted_tokens > 0
        # With no draft replica at all, sessions decode at k = 0.
        again = c.generate(PROMPT, max_new_tokens=40, k=4)
        assert again.token_ids == expected[:40]
        assert again.usage.drafted_tokens == 0
    fallbacks = draft_stack.metric("specserve_orchestrator_draft_fallbacks")
    assert sum(fallbacks.values()) > 0


def test_lost_target_fails_over_with_unchanged_output(
    two_targets: Stack, reference: Reference
) -> None:
    expected = reference.decode(PROMPT, LONG)
    keys_before = redis_keys(two_targets.redis_url)
    with Client(two_targets.address, timeout_s=120) as c:
        stream = iter(c.stream(PROMPT, max_new_tokens=LONG, k=4))
        first = next(stream)
        record = stored_record(two_targets.redis_url, first.session_id)
        assert record is not None and record.target.endpoint
        victim = next(t for t in two_targets.target_procs if t.address == record.target.endpoint)
        survivor = next(t for t in two_targets.target_procs if t is not victim)
        assert victim.proc is not None
        victim.proc.kill()
        deltas = [first, *stream]
        assert [t for d in deltas for t in d.token_ids] == expected
        assert deltas[-1].finish_reason == "length"
        usage = deltas[-1].usage  # the round lost with the target's stream was replayed
        assert usage is not None and usage.drafted_tokens > 0 and usage.accepted_tokens > 0
    failovers = two_targets.metric("specserve_orchestrator_target_failovers")
    assert sum(failovers.values()) >= 1
    deadline = time.monotonic() + 10
    while (
        kv_used(survivor.address, "target")[0] or redis_keys(two_targets.redis_url) != keys_before
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_device_failure_on_a_target_fails_over(redis_url: str, reference: Reference) -> None:
    """INTERNAL from a target whose health turns NOT_SERVING: replayed on the other one."""
    stack = Stack(redis_url, targets=2, target_args=[["--fail-after-forwards", "6"]])
    try:
        stack.start()
        expected = reference.decode(PROMPT, 60)
        with Client(stack.address, timeout_s=120) as c:
            got = c.generate(PROMPT, max_new_tokens=60, k=3)
        assert got.token_ids == expected
        assert got.usage.drafted_tokens > 0 and got.usage.accepted_tokens > 0
        failovers = stack.metric("specserve_orchestrator_target_failovers")
        assert sum(failovers.values()) >= 1
    finally:
        stack.stop()
