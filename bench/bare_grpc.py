"""A bare grpc.aio server and its client: the floor that Python gRPC itself sets.

The server has no interceptors and no specserve code: the standard health service
and an echo service of raw bytes with two methods,

* ``/bench.Echo/Unary``: one unary call per message;
* ``/bench.Echo/Stream``: a bidirectional stream, one answer per message;
* ``/bench.Echo/SocketPort``: the port of a plain TCP echo beside it (asyncio
  streams, each message a 4-byte little-endian length and its bytes, as on the
  replicas' data-plane sockets), the floor of the socket transport.

An echo request names the size of its answer (its first four bytes, little-endian),
so a reference call carries exactly the bytes of the call it stands beside, both
ways. ``bench.rpc_overhead`` times a round's two calls both ways here in the same
loop as the real round: the unary floor and the stream floor.

    python -m bench.bare_grpc --host 127.0.0.1 --port 0 --port-file FILE
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

ECHO_SERVICE = "bench.Echo"
ECHO_UNARY = f"/{ECHO_SERVICE}/Unary"
ECHO_STREAM = f"/{ECHO_SERVICE}/Stream"
SIZE_PREFIX = 4  # bytes of an echo request that name its answer's size


def echo_request(request_bytes: int, response_bytes: int) -> bytes:
    """An echo request of ``request_bytes`` (at least the size prefix) asking for an
    answer of ``response_bytes``."""
    padding = bytes(max(0, request_bytes - SIZE_PREFIX))
    return response_bytes.to_bytes(SIZE_PREFIX, "little") + padding


def echo_answer(request: bytes) -> bytes:
    """The answer an echo request asks for: as many zero bytes as its prefix says."""
    return bytes(int.from_bytes(request[:SIZE_PREFIX], "little"))


async def _unary(request: bytes, context: Any) -> bytes:
    return echo_answer(request)


_socket_port = 0  # the plain TCP echo's port, once listening


async def _socket_port_of(request: bytes, context: Any) -> bytes:
    return _socket_port.to_bytes(4, "little")


async def _echo_frames(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            size = int.from_bytes(await reader.readexactly(4), "little")
            answer = echo_answer(await reader.readexactly(size))
            writer.write(len(answer).to_bytes(4, "little") + answer)
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def _stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for request in requests:
        yield echo_answer(request)


def echo_handler() -> grpc.GenericRpcHandler:
    """The echo service (raw bytes: no (de)serialisers)."""
    return grpc.method_handlers_generic_handler(
        ECHO_SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(_unary),
            "Stream": grpc.stream_stream_rpc_method_handler(_stream),
            "SocketPort": grpc.unary_unary_rpc_method_handler(_socket_port_of),
        },
    )


class EchoClient:
    """Calls to the echo service over one channel: unary, on one open stream, or on one
    open connection to the plain TCP echo (``host``: where the channel's server is).

    :meth:`stream_call` and :meth:`socket_call` write one message and wait for its
    answer, as a caller with one call in flight on a long-lived stream does; the stream
    (connection) opens on the first such call and stays open until :meth:`close`.
    """

    def __init__(self, channel: grpc.aio.Channel, host: str = "127.0.0.1") -> None:
        self._unary = channel.unary_unary(ECHO_UNARY)
        self._open_stream = channel.stream_stream(ECHO_STREAM)
        self._port = channel.unary_unary(f"/{ECHO_SERVICE}/SocketPort")
        self._host = host
        self._stream: grpc.aio.StreamStreamCall | None = None
        self._socket: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def socket_call(self, request: bytes) -> bytes:
        if self._socket is None:
            port = int.from_bytes(await self._port(b""), "little")
            reader, writer = await asyncio.open_connection(self._host, port)
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socket = reader, writer
        reader, writer = self._socket
        writer.write(len(request).to_bytes(4, "little") + request)
        size = int.from_bytes(await reader.readexactly(4), "little")
        return await reader.readexactly(size)

    async def unary_call(self, request: bytes) -> bytes:
        answer: bytes = await self._unary(request)
        return answer

    async def stream_call(self, request: bytes) -> bytes:
        if self._stream is None:
            self._stream = self._open_stream()
        await self._stream.write(request)
        answer = await self._stream.read()
        assert isinstance(answer, bytes), "the echo stream ended"
        return answer

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.done_writing()
            self._stream = None
        if self._socket is not None:
            self._socket[1].close()
            self._socket = None


BARE = ("unary", "stream", "socket")  # the transports the echo offers


async def bare_round(
    echo: tuple[EchoClient, EchoClient], kind: str, sizes: tuple[tuple[int, int], tuple[int, int]]
) -> int:
    """One round's two messages, byte for byte, on the bare echo server (ns): the draft's
    on the first client, the target's on the second, as unary calls, stream messages or
    frames on the plain TCP echo (``kind``)."""
    total = 0
    for client, (request, response) in zip(echo, sizes, strict=True):
        payload = echo_request(request, response)
        call = {
            "unary": client.unary_call,
            "stream": client.stream_call,
            "socket": client.socket_call,
        }[kind]
        t0 = time.perf_counter_ns()
        await call(payload)
        total += time.perf_counter_ns() - t0
    return total


async def serve(host: str, port: int, port_file: Path | None) -> None:
    global _socket_port
    echo = await asyncio.start_server(_echo_frames, host, 0)
    _socket_port = int(echo.sockets[0].getsockname()[1])
    server = grpc.aio.server()
    health = health_aio.HealthServicer()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_generic_rpc_handlers((echo_handler(),))
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    if port_file is not None:  # atomic: the launcher never reads a half-written port
        tmp = port_file.with_name(port_file.name + ".tmp")
        tmp.write_text(str(bound))
        tmp.replace(port_file)
    await server.wait_for_termination()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file", type=Path, default=None)
    args = p.parse_args(argv)
    asyncio.run(serve(args.host, args.port, args.port_file))


if __name__ == "__main__":
    main()
