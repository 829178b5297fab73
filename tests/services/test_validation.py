"""Every malformed request is answered INVALID_ARGUMENT with a sentence that names the problem."""

from __future__ import annotations

import math
from typing import Any

import grpc
import numpy as np
import pytest

from specserve.serving.launch import ServerProcess
from specserve.v1 import common_pb2, draft_pb2, target_pb2
from tests.services.conftest import Stubs, run

DS = draft_pb2.DraftSession
VS = target_pb2.VerifySession
SC = common_pb2.SamplingConfig


def propose(*sessions: draft_pb2.DraftSession) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(sessions=sessions)


def verify(*sessions: target_pb2.VerifySession) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(sessions=sessions)


def q(ids: list[list[int]], probs: list[list[float]]) -> common_pb2.SparseQ:
    """A SparseQ given row by row."""
    return common_pb2.SparseQ(
        support=len(ids[0]),
        ids=np.asarray(ids, "<i4").tobytes(),
        probs=np.asarray(probs, "<f4").tobytes(),
    )


def sparse(ids: list[list[int]], probs: list[list[float]], tokens: list[int], **kw: Any) -> VS:
    """A verify session whose draft tokens carry the given q."""
    kw.setdefault("session_id", "v")
    return VS(new_tokens=[1, 2], draft_tokens=tokens, q=q(ids, probs), **kw)


DRAFT_CASES = {
    "empty session id": (propose(DS(session_id="", new_tokens=[1], k=2)), "empty session_id"),
    "duplicate ids": (
        propose(DS(session_id="a", new_tokens=[1], k=1), DS(session_id="a", new_tokens=[2], k=1)),
        "appears more than once",
    ),
    "unknown drafter enum": (
        propose(DS(session_id="a", new_tokens=[1], k=1, drafter=7)),
        "drafter 7 is not one of",
    ),
    "drafter none": (
        propose(DS(session_id="a", new_tokens=[1], k=1, drafter=common_pb2.DRAFTER_NONE)),
        "means no drafting",
    ),
    "k above 16": (propose(DS(session_id="a", new_tokens=[1], k=17)), "k must be between 0 and 16"),
    "token outside vocab": (
        propose(DS(session_id="a", new_tokens=[1, 256], k=2)),
        "token id 256, outside the vocabulary",
    ),
    "negative token": (propose(DS(session_id="a", new_tokens=[-3], k=2)), "token id -3"),
    "no tokens": (propose(DS(session_id="a", k=2)), "at least one committed token"),
    "nan temperature": (
        propose(DS(session_id="a", new_tokens=[1], k=2, sampling=SC(temperature=math.nan))),
        "temperature must be a finite number",
    ),
    "top_p above 1": (
        propose(DS(session_id="a", new_tokens=[1], k=2, sampling=SC(temperature=1, top_p=1.5))),
        "top_p must be in (0, 1]",
    ),
    "negative top_k": (
        propose(DS(session_id="a", new_tokens=[1], k=2, sampling=SC(top_k=-1))),
        "top_k must be >= 0",
    ),
    "too many sessions": (
        propose(*[DS(session_id=f"s{i}", new_tokens=[1], k=1) for i in range(1025)]),
        "at most 1024 sessions",
    ),
}

ROW = ([[7, 8, -1]], [[0.75, 0.25, 0.0]], [7])  # a valid sparse q for one draft token 7
TARGET_CASES = {
    "empty session id": (verify(VS(session_id="", new_tokens=[1])), "empty session_id"),
    "duplicate ids": (
        verify(VS(session_id="a", new_tokens=[1]), VS(session_id="a", new_tokens=[1])),
        "appears more than once",
    ),
    "no new tokens": (verify(VS(session_id="a", draft_tokens=[3])), "new_tokens is empty"),
    "draft token outside vocab": (
        verify(VS(session_id="a", new_tokens=[1], draft_tokens=[300])),
        "draft_tokens holds token id 300",
    ),
    "q of the wrong length": (
        verify(
            VS(
                session_id="a",
                new_tokens=[1],
                draft_tokens=[3, 4],
                q=common_pb2.SparseQ(support=4, ids=bytes(28), probs=bytes(32)),
            )
        ),
        "need 32 bytes of q ids and of q probs (4 per entry), got 28 and 32",
    ),
    "q without support": (
        verify(
            VS(
                session_id="a",
                new_tokens=[1],
                draft_tokens=[3],
                q=common_pb2.SparseQ(ids=bytes(4), probs=bytes(4)),
            )
        ),
        "support is 0",
    ),
    "support above vocab": (
        verify(sparse([list(range(300))], [[1 / 300] * 300], [3], session_id="a")),
        "support 300 exceeds the limit 256",
    ),
    "nan probability": (verify(sparse([[7, 8]], [[math.nan, 0.5]], [7])), "not finite"),
    "probability above 1": (verify(sparse([[7, 8]], [[1.5, -0.5]], [7])), "outside [0, 1]"),
    "negative probability": (verify(sparse([[7, 8]], [[-0.1, 1.1]], [7])), "outside [0, 1]"),
    "row not summing to 1": (verify(sparse([[7, 8]], [[0.25, 0.25]], [7])), "sums to 0.500000"),
    "q id outside vocab": (
        verify(sparse([[7, 999]], [[0.5, 0.5]], [7])),
        "names a token id outside the vocabulary",
    ),
    "padding with mass": (verify(sparse([[7, -1]], [[0.5, 0.5]], [7])), "padding (id -1)"),
    "repeated q id": (verify(sparse([[7, 7]], [[0.5, 0.5]], [7])), "same token id twice"),
    "token outside its q": (
        verify(sparse([[8, 9]], [[0.5, 0.5]], [7])),
        "gives its own draft token 7 probability 0",
    ),
    "bad sampling": (
        verify(VS(session_id="a", new_tokens=[1], sampling=SC(temperature=-1))),
        "temperature must be a finite number >= 0",
    ),
}


async def _fail(call: Any, request: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call(request)
    return e.value.code(), e.value.details() or ""


def test_valid_sparse_q_is_accepted(pair: tuple[ServerProcess, ServerProcess]) -> None:
    async def go() -> target_pb2.VerifyResponse:
        async with Stubs(*pair) as stubs:
            request = verify(sparse(*ROW, session_id="valid-q", sampling=SC(temperature=1.0)))
            response = await stubs.target.Verify(request)
            await stubs.target.Release(common_pb2.ReleaseRequest(session_ids=["valid-q"]))
            return response

    assert run(go()).results[0].status == common_pb2.SESSION_STATUS_OK


@pytest.mark.parametrize("case", list(DRAFT_CASES))
def test_bad_propose_is_invalid_argument(
    pair: tuple[ServerProcess, ServerProcess], case: str
) -> None:
    request, fragment = DRAFT_CASES[case]

    async def go() -> tuple[grpc.StatusCode, str]:
        async with Stubs(*pair) as stubs:
            return await _fail(stubs.draft.Propose, request)

    code, details = run(go())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert fragment in details


@pytest.mark.parametrize("case", list(TARGET_CASES))
def test_bad_verify_is_invalid_argument(
    pair: tuple[ServerProcess, ServerProcess], case: str
) -> None:
    request, fragment = TARGET_CASES[case]

    async def go() -> tuple[grpc.StatusCode, str]:
        async with Stubs(*pair) as stubs:
            return await _fail(stubs.target.Verify, request)

    code, details = run(go())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert fragment in details


def test_bad_prefill_is_invalid_argument(pair: tuple[ServerProcess, ServerProcess]) -> None:
    cases = [
        (target_pb2.PrefillSession(session_id="p"), "the prompt is empty"),
        (target_pb2.PrefillSession(session_id="p", tokens=[1, 256]), "token id 256"),
        (target_pb2.PrefillSession(session_id="", tokens=[1]), "empty session_id"),
    ]

    async def go() -> list[tuple[grpc.StatusCode, str]]:
        async with Stubs(*pair) as stubs:
            return [
                await _fail(stubs.target.Prefill, target_pb2.PrefillRequest(sessions=[s]))
                for s, _ in cases
            ]

    for (code, details), (_, fragment) in zip(run(go()), cases, strict=True):
        assert code == grpc.StatusCode.INVALID_ARGUMENT and fragment in details


def test_error_names_the_session(pair: tuple[ServerProcess, ServerProcess]) -> None:
    async def go() -> tuple[grpc.StatusCode, str]:
        async with Stubs(*pair) as stubs:
            return await _fail(
                stubs.draft.Propose, propose(DS(session_id="chat-42", k=99, new_tokens=[1]))
            )

    assert "session 'chat-42'" in run(go())[1]
