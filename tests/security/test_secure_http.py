"""``specserve http-server`` in front of the secure stack: TLS to the orchestrator with the
client TLS flags every other client takes, and the caller's API key passed through.

Shown with the official ``openai`` client: over TLS a completion equals the gRPC
answer for the same request and drafts were accepted; no key or a wrong key is 401;
an HTTP server with no CA (plaintext), with a CA that did not sign the orchestrator's
certificate, or checking another server name, reaches nothing (``/health`` 503, a
completion 503); presenting a client certificate works as well.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import openai
import pytest

from specserve.openai_api.launch import HttpServerProcess
from tests.orchestrator.stack import ENV
from tests.security.conftest import KEY_A, PROMPT, SecureStack

pytestmark = pytest.mark.redis

MODEL = "specserve"  # the orchestrator's and the HTTP server's default served name


def client(base_url: str, api_key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def door(secure: SecureStack) -> Iterator[HttpServerProcess]:
    """The HTTP server over TLS: the CA of the orchestrator's certificate, nothing else."""
    http = HttpServerProcess(secure.address, ["--tls-ca", secure.ca_file], env=ENV)
    with http:
        http.wait_serving()
        yield http


def test_a_completion_over_tls_equals_the_grpc_answer(
    secure: SecureStack, door: HttpServerProcess
) -> None:
    got = client(door.base_url).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        extra_body={"speculation": {"drafter": "model", "k": 4}},
    )
    with secure.client() as g:
        want = g.generate(PROMPT, max_new_tokens=16, drafter="model", k=4)
    assert got.choices[0].text == want.text and want.text
    spec = got.usage.model_extra["speculation"]  # type: ignore[union-attr]
    assert spec["drafted_tokens"] > 0 and spec["accepted_tokens"] > 0
    assert "over TLS" in door.output()


def test_the_orchestrator_decides_on_the_key(door: HttpServerProcess) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(door.base_url, api_key="not-a-key-of-this-server-000").completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2
        )
    wrong = info.value.body
    # No Authorization header at all (the SDK always sends one).
    conn = http.client.HTTPConnection(door.host, door.port, timeout=60)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = conn.getresponse()
    missing = json.loads(reply.read())["error"]
    conn.close()
    assert reply.status == 401
    for error in (wrong, missing):
        assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "authentication_error" and "API key" in error["message"]


def test_a_client_certificate_is_presented_when_given(secure: SecureStack) -> None:
    mine = secure.orchestrator_cert  # issued by the CA, for client authentication too
    flags = ["--tls-ca", secure.ca_file, "--tls-cert", mine.cert, "--tls-key", mine.key]
    with HttpServerProcess(secure.address, flags, env=ENV) as http:
        http.wait_serving()
        reply = client(http.base_url).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0
        )
    assert reply.usage is not None and reply.usage.completion_tokens == 4


@pytest.mark.parametrize(
    "which", ["plaintext", "wrong CA", "wrong server name"], ids=lambda w: w.replace(" ", "-")
)
def test_without_the_orchestrators_ca_nothing_gets_through(secure: SecureStack, which: str) -> None:
    flags = {
        "plaintext": [],
        "wrong CA": ["--tls-ca", secure.rogue_ca_file],
        "wrong server name": ["--tls-ca", secure.ca_file, "--tls-server-name", "elsewhere"],
    }[which]
    with HttpServerProcess(secure.address, flags, env=ENV) as http:
        assert http.health(timeout_s=10) == 503
        with pytest.raises(openai.APIStatusError) as info:
            client(http.base_url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 503
    assert info.value.body["type"] == "service_unavailable"  # type: ignore[index]
