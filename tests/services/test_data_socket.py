"""The data-plane socket, both ends, against a scripted in-process replica.

The replica is a real :class:`DataSocketServer` on loopback, beside a gRPC server
that answers ``GetLoad`` (where the client learns the socket's port). Calls are
answered by the session id they name: ``ok-*`` echoes it, ``slow-*`` after 0.3 s,
``hang-*`` never, ``refuse`` NOT_FOUND. No model is involved: what is tested is the
protocol (hello, frames, the frames that end a connection), and the rules
:class:`ReplicaConnection` keeps for the calls it multiplexes (request ids, deadlines,
breaks, backoff, a replica without a reachable socket).
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
from specserve.serving.call_stream import IN_FLIGHT_FRAMES, InFlightBytes, StreamMethod
from specserve.serving.data_frames import Answer, call_frame, frame, parse_answer, read_frame
from specserve.serving.data_socket import DataSocketServer
from specserve.serving.errors import ErrorInterceptor
from specserve.serving.replica_connection import ReplicaConnection
from specserve.serving.socket_call import SocketCall, SocketDial
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc

PROPOSE = "/specserve.v1.DraftService/Propose"


class Scripted(draft_pb2_grpc.DraftServiceServicer):
    """GetLoad (with the socket's port, or 0) and the socket's Propose."""

    def __init__(self) -> None:
        self.data_port = 0
        self.draining = asyncio.Event()
        self.seen: list[str] = []
        self.headers: list[common_pb2.CallHeader] = []  # of every call the socket read
        self.method = StreamMethod(PROPOSE, self.propose)
        self.replica_budget: InFlightBytes | None = None  # shared by the connections

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


@contextlib.asynccontextmanager
async def replica(
    *,
    serve_socket: bool = True,
    max_bytes: int = 1 << 20,
    bytes_in_flight: int | None = None,
    replica_bytes: int | None = None,
) -> AsyncIterator[Any]:
    """(address, servicer, socket server or None) of a scripted replica on loopback;
    ``replica_bytes``: a budget its connections share (None: none)."""
    servicer = Scripted()
    if replica_bytes is not None:
        servicer.replica_budget = InFlightBytes(replica_bytes)
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])  # as the replicas'
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    plane = None
    if serve_socket:
        plane = DataSocketServer(
            servicer.method,
            draft_pb2.ProposeRequest,
            max_bytes=max_bytes,
            draining=servicer.draining,
            bytes_in_flight=bytes_in_flight or IN_FLIGHT_FRAMES * max_bytes,
            replica_budget=servicer.replica_budget,
        )
        servicer.data_port = await plane.start("127.0.0.1", 0, None)
        parse = plane.parse

        def recording(data: bytes) -> Any:
            call = parse(data)
            servicer.headers.extend([call.header] if hasattr(call, "header") else [])
            return call

        plane.parse = recording  # type: ignore[method-assign]
    try:
        yield f"127.0.0.1:{port}", servicer, plane
    finally:
        servicer.draining.set()
        if plane is not None:
            await plane.close()
        await server.stop(0)


@contextlib.asynccontextmanager
async def dialled(*, serve_socket: bool = True, **backoff: float) -> AsyncIterator[Any]:
    """(stream, servicer, socket server or None): a ReplicaConnection dialling the replica's
    socket (the orchestrator's), closed afterwards."""
    async with (
        replica(serve_socket=serve_socket) as (address, servicer, plane),
        grpc.aio.insecure_channel(address) as channel,
    ):
        stream = ReplicaConnection.propose(channel, SocketDial.of(address), **backoff)
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


def answer_of(data: bytes) -> Answer:
    return parse_answer(data, draft_pb2.ProposeResponse)


async def ending(reader: asyncio.StreamReader) -> tuple[grpc.StatusCode, str]:
    """The frame that ends a connection (request id 0, an error), then the close."""
    data = await asyncio.wait_for(read_frame(reader, 1 << 20), 10)
    assert isinstance(data, bytes)
    answer = answer_of(data)
    assert answer.request_id == 0 and answer.error is not None
    assert await asyncio.wait_for(reader.read(), 10) == b""  # then the replica closes
    codes = {c.value[0]: c for c in grpc.StatusCode}
    return codes[answer.error.code], answer.error.message


def test_calls_go_over_the_socket_and_each_gets_its_own_answer() -> None:
    async def body() -> None:
        async with dialled() as (stream, _, _):
            names = [f"ok-{i}" for i in range(8)] + ["slow-1"]
            got = await asyncio.gather(*(stream.call(request(n), 10) for n in names))
            assert [answered(r) for r in got] == names
            assert stream.opened == 1 and isinstance(stream._connection, SocketCall)
            assert stream._connection.connected
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


def test_calls_carry_their_own_request_ids_and_deadlines() -> None:
    async def body() -> None:
        async with dialled() as (stream, servicer, _):
            names = [f"ok-{i}" for i in range(5)]
            await asyncio.gather(*(stream.call(request(n), 5.0) for n in names))
            assert len({h.request_id for h in servicer.headers}) == len(names)
            assert {h.timeout_ms for h in servicer.headers} == {5000}
            assert stream.in_flight == 0

    asyncio.run(body())


def test_a_replica_without_a_data_port_fails_its_calls_unavailable_naming_the_port() -> None:
    """No other transport to fall back to: the call fails at once, and says why."""

    async def body() -> None:
        async with dialled(serve_socket=False) as (stream, _, _):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(stream.call(request("ok-1"), 30), 10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "reports no data port" in (e.value.details() or "")
            assert "--data-port" in (e.value.details() or "")

    asyncio.run(body())


def test_a_socket_that_cannot_be_reached_fails_its_calls_unavailable_naming_the_port() -> None:
    async def body() -> None:
        async with dialled(serve_socket=False) as (stream, servicer, _):
            closed = socket.socket()
            closed.bind(("127.0.0.1", 0))
            servicer.data_port = closed.getsockname()[1]  # reported, nothing listens
            closed.close()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(stream.call(request("ok-1"), 30), 10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            details = e.value.details() or ""
            assert f"127.0.0.1:{servicer.data_port}" in details and "cannot be reached" in details

    asyncio.run(body())


def test_a_hello_naming_another_method_is_unimplemented() -> None:
    async def body() -> None:
        async with replica() as (_, servicer, _):
            _, writer, reply = await raw(servicer.data_port, b"/x.Y/Verify")
            assert reply
            answer = answer_of(reply)
            assert answer.error is not None
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
    """The frame of a Propose call of about 100 kB (50,000 two-byte token ids),
    ``slow-N`` id N."""
    session = draft_pb2.DraftSession(session_id=name, k=1, new_tokens=[1000] * 50_000)
    header = common_pb2.CallHeader(request_id=int(name.split("-")[1]))
    return call_frame(header, draft_pb2.ProposeRequest(sessions=[session]))


def test_a_connection_past_its_bytes_in_flight_is_read_no_further_until_answers_free_them() -> None:
    async def body() -> None:
        async with replica(bytes_in_flight=250_000) as (_, servicer, _):
            reader, writer, _ = await raw(servicer.data_port)
            for i in range(1, 5):
                writer.write(big_call(f"slow-{i}"))
            await asyncio.sleep(0.15)
            assert len(servicer.seen) == 3  # 300 kB held: the fourth waits unread
            answers = [await asyncio.wait_for(read_frame(reader, 1 << 20), 10) for _ in range(4)]
            assert len(servicer.seen) == 4 and all(isinstance(a, bytes) for a in answers)
            writer.close()

    asyncio.run(body())


def test_many_connections_together_hold_no_more_than_the_replicas_bytes_in_flight() -> None:
    async def body() -> None:
        # Each connection alone may hold 1 MB; the replica's connections together 250 kB.
        async with replica(bytes_in_flight=1_000_000, replica_bytes=250_000) as (_, servicer, _):
            first, first_writer, _ = await raw(servicer.data_port)
            for i in (1, 2, 3):
                first_writer.write(big_call(f"slow-{i}"))
            await asyncio.sleep(0.1)
            assert len(servicer.seen) == 3  # 300 kB held on the replica
            reader, writer, _ = await raw(servicer.data_port)
            writer.write(big_call("slow-4"))
            await asyncio.sleep(0.1)
            assert len(servicer.seen) == 3  # the other connection's call waits unread
            got = await asyncio.wait_for(read_frame(reader, 1 << 20), 10)  # once room freed
            assert isinstance(got, bytes) and servicer.seen[-1] == "slow-4"
            for _ in range(3):
                assert isinstance(await asyncio.wait_for(read_frame(first, 1 << 20), 10), bytes)
            assert servicer.replica_budget is not None and servicer.replica_budget.total == 0
            first_writer.close()
            writer.close()

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


def test_breaks_in_a_row_back_off_and_a_call_that_cannot_wait_fails_at_once() -> None:
    """After a break, the next call redials after the backoff; one whose deadline ends
    before the backoff does fails UNAVAILABLE at once, saying so."""

    async def body() -> None:
        async with dialled(backoff_s=5.0, max_backoff_s=5.0) as (stream, _, plane):
            assert answered(await stream.call(request("ok-1"), 10)) == "ok-1"
            for task in list(plane._connections):
                task.cancel()  # the connection drops
            await asyncio.sleep(0.1)
            with pytest.raises(grpc.aio.AioRpcError) as early:
                await stream.call(request("ok-too-soon"), 0.5)
            assert early.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "reopens in" in (early.value.details() or "")
            assert stream.opened == 1

    asyncio.run(body())
