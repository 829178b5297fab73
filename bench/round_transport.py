"""Which transport a round's Propose and Verify travel over, for the benchmarks' round client.

* ``socket``: every call a frame on one connection to the replica's data-plane
  socket (``specserve.serving.replica_connection.ReplicaConnection`` with a ``SocketDial``):
  the orchestrator's one transport for its rounds;
* ``unary``: one unary call per Propose / Verify (the stubs as generated): what
  clients other than the orchestrator use, measured as the reference.

The gRPC bidirectional stream that once carried the rounds too is gone from the
product: ``bench.rpc_overhead`` measured it slower than the socket in the same run
(docs/benchmarks.md); its bare floor stays in :mod:`bench.bare_grpc`.

:func:`socket_unavailable` says, in a sentence, why the socket cannot be measured on
this code (``None`` when it can); :func:`orchestrator_transport` is the transport the
orchestrator uses. :func:`round_stubs` gives :class:`bench.round_client.RoundClient`
its draft and target stubs for either.
"""

from __future__ import annotations

import importlib
from typing import Any

import grpc.aio

from specserve.v1 import draft_pb2_grpc, target_pb2_grpc

TRANSPORTS = ("unary", "socket")
CLIENT_MODULE = "specserve.serving.replica_connection"
SOCKET_MODULE = "specserve.serving.socket_call"


def socket_unavailable() -> str | None:
    """Why the socket transport cannot be measured on this code, or ``None``."""
    for module in (CLIENT_MODULE, SOCKET_MODULE):
        try:
            importlib.import_module(module)
        except ImportError:
            return f"{module} is missing on this code (the data-plane socket has not landed)"
    cls = getattr(importlib.import_module(CLIENT_MODULE), "ReplicaConnection", None)
    needed = ("propose", "verify", "call", "close")
    if cls is None or not all(hasattr(cls, name) for name in needed):
        return f"{CLIENT_MODULE}.ReplicaConnection lacks propose / verify / call / close"
    return None


def unavailable() -> dict[str, str | None]:
    """Per transport, why it cannot be measured here (None: it can)."""
    return {"unary": None, "socket": socket_unavailable()}


def orchestrator_transport() -> str:
    """The transport the orchestrator sends its rounds over: always its replicas'
    data-plane sockets (it has no other)."""
    return "socket"


class _SocketStub:
    """A service stub whose one data-plane method goes over the socket; the rest stay
    unary."""

    def __init__(self, unary: Any, method: str, stream: Any) -> None:
        self._unary = unary
        self._method = method
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        if name == self._method:
            return self._stream.call
        return getattr(self._unary, name)

    async def close(self) -> None:
        await self._stream.close()


def round_stubs(
    transport: str,
    target: grpc.aio.Channel,
    draft: grpc.aio.Channel,
    addresses: tuple[str, str] = ("", ""),
) -> tuple[Any, Any]:
    """(target stub, draft stub) whose Verify and Propose use ``transport``;
    ``addresses`` (target, draft ``host:port``) locate the data-plane sockets."""
    target_stub = target_pb2_grpc.TargetServiceStub(target)
    draft_stub = draft_pb2_grpc.DraftServiceStub(draft)
    if transport == "unary":
        return target_stub, draft_stub
    reason = unavailable().get(transport, "no such transport")
    if reason is not None:
        raise ValueError(f"transport {transport!r} cannot be measured: {reason}")
    client = importlib.import_module(CLIENT_MODULE).ReplicaConnection
    dial = importlib.import_module(SOCKET_MODULE).SocketDial
    return (
        _SocketStub(target_stub, "Verify", client.verify(target, dial.of(addresses[0]))),
        _SocketStub(draft_stub, "Propose", client.propose(draft, dial.of(addresses[1]))),
    )


async def close_stubs(*stubs: Any) -> None:
    """Close the connections of stubs :func:`round_stubs` made (unary stubs need nothing)."""
    for stub in stubs:
        if isinstance(stub, _SocketStub):
            await stub.close()
