"""target.proto <-> engine types, both ends: the target servicer's and its callers'."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.engine.errors import InvalidArgument
from specserve.engine.kv_chunks import KvLayout
from specserve.engine.kv_transfer import ExportInput, ImportInput, KvChunk
from specserve.engine.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from specserve.engine.rejection import Proposal, Verdict
from specserve.engine.verifier import VerifyInput, VerifyOutcome
from specserve.policy.plain_steps import MAX_STEPS
from specserve.v1 import common_pb2, draft_pb2, target_pb2
from specserve.wire import common_wire, sparse_q

# -- server side ---------------------------------------------------------------------


def verify_inputs(
    request: target_pb2.VerifyRequest, vocab: int, limit: common_wire.SessionLimit
) -> list[VerifyInput]:
    """A VerifyRequest -> validated engine inputs (raises InvalidArgument)."""
    sessions = request.sessions
    ids = [s.session_id for s in sessions]
    common_wire.check_session_ids(ids)
    wire, news = [], []
    for s, sid in zip(sessions, ids, strict=True):
        new = list(s.new_tokens)
        if not new:
            raise InvalidArgument(
                f"session {sid!r}: new_tokens is empty; a verify needs at least one new "
                "committed token (the last round's recovered or bonus token, or the prompt)"
            )
        drafts = list(s.draft_tokens)
        steps = _steps(s, sid, drafts)
        limit.check(sid, s.start, len(new), len(drafts), steps)
        common_wire.check_tokens(drafts, vocab, "draft_tokens", sid)
        wire.append(sparse_q.WireQ.of(sid, drafts, s.q if s.HasField("q") else None))
        news.append(new)
    proposals = sparse_q.proposals(wire, vocab)
    out = []
    for s, sid, new, p in zip(sessions, ids, news, proposals, strict=True):
        common_wire.check_tokens(new, vocab, "new_tokens", sid)
        params = common_wire.sampling_params(s.sampling, sid)
        top = _top_logprobs(s, sid)
        out.append(
            VerifyInput(
                sid, s.start, new, p, params, s.round_index, s.return_logprobs, top, s.steps or 1
            )
        )
    return out


def _steps(s: target_pb2.VerifySession, sid: str, drafts: list[int]) -> int:
    """The session's plain decoding steps (0 reads as 1), checked."""
    steps = s.steps or 1
    if steps > MAX_STEPS:
        raise InvalidArgument(
            f"session {sid!r}: steps must be 0..{MAX_STEPS} (plain tokens decoded in one "
            f"call), got {steps}"
        )
    if steps > 1 and drafts:
        raise InvalidArgument(
            f"session {sid!r}: steps > 1 decodes without drafts, and this session sends "
            f"{len(drafts)} draft tokens; send either draft_tokens or steps"
        )
    return steps


def prefill_inputs(
    request: target_pb2.PrefillRequest, vocab: int, limit: common_wire.SessionLimit
) -> list[VerifyInput]:
    """A PrefillRequest -> verify inputs with start 0 and no drafts (replacing any cache)."""
    common_wire.check_session_ids([s.session_id for s in request.sessions])
    out = []
    for s in request.sessions:
        sid = s.session_id
        if not s.tokens:
            raise InvalidArgument(f"session {sid!r}: the prompt is empty; send at least one token")
        limit.check(sid, 0, len(s.tokens))
        tokens = common_wire.check_tokens(s.tokens, vocab, "tokens", sid)
        params = common_wire.sampling_params(s.sampling, sid)
        out.append(
            VerifyInput(
                sid,
                0,
                tokens,
                Proposal(tokens=[]),
                params,
                s.round_index,
                s.return_logprobs,
                _top_logprobs(s, sid),
            )
        )
    return out


def verify_response(
    outcomes: Sequence[VerifyOutcome], inputs: Sequence[VerifyInput]
) -> target_pb2.VerifyResponse:
    """Outcomes -> VerifyResponse (compute_ns, batch_size and replica_id set by the caller)."""
    response = target_pb2.VerifyResponse()
    for x, o in zip(inputs, outcomes, strict=True):
        r = response.results.add(session_id=x.session_id)
        if o.stale:
            r.status = common_pb2.SESSION_STATUS_NEEDS_HISTORY
            continue
        assert o.verdict is not None
        r.status = common_pb2.SESSION_STATUS_OK
        r.accepted = o.verdict.accepted
        r.next_token = o.verdict.next_token
        r.decoded.extend(o.verdict.decoded)
        r.logprobs.extend(o.logprobs)
        for t in o.token_logprobs:
            r.token_logprobs.add(
                logprob=t.logprob,
                top_ids=[i for i, _ in t.top],
                top_logprobs=[lp for _, lp in t.top],
            )
    return response


def _top_logprobs(s: target_pb2.VerifySession | target_pb2.PrefillSession, sid: str) -> int | None:
    """The alternatives asked for per emitted token; None = no TokenLogprobs."""
    if not s.HasField("top_logprobs"):
        return None
    if s.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument(
            f"session {sid!r}: top_logprobs must be 0..{MAX_TOP_LOGPROBS}, got {s.top_logprobs}"
        )
    return s.top_logprobs


def export_input(request: target_pb2.ExportKvRequest, vocab: int) -> ExportInput:
    """An ExportKvRequest -> engine input (chunk sizes and ranges are checked on the model
    thread, where the cache is)."""
    sid = request.session_id
    common_wire.check_session_ids([sid])
    tokens = common_wire.check_tokens(request.tokens, vocab, "tokens", sid)
    return ExportInput(sid, tokens, request.chunk_tokens, request.first_chunk)


def import_input(request: target_pb2.ImportKvRequest, vocab: int) -> ImportInput:
    """An ImportKvRequest -> engine input; the chunks' keys, fingerprints and sizes are
    checked by :meth:`~specserve.engine.kv_transfer.KvTransfer.import_`."""
    sid = request.session_id
    common_wire.check_session_ids([sid])
    tokens = common_wire.check_tokens(request.tokens, vocab, "tokens", sid)
    chunks = [kv_chunk(c, sid, i) for i, c in enumerate(request.chunks)]
    return ImportInput(sid, tokens, request.start, chunks)


def kv_chunk(pb: target_pb2.KvChunk, sid: str = "", index: int = 0) -> KvChunk:
    """KvChunk message -> engine chunk; InvalidArgument for an unknown dtype or bad sizes."""
    lay = pb.layout
    try:
        layout = KvLayout(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype)
    except InvalidArgument as e:
        raise InvalidArgument(f"session {sid!r}: chunk {index}: {e}") from None
    return KvChunk(pb.key, pb.fingerprint, layout, pb.start, pb.tokens, pb.data, pb.digest)


def kv_chunk_pb(chunk: KvChunk) -> target_pb2.KvChunk:
    """Engine chunk -> KvChunk message (what ExportKv answers and Redis stores)."""
    lay = chunk.layout
    return target_pb2.KvChunk(
        key=chunk.key,
        fingerprint=chunk.fingerprint,
        layout=target_pb2.KvLayout(
            num_layers=lay.num_layers,
            num_kv_heads=lay.num_kv_heads,
            head_dim=lay.head_dim,
            dtype=lay.dtype,
        ),
        start=chunk.start,
        tokens=chunk.tokens,
        data=chunk.data,
        digest=chunk.digest,
    )


# -- client side ---------------------------------------------------------------------


def verify_session(
    x: VerifyInput, draft: draft_pb2.DraftResult | None = None
) -> target_pb2.VerifySession:
    """A verify input -> VerifySession; q is copied from the draft's result as it came."""
    s = target_pb2.VerifySession(
        session_id=x.session_id,
        start=x.start,
        new_tokens=x.new_tokens,
        draft_tokens=x.proposal.tokens,
        sampling=common_wire.sampling_pb(x.params),
        round_index=x.round_index,
        return_logprobs=x.want_logprobs,
        top_logprobs=x.top_logprobs,
        steps=x.steps if x.steps > 1 else 0,
    )
    if draft is not None and draft.HasField("q"):
        s.q.CopyFrom(draft.q)  # as it came: the target validates it
    else:
        q = sparse_q.encode(x.proposal)
        if q is not None:
            s.q.CopyFrom(q)
    return s


def verdict(result: target_pb2.VerifyResult, drafted: int, steps: int = 1) -> Verdict | None:
    """A VerifyResult -> Verdict, or None when the replica needs the full history
    (``drafted`` drafts or ``steps`` plain steps were asked for)."""
    sid = result.session_id
    if result.status == common_pb2.SESSION_STATUS_NEEDS_HISTORY:
        return None
    if result.status != common_pb2.SESSION_STATUS_OK:
        raise InvalidArgument(f"session {sid!r}: the target answered status {result.status}")
    if result.accepted > drafted:
        raise InvalidArgument(
            f"session {sid!r}: the target accepted {result.accepted} of {drafted} draft tokens"
        )
    decoded = tuple(result.decoded)
    if len(decoded) > steps - 1 or (decoded and result.accepted):
        raise InvalidArgument(
            f"session {sid!r}: the target decoded {len(decoded)} tokens before the next one "
            f"(and accepted {result.accepted} drafts) for a call of {steps} step(s)"
        )
    return Verdict(accepted=result.accepted, next_token=result.next_token, decoded=decoded)


def token_logprobs(result: target_pb2.VerifyResult) -> list[TokenLogprob]:
    """A VerifyResult's TokenLogprobs (empty when none were asked for)."""
    return [
        TokenLogprob(t.logprob, tuple(zip(t.top_ids, t.top_logprobs, strict=True)))
        for t in result.token_logprobs
    ]
