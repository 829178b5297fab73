"""Framed stream messages parse exactly as the wrapper messages they stand for."""

from __future__ import annotations

import pytest

from specserve.serving.stream_frames import answer_bytes, bytes_or_message, call_bytes
from specserve.v1 import common_pb2, draft_pb2, target_pb2


def propose_request() -> draft_pb2.ProposeRequest:
    sessions = [
        draft_pb2.DraftSession(session_id=f"s{i}", start=300, new_tokens=[1, 150_000], k=4)
        for i in range(3)
    ]
    return draft_pb2.ProposeRequest(sessions=sessions, strict=True)


@pytest.mark.parametrize("request_id", [0, 1, 127, 128, 300, 2**63 + 5])
def test_call_bytes_parse_as_the_stream_request(request_id: int) -> None:
    header = common_pb2.StreamCallHeader(
        request_id=request_id,
        timeout_ms=2000,
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        tracestate="k=v",
    )
    request = propose_request()
    parsed = draft_pb2.ProposeStreamRequest.FromString(call_bytes(header, request))
    assert parsed == draft_pb2.ProposeStreamRequest(header=header, request=request)
    assert parsed.HasField("request")


@pytest.mark.parametrize("request_id", [0, 1, 127, 128, 2**64 - 1])
def test_answer_bytes_parse_as_the_stream_response(request_id: int) -> None:
    response = target_pb2.VerifyResponse(
        results=[target_pb2.VerifyResult(session_id="a", accepted=3, next_token=9)],
        compute_ns=12345,
        replica_id="r1",
    )
    parsed = target_pb2.VerifyStreamResponse.FromString(answer_bytes(request_id, response))
    assert parsed == target_pb2.VerifyStreamResponse(request_id=request_id, response=response)
    assert parsed.WhichOneof("outcome") == "response"


def test_an_empty_response_still_sets_the_outcome() -> None:
    parsed = draft_pb2.ProposeStreamResponse.FromString(
        answer_bytes(7, draft_pb2.ProposeResponse())
    )
    assert parsed.request_id == 7
    assert parsed.WhichOneof("outcome") == "response"


def test_the_server_serializer_passes_bytes_and_serialises_messages() -> None:
    serialize = bytes_or_message(draft_pb2.ProposeStreamResponse.SerializeToString)
    assert serialize is not None
    assert serialize(b"\x08\x01") == b"\x08\x01"
    refusal = draft_pb2.ProposeStreamResponse(
        request_id=3, error=common_pb2.StreamCallError(code=3, message="bad")
    )
    assert serialize(refusal) == refusal.SerializeToString()
    assert bytes_or_message(None) is None
