"""Verify with failover: a round's ``Verify``, replayed elsewhere when its target is lost.

:meth:`Failover.verify` sends the batch to its lane's target (:func:`calls.verify`),
with a timeout from the work in the batch and the target's measured speed
(:class:`~specserve.orchestrator.fleet.verify_budget.VerifyBudget`, never below
``--target-timeout-s``).

* A target past that timeout that still answers SERVING is *slow*: the same round
  is replayed on it with twice the budget (its KV is warm there), and only a second
  miss counts as a loss — unless it is the only usable target and its model thread
  moved during the call: then it keeps the round, replayed with a doubled budget
  each time, for as long as it progresses and the clients' deadlines allow.
* A lost target: each session's stored record is re-read, and a session whose
  record moved on (closed, or taken over by another orchestrator) is dropped with
  ``VersionConflict`` and marked ``gone``; the rest — same drafts, same (seed, round
  index, position) draws — are replayed on the least loaded usable target with the
  whole history (or, with ``--kv-snapshots``, after restoring the saved chunks), so
  the tokens do not change. With no usable target for ``failover_s`` they end with
  ``UNAVAILABLE``.
* Clients whose deadlines passed first: the outcome is ``expired``, no failover.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from opentelemetry import trace

from specserve.engine.errors import EngineError
from specserve.orchestrator.errors import VersionConflict
from specserve.orchestrator.fleet.prefill_budget import PrefillBudget
from specserve.orchestrator.fleet.replicas import ReplicaPool
from specserve.orchestrator.fleet.scheduler import Scheduler
from specserve.orchestrator.fleet.verify_budget import VerifyBudget, rows_of
from specserve.orchestrator.round import calls
from specserve.orchestrator.round.calls import Plan, RoundTimeouts, batch_timeout
from specserve.orchestrator.round.stats import RunnerStats
from specserve.orchestrator.session import LiveSession
from specserve.orchestrator.snapshots.kv_snapshots import KvSnapshots
from specserve.orchestrator.store.session_store import SessionStore
from specserve.policy import Planner
from specserve.serving.errors import Unavailable
from specserve.telemetry import attributes as attr

log = logging.getLogger(__name__)

Items = list[tuple[LiveSession, Plan]]


class Failover:
    """The verify step of every lane's rounds."""

    def __init__(
        self,
        scheduler: Scheduler,
        targets: ReplicaPool,
        store: SessionStore,
        timeouts: RoundTimeouts,
        stats: RunnerStats,
        planner: Planner,
        snapshots: KvSnapshots | None,
        refresh_usable: Callable[[], None],
    ) -> None:
        self.scheduler = scheduler
        self.targets = targets
        self.store = store
        self.timeouts = timeouts
        self.stats = stats
        self.planner = planner  # forgets a lost target's costs
        self.snapshots = snapshots  # None: --kv-snapshots is off
        self.refresh_usable = refresh_usable  # the scheduler's view of usable replicas
        self.budget = VerifyBudget(timeouts.target_s)  # each Verify's timeout
        # each round's prompt tokens; a first chunk is sized at a verify row's cost
        self.prefill_budget = PrefillBudget(
            scheduler.config.max_prefill_tokens, self.budget.per_row_s.get
        )

    async def verify(
        self,
        target: str,
        items: Items,
        settle: Callable[[], Awaitable[set[str]]] | None = None,
    ) -> tuple[calls.VerifyOutcome, dict[str, str]]:
        """Verify on ``target``; if it is lost, replay on others.

        ``settle``: awaits the lane's last commit, still in flight while this round
        verifies, and returns the sessions it ended; called before the store is read
        for a replay, which those sessions are left out of (they get no outcome here).

        Returns the outcome of every other session (a verdict or an error, unless it
        ``expired``) and the sessions that now live on another target (id -> target).
        """
        total = calls.VerifyOutcome()
        moved: dict[str, str] = {}
        give_up = time.monotonic() + self.timeouts.failover_s
        todo = items
        slow_before = False  # this replica already missed the target timeout once
        while todo:
            rows = sum(rows_of(_unseen(s, p), len(p.proposal.tokens), p.steps) for s, p in todo)
            budget = self.budget.timeout_s(target, rows)
            timeout = batch_timeout(budget, [s for s, _ in todo])
            cut = timeout < budget
            out = await calls.verify(
                self.targets, target, todo, timeout, deadline_cut=cut, stall_s=self.timeouts.stall_s
            )
            if out.verdicts and not out.slow:
                self.budget.observe(target, rows, out.compute_s)
            if out.expired:  # the clients left, not the target: no failover
                total.expired = True
                break
            if out.slow:
                self.stats.slow_verifies += 1
                self.budget.missed(target)
                alone = not any(e != target for e in self.targets.usable())
                if not slow_before or (alone and out.progressed):
                    # busy, not broken: same replica, same round, a longer budget
                    slow_before = True
                    log.warning(
                        "%s; replaying the round there with a %g s budget%s",
                        out.why,
                        self.budget.timeout_s(target, rows),
                        " (the only target, and it progresses)" if alone else "",
                    )
                    trace.get_current_span().add_event(
                        "slow target", {attr.TARGET: target, attr.BATCH_SIZE: len(todo)}
                    )
                    continue
                out.lost = True  # twice: as good as lost for these sessions
                self.targets.mark_failed(target, out.why)
            self._add(total, out)
            todo = [
                (s, p) for s, p in todo if s.sid not in out.verdicts and s.sid not in out.errors
            ]
            if not todo:
                break
            if out.lost:
                self.planner.forget(target)  # a replacement may be another machine
                self.prefill_budget.forget(target)
                self.budget.forget(target)
            if settle is not None:  # the store must hold the last round before it is read
                ended = await settle()
                todo = [(s, p) for s, p in todo if s.sid not in ended]
                if not todo:
                    break
            todo = await self._resume_from_store(todo, total)
            next_target = await self._another_target(give_up)
            if next_target is None:
                for s, _ in todo:
                    total.errors[s.sid] = Unavailable(
                        f"no target replica could verify the session; retry later "
                        f"(last failure: {out.why})"
                    )
                break
            target = next_target
            await self._replay_on(target, todo, moved, out.why)
        return total, moved

    def _add(self, total: calls.VerifyOutcome, out: calls.VerifyOutcome) -> None:
        total.verdicts.update(out.verdicts)
        total.logprobs.update(out.logprobs)
        total.prefilled.update(out.prefilled)
        total.errors.update(out.errors)
        total.batch_sizes.extend(out.batch_sizes)
        total.compute_s += out.compute_s
        for size in out.batch_sizes:
            self.stats.verify_batch_sizes[size] += 1
        self.stats.target_history_resends += out.resent

    async def _replay_on(self, target: str, todo: Items, moved: dict[str, str], why: str) -> None:
        """Make ``target`` the sessions' target: from their whole history, or saved chunks."""
        log.warning("replaying a round of %d sessions on target %s", len(todo), target)
        trace.get_current_span().add_event(
            "replay", {attr.TARGET: target, attr.BATCH_SIZE: len(todo), "why": why}
        )
        self.stats.replayed_rounds += 1
        for s, _ in todo:
            s.state.target_start = 0  # the new replica rebuilds the KV from the history
            moved[s.sid] = target
            self.stats.target_failovers += 1
        if self.snapshots is not None:  # ... or from saved chunks, up to a short tail
            await self.snapshots.restore(target, [s for s, _ in todo])

    async def _resume_from_store(self, todo: Items, total: calls.VerifyOutcome) -> Items:
        """Keep the sessions whose stored record still is what this round started from."""
        kept = []
        for s, p in todo:
            try:
                stored = await self.store.get(s.sid)
            except EngineError as e:
                total.errors[s.sid] = e
                continue
            if stored is None or stored.version != s.record.version:
                s.gone = True
                total.errors[s.sid] = VersionConflict(
                    f"session {s.sid!r} was closed or taken over while its target was lost"
                )
                continue
            assert list(stored.tokens) == s.state.tokens, "memory and store disagree"
            kept.append((s, p))
        return kept

    async def _another_target(self, give_up: float) -> str | None:
        """The least loaded usable target, waiting for one until ``give_up``; None past it."""
        while True:
            self.refresh_usable()
            usable = self.scheduler.targets
            if usable:
                return min(usable, key=self.scheduler.target_load)
            if time.monotonic() >= give_up:
                return None
            await asyncio.sleep(0.2)


def _unseen(s: LiveSession, p: Plan) -> list[int]:
    """The committed tokens this round sends the target (a chunk of them, for a prefill chunk)."""
    unseen = s.state.tokens[s.state.target_start :]
    return unseen[: p.chunk] if p.chunk else unseen
