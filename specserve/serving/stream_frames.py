"""The bytes of a data-plane stream message, framed around an already serialised call.

A stream call (``ProposeStreamRequest``, ``VerifyStreamRequest``) is a header
(field 1) and the unary request (field 2); its answer (``ProposeStreamResponse``,
``VerifyStreamResponse``) the request id (field 1) and the unary response (field 2)
or an error (field 3). Building the wrapper message would copy the whole request or
response into it, then serialise the copy; a message field on the wire is only its
tag, its length and its bytes, so :func:`call_bytes` and :func:`answer_bytes` write
those around one serialisation of the inner message instead. What they return
parses as the wrapper message would have serialised (``tests/services/
test_stream_frames.py``), so the other end reads it with the generated classes.

Both ends hand these bytes to gRPC as they are: the client opens its stream without
a request serializer (:mod:`specserve.serving.replica_stream`), and the server's
stream handlers get a response serializer that passes bytes through
(:func:`bytes_or_message`, installed by :class:`~specserve.serving.errors.ErrorInterceptor`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message

from specserve.v1 import common_pb2

_HEADER_TAG = b"\x0a"  # field 1, length-delimited: StreamCallHeader
_BODY_TAG = b"\x12"  # field 2, length-delimited: the unary request / response
_REQUEST_ID_TAG = b"\x08"  # field 1, varint: the answer's request id


def _varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf base-128 varint."""
    assert value >= 0, value
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def call_bytes(header: common_pb2.StreamCallHeader, request: Message) -> bytes:
    """A stream call message: ``header`` and ``request``, serialised once each."""
    head = header.SerializeToString()
    body = request.SerializeToString()
    return b"".join((_HEADER_TAG, _varint(len(head)), head, _BODY_TAG, _varint(len(body)), body))


def answer_bytes(request_id: int, response: Message) -> bytes:
    """A stream answer message holding ``response`` (the ``outcome`` oneof's response)."""
    body = response.SerializeToString()
    return b"".join((_REQUEST_ID_TAG, _varint(request_id), _BODY_TAG, _varint(len(body)), body))


def bytes_or_message(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """A response serializer that sends bytes as they are and serialises messages."""
    if serialize is None:
        return None

    def serialize_answer(answer: Any) -> bytes:
        if isinstance(answer, bytes):
            return answer
        return serialize(answer)

    return serialize_answer
