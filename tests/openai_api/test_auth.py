"""Bearer keys through the HTTP API, checked by the orchestrator's ``--api-keys-file``.

A second orchestrator with a keys file runs over the shared tiny replicas, with its
own HTTP server in front; the ``openai`` client's ``api_key`` goes out as
``Authorization: Bearer <key>`` and the orchestrator decides: an unknown key is 401,
a key without the ``generate`` scope 403, streamed or not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from specserve.openai_api.launch import HttpServerProcess
from specserve.orchestrator.launch import OrchestratorProcess
from tests.openai_api.conftest import MODEL, HttpStack
from tests.orchestrator.stack import ENV

pytestmark = pytest.mark.redis

GOOD = "sk-good-0123456789abcdef"
SESSIONS_ONLY = "sk-sessions-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed(
    http_stack: HttpStack, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"{GOOD}\n{SESSIONS_ONLY} sessions\n")
    stack = http_stack.stack
    assert stack.draft is not None
    orchestrator = OrchestratorProcess(
        [
            *("--target", stack.target_procs[0].address, "--draft", stack.draft.address),
            *("--redis-url", stack.redis_url, "--tokenizer", str(tokenizer_dir)),
            *("--served-model-name", MODEL, "--api-keys-file", str(keys)),
        ],
        env=ENV,
    )
    http = None
    try:
        orchestrator.start().wait_serving()
        http = HttpServerProcess(orchestrator.address, ["--served-model-name", MODEL], env=ENV)
        http.start().wait_serving()
        yield f"{http.base_url}/v1"
    finally:
        if http is not None:
            http.stop()
        orchestrator.stop()


def client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)


def test_a_listed_key_generates(keyed: str) -> None:
    got = client(keyed, GOOD).completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert got.usage is not None and got.usage.completion_tokens >= 1
    stream = client(keyed, GOOD).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    assert any(ch.choices[0].finish_reason for ch in stream)


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_key_is_401_and_a_key_without_the_scope_403(keyed: str, stream: bool) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(keyed, "sk-not-a-listed-key-000").completions.create(
            model=MODEL, prompt="hi", max_tokens=4, stream=stream
        )
    assert info.value.status_code == 401
    assert info.value.body["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(openai.PermissionDeniedError) as denied:
        client(keyed, SESSIONS_ONLY).completions.create(
            model=MODEL, prompt="hi", max_tokens=4, stream=stream
        )
    assert denied.value.status_code == 403
