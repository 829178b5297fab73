"""Stall detection on fake targets: a call to a replica whose progress counter stands still
(or that does not answer at all) is cancelled after the stall time; a slow call on a
replica whose counter moves is waited for."""

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
    """Verify answers after ``verify_s``; GetLoad reports a counter that moves or not, or
    does not answer (``hung``)."""

    def __init__(self, verify_s: float, *, moving: bool, hung: bool = False) -> None:
        self.verify_s = verify_s
        self.moving = moving
        self.hung = hung
        self.steps = 0

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
        return common_pb2.LoadReport(progress_steps=self.steps, busy=True)


async def started(servicer: BusyTarget) -> tuple[grpc.aio.Server, ReplicaPool, str]:
    server = grpc.aio.server()
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    pool = ReplicaPool(
        "target", EndpointSpec.parse(endpoint, "target"), target_pb2_grpc.TargetServiceStub
    )
    await pool.start()
    return server, pool, endpoint


@pytest.mark.parametrize(("moving", "hung"), [(True, False), (False, False), (False, True)])
def test_only_a_replica_that_stands_still_is_stalled(moving: bool, hung: bool) -> None:
    async def body() -> None:
        server, pool, endpoint = await started(BusyTarget(1.5, moving=moving, hung=hung))
        try:
            s = live("a", [1, 2, 3])
            t0 = time.monotonic()
            out = await calls.verify(pool, endpoint, [(s, Plan())], 10.0, stall_s=0.5)
            took = time.monotonic() - t0
            if moving:  # slow but progressing (a long prefill): answered, not failed over
                assert out.verdicts["a"].next_token == 5 and not out.lost and took >= 1.5
            else:
                assert out.lost and "made no progress" in out.why and took < 1.4
                assert endpoint not in pool.usable()
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(body())


def test_the_caller_being_cancelled_is_not_a_stall() -> None:
    async def body() -> None:
        server, pool, endpoint = await started(BusyTarget(5.0, moving=False))
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
            await pool.close()
            await server.stop(None)

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
