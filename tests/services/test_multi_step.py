"""Multi-step plain decoding on the target: n steps in one call equal n one-step calls.

The target backend runs a session's ``steps`` as one batched verify per step
(:mod:`specserve.target_service.multi_step`); each step draws as the one-step round
``round_index + j`` would, so greedy, coupled and rejection-rule sampling all give the
tokens n one-step verifies give, and the cache ends where theirs would.
"""

from __future__ import annotations

import pytest

from specserve.engine.errors import InvalidArgument, KVBudgetExceeded
from specserve.engine.rejection import Proposal, Verdict
from specserve.engine.sampling import SamplingParams, SamplingRule
from specserve.engine.tiny import tiny_from_spec
from specserve.engine.verifier import TargetVerifier, VerifyInput
from specserve.target_service.backend import TargetBackend
from specserve.v1 import common_pb2, target_pb2
from specserve.wire import target_wire
from specserve.wire.common_wire import SessionLimit

BUDGET = 8 << 20
PROMPTS = {"a": [5, 17, 99, 3, 42], "b": [7, 7, 200, 31]}
PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.9, seed=11, rule=SamplingRule.COUPLED),
    SamplingParams(temperature=0.9, top_p=0.95, seed=12, rule=SamplingRule.REJECTION),
]


def backend() -> TargetBackend:
    verifier = TargetVerifier(tiny_from_spec("tiny:3"), BUDGET)
    return TargetBackend(verifier, model_name="tiny:3", dtype="float32")


def one_step_tokens(params: SamplingParams, sid: str, n: int, round_index: int) -> list[int]:
    """n plain verifies of one call each, the way one-step rounds send them."""
    b = backend()
    prompt = PROMPTS[sid]
    start, new, out = 0, list(prompt), []
    for j in range(n):
        x = VerifyInput(sid, start, new, Proposal([]), params, round_index + j, True)
        (o,) = b.verify([[x]])[0].outcomes
        assert o.verdict is not None
        out.append(o.verdict.next_token)
        start, new = start + len(new), [o.verdict.next_token]
    return out


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "coupled", "rejection"])
def test_n_steps_in_one_call_give_the_tokens_of_n_one_step_calls(params: SamplingParams) -> None:
    b = backend()
    inputs = [
        VerifyInput("a", 0, PROMPTS["a"], Proposal([]), params, 4, True, 2, steps=6),
        VerifyInput("b", 0, PROMPTS["b"], Proposal([]), params, 9, True, None, steps=3),
    ]
    a, bb = b.verify([inputs])[0].outcomes
    assert a.verdict is not None and bb.verdict is not None
    assert [*a.verdict.decoded, a.verdict.next_token] == one_step_tokens(params, "a", 6, 4)
    assert [*bb.verdict.decoded, bb.verdict.next_token] == one_step_tokens(params, "b", 3, 9)
    assert a.verdict.accepted == 0 and len(a.logprobs) == 6 and len(a.token_logprobs) == 6
    assert len(bb.logprobs) == 3 and bb.token_logprobs == ()
    # The cache holds the prompt and every decoded token but the last (the next call's).
    kv = b.verifier.kv  # type: ignore[attr-defined]
    assert kv.length("a") == len(PROMPTS["a"]) + 5
    assert kv.length("b") == len(PROMPTS["b"]) + 2


def test_a_step_that_runs_out_of_kv_keeps_what_was_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    b = backend()
    verifier = b.verifier
    real = verifier.verify
    calls = []

    def verify_until_the_third(inputs: list[VerifyInput]) -> list[object]:
        calls.append(len(inputs))
        if len(calls) == 3:
            raise KVBudgetExceeded("no free KV blocks")
        return real(inputs)  # type: ignore[return-value]

    monkeypatch.setattr(verifier, "verify", verify_until_the_third)
    x = VerifyInput("a", 0, PROMPTS["a"], Proposal([]), SamplingParams(), 0, steps=8)
    (o,) = b.verify([[x]])[0].outcomes
    assert o.verdict is not None and len(o.verdict.decoded) == 1  # steps 0 and 1 ran
    assert [*o.verdict.decoded, o.verdict.next_token] == one_step_tokens(
        SamplingParams(), "a", 2, 0
    )


def test_steps_with_drafts_or_past_the_most_are_refused() -> None:
    def session(**fields: object) -> target_pb2.VerifyRequest:
        s = target_pb2.VerifySession(session_id="a", new_tokens=[1, 2], **fields)  # type: ignore[arg-type]
        return target_pb2.VerifyRequest(sessions=[s])

    limit = SessionLimit(4096, 4096)
    with pytest.raises(InvalidArgument, match="either draft_tokens or steps"):
        target_wire.verify_inputs(session(draft_tokens=[3], steps=4), 256, limit)
    with pytest.raises(InvalidArgument, match=r"steps must be 0\.\.64"):
        target_wire.verify_inputs(session(steps=65), 256, limit)
    with pytest.raises(InvalidArgument, match="63 more steps"):  # the steps count too
        target_wire.verify_inputs(session(steps=64), 256, SessionLimit(32, 4096))
    (x,) = target_wire.verify_inputs(session(steps=5), 256, limit)
    assert x.steps == 5
    (x,) = target_wire.verify_inputs(session(), 256, limit)
    assert x.steps == 1


def test_a_verdict_with_more_decoded_tokens_than_steps_is_refused() -> None:
    ok = target_pb2.VerifyResult(
        session_id="a", status=common_pb2.SESSION_STATUS_OK, next_token=9, decoded=[4, 5]
    )
    assert target_wire.verdict(ok, 0, 3) == Verdict(0, 9, (4, 5))
    with pytest.raises(InvalidArgument, match="decoded 2 tokens"):
        target_wire.verdict(ok, 0, 2)
    drafted = target_pb2.VerifyResult(
        session_id="a", status=common_pb2.SESSION_STATUS_OK, accepted=1, decoded=[4]
    )
    with pytest.raises(InvalidArgument, match="decoded 1 tokens"):
        target_wire.verdict(drafted, 2, 2)
