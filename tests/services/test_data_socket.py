"""The data-plane socket, both ends, against a scripted in-process replica.

The replica is a real :class:`DataSocketServer` on loopback, beside a gRPC server
that answers ``GetLoad`` (where the client learns the socket's port) and serves the
same calls on ``ProposeStream`` (the fallback). Calls are answered by the session id
they name: ``ok-*`` echoes it, ``slow-*`` after 0.3 s, ``hang-*`` never, ``refuse``
NOT_FOUND. No model is involved: what is tested is the protocol (hello, frames,
the frames that end a connection), and that :class:`ReplicaStream` drives the
socket with the rules it has for a gRPC stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest

from specserve.engine.errors import NotFound
from specserve.serving import data_socket
from specserve.serving.call_stream import (
    IN_FLIGHT_FRAMES,
    InFlightBytes,
    StreamMethod,
    serve_call_stream,
)
from specserve.serving.data_socket import DataSocketServer, frame, read_frame
from specserve.serving.errors import ErrorInterceptor
from specserve.serving.replica_stream import ReplicaStream
from specserve.serving.socket_call import SocketCall, SocketDial
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc

PROPOSE = "/specserve.v1.DraftService/Propose"


class Scripted(draft_pb2_grpc.DraftServiceServicer):
    """GetLoad (with the socket's port, or 0) and ProposeStream over the same method."""

    def __init__(self) -> None:
        self.data_port = 0
        self.draining = asyncio.Event()
        self.seen: list[str] = []
        self.method = StreamMethod(PROPOSE, self.propose, draft_pb2.ProposeStreamResponse)
        self.stream_bytes_in_flight: int | None = None
        self.replica_budget: InFlightBytes | None = None  # shared by streams and sockets

    async def propose(self, request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        name = request.sessions[0].session_id
        self.seen.append(name)
        if name.startswith("slow-"):
            await asyncio.sleep(0.3)
        if name.startswith("hang-"):
            await asyncio.Event().wait()
        if name == "refuse":
            raise NotFound("no such session here")
        return draft_pb2.ProposeResponse(results=[draft_pb2.DraftResult(session_id=name)])

    async def GetLoad(self, request: Any, context: Any) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(role="draft", data_port=self.data_port)

    async def ProposeStream(self, request_iterator: AsyncIterator[Any], context: Any) -> None:
        await serve_call_stream(
            self.method, context, self.draining, self.stream_bytes_in_flight, self.replica_budget
        )


@contextlib.asynccontextmanager
async def replica(
    *,
    serve_socket: bool = True,
    max_bytes: int = 1 << 20,
    bytes_in_flight: int | None = None,
    replica_bytes: int | None = None,
) -> AsyncIterator[Any]:
    """(address, servicer, socket server or None) of a scripted replica on loopback;
    ``replica_bytes``: a budget its sockets and gRPC streams share (None: none)."""
    servicer = Scripted()
    if replica_bytes is not None:
        servicer.replica_budget = InFlightBytes(replica_bytes)
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])  # as the replicas': bytes pass
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    plane = None
    if serve_socket:
        plane = DataSocketServer(
            servicer.method,
            draft_pb2.ProposeStreamRequest,
            max_bytes=max_bytes,
            draining=servicer.draining,
            bytes_in_flight=bytes_in_flight or IN_FLIGHT_FRAMES * max_bytes,
            replica_budget=servicer.replica_budget,
        )
        servicer.data_port = await plane.start("127.0.0.1", 0, None)
    try:
        yield f"127.0.0.1:{port}", servicer, plane
    finally:
        servicer.draining.set()
        if plane is not None:
            await plane.close()
        await server.stop(0)


@contextlib.asynccontextmanager
async def dialled(*, serve_socket: bool = True, **backoff: float) -> AsyncIterator[Any]:
    """(stream, servicer, socket server or None): a ReplicaStream dialling the replica's
    socket (the orchestrator's), closed afterwards."""
    async with (
        replica(serve_socket=serve_socket) as (address, servicer, plane),
        grpc.aio.insecure_channel(address) as channel,
    ):
        stream = ReplicaStream.propose(channel, SocketDial.of(address), **backoff)
        try:
            yield stream, servicer, plane
        finally:
            await stream.close()


def request(name: str) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(sessions=[draft_pb2.DraftSession(session_id=name, k=1)])


def answered(response: draft_pb2.ProposeResponse) -> str:
    return str(response.results[0].session_id)


async def raw(port: int, hello: bytes = PROPOSE.encode()) -> tuple[Any, Any, bytes | None]:
    """A connection that said ``hello``; the replica's reply to it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(frame(hello))
    reply = await asyncio.wait_for(read_frame(reader, 1 << 20), 10)
    assert not isinstance(reply, data_socket.Oversized)
    return reader, writer, reply


async def ending(reader: asyncio.StreamReader) -> tuple[grpc.StatusCode, str]:
    """The frame that ends a connection (request id 0, an error), then the close."""
    data = await asyncio.wait_for(read_frame(reader, 1 << 20), 10)
    assert isinstance(data, bytes)
    answer = draft_pb2.ProposeStreamResponse.FromString(data)
    assert answer.request_id == 0 and answer.WhichOneof("outcome") == "error"
    assert await asyncio.wait_for(reader.read(), 10) == b""  # then the replica closes
    codes = {c.value[0]: c for c in grpc.StatusCode}
    return codes[answer.error.code], answer.error.message


def test_calls_go_over_the_socket_and_each_gets_its_own_answer() -> None:
    async def body() -> None:
        async with dialled() as (stream, _, _):
            names = [f"ok-{i}" for i in range(8)] + ["slow-1"]
            got = await asyncio.gather(*(stream.call(request(n), 10) for n in names))
            assert [answered(r) for r in got] == names
            assert stream.opened == 1 and isinstance(stream._stream, SocketCall)
            assert stream._stream.over_socket
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stream.call(request("refuse"), 10)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert "no such session" in (e.value.details() or "")
            assert answered(await stream.call(request("ok-after"), 10)) == "ok-after"

    asyncio.run(body())


def test_a_call_past_its_deadline_raises_deadline_exceeded_and_the_socket_goes_on() -> None:
    async def body() -> None:
        async with dialled() as (stream, _, _):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stream.call(request("hang-1"), 0.2)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert answered(await stream.call(request("ok-1"), 10)) == "ok-1"
            assert stream.opened == 1

    asyncio.run(body())


def test_a_replica_without_a_data_port_is_served_over_its_grpc_stream() -> None:
    async def body() -> None:
        async with dialled(serve_socket=False) as (stream, _, _):
            assert answered(await stream.call(request("ok-1"), 10)) == "ok-1"
            assert isinstance(stream._stream, SocketCall)
            assert not stream._stream.over_socket  # the gRPC stream carried it

    asyncio.run(body())


def test_a_socket_that_cannot_be_reached_falls_back_to_the_grpc_stream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body() -> None:
        async with dialled(serve_socket=False) as (stream, servicer, _):
            closed = socket.socket()
            closed.bind(("127.0.0.1", 0))
            servicer.data_port = closed.getsockname()[1]  # reported, nothing listens
            closed.close()
            assert answered(await stream.call(request("ok-1"), 10)) == "ok-1"
            assert isinstance(stream._stream, SocketCall)
            assert not stream._stream.over_socket  # the gRPC stream carried it

    asyncio.run(body())
    assert "cannot be reached" in caplog.text and "--data-port off" in caplog.text


def test_a_hello_naming_another_method_is_unimplemented() -> None:
    async def body() -> None:
        async with replica() as (_, servicer, _):
            _, writer, reply = await raw(servicer.data_port, b"/x.Y/Verify")
            assert reply
            answer = draft_pb2.ProposeStreamResponse.FromString(reply)
            assert answer.error.code == grpc.StatusCode.UNIMPLEMENTED.value[0]
            assert PROPOSE in answer.error.message
            writer.close()

    asyncio.run(body())


def test_a_frame_that_does_not_parse_ends_the_connection_and_others_go_on() -> None:
    async def body() -> None:
        async with dialled() as (stream, servicer, _):
            reader, writer, reply = await raw(servicer.data_port)
            assert reply == b""  # accepted
            writer.write(frame(b"\xff\xff\xff not a message"))
            code, text = await ending(reader)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in text
            assert answered(await stream.call(request("ok-1"), 10)) == "ok-1"

    asyncio.run(body())


def test_a_frame_past_the_size_limit_is_refused_unread() -> None:
    async def body() -> None:
        async with replica(max_bytes=1 << 20) as (_, servicer, _):
            reader, writer, _ = await raw(servicer.data_port)
            writer.write((1 << 30).to_bytes(4, "little"))  # a gigabyte announced, none sent
            code, text = await ending(reader)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert str(1 << 30) in text and "limit" in text
            assert servicer.seen == []

    asyncio.run(body())


def big_call(name: str) -> bytes:
    """A Propose call of about 100 kB (50,000 two-byte token ids), ``slow-N`` id N."""
    session = draft_pb2.DraftSession(session_id=name, k=1, new_tokens=[1000] * 50_000)
    header = common_pb2.StreamCallHeader(request_id=int(name.split("-")[1]))
    call = draft_pb2.ProposeStreamRequest(header=header)
    call.request.sessions.append(session)
    return call.SerializeToString()


@pytest.mark.parametrize("over", ["socket", "grpc stream"])
def test_a_stream_past_its_bytes_in_flight_is_read_no_further_until_answers_free_them(
    over: str,
) -> None:
    async def body() -> None:
        async with replica(bytes_in_flight=250_000) as (address, servicer, _):
            servicer.stream_bytes_in_flight = 250_000
            calls = [big_call(f"slow-{i}") for i in range(1, 5)]
            if over == "socket":
                reader, writer, _ = await raw(servicer.data_port)
                for data in calls:
                    writer.write(frame(data))

                async def answer() -> Any:
                    return await read_frame(reader, 1 << 20)
            else:
                channel = grpc.aio.insecure_channel(address)
                stream = channel.stream_stream(PROPOSE + "Stream")()

                async def send() -> None:
                    for data in calls:
                        await stream.write(data)

                sending = asyncio.ensure_future(send())

                async def answer() -> Any:
                    return await stream.read()

            await asyncio.sleep(0.15)
            assert len(servicer.seen) == 3  # 300 kB held: the fourth waits unread
            answers = [await asyncio.wait_for(answer(), 10) for _ in range(4)]
            assert len(servicer.seen) == 4 and all(isinstance(a, bytes) for a in answers)
            if over == "socket":
                writer.close()
            else:
                await sending
                stream.cancel()
                await channel.close()

    asyncio.run(body())


@pytest.mark.parametrize("second", ["socket", "grpc stream"])
def test_many_connections_together_hold_no_more_than_the_replicas_bytes_in_flight(
    second: str,
) -> None:
    async def body() -> None:
        # Each connection alone may hold 1 MB; the replica's connections together 250 kB.
        async with replica(bytes_in_flight=1_000_000, replica_bytes=250_000) as (
            address,
            servicer,
            _,
        ):
            first, first_writer, _ = await raw(servicer.data_port)
            for i in (1, 2, 3):
                first_writer.write(frame(big_call(f"slow-{i}")))
            await asyncio.sleep(0.1)
            assert len(servicer.seen) == 3  # 300 kB held on the replica
            late = big_call("slow-4")
            if second == "socket":
                reader, writer, _ = await raw(servicer.data_port)
                writer.write(frame(late))

                async def answer() -> Any:
                    return await read_frame(reader, 1 << 20)
            else:
                channel = grpc.aio.insecure_channel(address)
                stream = channel.stream_stream(PROPOSE + "Stream")()
                await stream.write(late)

                async def answer() -> Any:
                    return await stream.read()

            await asyncio.sleep(0.1)
            assert len(servicer.seen) == 3  # the other connection's call waits unread
            got = await asyncio.wait_for(answer(), 10)  # once the first three freed room
            assert isinstance(got, bytes) and servicer.seen[-1] == "slow-4"
            for _ in range(3):
                assert isinstance(await asyncio.wait_for(read_frame(first, 1 << 20), 10), bytes)
            assert servicer.replica_budget is not None and servicer.replica_budget.total == 0
            first_writer.close()
            if second == "socket":
                writer.close()
            else:
                stream.cancel()
                await channel.close()

    asyncio.run(body())


def test_a_connection_that_says_nothing_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_socket, "HELLO_TIMEOUT_S", 0.2)

    async def body() -> None:
        async with replica() as (_, servicer, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", servicer.data_port)
            assert await asyncio.wait_for(reader.read(), 10) == b""
            writer.close()

    asyncio.run(body())


def test_a_graceful_shutdown_answers_the_calls_in_flight_then_ends_unavailable() -> None:
    async def body() -> None:
        async with dialled() as (stream, servicer, _):
            slow = asyncio.ensure_future(stream.call(request("slow-1"), 10))
            await asyncio.sleep(0.1)
            servicer.draining.set()
            assert answered(await slow) == "slow-1"  # answered before the end
            await asyncio.sleep(0.1)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stream.call(request("ok-late"), 2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(body())


def test_a_dropped_connection_fails_the_calls_in_flight_and_the_next_call_redials() -> None:
    async def body() -> None:
        async with dialled(backoff_s=0.01, max_backoff_s=0.01) as (stream, _, plane):
            assert answered(await stream.call(request("ok-1"), 10)) == "ok-1"
            hung = asyncio.ensure_future(stream.call(request("hang-1"), 10))
            await asyncio.sleep(0.1)
            for task in list(plane._connections):
                task.cancel()  # the connection drops under the call
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await hung
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            await asyncio.sleep(0.05)
            assert answered(await stream.call(request("ok-2"), 10)) == "ok-2"
            assert stream.opened == 2

    asyncio.run(body())
