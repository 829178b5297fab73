"""The orchestrator's gRPC ``Generation`` API as the HTTP layer calls it: one call per choice.

Each call carries the HTTP request's metadata (``authorization`` and the W3C trace
context) and the request timeout. A request's choices run at once, so the
orchestrator batches them on the target; when one fails or the HTTP client goes
away, every call still running is cancelled, and the orchestrator cancels their
sessions (a cancelled gRPC call is a client that left).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.openai_api.errors import from_grpc
from specserve.openai_api.requests import Call
from specserve.serving.tls import ClientTls, aio_channel
from specserve.v1 import generate_pb2, generate_pb2_grpc

Metadata = tuple[tuple[str, str], ...]
StreamItem = tuple[int, generate_pb2.GenerateStreamResponse]
_DONE = object()


class Upstream:
    """One channel to the orchestrator, shared by every HTTP request."""

    def __init__(self, address: str, timeout_s: float, tls: ClientTls | None = None) -> None:
        """``tls``: dial the orchestrator over TLS (None: plaintext)."""
        self.address = address
        self.timeout_s = timeout_s
        self.channel = aio_channel(address, tls)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def serving(self) -> bool:
        """Whether the orchestrator answers health SERVING now."""
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def generate(
        self, calls: Sequence[Call], metadata: Metadata
    ) -> list[generate_pb2.GenerateResponse]:
        """Every call's whole response, in call order (raises ApiError on the first failure)."""
        tasks = [
            asyncio.ensure_future(
                self.stub.Generate(c.request, metadata=metadata, timeout=self.timeout_s)
            )
            for c in calls
        ]
        try:
            return list(await asyncio.gather(*tasks))
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        finally:
            for t in tasks:
                t.cancel()

    async def stream(self, calls: Sequence[Call], metadata: Metadata) -> AsyncIterator[StreamItem]:
        """(choice index, message) as each call's messages arrive (raises ApiError)."""
        streams = [
            (
                c.index,
                self.stub.GenerateStream(c.request, metadata=metadata, timeout=self.timeout_s),
            )
            for c in calls
        ]
        try:
            if len(streams) == 1:  # the common case, without a queue in the way
                index, call = streams[0]
                async for message in call:
                    yield index, message
                return
            async for item in _merged(streams):
                yield item
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        finally:
            for _, call in streams:
                call.cancel()


async def _merged(
    streams: Sequence[tuple[int, grpc.aio.UnaryStreamCall]],
) -> AsyncIterator[StreamItem]:
    """The messages of several streams in arrival order; the first error is raised."""
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def pump(index: int, call: grpc.aio.UnaryStreamCall) -> None:
        try:
            async for message in call:
                queue.put_nowait((index, message))
            queue.put_nowait(_DONE)
        except BaseException as e:  # handed to the reader, which raises it
            queue.put_nowait(e)

    tasks = [asyncio.ensure_future(pump(i, c)) for i, c in streams]
    try:
        open_streams = len(tasks)
        while open_streams:
            item = await queue.get()
            if item is _DONE:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item  # type: ignore[misc]
    finally:
        for t in tasks:
            t.cancel()
