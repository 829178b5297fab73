"""N-gram (prompt lookup) drafter: propose what followed the last n tokens before.

The index maps every n-gram of the committed tokens (n from ``min_n`` to
``max_n``) to the position right after its *latest* occurrence, so lookups are
O(1) and updates touch only the new tokens. Preferring the latest match (rather
than the first, as transformers' prompt lookup does) follows the code being
written, which is where repeats come from. The proposal distribution is a point
mass on each proposed token, which the acceptance rule handles exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.engine.drafter import DrafterKind, DraftInput, DraftOutcome
from specserve.engine.rejection import Proposal


@dataclass
class _Session:
    tokens: list[int] = field(default_factory=list)
    index: dict[tuple[int, ...], int] = field(default_factory=dict)


class NgramDrafter:
    """Prompt-lookup drafting over each session's committed tokens."""

    name = DrafterKind.NGRAM

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n
        self._sessions: dict[str, _Session] = {}

    def sessions(self) -> int:
        return len(self._sessions)

    def release(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftOutcome]:
        return [self._propose_one(x) for x in inputs]

    def _propose_one(self, x: DraftInput) -> DraftOutcome:
        s = self._sessions.get(x.session_id)
        if s is None or len(s.tokens) < x.start:
            if x.start > 0:
                return DraftOutcome.needs_history()
            s = self._sessions[x.session_id] = _Session()
        if len(s.tokens) > x.start:  # the caller rewound: rebuild from the kept prefix
            kept = s.tokens[: x.start]
            s = self._sessions[x.session_id] = _Session()
            self._extend(s, kept)
        self._extend(s, x.new_tokens)
        return DraftOutcome(Proposal(tokens=self._lookup(s, x.k)))

    def _extend(self, s: _Session, new: Sequence[int]) -> None:
        for t in new:
            s.tokens.append(t)
            end = len(s.tokens)
            # Index the n-grams that end just before the new token: they predict it.
            for n in range(self.min_n, self.max_n + 1):
                if end - 1 >= n:
                    s.index[tuple(s.tokens[end - 1 - n : end - 1])] = end - 1

    def _lookup(self, s: _Session, k: int) -> list[int]:
        if k == 0:
            return []
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(s.tokens) < n:
                continue
            pos = s.index.get(tuple(s.tokens[-n:]))
            if pos is not None:
                return s.tokens[pos : pos + k]
        return []
