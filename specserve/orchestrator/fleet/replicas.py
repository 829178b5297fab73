"""The draft and target replicas the orchestrator talks to: endpoints, channels, health.

Endpoints are a comma-separated list of ``host:port`` entries and/or
``dns:///name:port`` entries. A DNS entry (a Kubernetes headless service) is
resolved at start and every ``refresh_s`` seconds; each address it returns is
one replica, so a scaled pool is picked up without a restart.

Health is passive: a replica whose call fails with a transport error (or
times out) is *down* for a backoff that doubles with consecutive failures
(``backoff_s`` up to ``max_backoff_s``); after it, the next call tries it again,
and a success clears the count. The scheduler places sessions only on replicas
that are up.

Channels are TLS when the pool has a :class:`~specserve.serving.tls.ClientTls`: the
replica's certificate must chain to its CA, and the orchestrator presents its own
certificate (mutual TLS). A replica found by DNS is dialled by IP address, so its
certificate is checked against the DNS name (or ``ClientTls.server_name``). With an
internal token (:mod:`specserve.serving.internal_token`) every call on the channels
carries it, and so does the data-plane socket's hello.

Round calls (Propose, Verify) go over one long-lived connection per replica to its
data-plane socket (:class:`~specserve.serving.replica_connection.ReplicaConnection`, made by
the pool's ``connection_factory``: found at the replica's IP through ``GetLoad``'s
``data_port``, checked against the same TLS as the channel, opened on the first call,
shared by every session's calls, reopened after a break). A replica that reports no
data port, or whose socket cannot be reached, fails its round calls ``UNAVAILABLE``
with a sentence naming the port, so it is taken out of the pool as a lost replica is.
A pool without a ``connection_factory`` (tests, tools) sends them as unary calls; the
orchestrator always has one. Control calls (Release, GetLoad, ExportKv, ImportKv)
are unary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.engine.errors import InvalidArgument
from specserve.serving.internal_token import client_interceptors
from specserve.serving.replica_connection import ReplicaConnection
from specserve.serving.server import MAX_MESSAGE_BYTES
from specserve.serving.socket_call import SocketDial
from specserve.serving.tls import ClientTls, aio_channel
from specserve.v1 import common_pb2

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"


@dataclass(frozen=True)
class EndpointSpec:
    """Static ``host:port`` endpoints and DNS names (``(name, port)``) to resolve."""

    static: tuple[str, ...] = ()
    dns: tuple[tuple[str, int], ...] = ()

    @classmethod
    def parse(cls, text: str, role: str) -> EndpointSpec:
        static: list[str] = []
        dns: list[tuple[str, int]] = []
        for raw in (p.strip() for p in text.split(",")):
            if not raw:
                continue
            is_dns = raw.startswith(DNS_SCHEME)
            hostport = raw.removeprefix(DNS_SCHEME)
            host, sep, port = hostport.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise InvalidArgument(
                    f"{role} endpoint {raw!r} is not host:port or {DNS_SCHEME}name:port"
                )
            if is_dns:
                dns.append((host, int(port)))
            else:
                static.append(hostport)
        return cls(tuple(dict.fromkeys(static)), tuple(dict.fromkeys(dns)))

    def __bool__(self) -> bool:
        return bool(self.static or self.dns)


# Opens the data plane of one replica (ReplicaConnection.propose / .verify): its channel, and
# how to reach its data-plane socket.
ConnectionFactory = Callable[[grpc.aio.Channel, SocketDial], ReplicaConnection[Any, Any]]


class Replica:
    """One replica: its channel and stub, its data-plane connection, and whether it is
    up."""

    def __init__(
        self,
        endpoint: str,
        channel: grpc.aio.Channel,
        stub: Any,
        connection: ReplicaConnection[Any, Any] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.channel = channel
        self.stub = stub
        self.connection = connection  # None: round calls go unary
        self.replica_id = ""  # learnt from its responses
        self.failures = 0
        self.down_until = 0.0

    def up(self, now: float) -> bool:
        return now >= self.down_until


class ReplicaPool:
    """The replicas of one role (draft or target)."""

    def __init__(
        self,
        role: str,
        spec: EndpointSpec,
        stub_factory: Callable[[grpc.aio.Channel], Any],
        *,
        refresh_s: float = 10.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        interceptors: Sequence[Any] = (),
        tls: ClientTls | None = None,
        connection_factory: ConnectionFactory | None = None,
        internal_token: str | None = None,
    ) -> None:
        self.role = role
        self.internal_token = internal_token
        self.connection_factory = connection_factory  # None: round calls go unary
        self.tls = tls
        # tracing's client interceptors, and those that send the internal token
        self.interceptors = [*interceptors, *client_interceptors(internal_token)]
        self.spec = spec
        self.stub_factory = stub_factory
        self.refresh_s = refresh_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self.replicas: dict[str, Replica] = {}
        self._refresher: asyncio.Task[None] | None = None
        self.on_change: Callable[[], None] | None = None

    async def start(self) -> None:
        """Open channels to the static endpoints, resolve DNS names once, keep resolving."""
        await self.refresh()
        if self.spec.dns:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        for r in self.replicas.values():
            if r.connection is not None:
                await r.connection.close()
            await r.channel.close(grace=None)
        self.replicas.clear()

    async def refresh(self) -> None:
        """Resolve the DNS names and open/close channels to match."""
        wanted = list(self.spec.static)
        names: dict[str, str] = {}  # endpoint -> the DNS name it was found under
        for name, port in self.spec.dns:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    name, port, type=socket.SOCK_STREAM
                )
            except OSError as e:
                log.warning("resolving %s replicas at %s failed: %s", self.role, name, e)
                wanted.extend(ep for ep in self.replicas if ep not in wanted)  # keep what we had
                continue
            for family, _, _, _, addr in infos:
                host = f"[{addr[0]}]" if family == socket.AF_INET6 else addr[0]
                wanted.append(f"{host}:{addr[1]}")
                names[f"{host}:{addr[1]}"] = name
        wanted = list(dict.fromkeys(wanted))
        changed = False
        for ep in wanted:
            if ep not in self.replicas:
                channel = aio_channel(
                    ep,
                    self.tls,
                    options=channel_options(),
                    interceptors=self.interceptors or None,
                    server_name=names.get(ep),
                )
                dial = SocketDial.of(ep, self.tls, names.get(ep), self.internal_token)
                factory = self.connection_factory
                connection = factory(channel, dial) if factory is not None else None
                self.replicas[ep] = Replica(ep, channel, self.stub_factory(channel), connection)
                changed = True
        for ep in [ep for ep in self.replicas if ep not in wanted]:
            gone = self.replicas.pop(ep)
            if gone.connection is not None:
                await gone.connection.close()
            await gone.channel.close(grace=5.0)
            changed = True
        if changed and self.on_change is not None:
            self.on_change()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    def endpoints(self) -> list[str]:
        return list(self.replicas)

    def usable(self) -> list[str]:
        now = self.clock()
        return [ep for ep, r in self.replicas.items() if r.up(now)]

    def get(self, endpoint: str) -> Replica | None:
        return self.replicas.get(endpoint)

    def mark_failed(self, endpoint: str, why: str) -> None:
        """A call to ``endpoint`` failed at the transport level: take it out for a while."""
        r = self.replicas.get(endpoint)
        if r is None:
            return
        r.failures += 1
        backoff = min(self.max_backoff_s, self.backoff_s * 2 ** (r.failures - 1))
        r.down_until = self.clock() + backoff
        log.warning("%s replica %s is down for %.1f s: %s", self.role, endpoint, backoff, why)
        if self.on_change is not None:
            self.on_change()

    def mark_ok(self, endpoint: str, replica_id: str = "") -> None:
        r = self.replicas.get(endpoint)
        if r is None:
            return
        if replica_id:
            r.replica_id = replica_id
        if r.failures:
            r.failures = 0
            r.down_until = 0.0
            if self.on_change is not None:
                self.on_change()

    async def release(self, endpoint: str, session_ids: list[str], timeout_s: float) -> None:
        """Best effort: ask a replica to drop sessions' caches (errors are only logged)."""
        r = self.replicas.get(endpoint)
        if r is None or not session_ids:
            return
        try:
            await r.stub.Release(
                common_pb2.ReleaseRequest(session_ids=session_ids), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as e:
            log.info(
                "releasing %d sessions on %s %s failed: %s",
                len(session_ids),
                self.role,
                endpoint,
                e.code().name,
            )


def channel_options() -> list[tuple[str, Any]]:
    """Channel settings for internal calls: the servers' message limit, fast reconnects."""
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.keepalive_time_ms", 30_000),
    ]


# Status codes that mean "this replica is gone or too slow", not "this request is bad".
TRANSPORT_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
# Codes that mean either a device failure (the replica turns NOT_SERVING) or a bug that
# this one request triggers: the replica's health decides (see :func:`replica_lost`).
AMBIGUOUS_CODES = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


async def is_serving(replica: Replica, timeout_s: float = 1.0) -> bool:
    """Whether the replica's health service says SERVING (False if it does not answer)."""
    stub = health_pb2_grpc.HealthStub(replica.channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def replica_lost(replica: Replica, code: grpc.StatusCode) -> bool:
    """Whether a call that failed with ``code`` means the replica is lost for every session."""
    if code in TRANSPORT_CODES:
        return True
    return code in AMBIGUOUS_CODES and not await is_serving(replica)
