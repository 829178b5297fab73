"""The gRPC server factory shared by the draft and target services.

:func:`start_server` builds a ``grpc.aio`` server with the error interceptor (and,
when tracing is on, the OpenTelemetry server interceptor before it), the
standard health service (``grpc.health.v1``) and reflection, binds ``host:port``
(port 0 = an ephemeral port; TLS when ``ServerOptions.tls`` is set, see
:mod:`specserve.serving.tls`; calls refused without the internal token when
``ServerOptions.internal_token`` is set, see :mod:`specserve.serving.internal_token`)
and returns a :class:`RunningServer` that knows the
bound port. Health follows the model executor: NOT_SERVING while the model loads,
SERVING once it is ready, NOT_SERVING again after a device failure or when a
graceful shutdown begins. A failure the replica cannot recover from (a failed
load, a broken tensor-parallel group) ends the process with exit status 1 via
:meth:`RunningServer.abort`.

Message size limit: 64 MiB each way (``ServerOptions.max_message_bytes``). The
largest routine messages are far smaller — a Verify of 32 sessions with k = 16
and a 64-entry sparse q is about 0.3 MB — but a full-history resend after a
restart carries every committed token of every session in the batch (32
sessions x 128k tokens x up to 5 bytes per varint = 20 MB). 64 MiB admits that
with room to spare while still bounding what one call can make the server buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specserve.serving.call_stream import (
    IN_FLIGHT_FRAMES,
    REPLICA_IN_FLIGHT_FRAMES,
    InFlightBytes,
    StreamMethod,
)
from specserve.serving.data_socket import DataSocketServer
from specserve.serving.errors import ErrorInterceptor, Overloaded
from specserve.serving.executor import ModelExecutor, State
from specserve.serving.internal_token import TokenInterceptor, warn_if_open
from specserve.serving.reflection import enable_reflection
from specserve.serving.tls import ServerTls, warn_if_exposed
from specserve.telemetry.config import TelemetryConfig
from specserve.telemetry.process import ProcessTelemetry, setup_telemetry
from specserve.telemetry.tracing import ServiceIdentity, server_interceptors

log = logging.getLogger(__name__)

B = TypeVar("B")

MAX_MESSAGE_BYTES = 64 << 20
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class ServerOptions:
    """Settings every specserve gRPC server shares."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = an ephemeral port, reported by RunningServer.port
    port_file: str | None = None  # where to write the bound port once listening
    max_message_bytes: int = MAX_MESSAGE_BYTES
    batch_window_ms: float = 2.0  # how long a lone call waits for others to share its forward
    max_batch_sessions: int = 256  # coalescing stops at this many sessions per forward
    grace_s: float = 10.0  # graceful shutdown: time in-flight calls get to finish
    replica_id: str = ""  # empty = host:port
    threads: int | None = None  # torch intra-op threads; None = torch's default
    tls: ServerTls | None = None  # None = plaintext (see specserve.serving.tls)
    health_port: int | None = None  # a plaintext port serving health alone (probes); 0 = any
    data_port: int | None = 0  # the data-plane socket's port; 0 = any free one; None = none
    # request bytes the replica's calls in flight may hold together (data-plane
    # connections and unary Propose / Verify / Prefill / ImportKv); None = REPLICA_IN_FLIGHT_FRAMES
    # maximal messages
    max_in_flight_bytes: int | None = None
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    # the deployment's internal token: set, every call but health and reflection must
    # carry it (specserve.serving.internal_token); never in a repr
    internal_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_message_bytes < 1 << 20:
            raise ValueError(f"max_message_bytes must be >= 1 MiB, got {self.max_message_bytes}")
        if not 0 <= self.batch_window_ms <= 1000:
            raise ValueError(f"batch_window_ms must be in [0, 1000], got {self.batch_window_ms}")
        if self.max_batch_sessions < 1:
            raise ValueError(f"max_batch_sessions must be >= 1, got {self.max_batch_sessions}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            raise ValueError(f"health_port must be in 0..65535, got {self.health_port}")
        if self.data_port is not None and not 0 <= self.data_port <= 65535:
            raise ValueError(f"data_port must be in 0..65535, got {self.data_port}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.max_in_flight_bytes is not None and self.max_in_flight_bytes < 1:
            raise ValueError(f"max_in_flight_bytes must be >= 1, got {self.max_in_flight_bytes}")

    @property
    def replica_in_flight_bytes(self) -> int:
        """Request bytes the replica's calls in flight may hold together."""
        if self.max_in_flight_bytes is not None:
            return self.max_in_flight_bytes
        return REPLICA_IN_FLIGHT_FRAMES * self.max_message_bytes


class RunningServer(Generic[B]):
    """A started server: its bound port, health service and executor."""

    def __init__(
        self,
        server: grpc.aio.Server,
        port: int,
        health_servicer: health.aio.HealthServicer,
        executor: ModelExecutor[B],
        service_names: Sequence[str],
        options: ServerOptions,
    ) -> None:
        self.server = server
        self.port = port
        self.health = health_servicer
        self.executor = executor
        self.service_names = tuple(service_names)
        self.options = options
        self.replica_id = options.replica_id or f"{options.host}:{port}"
        self.metrics_port: int | None = None  # set once a metrics endpoint serves
        self.health_server: grpc.aio.Server | None = None  # --health-port's plaintext server
        self.health_port: int | None = None
        self.data_socket: DataSocketServer | None = None  # the data-plane socket, once serving
        self.data_port = 0  # its bound port (0: none), which GetLoad reports
        # The request bytes the calls in flight hold (every data-plane connection, and
        # unary Propose / Verify / Prefill / ImportKv), against one budget.
        self.in_flight = InFlightBytes(options.replica_in_flight_bytes)
        # Set when a graceful shutdown begins: the data-plane connections answer what
        # they hold and end (specserve.serving.call_stream), so the grace is not waited out.
        self.draining = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._aborted = asyncio.Event()
        self._abort_reason = ""
        self._was_ready = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._watchers: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    @contextlib.contextmanager
    def holding(self, request: Any) -> Iterator[None]:
        """A unary Propose / Verify / Prefill / ImportKv request held against the replica's
        in-flight budget while it runs; refused (:class:`Overloaded`) while the calls in
        flight hold the whole budget (its bytes are read already: holding it waiting
        would let any number of calls pile up)."""
        size = request.ByteSize()
        if not self.in_flight.try_hold(request, size):
            raise Overloaded(
                f"this replica's calls in flight hold {self.in_flight.total} bytes of requests, "
                f"its budget (--max-in-flight-bytes {self.in_flight.budget}); retry shortly "
                "or on another replica"
            )
        try:
            yield
        finally:
            self.in_flight.done(request)

    @property
    def bytes_in_flight(self) -> int:
        """Request bytes the calls in flight on one data-plane connection may hold
        before it is read no further."""
        return IN_FLIGHT_FRAMES * self.options.max_message_bytes

    async def serve_data_plane(self, method: StreamMethod[Any, Any], request_type: Any) -> None:
        """Serve ``method`` on the data-plane socket (:mod:`specserve.serving.data_socket`)
        at ``options.data_port``, with the gRPC port's TLS; nothing when that is None."""
        if self.options.data_port is None:
            return
        socket = DataSocketServer(
            method,
            request_type,
            max_bytes=self.options.max_message_bytes,
            draining=self.draining,
            bytes_in_flight=self.bytes_in_flight,
            replica_budget=self.in_flight,
        )
        self.data_port = await socket.start(
            self.options.host, self.options.data_port, self.options.tls, self.options.internal_token
        )
        self.data_socket = socket

    def watch(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` alongside the server until it stops (e.g. a health watch that may
        :meth:`abort`); it is cancelled when shutdown begins."""
        task = asyncio.get_running_loop().create_task(coro)
        self._watchers.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._watchers.discard)

    def abort(self, reason: str) -> None:
        """End the process with exit 1: this replica failed beyond repair (event loop)."""
        if not self._aborted.is_set():
            self._abort_reason = reason
            self._aborted.set()

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful shutdown: NOT_SERVING, refuse new calls, let in-flight batches finish."""
        grace = self.options.grace_s if grace_s is None else grace_s
        for task in list(self._watchers):
            task.cancel()
        await self.health.enter_graceful_shutdown()
        if self.health_server is not None:
            await self.health_server.stop(0)
        self.draining.set()
        if self.data_socket is not None:
            await self.data_socket.close()
        await self.server.stop(grace)
        await self.executor.close()

    def announce(self) -> None:
        """Tell whoever started this process where it listens (stdout, and the port file)."""
        if self.options.port_file:
            path = Path(self.options.port_file)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(f"{self.port}\n")
            tmp.replace(path)  # atomic: a reader never sees a half-written port
        print(f"{self.executor.name} server listening on {self.address}", flush=True)
        if self.metrics_port is not None:
            print(
                f"{self.executor.name} metrics on http://{self.options.host}:{self.metrics_port}"
                "/metrics",
                flush=True,
            )
        if self.health_port is not None:
            print(
                f"{self.executor.name} health (plaintext) on {self.options.host}:"
                f"{self.health_port}",
                flush=True,
            )
        if self.data_port:
            print(
                f"{self.executor.name} data-plane socket on {self.options.host}:{self.data_port}",
                flush=True,
            )

    async def serve_until_stopped(self) -> int:
        """Serve until SIGTERM/SIGINT (exit 0), or a failed model load or :meth:`abort`
        (exit 1)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop_requested.set)
        stop = asyncio.ensure_future(self._stop_requested.wait())
        failed = asyncio.ensure_future(self._aborted.wait())
        await asyncio.wait([stop, failed], return_when=asyncio.FIRST_COMPLETED)
        for task in (stop, failed):
            task.cancel()
        if self._aborted.is_set():
            log.error("%s; exiting", self._abort_reason)
            await self.stop(0)
            return 1
        log.info("shutting down (grace %.1f s)", self.options.grace_s)
        await self.stop()
        return 0

    def on_executor_state(self, state: State) -> None:
        """Follow the executor: health, and a failed load ends the process (event loop)."""
        if state is State.FAILED and not self._was_ready:
            self.abort(f"the {self.executor.name} model failed to load: {self.executor.error}")
        self._was_ready |= state is State.READY
        task = asyncio.get_running_loop().create_task(self.set_serving(state is State.READY))
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)


async def start_server(
    options: ServerOptions,
    name: str,
    load: Callable[[], B],
    register: Callable[[grpc.aio.Server, RunningServer[B]], None],
    service_names: Sequence[str],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    request_bytes: Mapping[str, int] | None = None,
) -> RunningServer[B]:
    """Bind, serve health (NOT_SERVING) at once, and load the model on the executor thread.

    ``request_bytes``: methods (full names) whose requests are refused past a size,
    before they are parsed (see :class:`~specserve.serving.errors.ErrorInterceptor`).

    ``register`` adds the servicers; it receives the running server, whose
    ``executor`` and ``replica_id`` the servicers use. ``service_names`` are the
    full names that health and reflection report. ``interceptors`` run after tracing's
    and before the error mapping (the orchestrator's API-key check).
    """
    limits = [
        ("grpc.max_receive_message_length", options.max_message_bytes),
        ("grpc.max_send_message_length", options.max_message_bytes),
        ("grpc.so_reuseport", 0),  # two servers must never share a port by accident
    ]
    # Tracing first: its server span then covers the error mapping and sees the status.
    token = [TokenInterceptor(options.internal_token)] if options.internal_token else []
    chain = [
        *server_interceptors(options.telemetry.tracing),
        *token,  # before anything reads the request
        *interceptors,
        ErrorInterceptor(request_bytes),
    ]
    server = grpc.aio.server(interceptors=chain, options=limits)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{options.host}:{options.port}"
    if options.tls is None:
        warn_if_exposed(options.host, None, f"the {name} server")
        if name != "orchestrator" and options.internal_token is None:
            warn_if_open(options.host, name)
        port = server.add_insecure_port(address)
    else:
        if options.tls.client_ca_file is None and name != "orchestrator":
            log.warning(
                "the %s server serves TLS without --tls-ca: any client can call it; give "
                "--tls-ca so that only clients with a certificate from that CA can",
                name,
            )
        port = server.add_secure_port(address, options.tls.credentials())
    if port == 0:
        raise OSError(f"could not bind {options.host}:{options.port}")
    executor: ModelExecutor[B] = ModelExecutor(
        name,
        window_s=options.batch_window_ms / 1000,
        max_batch_sessions=options.max_batch_sessions,
    )
    running = RunningServer(server, port, health_servicer, executor, service_names, options)
    register(server, running)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    enable_reflection((*service_names, health_name), server)
    if options.health_port is not None:
        await _serve_health_alone(running, options.health_port)
    await running.set_serving(False)
    await server.start()
    executor.start(load, running.on_executor_state)
    return running


async def _serve_health_alone(running: RunningServer[B], port: int) -> None:
    """A second, plaintext server with only the health service, for probes that cannot
    speak TLS (Kubernetes' gRPC probes): it tells whether the replica serves, nothing more."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(running.health, server)
    bound = server.add_insecure_port(f"{running.options.host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the health port {running.options.host}:{port}")
    await server.start()
    running.health_server, running.health_port = server, bound


def setup_process(options: ServerOptions, identity: ServiceIdentity) -> ProcessTelemetry:
    """Once per server process: logging and tracing, and torch's intra-op threads."""
    import torch

    telemetry = setup_telemetry(options.telemetry, identity)
    if options.threads:
        torch.set_num_threads(options.threads)
    return telemetry


def run_process(
    start: Callable[[], Awaitable[RunningServer[B]]],
    options: ServerOptions,
    identity: ServiceIdentity,
) -> int:
    """A server process's main: set up, start, serve until stopped, flush the spans."""
    telemetry = setup_process(options, identity)

    async def main() -> int:
        running = await start()
        running.announce()
        return await running.serve_until_stopped()

    try:
        return asyncio.run(main())
    finally:
        telemetry.shutdown()


def identity_of(options: ServerOptions, pool: str, model: str) -> ServiceIdentity:
    """The trace resource of a server: its pool, model and replica id (if fixed before bind)."""
    replica = options.replica_id or (f"{options.host}:{options.port}" if options.port else "")
    return ServiceIdentity(pool, model, replica)
