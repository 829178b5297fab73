"""A multi-step plain verdict commits as that many one-step plain rounds (pure)."""

from __future__ import annotations

from specserve.engine.decode_state import DecodeState, FinishReason, StopCriteria
from specserve.engine.rejection import Proposal, Verdict
from specserve.engine.sampling import SamplingParams
from specserve.policy.k_policy import KPolicy


def state(max_new_tokens: int = 64, eos: frozenset[int] = frozenset()) -> DecodeState:
    stop = StopCriteria(max_new_tokens, eos_ids=eos)
    return DecodeState("s", [1, 2, 3], SamplingParams(), stop, KPolicy(0), drafter="none")


def test_a_four_step_verdict_commits_as_four_plain_rounds() -> None:
    stepped, single = state(), state()
    kept = stepped.commit(Proposal([]), Verdict(0, 13, decoded=(10, 11, 12)))
    for t in (10, 11, 12, 13):
        single.commit(Proposal([]), Verdict(0, t))
    assert kept == [10, 11, 12, 13]
    assert stepped.tokens == single.tokens
    assert stepped.round_index == single.round_index == 4  # the next draws follow on
    assert stepped.target_start == single.target_start == 6  # 13 is the next call's news
    assert stepped.stats.rounds == single.stats.rounds == 4
    assert stepped.verify_input(Proposal([]), steps=4).steps == 4


def test_the_steps_past_eos_or_max_tokens_are_dropped() -> None:
    at_eos = state(eos=frozenset({11}))
    assert at_eos.commit(Proposal([]), Verdict(0, 13, decoded=(10, 11, 12))) == [10, 11]
    assert at_eos.finish_reason is FinishReason.EOS
    short = state(max_new_tokens=2)
    assert short.commit(Proposal([]), Verdict(0, 13, decoded=(10, 11, 12))) == [10, 11]
    assert short.finish_reason is FinishReason.LENGTH
