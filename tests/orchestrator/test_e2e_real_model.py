"""Slow: a real model and its tokenizer through the whole stack (SmolLM2-135M as target and draft).

Text and chat prompts are tokenized by the orchestrator; streamed text deltas end
on character boundaries and add up to the final text; greedy tokens equal local
target-only decoding. Run `specserve models fetch` for the model first; skipped
when it is absent.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from specserve.client import Client
from specserve.engine.errors import NotFound
from specserve.engine.sampling import SamplingParams
from specserve.orchestrator.launch import OrchestratorProcess
from specserve.serving.launch import ServerProcess
from tests.orchestrator.stack import ENV

pytestmark = [pytest.mark.slow, pytest.mark.redis]

MODEL = "smollm2-135m-instruct"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def real_stack(redis_url: str) -> Iterator[str]:
    from specserve.model_store import resolve

    try:
        resolve(MODEL)
    except NotFound as e:
        pytest.skip(str(e))
    args = ["--model", MODEL, "--threads", "1"]
    servers = [ServerProcess("target", args, env=ENV), ServerProcess("draft", args, env=ENV)]
    orchestrator = None
    try:
        for s in servers:
            s.start()
        orchestrator = OrchestratorProcess(
            [
                "--target",
                servers[0].address,
                "--draft",
                servers[1].address,
                "--tokenizer",
                MODEL,
                "--redis-url",
                redis_url,
            ],
            env=ENV,
        ).start()
        for s in (*servers, orchestrator):
            s.wait_serving(timeout_s=300)
        yield orchestrator.address
    finally:
        for s in (orchestrator, *servers):
            if s is not None:
                s.stop()


@pytest.fixture(scope="module")
def local():  # type: ignore[no-untyped-def]
    from specserve.local import LocalConfig, LocalRunner

    return LocalRunner(LocalConfig(target=MODEL))


def test_text_prompt_streams_whole_characters(real_stack: str, local) -> None:  # type: ignore[no-untyped-def]
    prompt = "Write the French word for coffee, with its accent, then a smiley emoji:"
    expected = local.generate(
        local.encode(prompt), SamplingParams(), max_new_tokens=NEW_TOKENS, drafter="none"
    )
    with Client(real_stack, timeout_s=300) as c:
        deltas = list(c.stream(prompt, max_new_tokens=NEW_TOKENS, k=4))
        whole = c.generate(prompt, max_new_tokens=NEW_TOKENS, k=4)
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == expected.tokens == whole.token_ids
    assert all("\ufffd" not in d.text for d in deltas)
    # A completion cut inside a character ends its text before that character.
    assert "".join(d.text for d in deltas) == whole.text == local.decode(tokens).rstrip("\ufffd")
    assert whole.usage.accepted_tokens > 0  # the draft is the target itself: all accepted


def test_chat_prompt(real_stack: str, local) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Say hello in one word."}]
    ids = local.tokenizer.apply_chat_template(messages)
    expected = local.generate(ids, SamplingParams(), max_new_tokens=8, drafter="none")
    with Client(real_stack, timeout_s=300) as c:
        got = c.generate(messages, max_new_tokens=8, k=4)
    assert got.token_ids == expected.tokens
    assert got.usage.prompt_tokens == len(ids)
