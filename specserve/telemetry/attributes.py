"""Span names and attribute names, in one place.

The request span follows the OpenTelemetry GenAI semantic conventions
(``gen_ai.*``; span name ``"{gen_ai.operation.name} {gen_ai.request.model}"``).
The names are written out here rather than imported from the conventions
package, whose GenAI module is still private (``_incubating``). Speculation
attributes use ``spec.*``; serving attributes ``specserve.*``. Durations are
in seconds, as the conventions do.
"""

from __future__ import annotations

# -- GenAI semantic conventions ------------------------------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # "chat" or "text_completion"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"  # the session id
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"  # string[]
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"  # seconds
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
PROVIDER = "specserve"

# -- speculation -------------------------------------------------------------------
SPEC_K = "spec.k"  # draft tokens asked for (a batch span: summed over its sessions)
SPEC_DRAFTED = "spec.drafted"  # draft tokens proposed
SPEC_K_CAP = "spec.k_cap"  # the round's k cap (load bound, or the measured best under it)
SPEC_ACCEPTED = "spec.accepted"  # draft tokens kept
SPEC_ROUND_INDEX = "spec.round_index"
SPEC_ROUNDS = "spec.rounds"
SPEC_DRAFTER = "spec.drafter"

# -- serving -----------------------------------------------------------------------
BATCH_SIZE = "specserve.batch_size"  # sessions in the batch (the forward's, on replicas)
BATCH_CALLS = "specserve.batch_calls"  # RPCs coalesced into one forward
QUEUE_WAIT = "specserve.queue_wait_s"  # from arrival to the start of its forward
COMPUTE = "specserve.compute_s"  # the forward's wall time on the model thread
SESSION_ID = "specserve.session_id"
TARGET = "specserve.target"  # the target replica's endpoint
PREFILL_TOKENS = "specserve.prefill_tokens"  # prompt tokens the target had not cached
REPLAYED = "specserve.replayed_sessions"  # sessions whose round went to another target
OP = "specserve.op"  # the batched operation on a replica: "propose", "verify"

# -- span names --------------------------------------------------------------------
SPAN_PREFILL = "specserve.prefill"  # a session's first round of a turn (prompt + drafts)
SPAN_ROUND = "specserve.round"  # a session's later rounds
SPAN_PROPOSE = "specserve.propose"  # the batch's Propose calls
SPAN_VERIFY = "specserve.verify"  # the batch's Verify call(s)
SPAN_COMMIT = "specserve.commit"  # the batch's commit to the session store
SPAN_FINISH = "specserve.finish"  # ending sessions: releases, final records


def forward_span(pool: str, op: str) -> str:
    """The model-thread span of one batched call: ``specserve.draft.propose`` etc."""
    return f"specserve.{pool}.{op}"
