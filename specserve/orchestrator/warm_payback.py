"""Whether a cold session's draft warm-up will pay for itself.

A warm-up prefills a session's history on its draft replica beside the rounds
(:func:`~specserve.orchestrator.calls.warm`; a lone session's inside its round). It
buys the session drafting for the rest of its turn; it costs draft compute, and
where draft and target share a device (one CPU, one GPU) it slows the target's
rounds as well.
A session with a long history and a few tokens left (the last of a batch, which
drafts once it is alone) can lose more to its warm-up than speculation gains it.
So a warm-up starts only when what speculation is measured to save exceeds what
the warm-up is measured to cost::

    finish_0 - finish_best > behind * warm_seconds_per_token

The sessions of one round that are cold on one draft replica are weighed
together: one warm-up call prefills them all (a prefill's cost grows with the
tokens it takes), and a batch's rounds move together, so what drafting saves is
what it saves the batch's slowest turn, and ``behind`` is their histories summed
(what the warm-up takes). Eight fresh sessions that would each repay their own
warm-up can cost the batch more than drafting saves it.

``finish_0`` and ``finish_best`` are the predicted seconds to finish the batch's
slowest turn at cap 0 and at the best cap above it, with the weighed sessions
drafting (:class:`~specserve.orchestrator.goodput.GoodputCaps`): the rounds its
slowest turn needs (its tokens left over the tokens it expects a round; of new
sessions, one at the low end of the pool's acceptance) times the round time
predicted for the drafts that cap allows. ``warm_seconds_per_token`` is
what this draft replica's recent warm-ups cost the batch (seconds per history token,
smoothed), measured for each of the two ways a warm-up runs:

* *inside* a round (a lone session, :meth:`RoundRunner._warm_now`): the round waits
  for it, so it costs its wall time;
* *beside* the rounds (:func:`~specserve.orchestrator.calls.warm`): it costs what the
  rounds run meanwhile lose, each round's wall time over the time predicted for it
  from timed rounds, summed while the warm-up runs. On separate devices that is about
  nothing and warm-ups go ahead; where draft and target share cores it is what the
  contention costs (2 cores: rounds of 4 sessions took 1.05-1.39 s beside a warm-up
  against 0.26 s, and a warm-up's own wall time, charged before, said nothing of it).
  Where a round beside it cannot be predicted (one that prefills on the target), or
  no round ended beside it, the warm-up's wall time is charged.

A way not measured yet borrows the other's figure; until either is measured a
warm-up goes ahead: the figures come from warming. The two figures also choose the
way: a batch's cold sessions warm beside the rounds unless warming inside a round
was measured to cost less (:meth:`WarmPayback.cheaper_inside`): on 2 shared cores a
warm-up of 3 prompts took about 7 s beside the rounds, each round 1.4 s instead of
0.26 s, against about 0.6 s alone.

Pure Python, no clock: the round runner passes in what it measured.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

log = logging.getLogger(__name__)


class WarmPayback:
    """Per draft replica warm-up cost, inside and beside the rounds, and the rule that
    weighs it against the gain."""

    def __init__(self, *, smoothing: float = 0.3) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        # (draft endpoint, inside a round) -> seconds the batch loses per history token
        self._cost: dict[tuple[str, bool], float] = {}

    def observe(self, endpoint: str, tokens: int, seconds: float, *, inside: bool) -> None:
        """A warm-up of ``tokens`` history tokens on ``endpoint`` cost the batch ``seconds``
        (``inside`` a round: its wall time; beside the rounds: their lost time)."""
        if tokens <= 0 or seconds < 0:
            return
        per_token = seconds / tokens
        old = self._cost.get((endpoint, inside))
        w = self.smoothing
        self._cost[endpoint, inside] = per_token if old is None else (1 - w) * old + w * per_token

    def cost(self, endpoint: str, *, inside: bool) -> float | None:
        """Seconds per history token a warm-up that way costs on ``endpoint`` (the other
        way's figure where this one is not measured; None: neither is)."""
        own = self._cost.get((endpoint, inside))
        return own if own is not None else self._cost.get((endpoint, not inside))

    def cheaper_inside(self, endpoint: str) -> bool:
        """Whether warm-ups on ``endpoint`` were measured to cost the batch less inside a
        round than beside the rounds (both measured: until then they run beside, which
        is free where draft and target have their own devices)."""
        inside, beside = self._cost.get((endpoint, True)), self._cost.get((endpoint, False))
        return inside is not None and beside is not None and inside < beside

    def forget(self, endpoint: str) -> None:
        """Drop a draft replica's figures (it left the pool; a new one may differ)."""
        for inside in (True, False):
            self._cost.pop((endpoint, inside), None)

    def repays(
        self,
        endpoint: str,
        *,
        behind: int,
        finish: Mapping[int, float],
        inside: bool,
    ) -> bool:
        """Whether warming ``behind`` history tokens (of the sessions warmed together) on
        ``endpoint``, ``inside`` a round or beside the rounds, saves the batch more time
        than it costs, by the predicted seconds to finish its slowest turn by cap
        (``finish``, :meth:`GoodputCaps.finish_times`, with these sessions drafting)."""
        per_token = self.cost(endpoint, inside=inside)
        plain = finish.get(0)
        drafting = [f for cap, f in finish.items() if cap > 0]
        if per_token is None or plain is None or not drafting:
            return True  # not measured yet: warm, and measure
        saved = plain - min(drafting)
        cost = behind * per_token
        log.debug(
            "warm-up of %d tokens on %s (%s): saves %.2f s (the batch finishes in %.2f s "
            "instead of %.2f s), costs %.2f s: %s",
            behind,
            endpoint,
            "inside a round" if inside else "beside the rounds",
            saved,
            min(drafting),
            plain,
            cost,
            "repays" if saved > cost else "declined",
        )
        return saved > cost
