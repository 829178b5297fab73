"""A round's commit in flight while the lane's next round proposes.

Round r's tokens are in each session's :class:`~specserve.engine.decode_state.DecodeState`
once verified; writing them to the store is a Redis round trip that no part of
round r + 1's ``Propose`` needs (the draft replica reads only the tokens, which
are in memory). So the round runner starts the commit of round r as a task and
proposes round r + 1 at once; the lane awaits the commit (:meth:`PendingCommit.settle`)
before round r + 1's ``Verify``. The rules that keep it lossless:

* **Tokens go out only after their commit.** The commit task puts a session's
  tokens in its outbox once the store answered OK for it
  (:meth:`~specserve.orchestrator.round.ledger.Ledger.write`), exactly as a commit
  awaited in the round did: no client ever holds a token the store may not have.
  Only the emit moved off the critical path, not ahead of the write.
* **One commit per session at a time, in round order.** Round r + 1 verifies and
  commits only after round r's commit settled, so its commit is written over the
  version round r wrote, and the versioned script still refuses a double commit or
  a commit over another writer's version.
* **A failed commit ends a session as it did.** Transient store errors are retried
  inside the store's window (the script is idempotent: a retried commit whose
  first reply was lost finds its own bytes and appends nothing twice). A version
  conflict, a closed session or a store down past the window ends the session
  when the commit settles: before round r + 1 verifies it, so nothing round r + 1
  computed for it is committed or sent. Its ``Propose`` for round r + 1 was
  wasted work, nothing more.
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
import logging
from collections.abc import Callable, Sequence

from opentelemetry import trace
from opentelemetry.trace import Span

from specserve.orchestrator.round.ledger import Ending, Ledger, RoundWrite
from specserve.orchestrator.round.spans import RoundSpans
from specserve.orchestrator.session import LiveSession
from specserve.orchestrator.snapshots.kv_snapshots import KvSnapshots
from specserve.telemetry import attributes as attr

log = logging.getLogger(__name__)


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

        pending = PendingCommit(
            self.ledger, self.ledger.prepare(list(committed)), spans, after_write
        )
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
