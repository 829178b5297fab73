"""ReplicaStream, the client end of a data-plane stream, against a scripted in-process server.

The server answers each ProposeStream call by the session id it names: ``ok-*``
echoes the id back, ``slow-*`` answers after 0.3 s, ``hang-*`` never answers,
``break`` ends the stream with UNAVAILABLE, ``refuse`` answers NOT_FOUND. No model
is involved: what is tested is the framing, the request-id matching, deadlines,
and what a broken stream does to the calls in flight and to the next call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest

from specserve.serving.replica_stream import ReplicaStream
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc


class ScriptedDraft(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self) -> None:
        self.streams = 0
        self.headers: list[common_pb2.StreamCallHeader] = []

    async def ProposeStream(
        self, request_iterator: AsyncIterator[draft_pb2.ProposeStreamRequest], context: object
    ) -> AsyncIterator[draft_pb2.ProposeStreamResponse]:
        self.streams += 1
        answers: asyncio.Queue[draft_pb2.ProposeStreamResponse] = asyncio.Queue()

        async def answer(message: draft_pb2.ProposeStreamRequest) -> None:
            name = message.request.sessions[0].session_id
            rid = message.header.request_id
            if name.startswith("slow-"):
                await asyncio.sleep(0.3)
            if name.startswith("hang-"):
                return
            if name == "refuse":
                error = common_pb2.StreamCallError(
                    code=grpc.StatusCode.NOT_FOUND.value[0], message="no such session here"
                )
                await answers.put(draft_pb2.ProposeStreamResponse(request_id=rid, error=error))
                return
            result = draft_pb2.DraftResult(session_id=name)
            response = draft_pb2.ProposeResponse(results=[result])
            await answers.put(draft_pb2.ProposeStreamResponse(request_id=rid, response=response))

        tasks = []
        reader_done = asyncio.Event()

        async def read() -> None:
            async for message in request_iterator:
                self.headers.append(message.header)
                if message.request.sessions[0].session_id == "break":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica went away")  # type: ignore[attr-defined]
                tasks.append(asyncio.ensure_future(answer(message)))
            reader_done.set()

        reader = asyncio.ensure_future(read())
        try:
            while True:
                getter = asyncio.ensure_future(answers.get())
                await asyncio.wait([getter, reader], return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                    continue
                getter.cancel()
                reader.result()  # re-raises the abort
                if reader_done.is_set() and not tasks:
                    return
        finally:
            reader.cancel()
            for t in tasks:
                t.cancel()


def request(name: str) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(sessions=[draft_pb2.DraftSession(session_id=name, k=1)])


async def serve() -> tuple[grpc.aio.Server, ScriptedDraft, str]:
    server = grpc.aio.server()
    servicer = ScriptedDraft()
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, servicer, f"127.0.0.1:{port}"


def test_concurrent_calls_share_one_stream_and_get_their_own_answers() -> None:
    async def main() -> None:
        server, servicer, address = await serve()
        async with grpc.aio.insecure_channel(address) as channel:
            stream = ReplicaStream.propose(channel)
            names = ["slow-a", "ok-b", "ok-c", "slow-d", "ok-e"]
            answers = await asyncio.gather(*(stream.call(request(n), 5.0) for n in names))
            assert [a.results[0].session_id for a in answers] == names
            assert stream.opened == servicer.streams == 1
            assert stream.in_flight == 0
            # The header carries a distinct id and each call's own deadline.
            assert len({h.request_id for h in servicer.headers}) == len(names)
            assert {h.timeout_ms for h in servicer.headers} == {5000}
            await stream.close()
        await server.stop(0)

    asyncio.run(main())


def test_an_error_answer_raises_the_unary_error_and_the_stream_goes_on() -> None:
    async def main() -> None:
        server, servicer, address = await serve()
        async with grpc.aio.insecure_channel(address) as channel:
            stream = ReplicaStream.propose(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stream.call(request("refuse"), 5.0)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            assert refused.value.details() == "no such session here"
            ok = await stream.call(request("ok-after"), 5.0)
            assert ok.results[0].session_id == "ok-after"
            assert servicer.streams == 1
            await stream.close()
        await server.stop(0)

    asyncio.run(main())


def test_a_call_past_its_timeout_raises_deadline_exceeded_and_is_forgotten() -> None:
    async def main() -> None:
        server, _, address = await serve()
        async with grpc.aio.insecure_channel(address) as channel:
            stream = ReplicaStream.propose(channel)
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await stream.call(request("hang-1"), 0.2)
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert stream.in_flight == 0
            assert (await stream.call(request("ok-2"), 5.0)).results[0].session_id == "ok-2"
            await stream.close()
        await server.stop(0)

    asyncio.run(main())


def test_a_broken_stream_fails_the_calls_in_flight_and_the_next_call_reopens_it() -> None:
    async def main() -> None:
        server, servicer, address = await serve()
        async with grpc.aio.insecure_channel(address) as channel:
            stream = ReplicaStream.propose(channel, backoff_s=0.1)
            waiting = [
                asyncio.ensure_future(stream.call(request(f"hang-{i}"), 5.0)) for i in (1, 2)
            ]
            await asyncio.sleep(0.1)
            assert stream.in_flight == 2
            with pytest.raises(grpc.aio.AioRpcError) as broke:
                await stream.call(request("break"), 5.0)
            assert broke.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "the replica went away" in (broke.value.details() or "")
            for call in waiting:  # the calls in flight fail as a lost unary call does
                with pytest.raises(grpc.aio.AioRpcError) as lost:
                    await call
                assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
            # The next call opens a new stream (after the backoff) and is answered.
            ok = await stream.call(request("ok-again"), 5.0)
            assert ok.results[0].session_id == "ok-again"
            assert stream.opened == servicer.streams == 2
            # A call whose deadline ends before the backoff does fails at once.
            with pytest.raises(grpc.aio.AioRpcError):
                await stream.call(request("break"), 5.0)
            with pytest.raises(grpc.aio.AioRpcError) as early:
                await stream.call(request("ok-too-soon"), 0.01)
            assert early.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "reopens in" in (early.value.details() or "")
            await stream.close()
        await server.stop(0)

    asyncio.run(main())


def test_a_replica_that_goes_away_fails_the_calls_in_flight_unavailable() -> None:
    async def main() -> None:
        server, _, address = await serve()
        async with grpc.aio.insecure_channel(address) as channel:
            stream = ReplicaStream.propose(channel)
            waiting = asyncio.ensure_future(stream.call(request("hang-x"), 5.0))
            await asyncio.sleep(0.1)
            await server.stop(0)
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await waiting
            assert lost.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            await stream.close()

    asyncio.run(main())
