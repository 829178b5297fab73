"""The single-process speculative loop: draft -> verify -> accept -> commit.

Every round, for all unfinished sessions at once:

1. each drafter proposes k tokens for its sessions (one batched call per drafter);
2. the target verifies every session's committed delta + drafts in one forward;
3. the acceptance rule keeps a prefix of the drafts and adds the recovered or
   bonus token; both caches roll back to what was committed;
4. :meth:`DecodeState.commit` appends the tokens and applies the stop rules.

k = 0 (drafter ``none``, or an adaptive k that found drafting unprofitable) is
plain target-only decoding through the same code. The distributed orchestrator
runs the same round over gRPC.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from specserve.engine.decode_state import DecodeState
from specserve.engine.drafter import Drafter, DrafterKind
from specserve.engine.errors import InvalidArgument
from specserve.engine.rejection import Proposal
from specserve.engine.verifier import TargetVerifier
from specserve.policy.round_cost import RoundCosts


@dataclass
class Timing:
    """Wall time of the round phases, summed over rounds."""

    draft_s: float = 0.0
    verify_s: float = 0.0
    rounds: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def draft_share(self) -> float:
        total = self.draft_s + self.verify_s
        return self.draft_s / total if total else 0.0


class SpeculativeEngine:
    """Runs rounds for a set of :class:`DecodeState` sessions in this process."""

    def __init__(
        self,
        verifier: TargetVerifier,
        drafters: Mapping[DrafterKind, Drafter],
        *,
        costs: RoundCosts | None = None,
    ) -> None:
        """``costs``: measure a lone session's decode rounds and plan adaptive k with the
        costs they imply (:mod:`specserve.policy.round_cost`); None keeps the policies'
        static costs (the k chosen then depends on acceptance alone, not on timing)."""
        self.verifier = verifier
        self.drafters = dict(drafters)
        self.timing = Timing()
        self.costs = costs

    def run(
        self,
        states: Sequence[DecodeState],
        on_tokens: Callable[[DecodeState, list[int]], None] | None = None,
    ) -> None:
        """Decode every session until it finishes; ``on_tokens`` sees each round's tokens."""
        for s in states:
            if s.drafter != DrafterKind.NONE and s.drafter not in self.drafters:
                known = ", ".join(sorted([*self.drafters, DrafterKind.NONE]))
                raise InvalidArgument(
                    f"drafter {s.drafter.value!r} is not loaded; available: {known}"
                )
        active = [s for s in states if not s.finished]
        while active:
            for s, tokens in self.round(active):
                if on_tokens is not None:
                    on_tokens(s, tokens)
            active = [s for s in active if not s.finished]
        for s in states:
            self.release(s)

    def release(self, state: DecodeState) -> None:
        self.verifier.release(state.session_id)
        for d in self.drafters.values():
            d.release(state.session_id)

    def round(self, states: Sequence[DecodeState]) -> list[tuple[DecodeState, list[int]]]:
        """One round for every session in ``states``; returns the tokens each added."""
        timed = self.costs is not None and len(states) == 1 and _decoding(states[0])
        if self.costs is not None:
            measured = self.costs.model()
            for s in states:
                s.k_policy.measured(measured)
        t0 = time.perf_counter()
        proposals, reread = self._propose(states)
        t1 = time.perf_counter()
        outcomes = self.verifier.verify(
            [s.verify_input(p) for s, p in zip(states, proposals, strict=True)]
        )
        stale = [i for i, o in enumerate(outcomes) if o.stale]
        timed = timed and not stale and not reread
        if stale:  # the target lost these caches: resend the whole history
            again = self.verifier.verify(
                [states[i].verify_input(proposals[i], full=True) for i in stale]
            )
            for i, o in zip(stale, again, strict=True):
                outcomes[i] = o
        t2 = time.perf_counter()
        self.timing.draft_s += t1 - t0
        self.timing.verify_s += t2 - t1
        self.timing.rounds += 1
        self.timing.batch_sizes.append(len(states))
        if timed and self.costs is not None:
            k = len(proposals[0].tokens)
            # A drafting round after plain ones also catches the draft up on their tokens:
            # not a drafting round's cost (it would read as a fixed cost of drafting).
            if k == 0 or states[0].last_drafted > 0:
                self.costs.observe(1, k, k, t2 - t0)
        out = []
        for s, p, o in zip(states, proposals, outcomes, strict=True):
            assert o.verdict is not None, "a full-history verify cannot be stale"
            out.append((s, s.commit(p, o.verdict)))
        return out

    def _propose(self, states: Sequence[DecodeState]) -> tuple[list[Proposal], bool]:
        """Each session's drafts, and whether a drafter re-read a session's whole history
        to draft for it (such a round is not a decode step to time)."""
        reread = False
        proposals: list[Proposal] = [Proposal(tokens=[])] * len(states)
        groups: dict[DrafterKind, list[int]] = {}
        for i, s in enumerate(states):
            if s.drafter != DrafterKind.NONE:
                groups.setdefault(s.drafter, []).append(i)
        for name, idx in groups.items():
            drafter = self.drafters[name]
            ks = {i: states[i].next_k() for i in idx}
            outcomes = drafter.propose([states[i].draft_input(ks[i]) for i in idx])
            stale = [i for i, o in zip(idx, outcomes, strict=True) if o.stale]
            if stale:
                # A drafter that lost a session re-reads its whole history (a forward
                # only where it then drafts).
                reread = reread or any(ks[i] for i in stale)
                again = drafter.propose([states[i].draft_input(ks[i], full=True) for i in stale])
                fixed = dict(zip(stale, again, strict=True))
                outcomes = [fixed.get(i, o) for i, o in zip(idx, outcomes, strict=True)]
            for i, o in zip(idx, outcomes, strict=True):
                assert o.proposal is not None, "a full-history draft cannot be stale"
                proposals[i] = o.proposal
                states[i].note_draft_synced()
        return proposals, reread


def _decoding(s: DecodeState) -> bool:
    """Whether a round of ``s`` now is a plain decode step: the target gets one new
    token (not a prompt) and the draft catches up at most a round's tokens (not its
    prefill)."""
    if len(s.tokens) - s.target_start != 1:
        return False
    if s.drafter == DrafterKind.NONE:
        return True
    return s.draft_start > 0 and len(s.tokens) - s.draft_start <= s.k_policy.k_max + 1
