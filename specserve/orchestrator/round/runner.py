"""The distributed speculative loop: one asyncio task per lane, one round at a time.

A round of a lane (see :mod:`specserve.orchestrator.fleet.scheduler`) is the round of
:class:`~specserve.engine.speculative.SpeculativeEngine`, over gRPC:

1. sessions whose client left, whose deadline passed or that were cancelled end
   here, at the round boundary;
2. ``Propose`` on each draft replica the batch uses, in parallel, with the k per
   session the planner chose (:class:`~specserve.policy.Planner`: the
   runner gives it the sessions as plain views, does what its plan says, and tells
   it what the round did); a draft replica that fails or misses its deadline costs
   only speculation: its sessions verify with k = 0 this round and move to another
   draft replica (or stay at k = 0) if it is lost, or stay if it is only slow. A
   cold session the plan warms is prefilled on its draft replica inside the round
   (:mod:`~specserve.orchestrator.round.warmups`: then it drafts in it) or beside
   the rounds (verifying at k = 0 until then);
3. one ``Verify`` on the lane's target. If the target is lost, the sessions'
   committed tokens are re-read from the store and the same round — same drafts,
   same (seed, round index, position) draws — is replayed on another target with
   the whole history, so the output does not change (with ``--kv-snapshots`` the
   new target first restores the saved KV chunks and gets only the tail). A
   target past the target timeout that still answers SERVING is slow, not lost:
   the round is replayed on it once more (its KV is warm there; another replica
   would have to prefill every session) and only a second miss fails it over;
4. ``DecodeState.commit``, then one pipelined atomic commit per session to the
   store, started and left in flight while the lane's next round proposes and
   verifies; the tokens go to the clients once it is written, and the next round
   applies its verdicts and commits only after it settled
   (:class:`~.ledger.PendingCommit`). A session whose record changed under it
   (another replica took it over) stops.

**Long prompts.** A round sends its target at most the token budget the scheduler
gives it (:mod:`~specserve.orchestrator.fleet.prefill_budget`); a prompt past it sends
a chunk a round, is left out of the plan (no drafts) and emits nothing until its last
chunk, while the lane's decoding sessions keep their rounds. A chunk moves only the
session's ``target_start``: nothing is written to the store until its first token, so a
takeover or a failover meanwhile prefills from the record's KV position (the target
rolls back to it).

**From an answer to the next call.** Once a round's ``Verify`` answers, its lane
applies the verdicts, starts the commit (capturing only what the next round may
change: :mod:`~.writes`), plans the next round and sends its first call on the
replica's data-plane connection without yielding to the event loop in between. What
decides nothing in that call runs after it is sent: building and writing the
commit's records, the runner's counts, the debug log.

Propose: :class:`~.drafting.Drafting`; verify with failover and replay:
:class:`~.failover.Failover`; commits and endings (releases, final records):
:class:`~.ledger.Ledger`; spans: :class:`~.spans.RoundSpans`;
KV snapshots (after each commit, off the round's path; before a replay):
:class:`~specserve.orchestrator.snapshots.kv_snapshots.KvSnapshots`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from opentelemetry import context as otel_context

from specserve.engine.decode_state import FinishReason
from specserve.orchestrator.fleet.replicas import ReplicaPool
from specserve.orchestrator.fleet.scheduler import LaneKey, Placement, Scheduler
from specserve.orchestrator.round.calls import Plan, RoundTimeouts
from specserve.orchestrator.round.drafting import Drafting
from specserve.orchestrator.round.failover import Failover
from specserve.orchestrator.round.ledger import (
    Commits,
    Ending,
    Ledger,
    PendingCommit,
    SettleOnce,
)
from specserve.orchestrator.round.spans import RoundSpans
from specserve.orchestrator.round.stats import RunnerStats
from specserve.orchestrator.round.views import prefills, session_view, target_backlog
from specserve.orchestrator.session import LiveSession, Phase
from specserve.orchestrator.snapshots.kv_snapshots import KvSnapshots
from specserve.orchestrator.store.leases import LeaseKeeper
from specserve.orchestrator.store.session_store import SessionStore
from specserve.policy import BatchPlan, Planner, RoundOutcome
from specserve.serving.errors import Unavailable
from specserve.telemetry import attributes as attr
from specserve.v1 import session_pb2

log = logging.getLogger(__name__)


class RoundRunner:
    """Drives every lane's rounds; sessions enter with :meth:`submit`."""

    def __init__(
        self,
        scheduler: Scheduler,
        drafts: ReplicaPool,
        targets: ReplicaPool,
        store: SessionStore,
        timeouts: RoundTimeouts | None = None,
        snapshots: KvSnapshots | None = None,
        planner: Planner | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.drafts = drafts
        self.targets = targets
        self.store = store
        self.timeouts = timeouts or RoundTimeouts()
        self.snapshots = snapshots  # None: --kv-snapshots is off
        self.planner = planner or Planner()  # every policy decision and what it learns
        self.sessions: dict[str, LiveSession] = {}
        self.stats = RunnerStats()
        self._lanes: dict[LaneKey, asyncio.Task[None]] = {}
        self.ledger = Ledger(
            scheduler, drafts, targets, store, self.sessions, self.timeouts.release_s
        )
        self.commits = Commits(self.ledger, snapshots)  # rounds' commits in flight
        self.leases = LeaseKeeper(store, self.sessions.keys)
        self.drafting = Drafting(scheduler, drafts, self.timeouts, self.stats, self.ledger)
        self.failover = Failover(
            scheduler,
            targets,
            store,
            self.timeouts,
            self.stats,
            self.planner,
            snapshots,
            self.refresh_usable,
        )

    # -- entering and leaving ------------------------------------------------------------

    def refresh_usable(self) -> None:
        self.scheduler.set_usable(self.targets.usable(), self.drafts.usable())

    def submit(self, live: LiveSession) -> None:
        """Place a session (preferring the replicas with its warm KV) and start decoding it."""
        self.refresh_usable()
        rec = live.record
        placement = self.scheduler.place(
            live.sid,
            prefer_target=rec.target.endpoint or None,
            prefer_draft=rec.draft.endpoint or None,
        )
        live.state.target_start = (
            rec.target.tokens if placement.target == rec.target.endpoint else 0
        )
        live.state.draft_start = rec.draft.tokens if placement.draft == rec.draft.endpoint else 0
        self.sessions[live.sid] = live
        self.leases.start()
        self._run_lane(self.scheduler.join(live.sid, placement))

    async def abandon(self, live: LiveSession, error: BaseException) -> None:
        """Undo a turn that could not start (its record was written, no round ran)."""
        await self.ledger.write_final(live, None, error, warm=False)

    async def release_owners(self, record: session_pb2.SessionRecord) -> None:
        """Drop a closed session's caches on the replicas its record names."""
        sid = [record.session_id]
        await asyncio.gather(
            self.targets.release(record.target.endpoint, sid, self.timeouts.release_s),
            self.drafts.release(record.draft.endpoint, sid, self.timeouts.release_s),
        )

    def cancel(self, session_id: str) -> bool:
        """Stop a session at its next round boundary; False if it is not decoding here."""
        live = self.sessions.get(session_id)
        if live is None or live.done:
            return False
        live.cancel_requested = True
        return True

    async def close(self) -> None:
        """Stop every lane; sessions still decoding end with UNAVAILABLE."""
        for task in list(self._lanes.values()):
            task.cancel()
        await asyncio.gather(*self._lanes.values(), return_exceptions=True)
        await self.commits.close()  # the records must be settled before the final ones
        await self.leases.close()
        down = Unavailable("the orchestrator is shutting down; retry on another replica")
        await self.ledger.finish([(s, None, down) for s in list(self.sessions.values())])

    def _run_lane(self, lane: LaneKey) -> None:
        task = self._lanes.get(lane)
        if task is None or task.done():
            self._lanes[lane] = asyncio.get_running_loop().create_task(self._lane(lane))

    async def _lane(self, lane: LaneKey) -> None:
        # An idle lane's first round waits for company: requests sent together arrive
        # a few ms apart, and a round that starts with the first alone prefills it
        # alone (and, alone, warms its draft) while the others wait a whole prefill
        # round for theirs (8 requests at once: a round of 1, then of 6, then of 1).
        await asyncio.sleep(self.scheduler.config.admission_window_s)
        pending: PendingCommit | None = None  # the last round's commit, in flight
        budget = self.failover.prefill_budget
        while True:
            admitted = self.scheduler.begin_round(
                lane,
                lambda sid: target_backlog(self.sessions[sid]),
                lambda sid: budget.rows(lane, self.sessions[sid].state.target_start),
            )
            ids = admitted.ids
            # A session that failed over mid-round joins this lane before that round ends;
            # one whose turn finished waits, in no round, for its commit to end it.
            batch = [self.sessions[sid] for sid in ids]
            for s in batch:
                s.prefill_chunk = admitted.chunks.get(s.sid, 0)
                s.prefill_tail = s.sid in admitted.tails
            batch = [s for s in batch if s.phase is Phase.WAITING and not s.state.finished]
            if not batch and pending is not None:
                await self.ledger.finish(await self.commits.settle(pending))
                pending = None
                continue
            if not ids:
                self._lanes.pop(lane, None)
                return
            if not batch:
                await asyncio.sleep(0.001)
                continue
            for s in batch:
                s.enter_round()
            # Work no span claims (ending sessions cancelled before their round) goes to
            # the first session's trace rather than to whichever request started the lane.
            token = otel_context.attach(batch[0].trace_context or otel_context.Context())
            try:
                pending = await self._round(lane, batch, pending)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug: fail this batch, keep the lane alive
                log.exception("a round on %s failed", lane)
                ending = await self.commits.settle(pending) if pending is not None else []
                pending = None
                ended = {s.sid for s, _, _ in ending}
                ending += [(s, None, e) for s in batch if s.sid not in ended]
                await self.ledger.finish([x for x in ending if not x[0].done])
            finally:
                otel_context.detach(token)
                for s in batch:
                    s.leave_round()

    # -- one round -----------------------------------------------------------------------

    async def _round(
        self, target: str, batch: list[LiveSession], pending: PendingCommit | None
    ) -> PendingCommit | None:
        """One round of ``batch`` while the lane's previous commit (``pending``) is in
        flight; returns this round's commit if it is left in flight."""
        now = time.monotonic()
        stop = {s.sid for s in batch if s.cancel_requested or s.expired(now)}
        ending: list[Ending] = []
        if stop and pending is not None:  # a session ends only once its commit settled
            ending += await self.commits.settle(pending)
            pending = None
        handed = {s.sid for s, _, _ in ending}
        ending += [(s, FinishReason.CANCELLED, None) for s in batch if s.sid in stop - handed]
        live = [s for s in batch if s.sid not in stop | handed]
        if not live:  # (then ``pending`` was settled)
            await self.ledger.finish(ending)
            return None
        self.refresh_usable()
        spans = RoundSpans(live, target)
        try:
            more, pending = await self._traced_round(target, live, spans, pending)
            ending += more
            if ending:
                with spans.phase(attr.SPAN_FINISH):
                    await self.ledger.finish(ending)
        except BaseException as e:
            spans.end(e)
            raise
        spans.end()
        return pending

    async def _traced_round(
        self,
        target: str,
        live: list[LiveSession],
        spans: RoundSpans,
        pending: PendingCommit | None,
    ) -> tuple[list[Ending], PendingCommit | None]:
        """Plan, propose, verify, settle the last commit, commit; returns the sessions
        that end with this round and this round's commit if it is still in flight.

        Round r - 1's commit (``pending``) runs while this round proposes and verifies;
        it is settled before this round's verdicts are applied, so a session it ends
        keeps nothing this round computed (a failover settles it before reading the
        store)."""
        started = time.perf_counter()
        # A session prefilling in chunks is not planned: it sends its chunk, drafts nothing
        # and emits nothing until its last chunk, a round that plans it as any prompt.
        chunked = [s for s in live if s.prefill_chunk]
        prefilled = prefills(live)  # what the round's time is set against
        planned = [s for s in live if not s.prefill_chunk]
        views = [session_view(s, self.planner.config.warm_above_tokens) for s in planned]
        waiting = self._waiting(target, live) + len(chunked)
        batch_plan = self.planner.plan(target, self.scheduler.target_load(target), views, waiting)
        cap = batch_plan.cap
        if any(s.state.drafter != "none" for s in planned):
            self.stats.k_caps[cap] += 1
        # Each session's depth floor weighs its drafts at what this target's rounds cost.
        costs = self.planner.cost_model(target, len(planned))
        for s in planned:
            s.state.k_policy.measured(costs)
        with spans.phase(attr.SPAN_PROPOSE) as pspan:
            plans = await self.drafting.propose(planned, spans, batch_plan)
            spans.proposed(pspan, plans, cap)
        for s in chunked:
            plans[s.sid] = Plan(chunk=s.prefill_chunk)
        if batch_plan.steps and not any(p.proposal.tokens for p in plans.values()):
            for s in planned:  # a plain round: several steps in its Verify
                plans[s.sid].steps = batch_plan.steps.get(s.sid, 1)
        last_commit = SettleOnce(self.commits, pending)
        with spans.phase(attr.SPAN_VERIFY) as vspan:
            outcome, moved = await self.failover.verify(
                target, [(s, plans[s.sid]) for s in live], last_commit.ended
            )
            seconds = time.perf_counter() - started  # before the settle: compute alone
            spans.verified(vspan, target, plans, outcome, len(moved))
        ending = list(await last_commit.endings())
        if ending:
            ended = {s.sid for s, _, _ in ending}
            live = [s for s in live if s.sid not in ended]
            views = [v for v in views if v.sid not in ended]
            for sid in ended:
                plans.pop(sid, None)
        if not live:
            self.stats.rounds += 1
            return ending, None
        committed = []
        for s in live:
            if outcome.expired and s.sid not in outcome.verdicts:
                ending.append((s, FinishReason.CANCELLED, None))  # as past a deadline
                continue
            if s.sid in outcome.errors:
                spans.fail(s, outcome.errors[s.sid])
                ending.append((s, None, outcome.errors[s.sid]))
                continue
            if s.sid in outcome.prefilled:  # a chunk: the target holds more, nothing to say
                s.state.target_start = outcome.prefilled[s.sid]
                self.stats.prefill_chunks += 1
                continue
            plan, verdict = plans[s.sid], outcome.verdicts[s.sid]
            spans.verdict(s, len(plan.proposal.tokens), verdict.accepted)
            kept = s.state.commit(plan.proposal, verdict)
            s.logprobs.extend(outcome.logprobs.get(s.sid, ())[: len(kept)])
            committed.append((s, kept))
        self._move(target, moved)
        undisturbed = not (
            moved or outcome.errors or outcome.expired or ending or self.drafting.warmups.beside_now
        )
        if undisturbed and not batch_plan.warm:
            self.failover.prefill_budget.observe(target, prefilled, seconds)
        result = RoundOutcome(
            drafted={sid: len(p.proposal.tokens) for sid, p in plans.items() if not p.chunk},
            accepted={
                sid: v.accepted
                for sid, v in outcome.verdicts.items()
                if sid not in outcome.prefilled
            },
            seconds=seconds,
            steps=max((p.steps for p in plans.values()), default=1),
            compute_s=outcome.compute_s,
            clean=undisturbed and not chunked,  # a chunk's time is not its sessions' rounds'
        )
        self.planner.observe(target, views, batch_plan, result)
        pending = self.commits.start(target, committed, moved, spans)
        # The lane's next round plans and sends its first call before it yields; what
        # decides none of it is counted then, in the event loop's next pass.
        asyncio.get_running_loop().call_soon(
            self._tally, target, batch_plan, plans, committed, result
        )
        if pending is not None and moved:
            # A moved session's next round runs on another lane, which does not wait for
            # this lane's commit: settle it now (failover is rare).
            ending += await self.commits.settle(pending)
            pending = None
        return ending, pending

    def _waiting(self, target: str, live: list[LiveSession]) -> int:
        """Sessions on ``target`` still to decode that are not in this round (waiting for
        admission, or rotated out of a batch past ``max_batch``)."""
        here = {s.sid for s in live}
        waiting = 0
        for sid, s in self.sessions.items():
            placement = self.scheduler.placement(sid)
            on_target = placement is not None and placement.target == target
            waiting += on_target and sid not in here and not s.state.finished
        return waiting

    def _tally(
        self,
        target: str,
        plan: BatchPlan,
        plans: dict[str, Plan],
        committed: list[tuple[LiveSession, list[int]]],
        result: RoundOutcome,
    ) -> None:
        """Count a round whose verdicts were applied: the runner's stats, the debug log."""
        self.stats.rounds += 1
        self.stats.multi_step_rounds += result.steps > 1
        for s, _ in committed:
            mine = plans[s.sid]
            self.stats.note_verdict(len(mine.proposal.tokens), result.accepted[s.sid], mine.steps)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "round on %s: %d sessions, k cap %d, steps %d, drafts %s, accepted %s, %.3f s%s",
                target,
                len(committed),
                plan.cap,
                result.steps,
                [len(plans[s.sid].proposal.tokens) for s, _ in committed],
                [result.accepted[s.sid] for s, _ in committed],
                result.seconds,
                "" if result.clean and plan.timeable else " (not timed)",
            )

    def _move(self, old: str, moved: dict[str, str]) -> None:
        """Sessions replayed on another target live there from now on."""
        for sid, new_target in moved.items():
            placement = self.scheduler.placement(sid)
            assert placement is not None
            self._run_lane(self.scheduler.move(sid, Placement(new_target, placement.draft)))
        self.ledger.release_later(self.targets, old, list(moved))  # in case it was only slow
