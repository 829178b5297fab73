"""Session records (``specserve.v1.SessionRecord``) as pure transitions: new, turn, round, end.

A record is the source of truth for a session; these functions build the next
record from the previous one and never touch Redis (the store writes them).
Usage in a record is cumulative over every turn.
"""

from __future__ import annotations

from specserve.engine.decode_state import DecodeState
from specserve.engine.sampling import SamplingParams, SamplingRule
from specserve.orchestrator.types import GenerateParams, SessionState, SessionSummary, Usage
from specserve.v1 import generate_pb2, session_pb2
from specserve.wire import common_wire

STATES = {
    SessionState.ACTIVE: generate_pb2.SESSION_STATE_ACTIVE,
    SessionState.IDLE: generate_pb2.SESSION_STATE_IDLE,
    SessionState.CANCELLED: generate_pb2.SESSION_STATE_CANCELLED,
}
STATE_NAMES = {v: k for k, v in STATES.items()}


def copy(record: session_pb2.SessionRecord) -> session_pb2.SessionRecord:
    out = session_pb2.SessionRecord()
    out.CopyFrom(record)
    return out


def new_record(session_id: str, owner: bytes = b"") -> session_pb2.SessionRecord:
    """An empty session (no turn yet) of the caller whose key fingerprint is ``owner``."""
    return session_pb2.SessionRecord(
        session_id=session_id, state=STATES[SessionState.IDLE], owner=owner
    )


def start_turn(
    record: session_pb2.SessionRecord,
    prompt: list[int],
    params: GenerateParams,
    sampling: SamplingParams,
) -> session_pb2.SessionRecord:
    """The record of a turn that begins: the prompt appended, this turn's parameters, ACTIVE."""
    rec = copy(record)
    rec.turn_starts.append(len(rec.tokens))
    rec.tokens.extend(prompt)
    rec.completion_start = len(rec.tokens)
    rec.sampling.CopyFrom(common_wire.sampling_pb(sampling))
    rec.max_new_tokens = params.max_new_tokens
    del rec.stop[:]
    rec.stop.extend(params.stop)
    rec.drafter = common_wire.DRAFTER_ENUMS[params.drafter]
    if params.k is None:
        rec.ClearField("k")
    else:
        rec.k = params.k
    rec.keep = params.keep_session
    rec.state = STATES[SessionState.ACTIVE]
    rec.usage.prompt_tokens += len(prompt)
    return rec


def after_round(
    record: session_pb2.SessionRecord,
    state: DecodeState,
    usage: Usage,
    draft: session_pb2.KvOwnership,
    target: session_pb2.KvOwnership,
    *,
    kv_snapshot: session_pb2.KvSnapshot | None = None,
) -> session_pb2.SessionRecord:
    """The record once a round is committed: every token, the next round index, KV owners
    (and how far KV snapshots reach, when they are on)."""
    rec = copy(record)
    if kv_snapshot is not None:
        rec.kv_snapshot.CopyFrom(kv_snapshot)
    del rec.tokens[:]
    rec.tokens.extend(state.tokens)
    rec.round_index = state.round_index
    rec.draft.CopyFrom(draft)
    rec.target.CopyFrom(target)
    rec.usage.CopyFrom(usage_pb(usage))
    return rec


def ended(
    record: session_pb2.SessionRecord, state: SessionState, *, warm: bool
) -> session_pb2.SessionRecord:
    """The record of a kept session between turns; ``warm=False`` forgets the KV owners."""
    rec = copy(record)
    rec.state = STATES[state]
    if not warm:
        rec.ClearField("draft")
        rec.ClearField("target")
    return rec


def turn_usage(state: DecodeState, prompt_tokens: int) -> Usage:
    s = state.stats
    return Usage(prompt_tokens, state.completion_len, s.rounds, s.drafted, s.accepted)


def usage_of(record: session_pb2.SessionRecord) -> Usage:
    u = record.usage
    return Usage(
        u.prompt_tokens, u.completion_tokens, u.rounds, u.drafted_tokens, u.accepted_tokens
    )


def usage_pb(u: Usage) -> generate_pb2.Usage:
    return generate_pb2.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        rounds=u.rounds,
        drafted_tokens=u.drafted,
        accepted_tokens=u.accepted,
        acceptance_rate=u.acceptance_rate,
        mean_acceptance_length=u.mean_acceptance_length,
    )


def summary(
    record: session_pb2.SessionRecord, *, leased: bool, cancelled: bool = False
) -> SessionSummary:
    """What GetSession reports; an ACTIVE record without a lease (its orchestrator died)
    is IDLE: nothing generates it, unless it was ``cancelled`` (marked by CancelSession),
    which is CANCELLED once nothing generates it."""
    state = STATE_NAMES.get(record.state, SessionState.IDLE)
    if state is SessionState.ACTIVE and not leased:
        state = SessionState.CANCELLED if cancelled else SessionState.IDLE
    elif cancelled and state is SessionState.IDLE:
        state = SessionState.CANCELLED
    return SessionSummary(
        session_id=record.session_id,
        state=state,
        tokens=len(record.tokens),
        turns=len(record.turn_starts),
        usage=usage_of(record),
        seed=record.sampling.seed,
        rule=common_wire.RULE_NAMES.get(record.sampling.rule, SamplingRule.COUPLED),
    )


def is_active(record: session_pb2.SessionRecord, *, leased: bool) -> bool:
    """A generation runs on it: it is ACTIVE and its orchestrator holds the lease (is alive)."""
    return record.state == STATES[SessionState.ACTIVE] and leased
