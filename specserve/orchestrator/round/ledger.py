"""Committing rounds to the store and ending sessions: the runner's bookkeeping half.

A round's tokens reach a client only after its record is committed. Ending a
session releases its KV on both replicas — unless it is kept warm for its next
turn — and writes its final record: IDLE or CANCELLED for a kept session,
deleted otherwise, and rolled back to before the turn when the turn failed
before its first round committed. A session whose record was deleted or taken
over by another replica is never written again.

**The commit overlaps the next round.** Round r's tokens are in each session's
:class:`~specserve.engine.decode_state.DecodeState` once verified; writing them to
the store is a Redis round trip that no part of round r + 1's ``Propose`` or
``Verify`` needs (the replicas read only the tokens, which are in memory). So the
round runner starts the commit of round r as a task (:class:`PendingCommit`) and
proposes and verifies round r + 1 at once; the lane awaits the commit
(:meth:`PendingCommit.settle`, once per round: :class:`SettleOnce`) before it applies
round r + 1's verdicts. Plain rounds (no ``Propose``) thus keep the store off their
path too. The rules that keep it lossless:

* **Tokens go out only after their commit.** The commit task puts a session's
  tokens in its outbox once the store answered OK for it
  (:meth:`Ledger.write`), exactly as a commit
  awaited in the round did: no client ever holds a token the store may not have.
  Only the emit moved off the critical path, not ahead of the write.
* **One commit per session at a time, in round order.** Round r + 1 applies its
  verdicts and commits only after round r's commit settled, so its commit is written
  over the version round r wrote, and the versioned script still refuses a double
  commit or a commit over another writer's version.
* **A failed commit ends a session as it did.** Transient store errors are retried
  inside the store's window (the script is idempotent: a retried commit whose
  first reply was lost finds its own bytes and appends nothing twice). A version
  conflict, a closed session or a store down past the window ends the session
  when the commit settles: before round r + 1's verdict is applied to it, so
  nothing round r + 1 computed for it is committed or sent. Its ``Propose`` and
  ``Verify`` for round r + 1 were wasted work, nothing more (every call says where
  its news starts, so a replica's cache past the stored tokens is never trusted).
* **A verify failover reads the store after the settle**, so the record it
  compares against is the one round r wrote.

Sessions whose turn finished in round r join no later round: the commit task ends
them itself (releases, final record, :class:`~specserve.orchestrator.session.Ended`)
in the background right after their commit, off every round's path. Every other
ending the commit decides (cancel requested, closed meanwhile, taken over, store
error) is handed to whoever settles, because such a session may be in round r + 1's
``Propose`` now and its caches must not be released under that call.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Sequence

from opentelemetry import trace
from opentelemetry.trace import Span

from specserve.engine.decode_state import FinishReason
from specserve.engine.errors import EngineError
from specserve.orchestrator.errors import SessionCancelled, VersionConflict
from specserve.orchestrator.fleet.replicas import ReplicaPool
from specserve.orchestrator.fleet.scheduler import Scheduler
from specserve.orchestrator.round.spans import RoundSpans
from specserve.orchestrator.round.writes import KvOwners, RoundWrite
from specserve.orchestrator.session import LiveSession
from specserve.orchestrator.snapshots.kv_snapshots import KvSnapshots
from specserve.orchestrator.store import records
from specserve.orchestrator.store.session_store import CommitStatus, SessionStore
from specserve.orchestrator.types import SessionState
from specserve.telemetry import attributes as attr
from specserve.v1 import session_pb2

log = logging.getLogger(__name__)

Ending = tuple[LiveSession, FinishReason | None, BaseException | None]


class Ledger:
    """Commits and endings for the sessions a runner decodes."""

    def __init__(
        self,
        scheduler: Scheduler,
        drafts: ReplicaPool,
        targets: ReplicaPool,
        store: SessionStore,
        sessions: dict[str, LiveSession],
        release_timeout_s: float,
    ) -> None:
        self.scheduler = scheduler
        self.drafts = drafts
        self.targets = targets
        self.store = store
        self.sessions = sessions  # the runner's: ending a session removes it
        self.release_timeout_s = release_timeout_s
        self._releasing: set[asyncio.Task[None]] = set()  # held until done
        self._finishing: set[asyncio.Task[None]] = set()

    def release_later(self, pool: ReplicaPool, endpoint: str, session_ids: list[str]) -> None:
        """Best effort, off the round's path: drop caches on a replica sessions left."""
        if not session_ids:
            return
        task = asyncio.get_running_loop().create_task(
            pool.release(endpoint, session_ids, self.release_timeout_s)
        )
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    def finish_later(self, ending: list[Ending], span: Span) -> None:
        """:meth:`finish` inside ``span`` (ended with it), off the round's path
        (:meth:`drain` waits for it)."""

        async def finish() -> None:
            with trace.use_span(span, end_on_exit=True):
                await self.finish(ending)

        task = asyncio.get_running_loop().create_task(finish())
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def drain(self) -> None:
        """Wait for every :meth:`finish_later` started so far."""
        await asyncio.gather(*self._finishing, return_exceptions=True)

    def capture(self, committed: Sequence[tuple[LiveSession, list[int]]]) -> list[RoundWrite]:
        """The writes of a round's commit, captured now from each session's placement
        (:mod:`~specserve.orchestrator.round.writes`: the records are built later)."""
        writes = []
        for s, tokens in committed:
            placement = self.scheduler.placement(s.sid)
            assert placement is not None
            draft = self.drafts.get(placement.draft) if placement.draft is not None else None
            target = self.targets.get(placement.target)
            owners = KvOwners(
                placement.draft,
                draft.replica_id if draft else "",
                s.state.draft_start,
                placement.target,
                target.replica_id if target else "",
                s.state.target_start,
            )
            writes.append(RoundWrite(s, tokens, owners, s.kv_snapshot, s.record))
        return writes

    async def write(self, writes: list[RoundWrite]) -> list[Ending]:
        """One pipelined versioned commit for a round's sessions, then their tokens go out.

        A session's tokens reach its outbox only once its record holds them. Returns the
        sessions that end with this commit: finished, cancel requested, closed meanwhile
        (MISSING), taken over (CONFLICT: marked ``gone``), or the store failed past its
        retry window (the error; nothing is delivered).
        """
        if not writes:
            return []
        ending: list[Ending] = []
        try:
            # Deltas from each session's last written record: a round writes its new
            # tokens and a few small fields, never the turn's constant ones again.
            results = await self.store.commit_many(
                [w.record() for w in writes], after=[w.after for w in writes]
            )
        except EngineError as e:
            return [(w.session, None, e) for w in writes]
        for w, (status, written) in zip(writes, results, strict=True):
            s = w.session
            if status in (CommitStatus.OK, CommitStatus.CANCEL_REQUESTED):
                s.record = written
                s.rounds_committed += 1
                s.deliver(w.tokens)
            if status is CommitStatus.CANCEL_REQUESTED:
                ending.append((s, FinishReason.CANCELLED, None))
            elif status is CommitStatus.OK and s.state.finished:
                ending.append((s, s.state.finish_reason, None))
            elif status is CommitStatus.MISSING:  # CloseSession deleted it
                s.gone = True
                ending.append((s, FinishReason.CANCELLED, None))
            elif status is CommitStatus.CONFLICT:
                s.gone = True
                ending.append(
                    (
                        s,
                        None,
                        VersionConflict(
                            f"session {s.sid!r} was changed by another orchestrator replica; "
                            "this one stopped decoding it"
                        ),
                    )
                )
        return ending

    async def finish(self, ending: list[Ending]) -> None:
        """Release KV, write final records, and tell the clients."""
        if not ending:
            return
        releases: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
        warm: dict[str, bool] = {}
        for s, reason, error in ending:
            placement = self.scheduler.placement(s.sid)
            keep_warm = s.keep and error is None and reason is not FinishReason.CANCELLED
            warm[s.sid] = keep_warm and not s.gone
            if placement is not None and not warm[s.sid]:
                releases[("target", placement.target)].append(s.sid)
                if placement.draft is not None:
                    releases[("draft", placement.draft)].append(s.sid)
            self.scheduler.leave(s.sid)
            self.sessions.pop(s.sid, None)
        pools = {"draft": self.drafts, "target": self.targets}
        await asyncio.gather(
            *(
                pools[role].release(ep, ids, self.release_timeout_s)
                for (role, ep), ids in releases.items()
            ),
            *(self.write_final(s, reason, error, warm[s.sid]) for s, reason, error in ending),
        )
        for s, reason, error in ending:
            s.end(reason, error)

    async def write_final(
        self, s: LiveSession, reason: FinishReason | None, error: BaseException | None, warm: bool
    ) -> None:
        """The record a turn ends with: rolled back, deleted, or IDLE/CANCELLED. On a
        session CancelSession marked cancelled meanwhile (the store refuses any other
        end), a rollback or an IDLE end is written CANCELLED instead."""
        try:
            if s.gone:
                return
            if error is not None and s.rounds_committed == 0 and s.pre_turn is not None:
                back = records.ended(s.pre_turn, SessionState.IDLE, warm=False)
                back.version = s.record.version  # roll the failed turn back
                await self._commit_end(back)
            elif not s.keep or (error is not None and s.rounds_committed == 0):
                await self.store.delete(s.sid, version=s.record.version)
            else:
                state = (
                    SessionState.CANCELLED
                    if reason is FinishReason.CANCELLED
                    else SessionState.IDLE
                )
                await self._commit_end(records.ended(s.record, state, warm=warm), s.record)
        except EngineError as e:
            log.warning("could not write the final record of session %s: %s", s.sid, e)

    async def _commit_end(
        self, record: session_pb2.SessionRecord, after: session_pb2.SessionRecord | None = None
    ) -> None:
        """Write a turn's final ``record``; on a session CancelSession marked meanwhile (the
        store refuses any other end) write it CANCELLED instead, its caches not kept."""
        try:
            await self.store.commit(record, final=True, after=after)
        except SessionCancelled:
            cancelled = records.ended(record, SessionState.CANCELLED, warm=False)
            await self.store.commit(cancelled, final=True, after=after)


class PendingCommit:
    """The commit of one round of one lane, started at once; :meth:`settle` awaits it."""

    def __init__(
        self,
        ledger: Ledger,
        writes: list[RoundWrite],
        spans: RoundSpans,
        after_write: Callable[[], None] | None = None,
    ) -> None:
        self.ledger = ledger
        self.spans = spans  # the round's: its commit and finish phases outlive it
        self.sessions: list[LiveSession] = [w.session for w in writes]
        for s in self.sessions:
            assert not s.committing, f"session {s.sid} has two commits in flight"
            s.committing = True
        self._handed: list[Ending] | None = None
        span = spans.detached_phase(attr.SPAN_COMMIT)
        self._task = asyncio.get_running_loop().create_task(self._run(writes, span, after_write))

    async def _run(
        self, writes: list[RoundWrite], span: Span, after_write: Callable[[], None] | None
    ) -> list[Ending]:
        try:
            with trace.use_span(span, end_on_exit=True):
                if span.is_recording():
                    span.set_attribute(attr.BATCH_SIZE, len(writes))
                ending = await self.ledger.write(writes)
        finally:
            for s in self.sessions:
                s.committing = False
        if after_write is not None:
            after_write()
        # A finished session is in no later round: nothing can be using its caches, and
        # its releases and final record need not hold up the next round.
        done = [e for e in ending if e[0].state.finished]
        if done:
            self.ledger.finish_later(done, self.spans.detached_phase(attr.SPAN_FINISH))
        return [e for e in ending if not e[0].state.finished]

    async def settle(self) -> list[Ending]:
        """Wait for the commit; the endings it decided that the caller must finish.

        Idempotent: later calls return the same endings (the caller finishes those not
        ``done``). If the waiting caller is cancelled the commit still completes.
        """
        if self._handed is None:
            try:
                self._handed = await asyncio.shield(self._task)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug: end its sessions rather than leave them hanging
                log.exception("a round's commit failed")
                self._handed = [(s, None, e) for s in self.sessions if not s.done]
        return self._handed


class Commits:
    """The commits in flight of one round runner's lanes (one per lane at most)."""

    def __init__(self, ledger: Ledger, snapshots: KvSnapshots | None) -> None:
        self.ledger = ledger
        self.snapshots = snapshots  # None: --kv-snapshots is off
        self._pending: set[PendingCommit] = set()

    def start(
        self,
        target: str,
        committed: Sequence[tuple[LiveSession, list[int]]],
        moved: dict[str, str],
        spans: RoundSpans,
    ) -> PendingCommit | None:
        """Start a round's commit (its span a phase of ``spans`` that ends with the commit);
        None if the round commits nothing."""
        if not committed:
            return None
        snapshots = self.snapshots

        def after_write() -> None:  # in the background, from where each session is now
            if snapshots is not None:
                snapshots.after_commit([(moved.get(s.sid, target), s) for s, _ in committed])

        pending = PendingCommit(self.ledger, self.ledger.capture(committed), spans, after_write)
        self._pending.add(pending)
        return pending

    async def settle(self, pending: PendingCommit) -> list[Ending]:
        """Wait for a commit; the endings it decided that are not finished yet. A caller
        cancelled meanwhile leaves it for :meth:`close`."""
        ending = await pending.settle()
        self._pending.discard(pending)
        return [e for e in ending if not e[0].done]

    async def close(self) -> None:
        """Wait for every commit in flight (their sessions' records must be settled)."""
        for pending in list(self._pending):
            await self.settle(pending)
        await self.ledger.drain()


class SettleOnce:
    """The settling of one round's commit (None: nothing in flight), done at most once
    by whichever of the next round's steps needs it first (a failover before it reads
    the store, else the runner before it applies the verdicts)."""

    def __init__(self, commits: Commits, pending: PendingCommit | None) -> None:
        self._commits = commits
        self._pending = pending
        self._endings: list[Ending] | None = None

    async def endings(self) -> list[Ending]:
        """The endings the commit decided that the caller must finish (the same list on
        every call)."""
        if self._endings is None:
            pending = self._pending
            self._endings = [] if pending is None else await self._commits.settle(pending)
        return self._endings

    async def ended(self) -> set[str]:
        """The ids of the sessions the commit ended."""
        return {s.sid for s, _, _ in await self.endings()}
