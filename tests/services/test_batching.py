"""Concurrent calls coalesce into one forward; a full KV budget is RESOURCE_EXHAUSTED.

A dedicated target with a 64 KiB KV budget (8 blocks of 16 tokens for the tiny
model) and a 50 ms coalescing window, so calls from several clients made at once
reliably share a forward even on a busy machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from specserve.serving.launch import ServerProcess
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc
from tests.services.conftest import TARGET, run, sid

CLIENTS = 4


@pytest.fixture(scope="module")
def small_target() -> Iterator[ServerProcess]:
    server = ServerProcess(
        "target",
        ["--model", TARGET, "--threads", "1", "--kv-budget", "64KiB", "--batch-window-ms", "50"],
    )
    try:
        server.start().wait_serving()
        yield server
    finally:
        server.stop()


def request(session_id: str, tokens: int) -> target_pb2.VerifyRequest:
    new = [(7 * i) % 256 for i in range(tokens)]
    return target_pb2.VerifyRequest(
        sessions=[target_pb2.VerifySession(session_id=session_id, new_tokens=new)]
    )


async def concurrently(server: ServerProcess, requests: list[target_pb2.VerifyRequest]) -> list:
    """Each request from its own client (its own channel), all at once."""
    channels = [grpc.aio.insecure_channel(server.address) for _ in requests]
    try:
        stubs = [target_pb2_grpc.TargetServiceStub(c) for c in channels]
        for c in channels:
            await c.channel_ready()
        calls = [s.Verify(r) for s, r in zip(stubs, requests, strict=True)]
        return await asyncio.gather(*calls, return_exceptions=True)
    finally:
        ids = [s.session_id for r in requests for s in r.sessions]
        await target_pb2_grpc.TargetServiceStub(channels[0]).Release(
            common_pb2.ReleaseRequest(session_ids=ids)
        )
        for c in channels:
            await c.close()


def test_concurrent_verify_calls_share_one_forward(small_target: ServerProcess) -> None:
    responses = run(concurrently(small_target, [request(sid(), 10) for _ in range(CLIENTS)]))
    assert all(isinstance(r, target_pb2.VerifyResponse) for r in responses), responses
    sizes = [r.batch_size for r in responses]
    assert max(sizes) > 1, sizes
    # Calls that shared a forward report the same compute time.
    by_size = {r.batch_size: r.compute_ns for r in responses if r.batch_size > 1}
    assert all(r.compute_ns == by_size[r.batch_size] for r in responses if r.batch_size > 1)


def test_full_kv_budget_is_resource_exhausted(small_target: ServerProcess) -> None:
    (response,) = run(concurrently(small_target, [request(sid(), 200)]))
    assert isinstance(response, grpc.aio.AioRpcError)
    assert response.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # More than the whole pool: refused before the model thread, not after trying.
    assert "KV budget can ever hold" in (response.details() or "")


def test_one_oversized_call_does_not_fail_the_calls_it_was_batched_with(
    small_target: ServerProcess,
) -> None:
    requests = [request(sid(), 10) for _ in range(CLIENTS - 1)] + [request(sid(), 200)]
    *small, big = run(concurrently(small_target, requests))
    assert all(isinstance(r, target_pb2.VerifyResponse) for r in small), small
    assert all(r.results[0].status == common_pb2.SESSION_STATUS_OK for r in small)
    assert isinstance(big, grpc.aio.AioRpcError)
    assert big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
