"""What the planner is given and what it answers: plain frozen data, no I/O objects."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class Cache(StrEnum):
    """A session's draft cache on its draft replica."""

    WARM = "warm"  # drafting needs no prefill of a long history first
    COLD = "cold"  # drafting would first prefill a long history (a warm-up)
    WARMING = "warming"  # a warm-up beside the rounds is under way: it verifies at k = 0


class WarmWhere(StrEnum):
    INSIDE = "inside"  # prefilled inside this round, then it drafts in it
    BESIDE = "beside"  # prefilled beside the rounds; verifies at k = 0 until then


@dataclass(frozen=True)
class SessionView:
    """One session of a round, as the planner sees it."""

    sid: str
    drafter: str  # "none", "model", "ngram"
    requested_k: int | None  # the request's own k (drafted whatever the caps); None: adaptive
    tokens_left: int  # of this turn's max_new_tokens
    alpha: float  # the session's running per-token acceptance estimate
    turn_drafted: int = 0  # drafts proposed this turn
    turn_accepted: int = 0  # of them accepted
    turn_rejections: int = 0  # rounds this turn whose drafts were not all accepted
    cache: Cache = Cache.WARM
    target_behind: int = 0  # history tokens its target has not seen (a prefill if > 1)
    # Whether it drafted in its last round: if not, a drafting round now also catches its
    # draft up on the plain rounds' tokens, which is not what drafting costs.
    draft_synced: bool = True


@dataclass(frozen=True)
class BatchPlan:
    """The planner's answer for one round of a batch."""

    cap: int  # the round's k cap (adaptive sessions draft at most this)
    k: Mapping[str, int]  # drafts per session this round (0: verify only)
    warm: Mapping[str, WarmWhere] = field(default_factory=dict)  # cold sessions to warm now
    timeable: bool = True  # its wall time says something about its drafts (no prefill in it)
    exploring: bool = False  # the round times the choice the predictions did not make
    # A round with no drafts at all: plain steps per session (multi-step decoding in one
    # Verify); empty: one step each.
    steps: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundOutcome:
    """What a round did: drafts proposed and accepted per session, and its wall time."""

    drafted: Mapping[str, int]
    accepted: Mapping[str, int]
    seconds: float  # propose and verify
    clean: bool  # no failure, replay or warm-up beside it: its time may be learnt from
    steps: int = 1  # plain steps of its Verify (its most; > 1 only without drafts)
    compute_s: float = 0.0  # the target's compute for its Verify (0: not reported)

    @property
    def depth(self) -> int:
        return max(self.drafted.values(), default=0)

    @property
    def drafts(self) -> int:
        return sum(self.drafted.values())
