"""Stall detection on fake targets: a call to a replica whose model thread took no step and
no CPU time (or that does not answer at all) is cancelled after the stall time when another
target could take it; a slow call on a replica that moves, or on the only target, is waited
for."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc.aio
import pytest

from specserve.orchestrator.fleet.replicas import EndpointSpec, ReplicaPool
from specserve.orchestrator.fleet.stall import Stalled, call_watched
from specserve.orchestrator.round import calls
from specserve.orchestrator.round.calls import Plan
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc
from tests.orchestrator.test_slow_replicas import live


class BusyTarget(target_pb2_grpc.TargetServiceServicer):
    """Verify answers after ``verify_s``; GetLoad reports a counter that moves or not, a
    model-thread CPU time that grows 10 ms a poll (``cpu``) or not, or does not answer
    (``hung``)."""

    def __init__(
        self, verify_s: float, *, moving: bool, hung: bool = False, cpu: bool = False
    ) -> None:
        self.verify_s = verify_s
        self.moving = moving
        self.hung = hung
        self.cpu = cpu
        self.steps = 0
        self.cpu_ns = 1_000_000_000  # reported: a replica that has run a while

    async def Verify(self, request: target_pb2.VerifyRequest, context: Any) -> Any:
        await asyncio.sleep(self.verify_s)
        ok = common_pb2.SESSION_STATUS_OK
        results = [
            target_pb2.VerifyResult(session_id=s.session_id, status=ok, accepted=0, next_token=5)
            for s in request.sessions
        ]
        return target_pb2.VerifyResponse(results=results, batch_size=len(results))

    async def GetLoad(self, request: common_pb2.GetLoadRequest, context: Any) -> Any:
        if self.hung:
            await asyncio.sleep(60)
        self.steps += self.moving
        self.cpu_ns += 10_000_000 * self.cpu
        return common_pb2.LoadReport(progress_steps=self.steps, busy=True, model_cpu_ns=self.cpu_ns)


async def started(
    servicer: BusyTarget, *, others: int = 1
) -> tuple[list[grpc.aio.Server], ReplicaPool, str]:
    """The busy target, and ``others`` idle ones in the same pool (somewhere to go)."""
    servers, endpoints = [], []
    for s in [servicer, *(BusyTarget(0.0, moving=True) for _ in range(others))]:
        server = grpc.aio.server()
        target_pb2_grpc.add_TargetServiceServicer_to_server(s, server)
        endpoints.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    spec = EndpointSpec.parse(",".join(endpoints), "target")
    pool = ReplicaPool("target", spec, target_pb2_grpc.TargetServiceStub)
    await pool.start()
    return servers, pool, endpoints[0]


async def stopped(servers: list[grpc.aio.Server], pool: ReplicaPool) -> None:
    await pool.close()
    for server in servers:
        await server.stop(None)


@pytest.mark.parametrize(
    ("moving", "cpu", "hung"),
    [(True, False, False), (False, True, False), (False, False, False), (False, False, True)],
)
def test_only_a_replica_that_stands_still_is_stalled(moving: bool, cpu: bool, hung: bool) -> None:
    async def body() -> None:
        busy = BusyTarget(1.5, moving=moving, cpu=cpu, hung=hung)
        servers, pool, endpoint = await started(busy)
        try:
            s = live("a", [1, 2, 3])
            t0 = time.monotonic()
            out = await calls.verify(pool, endpoint, [(s, Plan())], 10.0, stall_s=0.5)
            took = time.monotonic() - t0
            if moving or cpu:  # slow but progressing (a long prefill, a busy host): answered
                assert out.verdicts["a"].next_token == 5 and not out.lost and took >= 1.5
                assert out.progressed
            else:
                assert out.lost and "made no progress" in out.why and took < 1.4
                assert endpoint not in pool.usable()
        finally:
            await stopped(servers, pool)

    asyncio.run(body())


@pytest.mark.parametrize("hung", [False, True])
def test_a_lone_target_keeps_its_call_whatever_the_watch_sees(hung: bool) -> None:
    """With nowhere to fail over to, a stall verdict would only turn a slow answer into an
    error: the call is waited for up to its own timeout."""

    async def body() -> None:
        servers, pool, endpoint = await started(BusyTarget(1.5, moving=False, hung=hung), others=0)
        try:
            s = live("a", [1, 2, 3])
            t0 = time.monotonic()
            out = await calls.verify(pool, endpoint, [(s, Plan())], 10.0, stall_s=0.3)
            assert out.verdicts["a"].next_token == 5 and not out.lost
            assert time.monotonic() - t0 >= 1.5 and endpoint in pool.usable()
        finally:
            await stopped(servers, pool)

    asyncio.run(body())


def test_the_caller_being_cancelled_is_not_a_stall() -> None:
    async def body() -> None:
        servers, pool, endpoint = await started(BusyTarget(5.0, moving=False))
        try:
            replica = pool.get(endpoint)
            assert replica is not None
            rpc = replica.stub.Verify(target_pb2.VerifyRequest(), timeout=10)
            task = asyncio.ensure_future(call_watched(replica, rpc, 0.3))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            stalled = replica.stub.Verify(target_pb2.VerifyRequest(), timeout=10)
            with pytest.raises(Stalled, match="made no progress"):
                await call_watched(replica, stalled, 0.3)
        finally:
            await stopped(servers, pool)

    asyncio.run(body())


def test_a_call_answered_before_the_first_poll_starts_no_watch() -> None:
    """Every round's Verify is watched: one answered within a fifth of the stall time
    (at accelerator speed, all of them) costs a timer, not a polling task."""

    async def body() -> None:
        running: list[str] = []

        async def quick() -> int:
            running.extend(t.get_coro().__qualname__ for t in asyncio.all_tasks())  # type: ignore[union-attr]
            return 7

        replica: Any = object()  # never asked: the watch does not start
        assert await call_watched(replica, quick(), stall_s=5.0) == 7
        assert running and "_watch" not in running

    asyncio.run(body())
