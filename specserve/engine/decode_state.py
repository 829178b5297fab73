"""Per-session decoding state: committed tokens, what each side has seen, stopping.

A pure state machine shared by the local loop and the orchestrator. One round is
``draft_input`` -> (drafter) -> ``verify_input`` -> (target) -> ``commit``.
``commit`` appends the accepted drafts and the next token (recovered or bonus),
applies EOS / stop strings / max_new_tokens, and feeds the k policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from specserve.engine.drafter import DrafterKind, DraftInput
from specserve.engine.errors import InvalidArgument
from specserve.engine.rejection import Proposal, Verdict
from specserve.engine.sampling import SamplingParams
from specserve.engine.verifier import VerifyInput
from specserve.policy.k_policy import KPolicy, expected_tokens

MAX_STOP_STRINGS = 16


class FinishReason(StrEnum):
    LENGTH = "length"  # max_new_tokens reached
    EOS = "eos"  # the model emitted an end-of-sequence token
    STOP = "stop"  # a stop string appeared
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class StopCriteria:
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(not s for s in self.stop_strings):
            raise InvalidArgument("stop strings must not be empty")


@dataclass
class SessionStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # rounds whose drafts were not all accepted (a failed trial each)
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0


class DecodeState:
    """One session being decoded."""

    def __init__(
        self,
        session_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        stop: StopCriteria,
        k_policy: KPolicy,
        *,
        drafter: DrafterKind | str = DrafterKind.MODEL,
        decode: Callable[[Sequence[int]], str] | None = None,
        round_index: int = 0,
    ) -> None:
        if not prompt:
            raise InvalidArgument("the prompt is empty: give at least one token")
        if stop.stop_strings and decode is None:
            raise InvalidArgument("stop strings need a tokenizer to decode with")
        self.session_id = session_id
        self.tokens: list[int] = list(prompt)
        self.prompt_len = len(prompt)
        self.params = params
        self.stop = stop
        self.k_policy = k_policy
        self.drafter = DrafterKind.parse(drafter)
        self.decode = decode
        self.round_index = round_index
        self.draft_start = 0  # committed tokens the drafter holds
        self.target_start = 0  # committed tokens the target holds
        self.finish_reason: FinishReason | None = None
        self.text_end: int | None = None  # where a stop string cut the text
        self.stats = SessionStats()
        # Drafts proposed in the last round: 0 after a plain round, whose tokens the draft
        # has yet to see (a drafting round then also catches it up on them).
        self.last_drafted = 0

    @property
    def completion(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def completion_len(self) -> int:
        """``len(completion)`` without copying it (read every round)."""
        return len(self.tokens) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def next_k(self, k_cap: int | None = None) -> int:
        if self.drafter == DrafterKind.NONE:
            return 0
        remaining = self.stop.max_new_tokens - self.completion_len
        return max(0, min(self.k_policy.next_k(k_cap), remaining - 1))

    def outlook(self, limit: int) -> list[tuple[float, int]]:
        """Under each cap ``0 .. limit``: (the tokens the next round is expected to
        commit, the k it would draft), from the policy's plan before any probe and its
        running per-token acceptance (no state changes: the orchestrator weighs every
        cap each round)."""
        if self.drafter == DrafterKind.NONE:
            ks = [0] * (limit + 1)
        else:
            remaining = self.stop.max_new_tokens - self.completion_len
            ks = [max(0, min(k, remaining - 1)) for k in self.k_policy.plans(limit)]
        alpha = self.k_policy.alpha
        return [(expected_tokens(alpha, k), k) for k in ks]

    def draft_input(self, k: int, *, full: bool = False) -> DraftInput:
        start = 0 if full else self.draft_start
        return DraftInput(
            self.session_id,
            start,
            self.tokens[start:],
            k,
            self.params,
            self.round_index,
            self.k_policy.draft_confidence,
        )

    def verify_input(
        self, proposal: Proposal, *, full: bool = False, steps: int = 1, chunk: int = 0
    ) -> VerifyInput:
        """The target's input; ``steps`` > 1: a multi-step plain verify (no drafts);
        ``chunk`` > 0: only the first ``chunk`` of the tokens it lacks (a prefill chunk,
        whose verdict is not committed: the target then holds ``committed_len`` tokens)."""
        start = 0 if full else self.target_start
        end = start + chunk if chunk > 0 else len(self.tokens)
        return VerifyInput(
            self.session_id,
            start,
            self.tokens[start:end],
            proposal,
            self.params,
            self.round_index,
            steps=steps,
        )

    def commit(self, proposal: Proposal, verdict: Verdict) -> list[int]:
        """Apply a verdict; returns the tokens this round added to the completion.

        A multi-step verdict (``decoded``) counts as that many plain rounds: the
        round index moves past each step's, as one-step rounds would have moved it."""
        assert not self.finished
        drafted = len(proposal.tokens)
        self.last_drafted = drafted
        committed_before = len(self.tokens)
        emitted = [*proposal.tokens[: verdict.accepted], *verdict.decoded, verdict.next_token]
        steps = 1 + len(verdict.decoded)
        self.stats.rounds += steps
        self.stats.drafted += drafted
        self.stats.accepted += verdict.accepted
        self.stats.rejections += verdict.accepted < drafted
        per_pos = self.stats.accepted_per_position
        per_pos.extend([0] * (verdict.accepted - len(per_pos)))
        for i in range(verdict.accepted):
            per_pos[i] += 1
        self.k_policy.observe(drafted, verdict.accepted)
        self.round_index += steps
        self.target_start = committed_before + verdict.accepted + len(verdict.decoded)
        kept = self._apply_stops(emitted)
        self.tokens.extend(kept)
        return kept

    def note_draft_synced(self) -> None:
        """The drafter has seen every committed token (called after a propose)."""
        self.draft_start = len(self.tokens)

    def _apply_stops(self, emitted: list[int]) -> list[int]:
        room = self.stop.max_new_tokens - self.completion_len
        kept = emitted[:room]
        for i, t in enumerate(kept):
            if t in self.stop.eos_ids:
                self.finish_reason = FinishReason.EOS
                return kept[: i + 1]
        if self.stop.stop_strings and self.decode is not None:
            for i in range(len(kept)):
                text = self.decode(self.completion + kept[: i + 1])
                hits = [c for c in (text.find(s) for s in self.stop.stop_strings) if c >= 0]
                if hits:
                    self.finish_reason = FinishReason.STOP
                    self.text_end = min(hits)
                    return kept[: i + 1]
        if self.completion_len + len(kept) >= self.stop.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        return kept
