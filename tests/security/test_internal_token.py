"""Replicas with an internal token take calls only from the orchestrators (issue 46).

A target and a draft run with ``--internal-token-file`` and no TLS, as ``specserve up``
and the cpu overlay run them; an orchestrator has the same file. A caller who knows a
session id but not the token (the issue's attacker recovered a prompt token by token
through ``ExportKv`` and overwrote a live cache through ``ImportKv``) gets
``UNAUTHENTICATED`` for every method and for the data-plane socket, and the
session is untouched; health stays open; the orchestrator serves through the token;
and a chunk whose K/V was altered, then resealed without the token's key, is refused
even from a caller who has the token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from specserve.client import Client
from specserve.engine.kv_chunks import chunk_digest
from specserve.orchestrator.launch import OrchestratorProcess
from specserve.serving.data_frames import frame, parse_answer, read_frame
from specserve.serving.internal_token import HEADER, write_token_file
from specserve.serving.launch import ServerProcess
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.orchestrator.stack import DRAFT, ENV, SERVER_ARGS, TARGET

TOKEN = "internal-token-for-the-tests-0123456789"
WITH_TOKEN = ((HEADER, TOKEN),)
WRONG_TOKEN = ((HEADER, "another-deployments-token-000000"),)
SECRET = [211, 233, 239, 241, 251, 199, 197, 193] * 4 + [181] * 5  # 37 tokens
C = 16
Code = grpc.StatusCode


@dataclass
class Guarded:
    target: ServerProcess
    draft: ServerProcess
    orchestrator: OrchestratorProcess
    token_file: Path


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    token_file = write_token_file(tmp_path_factory.mktemp("token"), TOKEN)
    flags = ["--internal-token-file", str(token_file)]
    target = ServerProcess("target", ["--model", TARGET, *SERVER_ARGS, *flags], env=ENV)
    draft = ServerProcess("draft", ["--model", DRAFT, *SERVER_ARGS, *flags], env=ENV)
    procs: list[ServerProcess] = [target, draft]
    try:
        for p in procs:
            p.start()
        orchestrator = OrchestratorProcess(
            ["--target", target.address, "--draft", draft.address, *flags], env=ENV
        )
        procs.append(orchestrator)
        orchestrator.start()
        for p in procs:
            p.wait_serving()  # health needs no token
        yield Guarded(target, draft, orchestrator, token_file)
    finally:
        for p in reversed(procs):
            p.stop()


def refused(code: grpc.StatusCode, words: str, call: object, *args: object, **kw: object) -> str:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, **kw)  # type: ignore[operator]
        if hasattr(result, "__iter__") and not hasattr(result, "ByteSize"):
            list(result)  # a stream's error comes with its first answer
    assert info.value.code() == code, info.value.details()
    details = info.value.details() or ""
    assert words in details, details
    return details


def prefill(stub: target_pb2_grpc.TargetServiceStub, sid: str) -> int:
    session = target_pb2.PrefillSession(session_id=sid, tokens=SECRET)
    request = target_pb2.PrefillRequest(sessions=[session])
    return stub.Prefill(request, timeout=30, metadata=WITH_TOKEN).results[0].next_token


def next_round(stub: target_pb2_grpc.TargetServiceStub, sid: str, token: int) -> tuple[int, ...]:
    session = target_pb2.VerifySession(
        session_id=sid,
        start=len(SECRET),
        new_tokens=[token],
        draft_tokens=[3, 4],
        return_logprobs=True,
    )
    request = target_pb2.VerifyRequest(sessions=[session], strict=True)
    result = stub.Verify(request, timeout=30, metadata=WITH_TOKEN).results[0]
    return (result.accepted, result.next_token, *[round(p, 5) for p in result.logprobs])


def test_a_caller_without_the_token_can_neither_read_nor_overwrite_a_session(
    guarded: Guarded,
) -> None:
    with grpc.insecure_channel(guarded.target.address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        victim, twin = "victim-session", "twin-session"
        first = prefill(stub, victim)
        assert prefill(stub, twin) == first
        export = target_pb2.ExportKvRequest(
            session_id=victim, chunk_tokens=C, tokens=SECRET[:1] * C
        )
        chunks = stub.ExportKv(
            target_pb2.ExportKvRequest(session_id=twin, chunk_tokens=C, tokens=SECRET[:32]),
            timeout=30,
            metadata=WITH_TOKEN,
        ).chunks
        garbage = target_pb2.KvChunk()
        garbage.CopyFrom(chunks[0])
        garbage.data = bytes(len(garbage.data))  # zeros: finite
        overwrite = target_pb2.ImportKvRequest(
            session_id=victim, tokens=SECRET[:C], chunks=[garbage]
        )
        messages = []
        for metadata, words in ((None, "internal token"), (WRONG_TOKEN, "not this replica's")):
            messages += [
                refused(Code.UNAUTHENTICATED, words, stub.ExportKv, export, metadata=metadata),
                refused(Code.UNAUTHENTICATED, words, stub.ImportKv, overwrite, metadata=metadata),
                refused(
                    Code.UNAUTHENTICATED,
                    words,
                    stub.Release,
                    common_pb2.ReleaseRequest(session_ids=[victim]),
                    metadata=metadata,
                ),
                refused(
                    Code.UNAUTHENTICATED,
                    words,
                    stub.GetLoad,
                    common_pb2.GetLoadRequest(),
                    metadata=metadata,
                ),
            ]
        for message in messages:
            assert not any(str(t) in message for t in {*SECRET, len(SECRET)}), message
        # Untouched: the victim's next round is its twin's, bit for bit.
        assert next_round(stub, victim, first) == next_round(stub, twin, first)
        health = stub_health(channel)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def stub_health(channel: grpc.Channel) -> health_pb2.HealthCheckResponse:
    from grpc_health.v1 import health_pb2_grpc

    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)


def test_the_draft_refuses_a_caller_without_the_token(guarded: Guarded) -> None:
    with grpc.insecure_channel(guarded.draft.address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        request = draft_pb2.ProposeRequest(
            sessions=[draft_pb2.DraftSession(session_id="d", new_tokens=[1, 2, 3], k=2)]
        )
        refused(Code.UNAUTHENTICATED, "internal token", stub.Propose, request)
        refused(Code.UNAUTHENTICATED, "internal token", stub.GetLoad, common_pb2.GetLoadRequest())
        load = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10, metadata=WITH_TOKEN)
        assert load.role == "draft"


async def hello(port: int, payload: bytes) -> bytes | None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(frame(payload))
    reply = await read_frame(reader, 1 << 16)
    writer.close()
    return reply if isinstance(reply, bytes) else None


def test_the_data_plane_socket_wants_the_token_in_its_hello(guarded: Guarded) -> None:
    with grpc.insecure_channel(guarded.target.address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        port = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10, metadata=WITH_TOKEN).data_port
    assert port
    method = b"/specserve.v1.TargetService/Verify"
    for payload, words in (
        (method, "internal token"),
        (method + b"\nanother-deployments-token-000000", "not this replica's"),
    ):
        reply = asyncio.run(hello(port, payload))
        assert reply, "the hello was taken"
        ending = parse_answer(reply, target_pb2.VerifyResponse)
        assert ending.error is not None
        assert ending.error.code == Code.UNAUTHENTICATED.value[0]
        assert words in ending.error.message
    assert asyncio.run(hello(port, method + b"\n" + TOKEN.encode())) == b""


def test_the_orchestrator_serves_through_the_token(guarded: Guarded) -> None:
    with Client(guarded.orchestrator.address, timeout_s=60) as client:
        result = client.generate([5, 9, 14, 5, 9, 14, 5, 9, 14, 77], max_new_tokens=12)
    assert len(result.token_ids) == 12
    assert result.usage.rounds >= 1


def test_a_chunk_resealed_without_the_token_s_key_is_refused(guarded: Guarded) -> None:
    """The digest is keyed by the token: altered K/V with a digest anyone can compute
    does not import, even for a caller with the token; the real chunks do."""
    with grpc.insecure_channel(guarded.target.address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        prefill(stub, "source")
        chunks = list(
            stub.ExportKv(
                target_pb2.ExportKvRequest(session_id="source", chunk_tokens=C, tokens=SECRET[:32]),
                timeout=30,
                metadata=WITH_TOKEN,
            ).chunks
        )
        forged = target_pb2.KvChunk()
        forged.CopyFrom(chunks[1])
        forged.data = bytes(len(forged.data))
        forged.digest = chunk_digest(forged.key, forged.data)  # unkeyed: no token needed
        request = target_pb2.ImportKvRequest(
            session_id="restored", tokens=SECRET[:32], chunks=[chunks[0], forged]
        )
        refused(
            Code.INVALID_ARGUMENT,
            "digest does not match",
            stub.ImportKv,
            request,
            timeout=30,
            metadata=WITH_TOKEN,
        )
        request = target_pb2.ImportKvRequest(
            session_id="restored", tokens=SECRET[:32], chunks=chunks
        )
        assert stub.ImportKv(request, timeout=30, metadata=WITH_TOKEN).tokens == 32
