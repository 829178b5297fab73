"""The propose step of a round: drafts from each draft replica the batch uses, as planned.

:meth:`Drafting.propose` asks each draft replica for its sessions' drafts with the k
the plan chose (:func:`calls.propose`), in parallel when the batch uses several. A
session with no draft replica, or whose replica fails, is slow or refuses, verifies
at k = 0 this round (a failed replica's sessions move to another one). Cold sessions
are warmed where the plan says (:class:`~specserve.orchestrator.round.warmups.DraftWarmups`):
inside the round after its ``Propose``, never in its way, or beside the rounds.
"""

from __future__ import annotations

import asyncio
import collections

from specserve.orchestrator.fleet.replicas import ReplicaPool
from specserve.orchestrator.fleet.scheduler import Scheduler
from specserve.orchestrator.round import calls
from specserve.orchestrator.round.calls import Plan, RoundTimeouts, batch_timeout
from specserve.orchestrator.round.ledger import Ledger
from specserve.orchestrator.round.spans import RoundSpans
from specserve.orchestrator.round.stats import RunnerStats
from specserve.orchestrator.round.warmups import DraftWarmups, move_off_draft
from specserve.orchestrator.session import LiveSession
from specserve.policy import BatchPlan, WarmWhere


class Drafting:
    """The propose step of every lane's rounds."""

    def __init__(
        self,
        scheduler: Scheduler,
        drafts: ReplicaPool,
        timeouts: RoundTimeouts,
        stats: RunnerStats,
        ledger: Ledger,
    ) -> None:
        self.scheduler = scheduler
        self.drafts = drafts
        self.timeouts = timeouts
        self.stats = stats  # draft_fallbacks: sessions that wanted drafts and got none
        self.ledger = ledger  # releases the caches a failed replica's sessions left
        self.warmups = DraftWarmups(scheduler, drafts, timeouts, stats, ledger)

    async def propose(
        self, live: list[LiveSession], spans: RoundSpans, plan: BatchPlan
    ) -> dict[str, Plan]:
        """Each session's draft for this round (an empty :class:`Plan`: k = 0)."""
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
            if placement.draft is not None and k > 0:
                by_draft[placement.draft].append((s, k))
        timeout = batch_timeout(self.timeouts.draft_s, live)
        if len(by_draft) == 1:
            # Awaited here, not gathered: the call is sent before the lane first yields,
            # ahead of whatever the round before left to run (its commit, its counts).
            [(ep, items)] = by_draft.items()
            found = [await calls.propose(self.drafts, ep, items, timeout)]
        else:
            found = await asyncio.gather(
                *(calls.propose(self.drafts, ep, items, timeout) for ep, items in by_draft.items())
            )
        for (ep, items), got in zip(by_draft.items(), found, strict=True):
            plans.update(got)
            if ep not in self.drafts.usable():  # the replica failed: move its sessions
                move_off_draft(self.scheduler, [s for s, _ in items], ep)
                self.ledger.release_later(self.drafts, ep, [s.sid for s, _ in items])
        # No draft replica, a failed or slow one, or a refusal: these verify at k = 0.
        self.stats.draft_fallbacks += sum(1 for sid in wanted if sid not in plans)
        for ep, items in inside.items():  # after this round's Propose: never in its way
            plans.update(await self.warmups.inside(ep, items, live))
        for ep, sessions in beside.items():
            self.warmups.beside(ep, sessions)
        return plans
