"""The request span: one per Generate / GenerateStream turn, in GenAI semantic conventions.

Named ``"{gen_ai.operation.name} {gen_ai.request.model}"`` (``chat`` for chat
messages, ``text_completion`` for text or token ids), a child of the gRPC server
span. It is the parent of the turn's store calls and of every round span of its
session (:mod:`specserve.orchestrator.round.spans`), so one request is one trace.
Usage and the finish reason are set when the turn ends.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from specserve.orchestrator.types import Chunk, GenerateParams
from specserve.telemetry import attributes as attr

tracer = trace.get_tracer(__name__)


def start_request_span(params: GenerateParams, model: str) -> Span:
    """Start (not activate) the span of one turn, under the current (gRPC server) span."""
    operation = "chat" if params.prompt.chat is not None else "text_completion"
    span = tracer.start_span(f"{operation} {model}", kind=trace.SpanKind.INTERNAL)
    if span.is_recording():
        sampling = params.sampling
        span.set_attributes(
            {
                attr.GEN_AI_OPERATION_NAME: operation,
                attr.GEN_AI_PROVIDER_NAME: attr.PROVIDER,
                attr.GEN_AI_REQUEST_MODEL: model,
                attr.GEN_AI_REQUEST_MAX_TOKENS: params.max_new_tokens,
                attr.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature,
                attr.GEN_AI_REQUEST_TOP_P: sampling.top_p,
                attr.GEN_AI_REQUEST_TOP_K: sampling.top_k,
                attr.SPEC_DRAFTER: str(params.drafter),
            }
        )
        if params.seed is not None:
            span.set_attribute(attr.GEN_AI_REQUEST_SEED, params.seed)
        if params.k is not None:
            span.set_attribute(attr.SPEC_K, params.k)
    return span


def finish_request_span(span: Span, last: Chunk) -> None:
    """Usage, finish reason and time to first token from the turn's last chunk."""
    if not span.is_recording():
        return
    span.set_attribute(attr.GEN_AI_CONVERSATION_ID, last.session_id)
    if last.finish_reason is not None:
        span.set_attribute(attr.GEN_AI_RESPONSE_FINISH_REASONS, [str(last.finish_reason)])
    span.set_attribute(attr.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, last.time_to_first_token_ns / 1e9)
    if last.usage is not None:
        u = last.usage
        span.set_attributes(
            {
                attr.GEN_AI_USAGE_INPUT_TOKENS: u.prompt_tokens,
                attr.GEN_AI_USAGE_OUTPUT_TOKENS: u.completion_tokens,
                attr.SPEC_ROUNDS: u.rounds,
                attr.SPEC_DRAFTED: u.drafted,
                attr.SPEC_ACCEPTED: u.accepted,
            }
        )


def fail_request_span(span: Span, error: BaseException) -> None:
    """The turn failed (or the client left): record why."""
    if not span.is_recording():
        return
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
