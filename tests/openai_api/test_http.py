"""The HTTP layer without a client library: SSE framing, disconnects, metrics, routing errors."""

from __future__ import annotations

import http.client
import json
import time
from typing import Any

import pytest

from tests.openai_api.conftest import LONG_COMPLETION, MODEL, HttpStack
from tests.orchestrator.stack import kv_used, scrape

pytestmark = pytest.mark.redis


def connect(stack: HttpStack) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(stack.http.host, stack.http.port, timeout=60)


def post(conn: http.client.HTTPConnection, path: str, body: object) -> http.client.HTTPResponse:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    return conn.getresponse()


def cancelled(stack: HttpStack) -> float:
    return stack.stack.metric("specserve_orchestrator_requests").get(
        '{finish_reason="cancelled"}', 0.0
    )


def test_sse_framing(http_stack: HttpStack) -> None:
    body = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = connect(http_stack)
    r = post(conn, "/v1/completions", body)
    assert r.status == 200
    assert r.getheader("Content-Type", "").startswith("text/event-stream")
    assert r.getheader("Cache-Control") == "no-cache"
    raw = r.read().decode()
    conn.close()
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert events[-1] == "data: [DONE]"
    payloads: list[dict[str, Any]] = []
    for e in events[:-1]:
        assert e.startswith("data: ") and "\n" not in e  # one data line per event
        payloads.append(json.loads(e[len("data: ") :]))
    *chunks, usage = payloads
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert all(p["object"] == "text_completion" and p["usage"] is None for p in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(p["choices"][0]["text"] for p in chunks)
    whole = post(
        conn := connect(http_stack),
        "/v1/completions",
        {**body, "stream": False, "stream_options": None},
    )
    assert json.loads(whole.read())["choices"][0]["text"] == text
    conn.close()


def wait_for(check, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_a_client_that_disconnects_cancels_its_session(http_stack: HttpStack, stream: bool) -> None:
    target = http_stack.stack.target_procs[0].address
    sessions_before, _ = kv_used(target, "target")
    before = cancelled(http_stack)
    conn = connect(http_stack)
    if stream:
        r = post(conn, "/v1/completions", {**LONG_COMPLETION, "stream": True})
        assert r.status == 200
        assert r.readline().startswith(b"data: ")  # decoding now
    else:
        data = json.dumps(LONG_COMPLETION).encode()
        conn.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
        wait_for(lambda: kv_used(target, "target")[0] > sessions_before)  # decoding now
    assert conn.sock is not None
    conn.sock.close()  # the client goes away mid-generation
    conn.close()
    wait_for(lambda: cancelled(http_stack) == before + 1)
    wait_for(lambda: kv_used(target, "target")[0] == sessions_before)  # its KV is freed


def test_metrics_per_endpoint(http_stack: HttpStack) -> None:
    conn = connect(http_stack)
    post(conn, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2}).read()
    post(conn, "/v1/completions", {"model": MODEL, "prompt": "a", "temperature": 9}).read()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
    post(conn, "/v1/chat/completions", {**body, "stream": True}).read()
    conn.close()
    requests = scrape(http_stack.http.port, "specserve_http_requests")
    assert requests['{endpoint="/v1/completions",status="200"}'] >= 1
    assert requests['{endpoint="/v1/completions",status="400"}'] >= 1
    assert requests['{endpoint="/v1/chat/completions",status="200"}'] >= 1
    ttft = scrape(http_stack.http.port, "specserve_http_time_to_first_token_seconds_count")
    assert ttft['{endpoint="/v1/chat/completions"}'] >= 1
    tokens = scrape(http_stack.http.port, "specserve_http_completion_tokens")
    assert tokens['{endpoint="/v1/completions"}'] >= 2


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "kind"),
    [
        ("GET", "/v1/nothing", None, 404, "not_found_error"),
        ("GET", "/v1/completions", None, 405, "invalid_request_error"),
        ("POST", "/v1/completions", b"{not json", 400, "invalid_request_error"),
        ("POST", "/v1/completions", b"[1, 2]", 400, "invalid_request_error"),
    ],
)
def test_routing_and_parsing_errors_have_the_openai_shape(
    http_stack: HttpStack, method: str, path: str, body: bytes | None, status: int, kind: str
) -> None:
    conn = connect(http_stack)
    conn.request(method, path, body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    error = json.loads(r.read())["error"]
    conn.close()
    assert r.status == status
    assert error["type"] == kind and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_health(http_stack: HttpStack) -> None:
    conn = connect(http_stack)
    conn.request("GET", "/health")
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    conn.close()
