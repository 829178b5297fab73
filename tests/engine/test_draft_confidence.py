"""The adaptive policy's confidence cut: an adaptive session stops drafting past a
round's first draft where the draft's top probability is below the cut; a requested k is
drafted whole; the cut travels in DraftSession.min_confidence and is validated."""

from __future__ import annotations

import pytest

from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.drafter import DrafterKind, DraftInput
from specserve.engine.errors import InvalidArgument
from specserve.engine.k_policy import DRAFT_CONFIDENCE, KPolicy
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.sampling import SamplingParams
from specserve.v1 import draft_pb2
from specserve.wire import draft_wire
from specserve.wire.common_wire import SessionLimit
from tests.support.tiny import tiny_model

PROMPT = [5, 6, 7, 8, 9, 10]


def _drafts(drafter: ModelDrafter, sid: str, cut: float, k: int = 4) -> list[int]:
    x = DraftInput(sid, 0, PROMPT, k, SamplingParams(), 0, cut)
    out = drafter.propose([x])[0]
    assert out.proposal is not None
    return list(out.proposal.tokens)


def test_a_session_cut_keeps_the_first_draft_and_stops_the_rest() -> None:
    """A tiny random draft is never sure (top probability well below 0.99): with the cut
    it proposes its first draft only; without, all k; the replica's floor applies from
    the first draft on."""
    drafter = ModelDrafter(tiny_model(2), 8 << 20)
    full = _drafts(drafter, "a", 0.0)
    assert len(full) == 4
    assert _drafts(drafter, "b", 0.99) == full[:1]
    floor = ModelDrafter(tiny_model(2), 8 << 20, min_confidence=0.99)
    assert _drafts(floor, "c", 0.0) == []


def test_adaptive_sessions_send_the_cut_and_a_requested_k_sends_none() -> None:
    def state(k: int | None) -> DecodeState:
        return DecodeState("s", PROMPT, SamplingParams(), StopCriteria(8), KPolicy(k))

    assert state(None).draft_input(4).min_confidence == DRAFT_CONFIDENCE > 0
    assert state(4).draft_input(4).min_confidence == 0.0


def test_the_cut_crosses_the_wire_and_a_bad_one_is_refused() -> None:
    x = DraftInput("s", 0, PROMPT, 3, SamplingParams(), 2, 0.5)
    request = draft_pb2.ProposeRequest(sessions=[draft_wire.draft_session(x, DrafterKind.MODEL)])
    limit = SessionLimit(context=1024, kv_tokens=1024)
    (call,) = draft_wire.draft_calls(request, 256, limit)
    assert call.input.min_confidence == 0.5 and call.input.k == 3
    for bad in (1.0, -0.25, float("nan")):
        request.sessions[0].min_confidence = bad
        with pytest.raises(InvalidArgument, match="session 's': min_confidence must be in"):
            draft_wire.draft_calls(request, 256, limit)
