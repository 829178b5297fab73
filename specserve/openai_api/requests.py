"""OpenAI request bodies -> the gRPC ``GenerateRequest`` of each choice, validated.

One HTTP request becomes one :class:`Call` per choice: ``n`` samples of each prompt
(completions take a batch of prompts too), each its own orchestrator session, so
the target verifies them in one batch. With a ``seed``, choice ``i`` of a prompt is
sampled with ``seed + i`` (the same seed would give ``n`` equal samples).

Every field is checked here with the field named in the error (``param``); the
orchestrator checks the rest (vocabulary, prompt length, stop strings) and its
refusal passes through as the same kind of error body.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass
from typing import Any

from specserve.engine.drafter import MAX_K
from specserve.engine.logprobs import MAX_TOP_LOGPROBS
from specserve.openai_api.errors import ApiError, bad_request
from specserve.orchestrator.api.text import MAX_PROMPT_TOKENS
from specserve.orchestrator.types import MAX_NEW_TOKENS
from specserve.v1 import common_pb2, generate_pb2
from specserve.wire.public_wire import MAX_TEMPERATURE

# The bounds are the gRPC API's own constants, so a value the HTTP layer lets through is
# one the orchestrator accepts, and a refusal names the HTTP field (``param``).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TOKEN_ID = (1 << 31) - 1  # TokenIds.ids is int32
DRAFTERS = {
    "model": common_pb2.DRAFTER_MODEL,
    "ngram": common_pb2.DRAFTER_NGRAM,
    "none": common_pb2.DRAFTER_NONE,
}
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields of the OpenAI API this server refuses rather than silently ignores, with the
# value that means "not used".
_UNSUPPORTED: dict[str, object] = {
    "echo": False,
    "suffix": None,
    "logit_bias": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "tools": None,
    "functions": None,
    "audio": None,
}


_SHOWN = reprlib.Repr()  # Python 3.11: the limits are attributes, not arguments
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 2, 40, 40
_SHOWN.maxlist = _SHOWN.maxdict = 4


def shown(value: object) -> str:
    """``value`` as an error message quotes it: short, and bounded however deep or large
    (a plain ``repr`` of a 900-level list would recurse and of a 5 MB string copy it)."""
    return _SHOWN.repr(value)


@dataclass(frozen=True)
class Call:
    """The gRPC request of one choice (``index`` as OpenAI numbers choices)."""

    index: int
    prompt_index: int  # which prompt of the request it samples
    request: generate_pb2.GenerateRequest


@dataclass(frozen=True)
class ParsedRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    chat: bool
    model: str
    calls: tuple[Call, ...]
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # alternatives per token; None = no logprobs


def parse_completion(body: object, model: str, max_choices: int) -> ParsedRequest:
    """A /v1/completions body (raises :class:`ApiError`)."""
    b = _object(body)
    _check_model(b, model)
    _refuse_unsupported(b)
    best_of = b.get("best_of")
    if best_of is not None and best_of != _int(b, "n", 1, 1, max_choices):
        raise bad_request("best_of is not supported (other than equal to n)", "best_of")
    prompts = _prompts(b.get("prompt"))
    logprobs = _optional_int(b, "logprobs", 0, MAX_TOP_LOGPROBS)
    sampling = _sampling(b, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs)
    return _parsed(b, False, model, prompts, sampling, logprobs, max_choices)


def parse_chat(body: object, model: str, max_choices: int) -> ParsedRequest:
    """A /v1/chat/completions body (raises :class:`ApiError`)."""
    b = _object(body)
    _check_model(b, model)
    _refuse_unsupported(b)
    fmt = b.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_request(
            "response_format other than {'type': 'text'} is not supported", "response_format"
        )
    messages = _messages(b.get("messages"))
    want = b.get("logprobs", False)
    if not isinstance(want, bool):
        raise bad_request(f"logprobs must be a boolean, got {shown(want)}", "logprobs")
    top = _optional_int(b, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not want:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    logprobs = (top or 0) if want else None
    limit = "max_completion_tokens" if b.get("max_completion_tokens") is not None else "max_tokens"
    sampling = _sampling(b, limit, 0, logprobs)
    return _parsed(b, True, model, [messages], sampling, logprobs, max_choices)


def _parsed(
    b: dict[str, Any],
    chat: bool,
    model: str,
    prompts: list[Any],
    sampling: generate_pb2.SamplingParameters,
    logprobs: int | None,
    max_choices: int,
) -> ParsedRequest:
    n = _int(b, "n", 1, 1, max_choices)
    if n * len(prompts) > max_choices:
        raise bad_request(
            f"{len(prompts)} prompts x n={n} is {n * len(prompts)} choices; at most "
            f"{max_choices} are allowed per request",
            "n",
        )
    stream = b.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be a boolean, got {shown(stream)}", "stream")
    options = b.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or not isinstance(
            options.get("include_usage", False), bool
        ):
            raise bad_request('stream_options must be {"include_usage": bool}', "stream_options")
        include_usage = bool(options.get("include_usage", False))
    speculation = _speculation(b.get("speculation"))
    calls = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            req = generate_pb2.GenerateRequest(sampling=sampling, speculation=speculation)
            if chat:
                req.chat.messages.extend(prompt)
            elif isinstance(prompt, str):
                req.text = prompt
            else:
                req.token_ids.ids.extend(prompt)
            if sampling.HasField("seed"):
                req.sampling.seed = (sampling.seed + i) % (1 << 64)
            calls.append(Call(p * n + i, p, req))
    return ParsedRequest(chat, model, tuple(calls), stream, include_usage, logprobs)


def _object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _check_model(b: dict[str, Any], model: str) -> None:
    name = b.get("model")
    if not isinstance(name, str) or not name:
        raise bad_request("model is required: the name /v1/models lists", "model")
    if name != model:
        raise ApiError(
            404,
            f"The model `{name}` does not exist; this server serves `{model}`.",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def _refuse_unsupported(b: dict[str, Any]) -> None:
    for name, unused in _UNSUPPORTED.items():
        value = b.get(name)
        if value is not None and value != unused and value not in ({}, [], ""):
            raise bad_request(f"{name} is not supported by this server", name)


def _number(b: dict[str, Any], name: str, default: float) -> float:
    value = b.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"{name} must be a finite number, got {shown(value)}", name)
    return float(value)


def _int(b: dict[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = b.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise bad_request(f"{name} must be an integer in {lo}..{hi}, got {shown(value)}", name)
    return value


def _optional_int(b: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    return None if b.get(name) is None else _int(b, name, 0, lo, hi)


def _sampling(
    b: dict[str, Any], limit: str, default_limit: int, logprobs: int | None
) -> generate_pb2.SamplingParameters:
    temperature = _number(b, "temperature", 1.0)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise bad_request(
            f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 means greedy), "
            f"got {shown(temperature)}",
            "temperature",
        )
    top_p = _number(b, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {shown(top_p)}", "top_p")
    top_k = _int(b, "top_k", 0, -1, 1 << 30)
    s = generate_pb2.SamplingParameters(
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),  # -1 (vLLM's "off") = 0
        max_new_tokens=_int(b, limit, default_limit, 1, MAX_NEW_TOKENS),
        stop=_stops(b.get("stop")),
        ignore_eos=_bool(b, "ignore_eos"),
    )
    seed = b.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 64:
            raise bad_request(f"seed must be a 64-bit integer, got {shown(seed)}", "seed")
        s.seed = seed % (1 << 64)
    if logprobs is not None:
        s.logprobs = logprobs
    skip = b.get("skip_special_tokens", True)  # vLLM's extension field, and its default
    if not isinstance(skip, bool):
        raise bad_request(
            f"skip_special_tokens must be a boolean, got {shown(skip)}", "skip_special_tokens"
        )
    s.skip_special_tokens = skip
    return s


def _bool(b: dict[str, Any], name: str) -> bool:
    value = b.get(name, False)
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {shown(value)}", name)
    return value


def _stops(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad_request("stop must be a non-empty string or a list of them", "stop")
    return list(value)


def _prompts(prompt: object) -> list[str | list[int]]:
    """The prompts of a completion: text, token ids, or a batch of either."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if _is_id(prompt[0]):
            return [_ids(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p for p in prompt):
            return [_ids(p) for p in prompt]
    raise bad_request(
        "prompt must be a string, a list of token ids, or a non-empty list of either", "prompt"
    )


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(ids: list[Any]) -> list[int]:
    """One prompt's token ids, checked: the count first (before a million ids are looked
    at), then that each is an integer the gRPC field can carry; the orchestrator checks
    them against the vocabulary."""
    if len(ids) > MAX_PROMPT_TOKENS:
        raise bad_request(
            f"the prompt has {len(ids)} token ids; at most {MAX_PROMPT_TOKENS} are accepted",
            "prompt",
        )
    if not all(_is_id(t) for t in ids):
        raise bad_request("a token-id prompt must hold integers only", "prompt")
    low, high = min(ids), max(ids)
    if low < 0 or high > MAX_TOKEN_ID:
        bad = low if low < 0 else high
        raise bad_request(f"prompt token id {shown(bad)} is not in 0..{MAX_TOKEN_ID}", "prompt")
    return ids


def _messages(messages: object) -> list[generate_pb2.ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{param} must be an object with role and content", param)
        role = CHAT_ROLES.get(m.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise bad_request(
                f"{param}.role must be one of {', '.join(CHAT_ROLES)}, got {shown(m.get('role'))}",
                f"{param}.role",
            )
        out.append(generate_pb2.ChatMessage(role=role, content=_content(m.get("content"), param)))
    return out


def _content(content: object, param: str) -> str:
    """A message's text: a string, or a list of text parts (other part types are refused)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(
                    f"{param}.content: only text parts are supported", f"{param}.content"
                )
            text = part.get("text", "")
            if not isinstance(text, str):
                raise bad_request(
                    f"{param}.content: a text part's text must be a string", f"{param}.content"
                )
            texts.append(text)
        return "".join(texts)
    raise bad_request(
        f"{param}.content must be a string or a list of text parts", f"{param}.content"
    )


def _speculation(value: object) -> generate_pb2.SpeculationParameters:
    """The ``speculation`` extension object: ``{"drafter": ..., "k": ...}``, both optional."""
    spec = generate_pb2.SpeculationParameters()
    if value is None:
        return spec
    if not isinstance(value, dict):
        raise bad_request(
            'speculation must be an object: {"drafter": ..., "k": ...}', "speculation"
        )
    unknown = set(value) - {"drafter", "k"}
    if unknown:
        raise bad_request(
            f"speculation has unknown fields {sorted(unknown)}; it takes drafter and k",
            "speculation",
        )
    drafter = value.get("drafter")
    if drafter is not None:
        if drafter not in DRAFTERS:
            raise bad_request(
                f"speculation.drafter must be one of {', '.join(DRAFTERS)}, got {shown(drafter)}",
                "speculation.drafter",
            )
        spec.drafter = DRAFTERS[drafter]
    if value.get("k") is not None:
        spec.k = _int(value, "k", 0, 0, MAX_K)
    return spec
