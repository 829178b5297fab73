"""gRPC results -> OpenAI response bodies and stream chunks (plain dicts, ready for JSON).

Field mapping (docs/openai-api.md has the table): finish reasons ``length`` ->
``"length"``, ``eos`` and ``stop`` -> ``"stop"``, ``cancelled`` -> ``"abort"``; usage
counts each prompt once however many choices sample it, and adds the speculative
figures under ``usage.speculation``; logprobs take the legacy completions shape
(``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``) or the chat
shape (``content: [{token, logprob, bytes, top_logprobs}]``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from specserve.v1 import common_pb2, generate_pb2

FINISH = {
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_EOS: "stop",
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_CANCELLED: "abort",
}


@dataclass(frozen=True)
class Envelope:
    """What every body and chunk of one HTTP request shares."""

    id: str
    created: int
    model: str
    chat: bool

    def head(self, *, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


@dataclass
class LogprobCursor:
    """Where a choice's next token starts in its text (the legacy ``text_offset``)."""

    offset: int = 0


def usage(per_prompt: dict[int, int], usages: Iterable[generate_pb2.Usage]) -> dict[str, Any]:
    """OpenAI usage over a request's choices; ``per_prompt``: prompt index -> its tokens."""
    u = list(usages)
    prompt = sum(per_prompt.values())
    completion = sum(x.completion_tokens for x in u)
    rounds = sum(x.rounds for x in u)
    drafted = sum(x.drafted_tokens for x in u)
    accepted = sum(x.accepted_tokens for x in u)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "speculation": {
            "rounds": rounds,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / rounds if rounds else 0.0,
        },
    }


def logprobs(
    entries: Sequence[common_pb2.TokenLogprob], chat: bool, cursor: LogprobCursor
) -> dict[str, Any]:
    """The ``logprobs`` object of a choice (or of one stream chunk's tokens)."""
    if chat:
        return {
            "content": [
                {
                    "token": t.token,
                    "logprob": t.logprob,
                    "bytes": list(t.token.encode()),
                    "top_logprobs": [
                        {"token": s, "logprob": lp, "bytes": list(s.encode())}
                        for s, lp in zip(t.top_tokens, t.top_logprobs, strict=True)
                    ],
                }
                for t in entries
            ],
            "refusal": None,
        }
    offsets = []
    for t in entries:
        offsets.append(cursor.offset)
        cursor.offset += len(t.token)
    return {
        "tokens": [t.token for t in entries],
        "token_logprobs": [t.logprob for t in entries],
        "top_logprobs": [dict(zip(t.top_tokens, t.top_logprobs, strict=True)) for t in entries],
        "text_offset": offsets,
    }


@dataclass
class Choice:
    """One choice of a non-streamed response."""

    index: int
    prompt_index: int
    response: generate_pb2.GenerateResponse


def body(env: Envelope, choices: Sequence[Choice], want_logprobs: bool) -> dict[str, Any]:
    """The whole response of a non-streamed request."""
    out = env.head(chunk=False)
    items = []
    for c in sorted(choices, key=lambda c: c.index):
        r = c.response
        item: dict[str, Any] = {"index": c.index}
        if env.chat:
            item["message"] = {"role": "assistant", "content": r.text, "refusal": None}
        else:
            item["text"] = r.text
        item["logprobs"] = (
            logprobs(r.logprobs, env.chat, LogprobCursor()) if want_logprobs else None
        )
        item["finish_reason"] = FINISH.get(r.finish_reason, "stop")
        items.append(item)
    out["choices"] = items
    per_prompt = {c.prompt_index: c.response.usage.prompt_tokens for c in choices}
    out["usage"] = usage(per_prompt, (c.response.usage for c in choices))
    out["system_fingerprint"] = None
    return out


def chunk(
    env: Envelope,
    index: int,
    *,
    text: str | None = None,
    role: bool = False,
    finish: int = 0,
    entries: Sequence[common_pb2.TokenLogprob] = (),
    cursor: LogprobCursor | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One stream chunk of choice ``index``: a text delta, the role opener, or the finish."""
    out = env.head(chunk=True)
    item: dict[str, Any] = {"index": index}
    if env.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text is not None:
            delta["content"] = text
        item["delta"] = delta
    else:
        item["text"] = text or ""
    item["logprobs"] = (
        logprobs(entries, env.chat, cursor) if cursor is not None and entries else None
    )
    item["finish_reason"] = FINISH.get(finish, "stop") if finish else None
    out["choices"] = [item]
    if include_usage:
        out["usage"] = None  # OpenAI: null on every chunk but the last
    return out


def usage_chunk(env: Envelope, usage_body: dict[str, Any]) -> dict[str, Any]:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
    out = env.head(chunk=True)
    out["choices"] = []
    out["usage"] = usage_body
    return out
