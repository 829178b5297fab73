"""Replicas past a deadline: slow (still SERVING) is not lost.

Real gRPC on loopback: draft and target services that answer after the
deadline, with their health service saying SERVING or NOT_SERVING. A slow draft
replica costs the round its drafts but stays in the pool (taking it out would
move every session to k = 0 and make another replica rebuild their caches); one
whose health no longer says SERVING is lost and leaves the pool for a backoff.
A Verify cut short by its clients' deadline on a SERVING target has expired: the
target stays in the pool (without the cut it is lost and the batch fails over).
A warm-up records the length it sent, whatever the session committed while it ran.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.k_policy import KPolicy
from specserve.engine.sampling import SamplingParams
from specserve.orchestrator import calls
from specserve.orchestrator.calls import Plan
from specserve.orchestrator.replicas import EndpointSpec, ReplicaPool
from specserve.orchestrator.session import LiveSession
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


class SlowTarget(target_pb2_grpc.TargetServiceServicer):
    """Never answers Verify within the tests' deadlines."""

    async def Verify(self, request: target_pb2.VerifyRequest, context: Any) -> Any:
        await asyncio.sleep(2.0)
        return target_pb2.VerifyResponse()


class SlowDraft(draft_pb2_grpc.DraftServiceServicer):
    """Answers every session with one token after ``delay_s``; with ``forgetful``, asks
    for the whole history of every session that does not send it (an evicted cache)."""

    def __init__(self, delay_s: float, forgetful: bool = False) -> None:
        self.delay_s = delay_s
        self.forgetful = forgetful
        self.calls = 0

    async def Propose(self, request: draft_pb2.ProposeRequest, context: Any) -> Any:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        results = []
        for s in request.sessions:
            if self.forgetful and s.start > 0:
                status = common_pb2.SESSION_STATUS_NEEDS_HISTORY
                results.append(draft_pb2.DraftResult(session_id=s.session_id, status=status))
            else:
                status = common_pb2.SESSION_STATUS_OK
                results.append(
                    draft_pb2.DraftResult(session_id=s.session_id, status=status, tokens=[7])
                )
        return draft_pb2.ProposeResponse(results=results, replica_id="slow")


async def serve(servicer: SlowDraft | SlowTarget, serving: bool) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    if isinstance(servicer, SlowDraft):
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    else:
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else (health_pb2.HealthCheckResponse.NOT_SERVING)
    )
    await health.set("", status)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def live(sid: str, tokens: list[int]) -> LiveSession:
    state = DecodeState(sid, tokens, SamplingParams(), StopCriteria(64), KPolicy(4))
    return cast(LiveSession, SimpleNamespace(sid=sid, state=state))


async def pool_for(endpoint: str, role: str = "draft") -> ReplicaPool:
    stub = draft_pb2_grpc.DraftServiceStub if role == "draft" else target_pb2_grpc.TargetServiceStub
    pool = ReplicaPool(role, EndpointSpec.parse(endpoint, role), stub)
    await pool.start()
    return pool


@pytest.mark.parametrize("serving", [True, False])
def test_a_draft_past_its_deadline_is_lost_only_when_not_serving(serving: bool) -> None:
    async def body() -> None:
        server, endpoint = await serve(SlowDraft(delay_s=1.0), serving)
        pool = await pool_for(endpoint)
        try:
            s = live("a", [1, 2, 3])
            plans = await calls.propose(pool, endpoint, [(s, 4)], timeout_s=0.2)
            assert plans == {}  # no drafts this round either way
            assert (endpoint in pool.usable()) is serving
            assert s.state.draft_start == 0  # the replica may not hold anything new
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(body())


def test_a_warm_up_records_the_length_it_sent() -> None:
    async def body() -> None:
        draft = SlowDraft(delay_s=0.3)
        server, endpoint = await serve(draft, serving=True)
        pool = await pool_for(endpoint)
        try:
            s = live("a", list(range(40)))
            task = asyncio.create_task(calls.warm(pool, endpoint, [s], timeout_s=5.0))
            await asyncio.sleep(0.1)
            s.state.tokens.extend([41, 42])  # a k = 0 round committed meanwhile
            warm = await task
            assert warm == [s]
            assert s.state.draft_start == 40  # not 42: the replica has seen 40
            assert draft.calls == 1
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(body())


@pytest.mark.parametrize("cut", [True, False])
def test_a_verify_past_its_clients_deadline_expires_without_losing_the_target(cut: bool) -> None:
    async def body() -> None:
        server, endpoint = await serve(SlowTarget(), serving=True)
        pool = await pool_for(endpoint, "target")
        try:
            s = live("a", [1, 2, 3])
            out = await calls.verify(pool, endpoint, [(s, Plan())], 0.2, deadline_cut=cut)
            assert not out.verdicts and not out.errors
            assert out.expired is cut and out.lost is not cut
            assert (endpoint in pool.usable()) is cut
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(body())


def test_an_evicted_long_history_is_rebuilt_beside_the_round_not_in_it() -> None:
    async def body() -> None:
        draft = SlowDraft(delay_s=0.0, forgetful=True)
        server, endpoint = await serve(draft, serving=True)
        pool = await pool_for(endpoint)
        try:
            short, long = live("short", list(range(10))), live("long", list(range(40)))
            for s in (short, long):
                s.state.draft_start = len(s.state.tokens) - 1  # the replica forgot them
            plans = await calls.propose(pool, endpoint, [(short, 2), (long, 2)], 5.0)
            assert set(plans) == {"short"}  # resent whole at once: 10 tokens
            assert draft.calls == 2 and short.state.draft_start == 10
            assert long.state.draft_start == 0  # cold: no drafts, no prefill in this round
            assert await calls.warm(pool, endpoint, [long], 5.0) == [long]
            assert long.state.draft_start == 40 and draft.calls == 3
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(body())
