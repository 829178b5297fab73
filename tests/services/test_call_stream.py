"""Calls on the replicas' data-plane sockets against real servers.

Each call on a connection is served as the unary call is (same answer, same
batching, same status code and sentence), a bad call gets its own error while the
connection goes on serving, a call past its own deadline is answered
DEADLINE_EXCEEDED, and a graceful shutdown ends the connections at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import grpc
import grpc.aio
import pytest

from specserve.draft_service.config import DraftServerConfig
from specserve.draft_service.server import start as start_draft
from specserve.serving.data_frames import call_frame, frame, parse_answer, read_frame
from specserve.serving.launch import ServerProcess
from specserve.serving.replica_connection import ReplicaConnection
from specserve.serving.server import ServerOptions
from specserve.serving.socket_call import SocketCall, SocketDial
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.services.conftest import COMMON, DRAFT, TARGET, run, sid

PROMPT = [(7 * i) % 256 for i in range(12)]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """(target, draft); the target waits 50 ms for company, so calls sent together share
    a forward."""
    target = ServerProcess("target", ["--model", TARGET, *COMMON, "--batch-window-ms", "50"])
    draft = ServerProcess("draft", ["--model", DRAFT, *COMMON])
    try:
        for server in (target, draft):
            server.start(timeout_s=300)  # a busy machine imports torch slowly
        for server in (target, draft):
            server.wait_serving(timeout_s=300)
        yield target, draft
    finally:
        target.stop()
        draft.stop()


def verify_request(session_id: str, tokens: list[int]) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(
        sessions=[target_pb2.VerifySession(session_id=session_id, new_tokens=tokens)]
    )


def propose_request(session_id: str, tokens: list[int], k: int = 3) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(
        sessions=[draft_pb2.DraftSession(session_id=session_id, new_tokens=tokens, k=k)]
    )


def test_socket_calls_share_forwards_and_answer_as_unary(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    target, _ = servers
    dial = SocketDial.of(target.address)

    async def main() -> None:
        async with grpc.aio.insecure_channel(target.address) as channel:
            stream = ReplicaConnection.verify(channel, dial)
            ids = [sid() for _ in range(4)]
            answers = await asyncio.gather(
                *(stream.call(verify_request(i, PROMPT), 30) for i in ids)
            )
            unary = await target_pb2_grpc.TargetServiceStub(channel).Verify(
                verify_request(sid(), PROMPT), timeout=30
            )
            socket = isinstance(stream._connection, SocketCall) and stream._connection.connected
            await stream.close()
        assert stream.opened == 1 and socket
        assert max(a.batch_size for a in answers) > 1, [a.batch_size for a in answers]
        for session_id, answer in zip(ids, answers, strict=True):
            (result,) = answer.results
            assert result.session_id == session_id
            assert result.next_token == unary.results[0].next_token  # greedy, same prompt

    run(main())


def test_a_bad_call_gets_its_error_and_the_connection_keeps_serving(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    _, draft = servers
    bad = propose_request(sid(), [1, 256])  # 256 is outside the tiny vocabulary

    async def main() -> None:
        async with grpc.aio.insecure_channel(draft.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await draft_pb2_grpc.DraftServiceStub(channel).Propose(bad, timeout=30)
            stream = ReplicaConnection.propose(channel, SocketDial.of(draft.address))
            with pytest.raises(grpc.aio.AioRpcError) as streamed:
                await stream.call(bad, 30)
            good = await stream.call(propose_request(sid(), PROMPT), 30)
            await stream.close()
        assert streamed.value.code() == unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert streamed.value.details() == unary.value.details()
        assert len(good.results[0].tokens) == 3
        assert stream.opened == 1  # the same connection served the good call

    run(main())


def test_a_call_past_its_own_deadline_is_answered_deadline_exceeded(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    target, _ = servers
    long_prompt = [(3 * i) % 256 for i in range(3000)]

    async def main() -> dict[int, Any]:
        async with grpc.aio.insecure_channel(target.address) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            port = (await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=30)).data_port
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(frame(b"/specserve.v1.TargetService/Verify"))
            assert await read_frame(reader, 1 << 16) == b""  # accepted
            slow, quick = sid(), sid()
            for request_id, session_id, tokens, timeout_ms in (
                (1, slow, long_prompt, 1),
                (2, quick, PROMPT, 30_000),
            ):
                header = common_pb2.CallHeader(request_id=request_id, timeout_ms=timeout_ms)
                writer.write(call_frame(header, verify_request(session_id, tokens)))
            answers = {}
            for _ in range(2):
                data = await asyncio.wait_for(read_frame(reader, 1 << 24), 60)
                assert isinstance(data, bytes)
                answer = parse_answer(data, target_pb2.VerifyResponse)
                answers[answer.request_id] = answer
            writer.close()
            await stub.Release(common_pb2.ReleaseRequest(session_ids=[slow, quick]))
            return answers

    answers = run(main())
    assert answers[1].error is not None
    assert answers[1].error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "deadline of 1 ms" in answers[1].error.message
    assert answers[2].error is None and answers[2].response.results


def test_a_graceful_shutdown_ends_the_connections_instead_of_waiting_out_its_grace() -> None:
    """In process, an n-gram draft server (no model): SIGTERM's stop with a 60 s grace
    returns at once although a data-plane connection is open, and its next call is lost."""

    async def main() -> tuple[float, grpc.aio.AioRpcError]:
        options = ServerOptions(grace_s=60)
        running = await start_draft(DraftServerConfig(model=None, server=options))
        await asyncio.to_thread(running.executor.ready.wait)
        ngram = propose_request(sid(), PROMPT)
        ngram.sessions[0].drafter = common_pb2.DRAFTER_NGRAM
        async with grpc.aio.insecure_channel(running.address) as channel:
            stream = ReplicaConnection.propose(channel, SocketDial.of(running.address))
            await stream.call(ngram, 30)  # the connection is open
            assert isinstance(stream._connection, SocketCall) and stream._connection.connected
            began = time.monotonic()
            await running.stop()
            elapsed = time.monotonic() - began
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await stream.call(ngram, 5)
            await stream.close()
        return elapsed, gone.value

    elapsed, gone = run(main())
    assert elapsed < 10, f"shutdown took {elapsed:.1f} s: it waited for the open connection"
    assert gone.code() == grpc.StatusCode.UNAVAILABLE  # lost, as a unary call would be
