"""Draft warm-ups: bringing a cold session's draft replica up to its committed history.

Whether and where a session warms is the planner's decision
(:class:`~specserve.policy.WarmWhere`); this is the I/O:

* **inside** the round (:meth:`DraftWarmups.inside`): one ``Propose`` that resends
  the whole history and drafts from it; the round waits for it;
* **beside** the rounds (:meth:`DraftWarmups.beside`): :func:`calls.warm` in the
  background while the session verifies at k = 0; the session's ``draft_warming``
  is set until it is done.

A draft replica that fails a warm-up loses its sessions to another draft replica
(:func:`move_off_draft`), which starts cold.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from specserve.orchestrator.fleet.replicas import ReplicaPool
from specserve.orchestrator.fleet.scheduler import Scheduler
from specserve.orchestrator.round import calls
from specserve.orchestrator.round.calls import Plan, RoundTimeouts, batch_timeout
from specserve.orchestrator.round.ledger import Ledger
from specserve.orchestrator.round.stats import RunnerStats
from specserve.orchestrator.session import LiveSession


def move_off_draft(scheduler: Scheduler, sessions: Iterable[LiveSession], endpoint: str) -> None:
    """Place sessions whose draft replica failed on another one (cold: ``draft_start = 0``)."""
    for s in sessions:
        scheduler.set_draft(s.sid, scheduler.pick_draft(avoid=[endpoint]))
        s.state.draft_start = 0


class DraftWarmups:
    """Runs the warm-ups a round's plan asks for and counts them."""

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
        self.stats = stats  # draft_warmups: sessions a warm-up rebuilt (or tried to)
        self.ledger = ledger  # releases the cache of a session that ended meanwhile
        self.beside_now = 0  # warm-up calls under way beside the rounds
        self._tasks: set[asyncio.Task[None]] = set()  # held until done

    async def inside(
        self, endpoint: str, items: list[tuple[LiveSession, int]], batch: Sequence[LiveSession]
    ) -> dict[str, Plan]:
        """Prefill cold sessions on their draft replica inside this round, and draft.

        ``items`` are (session, k) pairs; ``batch`` is the whole round's batch, whose
        client deadlines cut the call's timeout.
        """
        sessions = [s for s, _ in items]
        timeout = batch_timeout(self.timeouts.draft_warm_s, batch)
        plans = await calls.propose(self.drafts, endpoint, items, timeout, resend_up_to=None)
        self.stats.draft_warmups += len(sessions)
        if endpoint not in self.drafts.usable():
            move_off_draft(self.scheduler, sessions, endpoint)
        return plans

    def beside(self, endpoint: str, sessions: list[LiveSession]) -> None:
        """Prefill sessions on their draft replica in the background (:func:`calls.warm`).

        Each session's ``draft_warming`` is True until the call is over. A session that
        ended meanwhile has its new cache released; one moved to another draft replica
        meanwhile is cold there; one whose replica failed moves off it.
        """
        for s in sessions:
            s.draft_warming = True
        self.stats.draft_warmups += len(sessions)
        self.beside_now += 1
        task = asyncio.get_running_loop().create_task(self._beside(endpoint, sessions))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _beside(self, endpoint: str, sessions: list[LiveSession]) -> None:
        try:
            await calls.warm(self.drafts, endpoint, sessions, self.timeouts.draft_warm_s)
        finally:
            self.beside_now -= 1
            lost = endpoint not in self.drafts.usable()
            for s in sessions:
                s.draft_warming = False
                placement = self.scheduler.placement(s.sid)
                if placement is None:  # ended meanwhile: do not leave its cache there
                    self.ledger.release_later(self.drafts, endpoint, [s.sid])
                elif placement.draft != endpoint:  # moved meanwhile: that replica is cold
                    s.state.draft_start = 0
                elif lost:
                    move_off_draft(self.scheduler, [s], endpoint)
