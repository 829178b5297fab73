"""The official ``openai`` client against a live tiny stack through ``specserve http-server``.

Every answer is checked against what the gRPC API gives for the same request (the
HTTP layer must add nothing and lose nothing), and speculation must have happened
where a test says it is on.
"""

from __future__ import annotations

import random

import openai
import pytest

from specserve.client import Client
from tests.openai_api.conftest import MODEL, HttpStack
from tests.orchestrator.stack import Reference

pytestmark = pytest.mark.redis

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
SPEC = {"speculation": {"drafter": "model", "k": 4}}


def test_completion_equals_the_grpc_answer_with_speculative_usage(http_stack: HttpStack) -> None:
    c = http_stack.client()
    got = c.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=24, temperature=0, extra_body=SPEC
    )
    with Client(http_stack.stack.address, timeout_s=60) as g:
        want = g.generate("Hello there", max_new_tokens=24, k=4, drafter="model")
    (choice,) = got.choices
    assert choice.text == want.text and choice.index == 0
    assert choice.finish_reason == {"length": "length", "eos": "stop"}[want.finish_reason]
    assert got.object == "text_completion" and got.model == MODEL
    assert got.usage is not None
    assert got.usage.prompt_tokens == want.usage.prompt_tokens == len("Hello there")
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    spec = got.usage.model_extra["speculation"]  # type: ignore[index]
    assert spec["drafted_tokens"] > 0 and spec["accepted_tokens"] > 0
    assert spec["mean_acceptance_length"] > 1


def test_streamed_completion_adds_up_to_the_unary_one(http_stack: HttpStack) -> None:
    c = http_stack.client()
    args = {"model": MODEL, "prompt": [5, 6, 7, 5, 6, 7], "max_tokens": 20, "temperature": 0}
    whole = c.completions.create(**args)
    chunks = list(c.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert all(ch.usage is None for ch in body)
    assert "".join(ch.choices[0].text for ch in body) == whole.choices[0].text
    assert body[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in body[:-1])
    assert len({ch.id for ch in chunks}) == 1


def test_chat_streamed_and_not_agree(http_stack: HttpStack) -> None:
    c = http_stack.client()
    whole = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    assert whole.object == "chat.completion"
    # The chat template framed the prompt: more tokens than the two messages' characters.
    assert whole.usage is not None and whole.usage.prompt_tokens > len("Be brief.Say hi")
    stream = list(
        c.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stream=True
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert stream[0].object == "chat.completion.chunk"
    text = "".join(ch.choices[0].delta.content or "" for ch in stream)
    assert text == message.content
    assert stream[-1].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.parametrize("drafter", ["model", "none"])
def test_n_choices_with_a_seed_are_reproducible_and_each_is_its_own_sample(
    http_stack: HttpStack, drafter: str
) -> None:
    c = http_stack.client()
    # With drafts too: coupled sampling makes the tokens a function of the seed alone,
    # however many drafts each round verified. A requested k drafts in every round (an
    # adaptive one may decide from the shared stack's timings to draft nothing in 12
    # tokens, and then nothing here would be verified).
    speculation: dict[str, object] = {"drafter": drafter}
    if drafter == "model":
        speculation["k"] = 3
    args = {
        "model": MODEL,
        "prompt": "Once",
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 7,
        "extra_body": {"speculation": speculation},
    }
    first = c.completions.create(**args, n=3)
    again = c.completions.create(**args, n=3)
    texts = [ch.text for ch in sorted(first.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in sorted(first.choices, key=lambda ch: ch.index)] == [0, 1, 2]
    assert texts == [ch.text for ch in sorted(again.choices, key=lambda ch: ch.index)]
    assert len(set(texts)) > 1  # seed + i per choice: not three copies of one sample
    alone = c.completions.create(**{**args, "seed": 8})  # choice 1 is seed 7 + 1
    assert alone.choices[0].text == texts[1]
    assert first.usage is not None and first.usage.prompt_tokens == len("Once")  # counted once
    drafted = first.usage.model_extra["speculation"]["drafted_tokens"]  # type: ignore[index]
    assert (drafted > 0) == (drafter == "model")
    singles = [c.completions.create(**{**args, "seed": 7 + i}).usage for i in range(3)]
    assert first.usage.completion_tokens == sum(u.completion_tokens for u in singles)  # type: ignore[union-attr]
    streamed = list(c.completions.create(**args, n=3, stream=True))
    by_index = {i: "" for i in range(3)}
    for ch in streamed:
        by_index[ch.choices[0].index] += ch.choices[0].text
    assert [by_index[i] for i in range(3)] == texts


def test_stop_strings_end_the_text(http_stack: HttpStack) -> None:
    c = http_stack.client()
    args = {"model": MODEL, "prompt": "abc", "max_tokens": 32, "temperature": 0}
    full = c.completions.create(**args).choices[0].text
    assert len(full) >= 8, full
    stop = full[5:7]
    cut = full[: full.index(stop)]
    got = c.completions.create(**args, stop=[stop, "never-appears"]).choices[0]
    assert got.text == cut and got.finish_reason == "stop"
    streamed = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=32, temperature=0
    )
    text = streamed.choices[0].message.content or ""
    if len(text) > 4:
        got_chat = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "abc"}],
            max_tokens=32,
            temperature=0,
            stop=text[3:5],
        )
        assert got_chat.choices[0].message.content == text[: text.index(text[3:5])]


def test_logprobs_completion_and_chat(http_stack: HttpStack) -> None:
    c = http_stack.client()
    got = c.completions.create(
        model=MODEL, prompt="xyz", max_tokens=10, temperature=0, logprobs=3, extra_body=SPEC
    )
    lp = got.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert "".join(lp.tokens) == got.choices[0].text  # one character per token
    assert lp.text_offset == list(range(len(lp.tokens)))
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs or [], strict=True):
        assert len(top) == 3 and max(top.values()) == pytest.approx(value)  # greedy: the argmax
        assert top[token] == pytest.approx(value)
    chat = c.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)
    stream = c.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, stream=True
    )
    streamed = [
        t for ch in stream if ch.choices[0].logprobs for t in ch.choices[0].logprobs.content or []
    ]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content])
    plain = c.completions.create(model=MODEL, prompt="xyz", max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_ignore_eos_generates_past_the_end_of_sequence(
    http_stack: HttpStack, reference: Reference
) -> None:
    prompt = next(
        p
        for p in ([random.Random(s).randrange(3, 256) for _ in range(8)] for s in range(100))
        if 1 in reference.decode(p, 24)  # id 1 is the tiny tokenizer's <|im_end|>
    )
    c = http_stack.client()
    stopped = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens < 24
    longer = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert longer.choices[0].finish_reason == "length"
    assert longer.usage is not None and longer.usage.completion_tokens == 24


def test_speculation_off_drafts_nothing_and_changes_no_greedy_token(http_stack: HttpStack) -> None:
    c = http_stack.client()
    args = {"model": MODEL, "prompt": "Hello there", "max_tokens": 20, "temperature": 0}
    on = c.completions.create(**args, extra_body=SPEC)
    off = c.completions.create(**args, extra_body={"speculation": {"drafter": "none"}})
    assert on.choices[0].text == off.choices[0].text
    assert off.usage.model_extra["speculation"]["drafted_tokens"] == 0  # type: ignore[union-attr]
    assert on.usage.model_extra["speculation"]["drafted_tokens"] > 0  # type: ignore[union-attr]


def test_models_lists_the_served_model(http_stack: HttpStack) -> None:
    c = http_stack.client()
    assert [m.id for m in c.models.list()] == [MODEL]
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")


BAD = [
    ({"temperature": 3.0}, "temperature", 400),
    ({"top_p": 0}, "top_p", 400),
    ({"n": 0}, "n", 400),
    ({"max_tokens": 0}, "max_tokens", 400),
    ({"logprobs": 21}, "logprobs", 400),
    ({"seed": "7"}, "seed", 400),
    ({"echo": True}, "echo", 400),
    ({"extra_body": {"speculation": {"drafter": "nope"}}}, "speculation.drafter", 400),
    ({"extra_body": {"speculation": {"k": 99}}}, "k", 400),
    ({"extra_body": {"speculation": {"drafts": 2}}}, "speculation", 400),
    ({"model": "gpt-4"}, "model", 404),
    ({"prompt": [1, 2, 300]}, None, 400),  # the orchestrator's refusal, passed through
]


@pytest.mark.parametrize(("change", "param", "status"), BAD)
def test_bad_input_gets_an_openai_error_body(
    http_stack: HttpStack, change: dict[str, object], param: str | None, status: int
) -> None:
    c = http_stack.client()
    args: dict[str, object] = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **change}
    with pytest.raises(openai.APIStatusError) as info:
        c.completions.create(**args)  # type: ignore[call-overload]
    e = info.value
    assert e.status_code == status
    body = e.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
    assert body["message"] and body["param"] == param
    if status == 400:
        assert isinstance(e, openai.BadRequestError) and body["type"] == "invalid_request_error"
    if change.get("prompt"):
        assert "outside the vocabulary" in body["message"]


def test_bad_chat_messages_are_refused(http_stack: HttpStack) -> None:
    c = http_stack.client()
    for messages, param in (
        ([], "messages"),
        ([{"role": "tool", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
        assert info.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=MODEL, messages=CHAT, top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs"  # type: ignore[index]


SPECIALS = ("<|im_start|>", "<|im_end|>", "<unk>")  # the tiny tokenizer's special tokens
END = 1  # its <|im_end|>: the chat template's end of turn and the end-of-sequence id


def without_specials(text: str) -> str:
    for s in SPECIALS:
        text = text.replace(s, "")
    return text


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def find_chat(http_stack: HttpStack, wanted: object, **kwargs: object) -> list[dict[str, str]]:
    """The first of a fixed list of chats whose greedy completion's token ids satisfy
    ``wanted`` (asked through the gRPC API, which reports every id)."""
    with Client(http_stack.stack.address, timeout_s=60) as g:
        for i in range(64):
            messages = chat(f"Tell me {i}")
            got = g.generate(messages, temperature=0, **kwargs)  # type: ignore[arg-type]
            if wanted(got):  # type: ignore[operator]
                return messages
    raise AssertionError("no chat of the list gives such a completion")


def test_a_chat_turn_ends_on_its_end_token_which_is_not_in_the_content(
    http_stack: HttpStack,
) -> None:
    """Greedy chat that ends on <|im_end|>: finish "stop", the content free of it (streamed
    or not, and in the chat logprobs), and kept only with skip_special_tokens false."""
    messages = find_chat(
        http_stack, lambda r: r.finish_reason == "eos" and len(r.token_ids) > 1, max_new_tokens=64
    )
    c = http_stack.client()
    args: dict[str, object] = {"model": MODEL, "messages": messages, "max_tokens": 64}
    whole = c.chat.completions.create(**args, temperature=0, logprobs=True)  # type: ignore[call-overload]
    choice = whole.choices[0]
    content = choice.message.content or ""
    assert choice.finish_reason == "stop" and content
    assert not any(s in content for s in SPECIALS), content
    tokens = choice.logprobs.content  # type: ignore[union-attr]
    assert tokens is not None and "".join(t.token for t in tokens) == content
    assert tokens[-1].token == "" and tokens[-1].bytes == []  # the end token, unspelled
    streamed = c.chat.completions.create(**args, temperature=0, stream=True)  # type: ignore[call-overload]
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == content
    kept = c.chat.completions.create(
        **args,  # type: ignore[arg-type]
        temperature=0,
        extra_body={"skip_special_tokens": False},
    )
    assert kept.choices[0].message.content == content + "<|im_end|>"
    assert kept.choices[0].finish_reason == "stop"


def _greedy_chat(messages: object, n: int) -> dict[str, object]:
    """The openai SDK's arguments of a greedy chat of ``n`` tokens past any end of turn."""
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": n,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }


def test_special_tokens_are_left_out_of_every_text_path(http_stack: HttpStack) -> None:
    """Past the end of turn (ignore_eos), a completion holding both <|im_start|> and
    <|im_end|>: the HTTP text (chat and completions, streamed or not) and the gRPC text
    (Generate and GenerateStream, the Python client's default) leave them out; kept, the
    same requests give the text with them, which is the left-out text plus the tokens."""
    n = 160
    messages = find_chat(
        http_stack,
        lambda r: {0, END} <= set(r.token_ids),
        max_new_tokens=n,
        ignore_eos=True,
    )
    c = http_stack.client()
    args = _greedy_chat(messages, n)
    plain = c.chat.completions.create(**args).choices[0].message.content or ""  # type: ignore[call-overload]
    keep = {"ignore_eos": True, "skip_special_tokens": False}
    kept = c.chat.completions.create(**{**args, "extra_body": keep}).choices[0].message.content  # type: ignore[call-overload]
    assert kept is not None and "<|im_start|>" in kept and "<|im_end|>" in kept
    assert not any(s in plain for s in SPECIALS)
    assert plain == without_specials(kept)
    streamed = c.chat.completions.create(**args, stream=True)  # type: ignore[call-overload]
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == plain
    with Client(http_stack.stack.address, timeout_s=60) as g:
        grpc_args: dict[str, object] = {"max_new_tokens": n, "ignore_eos": True}
        assert g.generate(messages, **grpc_args).text == plain  # type: ignore[arg-type]
        assert "".join(d.text for d in g.stream(messages, **grpc_args)) == plain  # type: ignore[arg-type]
        assert g.generate(messages, **grpc_args, skip_special_tokens=False).text == kept  # type: ignore[arg-type]
        ids = g.generate(messages, **grpc_args).token_ids  # type: ignore[arg-type]
    # /v1/completions on the same ids: the same rule.
    done = c.completions.create(
        model=MODEL, prompt=ids[:40], max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
    assert not any(s in done.choices[0].text for s in SPECIALS)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(**{**args, "extra_body": {"skip_special_tokens": "no"}})  # type: ignore[call-overload]
    assert info.value.body["param"] == "skip_special_tokens"  # type: ignore[index]


def test_a_stop_string_is_matched_in_the_text_without_special_tokens(
    http_stack: HttpStack,
) -> None:
    """A stop string that straddles a left-out special token still stops the text there:
    stop strings see the text the client gets."""
    n = 160
    messages = find_chat(
        http_stack,
        lambda r: {0, END} <= set(r.token_ids[1:-1]),
        max_new_tokens=n,
        ignore_eos=True,
    )
    c = http_stack.client()
    args = _greedy_chat(messages, n)
    kept = (
        c.chat.completions.create(  # type: ignore[call-overload]
            **{**args, "extra_body": {"ignore_eos": True, "skip_special_tokens": False}}
        )
        .choices[0]
        .message.content
    )
    plain = c.chat.completions.create(**args).choices[0].message.content or ""  # type: ignore[call-overload]
    at = min(kept.find(s) for s in SPECIALS if s in kept)  # the first, so none before it
    assert 0 < at < len(plain)
    stop = plain[at - 1 : at + 1]  # one character each side of where the token was
    got = c.chat.completions.create(**args, stop=[stop]).choices[0]  # type: ignore[call-overload]
    assert got.finish_reason == "stop"
    assert got.message.content == plain[: plain.index(stop)]
