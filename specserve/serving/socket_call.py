"""The client end of one connection to a replica's data-plane socket.

:class:`~specserve.serving.replica_connection.ReplicaConnection` multiplexes calls over one
connection and owns every rule about them (request ids, deadlines, breaks, backoff,
tracing). :class:`SocketCall` is that connection, with the methods it uses
(``write``, ``read``, ``done``, ``cancel``, ``code``), over the replica's
data-plane socket (:mod:`specserve.serving.data_socket`, which documents the
protocol; :mod:`specserve.serving.data_frames` the bytes):

* On creation it asks the replica, over the gRPC channel, where its socket is
  (``GetLoad``'s ``data_port``), connects to the channel's host at that port (TLS
  with the channel's CA, client certificate and server name when the pool has TLS),
  and says hello (with the internal token when the pool has one).
* A replica that reports no data port (``--data-port off``), or whose socket cannot
  be reached (refused, or no answer within ``DIAL_TIMEOUT_S``: a firewall or network
  policy that admits only the gRPC port), fails the connection ``UNAVAILABLE`` with
  a sentence that names the data port (and a WARNING a minute at most): the
  orchestrator then takes the replica out of its pool as it does a lost one, and
  its sessions go elsewhere. There is no other transport to fall back to.
* ``write`` never waits for the connection: calls written before it is up are sent
  once it is, so a call's deadline runs from when it was written, as on gRPC.
* A connection that cannot be made (within ``CONNECT_TIMEOUT_S``), a replica that
  refuses the hello, a frame that ends the connection (request id 0 with an error)
  or a connection that drops, make ``read`` raise :class:`grpc.aio.AioRpcError`
  with the code and a sentence: the connection broke, and its calls in flight fail.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from specserve.serving.data_frames import Answer, frame, parse_answer, read_frame
from specserve.serving.data_socket import tune
from specserve.serving.malformed import Oversized, RateLimitedWarning
from specserve.serving.tls import ClientTls
from specserve.v1 import common_pb2

CONNECT_TIMEOUT_S = 10.0  # GetLoad, the connection and the hello, together
DIAL_TIMEOUT_S = 3.0  # the connection alone; past it the socket counts as unreachable
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}  # number -> code
log = logging.getLogger(__name__)
_unreachable = RateLimitedWarning(log, interval_s=60.0)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a unary call that ended with ``code`` and ``details`` raises."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@dataclass(frozen=True)
class SocketDial:
    """Where and how to reach a replica's data-plane socket: the host its gRPC channel
    dials, and the pool's TLS (with the name its certificate is checked against)."""

    host: str
    tls: ClientTls | None = None
    server_name: str | None = None
    max_bytes: int = 64 << 20  # the largest answer accepted
    token: str | None = field(default=None, repr=False)  # the internal token, for the hello

    @classmethod
    def of(
        cls,
        endpoint: str,
        tls: ClientTls | None = None,
        server_name: str | None = None,
        token: str | None = None,
    ) -> SocketDial:
        """From a ``host:port`` / ``[v6]:port`` endpoint."""
        host = endpoint.rpartition(":")[0].removeprefix("[").removesuffix("]")
        return cls(host, tls, server_name, token=token)

    def hello(self, unary_method: str) -> bytes:
        """The first frame's payload: the method, and the internal token if there is one."""
        method = unary_method.encode()
        return method if self.token is None else method + b"\n" + self.token.encode()

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        context = ssl.create_default_context(cafile=self.tls.ca_file)
        if self.tls.cert_file and self.tls.key_file:
            context.load_cert_chain(self.tls.cert_file, self.tls.key_file)
        return context


class SocketCall:
    """One connection to a replica's data-plane socket (see the module docstring)."""

    def __init__(
        self, channel: grpc.aio.Channel, dial: SocketDial, unary_method: str, response_type: Any
    ) -> None:
        self.dial = dial
        self.unary_method = unary_method
        self.response_type = response_type
        self._get_load = channel.unary_unary(
            "/" + unary_method.lstrip("/").rpartition("/")[0] + "/GetLoad",
            request_serializer=common_pb2.GetLoadRequest.SerializeToString,
            response_deserializer=common_pb2.LoadReport.FromString,
        )
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._queued: list[bytes] = []  # written before the connection was up
        self._done = False
        self._code: grpc.StatusCode | None = None
        self._ready = asyncio.get_running_loop().create_task(self._connect())

    @property
    def connected(self) -> bool:
        """The connection is up (False while connecting, and once it failed)."""
        return self._writer is not None

    async def _connect(self) -> None:
        try:
            await asyncio.wait_for(self._open(), CONNECT_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise self._broken(e.code(), e.details() or "") from None
        except TimeoutError:
            raise self._broken(
                grpc.StatusCode.UNAVAILABLE,
                f"no data-plane connection within {CONNECT_TIMEOUT_S:g} s",
            ) from None
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError) as e:
            raise self._broken(
                grpc.StatusCode.UNAVAILABLE, f"the data-plane connection failed: {e}"
            ) from None

    async def _open(self) -> None:
        report = await self._get_load(common_pb2.GetLoadRequest(), timeout=CONNECT_TIMEOUT_S)
        if not report.data_port:
            why = (
                f"the replica at {self.dial.host} reports no data port (data_port 0: run with "
                f"--data-port off?); the orchestrator sends {self.unary_method} only over a "
                "replica's data-plane socket: give the replica a --data-port"
            )
            _unreachable.warn(why)
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, why)
        context, tls = self.dial.ssl_context(), self.dial.tls
        name = (tls.server_name or self.dial.server_name or self.dial.host) if tls else None
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    self.dial.host, report.data_port, ssl=context, server_hostname=name
                ),
                DIAL_TIMEOUT_S,
            )
        except ssl.SSLError:
            raise  # reached, and refused: the certificates are wrong, say so
        except (OSError, TimeoutError) as e:  # not reached: a firewall, a network policy
            why = (
                f"the {self.unary_method} data-plane socket at {self.dial.host}:"
                f"{report.data_port} (the replica's data port) cannot be reached "
                f"({e or 'timed out'}): admit the port (the manifests' `data` port)"
            )
            _unreachable.warn(why)
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, why) from None
        tune(writer.get_extra_info("socket"))
        writer.write(frame(self.dial.hello(self.unary_method)))
        reply = await read_frame(reader, 1 << 16)
        if reply is None or isinstance(reply, Oversized):
            writer.close()
            raise ConnectionError("the replica closed the connection after the hello")
        if reply:
            writer.close()
            ending = self._answer(reply)
            error = ending.error
            if error is None:
                raise rpc_error(grpc.StatusCode.INTERNAL, "the replica answered the hello oddly")
            raise rpc_error(STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN), error.message)
        if self._done:  # cancelled while connecting
            writer.close()
            return
        for data in self._queued:
            writer.write(data)
        self._queued.clear()
        self._reader, self._writer = reader, writer

    def _answer(self, payload: bytes) -> Answer:
        try:
            return parse_answer(payload, self.response_type)
        except Exception as e:  # ValueError, DecodeError: not an answer
            raise self._broken(
                grpc.StatusCode.INTERNAL,
                f"the replica sent a frame of {len(payload)} bytes that is not an answer ({e})",
            ) from None

    def _broken(self, code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
        self._done = True
        self._code = code
        if self._writer is not None:
            self._writer.close()
        return rpc_error(code, details)

    async def write(self, data: bytes) -> None:
        """Send one call's frame (queued while connecting); raises ``UsageError`` once
        broken."""
        if self._done:
            raise grpc.aio.UsageError("the data-plane connection is closed")
        if self._writer is None:
            self._queued.append(data)
        else:
            self._writer.write(data)
            if self._writer.transport.get_write_buffer_size() > 1 << 20:
                await self._writer.drain()  # the replica stopped reading

    async def read(self) -> Answer | Any:
        """The next :class:`~specserve.serving.data_frames.Answer`; ``grpc.aio.EOF`` when
        the replica closed cleanly; raises :class:`grpc.aio.AioRpcError` when the
        connection broke or was ended."""
        await self._ready
        assert self._reader is not None
        try:
            data = await read_frame(self._reader, self.dial.max_bytes)
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError) as e:
            raise self._broken(
                grpc.StatusCode.UNAVAILABLE, f"the data-plane connection broke: {e}"
            ) from None
        if data is None:
            self._done = True
            return grpc.aio.EOF
        if isinstance(data, Oversized):
            raise self._broken(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"an answer of {data.size} bytes exceeds the limit of {data.limit}",
            )
        answer = self._answer(data)
        if answer.request_id == 0 and answer.error is not None:
            code = STATUS_CODES.get(answer.error.code, grpc.StatusCode.UNKNOWN)
            raise self._broken(code, answer.error.message)
        return answer

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        """Close the connection; reads then fail CANCELLED."""
        if self._done:
            return False
        self._done = True
        self._code = grpc.StatusCode.CANCELLED
        self._ready.cancel()
        if self._writer is not None:
            self._writer.close()
        return True

    async def code(self) -> grpc.StatusCode:
        """The status the connection ended with (UNAVAILABLE for a clean close)."""
        return self._code or grpc.StatusCode.UNAVAILABLE
