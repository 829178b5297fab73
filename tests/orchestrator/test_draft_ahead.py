"""Draft-ahead decisions (pure), and the draft model's cache under a bet (in process).

The decisions: who bets, what the bet asks the draft replica, and how it settles
(hit, rejected drafts, wrong guess of the bonus token, no usable answer). Then a
real :class:`ModelDrafter` driven round by round with bets interleaved, against
a second drafter that only ever gets plain proposals: every round's drafts —
from a hit or from a Propose after a miss — must be the plain drafter's, so the
speculative continuation leaves the cache exactly as rollback expects.
"""

from __future__ import annotations

import random

import pytest

from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.drafter import DraftInput
from specserve.engine.k_policy import KPolicy
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.rejection import Proposal, Verdict
from specserve.engine.sampling import SamplingParams
from specserve.engine.tiny import tiny_from_spec
from specserve.engine.verifier import TargetVerifier
from specserve.orchestrator.round.draft_ahead import (
    Outcome,
    next_k_if_accepted,
    place,
    settle,
)

PROMPT = [11, 12, 13, 14, 15]
D = "d:1"


def session(
    *,
    k: int | None = 4,
    max_new_tokens: int = 64,
    params: SamplingParams | None = None,
    drafter: str = "model",
) -> DecodeState:
    s = DecodeState(
        "s",
        PROMPT,
        params or SamplingParams(),
        StopCriteria(max_new_tokens),
        KPolicy(k),
        drafter=drafter,
    )
    s.note_draft_synced()  # as after round 0's Propose
    return s


def test_a_bet_asks_for_the_guess_and_the_next_round() -> None:
    s = session()
    bet = place(s, Proposal(tokens=[7, 8, 9, 10]), D, k_cap=8)
    assert bet is not None
    x = bet.input
    assert (x.session_id, x.start, list(x.new_tokens)) == ("s", 5, [7, 8, 9, 10])
    assert x.k == 4 + 1  # the guess, then round 1's four drafts
    assert x.round_index == 1 and x.params == s.params
    assert (bet.base, bet.drafts, bet.draft, bet.draft_start) == (5, (7, 8, 9, 10), D, 9)


def test_the_bet_starts_where_the_draft_replica_is() -> None:
    s = session()
    s.commit(Proposal(tokens=[7, 8]), Verdict(accepted=2, next_token=9))
    s.draft_start = 7  # a hit: the replica holds the two drafts, not the bonus token
    bet = place(s, Proposal(tokens=[1, 2]), D, k_cap=8)
    assert bet is not None
    assert (bet.input.start, list(bet.input.new_tokens)) == (7, [9, 1, 2])
    assert bet.base == 8 and bet.draft_start == 10 and bet.input.round_index == 2


@pytest.mark.parametrize(
    ("why", "kwargs", "draft", "tokens"),
    [
        ("sampled", {"params": SamplingParams(temperature=0.7, seed=1)}, D, [7, 8]),
        ("n-gram drafter", {"drafter": "ngram"}, D, [7, 8]),
        ("no draft replica", {}, None, [7, 8]),
        ("nothing drafted", {}, D, []),
        ("ends this round if all are accepted", {"max_new_tokens": 3}, D, [7, 8]),
        ("one token left after this round", {"max_new_tokens": 4}, D, [7, 8]),
    ],
)
def test_who_does_not_bet(
    why: str, kwargs: dict[str, object], draft: str | None, tokens: list[int]
) -> None:
    s = session(**kwargs)  # type: ignore[arg-type]
    assert place(s, Proposal(tokens=tokens), draft, k_cap=8) is None, why


def test_the_next_k_assumes_acceptance_and_respects_caps() -> None:
    s = session(k=None, max_new_tokens=64)  # adaptive
    alpha = s.k_policy.alpha
    now = s.k_policy.plan(8)
    assert next_k_if_accepted(s, 3, k_cap=8) > now  # all accepted: alpha rises, and k with it
    assert s.k_policy.alpha == alpha  # the session's own policy is untouched
    assert next_k_if_accepted(s, 3, k_cap=2) == 2
    assert place(s, Proposal(tokens=[7, 8, 9]), D, k_cap=0) is None  # the load cap is 0
    # 64 - 3 drafts - 1 bonus = 60 left after this round; close to the end k shrinks.
    short = session(k=8, max_new_tokens=7)
    assert next_k_if_accepted(short, 3, k_cap=8) == 2  # 3 left: 2 drafts + 1 next token
    bet = place(short, Proposal(tokens=[7, 8, 9]), D, k_cap=8)
    assert bet is not None and bet.input.k == 3
    big = session()
    big.k_policy = KPolicy(16, k_max=16)
    assert next_k_if_accepted(big, 4, k_cap=16) == 15  # k' + 1 fits one Propose


def test_settle() -> None:
    def after(accepted: int, next_token: int) -> tuple[DecodeState, object]:
        s = session()
        bet = place(s, Proposal(tokens=[7, 8, 9]), D, k_cap=8)
        assert bet is not None
        s.commit(Proposal(tokens=[7, 8, 9]), Verdict(accepted, next_token))
        return s, bet

    s, bet = after(3, 40)
    hit = settle(bet, s, [40, 41, 42, 43, 44], D, 4)  # type: ignore[arg-type]
    assert hit.outcome is Outcome.HIT and hit.proposal is not None
    assert list(hit.proposal.tokens) == [41, 42, 43, 44]
    short = settle(bet, s, [40, 41, 42, 43, 44], D, 2)  # type: ignore[arg-type]
    assert short.proposal is not None and list(short.proposal.tokens) == [41, 42]
    assert settle(bet, s, [40, 41], D, 4).proposal.tokens == [41]  # type: ignore[arg-type,union-attr]
    assert settle(bet, s, [39, 41, 42], D, 4).outcome is Outcome.GUESS  # type: ignore[arg-type]
    for answer, draft, k in [(None, D, 4), ([40], D, 4), ([40, 41], "d:2", 4), ([40, 41], D, 0)]:
        got = settle(bet, s, answer, draft, k)  # type: ignore[arg-type]
        assert got.outcome is Outcome.LOST and got.proposal is None
    for accepted in (0, 2):
        s, bet = after(accepted, 50)
        assert settle(bet, s, [50, 1, 2], D, 4).outcome is Outcome.REJECTED  # type: ignore[arg-type]


def test_the_draft_cache_under_bets_matches_plain_proposals() -> None:
    """Greedy rounds with a bet on every round: hits and misses both give plain drafts."""
    budget = 8 << 20
    target = TargetVerifier(tiny_from_spec("tiny:3"), budget)
    draft_model = tiny_from_spec("tiny:3:noise=0.05")
    betting, plain = ModelDrafter(draft_model, budget), ModelDrafter(draft_model, budget)
    rng = random.Random(5)
    outcomes: list[Outcome] = []
    for n in range(4):
        prompt = [rng.randrange(256) for _ in range(10)]
        s = DecodeState(f"s{n}", prompt, SamplingParams(), StopCriteria(60), KPolicy(None))
        plain_start = 0
        pending = None  # (bet, answer)
        while not s.finished:
            k = s.next_k(8)
            x_plain = DraftInput(s.session_id, plain_start, s.tokens[plain_start:], k, s.params, 0)
            (expected,) = plain.propose([x_plain])
            plain_start = len(s.tokens)
            assert expected.proposal is not None
            proposal = None
            if pending is not None:
                bet, answer = pending
                settled = settle(bet, s, answer, D, k)
                outcomes.append(settled.outcome)
                if settled.proposal is not None:
                    proposal = settled.proposal
                    s.draft_start = bet.draft_start
            if proposal is None:
                (o,) = betting.propose([s.draft_input(k)])
                assert o.proposal is not None
                proposal = o.proposal
                s.note_draft_synced()
            assert list(proposal.tokens) == list(expected.proposal.tokens)
            bet = place(s, proposal, D, k_cap=8)
            pending = None
            if bet is not None:
                (a,) = betting.propose([bet.input])
                assert a.proposal is not None
                pending = (bet, list(a.proposal.tokens))
            (v,) = target.verify([s.verify_input(proposal)])
            assert v.verdict is not None
            s.commit(proposal, v.verdict)
        target.release(s.session_id)
    assert outcomes.count(Outcome.HIT) > 0
    assert outcomes.count(Outcome.REJECTED) + outcomes.count(Outcome.GUESS) > 0
