"""The Starlette application: routes, streaming, disconnects, tracing and metrics.

Each generation request is parsed (:mod:`~specserve.openai_api.requests`), sent as one
gRPC call per choice (:mod:`~specserve.openai_api.upstream`) with the caller's
``Authorization`` header as the ``authorization`` metadata and the trace context
(this server's span when tracing is on, else the caller's ``traceparent`` passed
through), and answered as JSON or as server-sent events
(:mod:`~specserve.openai_api.responses`). A client that disconnects cancels its gRPC
calls, and so its sessions: a stream is cancelled by Starlette when the connection
drops; a non-streamed request watches for the disconnect itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specserve.openai_api import body, responses
from specserve.openai_api.config import HttpServerConfig
from specserve.openai_api.errors import ApiError
from specserve.openai_api.metrics import HttpMetrics
from specserve.openai_api.requests import ParsedRequest, parse_chat, parse_completion
from specserve.openai_api.upstream import Metadata, StreamItem, Upstream

tracer = trace.get_tracer(__name__)
T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
INLINE_BODY_BYTES = 64 << 10  # bodies up to this are decoded on the loop (well under 1 ms)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Api:
    """The endpoints over one :class:`Upstream` (made at startup, in the server's loop)."""

    def __init__(self, config: HttpServerConfig) -> None:
        self.config = config
        self.metrics = HttpMetrics()
        self.created = int(time.time())
        self._upstream: Upstream | None = None

    @property
    def upstream(self) -> Upstream:
        assert self._upstream is not None, "the app's lifespan has not started"
        return self._upstream

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Starlette) -> AsyncIterator[None]:
        self._upstream = Upstream(self.config.orchestrator, self.config.timeout_s, self.config.tls)
        try:
            yield
        finally:
            await self._upstream.close()

    # -- endpoints -------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/completions", parse_completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/chat/completions", parse_chat)

    async def models(self, request: Request) -> Response:
        return self._count("/v1/models", JSONResponse({"object": "list", "data": [self._model()]}))

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.config.served_model_name:
            error = ApiError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )
            return self._count("/v1/models", error_response(error))
        return self._count("/v1/models", JSONResponse(self._model()))

    async def health(self, request: Request) -> Response:
        if await self.upstream.serving():
            return self._count("/health", JSONResponse({"status": "ok"}))
        error = ApiError(
            503,
            f"the orchestrator at {self.config.orchestrator} is not serving",
            "service_unavailable",
        )
        return self._count("/health", error_response(error))

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- generation ------------------------------------------------------------------

    async def _generate(
        self,
        request: Request,
        endpoint: str,
        parse: Callable[[object, str, int], ParsedRequest],
    ) -> Response:
        started = time.perf_counter()
        span = tracer.start_span(
            f"POST {endpoint}",
            context=propagate.extract(request.headers),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": endpoint},
        )
        self.metrics.in_flight.labels(endpoint).inc()
        streaming = False
        status = "500"
        try:
            metadata = _metadata(request, span)
            parsed = await self._parse(request, parse)
            kind = "chatcmpl" if parsed.chat else "cmpl"
            env = responses.Envelope(
                f"{kind}-{uuid.uuid4().hex}", int(time.time()), parsed.model, parsed.chat
            )
            if parsed.stream:
                # The first message before the headers: a refusal (a bad key, a prompt the
                # orchestrator rejects) is then an HTTP status, not an event in a 200 stream.
                upstream = self.upstream.stream(parsed.calls, metadata)
                first = await _unless_disconnected(request, anext(upstream, None))
                events = self._events(parsed, env, first, upstream, endpoint, started, span)
                streaming = True
                status = "200"
                return StreamingResponse(
                    events, media_type="text/event-stream", headers=SSE_HEADERS
                )
            results = await _unless_disconnected(
                request, self.upstream.generate(parsed.calls, metadata)
            )
            choices = [
                responses.Choice(c.index, c.prompt_index, r)
                for c, r in zip(parsed.calls, results, strict=True)
            ]
            self.metrics.tokens.labels(endpoint).inc(sum(len(r.token_ids) for r in results))
            status = "200"
            return JSONResponse(responses.body(env, choices, parsed.logprobs is not None))
        except ApiError as e:
            status = str(e.status)
            span.set_status(Status(StatusCode.ERROR, e.message))
            return error_response(e)
        except ClientGone:
            status = "499"
            return Response(status_code=499)
        finally:
            self.metrics.requests.labels(endpoint, status).inc()
            if not streaming:
                self._finish(endpoint, started, span)

    async def _parse(
        self, request: Request, parse: Callable[[object, str, int], ParsedRequest]
    ) -> ParsedRequest:
        """The body, bounded, decoded and validated (raises ApiError). A large body is
        decoded in a worker thread: a megabyte of token ids takes tens of milliseconds
        of JSON and checks that would otherwise stall every other stream's events."""
        raw = await body.read(request, self.config.max_body_bytes)

        def work() -> ParsedRequest:
            return parse(body.decode(raw), self.config.served_model_name, self.config.max_choices)

        if len(raw) <= INLINE_BODY_BYTES:
            return work()
        return await asyncio.to_thread(work)

    async def _events(
        self,
        parsed: ParsedRequest,
        env: responses.Envelope,
        first_item: StreamItem | None,
        upstream: AsyncIterator[StreamItem],
        endpoint: str,
        started: float,
        span: trace.Span,
    ) -> AsyncIterator[bytes]:
        """The SSE body: text chunks as they commit, each choice's finish, usage, [DONE]."""
        cursors = {c.index: responses.LogprobCursor() for c in parsed.calls}
        prompt_of = {c.index: c.prompt_index for c in parsed.calls}
        usages: dict[int, Any] = {}
        tokens = 0
        first = True
        usage_null = parsed.include_usage
        try:
            if parsed.chat:
                for c in parsed.calls:
                    yield sse(responses.chunk(env, c.index, role=True, include_usage=usage_null))
            async for index, message in _chain(first_item, upstream):
                tokens += len(message.token_ids)
                if message.text or message.logprobs:
                    if first:
                        first = False
                        self.metrics.first_token.labels(endpoint).observe(
                            time.perf_counter() - started
                        )
                    yield sse(
                        responses.chunk(
                            env,
                            index,
                            text=message.text,
                            entries=message.logprobs,
                            cursor=cursors[index] if parsed.logprobs is not None else None,
                            include_usage=usage_null,
                        )
                    )
                if message.finish_reason:
                    usages[index] = message.usage
                    yield sse(
                        responses.chunk(
                            env, index, finish=message.finish_reason, include_usage=usage_null
                        )
                    )
            if parsed.include_usage:
                per_prompt = {prompt_of[i]: u.prompt_tokens for i, u in usages.items()}
                usage = responses.usage(per_prompt, usages.values())
                yield sse(responses.usage_chunk(env, usage))
            yield DONE
        except ApiError as e:  # the headers are out: the error is the stream's last event
            self.metrics.requests.labels(endpoint, "stream_error").inc()
            span.set_status(Status(StatusCode.ERROR, e.message))
            yield sse(e.body())
            yield DONE
        finally:
            await upstream.aclose()  # type: ignore[attr-defined]  # cancels the gRPC calls
            self.metrics.tokens.labels(endpoint).inc(tokens)
            self._finish(endpoint, started, span)

    # -- helpers ---------------------------------------------------------------------

    def _model(self) -> dict[str, Any]:
        return {
            "id": self.config.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "specserve",
        }

    def _count(self, endpoint: str, response: Response) -> Response:
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    def _finish(self, endpoint: str, started: float, span: trace.Span) -> None:
        self.metrics.in_flight.labels(endpoint).dec()
        self.metrics.seconds.labels(endpoint).observe(time.perf_counter() - started)
        span.end()


def _metadata(request: Request, span: trace.Span) -> Metadata:
    """``authorization`` as the caller sent it, and the trace context to continue."""
    carrier: dict[str, str] = {}
    context = trace.set_span_in_context(span)
    if not span.get_span_context().is_valid:  # tracing off here: pass the caller's through
        context = propagate.extract(request.headers)
    propagate.inject(carrier, context=context)
    items = [(k.lower(), v) for k, v in carrier.items()]
    auth = request.headers.get("authorization")
    if auth is not None:
        if not auth.isascii() or not auth.isprintable():
            raise ApiError(
                401,
                "the Authorization header must be printable ASCII: Bearer <key>",
                "authentication_error",
                code="invalid_api_key",
            )
        items.append(("authorization", auth))
    return tuple(items)


async def _chain(
    first: StreamItem | None, rest: AsyncIterator[StreamItem]
) -> AsyncIterator[StreamItem]:
    if first is None:
        return
    yield first
    async for item in rest:
        yield item


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; cancels it and raises ClientGone if the client disconnects first.

    A cancelled task is awaited before ClientGone is raised: its cancellation (which
    cancels the gRPC calls) has then run, and its outcome is taken, so nothing is left
    for asyncio to log."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(ApiError(exc.status_code, message, kind))


async def _internal_error(request: Request, exc: Exception) -> Response:
    return error_response(
        ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
    )


def build_app(config: HttpServerConfig) -> Starlette:
    """The ASGI application of one HTTP server."""
    api = Api(config)
    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.prometheus, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=api.lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.api = api
    return app
