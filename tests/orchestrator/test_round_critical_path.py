"""From a Verify's answer to the lane's next call: nothing runs in between but what
decides that call.

Fake replicas (data-plane streams that note each call as it is handed over and answer
after a short emulated device time) and the embedded store. Round r + 1's first call
(its Verify in plain rounds, its Propose when the session drafts) is sent before round
r's commit builds its record or reaches the store, and before the runner counts round
r; the commit still settles before round r + 1 applies its verdicts, so every token is
stored once, in order, and reaches the client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest

from specserve.engine.decode_state import DecodeState, FinishReason, StopCriteria
from specserve.engine.sampling import SamplingParams
from specserve.orchestrator.fleet.replicas import EndpointSpec, Replica, ReplicaPool
from specserve.orchestrator.fleet.scheduler import Scheduler
from specserve.orchestrator.round.runner import RoundRunner
from specserve.orchestrator.session import Ended, LiveSession
from specserve.orchestrator.store.redis_settings import embedded_client
from specserve.orchestrator.store.session_store import SessionStore
from specserve.orchestrator.types import Usage
from specserve.policy.k_policy import KPolicy
from specserve.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    generate_pb2,
    session_pb2,
    target_pb2,
    target_pb2_grpc,
)

OK = common_pb2.SESSION_STATUS_OK
NEW_TOKENS = 10

Events = list[tuple[str, int]]  # (what happened, rounds the runner had counted by then)


class FakeStream:
    """One replica's data-plane stream: notes ``"<name> sent"`` in ``events`` as a call is
    handed over (before its caller yields), answers after ``device_s``: every draft token
    7, every draft accepted, then token 5."""

    def __init__(self, name: str, events: Events, device_s: float = 0.002) -> None:
        self.name = name
        self.events = events
        self.device_s = device_s
        self.counted: Callable[[], int] = lambda: 0

    async def call(self, request: Any, timeout: float | None = None) -> Any:
        self.events.append((f"{self.name} sent", self.counted()))
        await asyncio.sleep(self.device_s)
        if self.name == "propose":
            return draft_pb2.ProposeResponse(
                results=[
                    draft_pb2.DraftResult(session_id=s.session_id, status=OK, tokens=[7] * s.k)
                    for s in request.sessions
                ]
            )
        results = [
            target_pb2.VerifyResult(
                session_id=s.session_id, status=OK, accepted=len(s.draft_tokens), next_token=5
            )
            for s in request.sessions
        ]
        return target_pb2.VerifyResponse(results=results, batch_size=len(results))


def fake_runner(events: Events) -> RoundRunner:
    """A runner over one fake draft and one fake target replica and the embedded store;
    each commit is noted in ``events`` as it reaches the store."""
    pools = []
    for role, endpoint, stub in (
        ("draft", "127.0.0.1:1", draft_pb2_grpc.DraftServiceStub),
        ("target", "127.0.0.1:2", target_pb2_grpc.TargetServiceStub),
    ):
        replicas = ReplicaPool(role, EndpointSpec.parse(endpoint, role), stub)  # never started
        stream: Any = FakeStream("propose" if role == "draft" else "verify", events)
        channel: Any = None  # never used: the calls go over the fake stream
        replicas.replicas[endpoint] = Replica(endpoint, channel, None, stream)
        pools.append((replicas, stream))
    (drafts, propose), (targets, verify) = pools
    runner = RoundRunner(Scheduler(), drafts, targets, SessionStore(embedded_client()))
    propose.counted = verify.counted = lambda: runner.stats.rounds
    real = runner.store.commit_many

    async def commit_many(*a: Any, **kw: Any) -> Any:
        events.append(("commit", runner.stats.rounds))
        return await real(*a, **kw)

    runner.store.commit_many = commit_many  # type: ignore[method-assign]
    return runner


def expected_completion(k: int) -> list[int]:
    """What the fakes make of a turn: k drafts (fewer near the end), all accepted, then 5."""
    out: list[int] = []
    while len(out) < NEW_TOKENS:
        left = NEW_TOKENS - len(out)
        out += [7] * min(k, left - 1) + [5]
    return out


@pytest.mark.parametrize("k", [0, 2], ids=["plain", "drafting"])
def test_the_next_call_is_sent_before_the_last_rounds_commit_and_counts(
    k: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="specserve.orchestrator.round.runner")

    async def body() -> None:
        events: Events = []
        runner = fake_runner(events)
        record = await runner.store.create(
            session_pb2.SessionRecord(
                session_id="a", tokens=[1, 2, 3], state=generate_pb2.SESSION_STATE_ACTIVE, keep=True
            )
        )
        state = DecodeState(
            "a",
            [1, 2, 3],
            SamplingParams(),
            StopCriteria(NEW_TOKENS),
            KPolicy(k, k_max=4),  # the request's k: drafted as given
            drafter="model" if k else "none",
        )
        s = LiveSession(
            record, state, prompt_tokens=3, base_usage=Usage(), pre_turn=None, deadline=None
        )
        runner.submit(s)
        got: list[int] = []
        while not isinstance(item := await asyncio.wait_for(s.outbox.get(), 10), Ended):
            got.extend(item)
        await runner.close()

        assert item == Ended(FinishReason.LENGTH)
        assert got == expected_completion(k)
        stored = await runner.store.get("a")
        assert stored is not None and list(stored.tokens) == [1, 2, 3, *got]
        assert ("propose sent" in (e for e, _ in events)) is bool(k)
        verifies = [i for i, (e, _) in enumerate(events) if e == "verify sent"]
        commits = [i for i, (e, _) in enumerate(events) if e == "commit"]
        # One commit per round, then the kept session's final record.
        assert len(verifies) + 1 == len(commits) and len(verifies) == runner.stats.rounds > 1
        for r in range(len(verifies) - 1):
            # Round r + 1's first call went out before round r's commit reached the store
            # and before round r was counted.
            first = next(i for i in range(verifies[r] + 1, len(events)) if "sent" in events[i][0])
            assert first < commits[r], events
            assert events[first][1] == r, events

    asyncio.run(body())
    counted = [r for r in caplog.records if r.getMessage().startswith("round on")]
    assert len(counted) >= 2, caplog.text  # the runner's count logged each round
