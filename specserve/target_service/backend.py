"""What the target replica's model thread owns: the verifier and its KV pool.

Every method here runs on the model executor's thread, one batch at a time.
``verify`` takes the sessions of several coalesced Verify and Prefill calls and
runs them as ONE batched forward (a prefill is a verify with no drafts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.engine.verifier import TargetVerifier, VerifyInput, VerifyOutcome


@dataclass(frozen=True)
class Verified:
    """A call's outcomes, and which stale sessions this replica held no cache for at all."""

    outcomes: list[VerifyOutcome]
    unknown: frozenset[str]


@dataclass(frozen=True)
class TargetLoad:
    """A snapshot of the replica's state for GetLoad (replaced whole, read from any thread)."""

    sessions: int = 0
    kv_bytes_used: int = 0
    kv_bytes_free: int = 0


class TargetBackend:
    """A loaded target model behind its :class:`TargetVerifier`."""

    def __init__(self, verifier: TargetVerifier, *, model_name: str, dtype: str) -> None:
        self.verifier = verifier
        self.model_name = model_name
        self.dtype = dtype
        self.vocab = verifier.vocab_limit  # token ids a request may name
        self.load = TargetLoad()
        self._snapshot()

    def verify(self, calls: Sequence[Sequence[VerifyInput]]) -> list[Verified]:
        """Outcomes for several coalesced calls, from one batched forward."""
        flat = [x for call in calls for x in call]
        unknown = {x.session_id for x in flat if x.session_id not in self.verifier.kv}
        try:
            outcomes = self.verifier.verify(flat)
        finally:
            self._snapshot()
        out, pos = [], 0
        for call in calls:
            part = outcomes[pos : pos + len(call)]
            stale_unknown = {x.session_id for x, o in zip(call, part, strict=True) if o.stale}
            out.append(Verified(part, frozenset(stale_unknown & unknown)))
            pos += len(call)
        return out

    def release(self, calls: Sequence[Sequence[str]]) -> list[int]:
        """Drop the named sessions' caches; per call, how many were held."""
        out = [sum(self.verifier.release(sid) for sid in ids) for ids in calls]
        self._snapshot()
        return out

    def _snapshot(self) -> None:
        kv = self.verifier.kv_stats()
        self.load = TargetLoad(kv.sessions, kv.bytes_used, kv.bytes_free)
