"""What the draft replica's model thread owns: the drafters and their per-session state.

Every method here runs on the model executor's thread (never on the event loop),
one batch at a time, so the drafters need no locks. ``propose`` takes the
payloads of several coalesced ``Propose`` calls and makes one batched call per
drafter for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specserve.engine.drafter import DraftCall, Drafter, DrafterKind, DraftOutcome
from specserve.engine.errors import InvalidArgument
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.ngram import NgramDrafter
from specserve.wire.common_wire import SessionLimit

# A replica without a draft model (n-gram only) holds no KV: its histories are bounded
# only so that no call can make it scan without end (above what an orchestrator admits).
NGRAM_SESSION_TOKENS = 1 << 18


@dataclass(frozen=True)
class Proposed:
    """A Propose call's outcomes, and which stale sessions this replica had never held."""

    outcomes: list[DraftOutcome]
    unknown: frozenset[str]  # stale and not held here at all (never seen, or released)


@dataclass(frozen=True)
class DraftLoad:
    """A snapshot of the replica's state for GetLoad (replaced whole, read from any thread)."""

    sessions: int = 0
    kv_bytes_used: int = 0
    kv_bytes_free: int = 0


class DraftBackend:
    """The drafters a draft replica serves (n-gram always, the model when one is loaded)."""

    def __init__(self, model: ModelDrafter | None, *, model_name: str, dtype: str, vocab: int):
        self.drafters: dict[DrafterKind, Drafter] = {DrafterKind.NGRAM: NgramDrafter()}
        if model is not None:
            self.drafters[DrafterKind.MODEL] = model
        self.model = model
        self.model_name = model_name
        self.dtype = dtype
        self.vocab = vocab  # token ids a request may name
        self.limit = SessionLimit(NGRAM_SESSION_TOKENS, NGRAM_SESSION_TOKENS)
        if model is not None:  # tokens one session may hold, checked before the model thread
            kv = model.kv_stats()
            self.limit = SessionLimit(model.context_tokens, kv.blocks_total * kv.block_size)
        self._held: dict[DrafterKind, set[str]] = {kind: set() for kind in self.drafters}
        self.load = DraftLoad()
        self._snapshot()

    def progress_modules(self) -> list[Any]:
        """The draft model's decoder layers, for the progress counter (none: n-gram only,
        or a drafter that is not a local model)."""
        layers = getattr(getattr(self.model, "model", None), "decoder_layers", None)
        return layers() if callable(layers) else []

    def check_drafter(self, kind: DrafterKind, sid: str) -> None:
        if kind not in self.drafters:
            served = ", ".join(sorted(self.drafters))
            hint = " (this replica runs no draft model)" if kind == DrafterKind.MODEL else ""
            raise InvalidArgument(
                f"session {sid!r}: drafter {kind.value!r} is not served here{hint}; "
                f"served: {served}"
            )

    def propose(self, calls: Sequence[Sequence[DraftCall]]) -> list[Proposed]:
        """Outcomes for several coalesced calls: one batched ``propose`` per drafter."""
        flat = [c for call in calls for c in call]
        outcomes: list[DraftOutcome | None] = [None] * len(flat)
        unknown: set[str] = set()
        for name, drafter in self.drafters.items():
            idx = [i for i, c in enumerate(flat) if c.drafter == name]
            if not idx:
                continue
            held = self._held[name]
            for i, o in zip(idx, drafter.propose([flat[i].input for i in idx]), strict=True):
                sid = flat[i].input.session_id
                if o.stale:
                    if sid not in held:
                        unknown.add(sid)
                    held.discard(sid)
                else:
                    held.add(sid)
                outcomes[i] = o
        self._snapshot()
        out, pos = [], 0
        for call in calls:
            part = outcomes[pos : pos + len(call)]
            assert all(o is not None for o in part)
            ids = {c.input.session_id for c in call}
            out.append(Proposed(part, frozenset(unknown & ids)))  # type: ignore[arg-type]
            pos += len(call)
        return out

    def idle_step(self) -> bool:
        """One step of the draft model's ahead drafting (the executor calls it while no
        call waits); whether it did work."""
        if not getattr(self.model, "draft_ahead", 0):  # off, n-gram only, or a stub drafter
            return False
        assert self.model is not None
        worked = self.model.idle_step()
        if worked:
            self._snapshot()
        return worked

    def release(self, calls: Sequence[Sequence[str]]) -> list[int]:
        """Drop the named sessions from every drafter; per call, how many were held."""
        out = []
        for ids in calls:
            released = 0
            for sid in ids:
                hit = [d.release(sid) for d in self.drafters.values()]
                for held in self._held.values():
                    held.discard(sid)
                released += any(hit)
            out.append(released)
        self._snapshot()
        return out

    def _snapshot(self) -> None:
        sessions = sum(d.sessions() for d in self.drafters.values())
        if self.model is None:
            self.load = DraftLoad(sessions=sessions)
            return
        kv = self.model.kv_stats()
        self.load = DraftLoad(sessions, kv.bytes_used, kv.bytes_free)
