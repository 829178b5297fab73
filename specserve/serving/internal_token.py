"""The internal token: a per-deployment secret the orchestrators show the replicas.

A replica started with ``--internal-token-file FILE`` (or ``SPECSERVE_INTERNAL_TOKEN_FILE``,
or the token itself in ``SPECSERVE_INTERNAL_TOKEN``) answers a gRPC call only when it
carries the metadata ``x-specserve-internal-token: <token>``, and a data-plane socket
only when its hello carries the token (:mod:`specserve.serving.data_socket`). Anything
else is ``UNAUTHENTICATED`` with a sentence saying what was missing; the token is
compared in constant time and never logged or echoed. Health and reflection stay open
(probes carry no token). The orchestrator, given the same file, sends the token on
every call to every replica (:func:`client_interceptors`, and in the socket's hello).

This is how replicas trust only the orchestrators where TLS is off. Under mutual TLS
(``--tls-ca`` on the replicas) a caller without a certificate from the CA cannot even
connect, so the token is optional there; given, both hold. The token also keys the
digest of exported KV chunks (:func:`~specserve.engine.kv_chunks.digest_key_of`), so a
caller without it cannot make K/V that an ``ImportKv`` accepts.

A token is 16 to 512 characters of ``A-Z a-z 0-9 - . _ ~ + / =``; a file holds it on
its first line (a trailing newline is dropped). There is no flag that takes the token
itself: a command line is visible to every user of the machine. ``specserve up`` makes
one (:func:`generate_token`) and hands it to its children as a file of mode 600.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import re
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from specserve.engine.errors import InvalidArgument
from specserve.serving.tls import LOOPBACK_HOSTS

log = logging.getLogger(__name__)

HEADER = "x-specserve-internal-token"
FILE_ENV = "SPECSERVE_INTERNAL_TOKEN_FILE"
VALUE_ENV = "SPECSERVE_INTERNAL_TOKEN"
# Services any caller may use: probes and tools carry no token.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/=]{16,512}")
MISSING = (
    f"this replica takes calls only from its orchestrators: send the deployment's internal "
    f"token as metadata '{HEADER}' (the orchestrator's --internal-token-file)"
)
WRONG = (
    "the internal token of this call is not this replica's: give the orchestrator the "
    "--internal-token-file the replicas have"
)


def check_token(token: str, where: str) -> str:
    """``token`` if well formed; InvalidArgument naming ``where`` (never the token)."""
    if not _TOKEN.fullmatch(token):
        raise InvalidArgument(
            f"{where}: an internal token is 16 to 512 characters of letters, digits and "
            "- . _ ~ + / ="
        )
    return token


def read_token_file(path: str) -> str:
    """The token in ``path`` (its first line, without the newline)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise InvalidArgument(
            f"cannot read --internal-token-file {path!r}: {e.strerror or e}"
        ) from None
    lines = text.splitlines()
    return check_token(lines[0] if lines else "", f"--internal-token-file {path!r}")


def generate_token() -> str:
    """A fresh random token (256 bits)."""
    return secrets.token_urlsafe(32)


def write_token_file(directory: str | Path, token: str | None = None) -> Path:
    """Write ``token`` (a fresh one if None) to ``directory``/internal-token, mode 600."""
    path = Path(directory) / "internal-token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write((token or generate_token()) + "\n")
    return path


def add_internal_token_argument(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """``--internal-token-file`` (``SPECSERVE_INTERNAL_TOKEN_FILE``; the token itself may
    come from ``SPECSERVE_INTERNAL_TOKEN``, which ``--help`` never shows)."""
    parser.add_argument(
        "--internal-token-file",
        default=env.get(FILE_ENV),
        metavar="FILE",
        help="the deployment's internal token: replicas take calls only with it, the "
        f"orchestrator sends it on every call to them (or {VALUE_ENV}; default: none)",
    )
    parser.set_defaults(internal_token_env=env.get(VALUE_ENV))


def internal_token(args: argparse.Namespace) -> str | None:
    """The token from the flags: the file, else the environment; None without either."""
    if getattr(args, "internal_token_file", None):
        return read_token_file(args.internal_token_file)
    value = getattr(args, "internal_token_env", None)
    if value:
        return check_token(value.strip(), VALUE_ENV)
    return None


def warn_if_open(host: str, name: str) -> None:
    """A WARNING when a plaintext replica without a token listens beyond loopback."""
    if host not in LOOPBACK_HOSTS:
        log.warning(
            "the %s server listens on %s without TLS and without an internal token: anyone "
            "who reaches the port can call it, read prompts' K/V and overwrite sessions' "
            "caches (give --internal-token-file, or --tls-cert/--tls-key/--tls-ca)",
            name,
            host,
        )


def matches(expected: str, given: str | bytes | None) -> bool:
    """Whether ``given`` is the token, compared in constant time."""
    if given is None:
        return False
    raw = given if isinstance(given, bytes) else given.encode()
    return hmac.compare_digest(expected.encode(), raw)


def refusal(expected: str, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """Why a call with ``metadata`` is refused (None: it carries the token)."""
    given = next((v for k, v in metadata or () if k == HEADER), None)
    if given is None:
        return MISSING
    return None if matches(expected, given) else WRONG


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health and reflection without the internal token."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        why = refusal(self.token, handler_call_details.invocation_metadata)
        return handler if why is None else refusing(handler, grpc.StatusCode.UNAUTHENTICATED, why)


def refusing(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, why: str
) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s shape that answers ``code`` with ``why``, reading
    nothing (the server interceptors' refusal: this token's, the API keys')."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, why)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, why)
        yield  # unreachable: abort raises; makes this an async generator

    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(streaming, **kw)


def _with_token(details: Any, token: str) -> Any:
    """``details`` (a ClientCallDetails) with the token added to its metadata."""
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(HEADER, token)
    return details._replace(metadata=metadata)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.token), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.token), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_token(details, self.token), requests)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_token(details, self.token), requests)


def client_interceptors(token: str | None) -> list[Any]:
    """Channel interceptors that send ``token`` on every call (none without a token)."""
    if token is None:
        return []
    return [_UnaryUnary(token), _UnaryStream(token), _StreamUnary(token), _StreamStream(token)]
