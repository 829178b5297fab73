"""The distributed speculative loop: one asyncio task per lane, one round at a time.

A round of a lane (see :mod:`specserve.orchestrator.fleet.scheduler`) is the round of
:class:`~specserve.engine.speculative.SpeculativeEngine`, over gRPC:

1. sessions whose client left, whose deadline passed or that were cancelled end
   here, at the round boundary;
2. ``Propose`` on each draft replica the batch uses, in parallel, with the k per
   session the planner chose (:class:`~specserve.orchestrator.policy.Planner`: the
   runner gives it the sessions as plain views, does what its plan says, and tells
   it what the round did); a draft replica that fails or misses its deadline costs
   only speculation: its sessions verify with k = 0 this round and move to another
   draft replica (or stay at k = 0) if it is lost, or stay if it is only slow. A
   cold session the plan warms is prefilled on its draft replica inside the round
   (:meth:`RoundRunner._warm_now`, then it drafts in it) or beside the rounds
   (:func:`calls.warm`, verifying at k = 0 until then);
3. one ``Verify`` on the lane's target. If the target is lost, the sessions'
   committed tokens are re-read from the store and the same round — same drafts,
   same (seed, round index, position) draws — is replayed on another target with
   the whole history, so the output does not change (with ``--kv-snapshots`` the
   new target first restores the saved KV chunks and gets only the tail). A
   target past the target timeout that still answers SERVING is slow, not lost:
   the round is replayed on it once more (its KV is warm there; another replica
   would have to prefill every session) and only a second miss fails it over;
4. ``DecodeState.commit``, one pipelined atomic commit per session to the store,
   then the tokens go to the clients. A session whose record changed under it
   (another replica took it over) stops without writing.

With draft-ahead on, step 3 also sends each eligible session's bet on round
r + 1 to its draft replica, and step 2 of round r + 1 uses a bet that came true
instead of proposing (:mod:`specserve.orchestrator.round.draft_ahead`).

Commits and endings (releasing KV, final records) are the
:class:`~specserve.orchestrator.round.ledger.Ledger`'s; the round's spans are
:class:`~specserve.orchestrator.round.spans.RoundSpans`'; saving and restoring KV
snapshots are :class:`~specserve.orchestrator.snapshots.kv_snapshots.KvSnapshots`'s (after
each commit, off the round's path; before a replay).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace

from specserve.engine.decode_state import FinishReason
from specserve.engine.errors import EngineError
from specserve.orchestrator.errors import VersionConflict
from specserve.orchestrator.fleet.replicas import ReplicaPool
from specserve.orchestrator.fleet.scheduler import LaneKey, Placement, Scheduler
from specserve.orchestrator.fleet.stall import DEFAULT_STALL_S
from specserve.orchestrator.policy import (
    BatchPlan,
    Cache,
    Planner,
    RoundOutcome,
    SessionView,
    WarmWhere,
)
from specserve.orchestrator.round import calls, draft_ahead
from specserve.orchestrator.round.bets import BetBook
from specserve.orchestrator.round.calls import Plan
from specserve.orchestrator.round.draft_ahead import Outcome
from specserve.orchestrator.round.ledger import Ending, Ledger
from specserve.orchestrator.round.spans import RoundSpans
from specserve.orchestrator.session import LiveSession
from specserve.orchestrator.snapshots.kv_snapshots import KvSnapshots
from specserve.orchestrator.store.leases import LeaseKeeper
from specserve.orchestrator.store.session_store import SessionStore
from specserve.serving.errors import Unavailable
from specserve.telemetry import attributes as attr
from specserve.v1 import session_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)  # six floats: never positional
class RoundTimeouts:
    draft_s: float = 2.0  # a Propose slower than this costs the round its drafts
    draft_warm_s: float = 120.0  # a draft replica's prefill of a session's history
    target_s: float = 60.0  # a Verify slower than this is replayed, twice: a lost target
    failover_s: float = 20.0  # how long a session waits for some target to come back
    release_s: float = 2.0
    # A target whose model thread stood still this long while it held a round is lost
    # (hung); 0 = wait for target_s alone.
    stall_s: float = DEFAULT_STALL_S


@dataclass
class RunnerStats:
    """Plain counts the metrics collector reads (:mod:`specserve.orchestrator.metrics`).

    The session-round counts grow exactly as the sessions' usage does
    (:class:`~specserve.engine.decode_state.SessionStats`): one per committed
    verdict, whether or not the store then accepted the commit.
    """

    rounds: int = 0  # batch rounds (one Verify per lane round)
    session_rounds: int = 0  # verdicts: one per session per round
    drafts: int = 0  # session rounds that verified at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # Draft position (1 = the first draft token) -> tokens drafted / accepted there.
    drafted_by_position: collections.Counter[int] = field(default_factory=collections.Counter)
    accepted_by_position: collections.Counter[int] = field(default_factory=collections.Counter)
    # Sessions per target forward, as the target reported them (its calls coalesce).
    verify_batch_sizes: collections.Counter[int] = field(default_factory=collections.Counter)
    draft_fallbacks: int = 0  # session rounds that wanted drafts but verified at k = 0
    draft_warmups: int = 0  # sessions whose draft cache was rebuilt beside the rounds
    draft_warmups_declined: int = 0  # session rounds cold at k = 0: its warm-up would not repay
    k_caps: collections.Counter[int] = field(default_factory=collections.Counter)  # by cap
    target_failovers: int = 0  # sessions moved to another target mid-round
    replayed_rounds: int = 0  # Verify batches replayed on another target after a loss
    slow_verifies: int = 0  # Verify batches past the target timeout on a SERVING target
    target_history_resends: int = 0  # sessions a target asked for the whole history
    draft_ahead_bets: int = 0  # draft-ahead calls' sessions
    draft_ahead: collections.Counter[Outcome] = field(default_factory=collections.Counter)

    def note_verdict(self, drafted: int, accepted: int) -> None:
        self.session_rounds += 1
        self.drafts += drafted > 0
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        for position in range(1, drafted + 1):
            self.drafted_by_position[position] += 1
        for position in range(1, accepted + 1):
            self.accepted_by_position[position] += 1


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
        self._warming_beside = 0  # draft warm-ups under way beside the rounds
        self.sessions: dict[str, LiveSession] = {}
        self.stats = RunnerStats()
        self._lanes: dict[LaneKey, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self.bets = BetBook(drafts, self.timeouts.draft_s)
        self.ledger = Ledger(
            scheduler, drafts, targets, store, self.sessions, self.timeouts.release_s
        )
        self.leases = LeaseKeeper(store, self.sessions.keys)

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
        self.bets.close()
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
        while True:
            ids = self.scheduler.begin_round(lane, self._target_backlog)
            if not ids:
                self._lanes.pop(lane, None)
                return
            # A session that failed over mid-round joins this lane before that round ends.
            batch = [self.sessions[sid] for sid in ids if not self.sessions[sid].in_round]
            if not batch:
                await asyncio.sleep(0.001)
                continue
            for s in batch:
                s.in_round = True
            # Work no span claims (ending sessions cancelled before their round) goes to
            # the first session's trace rather than to whichever request started the lane.
            token = otel_context.attach(batch[0].trace_context or otel_context.Context())
            try:
                await self._round(lane[0], batch)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug: fail this batch, keep the lane alive
                log.exception("a round on %s failed", lane[0])
                await self.ledger.finish([(s, None, e) for s in batch if not s.done])
            finally:
                otel_context.detach(token)
                for s in batch:
                    s.in_round = False
                    if s.done:
                        self.bets.drop(s.sid)

    # -- one round -----------------------------------------------------------------------

    async def _round(self, target: str, batch: list[LiveSession]) -> None:
        now = time.monotonic()
        ending: list[Ending] = [
            (s, FinishReason.CANCELLED, None) for s in batch if s.cancel_requested or s.expired(now)
        ]
        live = [s for s in batch if not (s.cancel_requested or s.expired(now))]
        if not live:
            await self.ledger.finish(ending)
            return
        self.refresh_usable()
        spans = RoundSpans(live, target)
        try:
            ending += await self._traced_round(target, live, spans)
            if ending:
                with spans.phase(attr.SPAN_FINISH):
                    await self.ledger.finish(ending)
        except BaseException as e:
            spans.end(e)
            raise
        spans.end()

    async def _traced_round(
        self, target: str, live: list[LiveSession], spans: RoundSpans
    ) -> list[Ending]:
        """Plan, propose, verify, commit; returns the sessions that end with this round."""
        started = time.perf_counter()
        views = [self._view(s) for s in live]
        batch_plan = self.planner.plan(target, self.scheduler.target_load(target), views)
        cap = batch_plan.cap
        if any(s.state.drafter != "none" for s in live):
            self.stats.k_caps[cap] += 1
        self.stats.draft_warmups_declined += batch_plan.declined
        with spans.phase(attr.SPAN_PROPOSE) as pspan:
            plans = await self._propose(target, live, spans, batch_plan)
            if pspan.is_recording():
                pspan.set_attributes(
                    {
                        attr.BATCH_SIZE: sum(1 for p in plans.values() if p.draft is not None),
                        attr.SPEC_DRAFTED: sum(len(p.proposal.tokens) for p in plans.values()),
                        attr.SPEC_K_CAP: cap,
                    }
                )
        self._bet(target, live, plans, cap)
        with spans.phase(attr.SPAN_VERIFY) as vspan:
            outcome, moved = await self._verify(target, [(s, plans[s.sid]) for s in live])
            seconds = time.perf_counter() - started
            if vspan.is_recording():
                vspan.set_attributes(
                    {
                        attr.TARGET: target,
                        attr.BATCH_SIZE: max(outcome.batch_sizes, default=0),
                        attr.SPEC_DRAFTED: sum(len(p.proposal.tokens) for p in plans.values()),
                        attr.SPEC_ACCEPTED: sum(v.accepted for v in outcome.verdicts.values()),
                        attr.REPLAYED: len(moved),
                    }
                )
        self.stats.rounds += 1
        ending: list[Ending] = []
        committed = []
        for s in live:
            if outcome.expired and s.sid not in outcome.verdicts:
                ending.append((s, FinishReason.CANCELLED, None))  # as past a deadline
                continue
            if s.sid in outcome.errors:
                spans.fail(s, outcome.errors[s.sid])
                ending.append((s, None, outcome.errors[s.sid]))
                continue
            plan, verdict = plans[s.sid], outcome.verdicts[s.sid]
            drafted = len(plan.proposal.tokens)
            self.stats.note_verdict(drafted, verdict.accepted)
            spans.verdict(s, drafted, verdict.accepted)
            kept = s.state.commit(plan.proposal, verdict)
            s.logprobs.extend(outcome.logprobs.get(s.sid, ())[: len(kept)])
            committed.append((s, kept))
        self._move(target, moved)
        result = RoundOutcome(
            drafted={sid: len(p.proposal.tokens) for sid, p in plans.items()},
            accepted={sid: v.accepted for sid, v in outcome.verdicts.items()},
            seconds=seconds,
            clean=not (moved or outcome.errors or outcome.expired or self._warming_beside),
        )
        self.planner.observe(target, views, batch_plan, result)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "round on %s: %d sessions, k cap %d, drafts %s, accepted %s, %.3f s%s",
                target,
                len(live),
                cap,
                [len(plans[s.sid].proposal.tokens) for s in live],
                [outcome.verdicts[s.sid].accepted for s in live if s.sid in outcome.verdicts],
                seconds,
                "" if result.clean and batch_plan.timeable else " (not timed)",
            )
        with spans.phase(attr.SPAN_COMMIT) as cspan:
            if cspan.is_recording():
                cspan.set_attribute(attr.BATCH_SIZE, len(committed))
            ending += await self.ledger.commit(committed)
        if self.snapshots is not None:  # in the background, from where each session is now
            self.snapshots.after_commit([(moved.get(s.sid, target), s) for s, _ in committed])
        return ending

    def _move(self, old: str, moved: dict[str, str]) -> None:
        """Sessions replayed on another target live there from now on."""
        for sid, new_target in moved.items():
            placement = self.scheduler.placement(sid)
            assert placement is not None
            group = self.scheduler.least_loaded_group(new_target)
            self._run_lane(self.scheduler.move(sid, Placement(new_target, group, placement.draft)))
        self._release_later(self.targets, old, list(moved))  # in case it was only slow

    async def _propose(
        self, target: str, live: list[LiveSession], spans: RoundSpans, plan: BatchPlan
    ) -> dict[str, Plan]:
        bets = await self.bets.collect(s.sid for s in live)
        by_draft: dict[str, list[tuple[LiveSession, int]]] = collections.defaultdict(list)
        inside: dict[str, list[tuple[LiveSession, int]]] = collections.defaultdict(list)
        beside: dict[str, list[LiveSession]] = collections.defaultdict(list)
        wanted: list[str] = []  # sessions that want drafts this round
        plans: dict[str, Plan] = collections.defaultdict(Plan)
        for s in live:
            placement = self.scheduler.placement(s.sid)
            assert placement is not None
            if s.state.drafter == "none":
                continue
            if placement.draft is None and self.scheduler.drafts:  # a draft replica is back
                placement.draft = self.scheduler.pick_draft()
                s.state.draft_start = 0
            k = plan.k.get(s.sid, 0)
            spans.asked(s, k)
            where = plan.warm.get(s.sid)
            if where is not None and placement.draft is not None:
                if where is WarmWhere.INSIDE:
                    inside[placement.draft].append((s, k))
                else:
                    beside[placement.draft].append(s)
                continue
            if k > 0:
                wanted.append(s.sid)
            if s.sid in bets:
                bet, answer = bets[s.sid]
                settled = draft_ahead.settle(bet, s.state, answer, placement.draft, k)
                self.stats.draft_ahead[settled.outcome] += 1
                if settled.proposal is not None:  # a hit: no Propose this round
                    plans[s.sid] = Plan(settled.proposal)
                    s.state.draft_start = bet.draft_start
                    continue
            if placement.draft is not None and k > 0:
                by_draft[placement.draft].append((s, k))
        timeout = self._timeout(self.timeouts.draft_s, live)
        found = await asyncio.gather(
            *(calls.propose(self.drafts, ep, items, timeout) for ep, items in by_draft.items())
        )
        for (ep, items), got in zip(by_draft.items(), found, strict=True):
            plans.update(got)
            if ep not in self.drafts.usable():  # the replica failed: move its sessions
                for s, _ in items:
                    self.scheduler.set_draft(s.sid, self.scheduler.pick_draft(avoid=[ep]))
                    s.state.draft_start = 0
                self._release_later(self.drafts, ep, [s.sid for s, _ in items])
        # No draft replica, a failed or slow one, or a refusal: these verify at k = 0.
        self.stats.draft_fallbacks += sum(1 for sid in wanted if sid not in plans)
        for ep, items in inside.items():  # after this round's Propose: never in its way
            plans.update(await self._warm_now(ep, items, live))
        for ep, sessions in beside.items():
            self._warm_later(ep, sessions)
        return plans

    async def _warm_now(
        self, endpoint: str, items: list[tuple[LiveSession, int]], live: list[LiveSession]
    ) -> dict[str, Plan]:
        """Prefill cold sessions on their draft replica inside this round, and draft (the
        round waits for it; the planner asks for it where nothing else would be held back
        or where draft and target share hardware). The call's wall time is the warm-up's
        cost the planner learns."""
        sessions = [s for s, _ in items]
        behind = self._draft_backlog(sessions)
        timeout = self._timeout(self.timeouts.draft_warm_s, live)
        started = time.perf_counter()
        plans = await calls.propose(self.drafts, endpoint, items, timeout, resend_up_to=None)
        if len(plans) == len(items):
            self.planner.observe_warm(behind, time.perf_counter() - started)
        self.stats.draft_warmups += len(sessions)
        if endpoint not in self.drafts.usable():  # the replica failed: move its sessions
            for s in sessions:
                self.scheduler.set_draft(s.sid, self.scheduler.pick_draft(avoid=[endpoint]))
                s.state.draft_start = 0
        return plans

    def _view(self, s: LiveSession) -> SessionView:
        """The session as the planner sees it."""
        st = s.state
        behind = self._draft_backlog([s])
        cache = Cache.WARM
        if s.draft_warming:
            cache = Cache.WARMING
        elif st.drafter == "model" and behind > self.planner.config.warm_above_tokens:
            cache = Cache.COLD  # n-gram drafters index any history cheaply
        return SessionView(
            sid=s.sid,
            drafter=str(st.drafter),
            greedy=st.params.greedy,
            requested_k=st.k_policy.fixed,
            tokens_left=st.stop.max_new_tokens - len(st.completion),
            alpha=st.k_policy.alpha,
            turn_drafted=st.stats.drafted,
            turn_accepted=st.stats.accepted,
            cache=cache,
            draft_behind=behind,
            target_behind=self._backlog(s),
        )

    def _target_backlog(self, sid: str) -> int:
        """Tokens of a session's history its target has not seen (its prefill)."""
        return self._backlog(self.sessions[sid])

    @staticmethod
    def _backlog(s: LiveSession) -> int:
        return len(s.state.tokens) - s.state.target_start

    @staticmethod
    def _draft_backlog(sessions: list[LiveSession]) -> int:
        """History tokens of these sessions their draft replica has not seen (a warm-up)."""
        return sum(len(s.state.tokens) - s.state.draft_start for s in sessions)

    def _warm_later(self, endpoint: str, sessions: list[LiveSession]) -> None:
        """Prefill sessions on their draft replica beside the rounds (:func:`calls.warm`)."""
        for s in sessions:
            s.draft_warming = True
        self.stats.draft_warmups += len(sessions)
        self._warming_beside += 1

        async def run() -> None:
            try:
                await calls.warm(self.drafts, endpoint, sessions, self.timeouts.draft_warm_s)
            finally:
                self._warming_beside -= 1
                lost = endpoint not in self.drafts.usable()
                for s in sessions:
                    s.draft_warming = False
                    placement = self.scheduler.placement(s.sid)
                    if placement is None:  # ended meanwhile: do not leave its cache there
                        self._release_later(self.drafts, endpoint, [s.sid])
                        continue
                    if placement.draft != endpoint:  # moved meanwhile: that replica is cold
                        s.state.draft_start = 0
                    elif lost:
                        self.scheduler.set_draft(s.sid, self.scheduler.pick_draft(avoid=[endpoint]))
                        s.state.draft_start = 0

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _bet(self, target: str, live: list[LiveSession], plans: dict[str, Plan], cap: int) -> None:
        """Draft round r + 1 while round r is verified, where the draft would idle meanwhile."""
        bets = []
        idle: dict[tuple[str, LaneKey], bool] = {}
        for s in live:
            placement = self.scheduler.placement(s.sid)
            plan = plans.get(s.sid)
            if placement is None or plan is None or placement.draft is None:
                continue
            key = (placement.draft, placement.lane)
            if key not in idle:
                idle[key] = self.scheduler.draft_idle_while_verifying(
                    placement.lane, placement.draft
                )
            if not idle[key]:
                continue
            bet = draft_ahead.place(s.state, plan.proposal, placement.draft, cap)
            if bet is not None:
                bets.append(bet)
        self.stats.draft_ahead_bets += len(bets)
        self.bets.place(bets)

    def _release_later(self, pool: ReplicaPool, endpoint: str, ids: list[str]) -> None:
        """Best effort, off the round's path: drop caches on a replica sessions left."""
        if not ids:
            return
        task = asyncio.get_running_loop().create_task(
            pool.release(endpoint, ids, self.timeouts.release_s)
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _verify(
        self, target: str, items: list[tuple[LiveSession, Plan]]
    ) -> tuple[calls.VerifyOutcome, dict[str, str]]:
        """Verify on ``target``; if it is lost, replay on others. Returns the outcome and moves."""
        total = calls.VerifyOutcome()
        moved: dict[str, str] = {}
        give_up = time.monotonic() + self.timeouts.failover_s
        todo = items
        slow_before = False  # this replica already missed the target timeout once
        while todo:
            timeout = self._timeout(self.timeouts.target_s, [s for s, _ in todo])
            cut = timeout < self.timeouts.target_s
            out = await calls.verify(
                self.targets, target, todo, timeout, deadline_cut=cut, stall_s=self.timeouts.stall_s
            )
            if out.expired:  # the clients left, not the target: no failover
                total.expired = True
                break
            if out.slow:
                self.stats.slow_verifies += 1
                if not slow_before:  # busy, not broken: same replica, same round
                    slow_before = True
                    log.warning("%s; replaying the round there once", out.why)
                    trace.get_current_span().add_event(
                        "slow target", {attr.TARGET: target, attr.BATCH_SIZE: len(todo)}
                    )
                    continue
                out.lost = True  # twice: as good as lost for these sessions
                self.targets.mark_failed(target, out.why)
            total.verdicts.update(out.verdicts)
            total.logprobs.update(out.logprobs)
            total.errors.update(out.errors)
            total.batch_sizes.extend(out.batch_sizes)
            for size in out.batch_sizes:
                self.stats.verify_batch_sizes[size] += 1
            self.stats.target_history_resends += out.resent
            todo = [
                (s, p) for s, p in todo if s.sid not in out.verdicts and s.sid not in out.errors
            ]
            if not todo:
                break
            if out.lost:
                self.planner.forget(target)  # a replacement may be another machine
            todo = await self._resume_from_store(todo, total)
            next_target = await self._another_target(give_up)
            if next_target is None:
                for s, _ in todo:
                    total.errors[s.sid] = Unavailable(
                        f"no target replica could verify the session; retry later "
                        f"(last failure: {out.why})"
                    )
                break
            log.warning("replaying a round of %d sessions on target %s", len(todo), next_target)
            trace.get_current_span().add_event(
                "replay", {attr.TARGET: next_target, attr.BATCH_SIZE: len(todo), "why": out.why}
            )
            self.stats.replayed_rounds += 1
            target = next_target
            for s, _ in todo:
                s.state.target_start = 0  # the new replica rebuilds the KV from the history
                moved[s.sid] = target
                self.stats.target_failovers += 1
            if self.snapshots is not None:  # ... or from saved chunks, up to a short tail
                await self.snapshots.restore(target, [s for s, _ in todo])
        return total, moved

    async def _resume_from_store(
        self, todo: list[tuple[LiveSession, Plan]], total: calls.VerifyOutcome
    ) -> list[tuple[LiveSession, Plan]]:
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
        while True:
            self.refresh_usable()
            usable = self.scheduler.targets
            if usable:
                return min(usable, key=self.scheduler.target_load)
            if time.monotonic() >= give_up:
                return None
            await asyncio.sleep(0.2)

    def _timeout(self, base: float, sessions: list[LiveSession]) -> float:
        """The configured timeout, cut to the latest client deadline of the batch."""
        deadlines = [s.deadline for s in sessions]
        if not deadlines or any(d is None for d in deadlines):
            return base
        left = max(deadlines) - time.monotonic()  # type: ignore[type-var,operator]
        return max(0.05, min(base, left))
