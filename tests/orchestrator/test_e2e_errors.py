"""Bad input, unknown sessions, busy sessions, cancellation and deadlines, end to end.

Every refusal carries a sentence saying what is wrong, and leaves Redis and the
replicas' KV exactly as they were.
"""

from __future__ import annotations

import time

import grpc
import pytest

from specserve.client import Client, request
from specserve.v1 import generate_pb2, generate_pb2_grpc
from tests.orchestrator.stack import Reference, Stack, kv_used, redis_keys

pytestmark = pytest.mark.redis

OK_PROMPT = [5, 6, 7, 5, 6, 7]


def bad(**changes: object) -> generate_pb2.GenerateRequest:
    req = request(OK_PROMPT, max_new_tokens=8)
    for path, value in changes.items():
        obj = req
        *parents, name = path.split("__")
        for p in parents:
            obj = getattr(obj, p)
        if isinstance(value, list):
            getattr(obj, name).extend(value)
        else:
            setattr(obj, name, value)
    return req


def no_prompt() -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest()


CASES = [
    (no_prompt(), grpc.StatusCode.INVALID_ARGUMENT, "no prompt"),
    (request("hello"), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    (request([1, 2, 300]), grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    (request([]), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (bad(sampling__temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (bad(sampling__temperature=2.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (bad(sampling__temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (bad(sampling__logprobs=21), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    (bad(sampling__top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (bad(sampling__top_k=-2), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    (bad(sampling__max_new_tokens=10**6), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
    (bad(sampling__stop=["x"] * 17), grpc.StatusCode.INVALID_ARGUMENT, "stop strings"),
    (bad(speculation__k=17), grpc.StatusCode.INVALID_ARGUMENT, "k must be"),
    (bad(speculation__drafter=9), grpc.StatusCode.INVALID_ARGUMENT, "drafter"),
    (bad(session_id="not valid!"), grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
    (bad(session_id="no-such-session"), grpc.StatusCode.NOT_FOUND, "does not exist"),
]


@pytest.mark.parametrize(("req", "code", "match"), CASES)
def test_bad_requests_are_refused_and_leave_nothing(
    stack: Stack, req: generate_pb2.GenerateRequest, code: grpc.StatusCode, match: str
) -> None:
    before = redis_keys(stack.redis_url)
    target = stack.target_procs[0].address
    kv_before = kv_used(target, "target")
    with grpc.insecure_channel(stack.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        for call in (
            stub.Generate,
            lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout)),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(req, timeout=30)
            assert info.value.code() == code
            assert match in info.value.details()
    assert redis_keys(stack.redis_url) == before
    assert kv_used(target, "target") == kv_before


def test_unknown_sessions_are_not_found(stack: Stack) -> None:
    with Client(stack.address, timeout_s=10) as c:
        for call in (c.get_session, c.cancel, c.close_session):
            with pytest.raises(grpc.RpcError) as info:
                call("never-existed")
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert "never-existed" in info.value.details()


def test_a_failed_turn_is_rolled_back(stack: Stack, reference: Reference) -> None:
    with Client(stack.address, timeout_s=60) as c:
        first = c.generate(OK_PROMPT, max_new_tokens=6, keep_session=True)
        sid = first.session_id
        before = c.get_session(sid)
        with pytest.raises(grpc.RpcError) as info:
            c.generate([1, 999], session_id=sid, keep_session=True, max_new_tokens=4)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        after = c.get_session(sid)
        assert (after.tokens, after.turns, after.state) == (before.tokens, before.turns, 2)
        second = c.generate([9, 9], session_id=sid, max_new_tokens=6)
        history = [*OK_PROMPT, *first.token_ids, 9, 9]
        assert second.token_ids == reference.decode(history, 6)


def test_cancel_session_stops_a_running_generation(stack: Stack) -> None:
    before = redis_keys(stack.redis_url)
    target = stack.target_procs[0].address
    with Client(stack.address, timeout_s=60) as c:
        stream = iter(c.stream(OK_PROMPT, max_new_tokens=4000, drafter="none", keep_session=True))
        sid = next(stream).session_id
        with pytest.raises(grpc.RpcError) as info:  # one generation per session at a time
            c.generate([1], session_id=sid, max_new_tokens=2)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert c.cancel(sid)
        rest = list(stream)
        assert rest[-1].finish_reason == "cancelled"
        tokens = sum(len(d.token_ids) for d in rest) + 1
        assert tokens < 4000
        info_after = c.get_session(sid)
        assert info_after.state == generate_pb2.SESSION_STATE_CANCELLED
        assert not c.cancel(sid)  # nothing in flight any more
        assert c.close_session(sid)
    assert redis_keys(stack.redis_url) == before
    assert kv_used(target, "target")[0] == 0


def test_client_hang_up_and_deadline_free_everything(stack: Stack) -> None:
    before = redis_keys(stack.redis_url)
    target = stack.target_procs[0].address
    with Client(stack.address) as c:
        stream = c.stream(OK_PROMPT, max_new_tokens=4000, drafter="none")
        next(iter(stream))
        stream.cancel()
        with pytest.raises(grpc.RpcError) as info:
            c.generate(OK_PROMPT, max_new_tokens=4000, k=2, timeout_s=0.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert stack.draft is not None
    draft = stack.draft.address

    def busy() -> bool:
        kv = kv_used(target, "target")[0] + kv_used(draft, "draft")[0]
        return redis_keys(stack.redis_url) != before or kv != 0

    deadline = time.monotonic() + 10
    while busy():
        assert time.monotonic() < deadline, "the orchestrator kept decoding for a gone client"
        time.sleep(0.05)


def test_a_bad_session_does_not_spoil_its_batch(stack: Stack, reference: Reference) -> None:
    """A session the replicas refuse fails alone; the ones batched with it finish correctly."""
    import asyncio

    from specserve.client import AsyncClient

    good = [[3 + i, 4, 5, 3 + i, 4, 5] for i in range(5)]

    async def run_all() -> list[object]:
        async with AsyncClient(stack.address, timeout_s=60) as c:
            calls = [c.generate(p, max_new_tokens=12, k=3) for p in good]
            calls.insert(2, c.generate([1, 2, 256], max_new_tokens=12, k=3))
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(run_all())
    refused = results.pop(2)
    assert isinstance(refused, grpc.RpcError)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "256" in refused.details()
    for p, r in zip(good, results, strict=True):
        assert not isinstance(r, BaseException), r
        assert r.token_ids == reference.decode(p, 12)  # type: ignore[attr-defined]
