"""The orchestrator's domain types: what a request asks for and what the client gets back.

The servicer converts protobuf to these and back (:mod:`specserve.wire.public_wire`);
nothing between it and the session store sees a pb object of the public API.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specserve.engine.decode_state import FinishReason
from specserve.engine.drafter import DrafterKind
from specserve.engine.logprobs import TokenLogprob
from specserve.engine.sampling import SamplingParams, SamplingRule

DEFAULT_MAX_NEW_TOKENS = 128
MAX_NEW_TOKENS = 8192  # the most a request may ask for, on the gRPC and the HTTP API


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system", "user" or "assistant"
    content: str


@dataclass(frozen=True)
class Prompt:
    """Exactly one of raw text, token ids or chat messages."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[ChatMessage, ...] | None = None


@dataclass(frozen=True)
class GenerateParams:
    """One validated Generate / GenerateStream request."""

    prompt: Prompt
    sampling: SamplingParams  # its seed is ignored: see ``seed``
    seed: int | None = None  # None = the session's seed, or a new random one
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: tuple[str, ...] = ()
    drafter: DrafterKind = DrafterKind.MODEL
    k: int | None = None  # None = adaptive
    session_id: str = ""  # continue this kept session; empty = a new one
    keep_session: bool = False
    deadline: float | None = None  # time.monotonic() by which the client stops waiting
    owner: bytes = b""  # the caller's API key fingerprint (b"": keys are off)
    ignore_eos: bool = False  # generate past end-of-sequence tokens up to max_new_tokens
    logprobs: int | None = None  # alternatives per token (0..20); None = no logprobs
    skip_special_tokens: bool = True  # leave special tokens out of the text


@dataclass
class Usage:
    """Token counts of a turn, or of every turn of a session."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.rounds + other.rounds,
            self.drafted + other.drafted,
            self.accepted + other.accepted,
        )


@dataclass(frozen=True)
class Chunk:
    """Text and tokens committed since the previous chunk; the last one carries the finish."""

    session_id: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # this turn's, on the last chunk
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when asked for
    time_to_first_token_ns: int = 0
    duration_ns: int = 0
    seed: int = 0  # the turn's seed (the request's or the server's), on every chunk


class SessionState(enum.StrEnum):
    ACTIVE = "active"
    IDLE = "idle"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class SessionSummary:
    """What GetSession reports."""

    session_id: str
    state: SessionState
    tokens: int
    turns: int
    usage: Usage = field(default_factory=Usage)
    seed: int = 0
    rule: SamplingRule = SamplingRule.COUPLED
