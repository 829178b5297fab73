"""What the target replica's model thread owns: the verifier and its KV pool.

Every method here runs on the model executor's thread, one batch at a time.
``verify`` takes the sessions of several coalesced Verify and Prefill calls and
runs them as ONE batched forward (a prefill is a verify with no drafts).

The verifier is a :class:`~specserve.engine.verifier.TargetVerifier` or, with
tensor parallelism, rank 0's handle on the rank group (``TPVerifier`` under
torchrun, ``RayTPVerifier`` with Ray). Each verifier call may be a Ray round trip,
so the backend never asks about sessions one at a time: membership and release
are one call per batch.

KV snapshots (``ExportKv`` / ``ImportKv``) go through a
:class:`~specserve.engine.kv_transfer.KvTransfer` on the verifier's pool. A
tensor-parallel target has none: each rank caches only its slice of the KV heads,
and gathering them is not built, so both calls answer FAILED_PRECONDITION there
and the orchestrator re-prefills instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specserve.engine.errors import FailedPrecondition
from specserve.engine.kv_transfer import ExportInput, ImportInput, KvChunk, KvTransfer
from specserve.engine.verifier import Verifier, VerifyInput, VerifyOutcome
from specserve.target_service.multi_step import decode_steps
from specserve.wire.common_wire import SessionLimit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verified:
    """A call's outcomes, and which stale sessions this replica held no cache for at all."""

    outcomes: list[VerifyOutcome]
    unknown: frozenset[str]


@dataclass(frozen=True)
class TargetLoad:
    """A snapshot of the replica's state for GetLoad (replaced whole, read from any thread)."""

    sessions: int = 0
    kv_bytes_used: int = 0  # rank 0's pool; every rank holds the same blocks of its heads
    kv_bytes_free: int = 0


class TargetBackend:
    """A loaded target model behind its verifier (one process, or a TP rank group)."""

    def __init__(
        self,
        verifier: Verifier,
        *,
        model_name: str,
        dtype: str,
        tp_size: int = 1,
        kv_transfer: KvTransfer | None = None,
    ) -> None:
        self.verifier = verifier
        self.model_name = model_name
        self.dtype = dtype
        self.tp_size = tp_size  # ranks behind this replica, reported by GetLoad
        self.kv_transfer = kv_transfer  # None: ExportKv / ImportKv are not supported
        self.vocab = verifier.vocab_limit  # token ids a request may name
        kv = verifier.kv_stats()
        # Tokens one session may hold: checked before a call reaches the model thread.
        self.limit = SessionLimit(
            int(verifier.config.max_position_embeddings), kv.blocks_total * kv.block_size
        )
        self.load = TargetLoad()
        self._snapshot()

    def progress_modules(self) -> list[Any]:
        """The in-process model's decoder layers, for the progress counter (none when
        the model runs in other processes: tensor-parallel ranks)."""
        model = getattr(self.verifier, "model", None)
        layers = getattr(model, "decoder_layers", None)
        return layers() if callable(layers) else []

    def verify(self, calls: Sequence[Sequence[VerifyInput]]) -> list[Verified]:
        """Outcomes for several coalesced calls, from one batched forward (and, for
        sessions that ask for several plain steps, one more per step:
        :mod:`~specserve.target_service.multi_step`)."""
        flat = [x for call in calls for x in call]
        held = self.verifier.holding([x.session_id for x in flat])  # before verify adds any
        try:
            outcomes = self.verifier.verify(flat)
            if any(x.steps > 1 for x in flat):
                outcomes = decode_steps(self.verifier, flat, outcomes)
        finally:
            self._snapshot()
        out, pos = [], 0
        for call in calls:
            part = outcomes[pos : pos + len(call)]
            stale_unknown = {
                x.session_id for x, o in zip(call, part, strict=True) if o.stale
            } - held
            out.append(Verified(part, frozenset(stale_unknown)))
            pos += len(call)
        return out

    def release(self, calls: Sequence[Sequence[str]]) -> list[int]:
        """Drop the named sessions' caches; per call, how many were held."""
        released = self.verifier.release_sessions([sid for ids in calls for sid in ids])
        self._snapshot()
        return [len(set(ids) & released) for ids in calls]  # coalesced calls never share one

    def export_kv(self, calls: Sequence[ExportInput]) -> list[list[KvChunk]]:
        """Snapshot chunks of sessions' caches (one call per job: not coalesced)."""
        kv = self._kv()
        return [kv.export(c.session_id, c.tokens, c.chunk_tokens, c.first_chunk) for c in calls]

    def import_kv(self, calls: Sequence[ImportInput]) -> list[int]:
        """Build sessions' caches from chunks; per call, the tokens the cache holds."""
        kv = self._kv()
        try:
            return [kv.import_(c.session_id, c.tokens, c.start, c.chunks) for c in calls]
        finally:
            self._snapshot()

    def _kv(self) -> KvTransfer:
        if self.kv_transfer is None:
            raise FailedPrecondition(
                f"this target is tensor-parallel (--tp {self.tp_size}): each rank caches "
                "only its slice of the KV heads, and KV export/import is not supported "
                "there; re-prefill from the committed tokens instead"
            )
        return self.kv_transfer

    def healthy(self) -> bool:
        """False once a rank of the TP group failed (any thread; may be one Ray call)."""
        return self.verifier.healthy()

    def close(self) -> None:
        """Stop the TP rank group, if any (the executor calls this on its thread at close)."""
        if self.tp_size > 1:
            log.info("closing the tensor-parallel group (%d ranks)", self.tp_size)
        self.verifier.close()

    def _snapshot(self) -> None:
        kv = self.verifier.kv_stats()
        self.load = TargetLoad(kv.sessions, kv.bytes_used, kv.bytes_free)
