"""One batched Propose or Verify on one replica, what its failures mean, and its timeouts.

* ``NEEDS_HISTORY`` answers are resent at once with the whole committed history
  (:func:`send_resending_history`, for both calls).
* A target whose model thread makes no progress for ``stall_s`` while a Verify is
  out (hung, stopped: :mod:`specserve.orchestrator.fleet.stall`; no CPU time used, or
  no answer at all) is lost at once, when another target could take the batch. A
  lone target keeps it (up to the call's timeout).
* A transport failure (unreachable, past the deadline), or INTERNAL from a
  replica whose health then says NOT_SERVING (a device failure), takes the
  replica out of its pool for a backoff and is reported as ``lost``: drafts then
  fall back to k = 0, verification fails over to another target. INTERNAL from a
  replica still SERVING is a bug this request triggers, not a lost replica.
* A Verify past its clients' deadline (the batch's timeout is cut to the latest
  one) on a target that still answers SERVING has *expired*: those sessions end
  as at a round boundary past their deadline, and the target stays in the pool.
  Past the target timeout instead, on a target still SERVING, it is *slow*: the
  caller replays it on the same replica (whose KV is warm; it rolls back to the
  request's start) before it calls the replica lost. The only target, when its model
  thread moved during the call, counts as SERVING here even if it does not answer
  health at that moment (a starved host, a process stopped part of the time).
* A draft replica past the round's deadline whose health still answers SERVING is
  *slow*, not lost: the round verifies without its drafts and it stays in the pool
  (taking a busy draft pool out would move every session to k = 0 and make the
  next replica rebuild their caches, the slowest thing it could do).
* Any other error of a batched call is not every session's fault: the batch is
  split and each session retried alone, so only the session that caused it gets
  the error (for Propose: no drafts this round). Re-running is safe: every call
  says where its news starts, and the random draws depend only on (seed, round,
  position).

Over the data plane (:class:`~specserve.serving.replica_connection.ReplicaConnection` on the
replicas' data-plane sockets) a call fails with the same codes as the unary call, and
a broken connection (or one that cannot be made: no data port, an unreachable
socket) fails every call in flight on it ``UNAVAILABLE``, as a lost unary call: the
rules above apply unchanged.

Converters are the services' own (:mod:`specserve.draft_service.convert`,
:mod:`specserve.target_service.convert`), so both ends of a field agree.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc
import grpc.aio

from specserve.engine.errors import EngineError, InvalidArgument, KVBudgetExceeded, NotFound
from specserve.engine.logprobs import TokenLogprob
from specserve.engine.rejection import Proposal, Verdict
from specserve.orchestrator.fleet.replicas import (
    TRANSPORT_CODES,
    ReplicaPool,
    is_serving,
    replica_lost,
)
from specserve.orchestrator.fleet.stall import DEFAULT_STALL_S, Stalled, call_watched
from specserve.orchestrator.session import LiveSession
from specserve.serving.errors import Unavailable
from specserve.v1 import common_pb2, draft_pb2, target_pb2
from specserve.wire import draft_wire, target_wire

log = logging.getLogger(__name__)

A = TypeVar("A", bound="Answer")

NEEDS_HISTORY = common_pb2.SESSION_STATUS_NEEDS_HISTORY
# A session whose draft replica lacks more committed tokens than this (a new prompt,
# a new replica after a failover, an evicted cache) is brought up to date beside the
# rounds (:func:`warm`), not inside one.
WARM_ABOVE_TOKENS = 32


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


def batch_timeout(base: float, sessions: Sequence[LiveSession]) -> float:
    """``base``, cut to the latest client deadline of the batch (never below 50 ms).

    A batch with a session that has no deadline keeps ``base``.
    """
    deadlines = [s.deadline for s in sessions]
    if not deadlines or any(d is None for d in deadlines):
        return base
    left = max(d for d in deadlines if d is not None) - time.monotonic()
    return max(0.05, min(base, left))


@dataclass
class Plan:
    """One session's draft for this round (empty = k 0), or its plain steps."""

    proposal: Proposal = field(default_factory=lambda: Proposal(tokens=[]))
    draft: draft_pb2.DraftResult | None = None  # q travels on to the target as it came
    steps: int = 1  # > 1 (no drafts): tokens the target decodes in this round's Verify
    # > 0: a prefill chunk, only this many of the tokens the target lacks (no drafts)
    chunk: int = 0


@dataclass
class VerifyOutcome:
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    # per session that asked for them: a TokenLogprob per emitted token of its verdict
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    errors: dict[str, EngineError] = field(default_factory=dict)
    lost: bool = False  # the replica failed: nothing was verified
    slow: bool = False  # past the target timeout, the replica still SERVING: nothing verified
    progressed: bool = False  # the stall watch saw the model thread move during the call
    why: str = ""  # how it failed, when lost or slow
    batch_sizes: list[int] = field(default_factory=list)  # as the target reported them
    compute_s: float = 0.0  # the target's compute for the calls, as it reported it
    resent: int = 0  # sessions the target answered NEEDS_HISTORY, resent whole
    expired: bool = False  # the clients' deadlines passed first: nothing was verified
    # per session sent a prefill chunk that the target took: the tokens it holds now
    prefilled: dict[str, int] = field(default_factory=dict)


class Answer(Protocol):
    """A batched Propose or Verify response: one result per session, in order."""

    @property
    def results(self) -> Sequence[Any]: ...


async def send_resending_history(
    sessions: list[LiveSession],
    send: Callable[[list[LiveSession], bool], Awaitable[A]],
    resend: Callable[[LiveSession], bool] = lambda s: True,
) -> tuple[dict[str, Any], list[A], int]:
    """One batched call with each session's news only, then, at once, one with the whole
    history for the sessions the replica answered ``NEEDS_HISTORY`` (those ``resend``
    admits; the others keep that answer). ``send(sessions, full)`` makes one call.

    Returns each session's result, the responses in order, and how many were resent.
    """
    first = await send(sessions, False)
    results = dict(zip([s.sid for s in sessions], first.results, strict=True))
    stale = [s for s in sessions if results[s.sid].status == NEEDS_HISTORY and resend(s)]
    if not stale:
        return results, [first], 0
    again = await send(stale, True)
    results.update(zip([s.sid for s in stale], again.results, strict=True))
    return results, [first, again], len(stale)


def engine_error(e: grpc.aio.AioRpcError, role: str) -> EngineError:
    """A replica's refusal of one session, as the error the client will get."""
    details = f"the {role} replica refused the request: {e.details()}"
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return KVBudgetExceeded(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(details)
    if code in TRANSPORT_CODES:
        return Unavailable(details)
    return EngineError(details)


async def propose(
    pool: ReplicaPool,
    endpoint: str,
    items: list[tuple[LiveSession, int]],
    timeout_s: float,
    *,
    resend_up_to: int | None = WARM_ABOVE_TOKENS,
) -> dict[str, Plan]:
    """Drafts for ``(session, k)`` pairs from one draft replica; failures give no plan (k 0).

    A session the replica answers ``NEEDS_HISTORY`` for is resent whole at once if its
    history has at most ``resend_up_to`` tokens (None: any); a longer one gets no
    drafts and ``draft_start = 0``, so the round runner rebuilds it beside the rounds
    (:func:`warm`) instead of making this round wait for the prefill.
    """
    replica = pool.get(endpoint)
    if replica is None:
        return {}
    k_of = {s.sid: k for s, k in items}
    held: dict[str, int] = {}  # committed tokens each request hands the replica

    def request(which: list[LiveSession], full: bool) -> draft_pb2.ProposeRequest:
        held.update((s.sid, len(s.state.tokens)) for s in which)
        return draft_pb2.ProposeRequest(
            sessions=[
                draft_wire.draft_session(
                    s.state.draft_input(k_of[s.sid], full=full), s.state.drafter
                )
                for s in which
            ]
        )

    sessions = [s for s, _ in items]

    async def call(which: list[LiveSession], full: bool) -> draft_pb2.ProposeResponse:
        if replica.connection is not None:
            return await replica.connection.call(request(which, full), timeout_s)
        return await replica.stub.Propose(request(which, full), timeout=timeout_s)

    def short(s: LiveSession) -> bool:
        return resend_up_to is None or len(s.state.tokens) <= resend_up_to

    try:
        results, responses, _ = await send_resending_history(sessions, call, short)
        response = responses[0]
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and await is_serving(replica):
            # Slow, not lost (busy with other sessions' drafts or a prefill): this
            # round verifies without drafts, the sessions keep their warm caches here.
            log.info("draft replica %s missed the round's deadline of %.2f s", endpoint, timeout_s)
            return {}
        if await replica_lost(replica, e.code()):
            pool.mark_failed(endpoint, f"Propose: {e.code().name}: {e.details()}")
            return {}
        if len(items) == 1:  # this session's drafts are refused: it verifies at k = 0
            log.info("draft replica %s refused Propose: %s", endpoint, e.details())
            return {}
        plans: dict[str, Plan] = {}  # one session spoilt the batch: find it, draft the others
        for part in await asyncio.gather(
            *(propose(pool, endpoint, [item], timeout_s) for item in items)
        ):
            plans.update(part)
        return plans
    pool.mark_ok(endpoint, response.replica_id)
    plans = {}
    for s in sessions:
        if results[s.sid].status == NEEDS_HISTORY:
            s.state.draft_start = 0  # cold: warmed beside the rounds (or refused twice)
        try:
            proposal = draft_wire.proposal(results[s.sid], k_of[s.sid])
        except InvalidArgument as e:  # a misbehaving replica: skip drafting this round
            log.warning("draft replica %s: %s", endpoint, e)
            continue
        if proposal is None:
            continue
        plans[s.sid] = Plan(proposal, results[s.sid])
        s.state.draft_start = held[s.sid]
    return plans


async def warm(
    pool: ReplicaPool, endpoint: str, sessions: list[LiveSession], timeout_s: float
) -> list[LiveSession]:
    """Have a draft replica take sessions' committed history into its KV cache now.

    A one-token ``Propose`` whose draft is dropped: the replica prefills what it
    lacks of each history (a whole prompt, for a new session). Runs beside the
    rounds, which keep verifying these sessions at k = 0 meanwhile, so a prefill
    on the draft never holds up a round (:class:`~specserve.orchestrator.round.runner.RoundRunner`).
    Each session's ``draft_start`` becomes the length this call sent; returns the
    sessions that are warm now (failures leave the others cold, to try again).
    """
    plans = await propose(pool, endpoint, [(s, 1) for s in sessions], timeout_s, resend_up_to=None)
    return [s for s in sessions if s.sid in plans]


async def verify(
    pool: ReplicaPool,
    endpoint: str,
    items: list[tuple[LiveSession, Plan]],
    timeout_s: float,
    *,
    deadline_cut: bool = False,
    stall_s: float = 0.0,
) -> VerifyOutcome:
    """Verify one batch on one target replica (see the module docstring for failures).

    ``deadline_cut``: ``timeout_s`` is the batch's client deadline, shorter than the
    target timeout; if it passes while the replica still answers SERVING, the batch
    ``expired`` and the replica stays in the pool. Without the cut, the same is ``slow``.
    ``stall_s`` > 0: a replica whose model thread makes no progress that long while the
    call is out is ``lost`` at once if another target is usable
    (:mod:`specserve.orchestrator.fleet.stall`); ``progressed`` says whether it moved.
    """
    out = VerifyOutcome()
    replica = pool.get(endpoint)
    if replica is None:
        out.lost, out.why = True, f"target replica {endpoint} left the pool"
        return out
    plans = {s.sid: p for s, p in items}
    sent: dict[str, int] = {}  # committed tokens a prefill chunk's request ends at

    def request(which: list[LiveSession], full: bool) -> target_pb2.VerifyRequest:
        sessions = []
        for s in which:
            plan = plans[s.sid]
            vin = s.state.verify_input(plan.proposal, full=full, steps=plan.steps, chunk=plan.chunk)
            pb = target_wire.verify_session(vin, plan.draft)
            if plan.chunk:
                sent[s.sid] = vin.committed_len
            elif s.top_logprobs is not None:
                pb.top_logprobs = s.top_logprobs
            sessions.append(pb)
        return target_pb2.VerifyRequest(sessions=sessions)

    sessions = [s for s, _ in items]

    async def call(which: list[LiveSession], full: bool) -> target_pb2.VerifyResponse:
        rpc = (
            replica.connection.call(request(which, full), timeout_s)
            if replica.connection is not None
            else replica.stub.Verify(request(which, full), timeout=timeout_s)
        )
        return await call_watched(
            replica, rpc, stall_s, may_fail_over=elsewhere, on_progress=progressed
        )

    def elsewhere() -> bool:  # a stall verdict needs another target to go to
        return any(e != endpoint for e in pool.usable())

    def progressed() -> None:
        out.progressed = True

    try:
        results, responses, out.resent = await send_resending_history(sessions, call)
        out.batch_sizes.extend(r.batch_size for r in responses)
        out.compute_s = sum(r.compute_ns for r in responses) / 1e9
        response = responses[0]
    except Stalled as e:  # hung: as good as lost, without waiting for the timeout
        out.lost, out.why = True, f"Verify on {endpoint}: {e}"
        pool.mark_failed(endpoint, out.why)
        return out
    except grpc.aio.AioRpcError as e:
        # Past the timeout on a replica that answers SERVING (busy), or that does not
        # answer now but moved during the call and is the only target (starved): slow.
        serving = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and await is_serving(replica)
        starved = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and (
            out.progressed and not elsewhere()
        )
        if serving or starved:
            if deadline_cut:
                out.expired = True
            else:
                out.slow = True
                how = "answered SERVING" if serving else "moved during it (the only target)"
                out.why = f"Verify on {endpoint} ran past {timeout_s:g} s while the replica {how}"
            return out
        if await replica_lost(replica, e.code()):
            out.lost, out.why = True, f"Verify on {endpoint}: {e.code().name}: {e.details()}"
            pool.mark_failed(endpoint, out.why)
            return out
        if len(items) == 1:
            out.errors[sessions[0].sid] = engine_error(e, "target")
            return out
        alone = await asyncio.gather(
            *(verify(pool, endpoint, [item], timeout_s, stall_s=stall_s) for item in items)
        )
        for part in alone:
            out.verdicts.update(part.verdicts)
            out.logprobs.update(part.logprobs)
            out.errors.update(part.errors)
            out.prefilled.update(part.prefilled)
            out.lost |= part.lost
            out.progressed |= part.progressed
            out.why = out.why or part.why
            out.batch_sizes.extend(part.batch_sizes)
            out.compute_s += part.compute_s
            out.resent += part.resent
        return out
    pool.mark_ok(endpoint, response.replica_id)
    for s in sessions:
        try:
            plan = plans[s.sid]
            verdict = target_wire.verdict(results[s.sid], len(plan.proposal.tokens), plan.steps)
        except InvalidArgument as e:
            out.errors[s.sid] = EngineError(f"the target replica answered wrongly: {e}")
            continue
        if verdict is None:
            out.errors[s.sid] = EngineError("the target replica asked twice for the full history")
            continue
        out.verdicts[s.sid] = verdict
        if plan.chunk:  # its next token is the history's: only the position counts
            out.prefilled[s.sid] = sent[s.sid]
        elif s.top_logprobs is not None:
            out.logprobs[s.sid] = target_wire.token_logprobs(results[s.sid])
    return out
