"""The bytes of the data-plane socket: frames, and the calls and answers they carry.

Every frame is a 4-byte little-endian length ``N`` and ``N`` bytes. A call or an
answer frame's ``N`` bytes are two parts, each a message serialized on its own
(``SerializeToString``) and parsed on its own (``FromString``), so no protobuf tag
is written by hand and the request or response is never copied into a wrapper
message::

    u32 N | u32 H | H bytes: header message | N - 4 - H bytes: body message

* a call: a :class:`~specserve.v1.common_pb2.CallHeader` (request id, deadline,
  trace context) and the unary request (``ProposeRequest`` / ``VerifyRequest``);
* an answer: an :class:`~specserve.v1.common_pb2.AnswerHeader` (request id, and an
  error when the call failed) and, without an error, the unary response.

The hello and its acceptance are plain frames (the protocol is in
:mod:`specserve.serving.data_socket`). All integers are unsigned little-endian;
``H`` counts the header's bytes alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from specserve.serving.malformed import Malformed, Oversized
from specserve.v1 import common_pb2

LENGTH_BYTES = 4
_CALL_HEADER = common_pb2.CallHeader.DESCRIPTOR.full_name


def _length(size: int) -> bytes:
    return size.to_bytes(LENGTH_BYTES, "little")


def frame(payload: bytes) -> bytes:
    """``payload`` with its length in front."""
    return _length(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes | Oversized | None:
    """The next frame's bytes; None at a clean end of the stream (between frames);
    :class:`Oversized` for a frame longer than ``max_bytes`` (its bytes are not read)."""
    try:
        head = await reader.readexactly(LENGTH_BYTES)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise ConnectionError("the connection closed inside a frame's length") from None
    size = int.from_bytes(head, "little")
    if size > max_bytes:
        return Oversized(size, max_bytes)
    return await reader.readexactly(size)


def _two_parts(head: bytes, body: bytes) -> bytes:
    """One frame of a header and a body: one copy of each, in one join."""
    size = LENGTH_BYTES + len(head) + len(body)
    return b"".join((_length(size), _length(len(head)), head, body))


def call_frame(header: common_pb2.CallHeader, request: Message) -> bytes:
    """The frame of one call: ``header`` and ``request``, serialized once each."""
    return _two_parts(header.SerializeToString(), request.SerializeToString())


def answer_frame(request_id: int, response: Message) -> bytes:
    """The frame of one call's response."""
    head = common_pb2.AnswerHeader(request_id=request_id).SerializeToString()
    return _two_parts(head, response.SerializeToString())


def error_frame(request_id: int, code: grpc.StatusCode, text: str) -> bytes:
    """The frame of one call's error (request id 0: the one that ends the connection)."""
    error = common_pb2.CallError(code=code.value[0], message=text)
    head = common_pb2.AnswerHeader(request_id=request_id, error=error).SerializeToString()
    return _two_parts(head, b"")


def _split(payload: bytes) -> tuple[bytes, memoryview]:
    """(header bytes, body bytes) of a frame's payload; ValueError if it has no header."""
    if len(payload) < LENGTH_BYTES:
        raise ValueError(f"{len(payload)} bytes cannot hold the header's length")
    size = int.from_bytes(payload[:LENGTH_BYTES], "little")
    end = LENGTH_BYTES + size
    if end > len(payload):
        raise ValueError(f"a header of {size} bytes does not fit in {len(payload)}")
    return payload[LENGTH_BYTES:end], memoryview(payload)[end:]


@dataclass(frozen=True, eq=False)  # identity: the in-flight budget holds calls by id()
class Call:
    """One call as the replica reads it."""

    header: common_pb2.CallHeader
    request: Any  # the unary request message


def call_parser(request_type: Any) -> Callable[[bytes], Call | Malformed]:
    """Parses a call frame's payload into a :class:`Call`; :class:`Malformed` for bytes
    that are not one (the frame then ends the connection)."""
    name = request_type.DESCRIPTOR.full_name

    def parse(payload: bytes) -> Call | Malformed:
        try:
            head, body = _split(payload)
        except ValueError as e:  # no room for the header its length announces
            return Malformed(_CALL_HEADER, len(payload), str(e))
        try:
            header = common_pb2.CallHeader.FromString(head)
        except Exception as e:  # DecodeError
            return Malformed(_CALL_HEADER, len(payload), f"{type(e).__name__}: {e}"[:200])
        try:
            request = request_type.FromString(body)
        except Exception as e:
            return Malformed(name, len(payload), f"{type(e).__name__}: {e}"[:200])
        return Call(header, request)

    return parse


@dataclass(frozen=True)
class Answer:
    """One answer as the client reads it: ``response`` or ``error``, never both."""

    request_id: int
    response: Any = None  # the unary response message, when the call succeeded
    error: common_pb2.CallError | None = None


def parse_answer(payload: bytes, response_type: Any) -> Answer:
    """An answer frame's payload; raises ``ValueError`` / ``DecodeError`` if it is not one."""
    head, body = _split(payload)
    header = common_pb2.AnswerHeader.FromString(head)
    if header.HasField("error"):
        return Answer(header.request_id, error=header.error)
    return Answer(header.request_id, response=response_type.FromString(body))
