"""The distributed speculative loop: one asyncio task per lane, one round at a time.

A round of a lane (see :mod:`specserve.orchestrator.scheduler`) is the round of
:class:`~specserve.engine.speculative.SpeculativeEngine`, over gRPC:

1. sessions whose client left, whose deadline passed or that were cancelled end
   here, at the round boundary;
2. ``Propose`` on each draft replica the batch uses, in parallel (k from each
   session's policy under the target's load cap); a draft replica that fails or
   misses its deadline costs only speculation: its sessions verify with k = 0
   this round and move to another draft replica (or stay at k = 0) if it is
   lost, or stay if it is only slow. A session its draft replica lacks a long
   history of is prefilled there beside the rounds (:func:`calls.warm`), from the
   round after its target prefilled it and only if the measured gain over the
   batch's remaining tokens repays the measured warm-up of the round's cold sessions
   (:mod:`~specserve.orchestrator.warm_payback`), and verifies at k = 0 until then
   (a lone session holds no other back: it is prefilled inside its round, its
   first one included, and drafts in it, :meth:`RoundRunner._warm_now`; so are a
   batch's cold sessions where warming inside a round was measured to cost the
   batch less than beside the rounds, as on shared cores). The round's k cap is
   the load curve's bound, or under it the cap predicted to finish the batch's
   slowest turn soonest: the rounds its sessions' acceptance says it needs times
   the round time predicted for their drafts from the measured rounds
   (:mod:`specserve.orchestrator.goodput`);
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
instead of proposing (:mod:`specserve.orchestrator.draft_ahead`).

Commits and endings (releasing KV, final records) are the
:class:`~specserve.orchestrator.ledger.Ledger`'s; the round's spans are
:class:`~specserve.orchestrator.round_spans.RoundSpans`'; saving and restoring KV
snapshots are :class:`~specserve.orchestrator.kv_snapshots.KvSnapshots`'s (after
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
from specserve.engine.k_policy import expected_tokens
from specserve.orchestrator import calls, draft_ahead
from specserve.orchestrator.acceptance_prior import AcceptancePrior
from specserve.orchestrator.bets import BetBook
from specserve.orchestrator.calls import WARM_ABOVE_TOKENS, Plan
from specserve.orchestrator.draft_ahead import Outcome
from specserve.orchestrator.errors import VersionConflict
from specserve.orchestrator.goodput import GoodputCaps, Outlook, Prospect
from specserve.orchestrator.kv_snapshots import KvSnapshots
from specserve.orchestrator.leases import LeaseKeeper
from specserve.orchestrator.ledger import Ending, Ledger
from specserve.orchestrator.replicas import ReplicaPool
from specserve.orchestrator.round_spans import RoundSpans
from specserve.orchestrator.scheduler import LaneKey, Placement, Scheduler
from specserve.orchestrator.session import LiveSession
from specserve.orchestrator.session_store import SessionStore
from specserve.orchestrator.stall import DEFAULT_STALL_S
from specserve.orchestrator.warm_payback import WarmPayback
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
class _LostTime:
    """What the rounds lost while one draft warm-up ran beside them (the payback rule's
    cost of warming beside the rounds)."""

    seconds: float = 0.0
    rounds: int = 0  # rounds charged
    unpredicted: bool = False  # a round's time could not be predicted: charge the wall time

    def cost(self, wall: float) -> float:
        """The warm-up's cost: what the rounds beside it lost, or its wall time where one
        of them could not be predicted or none ended beside it (nothing said it was free)."""
        return wall if self.unpredicted or not self.rounds else max(0.0, self.seconds)


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
    draft_warmups_declined: int = 0  # session rounds cold at k = 0: a warm-up would not repay
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
    ) -> None:
        self.scheduler = scheduler
        self.drafts = drafts
        self.targets = targets
        self.store = store
        self.timeouts = timeouts or RoundTimeouts()
        self.snapshots = snapshots  # None: --kv-snapshots is off
        # The k cap under the load curve, from measured round times (None: the curve alone).
        self.caps = GoodputCaps() if scheduler.config.measured_k_cap else None
        self.payback = WarmPayback()  # weighs draft warm-ups against the measured gain
        self._beside: list[_LostTime] = []  # one per draft warm-up under way beside the rounds
        self.prior = AcceptancePrior()  # where a new session's acceptance estimate starts
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
        """Propose, verify, commit; returns the sessions that end with this round."""
        started = time.perf_counter()
        cap = self.scheduler.k_cap(target)
        # Measured caps only for rounds where some session may draft (not plain decoding).
        drafting = any(s.state.drafter != "none" for s in live)
        caps = self.caps if drafting else None
        if caps is not None:
            self._plan_with_measured_costs(target, live)
            cap = caps.choose(target, len(live), cap, self._outlook(live, cap, self.prior))
        measurable = caps is not None and self._timeable(live, cap)
        if drafting:
            self.stats.k_caps[cap] += 1
        declined = self.stats.draft_warmups_declined
        with spans.phase(attr.SPAN_PROPOSE) as pspan:
            plans = await self._propose(target, live, spans, cap)
            if caps is not None and self.stats.draft_warmups_declined > declined:
                caps.give_up(target, len(live), cap)  # a cold session stays cold
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
            self.prior.observe(s.state.drafter, s.state.params.greedy, drafted, verdict.accepted)
            spans.verdict(s, drafted, verdict.accepted)
            kept = s.state.commit(plan.proposal, verdict)
            s.logprobs.extend(outcome.logprobs.get(s.sid, ())[: len(kept)])
            committed.append((s, kept))
        self._move(target, moved)
        depth = max((len(p.proposal.tokens) for p in plans.values()), default=0)
        drafts = sum(len(p.proposal.tokens) for p in plans.values())
        if not (moved or outcome.errors or outcome.expired):
            if caps is not None and measurable:
                caps.observe(target, len(live), depth, drafts, seconds)
            self._charge_warm_ups(target, live, depth, drafts, seconds)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "round on %s: %d sessions, k cap %d, drafts %s, accepted %s, %.3f s%s",
                target,
                len(live),
                cap,
                [len(plans[s.sid].proposal.tokens) for s in live],
                [outcome.verdicts[s.sid].accepted for s in live if s.sid in outcome.verdicts],
                seconds,
                "" if measurable else " (not timed)",
            )
        with spans.phase(attr.SPAN_COMMIT) as cspan:
            if cspan.is_recording():
                cspan.set_attribute(attr.BATCH_SIZE, len(committed))
            ending += await self.ledger.commit(committed)
        self._learn_turns(ending)
        if self.snapshots is not None:  # in the background, from where each session is now
            self.snapshots.after_commit([(moved.get(s.sid, target), s) for s, _ in committed])
        return ending

    def _learn_turns(self, ending: list[Ending]) -> None:
        """Turns that end: their acceptance (accepted drafts over draft trials) joins
        the spread the prior expects of new turns."""
        for s, _, _ in ending:
            st = s.state.stats
            trials = st.accepted + st.rejections
            self.prior.observe_turn(s.state.drafter, s.state.params.greedy, st.accepted, trials)

    def _move(self, old: str, moved: dict[str, str]) -> None:
        """Sessions replayed on another target live there from now on."""
        for sid, new_target in moved.items():
            placement = self.scheduler.placement(sid)
            assert placement is not None
            group = self.scheduler.least_loaded_group(new_target)
            self._run_lane(self.scheduler.move(sid, Placement(new_target, group, placement.draft)))
        self._release_later(self.targets, old, list(moved))  # in case it was only slow

    async def _propose(
        self, target: str, live: list[LiveSession], spans: RoundSpans, cap: int
    ) -> dict[str, Plan]:
        bets = await self.bets.collect(s.sid for s in live)
        by_draft: dict[str, list[tuple[LiveSession, int]]] = collections.defaultdict(list)
        cold: dict[str, list[LiveSession]] = collections.defaultdict(list)
        k_of: dict[str, int] = {}  # what each cold session would draft
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
            k = s.state.next_k(cap)
            spans.asked(s, k)
            if k > 0 and placement.draft is not None and (s.draft_warming or self._cold(s)):
                if self._may_warm(s, alone=len(live) == 1):
                    cold[placement.draft].append(s)
                    k_of[s.sid] = k
                continue  # verifies at k = 0 until its draft cache is warm
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
                self.payback.forget(ep)
                for s, _ in items:
                    self.scheduler.set_draft(s.sid, self.scheduler.pick_draft(avoid=[ep]))
                    s.state.draft_start = 0
                self._release_later(self.drafts, ep, [s.sid for s, _ in items])
        # No draft replica, a failed or slow one, or a refusal: these verify at k = 0.
        self.stats.draft_fallbacks += sum(1 for sid in wanted if sid not in plans)
        for ep, sessions in cold.items():  # after this round's Propose: never in its way
            # A lone session holds nobody else's round back; a batch's round waits only
            # where warming inside a round was measured to cost less than beside them.
            inside = len(live) == 1 or self.payback.cheaper_inside(ep)
            # A requested k is drafted: only adaptive sessions weigh the warm-up.
            asked = [s for s in sessions if s.state.k_policy.fixed is not None]
            weighed = [s for s in sessions if s.state.k_policy.fixed is None]
            if weighed and not self._warm_repays(target, ep, weighed, live, inside=inside):
                weighed = []
            sessions = asked + weighed
            if not sessions:
                continue
            if inside:
                plans.update(await self._warm_now(ep, [(s, k_of[s.sid]) for s in sessions], live))
            else:
                self._warm_later(ep, sessions)
        return plans

    async def _warm_now(
        self, endpoint: str, items: list[tuple[LiveSession, int]], live: list[LiveSession]
    ) -> dict[str, Plan]:
        """Prefill cold sessions on their draft replica inside this round, and draft.

        For a lone session: no other session's round waits for the prefill, and the
        session drafts this round instead of verifying at k = 0 beside a warm-up (where
        draft and target share cores, both of them slowed by the other: a lone
        session's first rounds at k = 0 took 0.5-1.0 s instead of 0.21 s). For the cold
        sessions of a batch only where warm-ups inside a round were measured to cost
        less than beside the rounds (:meth:`WarmPayback.cheaper_inside`): on 2 shared
        cores 4 sessions' rounds took 1.4 s instead of 0.26 s for 5 rounds beside a
        warm-up that takes 0.6 s alone. The call is timed as a warm-up inside a round
        (its drafts included) for the payback rule.
        """
        sessions = [s for s, _ in items]
        behind = self._draft_backlog(sessions)
        timeout = self._timeout(self.timeouts.draft_warm_s, live)
        started = time.perf_counter()
        plans = await calls.propose(self.drafts, endpoint, items, timeout, resend_up_to=None)
        if len(plans) == len(items):
            self.payback.observe(endpoint, behind, time.perf_counter() - started, inside=True)
        self.stats.draft_warmups += len(sessions)
        if endpoint not in self.drafts.usable():  # the replica failed: move its sessions
            self.payback.forget(endpoint)
            for s in sessions:
                self.scheduler.set_draft(s.sid, self.scheduler.pick_draft(avoid=[endpoint]))
                s.state.draft_start = 0
        return plans

    def _plan_with_measured_costs(self, target: str, live: list[LiveSession]) -> None:
        """Each session's k policy plans this round with what drafting was measured to
        cost on ``target`` at this batch size (its static guess until that is timed):
        the k it would draft under each cap, which the cap's outlook weighs, then follows
        this machine's rounds (a bfloat16 draft on the Xeon: 0.23 of a plain round a
        drafted token, where the guess says 0.55; at acceptance 0.85 that is 4-5 drafts
        planned instead of 2)."""
        assert self.caps is not None
        measured = self.caps.relative_cost(target, len(live))
        for s in live:
            s.state.k_policy.measured(measured)

    @staticmethod
    def _outlook(
        live: list[LiveSession], limit: int, prior: AcceptancePrior | None = None
    ) -> Outlook:
        """cap (up to ``limit``) -> the round its sessions expect under it
        (:class:`~specserve.orchestrator.goodput.Prospect`): the tokens they expect to
        commit, the most drafts any of them would make, their drafts together, and the
        rounds the slowest of their turns needs, each from its policy and running
        acceptance. A session whose draft warm-up is under way, or was declined at this
        batch size, commits one token under any cap (it verifies at k = 0 whatever the
        cap); another cold one counts as warm (it drafts once a cap above 0 lets it
        warm, so a round of new sessions does not hold them at k = 0). Of the sessions
        that have judged no drafts yet this turn, the one with the most to go is taken
        at its acceptance less the shortfall the ``prior`` expects of the lowest of that
        many new turns. One table for every cap, built once a round."""
        limit = max(limit, 0)
        idle = [RoundRunner._not_drafting(s, live) for s in live]
        plain = [(1.0, 0)] * (limit + 1)
        each = [plain if idle[i] else s.state.outlook(limit) for i, s in enumerate(live)]
        left = [max(1, s.state.stop.max_new_tokens - len(s.state.completion)) for s in live]
        fresh = [
            i
            for i, s in enumerate(live)
            if not idle[i] and s.state.drafter != "none" and not s.state.stats.drafted
        ]
        low: tuple[int, float] | None = None  # (session index, its acceptance)
        if prior is not None and len(fresh) > 1:
            i = max(fresh, key=lambda j: left[j])
            st = live[i].state
            short = prior.shortfall(st.drafter, st.params.greedy, len(fresh))
            low = (i, max(0.0, st.k_policy.alpha - short))

        def rounds(cap: int) -> float:
            worst = 0.0
            for i, o in enumerate(each):
                tokens = o[cap][0]
                if low is not None and i == low[0]:
                    tokens = expected_tokens(low[1], o[cap][1])
                worst = max(worst, left[i] / tokens)
            return worst

        table = [
            Prospect(
                sum(o[cap][0] for o in each),
                max(o[cap][1] for o in each),
                sum(o[cap][1] for o in each),
                rounds(cap),
            )
            for cap in range(limit + 1)
        ]
        return lambda cap: table[min(cap, limit)]

    @staticmethod
    def _timeable(live: list[LiveSession], cap: int) -> bool:
        """Whether a round's wall time says something about its cap: not when the target
        prefills a session in it (a new turn or a restart: more than the one token a
        round leaves it; a short prompt's round, prefills on both models included, took
        0.95 s against 0.28 s for a plain round and made drafting look 3x dearer than
        it is), nor when a session's draft warm-up runs beside it (at any cap: where
        draft and target share cores the warm-up slows the round, and a plain round timed
        so would flatter drafting), nor (for a cap above 0) when a cold session may warm
        in it. A cold session whose warm-up was declined at this batch size only
        verifies at k = 0: its rounds are timed."""
        return not any(
            RoundRunner._target_prefills(s)
            or s.draft_warming
            or (cap > 0 and RoundRunner._cold(s) and not RoundRunner._declined(s, live))
            for s in live
        )

    @staticmethod
    def _declined(s: LiveSession, live: list[LiveSession]) -> bool:
        """Whether the session's draft warm-up was declined at this round's batch size (a
        batch of another size weighs it again: the gain it would repay differs)."""
        return s.warm_declined_at == len(live)

    @staticmethod
    def _not_drafting(s: LiveSession, live: list[LiveSession]) -> bool:
        """Whether the session verifies at k = 0 this round whatever the cap: its draft
        cache warms beside the rounds, or is cold with its warm-up declined."""
        return s.draft_warming or (RoundRunner._declined(s, live) and RoundRunner._cold(s))

    def _charge_warm_ups(
        self, target: str, live: list[LiveSession], depth: int, drafts: int, seconds: float
    ) -> None:
        """Charge the draft warm-ups under way beside the rounds with what this round lost
        to them: its wall time over the time predicted for it (shared equally where
        several run; signed, so a round's noise either way cancels over the warm-up,
        whose total is taken as at least 0). A round that cannot be predicted, one that
        prefills on the target among them, makes them charge their wall time: a warm-up
        that ran beside prefill rounds only was charged nothing, so warm-ups beside the
        rounds were taken as free on shared cores, and the next one slowed 5 rounds of
        4 sessions from 0.25 s to 1.27 s."""
        if not self._beside:
            return
        expected = None
        if self.caps is not None and not any(self._target_prefills(s) for s in live):
            expected = self.caps.seconds(target, len(live), depth, drafts)
        for lost in self._beside:
            if expected is None:
                lost.unpredicted = True
            else:
                lost.seconds += (seconds - expected) / len(self._beside)
                lost.rounds += 1

    def _target_backlog(self, sid: str) -> int:
        """Tokens of a session's history its target has not seen (its prefill)."""
        return self._backlog(self.sessions[sid])

    @staticmethod
    def _backlog(s: LiveSession) -> int:
        return len(s.state.tokens) - s.state.target_start

    @staticmethod
    def _cold(s: LiveSession) -> bool:
        """Whether drafting now would make the draft replica prefill a long history first
        (n-gram drafters index any history cheaply)."""
        return s.state.drafter == "model" and RoundRunner._draft_backlog([s]) > WARM_ABOVE_TOKENS

    def _may_warm(self, s: LiveSession, *, alone: bool) -> bool:
        """Whether a cold session's draft cache may start warming: not twice, and not
        while its target still prefills it (the round after is soon enough, the draft's
        prefill does not take the target's cores when they share them, and a burst of
        sessions that will verify together at k = 0 never warms at all) unless the
        session is ``alone`` in its round. A lone session warms inside its round, so its
        draft's prefill and drafts and then the target's prefill of the history with
        them run one after another, as the local loop's first round does; held back, its
        prefill round committed one token and the next round paid the draft's prefill
        (one round more a turn: 5% of a 64-token turn of the Qwen pair on 2 cores)."""
        return not s.draft_warming and (alone or not self._prefilling(s))

    def _warm_repays(
        self,
        target: str,
        draft: str,
        sessions: list[LiveSession],
        live: list[LiveSession],
        *,
        inside: bool,
    ) -> bool:
        """Whether warming a round's cold ``sessions`` on ``draft`` repays itself.

        They are weighed together: one warm-up call prefills them all, and the rounds
        of the batch move together, so the batch's time saved (over its
        longest remaining turn) must exceed the whole warm-up. Eight sessions that would
        each repay their own warm-up need not repay eight. ``inside``: warmed inside
        this round rather than beside the rounds (each way has its measured cost).
        """
        if self.caps is None:  # a pinned curve: no measured gain to weigh
            return True
        for s in sessions:  # weighed as if they warm: what would they gain?
            s.warm_declined_at = None
        limit = self.scheduler.k_cap(target)
        outlook = self._outlook(live, limit, self.prior)
        repays = self.payback.repays(
            draft,
            behind=self._draft_backlog(sessions),
            finish=self.caps.finish_times(target, len(live), limit, outlook),
            inside=inside,
        )
        if not repays:
            self.stats.draft_warmups_declined += len(sessions)
            for s in sessions:
                s.warm_declined_at = len(live)
        return repays

    @staticmethod
    def _draft_backlog(sessions: list[LiveSession]) -> int:
        """History tokens of these sessions their draft replica has not seen (a warm-up)."""
        return sum(len(s.state.tokens) - s.state.draft_start for s in sessions)

    @staticmethod
    def _target_prefills(s: LiveSession) -> bool:
        """Whether the target prefills the session in this round, however short: it is
        more than the one token behind that a round leaves it (a new turn, a restart)."""
        return RoundRunner._backlog(s) > 1

    @staticmethod
    def _prefilling(s: LiveSession) -> bool:
        """Whether this round prefills a long history of the session on its target."""
        return RoundRunner._backlog(s) > WARM_ABOVE_TOKENS

    def _warm_later(self, endpoint: str, sessions: list[LiveSession]) -> None:
        """Prefill sessions on their draft replica beside the rounds (:func:`calls.warm`)."""
        for s in sessions:
            s.draft_warming = True
        self.stats.draft_warmups += len(sessions)

        behind = self._draft_backlog(sessions)

        slowed = _LostTime()  # what the rounds lose to this warm-up
        self._beside.append(slowed)

        async def run() -> None:
            try:
                started = time.perf_counter()
                warm = await calls.warm(self.drafts, endpoint, sessions, self.timeouts.draft_warm_s)
                wall = time.perf_counter() - started
                if len(warm) == len(sessions):
                    self.payback.observe(endpoint, behind, slowed.cost(wall), inside=False)
            finally:
                self._beside.remove(slowed)
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
            if out.lost and self.caps is not None:
                self.caps.forget(target)  # a replacement may be another machine
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
