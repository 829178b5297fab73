"""The public ``Generation`` servicer: pb -> domain -> :class:`Orchestrator` -> pb, nothing more.

Errors become status codes in one place (:func:`specserve.orchestrator.errors.status_for`),
for the streaming call as well as the unary ones; the client's deadline travels
into the request so that internal calls never outlive it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from specserve.orchestrator.api.api_keys import KeysFile, owner_of
from specserve.orchestrator.api.generation import Orchestrator
from specserve.orchestrator.errors import status_for
from specserve.orchestrator.types import GenerateParams
from specserve.v1 import generate_pb2, generate_pb2_grpc
from specserve.wire import public_wire

log = logging.getLogger(__name__)


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


async def _abort(context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
    code, message = status_for(error)
    if code == grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=error)
    await context.abort(code, message)


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """Serves the public API from an :class:`Orchestrator`.

    With ``keys`` every call has been authenticated by
    :class:`~specserve.orchestrator.api.api_keys.AuthInterceptor`; the servicer only asks
    whose key it was, and a session of another key is NOT_FOUND (the orchestrator checks).
    """

    def __init__(self, orchestrator: Orchestrator, keys: KeysFile | None = None) -> None:
        self.orchestrator = orchestrator
        self.keys = keys

    def _owner(self, context: grpc.aio.ServicerContext) -> bytes:
        return owner_of(self.keys, context.invocation_metadata())

    def _token_text(self, params: GenerateParams) -> public_wire.TokenText:
        """A logprobs entry's token text, with the request's choice about special tokens."""
        return functools.partial(
            self.orchestrator.token_text, skip_special_tokens=params.skip_special_tokens
        )

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.GenerateResponse:
        try:
            params = public_wire.generate_params(
                request, deadline_of(context), self._owner(context)
            )
            chunks = [c async for c in self.orchestrator.generate(params)]
            return public_wire.generate_response(chunks, self._token_text(params))
        except Exception as e:
            await _abort(context, "Generate", e)
            raise  # unreachable: abort raises

    async def GenerateStream(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateStreamResponse]:
        try:
            params = public_wire.generate_params(
                request, deadline_of(context), self._owner(context)
            )
            token_text = self._token_text(params)
            async for chunk in self.orchestrator.generate(params):
                yield public_wire.stream_response(chunk, token_text)
        except Exception as e:
            await _abort(context, "GenerateStream", e)

    async def CancelSession(
        self, request: generate_pb2.CancelSessionRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.CancelSessionResponse:
        try:
            cancelled = await self.orchestrator.cancel(request.session_id, self._owner(context))
            return generate_pb2.CancelSessionResponse(cancelled=cancelled)
        except Exception as e:
            await _abort(context, "CancelSession", e)
            raise

    async def GetSession(
        self, request: generate_pb2.GetSessionRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.SessionInfo:
        try:
            return public_wire.session_info(
                await self.orchestrator.get(request.session_id, self._owner(context))
            )
        except Exception as e:
            await _abort(context, "GetSession", e)
            raise

    async def CloseSession(
        self, request: generate_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.CloseSessionResponse:
        try:
            closed = await self.orchestrator.close_session(request.session_id, self._owner(context))
            return generate_pb2.CloseSessionResponse(closed=closed)
        except Exception as e:
            await _abort(context, "CloseSession", e)
            raise
