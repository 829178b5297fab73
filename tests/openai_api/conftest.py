"""A tiny stack with a tokenizer (so text and chat work) and the HTTP server in front of it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from specserve.engine.tiny_tokenizer import write_tiny_tokenizer
from specserve.openai_api.launch import HttpServerProcess
from tests.orchestrator.conftest import redis_url  # noqa: F401  (the session's Redis)
from tests.orchestrator.stack import ENV, Reference, Stack

MODEL = "tiny-pair"
# A plain completion that decodes for seconds (4000 tokens past any end): a request still
# running while a test does something else.
LONG_COMPLETION = {
    "model": MODEL,
    "prompt": "Hello",
    "max_tokens": 4000,
    "temperature": 0,
    "ignore_eos": True,
    "speculation": {"drafter": "none"},
}


@dataclass
class HttpStack:
    stack: Stack
    http: HttpServerProcess

    @property
    def base_url(self) -> str:
        return self.http.base_url

    def client(self, **kw: object) -> openai.OpenAI:
        """The official client on this server (no retries: a test sees the first answer)."""
        options: dict[str, object] = {"api_key": "sk-test", "max_retries": 0, "timeout": 60}
        options.update(kw)
        return openai.OpenAI(base_url=f"{self.base_url}/v1", **options)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def http_stack(redis_url: str, tokenizer_dir: Path) -> Iterator[HttpStack]:  # noqa: F811
    args = ["--tokenizer", str(tokenizer_dir), "--served-model-name", MODEL]
    stack = Stack(redis_url, orchestrator_args=args)
    http = None
    try:
        stack.start()
        http = HttpServerProcess(stack.address, ["--served-model-name", MODEL], env=ENV)
        http.start().wait_serving()
        yield HttpStack(stack, http)
    finally:
        if http is not None:
            http.stop()
        stack.stop()


@pytest.fixture(scope="session")
def reference() -> Reference:
    return Reference()
