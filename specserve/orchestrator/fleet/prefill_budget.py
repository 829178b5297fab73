"""How many rows a round may send its target: measured so a round stays near its usual length.

A round that prefills a prompt whole holds every other session of its target for
the whole prefill (a 32k-token prompt: 47 s against a usual round of 50 ms). The
scheduler gives each round a token budget instead
(:meth:`~specserve.orchestrator.fleet.scheduler.Scheduler.begin_round`), and this
module sizes it per target from two measurements:

* ``round_s``: a usual round's seconds (propose, verify, commit start), a running
  average over the rounds that prefilled nothing;
* ``token_s``: what one token of prefill adds to a round: the seconds the rounds that
  prefilled took beyond ``round_s``, over the tokens they prefilled, both summed with
  the older rounds' weights decayed as the running average's. A large chunk weighs
  by its tokens, so a few-token chunk lost in a round's noise moves it little; the
  decay follows a prompt's later chunks, which cost more (a token's attention grows
  with the context before it).

The budget is ``round_s / token_s`` rows: a round that spends it takes about two
usual rounds, so the others' tokens come at most about twice as far apart while a
prompt prefills, and the prompt gets the largest chunks that allows. It is never
more than ``cap`` (``--max-prefill-tokens``), and is ``cap`` until both are measured.

Pure bookkeeping: no clock, no grpc; the runner measures and reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.orchestrator.fleet.verify_budget import EWMA


@dataclass
class PrefillBudget:
    """Per target: a usual round's seconds, a prefill token's, and the budget they give."""

    cap: int  # --max-prefill-tokens: the budget is never larger
    round_s: dict[str, float] = field(default_factory=dict)
    # per target: decayed sums of the prefill rounds' extra seconds and of their tokens
    extra_s: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cap < 1:
            raise ValueError(f"the budget's cap must be >= 1, got {self.cap}")

    def token_s(self, target: str) -> float | None:
        """Seconds a prefill token adds to a round on ``target``; None until measured."""
        extra, tokens = self.extra_s.get(target), self.tokens.get(target)
        return None if extra is None or tokens is None else extra / tokens

    def rows(self, target: str) -> int:
        """The rows (verify rows and prefill tokens) the next round on ``target`` may send."""
        usual, per_token = self.round_s.get(target), self.token_s(target)
        if usual is None or per_token is None or per_token * self.cap <= usual:
            return self.cap
        return max(1, int(usual / per_token))

    def observe(self, target: str, prefilled: int, seconds: float) -> None:
        """A round on ``target`` that prefilled ``prefilled`` tokens took ``seconds``
        (a round disturbed by a failover, a warm-up or an error is not reported)."""
        if seconds <= 0 or prefilled < 0:
            return
        usual = self.round_s.get(target)
        if prefilled == 0:
            self.round_s[target] = seconds if usual is None else usual + EWMA * (seconds - usual)
        elif usual is not None:
            keep = 1 - EWMA
            self.extra_s[target] = keep * self.extra_s.get(target, 0.0) + seconds - usual
            self.tokens[target] = keep * self.tokens.get(target, 0.0) + prefilled

    def forget(self, target: str) -> None:
        """``target`` was lost: a replacement may be another machine."""
        for figures in (self.round_s, self.extra_s, self.tokens):
            figures.pop(target, None)
