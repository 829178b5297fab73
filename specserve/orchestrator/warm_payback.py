"""Whether a cold session's draft warm-up will pay for itself.

A warm-up prefills a session's history on its draft replica beside the rounds
(:func:`~specserve.orchestrator.calls.warm`). It buys the session drafting for the
rest of its turn; it costs draft compute, and where draft and target share a
device (one CPU, one GPU) every second of it slows the target's rounds as well.
A session with a long history and a few tokens left (the last of a batch, which
drafts once it is alone) can lose more to its warm-up than speculation gains it.
So a warm-up starts only when what speculation is measured to save exceeds what
the warm-up is measured to cost::

    remaining * (1 / rate_0 - 1 / rate_best) > behind * warm_seconds_per_token

The sessions of one round that are cold on one draft replica are weighed
together: one warm-up call prefills them all (a prefill's cost grows with the
tokens it takes), and a batch's rounds move together, so ``remaining`` is the
longest remaining turn among them (what the batch's wall time can gain) and
``behind`` their histories summed (what the warm-up takes). Eight fresh sessions
that would each repay their own warm-up can cost the batch more than drafting
saves it.

``rate_0`` and ``rate_best`` are the goodput (tokens/s per session) at cap 0 and
at the best cap above it for the round's batch: the round's sessions' expected
tokens over the round time predicted for the drafts that cap allows
(:class:`~specserve.orchestrator.goodput.GoodputCaps`); ``warm_seconds_per_token``
is this draft replica's recent warm-ups (seconds per history token, smoothed).
Until both are measured a warm-up goes ahead: the figures come from drafting.
The whole warm-up is charged, as if the devices were shared; on separate devices
that declines a few late warm-ups that would have been free (those sessions
verify at k = 0 to the end), which costs little where warm-ups are fast anyway.

Pure Python, no clock: the round runner passes in what it measured.
"""

from __future__ import annotations

from collections.abc import Mapping


class WarmPayback:
    """Per draft replica warm-up cost, and the rule that weighs it against the gain."""

    def __init__(self, *, smoothing: float = 0.3) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        self._cost: dict[str, float] = {}  # draft endpoint -> seconds per history token

    def observe(self, endpoint: str, tokens: int, seconds: float) -> None:
        """A warm-up on ``endpoint`` prefilled ``tokens`` history tokens in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        per_token = seconds / tokens
        old = self._cost.get(endpoint)
        w = 1.0 if old is None else self.smoothing
        self._cost[endpoint] = per_token if old is None else (1 - w) * old + w * per_token

    def cost(self, endpoint: str) -> float | None:
        """Seconds per history token of ``endpoint``'s warm-ups (None: none measured)."""
        return self._cost.get(endpoint)

    def forget(self, endpoint: str) -> None:
        """Drop a draft replica's figure (it left the pool; a new one may differ)."""
        self._cost.pop(endpoint, None)

    def repays(
        self, endpoint: str, *, behind: int, remaining: int, rates: Mapping[int, float]
    ) -> bool:
        """Whether warming ``behind`` history tokens (of the sessions warmed together) on
        ``endpoint``, for a batch whose longest turn has ``remaining`` tokens to go, saves
        more time than it takes, by the goodput ``rates`` (tokens/s per session
        by cap) of that batch."""
        per_token = self._cost.get(endpoint)
        plain = rates.get(0)
        drafting = [r for cap, r in rates.items() if cap > 0]
        if per_token is None or plain is None or not drafting:
            return True  # not measured yet: warm, and measure
        best = max(drafting)
        if best <= plain or plain <= 0:
            return False  # speculation does not pay at this batch: nothing to repay with
        saved = remaining * (1 / plain - 1 / best)
        return saved > behind * per_token
