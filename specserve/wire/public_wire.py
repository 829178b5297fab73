"""generate.proto <-> the orchestrator's domain types, with the checks a request needs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specserve.engine.decode_state import FinishReason
from specserve.engine.drafter import MAX_K
from specserve.engine.errors import InvalidArgument
from specserve.engine.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from specserve.engine.sampling import SamplingParams
from specserve.orchestrator.api.text import MAX_PROMPT_TOKENS
from specserve.orchestrator.store import records
from specserve.orchestrator.types import (
    DEFAULT_MAX_NEW_TOKENS,
    ChatMessage,
    Chunk,
    GenerateParams,
    Prompt,
    SessionState,
    SessionSummary,
    Usage,
)
from specserve.v1 import common_pb2, generate_pb2
from specserve.wire.common_wire import DRAFTER_KINDS, RULE_ENUMS, sampling_rule

# The OpenAI range; higher temperatures give noise, and the bound catches unit mistakes.
MAX_TEMPERATURE = 2.0

FINISH = {
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: generate_pb2.FINISH_REASON_EOS,
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.CANCELLED: generate_pb2.FINISH_REASON_CANCELLED,
}
STATES = {
    SessionState.ACTIVE: generate_pb2.SESSION_STATE_ACTIVE,
    SessionState.IDLE: generate_pb2.SESSION_STATE_IDLE,
    SessionState.CANCELLED: generate_pb2.SESSION_STATE_CANCELLED,
}


def prompt(request: generate_pb2.GenerateRequest) -> Prompt:
    which = request.WhichOneof("prompt")
    if which == "text":
        return Prompt(text=request.text)
    if which == "token_ids":
        ids = request.token_ids.ids
        if len(ids) > MAX_PROMPT_TOKENS:  # before copying millions of ids on the event loop
            raise InvalidArgument(
                f"the prompt has {len(ids)} tokens; at most {MAX_PROMPT_TOKENS} are accepted"
            )
        return Prompt(token_ids=tuple(ids))
    if which == "chat":
        return Prompt(chat=tuple(ChatMessage(m.role, m.content) for m in request.chat.messages))
    raise InvalidArgument("the request has no prompt: set text, token_ids or chat")


def generate_params(
    request: generate_pb2.GenerateRequest, deadline: float | None, owner: bytes = b""
) -> GenerateParams:
    """A GenerateRequest -> validated GenerateParams (raises InvalidArgument); ``owner`` is
    the caller's key fingerprint."""
    s = request.sampling
    if not 0 <= s.temperature <= MAX_TEMPERATURE:  # NaN fails both comparisons
        raise InvalidArgument(
            f"sampling.temperature must be in [0, {MAX_TEMPERATURE:g}] (0 means greedy), "
            f"got {s.temperature!r}"
        )
    if s.HasField("logprobs") and s.logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument(
            f"sampling.logprobs must be in 0..{MAX_TOP_LOGPROBS} (alternatives per token), "
            f"got {s.logprobs}"
        )
    sampling = SamplingParams(
        temperature=float(s.temperature),
        top_k=int(s.top_k),
        top_p=float(s.top_p) if s.top_p != 0 else 1.0,
        rule=sampling_rule(s.rule, "sampling.rule"),
    )
    spec = request.speculation
    if spec.drafter not in DRAFTER_KINDS:
        known = ", ".join(common_pb2.Drafter.Name(v) for v in DRAFTER_KINDS)
        raise InvalidArgument(f"speculation.drafter {spec.drafter} is not one of {known}")
    k = spec.k if spec.HasField("k") else None
    if k is not None and k > MAX_K:
        raise InvalidArgument(f"speculation.k must be between 0 and {MAX_K}, got {k}")
    return GenerateParams(
        prompt=prompt(request),
        sampling=sampling,
        seed=s.seed if s.HasField("seed") else None,
        max_new_tokens=s.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        stop=tuple(s.stop),
        drafter=DRAFTER_KINDS[spec.drafter],
        k=k,
        session_id=request.session_id,
        keep_session=request.keep_session,
        deadline=deadline,
        owner=owner,
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        skip_special_tokens=s.skip_special_tokens if s.HasField("skip_special_tokens") else True,
    )


def usage_pb(usage: Usage | None) -> generate_pb2.Usage | None:
    return None if usage is None else records.usage_pb(usage)


TokenText = Callable[[int], str]  # one token id decoded alone


def logprobs_pb(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprob], token_text: TokenText
) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            logprob=t.logprob,
            top_ids=[i for i, _ in t.top],
            top_logprobs=[lp for _, lp in t.top],
            token=token_text(token_id),
            top_tokens=[token_text(i) for i, _ in t.top],
        )
        for token_id, t in zip(token_ids, logprobs, strict=True)
    ]


def stream_response(chunk: Chunk, token_text: TokenText) -> generate_pb2.GenerateStreamResponse:
    return generate_pb2.GenerateStreamResponse(
        session_id=chunk.session_id,
        text=chunk.text,
        token_ids=chunk.token_ids,
        finish_reason=FINISH[chunk.finish_reason] if chunk.finish_reason else 0,
        usage=usage_pb(chunk.usage),
        seed=chunk.seed,
        logprobs=logprobs_pb(chunk.token_ids[: len(chunk.logprobs)], chunk.logprobs, token_text),
    )


def generate_response(
    chunks: Sequence[Chunk], token_text: TokenText
) -> generate_pb2.GenerateResponse:
    """The chunks of one turn, whole (the last chunk carries the finish)."""
    last = chunks[-1]
    return generate_pb2.GenerateResponse(
        session_id=last.session_id,
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=FINISH[last.finish_reason] if last.finish_reason else 0,
        usage=usage_pb(last.usage),
        time_to_first_token_ns=last.time_to_first_token_ns,
        duration_ns=last.duration_ns,
        seed=last.seed,
        logprobs=logprobs_pb(
            [t for c in chunks for t in c.token_ids[: len(c.logprobs)]],
            [t for c in chunks for t in c.logprobs],
            token_text,
        ),
    )


def session_info(summary: SessionSummary) -> generate_pb2.SessionInfo:
    return generate_pb2.SessionInfo(
        session_id=summary.session_id,
        state=STATES[summary.state],
        tokens=summary.tokens,
        turns=summary.turns,
        usage=records.usage_pb(summary.usage),
        seed=summary.seed,
        rule=RULE_ENUMS[summary.rule],
    )
