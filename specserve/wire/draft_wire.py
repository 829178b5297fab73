"""draft.proto <-> engine types, both ends: the draft servicer's and its callers'."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.engine.drafter import MAX_K, DraftCall, DrafterKind, DraftInput, DraftOutcome
from specserve.engine.errors import InvalidArgument
from specserve.engine.rejection import Proposal
from specserve.v1 import common_pb2, draft_pb2
from specserve.wire import common_wire, sparse_q

# -- server side ---------------------------------------------------------------------


def draft_calls(
    request: draft_pb2.ProposeRequest, vocab: int, limit: common_wire.SessionLimit
) -> list[DraftCall]:
    """A ProposeRequest -> validated engine inputs (raises InvalidArgument)."""
    sessions = request.sessions
    ids = [s.session_id for s in sessions]
    common_wire.check_session_ids(ids)
    calls = []
    for s, sid in zip(sessions, ids, strict=True):
        kind = common_wire.drafter_kind(s.drafter, sid)
        if kind == DrafterKind.NONE:
            raise InvalidArgument(
                f"session {sid!r}: drafter DRAFTER_NONE means no drafting; do not send the "
                "session to Propose"
            )
        k, start = s.k, s.start
        if k > MAX_K:
            raise InvalidArgument(f"session {sid!r}: k must be between 0 and {MAX_K}, got {k}")
        tokens = list(s.new_tokens)
        limit.check(sid, start, len(tokens), k)
        common_wire.check_tokens(tokens, vocab, "new_tokens", sid)
        params = common_wire.sampling_params(s.sampling, sid)
        try:
            x = DraftInput(sid, start, tokens, k, params, s.round_index, s.min_confidence)
        except InvalidArgument as e:
            raise InvalidArgument(f"session {sid!r}: {e}") from None
        calls.append(DraftCall(kind, x))
    return calls


def propose_response(
    outcomes: Sequence[DraftOutcome], calls: Sequence[DraftCall]
) -> draft_pb2.ProposeResponse:
    """Outcomes -> ProposeResponse (compute_ns, replica_id and batch_size set by the caller)."""
    response = draft_pb2.ProposeResponse()
    proposals: list[Proposal] = []
    qs: list[common_pb2.SparseQ] = []
    for call, o in zip(calls, outcomes, strict=True):
        r = response.results.add(session_id=call.input.session_id)
        if o.stale:
            r.status = common_pb2.SESSION_STATUS_NEEDS_HISTORY
            continue
        assert o.proposal is not None
        r.status = common_pb2.SESSION_STATUS_OK
        r.tokens.extend(o.proposal.tokens)
        proposals.append(o.proposal)
        qs.append(r.q)
    sparse_q.encode_into(proposals, qs)  # all sessions' q in one conversion
    return response


# -- client side ---------------------------------------------------------------------


def draft_session(x: DraftInput, drafter: DrafterKind) -> draft_pb2.DraftSession:
    return draft_pb2.DraftSession(
        session_id=x.session_id,
        start=x.start,
        new_tokens=x.new_tokens,
        k=x.k,
        sampling=common_wire.sampling_pb(x.params),
        round_index=x.round_index,
        drafter=common_wire.DRAFTER_ENUMS[drafter],
        min_confidence=x.min_confidence,
    )


def proposal(result: draft_pb2.DraftResult, k: int) -> Proposal | None:
    """A DraftResult -> its draft tokens, or None when the replica needs the full history.

    q stays in ``result`` and goes to the target as it came
    (:func:`specserve.target_service.common_wire.verify_session`), which validates them:
    turning them into tensors here and back into lists there would only cost time.
    """
    sid = result.session_id
    if result.status == common_pb2.SESSION_STATUS_NEEDS_HISTORY:
        return None
    if result.status != common_pb2.SESSION_STATUS_OK:
        raise InvalidArgument(f"session {sid!r}: the draft replica answered status {result.status}")
    if len(result.tokens) > k:
        raise InvalidArgument(
            f"session {sid!r}: asked for {k} draft tokens, got {len(result.tokens)}"
        )
    return Proposal(tokens=list(result.tokens))
