"""Draft-ahead bets in flight: sent to the draft replicas, awaited, handed back to settle.

The decisions are :mod:`specserve.orchestrator.round.draft_ahead`'s; this is the asyncio
shell the round runner drives. :meth:`BetBook.place` sends one batched
``Propose`` per draft replica for a round's bets and returns at once (the target
verifies meanwhile); :meth:`BetBook.collect` awaits the bets of the sessions about
to start their next round — so a session never has two draft calls in flight,
and its next ``Propose`` reaches the replica after the bet — and returns each
bet with its answer.

A bet costs only speculation when it fails: no NEEDS_HISTORY resend, no retry,
and the replica is not marked down (the session's next ``Propose`` finds out).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Iterable

import grpc
import grpc.aio

from specserve.engine.drafter import DraftInput
from specserve.engine.errors import InvalidArgument
from specserve.orchestrator.fleet.replicas import ReplicaPool
from specserve.orchestrator.fleet.scheduler import LaneKey, Scheduler
from specserve.orchestrator.round import draft_ahead
from specserve.orchestrator.round.calls import Plan
from specserve.orchestrator.round.draft_ahead import DRAFTER, Bet
from specserve.orchestrator.session import LiveSession
from specserve.v1 import draft_pb2
from specserve.wire import draft_wire

log = logging.getLogger(__name__)

Answers = dict[str, list[int]]  # session id -> the draft tokens a replica answered


async def propose_ahead(
    pool: ReplicaPool, endpoint: str, inputs: list[DraftInput], timeout_s: float
) -> Answers:
    """One Propose for a round's bets on one draft replica; failures answer nothing."""
    replica = pool.get(endpoint)
    if replica is None:
        return {}
    request = draft_pb2.ProposeRequest(
        sessions=[draft_wire.draft_session(x, DRAFTER) for x in inputs]
    )
    try:
        if replica.stream is not None:
            response = await replica.stream.call(request, timeout_s)
        else:
            response = await replica.stub.Propose(request, timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        log.info("draft-ahead on %s failed: %s: %s", endpoint, e.code().name, e.details())
        return {}
    answers: Answers = {}
    for x, result in zip(inputs, response.results, strict=True):
        try:
            proposal = draft_wire.proposal(result, x.k)
        except InvalidArgument as e:
            log.warning("draft replica %s: %s", endpoint, e)
            continue
        if proposal is not None:  # None: the replica lost the session (stale)
            answers[x.session_id] = list(proposal.tokens)
    return answers


class BetBook:
    """The bets in flight for one round runner's sessions."""

    def __init__(self, drafts: ReplicaPool, timeout_s: float) -> None:
        self.drafts = drafts
        self.timeout_s = timeout_s
        self._pending: dict[str, tuple[Bet, asyncio.Task[Answers]]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def place(self, bets: Iterable[Bet]) -> None:
        """Send the bets, one batched call per draft replica, without waiting for them."""
        by_draft: dict[str, list[Bet]] = collections.defaultdict(list)
        for bet in bets:
            assert bet.input.session_id not in self._pending, "a session bet twice"
            by_draft[bet.draft].append(bet)
        loop = asyncio.get_running_loop()
        for endpoint, group in by_draft.items():
            inputs = [b.input for b in group]
            task = loop.create_task(propose_ahead(self.drafts, endpoint, inputs, self.timeout_s))
            for b in group:
                self._pending[b.input.session_id] = (b, task)

    def place_for_round(
        self, scheduler: Scheduler, live: list[LiveSession], plans: dict[str, Plan], k_cap: int
    ) -> int:
        """Bet on round r + 1 of each session whose draft replica would idle while the
        target verifies round r (:func:`draft_ahead.place` decides each bet); returns
        the number of bets placed."""
        bets = []
        idle: dict[tuple[str, LaneKey], bool] = {}
        for s in live:
            placement = scheduler.placement(s.sid)
            plan = plans.get(s.sid)
            if placement is None or plan is None or placement.draft is None:
                continue
            key = (placement.draft, placement.lane)
            if key not in idle:
                idle[key] = scheduler.draft_idle_while_verifying(placement.lane, placement.draft)
            if not idle[key]:
                continue
            bet = draft_ahead.place(s.state, plan.proposal, placement.draft, k_cap)
            if bet is not None:
                bets.append(bet)
        self.place(bets)
        return len(bets)

    async def collect(self, session_ids: Iterable[str]) -> dict[str, tuple[Bet, list[int] | None]]:
        """Await and hand back the bets of these sessions (None: no answer)."""
        mine = {sid: self._pending.pop(sid) for sid in session_ids if sid in self._pending}
        if not mine:
            return {}
        tasks = {id(task): task for _, task in mine.values()}
        await asyncio.gather(*tasks.values())
        return {sid: (bet, task.result().get(sid)) for sid, (bet, task) in mine.items()}

    def drop(self, session_id: str) -> None:
        """Forget an ended session's bet (its call finishes on its own)."""
        self._pending.pop(session_id, None)

    def close(self) -> None:
        for _, task in self._pending.values():
            task.cancel()
        self._pending.clear()
