"""One session's share of a round's commit: captured as the round ends, built off its path.

A round's commit is written while the lane's next round proposes and verifies
(:mod:`~specserve.orchestrator.round.ledger`). Building the record to write copies
the session's whole record and history, which no part of the next round's calls
needs; so the round only captures what its next round may change before the
commit is written (:class:`RoundWrite`: where the session's KV lives now, how far
its KV snapshots reach), and the commit task builds the record (:meth:`RoundWrite.record`)
after the next round's first call has been sent. The rest of what the record holds
comes from the session's :class:`~specserve.engine.decode_state.DecodeState` and its
last written record, which stay as the round left them until the commit settles: the
next round applies its verdicts only after that.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.orchestrator.session import LiveSession
from specserve.orchestrator.store import records
from specserve.v1 import session_pb2


@dataclass(frozen=True, slots=True)
class KvOwners:
    """The replicas that hold a session's KV cache as a round ends, and how many of its
    tokens each holds (the record's ``draft`` and ``target``)."""

    draft: str | None  # the draft replica's endpoint; None: the session has none
    draft_replica_id: str
    draft_tokens: int
    target: str
    target_replica_id: str
    target_tokens: int

    def pb(self) -> tuple[session_pb2.KvOwnership, session_pb2.KvOwnership]:
        """The record's ``draft`` and ``target`` (an empty ``draft`` without a draft replica)."""
        draft = session_pb2.KvOwnership()
        if self.draft is not None:
            draft = session_pb2.KvOwnership(
                replica_id=self.draft_replica_id, endpoint=self.draft, tokens=self.draft_tokens
            )
        target = session_pb2.KvOwnership(
            replica_id=self.target_replica_id, endpoint=self.target, tokens=self.target_tokens
        )
        return draft, target


@dataclass(frozen=True, slots=True)
class RoundWrite:
    """One session's share of a round's commit (see the module docstring)."""

    session: LiveSession
    tokens: list[int]  # the round's committed tokens, delivered once written
    owners: KvOwners
    kv_snapshot: session_pb2.KvSnapshot | None  # how far KV snapshots reach (None: off)
    after: session_pb2.SessionRecord  # the record as last written: its version, the delta's base

    def record(self) -> session_pb2.SessionRecord:
        """The record to write: every token of the session's state, its next round index,
        usage, KV owners. Valid until the commit settles (the state may move on after)."""
        s = self.session
        usage = s.base_usage + s.turn_usage()
        return records.after_round(
            self.after, s.state, usage, *self.owners.pb(), kv_snapshot=self.kv_snapshot
        )
