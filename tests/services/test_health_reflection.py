"""Health follows the model (loading, ready, device failure); reflection serves every service.

Health transitions are tested on servers started in this process, where the
model load can be held back deterministically; reflection and the generic client
talk to the shared server processes.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from grpc_requests import Client

from specserve.serving.launch import ServerProcess
from specserve.serving.server import ServerOptions
from specserve.target_service.backend import TargetBackend
from specserve.target_service.config import TargetServerConfig
from specserve.target_service.server import SERVICE_NAME, load_backend, start
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc
from tests.services.conftest import TARGET, run

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def config(**kw: object) -> TargetServerConfig:
    return TargetServerConfig(model=TARGET, kv_budget_bytes=8 << 20, server=ServerOptions(), **kw)


def verify(session_id: str) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(
        sessions=[target_pb2.VerifySession(session_id=session_id, new_tokens=[1, 2, 3])]
    )


def test_not_serving_while_loading_then_serving() -> None:
    gate = threading.Event()
    cfg = config()

    def slow_load() -> TargetBackend:
        assert gate.wait(30)
        return load_backend(cfg)

    async def go() -> None:
        running = await start(cfg, load=slow_load)
        try:
            async with grpc.aio.insecure_channel(running.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                assert (await watch.read()).status == NOT_SERVING
                check = await health.Check(health_pb2.HealthCheckRequest())
                assert check.status == NOT_SERVING
                stub = target_pb2_grpc.TargetServiceStub(channel)
                try:
                    await stub.GetLoad(common_pb2.GetLoadRequest())
                    raise AssertionError("GetLoad answered while loading")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE
                    assert "still loading" in (e.details() or "")
                gate.set()
                assert (await watch.read()).status == SERVING
                assert (await health.Check(health_pb2.HealthCheckRequest())).status == SERVING
                await stub.GetLoad(common_pb2.GetLoadRequest())
                watch.cancel()
        finally:
            gate.set()
            await running.stop(0)

    run(go())


def test_device_failure_turns_not_serving() -> None:
    async def go() -> None:
        running = await start(config(fail_after_forwards=1))
        try:
            await asyncio.to_thread(running.executor.ready.wait, 30)
            async with grpc.aio.insecure_channel(running.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                stub = target_pb2_grpc.TargetServiceStub(channel)
                await stub.Verify(verify("ok"))  # the one forward that works
                assert (await health.Check(health_pb2.HealthCheckRequest())).status == SERVING
                codes = []
                for name in ("boom", "after"):
                    try:
                        await stub.Verify(verify(name))
                    except grpc.aio.AioRpcError as e:
                        codes.append((e.code(), e.details() or ""))
                assert codes[0][0] == grpc.StatusCode.INTERNAL
                assert "simulated device failure" in codes[0][1]
                assert codes[1][0] == grpc.StatusCode.UNAVAILABLE
                assert "NOT_SERVING until restarted" in codes[1][1]
                for service in ("", SERVICE_NAME):
                    request = health_pb2.HealthCheckRequest(service=service)
                    assert (await health.Check(request)).status == NOT_SERVING
        finally:
            await running.stop(0)

    run(go())


def test_a_model_that_fails_to_load_ends_the_process() -> None:
    server = ServerProcess("target", ["--model", "tiny:not-a-seed", "--threads", "1"])
    server.start()  # it binds (health NOT_SERVING) before it loads
    assert server.proc is not None
    assert server.proc.wait(60) == 1
    assert "bad tiny model spec" in server.output()
    server.stop()


class SlowBackend(TargetBackend):
    """Holds every verify batch for a while, to catch it in flight."""

    entered = threading.Event()

    def verify(self, calls):  # type: ignore[no-untyped-def]
        self.entered.set()
        threading.Event().wait(0.5)
        return super().verify(calls)


def test_graceful_shutdown_finishes_the_batch_in_flight() -> None:
    cfg = config()

    def load() -> TargetBackend:
        real = load_backend(cfg)
        return SlowBackend(real.verifier, model_name=real.model_name, dtype=real.dtype)

    async def go() -> None:
        running = await start(cfg, load=load)
        await asyncio.to_thread(running.executor.ready.wait, 30)
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            in_flight = asyncio.ensure_future(stub.Verify(verify("slow")))
            assert await asyncio.to_thread(SlowBackend.entered.wait, 10)  # running now
            await running.stop(grace_s=5)
            response = await in_flight
            assert response.results[0].status == common_pb2.SESSION_STATUS_OK

    run(go())


def test_reflection_lists_the_services(pair: tuple[ServerProcess, ServerProcess]) -> None:
    target, draft = pair
    expected = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    for server, name in (
        (target, "specserve.v1.TargetService"),
        (draft, "specserve.v1.DraftService"),
    ):
        with grpc.insecure_channel(server.address) as channel:
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert services >= expected | {name}


def test_reflection_v1_answers_as_v1alpha_does(pair: tuple[ServerProcess, ServerProcess]) -> None:
    """grpcurl and grpc-js ask grpc.reflection.v1 first; it lists the services and the file."""
    target, _ = pair
    with grpc.insecure_channel(target.address) as channel:
        call = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        asks = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
        ]
        listed, found = list(call(iter(asks), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE_NAME, "grpc.reflection.v1.ServerReflection"} <= names
    assert found.file_descriptor_response.file_descriptor_proto


def test_a_generic_reflection_client_calls_get_load(
    pair: tuple[ServerProcess, ServerProcess],
) -> None:
    """grpc-requests knows nothing of specserve: it learns the API through reflection."""
    target, draft = pair
    for server, name, role in (
        (target, "specserve.v1.TargetService", "target"),
        (draft, "specserve.v1.DraftService", "draft"),
    ):
        client = Client.get_by_endpoint(server.address)
        assert name in client.service_names
        report = client.request(name, "GetLoad", {})
        assert report["role"] == role
        assert report["replica_id"] == server.address, report
