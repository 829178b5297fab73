"""Admission: what a request may cost, checked before it costs anything.

A request is refused with ``INVALID_ARGUMENT`` and a sentence, before any
tokenizing, store write or replica call, when

* its text (or chat messages) is larger than ``max_prompt_bytes``: measured on the
  bytes, so a 10 MB prompt is refused in microseconds instead of tokenized;
* its stop strings are too many, one is longer than ``max_stop_bytes`` or all of
  them together are longer than ``max_stop_total_bytes``;
* its tokens (a continued session's history plus the new prompt) are more than
  ``max_prompt_tokens`` or the model's context, or (``RESOURCE_EXHAUSTED``) more
  than a target's KV budget can ever hold for one session (a
  :class:`~specserve.wire.common_wire.SessionLimit`, which the targets report in
  ``GetLoad`` and :class:`TargetLimits` keeps).

A prompt inside the limits is served; its ``max_new_tokens`` is cut so that the
session never passes the limit (a prompt of the model's full context gets one
token). Text is tokenized off the event loop (:func:`encode`), so a large prompt
never stalls other clients' streams.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc.aio

from specserve.engine.errors import InvalidArgument, KVBudgetExceeded
from specserve.orchestrator.api.text import MAX_PROMPT_TOKENS, Tokenization
from specserve.orchestrator.fleet.replicas import ReplicaPool
from specserve.orchestrator.types import GenerateParams, Prompt
from specserve.v1 import common_pb2
from specserve.wire.common_wire import SessionLimit

log = logging.getLogger(__name__)

LIMITS_TTL_S = 30.0  # how long the targets' reported limits are trusted
LIMITS_TIMEOUT_S = 2.0  # GetLoad timeout while asking for them


@dataclass(frozen=True)
class AdmissionConfig:
    """The per-request bounds (flags of the orchestrator)."""

    max_prompt_tokens: int = MAX_PROMPT_TOKENS  # at most that: the API's ceiling
    max_prompt_bytes: int = 1 << 20  # 8 bytes per token of the default token limit
    max_stop_strings: int = 16
    max_stop_bytes: int = 1024  # one stop string
    max_stop_total_bytes: int = 16 << 10  # all of a request's stop strings (16 x 1 KiB)

    def __post_init__(self) -> None:
        for name in (
            "max_prompt_tokens",
            "max_prompt_bytes",
            "max_stop_strings",
            "max_stop_bytes",
            "max_stop_total_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens > MAX_PROMPT_TOKENS:
            raise ValueError(
                f"max_prompt_tokens must be <= {MAX_PROMPT_TOKENS}, got {self.max_prompt_tokens}"
            )


def request_bytes(config: AdmissionConfig) -> int:
    """The most bytes a GenerateRequest within ``config`` can take on the wire (generous:
    twice the prompt bytes for chat framing, 5 bytes a token id, 64 KiB for the rest).
    A larger one is refused before it is parsed."""
    return (
        2 * config.max_prompt_bytes
        + 5 * config.max_prompt_tokens
        + config.max_stop_total_bytes
        + 8 * config.max_stop_strings
        + (64 << 10)
    )


def check_request(params: GenerateParams, config: AdmissionConfig) -> None:
    """The checks on a request's sizes that need neither tokenizer nor store."""
    size = prompt_bytes(params.prompt)
    if size > config.max_prompt_bytes:
        raise InvalidArgument(
            f"the prompt is {size} bytes; at most {config.max_prompt_bytes} are accepted"
        )
    stop = params.stop
    if len(stop) > config.max_stop_strings:
        raise InvalidArgument(
            f"{len(stop)} stop strings; at most {config.max_stop_strings} are allowed"
        )
    sizes = [len(s.encode("utf-8", "surrogatepass")) for s in stop]
    if sizes and max(sizes) > config.max_stop_bytes:
        i = sizes.index(max(sizes))
        raise InvalidArgument(
            f"stop string {i} is {sizes[i]} bytes; at most {config.max_stop_bytes} are "
            "allowed per stop string"
        )
    if sum(sizes) > config.max_stop_total_bytes:
        raise InvalidArgument(
            f"the stop strings are {sum(sizes)} bytes together; at most "
            f"{config.max_stop_total_bytes} are allowed"
        )


def prompt_bytes(prompt: Prompt) -> int:
    """UTF-8 bytes of a text or chat prompt (0 for token ids: their count is checked)."""
    if prompt.text is not None:
        return _utf8_len(prompt.text)
    if prompt.chat is not None:
        return sum(_utf8_len(m.role) + _utf8_len(m.content) for m in prompt.chat)
    return 0


def _utf8_len(text: str) -> int:
    if text.isascii():  # the common case, without a copy
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


async def encode(text: Tokenization, prompt: Prompt, *, continuing: bool) -> list[int]:
    """Token ids of ``prompt``; text and chat are tokenized on a worker thread."""
    if prompt.token_ids is not None or text.tokenizer is None:
        return text.encode(prompt, continuing=continuing)
    return await asyncio.to_thread(text.encode, prompt, continuing=continuing)


def check_tokens(
    history: int, prompt: int, config: AdmissionConfig, limit: SessionLimit | None
) -> None:
    """A session's tokens after this prompt (``history`` committed before it) against
    ``max_prompt_tokens`` and the targets' limit."""
    total = history + prompt
    if total > config.max_prompt_tokens:
        raise InvalidArgument(
            f"the prompt has {total} tokens"
            + (f" ({history} of the session and {prompt} new)" if history else "")
            + f"; at most {config.max_prompt_tokens} are accepted"
        )
    if limit is None or total <= limit.tokens:
        return
    what = f"the prompt has {total} tokens" + (
        f" ({history} of the session and {prompt} new)" if history else ""
    )
    if total > limit.context:
        raise InvalidArgument(f"{what}; the model's context is {limit.context} tokens")
    raise KVBudgetExceeded(
        f"{what}; the targets' KV budget can hold at most {limit.kv_tokens} tokens of one session"
    )


def max_new_tokens(requested: int, history: int, prompt: int, limit: SessionLimit | None) -> int:
    """``requested``, cut so that the session stays within ``limit``: the last token is
    emitted, never cached, so a session of ``limit.tokens`` may still emit one."""
    if limit is None:
        return requested
    return max(1, min(requested, limit.tokens - history - prompt + 1))


class TargetLimits:
    """The tightest :class:`SessionLimit` the target replicas report, cached a while.

    Asked lazily (the first request after the cache expires waits for at most
    :data:`LIMITS_TIMEOUT_S`); ``None`` while no target answers, in which case the
    targets still refuse what they cannot hold.
    """

    def __init__(self, targets: ReplicaPool, clock: Callable[[], float] = time.monotonic):
        self.targets = targets
        self.clock = clock
        self._limit: SessionLimit | None = None
        self._asked = -LIMITS_TTL_S

    async def get(self) -> SessionLimit | None:
        if self._limit is not None and self.clock() - self._asked < LIMITS_TTL_S:
            return self._limit
        reports = await asyncio.gather(
            *(self._ask(ep) for ep in self.targets.usable()), return_exceptions=False
        )
        known = [r for r in reports if r is not None]
        if known:
            self._limit = SessionLimit(
                min(r.context for r in known), min(r.kv_tokens for r in known)
            )
            self._asked = self.clock()
        return self._limit

    async def _ask(self, endpoint: str) -> SessionLimit | None:
        replica = self.targets.get(endpoint)
        if replica is None:
            return None
        try:
            load = await replica.stub.GetLoad(common_pb2.GetLoadRequest(), timeout=LIMITS_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.info("GetLoad on target %s failed: %s", endpoint, e.code().name)
            return None
        if not load.max_context_tokens or not load.kv_capacity_tokens:
            return None  # a replica of an older version: it checks for itself
        return SessionLimit(load.max_context_tokens, load.kv_capacity_tokens)
