"""The data-plane socket's frames: a header and a unary message, each serialized alone."""

from __future__ import annotations

import grpc
import pytest

from specserve.serving.data_frames import (
    LENGTH_BYTES,
    Call,
    answer_frame,
    call_frame,
    call_parser,
    error_frame,
    parse_answer,
)
from specserve.serving.malformed import Malformed
from specserve.v1 import common_pb2, draft_pb2, target_pb2


def propose_request() -> draft_pb2.ProposeRequest:
    sessions = [
        draft_pb2.DraftSession(session_id=f"s{i}", start=300, new_tokens=[1, 150_000], k=4)
        for i in range(3)
    ]
    return draft_pb2.ProposeRequest(sessions=sessions, strict=True)


def payload(frame: bytes) -> bytes:
    """A frame's bytes after its length, checking that length."""
    assert int.from_bytes(frame[:LENGTH_BYTES], "little") == len(frame) - LENGTH_BYTES
    return frame[LENGTH_BYTES:]


@pytest.mark.parametrize("request_id", [0, 1, 127, 128, 300, 2**63 + 5])
def test_a_call_frame_is_its_header_then_its_request_each_serialized_alone(
    request_id: int,
) -> None:
    header = common_pb2.CallHeader(
        request_id=request_id,
        timeout_ms=2000,
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        tracestate="k=v",
    )
    request = propose_request()
    data = payload(call_frame(header, request))
    head = header.SerializeToString()
    assert data == len(head).to_bytes(4, "little") + head + request.SerializeToString()
    call = call_parser(draft_pb2.ProposeRequest)(data)
    assert isinstance(call, Call)
    assert call.header == header and call.request == request


@pytest.mark.parametrize("request_id", [1, 127, 128, 2**64 - 1])
def test_an_answer_frame_parses_back_to_its_response(request_id: int) -> None:
    response = target_pb2.VerifyResponse(
        results=[target_pb2.VerifyResult(session_id="a", accepted=3, next_token=9)],
        compute_ns=12345,
        replica_id="r1",
    )
    answer = parse_answer(payload(answer_frame(request_id, response)), target_pb2.VerifyResponse)
    assert answer.request_id == request_id and answer.error is None
    assert answer.response == response


def test_an_empty_response_is_a_response_and_an_error_frame_is_an_error() -> None:
    empty = parse_answer(
        payload(answer_frame(7, draft_pb2.ProposeResponse())), draft_pb2.ProposeResponse
    )
    assert empty.request_id == 7 and empty.error is None
    assert empty.response == draft_pb2.ProposeResponse()
    error = parse_answer(
        payload(error_frame(0, grpc.StatusCode.NOT_FOUND, "no such session")),
        draft_pb2.ProposeResponse,
    )
    assert error.request_id == 0 and error.response is None and error.error is not None
    assert (error.error.code, error.error.message) == (5, "no such session")


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (b"\x01\x00", "cannot hold the header's length"),
        ((100).to_bytes(4, "little") + b"\x08\x01", "does not fit"),
        ((2).to_bytes(4, "little") + b"\xff\xff", "DecodeError"),
        ((0).to_bytes(4, "little") + b"\xff\xff\xff not a message", "DecodeError"),
    ],
)
def test_bytes_that_are_not_a_call_are_malformed(data: bytes, said: str) -> None:
    call = call_parser(draft_pb2.ProposeRequest)(data)
    assert isinstance(call, Malformed) and call.size == len(data)
    assert said in call.why


def test_an_answer_that_is_not_one_raises() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        parse_answer((9).to_bytes(4, "little"), draft_pb2.ProposeResponse)
