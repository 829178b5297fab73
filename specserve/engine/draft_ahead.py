"""Drafting ahead: a session's continuation past its last proposal, drafted while idle.

On separate devices the draft device idles while the target verifies. A model
drafter (:class:`~specserve.engine.model_drafter.ModelDrafter` with ``draft_ahead
> 0``) spends that time, one batched forward per idle step, continuing each session
it just drafted for (in a batch of at most :data:`AHEAD_MAX_SESSIONS`) as if the
target accepts every draft: first its own next token,
its guess of the target's **bonus** token, then drafts after it, by the rules the
next round's drafting will use (greedy; coupled; or sampled, drawn for the next
round's index and keeping q), stopping where ``min_confidence`` would stop drafting.

The next Propose uses them when its committed history is the session's tokens plus
every draft plus a bonus equal to the guess, with the same sampling parameters and
(sampled, not coupled) the round index they were drawn for: the tokens after the
guess are then exactly what drafting from that history gives, and their K/V are
cached. Anything else is a mismatch, rolled back as a rejected draft is.

This module holds the per-session record and the counters; the forwards are the
drafter's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from specserve.engine.drafter import DraftInput
from specserve.engine.sampling import SamplingParams

# Ahead tokens one session may hold: the bonus guess and up to MAX_K drafts after it.
MAX_DRAFT_AHEAD = 17
# Draft ahead only after a Propose batch of at most this many drafting sessions. A batch
# skips a draft forward only when every session in it has that draft ahead, i.e. when
# every guess was right and every draft accepted: at most about a quarter of a lone
# session's rounds at 85% acceptance and k = 8 (0.85**8), 2% of a batch of three. A miss
# costs the next Propose up to one forward (the idle step it arrives in): past two
# sessions that wait is nearly all ahead drafting would bring.
AHEAD_MAX_SESSIONS = 2


@dataclass
class Ahead:
    """One session's ahead tokens: ``tokens[start:]`` of its drafter record.

    ``tokens[start]`` is the bonus guess; the ones after it are drafts for round
    ``round_index``, with their sparse q (sampled drafting only) in ``q_ids`` /
    ``q_probs``, one ``[m]`` tensor per draft.
    """

    start: int  # position of the bonus guess: the session's tokens and drafts before it
    params: SamplingParams
    round_index: int  # the round the drafts after the guess are drawn for
    q_ids: list[torch.Tensor] = field(default_factory=list)  # [m] per draft after the guess
    q_probs: list[torch.Tensor] = field(default_factory=list)  # [m] per draft after the guess
    stopped: bool = False  # confidence fell: drafting from the same history stops there too

    def matches(self, x: DraftInput) -> bool:
        """Whether ``x`` (whose history agrees with the held tokens up to its end) drafts
        from just past the guess, as the ahead drafts were drafted."""
        if x.committed_len != self.start + 1 or x.k == 0 or x.params != self.params:
            return False
        sampled = not x.params.greedy and not x.params.coupled
        return not sampled or x.round_index == self.round_index


@dataclass(frozen=True)
class Predrafted:
    """The ahead drafts a request takes: its first drafts, already in the cache."""

    tokens: list[int]
    q_ids: list[torch.Tensor]  # [m] per token (sampled drafting; else empty)
    q_probs: list[torch.Tensor]  # [m] per token
    final: bool  # drafting from here would stop at once (confidence): no more to draft

    @classmethod
    def take(cls, ahead: Ahead, held: list[int], k: int) -> Predrafted:
        """At most ``k`` of the ``held`` drafts after the guess."""
        n = min(k, len(held))
        return cls(held[:n], ahead.q_ids[:n], ahead.q_probs[:n], ahead.stopped and n == len(held))


class AheadCounts:
    """Ahead work done and used (written on the model thread, read by a metrics scrape)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.forwards = 0  # idle steps that ran a forward
        self.drafted = 0  # ahead tokens drafted (bonus guesses included)
        self.hits = 0  # proposals that started from ahead tokens (the guess was the bonus)
        self.used = 0  # draft tokens proposed from ahead tokens

    def drafted_step(self, tokens: int) -> None:
        with self._lock:
            self.forwards += 1
            self.drafted += tokens

    def hit(self, used: int) -> None:
        with self._lock:
            self.hits += 1
            self.used += used

    def snapshot(self) -> tuple[int, int, int, int]:
        """(forwards, drafted, hits, used)."""
        with self._lock:
            return self.forwards, self.drafted, self.hits, self.used
