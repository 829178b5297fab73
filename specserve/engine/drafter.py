"""The drafter interface shared by the draft model and the n-gram drafter.

A drafter keeps per-session state (a KV cache, an n-gram index) that mirrors the
session's committed tokens. Each call says where the caller's news starts:
``start`` tokens are assumed known to the drafter and ``new_tokens`` follow them.
A drafter that holds fewer than ``start`` tokens of the session (it restarted,
evicted the session, or never saw it) answers ``stale`` and the caller resends the
whole history with ``start = 0``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from specserve.engine.errors import InvalidArgument
from specserve.engine.rejection import Proposal
from specserve.engine.sampling import SamplingParams

MAX_K = 16


class DrafterKind(StrEnum):
    """Which drafter proposes a session's tokens; ``NONE`` decodes target-only (k = 0).

    A ``str`` subclass: members equal, hash and format as their values (``"model"``, ...),
    which are the names flags, logs and span attributes carry.
    """

    MODEL = "model"  # a small causal LM (:mod:`specserve.engine.model_drafter`)
    NGRAM = "ngram"  # prompt lookup (:mod:`specserve.engine.ngram`)
    NONE = "none"  # no drafts

    @classmethod
    def parse(cls, value: str) -> DrafterKind:
        """``value`` as a kind; :class:`InvalidArgument` naming the kinds otherwise."""
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(kind.value for kind in cls)
            raise InvalidArgument(f"unknown drafter {value!r}; one of {known}") from None


@dataclass(frozen=True)
class DraftInput:
    """One session's request for ``k`` draft tokens."""

    session_id: str
    start: int  # tokens of the session the drafter should already hold
    new_tokens: Sequence[int]  # committed tokens from position ``start`` on
    k: int
    params: SamplingParams
    round_index: int
    # The session's depth floor: drafting stops after the draft at which the product of
    # this round's draft top probabilities falls below it; that draft is still proposed
    # (the adaptive policy's KPolicy.depth_floor; 0 = draft all k).
    min_confidence: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_confidence < 1.0:
            raise InvalidArgument(f"min_confidence must be in [0, 1), got {self.min_confidence}")
        if not 0 <= self.k <= MAX_K:
            raise InvalidArgument(f"k must be between 0 and {MAX_K}, got {self.k}")
        if self.start < 0:
            raise InvalidArgument(f"start must be >= 0, got {self.start}")
        if self.start + len(self.new_tokens) == 0:
            raise InvalidArgument("a draft needs at least one committed token")

    @property
    def committed_len(self) -> int:
        return self.start + len(self.new_tokens)


@dataclass(frozen=True)
class DraftCall:
    """One session of a batched propose: which drafter, and what it is asked."""

    drafter: DrafterKind  # never NONE
    input: DraftInput


@dataclass(frozen=True)
class DraftOutcome:
    """A proposal, or ``stale=True`` when the drafter needs the full history."""

    proposal: Proposal | None
    stale: bool = False

    @classmethod
    def needs_history(cls) -> DraftOutcome:
        return cls(proposal=None, stale=True)


class Drafter(Protocol):
    """Proposes draft tokens for a batch of sessions."""

    name: DrafterKind  # never NONE

    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftOutcome]:
        """One outcome per input, in order."""
        ...

    def release(self, session_id: str) -> bool:
        """Forget a session; returns whether it was known."""
        ...

    def sessions(self) -> int:
        """How many sessions this drafter holds state for."""
        ...
