"""Drafting ahead in the model drafter: ahead drafts are exactly fresh drafting's, or unused.

Each test drafts for a history, lets the drafter draft ahead in idle steps, then asks
for the next round's drafts and compares them with a fresh drafter's on the same
history (tokens, and q for the rejection rule), counting the draft model's forwards.
"""

from __future__ import annotations

import random

import pytest
import torch

from specserve.engine.draft_ahead import AHEAD_MAX_SESSIONS
from specserve.engine.drafter import DraftInput
from specserve.engine.model import CausalLM
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.rejection import Proposal
from specserve.engine.sampling import SamplingParams, SamplingRule
from tests.support.tiny import tiny_model

BUDGET = 8 << 20
K = 4
PARAMS = {
    "greedy": SamplingParams(),
    "coupled": SamplingParams(temperature=0.8, seed=7, rule=SamplingRule.COUPLED),
    "rejection": SamplingParams(temperature=0.8, seed=7, rule=SamplingRule.REJECTION),
}


class Counted:
    """Counts the forwards of a model (each batched call is one)."""

    def __init__(self, model: CausalLM) -> None:
        self.n = 0
        model.register_forward_pre_hook(lambda module, args: self._count())

    def _count(self) -> None:
        self.n += 1


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return tiny_model(5)


def prompt(seed: int = 0, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def draft(
    d: ModelDrafter,
    history: list[int],
    params: SamplingParams,
    round_index: int,
    *,
    start: int = 0,
    k: int = K,
    sid: str = "s",
) -> Proposal:
    x = DraftInput(sid, start, history[start:], k, params, round_index)
    out = d.propose([x])[0]
    assert out.proposal is not None
    return out.proposal


def fresh(
    model: CausalLM, history: list[int], params: SamplingParams, round_index: int
) -> Proposal:
    return draft(ModelDrafter(model, BUDGET), history, params, round_index)


def bonus_guess(model: CausalLM, history: list[int], params: SamplingParams) -> int:
    """What the drafter guesses the target's bonus after ``history`` is: its argmax, or
    its coupled draw where the session samples with the coupled rule."""
    guess_params = params if params.coupled else SamplingParams()
    return draft(ModelDrafter(model, BUDGET), history, guess_params, 0, k=1).tokens[0]


def idle(d: ModelDrafter, limit: int = 50) -> int:
    """Idle steps until the drafter has no ahead work; how many did work."""
    steps = 0
    while d.idle_step():
        steps += 1
        assert steps < limit
    return steps


def assert_same(got: Proposal, want: Proposal) -> None:
    assert got.tokens == want.tokens
    assert (got.q_ids is None) == (want.q_ids is None)
    if got.q_ids is not None and want.q_ids is not None:
        assert torch.equal(got.q_ids, want.q_ids)
        assert got.q_probs is not None and want.q_probs is not None
        assert torch.allclose(got.q_probs, want.q_probs, atol=1e-6)


@pytest.mark.parametrize("mode", PARAMS)
def test_ahead_drafts_answer_the_next_round_with_no_forward(model: CausalLM, mode: str) -> None:
    params = PARAMS[mode]
    d = ModelDrafter(model, BUDGET, draft_ahead=K + 1)
    forwards = Counted(model)
    history = prompt()
    first = draft(d, history, params, 0)
    assert len(first.tokens) == K
    assert idle(d) == K + 1  # one forward per ahead token: the guess and K drafts
    assert d.ahead_counts.snapshot()[:2] == (K + 1, K + 1)
    nxt = history + first.tokens + [bonus_guess(model, history + first.tokens, params)]
    before = forwards.n
    got = draft(d, nxt, params, 1, start=len(history))
    assert forwards.n == before  # answered from the ahead drafts
    assert d.ahead_counts.snapshot()[2:] == (1, K)
    assert_same(got, fresh(model, nxt, params, 1))
    # The session goes on as after fresh drafting: the round after it matches too.
    later = nxt + got.tokens[:2] + [123]
    assert_same(draft(d, later, params, 2, start=len(history)), fresh(model, later, params, 2))


@pytest.mark.parametrize("mode", PARAMS)
def test_fewer_ahead_drafts_than_k_are_completed_by_drafting(model: CausalLM, mode: str) -> None:
    params = PARAMS[mode]
    d = ModelDrafter(model, BUDGET, draft_ahead=3)  # the guess and two drafts
    forwards = Counted(model)
    history = prompt(1)
    first = draft(d, history, params, 0)
    assert idle(d) == 3
    nxt = history + first.tokens + [bonus_guess(model, history + first.tokens, params)]
    before = forwards.n
    got = draft(d, nxt, params, 1, start=len(history))
    assert forwards.n - before == K - 2  # one per draft not drafted ahead
    assert d.ahead_counts.snapshot()[2:] == (1, 2)
    assert_same(got, fresh(model, nxt, params, 1))


@pytest.mark.parametrize("mode", PARAMS)
@pytest.mark.parametrize("case", ["rejected-draft", "other-bonus"])
def test_a_mismatch_falls_back_to_drafting(model: CausalLM, mode: str, case: str) -> None:
    params = PARAMS[mode]
    d = ModelDrafter(model, BUDGET, draft_ahead=K + 1)
    history = prompt(2)
    first = draft(d, history, params, 0)
    idle(d)
    guess = bonus_guess(model, history + first.tokens, params)
    if case == "rejected-draft":
        nxt = history + first.tokens[:1] + [(first.tokens[1] + 1) % 256]
    else:
        nxt = history + first.tokens + [(guess + 1) % 256]
    got = draft(d, nxt, params, 1, start=len(history))
    assert d.ahead_counts.snapshot()[2:] == (0, 0)
    assert_same(got, fresh(model, nxt, params, 1))


def test_sampled_ahead_drafts_are_unused_under_another_round_index(model: CausalLM) -> None:
    params = PARAMS["rejection"]
    d = ModelDrafter(model, BUDGET, draft_ahead=K + 1)
    history = prompt(3)
    first = draft(d, history, params, 0)
    idle(d)
    nxt = history + first.tokens + [bonus_guess(model, history + first.tokens, params)]
    got = draft(d, nxt, params, 5, start=len(history))  # drawn for round 1, asked for 5
    assert d.ahead_counts.snapshot()[2:] == (0, 0)
    assert_same(got, fresh(model, nxt, params, 5))
    assert got.tokens != fresh(model, nxt, params, 1).tokens  # the round index mattered


def test_other_sampling_params_do_not_use_ahead_drafts(model: CausalLM) -> None:
    d = ModelDrafter(model, BUDGET, draft_ahead=K + 1)
    history = prompt(4)
    first = draft(d, history, PARAMS["greedy"], 0)
    idle(d)
    nxt = history + first.tokens + [bonus_guess(model, history + first.tokens, PARAMS["greedy"])]
    got = draft(d, nxt, PARAMS["coupled"], 1, start=len(history))
    assert d.ahead_counts.snapshot()[2:] == (0, 0)
    assert_same(got, fresh(model, nxt, PARAMS["coupled"], 1))


def test_ahead_drafting_never_evicts_a_session(model: CausalLM) -> None:
    probe = ModelDrafter(model, BUDGET)
    per_block = probe.kv_stats().bytes_per_block
    block = probe.kv.block_size
    d = ModelDrafter(model, 2 * per_block, draft_ahead=K + 1)  # two blocks in all
    for sid in ("a", "b"):  # each fills its block but for one position
        draft(d, prompt(5)[:1] * (block - 1), PARAMS["greedy"], 0, k=1, sid=sid)
    assert d.kv_stats().blocks_used == 2
    assert idle(d) == 1  # a token each fits; the next would need a third block
    assert "a" in d.kv and "b" in d.kv and d.sessions() == 2


def test_release_drops_ahead_work_and_off_means_none(model: CausalLM) -> None:
    d = ModelDrafter(model, BUDGET, draft_ahead=K + 1)
    draft(d, prompt(6), PARAMS["greedy"], 0)
    assert d.release("s")
    assert not d.idle_step()
    off = ModelDrafter(model, BUDGET)
    draft(off, prompt(6), PARAMS["greedy"], 0)
    assert not off.idle_step()
    with pytest.raises(ValueError, match="draft_ahead"):
        ModelDrafter(model, BUDGET, draft_ahead=-1)


def test_only_a_batch_of_few_sessions_drafts_ahead(model: CausalLM) -> None:
    """A wider batch skips a forward only if every session's guess was right: it does not
    draft ahead (AHEAD_MAX_SESSIONS)."""
    for sessions, ahead in ((AHEAD_MAX_SESSIONS, True), (AHEAD_MAX_SESSIONS + 1, False)):
        d = ModelDrafter(model, BUDGET, draft_ahead=K + 1)
        batch = [
            DraftInput(f"s{i}", 0, prompt(10 + i), K, PARAMS["greedy"], 0) for i in range(sessions)
        ]
        assert all(o.proposal is not None for o in d.propose(batch))
        assert d.idle_step() is ahead
