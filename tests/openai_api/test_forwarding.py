"""What the HTTP layer forwards to the gRPC API, and how gRPC refusals come back.

The orchestrator here is a fake Generation server that records each call's metadata
and answers by API key, so the test sees exactly what the HTTP server sent: the
caller's ``Authorization`` header as the ``authorization`` metadata (``Bearer <key>``),
and the W3C trace context (passed through with tracing off, a child span of the
caller's with tracing on: one trace). The bearer-key check itself is the gRPC
server's; each of its status codes must reach the ``openai`` client as the matching
HTTP status and error type.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import openai
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specserve.openai_api.launch import HttpServerProcess
from specserve.v1 import generate_pb2, generate_pb2_grpc

MODEL = "fake"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
REFUSALS = {
    "Bearer sk-forbidden": (grpc.StatusCode.PERMISSION_DENIED, "session owned by another key"),
    "Bearer sk-busy": (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests for this key"),
    "Bearer sk-down": (grpc.StatusCode.UNAVAILABLE, "no target replica"),
}


class RecordingGeneration(generate_pb2_grpc.GenerationServicer):
    """Answers ``Bearer sk-good``; refuses other keys as an authenticating server would."""

    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []
        self.lock = threading.Lock()

    def _check(self, context: grpc.ServicerContext) -> None:
        metadata = {k: v for k, v in context.invocation_metadata()}
        with self.lock:
            self.calls.append(metadata)
        auth = metadata.get("authorization", "")
        if auth == "Bearer sk-good":
            return
        code, message = REFUSALS.get(auth, (grpc.StatusCode.UNAUTHENTICATED, "unknown API key"))
        context.abort(code, message)

    def Generate(self, request, context):  # type: ignore[no-untyped-def]
        self._check(context)
        return generate_pb2.GenerateResponse(
            session_id="s",
            text="ok",
            token_ids=[7],
            finish_reason=generate_pb2.FINISH_REASON_LENGTH,
            usage=generate_pb2.Usage(prompt_tokens=2, completion_tokens=1, rounds=1),
        )

    def GenerateStream(self, request, context):  # type: ignore[no-untyped-def]
        self._check(context)
        yield generate_pb2.GenerateStreamResponse(session_id="s", text="o", token_ids=[7])
        if request.sampling.max_new_tokens == 99:  # fails half-way
            context.abort(grpc.StatusCode.UNAVAILABLE, "the target replica went away")
        yield generate_pb2.GenerateStreamResponse(
            session_id="s",
            text="k",
            token_ids=[8],
            finish_reason=generate_pb2.FINISH_REASON_LENGTH,
            usage=generate_pb2.Usage(prompt_tokens=2, completion_tokens=2, rounds=2),
        )


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[RecordingGeneration, str]]:
    servicer = RecordingGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@pytest.fixture(scope="module", params=["none", "console"], ids=["tracing-off", "tracing-on"])
def http(request: pytest.FixtureRequest, fake: tuple[RecordingGeneration, str]) -> Iterator[str]:
    args = ["--served-model-name", MODEL, "--trace-exporter", request.param]
    with HttpServerProcess(fake[1], args) as server:
        server.wait_serving()
        yield f"{server.base_url}/v1"


def post(url: str, body: dict[str, object]) -> tuple[int, dict[str, Any]]:
    """POST JSON without any client library; (status, parsed body)."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)


def test_the_bearer_key_and_the_trace_context_reach_the_grpc_api(
    http: str, fake: tuple[RecordingGeneration, str], request: pytest.FixtureRequest
) -> None:
    servicer, _ = fake
    got = client(http, "sk-good").completions.create(
        model=MODEL, prompt="hi", extra_headers={"traceparent": TRACEPARENT}
    )
    assert got.choices[0].text == "ok"
    sent = servicer.calls[-1]
    assert sent["authorization"] == "Bearer sk-good"
    _, trace_id, span_id, _ = sent["traceparent"].split("-")
    assert trace_id == TRACE_ID  # one trace from the HTTP caller through the orchestrator
    tracing = "tracing-on" in request.node.callspec.id
    assert (span_id != "00f067aa0ba902b7") == tracing  # with tracing, the HTTP span is parent
    stream = client(http, "sk-good").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == "ok"
    assert servicer.calls[-1]["authorization"] == "Bearer sk-good"


@pytest.mark.parametrize(
    ("key", "error", "status"),
    [
        ("sk-wrong", openai.AuthenticationError, 401),
        ("sk-forbidden", openai.PermissionDeniedError, 403),
        ("sk-busy", openai.RateLimitError, 429),
        ("sk-down", openai.InternalServerError, 503),
    ],
)
def test_grpc_refusals_become_openai_errors(
    http: str, key: str, error: type[openai.APIStatusError], status: int
) -> None:
    for stream in (False, True):
        with pytest.raises(error) as info:
            client(http, key).completions.create(model=MODEL, prompt="hi", stream=stream)
        assert info.value.status_code == status
        body = info.value.body
        assert isinstance(body, dict) and body["message"] in {m for _, m in REFUSALS.values()} | {
            "unknown API key"
        }


def test_no_key_sends_no_authorization(http: str, fake: tuple[RecordingGeneration, str]) -> None:
    servicer, _ = fake
    status, body = post(f"{http}/completions", {"model": MODEL, "prompt": "hi"})
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert "authorization" not in servicer.calls[-1]


def test_an_error_mid_stream_is_the_last_event(http: str) -> None:
    stream = client(http, "sk-good").completions.create(
        model=MODEL, prompt="hi", max_tokens=99, stream=True
    )
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            pass
    assert "the target replica went away" in str(info.value)
