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

from specserve.engine.decode_state import DecodeState, FinishReason, StopCriteria
from specserve.engine.k_policy import KPolicy
from specserve.engine.k_policy import expected_tokens as expected
from specserve.engine.rejection import Proposal, Verdict
from specserve.engine.sampling import SamplingParams
from specserve.orchestrator import calls
from specserve.orchestrator.acceptance_prior import AcceptancePrior
from specserve.orchestrator.calls import Plan
from specserve.orchestrator.redis_settings import embedded_client
from specserve.orchestrator.replicas import EndpointSpec, ReplicaPool
from specserve.orchestrator.rounds import RoundRunner, RoundTimeouts, _LostTime
from specserve.orchestrator.scheduler import Placement, Scheduler
from specserve.orchestrator.session import LiveSession
from specserve.orchestrator.session_store import SessionStore
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
            warm_declined_at=None,
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
            out, moved = await runner._verify(a, [(s, Plan())])
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


def test_a_draft_cache_warms_once_the_target_has_the_history_and_if_it_repays() -> None:
    """Not during the target's prefill, not twice, and only when the gain over the batch's
    remaining tokens (64 here; the sessions' expected tokens over the measured round
    times) exceeds the measured warm-up of the round's cold sessions, weighed together."""
    runner = offline_runner()
    assert runner.caps is not None  # the default measured cap
    s, other = live("a", list(range(100))), live("b", list(range(100)))
    assert not runner._may_warm(s, alone=False)  # the target still prefills 100 tokens
    assert runner._may_warm(s, alone=True)  # ... but alone: prefilled inside its round
    s.state.target_start = other.state.target_start = 99  # prefilled: one new token
    assert runner._may_warm(s, alone=False)
    assert runner._warm_repays(
        "t", "d", [s], [s], inside=False
    )  # nothing measured yet: warm, and measure
    batch = [s, other]
    for x in batch:
        x.state.k_policy.alpha = 1.0  # every draft accepted: 5 tokens a round at cap 4
    runner.caps.choose("t", 2, 4, runner._outlook(batch, 4))
    runner.caps.observe("t", 2, 0, 0, 0.5)  # cap 0: 2 tokens/s per session
    runner.caps.observe("t", 2, 4, 8, 1.25)  # 4 drafts each: 4 tokens/s, 0.25 s saved a token
    runner.payback.observe("d", 100, 1.0, inside=False)  # 0.01 s a history token: 2 s < 16 s saved
    assert runner._warm_repays("t", "d", batch, batch, inside=False)
    runner.payback.forget("d")
    runner.payback.observe("d", 100, 50.0, inside=False)  # 0.5 s a history token: 50 s > 16 s saved
    assert not runner._warm_repays(
        "t", "d", [s], batch, inside=False
    )  # a lone session is weighed too
    assert runner.stats.draft_warmups_declined == 1
    assert s.warm_declined_at == 2  # declined at this batch size: k = 0 in the outlook
    runner.payback.forget("d")
    runner.payback.observe("d", 100, 10.0, inside=False)  # 0.1 s a token: 10 s each, 20 s together
    assert runner._warm_repays("t", "d", [s], batch, inside=False)
    assert s.warm_declined_at is None  # weighed again, and it repays now
    assert not runner._warm_repays("t", "d", batch, batch, inside=False)
    assert runner.stats.draft_warmups_declined == 3  # in session rounds
    for x in batch:
        x.state.k_policy.alpha = 0.0  # every draft rejected: drafting gains nothing
    assert not runner._warm_repays("t", "d", [s], batch, inside=False)  # nothing to repay it with
    runner.payback.forget("d")
    cast(Any, s).draft_warming = True
    assert not runner._may_warm(s, alone=True)  # already warming


def test_a_warm_up_beside_the_rounds_is_charged_what_they_lost_to_it() -> None:
    """Each round beside a warm-up adds its wall time over the time predicted for it (shared
    among the warm-ups under way); a round that cannot be predicted (one that prefills on
    the target, or drafts where drafting was never timed) makes the warm-up charge its own
    wall time, and so does a warm-up that no round ended beside."""
    runner = offline_runner()
    assert runner.caps is not None
    a, b = live("a", [1, 2, 3]), live("b", [4, 5, 6])
    for x in (a, b):
        x.state.target_start = 2  # one token behind, as after every round
    runner.caps.choose("t", 2, 4, runner._outlook([a, b], 4))
    runner.caps.observe("t", 2, 0, 0, 0.25)  # a plain round of 2: 0.25 s
    runner._charge_warm_ups("t", [a, b], 0, 0, 1.0)  # no warm-up under way: nobody to charge
    lost = _LostTime()
    runner._beside.append(lost)
    runner._charge_warm_ups("t", [a, b], 0, 0, 1.0)  # 0.75 s lost to it
    runner._charge_warm_ups("t", [a, b], 0, 0, 0.2)  # faster than predicted: noise cancels
    assert lost.seconds == pytest.approx(0.70) and not lost.unpredicted
    assert lost.cost(wall=3.0) == pytest.approx(0.70)
    assert _LostTime().cost(wall=3.0) == 3.0  # no round ended beside it: nothing said free
    second = _LostTime()
    runner._beside.append(second)
    runner._charge_warm_ups("t", [a, b], 0, 0, 0.75)  # 0.5 s lost to the two of them
    assert lost.seconds == pytest.approx(0.95) and second.seconds == pytest.approx(0.25)
    runner._charge_warm_ups("t", [a, b], 3, 6, 1.0)  # drafting never timed: no prediction
    assert second.unpredicted and second.cost(wall=3.0) == 3.0
    third = _LostTime()
    runner._beside[:] = [third]
    new = live("c", list(range(20)))  # its prompt prefills on the target in this round
    runner._charge_warm_ups("t", [a, b, new], 0, 0, 5.0)
    assert third.seconds == 0.0 and third.unpredicted  # a prefill's time says nothing


def test_a_warm_up_under_way_or_declined_drafts_nothing_in_the_outlook() -> None:
    """A session whose draft cache is warming, or whose warm-up was declined at this batch
    size, verifies at k = 0 whatever the cap, so the caps are weighed with one token from
    it; another cold one counts as warm (a cap above 0 lets it warm). A round beside a
    warm-up is not timed at any cap."""
    warm, cold = live("a", [1, 2, 3]), live("b", list(range(100)))
    warm.state.target_start = warm.state.draft_start = 2
    cold.state.target_start = 99  # the target has it; the draft has none of it
    for x in (warm, cold):
        x.state.k_policy.alpha = 1.0  # every draft accepted: 5 tokens at cap 4
    assert RoundRunner._outlook([warm, cold], 4)(4)[:3] == (pytest.approx(10.0), 4, 8)
    assert RoundRunner._outlook([warm, cold], 4)(0)[:3] == (pytest.approx(2.0), 0, 0)
    assert RoundRunner._timeable([warm, cold], 0)  # the cold one verifies at k = 0 too
    assert not RoundRunner._timeable([warm, cold], 4)  # it would draft from a cold cache
    assert RoundRunner._outlook([warm, cold], 4)(4).rounds == pytest.approx(64 / 5)
    cast(Any, cold).draft_warming = True
    assert RoundRunner._outlook([warm, cold], 4)(4)[:3] == (pytest.approx(6.0), 4, 4)
    assert RoundRunner._outlook([warm, cold], 4)(4).rounds == pytest.approx(64)  # cold: 1 a round
    assert RoundRunner._outlook([cold], 4)(4)[:3] == (pytest.approx(1.0), 0, 0)
    assert not RoundRunner._timeable([warm, cold], 0)  # its warm-up shares the cores
    assert RoundRunner._timeable([warm], 4)
    # Its warm-up declined at this batch size (it would not repay itself): it verifies at
    # k = 0 whatever the cap, and the round is timed. Seen at 8 sessions: 7 declined and
    # counted as warm held cap 3 for one drafting session, every round 0.47 s, not 0.27.
    cast(Any, cold).draft_warming = False
    cast(Any, cold).warm_declined_at = 2
    assert RoundRunner._outlook([warm, cold], 4)(4)[:3] == (pytest.approx(6.0), 4, 4)
    assert RoundRunner._timeable([warm, cold], 4)
    third = live("c", [4, 5, 6])
    third.state.target_start = third.state.draft_start = 2
    third.state.k_policy.alpha = 1.0
    assert RoundRunner._outlook([warm, cold, third], 4)(4)[:3] == (pytest.approx(15.0), 4, 12)
    assert not RoundRunner._timeable([warm, cold, third], 4)  # another batch: weighed again


def test_a_round_in_which_the_target_prefills_a_session_is_not_timed() -> None:
    """A new turn's first round prefills its prompt on the target (and a short one on the
    draft too): timed as drafting, the demo's first round (0.95 s against 0.28 s for a
    plain one) held its lone session at cap 0. A round leaves the target one token
    behind; more means a prefill, however short."""
    s = live("a", list(range(20)))  # a short prompt: not cold, drafts in its first round
    assert not RoundRunner._cold(s)
    assert not RoundRunner._timeable([s], 4)
    assert not RoundRunner._timeable([s], 0)
    s.state.target_start = 18  # two tokens behind: a restart's resend, say
    assert not RoundRunner._timeable([s], 4)
    s.state.target_start = s.state.draft_start = 19  # one behind, as after every round
    assert RoundRunner._timeable([s], 4)
    assert RoundRunner._timeable([s], 0)


def test_of_new_turns_one_is_counted_at_the_low_end_of_the_pools_acceptance() -> None:
    """The batch finishes with its slowest turn; of two sessions that have judged no
    drafts yet, one is expected below the pool's acceptance (the spread of the turns
    seen), so the round's slowest turn needs more rounds than either's mean says; once
    one has judged drafts its own estimate stands, and a lone new turn is the mean's."""
    prior = AcceptancePrior(turn_decay=0.999)
    for a in (0.6, 0.8, 1.0):
        prior.observe_turn("model", True, round(a * 100), 100)
    short = prior.shortfall("model", True, 2)
    assert short > 0.05
    a, b = live("a", [1, 2, 3], KPolicy(4)), live("b", [4, 5, 6], KPolicy(4))
    for x in (a, b):
        x.state.target_start = x.state.draft_start = 2
        x.state.k_policy.alpha = 0.9
    assert RoundRunner._outlook([a, b], 4)(4).rounds == pytest.approx(64 / expected(0.9, 4))
    low = RoundRunner._outlook([a, b], 4, prior)(4)
    assert low.rounds == pytest.approx(64 / expected(0.9 - short, 4))
    assert low.tokens == pytest.approx(2 * expected(0.9, 4))  # the batch's mean is the mean
    a.state.stats.drafted = 4  # a has drafted: its own estimate, and b is the only new one
    assert RoundRunner._outlook([a, b], 4, prior)(4).rounds == pytest.approx(64 / expected(0.9, 4))


def test_turns_that_end_tell_the_prior_their_acceptance() -> None:
    runner = offline_runner()
    for i, accepted in enumerate((2, 4, 1)):
        s = live(str(i), [1, 2, 3])
        for _ in range(4):  # 4 drafts a round: 4 accepted, or a rejection after some
            s.state.commit(Proposal([5, 6, 7, 8]), Verdict(accepted=accepted, next_token=9))
        runner._learn_turns([(s, FinishReason.LENGTH, None)])
    assert (s.state.stats.accepted, s.state.stats.rejections) == (4, 4)  # 4 of 8 trials
    assert runner.prior.shortfall("model", True, 2) > 0.1  # turns at 2/3, 4/5 and 1/2


def test_a_round_of_only_cold_sessions_warms_them_inside_it_and_drafts() -> None:
    """A lone new session drafts in its first round, the target's prefill round (its
    draft prefill inside that round, before the Verify that prefills the target); a cold
    session beside a warm one is warmed beside the rounds, so the warm one's round does
    not wait for it."""

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
        )
        spans = cast(Any, SimpleNamespace(asked=lambda s, k: None))
        try:
            lone = live("a", list(range(100)))
            assert lone.state.target_start == 0  # the target prefills it in this round
            runner.scheduler.join("a", Placement("t", 0, endpoint))
            plans = await runner._propose("t", [lone], spans, 4)
            assert plans["a"].proposal.tokens == [7]  # drafts this round
            assert lone.state.draft_start == 100 and not lone.draft_warming
            assert runner.stats.draft_warmups == 1
            assert runner.payback.cost(endpoint, inside=True) is not None  # timed, inside

            warm, cold = live("b", [1, 2, 3]), live("c", list(range(100)))
            warm.state.target_start = warm.state.draft_start = 2
            cold.state.target_start = 99
            for x in (warm, cold):
                runner.scheduler.join(x.sid, Placement("t", 0, endpoint))
            runner.payback.forget(endpoint)  # not measured: the warm-up goes ahead
            plans = await runner._propose("t", [warm, cold], spans, 4)
            assert "b" in plans and "c" not in plans  # the cold one verifies at k = 0 now
            assert cold.draft_warming  # ... while its draft replica prefills it
            while cold.draft_warming:
                await asyncio.sleep(0.01)
            assert cold.state.draft_start == 100 and runner.stats.draft_warmups == 2
            # No round ended beside it: nothing said it was free, its wall time is charged.
            cost = runner.payback.cost(endpoint, inside=False)
            assert cost is not None and cost > 0
            # Measured cheaper inside a round than beside the rounds (draft and target on
            # shared cores): a batch's cold session warms inside this round and drafts.
            runner.payback.observe(endpoint, 100, 1.0, inside=True)
            runner.payback.observe(endpoint, 100, 5.0, inside=False)
            assert runner.payback.cheaper_inside(endpoint)
            later = live("d", list(range(100)))
            later.state.target_start = 99
            runner.scheduler.join("d", Placement("t", 0, endpoint))
            plans = await runner._propose("t", [warm, later], spans, 4)
            assert plans["d"].proposal.tokens == [7] and not later.draft_warming
            assert later.state.draft_start == 100 and runner.stats.draft_warmups == 3
        finally:
            await runner.close()
            await drafts.close()
            await server.stop(None)

    asyncio.run(body())
