"""Replicas past a deadline: slow (still SERVING) is not lost.

Real gRPC on loopback: draft and target services that answer after the
deadline, with their health service saying SERVING or NOT_SERVING. A slow draft
replica costs the round its drafts but stays in the pool (taking it out would
move every session to k = 0 and make another replica rebuild their caches); one
whose health no longer says SERVING is lost and leaves the pool for a backoff.
A Verify cut short by its clients' deadline on a SERVING target has expired: the
target stays in the pool. Without the cut it is slow: the round replays on the same
target once, and a second miss fails the batch over to another target.
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
from specserve.engine.sampling import SamplingParams
from specserve.orchestrator.fleet.replicas import EndpointSpec, ReplicaPool
from specserve.orchestrator.fleet.scheduler import Placement, Scheduler
from specserve.orchestrator.round import calls
from specserve.orchestrator.round.calls import Plan, RoundTimeouts
from specserve.orchestrator.round.runner import RoundRunner
from specserve.orchestrator.round.views import session_view
from specserve.orchestrator.session import LiveSession
from specserve.orchestrator.store.redis_settings import embedded_client
from specserve.orchestrator.store.session_store import SessionStore
from specserve.policy import BatchPlan, Devices, Planner, PolicyConfig, WarmWhere
from specserve.policy.k_policy import KPolicy
from specserve.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    session_pb2,
    target_pb2,
    target_pb2_grpc,
)


class SlowTarget(target_pb2_grpc.TargetServiceServicer):
    """Answers Verify after 2 s (past the tests' deadlines) ``slow_calls`` times, then at
    once: every session's drafts rejected and token 5 next."""

    def __init__(self, slow_calls: int = 1_000_000) -> None:
        self.slow_calls = slow_calls
        self.calls = 0
        self.starts: list[int] = []  # the start of every session every call sent

    async def Verify(self, request: target_pb2.VerifyRequest, context: Any) -> Any:
        self.calls += 1
        self.starts.extend(s.start for s in request.sessions)
        if self.calls <= self.slow_calls:
            await asyncio.sleep(2.0)
        ok = common_pb2.SESSION_STATUS_OK
        results = [
            target_pb2.VerifyResult(session_id=s.session_id, status=ok, accepted=0, next_token=5)
            for s in request.sessions
        ]
        return target_pb2.VerifyResponse(results=results, batch_size=len(results))


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


def live(sid: str, tokens: list[int], policy: KPolicy | None = None) -> LiveSession:
    """A session whose k follows the cap up to 4 (adaptive; with alpha 1 it drafts the cap)."""
    policy = policy or KPolicy(None, k_max=4)
    state = DecodeState(sid, tokens, SamplingParams(), StopCriteria(64), policy)
    return cast(
        LiveSession,
        SimpleNamespace(
            sid=sid,
            state=state,
            deadline=None,
            draft_warming=False,
            top_logprobs=None,
        ),
    )


def offline_runner() -> RoundRunner:
    """A runner whose replica pools are never started (for its decisions, not its calls)."""
    spec = EndpointSpec.parse("127.0.0.1:1", "draft")
    return RoundRunner(
        Scheduler(),
        ReplicaPool("draft", spec, draft_pb2_grpc.DraftServiceStub),
        ReplicaPool("target", spec, target_pb2_grpc.TargetServiceStub),
        SessionStore(embedded_client()),
    )


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


@pytest.mark.parametrize("serving", [True, False])
@pytest.mark.parametrize("cut", [True, False])
def test_a_verify_past_its_deadline_loses_the_target_only_when_not_serving(
    cut: bool, serving: bool
) -> None:
    async def body() -> None:
        server, endpoint = await serve(SlowTarget(), serving=serving)
        pool = await pool_for(endpoint, "target")
        try:
            s = live("a", [1, 2, 3])
            out = await calls.verify(pool, endpoint, [(s, Plan())], 0.2, deadline_cut=cut)
            assert not out.verdicts and not out.errors
            assert out.expired is (serving and cut)  # the clients left, not the target
            assert out.slow is (serving and not cut)  # busy, not broken
            assert out.lost is not serving
            assert (endpoint in pool.usable()) is serving
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(body())


@pytest.mark.parametrize("slow_calls", [1, 2])
def test_a_slow_target_gets_the_round_again_before_it_fails_over(slow_calls: int) -> None:
    """Slow once: the same round replays on the same target (same start: it rolls back
    there). Slow twice: the batch moves to the other target with the whole history."""

    async def body() -> None:
        first, other = SlowTarget(slow_calls), SlowTarget(slow_calls=0)
        (server_a, a), (server_b, b) = await serve(first, True), await serve(other, True)
        targets = ReplicaPool(
            "target", EndpointSpec.parse(f"{a},{b}", "target"), target_pb2_grpc.TargetServiceStub
        )
        drafts = await pool_for(a)  # never called: the plan has no drafts
        await targets.start()
        store = SessionStore(embedded_client())
        runner = RoundRunner(
            Scheduler(), drafts, targets, store, RoundTimeouts(target_s=0.3, failover_s=2.0)
        )
        try:
            record = await store.create(session_pb2.SessionRecord(session_id="a", tokens=[1, 2, 3]))
            s = live("a", [1, 2, 3])
            s.record = record
            s.state.target_start = 2  # the first target holds two of the three tokens
            out, moved = await runner.failover.verify(a, [(s, Plan())])
            assert out.verdicts["a"].next_token == 5 and not out.errors
            assert runner.stats.slow_verifies == slow_calls
            if slow_calls == 1:
                assert first.starts == [2, 2] and other.calls == 0 and moved == {}
                assert a in targets.usable()
            else:
                assert first.starts == [2, 2] and other.starts == [0]  # the whole history
                assert moved == {"a": b} and runner.stats.replayed_rounds == 1
                assert a not in targets.usable()
        finally:
            await runner.close()
            await targets.close()
            await drafts.close()
            await store.close()
            await server_a.stop(None)
            await server_b.stop(None)

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


def plan_for(runner: RoundRunner, sessions: list[LiveSession]) -> BatchPlan:
    warm_above = runner.planner.config.warm_above_tokens
    return runner.planner.plan("t", len(sessions), [session_view(s, warm_above) for s in sessions])


@pytest.mark.parametrize("devices", [Devices.SEPARATE, Devices.SHARED])
def test_a_lone_cold_session_warms_inside_its_round_a_batchs_where_devices_say(
    devices: Devices,
) -> None:
    """A lone new session drafts in its first round, the target's prefill round (its
    draft prefill inside that round, before the Verify that prefills the target). In a
    batch, a cold session warms beside the rounds on separate devices (the warm one's
    round does not wait for it) and inside the round where the devices are shared."""

    async def body() -> None:
        draft = SlowDraft(delay_s=0.0)
        server, endpoint = await serve(draft, True)
        drafts = await pool_for(endpoint)
        spec = EndpointSpec.parse("127.0.0.1:1", "target")
        runner = RoundRunner(
            Scheduler(),
            drafts,
            ReplicaPool("target", spec, target_pb2_grpc.TargetServiceStub),  # never started
            SessionStore(embedded_client()),
            planner=Planner(PolicyConfig(devices=devices)),
        )
        spans = cast(Any, SimpleNamespace(asked=lambda s, k: None))
        try:
            lone = live("a", list(range(100)))
            assert lone.state.target_start == 0  # the target prefills it in this round
            runner.scheduler.join("a", Placement("t", endpoint))
            plan = plan_for(runner, [lone])
            assert plan.k["a"] > 0 and plan.warm == {"a": WarmWhere.INSIDE}
            plans = await runner.drafting.propose([lone], spans, plan)
            assert plans["a"].proposal.tokens == [7]  # drafts this round
            assert lone.state.draft_start == 100 and not lone.draft_warming
            assert runner.stats.draft_warmups == 1

            asked = KPolicy(4, k_max=4)  # drafts under any cap: only the warm-up is planned
            warm, cold = live("b", [1, 2, 3], asked), live("c", list(range(100)), KPolicy(4))
            warm.state.target_start = warm.state.draft_start = 2
            cold.state.target_start = 99
            for x in (warm, cold):
                runner.scheduler.join(x.sid, Placement("t", endpoint))
            plan = plan_for(runner, [warm, cold])
            plans = await runner.drafting.propose([warm, cold], spans, plan)
            assert "b" in plans
            if devices is Devices.SEPARATE:
                assert "c" not in plans and plan.k["c"] == 0  # k = 0 while it warms ...
                assert cold.draft_warming  # ... beside the rounds
                while cold.draft_warming:
                    await asyncio.sleep(0.01)
            else:
                assert plans["c"].proposal.tokens == [7] and not cold.draft_warming
            assert cold.state.draft_start == 100 and runner.stats.draft_warmups == 2
        finally:
            await runner.close()
            await drafts.close()
            await server.stop(None)

    asyncio.run(body())
