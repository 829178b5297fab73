"""Typed errors of the serving layer and the one interceptor that maps errors to gRPC codes.

Servicers never pick a status code themselves: they (or the engine below them)
raise a typed error and :class:`ErrorInterceptor` answers the call with

========================  =======================  ==============================================
error                     code                     when
========================  =======================  ==============================================
``InvalidArgument``       ``INVALID_ARGUMENT``     the request itself is wrong
``NotFound``              ``NOT_FOUND``            a strict call names a session not held here
``KVBudgetExceeded``      ``RESOURCE_EXHAUSTED``   the KV pool cannot hold the tokens
``Overloaded``            ``RESOURCE_EXHAUSTED``   the replica holds its budget of request bytes
``StaleCache``            ``FAILED_PRECONDITION``  a strict call finds a cache behind ``start``
``FailedPrecondition``    ``FAILED_PRECONDITION``  e.g. KV chunks of another model (ImportKv)
``Unavailable``           ``UNAVAILABLE``          loading, shutting down, or after device failure
anything else             ``INTERNAL``             a bug or a device failure
========================  =======================  ==============================================

The message is the error's own sentence, so a caller reads what is wrong. Errors
are mapped for unary-unary handlers; the health ``Watch`` stream and reflection
pass through untouched. Every unary-request handler (unary-unary and
unary-stream, such as ``GenerateStream``) gets a tolerant deserializer: bytes
that do not parse as its request message are answered ``INVALID_ARGUMENT`` with
one rate-limited WARNING line (:mod:`specserve.serving.malformed`). The
data-plane socket is not a gRPC method: its calls' errors are mapped with
:func:`status_for` by :mod:`specserve.serving.call_stream`.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
import grpc.aio

from specserve.engine.errors import (
    EngineError,
    FailedPrecondition,
    InvalidArgument,
    KVBudgetExceeded,
    ModelLoadError,
    NotFound,
)
from specserve.serving.malformed import Malformed, Oversized, refuse, tolerant

log = logging.getLogger(__name__)


class StaleCache(EngineError):
    """A strict call named a session whose cache holds fewer tokens than ``start``."""


class Unavailable(EngineError):
    """The replica cannot serve now: still loading, shutting down, or its device failed."""


class Overloaded(EngineError):
    """The replica's calls in flight hold its whole budget of request bytes
    (``--max-in-flight-bytes``): a unary call is refused rather than held."""


# Checked in order: the first matching class decides (subclasses before bases).
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (KVBudgetExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StaleCache, grpc.StatusCode.FAILED_PRECONDITION),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (ModelLoadError, grpc.StatusCode.INTERNAL),
)


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a call that raised ``error`` is answered with."""
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code, str(error)
    if isinstance(error, EngineError):
        return grpc.StatusCode.INTERNAL, str(error)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(error).__name__}: {error})"


Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _wrap(method: str, inner: Handler) -> Handler:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed | Oversized):
            await refuse(method, request, context)
        try:
            return await inner(request, context)
        except grpc.aio.AbortError:
            raise  # the handler already chose a status
        except Exception as error:
            code, message = status_for(error)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method)
            await context.abort(code, message)

    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Answers every unary-unary call that raises with the status :func:`status_for` picks.

    ``request_bytes`` caps the request size of some methods (full method name ->
    bytes): a larger request is refused before it is parsed.
    """

    def __init__(self, request_bytes: Mapping[str, int] | None = None) -> None:
        self.request_bytes = dict(request_bytes or {})

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None:
            return handler
        limit = self.request_bytes.get(method)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap(method, handler.unary_unary),
                request_deserializer=tolerant(handler.request_deserializer, limit),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(method, handler.unary_stream),
                request_deserializer=tolerant(handler.request_deserializer, limit),
                response_serializer=handler.response_serializer,
            )
        return handler


def _wrap_stream(method: str, inner: Callable[..., Any]) -> Callable[..., Any]:
    """A unary-stream handler that refuses a malformed request (its own errors are its
    own): an async generator for an async generator (``GenerateStream``), a coroutine
    for a coroutine that writes with ``context.write`` (health ``Watch``)."""
    if not inspect.isasyncgenfunction(inner):

        async def writer(request: Any, context: grpc.aio.ServicerContext) -> None:
            if isinstance(request, Malformed | Oversized):
                await refuse(method, request, context)
            await inner(request, context)

        return writer

    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Malformed | Oversized):
            await refuse(method, request, context)
        async for item in inner(request, context):
            yield item

    return handler


def check_strict(stale: list[str], unknown: frozenset[str], role: str) -> None:
    """For a strict call: NotFound if a stale session is unknown here, else StaleCache."""
    if not stale:
        return
    missing = [sid for sid in stale if sid in unknown]
    if missing:
        raise NotFound(
            f"this {role} replica holds no cache for session {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + "; resend it with start = 0 and the whole committed history"
        )
    raise StaleCache(
        f"this {role} replica holds fewer committed tokens of session {stale[0]!r} than "
        "`start`"
        + (f" (and of {len(stale) - 1} more)" if len(stale) > 1 else "")
        + "; resend it with start = 0 and the whole committed history"
    )
