"""Multi-step plain decoding: n target steps for a session in one Verify call.

A plain round (no drafts) costs the stack a whole round trip for one token: the
Verify message out and back, the servers' and the orchestrator's Python. On an
accelerator, where a step takes 6-25 ms, that is 15-40% of the round. With
``VerifySession.steps = n`` the target replica feeds each token it decodes back in
and decodes n tokens in the call (vLLM's multi-step scheduling does the same for
its scheduler's cost), so the round trip is paid once per n tokens.

Step j (from 0) of a session is the verify one-step plain round ``round_index + j``
would send: start ``committed_len + j - 1``, the previous step's token, no drafts,
the same sampling config. Its draws depend only on (seed, round, position)
(:mod:`specserve.engine.randomness`), so the n tokens equal n one-step rounds', and
a replay of the call repeats them. The steps of every session in the batch run as
one batched verify each; a session leaves the batch when its n are done.

A step that the verifier refuses (its KV blocks ran out part way) ends the stepping
for every session still in it: each keeps what it decoded (``Verdict.decoded`` is
then shorter than n - 1) and the orchestrator sends the rest in its next round. EOS
and stop strings are not seen here: the orchestrator cuts the tokens at them, and
the target's cache is rolled back to the committed history by the next call's
``start`` anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.engine.errors import EngineError
from specserve.engine.logprobs import TokenLogprob
from specserve.engine.rejection import Proposal, Verdict
from specserve.engine.verifier import Verifier, VerifyInput, VerifyOutcome

log = logging.getLogger(__name__)


@dataclass
class _Stepping:
    """One multi-step session's tokens so far."""

    first: VerifyInput
    last: VerifyOutcome  # the latest step's outcome: its next token is the newest
    steps: int  # steps it runs (its request's, fewer if its cache went)
    decoded: list[int] = field(default_factory=list)  # tokens before ``last``'s next token
    logprobs: list[float] = field(default_factory=list)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)

    def step_input(self, j: int) -> VerifyInput:
        """Step ``j``'s verify: the previous step's token at the next position."""
        x, verdict = self.first, self.last.verdict
        assert verdict is not None
        return VerifyInput(
            x.session_id,
            x.committed_len + j - 1,
            [verdict.next_token],
            Proposal(tokens=[]),
            x.params,
            x.round_index + j,
            x.want_logprobs,
            x.top_logprobs,
        )

    def advance(self, outcome: VerifyOutcome) -> None:
        assert self.last.verdict is not None
        self.decoded.append(self.last.verdict.next_token)
        self.logprobs.extend(self.last.logprobs)
        self.token_logprobs.extend(self.last.token_logprobs)
        self.last = outcome

    def outcome(self) -> VerifyOutcome:
        last = self.last
        assert last.verdict is not None
        return VerifyOutcome(
            Verdict(accepted=0, next_token=last.verdict.next_token, decoded=tuple(self.decoded)),
            logprobs=(*self.logprobs, *last.logprobs),
            token_logprobs=(*self.token_logprobs, *last.token_logprobs),
        )


def decode_steps(
    verifier: Verifier, inputs: Sequence[VerifyInput], first: Sequence[VerifyOutcome]
) -> list[VerifyOutcome]:
    """The outcomes of ``inputs`` whose first step (one batched verify) gave ``first``,
    each session with ``steps`` > 1 carried on to its last step (see the module doc)."""
    stepping = {
        i: _Stepping(x, o, x.steps)
        for i, (x, o) in enumerate(zip(inputs, first, strict=True))
        if x.steps > 1 and o.verdict is not None
    }
    for j in range(1, max((x.steps for x in inputs), default=1)):
        now = [i for i, s in stepping.items() if s.steps > j]
        if not now:
            break
        try:
            outcomes = verifier.verify([stepping[i].step_input(j) for i in now])
        except EngineError as e:  # KV blocks ran out part way: keep what was decoded
            log.info("multi-step decoding stopped after %d of its steps: %s", j, e)
            break
        for i, o in zip(now, outcomes, strict=True):
            if o.verdict is None:  # the cache went (cannot happen within one call): stop it
                stepping[i].steps = j
                continue
            stepping[i].advance(o)
    out = list(first)
    for i, s in stepping.items():
        out[i] = s.outcome()
    return out
