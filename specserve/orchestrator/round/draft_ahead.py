"""Draft-ahead: draft round r + 1 while round r is verified, betting that all k are accepted.

A pure state machine: no grpc, no asyncio. The round runner asks :func:`place`
for a session's bet once its round-r proposal is known, sends the bet's
:class:`~specserve.engine.drafter.DraftInput` to the draft replica while the
target verifies, and at round r + 1 asks :func:`settle` whether the answer can
stand in for a fresh ``Propose``.

**The bet.** Round r proposes drafts d1..dk after the C committed tokens. The bet
asks the same draft replica for k' + 1 tokens after C + d1..dk, as if d1..dk were
committed: the first answer token g is the draft's guess of round r's bonus
token, the next k' are round r + 1's proposal. It is a **hit** when the target
accepted all k drafts and its bonus token equals g: the committed tokens are then
exactly the ones the bet assumed, so its k' tokens are what a ``Propose`` for
round r + 1 would draft, and round r + 1 verifies them at once — the draft
round trip is off the critical path. Otherwise it is a miss and the answer is
discarded.

**The draft replica's cache.** The bet says the draft holds C + k committed
tokens; its next call either confirms them (a hit: the call starts at C + k and
the cached guess and drafts are reused) or starts at C again with the real
tokens, and the drafter keeps only the cached tokens the real history confirms
and truncates the rest (see :class:`~specserve.engine.model_drafter.ModelDrafter`),
as it does for rejected drafts. The runner never has two calls for one session
in flight: it awaits a bet before the session's next ``Propose``.

**Only greedy sessions with the model drafter bet.** Greedy output is target
greedy decoding whatever the drafts are, so a hit cannot change it. A sampled
hit would draw the same (seed, round, position) uniforms as a fresh proposal,
but its q would be bit-identical only where the draft's forward is row-invariant
(a token fed alone vs. together with the next one): the engine's CPU kernels
are, the torch fallback is not, and a seeded request must give the same tokens
with draft-ahead on or off. The n-gram drafter answers in microseconds, so
betting would save little, and a miss makes it rebuild its index.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.engine.decode_state import DecodeState
from specserve.engine.drafter import MAX_K, DrafterKind, DraftInput
from specserve.engine.rejection import Proposal

DRAFTER = DrafterKind.MODEL  # the only drafter that bets


class Outcome(enum.StrEnum):
    """How a bet ended."""

    HIT = "hit"  # round r + 1 used the bet's drafts
    REJECTED = "rejected"  # the target did not accept all of round r's drafts
    GUESS = "guess"  # all accepted, but the target's next token was not the draft's guess
    LOST = "lost"  # no usable answer: the call failed, the session moved, or k fell to 0


@dataclass(frozen=True)
class Bet:
    """One session's draft-ahead in flight."""

    draft: str  # the draft replica asked
    base: int  # committed tokens when the bet was placed (C)
    drafts: tuple[int, ...]  # round r's proposal, assumed accepted (d1..dk)
    input: DraftInput  # the call: start at the drafter's position, k' + 1 tokens

    @property
    def draft_start(self) -> int:
        """Committed tokens the draft replica holds once it has answered (C + k)."""
        return self.input.committed_len


@dataclass(frozen=True)
class Settled:
    outcome: Outcome
    proposal: Proposal | None = None  # round r + 1's drafts, on a hit


def next_k_if_accepted(state: DecodeState, drafted: int, k_cap: int) -> int:
    """The k round r + 1 would ask for if all ``drafted`` tokens of round r are accepted."""
    policy = copy.copy(state.k_policy)  # scalars only: the session's own policy is untouched
    policy.observe(drafted, drafted)
    remaining = state.stop.max_new_tokens - len(state.completion) - drafted - 1
    return max(0, min(policy.next_k(k_cap), remaining - 1, MAX_K - 1))


def place(state: DecodeState, proposal: Proposal, draft: str | None, k_cap: int) -> Bet | None:
    """The bet for a session whose round r verifies ``proposal``; None when it should not bet."""
    if draft is None or state.drafter != DRAFTER or not state.params.greedy:
        return None
    drafts = tuple(proposal.tokens)
    if not drafts:
        return None
    k_next = next_k_if_accepted(state, len(drafts), k_cap)
    if k_next == 0:  # the session ends this round if all are accepted, or drafting stops
        return None
    start = state.draft_start
    x = DraftInput(
        state.session_id,
        start,
        [*state.tokens[start:], *drafts],
        k_next + 1,  # the guess of round r's bonus token, then round r + 1's drafts
        state.params,
        state.round_index + 1,
    )
    return Bet(draft, len(state.tokens), drafts, x)


def settle(
    bet: Bet, state: DecodeState, answer: Sequence[int] | None, draft: str | None, k: int
) -> Settled:
    """Whether a bet placed in round r gives round r + 1's proposal, now that r is committed.

    ``answer`` is the draft replica's tokens (None: the call failed or was stale),
    ``draft`` the session's draft replica now, ``k`` the drafts round r + 1 wants.
    """
    tokens = state.tokens
    assumed = bet.base + len(bet.drafts)
    if len(tokens) <= assumed or tuple(tokens[bet.base : assumed]) != bet.drafts:
        return Settled(Outcome.REJECTED)
    if not answer or draft != bet.draft or state.round_index != bet.input.round_index:
        return Settled(Outcome.LOST)
    if len(tokens) != assumed + 1 or tokens[assumed] != answer[0]:
        return Settled(Outcome.GUESS)
    drafts = list(answer[1 : 1 + k])
    if not drafts:
        return Settled(Outcome.LOST)
    return Settled(Outcome.HIT, Proposal(tokens=drafts))
