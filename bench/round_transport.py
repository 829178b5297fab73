"""Which transport a round's Propose and Verify travel over, for the benchmarks' round client.

* ``unary``: one unary call per Propose / Verify (the stubs as generated);
* ``stream``: every call a message on one long-lived gRPC bidirectional stream per
  replica (``specserve.serving.replica_stream.ReplicaStream`` over
  ``ProposeStream`` / ``VerifyStream``);
* ``socket``: every call a frame on one connection to the replica's data-plane
  socket (``ReplicaStream`` with a ``SocketDial``, the orchestrator's default).

:func:`stream_unavailable` / :func:`socket_unavailable` say, in a sentence, why
that transport cannot be measured on this code (``None`` when it can);
:func:`orchestrator_transport` is the transport the orchestrator would use here,
read from its own flags' default.
:func:`round_stubs` gives :class:`bench.round_client.RoundClient` its draft and
target stubs for either.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

import grpc.aio

from specserve.orchestrator import flags as orchestrator_flags
from specserve.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

TRANSPORTS = ("unary", "stream", "socket")
STREAM_MODULE = "specserve.serving.replica_stream"
SOCKET_MODULE = "specserve.serving.socket_call"


def stream_unavailable() -> str | None:
    """Why the stream transport cannot be measured on this code, or ``None``."""
    methods = (
        (draft_pb2, "DraftService", "ProposeStream"),
        (target_pb2, "TargetService", "VerifyStream"),
    )
    for module, service, method in methods:
        if method not in module.DESCRIPTOR.services_by_name[service].methods_by_name:
            return f"{service} has no {method} RPC here (the data-plane stream has not landed)"
    try:
        stream_module = importlib.import_module(STREAM_MODULE)
    except ImportError:
        return f"{STREAM_MODULE} is missing on this code (the data-plane stream has not landed)"
    cls = getattr(stream_module, "ReplicaStream", None)
    needed = ("propose", "verify", "call", "close")
    if cls is None or not all(hasattr(cls, name) for name in needed):
        return f"{STREAM_MODULE}.ReplicaStream lacks propose / verify / call / close"
    return None


def socket_unavailable() -> str | None:
    """Why the socket transport cannot be measured on this code, or ``None``."""
    reason = stream_unavailable()
    if reason is not None:
        return reason
    try:
        importlib.import_module(SOCKET_MODULE)
    except ImportError:
        return f"{SOCKET_MODULE} is missing on this code (the data-plane socket has not landed)"
    return None


def unavailable() -> dict[str, str | None]:
    """Per transport, why it cannot be measured here (None: it can)."""
    return {"unary": None, "stream": stream_unavailable(), "socket": socket_unavailable()}


def orchestrator_transport() -> str:
    """The transport the orchestrator uses by default here: its ``--round-transport``
    default (which ``SPECSERVE_ROUND_TRANSPORT`` sets); ``unary`` where it has no such
    flag (before the data-plane stream, every round call was unary)."""
    parser = argparse.ArgumentParser()
    orchestrator_flags.add_arguments(parser)
    chosen = parser.get_default("round_transport")
    if chosen is None:
        return "unary"
    if chosen not in TRANSPORTS:
        raise ValueError(f"the orchestrator's round transport {chosen!r} is not in {TRANSPORTS}")
    return str(chosen)


class _StreamedStub:
    """A service stub whose one data-plane method goes over a stream; the rest stay unary."""

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
    replica_stream = importlib.import_module(STREAM_MODULE).ReplicaStream
    dials: tuple[Any, Any] = (None, None)
    if transport == "socket":
        dial = importlib.import_module(SOCKET_MODULE).SocketDial
        dials = (dial.of(addresses[0]), dial.of(addresses[1]))
    return (
        _StreamedStub(target_stub, "Verify", replica_stream.verify(target, dials[0])),
        _StreamedStub(draft_stub, "Propose", replica_stream.propose(draft, dials[1])),
    )


async def close_stubs(*stubs: Any) -> None:
    """Close the streams of stubs :func:`round_stubs` made (unary stubs need nothing)."""
    for stub in stubs:
        if isinstance(stub, _StreamedStub):
            await stub.close()
