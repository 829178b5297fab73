"""The adaptive policy's depth floor: an adaptive session stops drafting after the draft
at which the product of its round's top probabilities falls below the floor (that draft
still proposed); a requested k is drafted whole; the floor travels in
DraftSession.min_confidence and is validated; a replica's own floor drops a draft below
it from the first draft on."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.drafter import DrafterKind, DraftInput
from specserve.engine.errors import InvalidArgument
from specserve.engine.model import SeqInput
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.sampling import SamplingParams
from specserve.policy.k_policy import KPolicy
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


def _top_probabilities(drafter: ModelDrafter, drafts: list[int]) -> list[float]:
    """The draft's top probability at each of ``drafts``' positions, teacher-forced."""
    tokens = PROMPT + drafts
    kv = drafter.model.new_kv_pool(8 << 20)
    kv.reserve({"t": len(tokens)})
    with torch.inference_mode():
        logits = drafter.model([SeqInput("t", tokens, num_logits=len(tokens))], kv)
    top = torch.softmax(logits, dim=-1).amax(dim=-1).tolist()
    return top[len(PROMPT) - 1 : len(tokens) - 1]


def test_a_session_floor_stops_after_the_draft_whose_product_falls_below_it() -> None:
    """With a floor between the product of the first two drafts' top probabilities and
    that of the first three, a round proposes three drafts (the third is the one that
    crossed it), the same three it drafts without a floor; a floor above any product
    keeps the first draft only; the replica's floor drops drafts from the first on."""
    drafter = ModelDrafter(tiny_model(2), 8 << 20)
    full = _drafts(drafter, "a", 0.0)
    assert len(full) == 4
    q1, q2, q3, _ = _top_probabilities(drafter, full)
    floor = (q1 * q2 + q1 * q2 * q3) / 2
    assert _drafts(drafter, "b", floor) == full[:3]
    assert _drafts(drafter, "c", 0.99) == full[:1]  # a tiny random draft is never sure
    strict = ModelDrafter(tiny_model(2), 8 << 20, min_confidence=0.99)
    assert _drafts(strict, "d", 0.0) == []


def test_adaptive_sessions_send_their_depth_floor_and_a_requested_k_sends_none() -> None:
    def state(k: int | None) -> DecodeState:
        return DecodeState("s", PROMPT, SamplingParams(), StopCriteria(8), KPolicy(k))

    adaptive = state(None)
    assert adaptive.draft_input(4).min_confidence == adaptive.k_policy.depth_floor() > 0
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
