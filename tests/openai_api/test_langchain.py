"""LangChain's own OpenAI integration (``langchain-openai``) against the live tiny stack.

LangChain is how many applications reach an OpenAI-compatible server: ``ChatOpenAI``
and ``OpenAI`` pointed at ``http-server`` must give what the ``openai`` SDK gives
(itself checked against the gRPC API in test_sdk.py), streamed or not, and pass the
server's 4xx errors through as the SDK's exceptions.
"""

from __future__ import annotations

import openai
import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI, OpenAI

from tests.openai_api.conftest import MODEL, HttpStack

pytestmark = pytest.mark.redis

MESSAGES = [SystemMessage("Be brief."), HumanMessage("Say hi")]
SDK_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]


def _chat(http_stack: HttpStack, **kw: object) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL, base_url=f"{http_stack.base_url}/v1", api_key="sk-test",  # type: ignore[arg-type]
        temperature=0, max_retries=0, timeout=60, **kw,
    )  # fmt: skip


def test_chat_invoke_and_stream_equal_the_sdks_answer(http_stack: HttpStack) -> None:
    want = http_stack.client().chat.completions.create(
        model=MODEL,
        messages=SDK_MESSAGES,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )
    chat = _chat(http_stack, max_tokens=16)
    got = chat.invoke(MESSAGES)
    assert got.content == want.choices[0].message.content and got.content
    assert got.usage_metadata is not None and want.usage is not None
    assert got.usage_metadata["output_tokens"] == want.usage.completion_tokens
    assert got.usage_metadata["input_tokens"] == want.usage.prompt_tokens
    assert got.response_metadata["finish_reason"] == want.choices[0].finish_reason
    streamed = "".join(str(chunk.content) for chunk in chat.stream(MESSAGES))
    assert streamed == got.content


def test_completion_llm_equals_the_sdks_answer(http_stack: HttpStack) -> None:
    want = http_stack.client().completions.create(
        model=MODEL, prompt="Hello there", max_tokens=20, temperature=0
    )
    llm = OpenAI(
        model=MODEL, base_url=f"{http_stack.base_url}/v1", api_key="sk-test",  # type: ignore[arg-type]
        temperature=0, max_tokens=20, max_retries=0, timeout=60,
    )  # fmt: skip
    assert llm.invoke("Hello there") == want.choices[0].text
    assert "".join(llm.stream("Hello there")) == want.choices[0].text


def test_a_refused_request_surfaces_as_the_sdks_error(http_stack: HttpStack) -> None:
    chat = _chat(http_stack, max_tokens=1_000_000)
    with pytest.raises(openai.BadRequestError) as caught:
        chat.invoke(MESSAGES)
    assert caught.value.status_code == 400
    # LangChain sends OpenAI's newer name for the bound; the answer names what was sent
    assert "max_completion_tokens must be an integer in 1..8192" in str(caught.value)
    assert _chat(http_stack, max_tokens=4).invoke(MESSAGES).content  # still serving
