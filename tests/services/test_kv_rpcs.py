"""ExportKv / ImportKv over gRPC: a restored session verifies exactly as the original, and
every refusal carries the right status code and a sentence."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from specserve.engine.kv_chunks import chain_keys, chunk_digest
from specserve.serving.launch import ServerProcess
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc
from tests.services.conftest import sid

C = 16
PROMPT = [(i * 29 + 3) % 256 for i in range(75)]
Code = grpc.StatusCode


@pytest.fixture
def stub(pair: tuple[ServerProcess, ServerProcess]) -> Iterator[target_pb2_grpc.TargetServiceStub]:
    with grpc.insecure_channel(pair[0].address) as channel:
        yield target_pb2_grpc.TargetServiceStub(channel)


def prefill(stub: target_pb2_grpc.TargetServiceStub, session_id: str, tokens: list[int]) -> int:
    session = target_pb2.PrefillSession(session_id=session_id, tokens=tokens)
    response = stub.Prefill(target_pb2.PrefillRequest(sessions=[session]), timeout=30)
    return response.results[0].next_token


def verify_tail(
    stub: target_pb2_grpc.TargetServiceStub, session_id: str, start: int, drafts: list[int]
) -> target_pb2.VerifyResult:
    session = target_pb2.VerifySession(
        session_id=session_id,
        start=start,
        new_tokens=PROMPT[start:],
        draft_tokens=drafts,
        return_logprobs=True,
    )
    request = target_pb2.VerifyRequest(sessions=[session], strict=True)
    return stub.Verify(request, timeout=30).results[0]


def export(
    stub: target_pb2_grpc.TargetServiceStub, session_id: str, end: int, first: int = 0
) -> list[target_pb2.KvChunk]:
    request = target_pb2.ExportKvRequest(
        session_id=session_id, chunk_tokens=C, tokens=PROMPT[:end], first_chunk=first
    )
    return list(stub.ExportKv(request, timeout=30).chunks)


def import_(
    stub: target_pb2_grpc.TargetServiceStub,
    session_id: str,
    chunks: list[target_pb2.KvChunk],
    *,
    tokens: list[int] = PROMPT,
    start: int = 0,
) -> int:
    request = target_pb2.ImportKvRequest(
        session_id=session_id, tokens=tokens, start=start, chunks=chunks
    )
    return stub.ImportKv(request, timeout=30).tokens


def refused(code: grpc.StatusCode, match: str, call, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details()


def test_load_report_names_the_fingerprint(stub: target_pb2_grpc.TargetServiceStub) -> None:
    load = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10)
    assert len(load.kv_fingerprint) == 32
    assert load.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers, K/V, heads, head_dim, fp32


def test_a_restored_session_verifies_exactly_as_the_original(
    stub: target_pb2_grpc.TargetServiceStub,
) -> None:
    original, restored = sid("orig"), sid("restored")
    prefill(stub, original, PROMPT)
    chunks = export(stub, original, 64)
    assert [c.start for c in chunks] == [0, 16, 32, 48]
    assert all(c.tokens == C and len(c.data) == C * 512 for c in chunks)
    load = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10)
    assert {c.fingerprint for c in chunks} == {load.kv_fingerprint}
    assert [c.key for c in chunks] == chain_keys(load.kv_fingerprint, PROMPT[:64], C)
    # Two calls, as the orchestrator splits a long restore; the tail is prefilled by Verify.
    assert import_(stub, restored, chunks[:3], tokens=PROMPT[:48]) == 48
    assert import_(stub, restored, chunks[3:], start=48) == 64
    drafts = [17, 4, 99]
    want = verify_tail(stub, original, 64, drafts)  # strict: the caches really hold 64
    got = verify_tail(stub, restored, 64, drafts)
    assert (got.accepted, got.next_token) == (want.accepted, want.next_token)
    assert list(got.logprobs) == list(want.logprobs)  # bit-identical K/V, identical logits
    assert export(stub, restored, 64, first=2) == chunks[2:]


def test_refusals_have_the_right_status(stub: target_pb2_grpc.TargetServiceStub) -> None:
    source, dest = sid("src"), sid("dst")
    prefill(stub, source, PROMPT)
    chunks = export(stub, source, 48)
    refused(Code.NOT_FOUND, "no KV cache", export, stub, sid("nobody"), 32)
    short = sid("short")
    prefill(stub, short, PROMPT[:20])
    refused(Code.FAILED_PRECONDITION, "fewer tokens than the 32", export, stub, short, 32)
    refused(Code.INVALID_ARGUMENT, "empty session_id", export, stub, "", 32)
    refused(Code.INVALID_ARGUMENT, "empty session_id", import_, stub, "", chunks)
    refused(Code.INVALID_ARGUMENT, "whole chunks of 16", export, stub, source, 40)

    other_model = [target_pb2.KvChunk() for _ in chunks]
    for new, old in zip(other_model, chunks, strict=True):
        new.CopyFrom(old)
        new.fingerprint = bytes(32)
    refused(Code.FAILED_PRECONDITION, "another model", import_, stub, dest, other_model)
    wrong_shape = [target_pb2.KvChunk() for _ in chunks]
    for new, old in zip(wrong_shape, chunks, strict=True):
        new.CopyFrom(old)
        new.layout.num_kv_heads = 4
    refused(Code.FAILED_PRECONDITION, "4 KV heads", import_, stub, dest, wrong_shape)
    bad_dtype = target_pb2.KvChunk()
    bad_dtype.CopyFrom(chunks[0])
    bad_dtype.layout.dtype = "int4"
    refused(Code.INVALID_ARGUMENT, "'int4'", import_, stub, dest, [bad_dtype])
    other_tokens = [7, *PROMPT[1:]]
    refused(
        Code.INVALID_ARGUMENT,
        "another token prefix",
        import_,
        stub,
        dest,
        chunks,
        tokens=other_tokens,
    )
    refused(
        Code.INVALID_ARGUMENT, "outside the vocabulary", import_, stub, dest, chunks, tokens=[256]
    )
    refused(Code.FAILED_PRECONDITION, "import from 0", import_, stub, dest, chunks[1:], start=16)
    assert stub.Release(common_pb2.ReleaseRequest(session_ids=[dest]), timeout=10).released == 0


def test_an_import_past_the_budget_is_resource_exhausted(
    stub: target_pb2_grpc.TargetServiceStub,
) -> None:
    load = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10)
    per_token = load.kv_bytes_per_token
    capacity = (load.kv_bytes_used + load.kv_bytes_free) // per_token
    chunk = 1024
    n = capacity // chunk + 1  # one chunk more than the whole pool holds
    tokens = list(np.random.default_rng(0).integers(0, 256, n * chunk))
    keys = chain_keys(load.kv_fingerprint, tokens, chunk)
    layout = target_pb2.KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
    zeros = bytes(chunk * per_token)
    chunks = [
        target_pb2.KvChunk(
            key=k,
            fingerprint=load.kv_fingerprint,
            layout=layout,
            start=i * chunk,
            tokens=chunk,
            data=zeros,
            digest=chunk_digest(k, zeros),  # a replica without a token: unkeyed
        )
        for i, k in enumerate(keys)
    ]
    session = sid("big")
    refused(
        Code.RESOURCE_EXHAUSTED,
        "KV cache is full",
        import_,
        stub,
        session,
        chunks,
        tokens=[int(t) for t in tokens],
    )
    released = stub.Release(common_pb2.ReleaseRequest(session_ids=[session]), timeout=10)
    assert released.released == 0  # nothing was left half-built


def test_load_report_counts_the_model_threads_progress(
    stub: target_pb2_grpc.TargetServiceStub,
) -> None:
    """Every attention layer of a forward, and every batch, moves the counter (what tells a
    slow replica from a hung one); the thread is idle once the call is done."""
    before = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10)
    prefill(stub, sid("progress"), PROMPT[:8])
    after = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10)
    assert after.progress_steps >= before.progress_steps + 2  # 2 attention layers
    deadline = time.monotonic() + 5  # the batch's own step may come just after the answer
    while after.busy or after.progress_steps < before.progress_steps + 2 + 1:
        assert time.monotonic() < deadline, after
        time.sleep(0.01)
        after = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10)


def test_errors_never_name_the_session_s_tokens_or_length(
    stub: target_pb2_grpc.TargetServiceStub,
) -> None:
    """A caller who knows a session id and guesses at it (export, continue an import,
    verify as if the cache held more) learns nothing of the history from the messages:
    the answers for two sessions of different histories are word for word the same."""
    secret = [211, 233, 239, 241, 251, 199, 197, 193] * 4 + [181] * 5  # 37 tokens
    answers = []
    for held in (secret, [5] * 37):
        victim = sid("victim")
        prefill(stub, victim, held)
        calls = [
            (export_guess, [211] * 16),
            (export_guess, [211, 233, 7, *[7] * 13]),
            (export_guess, [5] * 48),
            (import_guess, [7] * 48),
            (verify_guess, [5] * 3),
        ]
        for call, guess in calls:
            with pytest.raises(grpc.RpcError) as info:
                call(stub, victim, guess)
            answers.append((info.value.code(), info.value.details().replace(victim, "ID")))
    assert answers[:5] == answers[5:]
    for _, message in answers:
        assert not any(str(t) in message for t in {*secret, 37, 36}), message


def export_guess(stub: target_pb2_grpc.TargetServiceStub, victim: str, guess: list[int]) -> None:
    request = target_pb2.ExportKvRequest(session_id=victim, chunk_tokens=C, tokens=guess)
    stub.ExportKv(request, timeout=30)


def import_guess(stub: target_pb2_grpc.TargetServiceStub, victim: str, guess: list[int]) -> None:
    """Continue the victim's cache from position 32 (needs its first 32 tokens)."""
    load = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10)
    key = chain_keys(load.kv_fingerprint, guess, C)[2]
    layout = target_pb2.KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
    data = bytes(C * load.kv_bytes_per_token)
    chunk = target_pb2.KvChunk(
        key=key,
        fingerprint=load.kv_fingerprint,
        layout=layout,
        start=32,
        tokens=C,
        data=data,
        digest=chunk_digest(key, data),
    )
    request = target_pb2.ImportKvRequest(session_id=victim, tokens=guess, start=32, chunks=[chunk])
    stub.ImportKv(request, timeout=30)


def verify_guess(stub: target_pb2_grpc.TargetServiceStub, victim: str, guess: list[int]) -> None:
    session = target_pb2.VerifySession(session_id=victim, start=48, new_tokens=guess)
    stub.Verify(target_pb2.VerifyRequest(sessions=[session], strict=True), timeout=30)
