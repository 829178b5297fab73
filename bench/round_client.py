"""The speculative round over gRPC: Propose on a draft replica, Verify on a target replica.

The same round as :meth:`specserve.engine.speculative.SpeculativeEngine.round`, on
the same :class:`~specserve.engine.decode_state.DecodeState` sessions, with each
phase one batched RPC for every session:

1. ``Propose`` the drafts (sessions with drafter ``none`` skip it); sessions the
   replica answers ``NEEDS_HISTORY`` are resent at once with ``start = 0`` and the
   whole committed history;
2. ``Verify`` the committed delta + drafts, again resending ``NEEDS_HISTORY``
   sessions in full;
3. ``DecodeState.commit`` the verdicts.

A client of both services for the benchmarks (``bench.rpc_overhead``) and the tests,
which drive it against server processes; the orchestrator does not use it (its round
is ``specserve/orchestrator/round/runner.py``, its RPCs ``orchestrator/round/calls.py``). Every
RPC's wall time and server-reported compute go to ``on_rpc`` (the bench reads the
difference: serialisation + transport).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specserve.engine.decode_state import DecodeState
from specserve.engine.drafter import DrafterKind
from specserve.engine.rejection import Proposal, Verdict
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specserve.wire import common_wire, draft_wire, target_wire


@dataclass(frozen=True)
class RpcTiming:
    """One RPC as the client saw it."""

    method: str  # "Propose", "Verify", "Prefill"
    sessions: int
    wall_ns: int  # from just before the call to the response, client side
    compute_ns: int  # what the server reported spending in model compute
    batch_size: int  # sessions in the server's forward (> sessions when calls coalesced)
    request_bytes: int
    response_bytes: int

    @property
    def overhead_ns(self) -> int:
        """Serialisation + transport + server queueing: everything but the model's compute."""
        return self.wall_ns - self.compute_ns


class RoundClient:
    """Runs rounds for a set of sessions against one draft and one target replica."""

    def __init__(
        self,
        target: target_pb2_grpc.TargetServiceStub,
        draft: draft_pb2_grpc.DraftServiceStub | None = None,
        *,
        timeout_s: float | None = 60.0,
        on_rpc: Callable[[RpcTiming], None] | None = None,
    ) -> None:
        self.target = target
        self.draft = draft
        self.timeout_s = timeout_s
        self.on_rpc = on_rpc

    async def run(
        self,
        states: Sequence[DecodeState],
        on_tokens: Callable[[DecodeState, list[int]], None] | None = None,
    ) -> None:
        """Decode every session until it finishes, then release its caches on both replicas."""
        active = [s for s in states if not s.finished]
        while active:
            for s, tokens in await self.round(active):
                if on_tokens is not None:
                    on_tokens(s, tokens)
            active = [s for s in active if not s.finished]
        await self.release(states)

    async def prefill(self, states: Sequence[DecodeState]) -> list[tuple[DecodeState, list[int]]]:
        """Process the prompts (replacing any target cache) and commit each first token."""
        request = target_pb2.PrefillRequest(
            sessions=[
                target_pb2.PrefillSession(
                    session_id=s.session_id,
                    tokens=s.tokens,
                    sampling=common_wire.sampling_pb(s.params),
                    round_index=s.round_index,
                )
                for s in states
            ]
        )
        response = await self._call("Prefill", self.target.Prefill, request, len(states))
        out = []
        for s, r in zip(states, response.results, strict=True):
            verdict = target_wire.verdict(r, 0)
            assert verdict is not None, "a prefill cannot be stale"
            out.append((s, s.commit(Proposal(tokens=[]), verdict)))
        return out

    async def round(self, states: Sequence[DecodeState]) -> list[tuple[DecodeState, list[int]]]:
        """One round for every session in ``states``; returns the tokens each added."""
        proposals, drafts = await self._propose(states)
        verdicts = await self._verify(states, proposals, drafts)
        return [(s, s.commit(p, v)) for s, p, v in zip(states, proposals, verdicts, strict=True)]

    async def release(self, states: Sequence[DecodeState]) -> None:
        request = common_pb2.ReleaseRequest(session_ids=[s.session_id for s in states])
        await self.target.Release(request, timeout=self.timeout_s)
        if self.draft is not None:
            await self.draft.Release(request, timeout=self.timeout_s)

    # -- phases ----------------------------------------------------------------------

    async def _propose(
        self, states: Sequence[DecodeState]
    ) -> tuple[list[Proposal], dict[int, draft_pb2.DraftResult]]:
        proposals = [Proposal(tokens=[])] * len(states)
        drafts: dict[int, draft_pb2.DraftResult] = {}
        idx = [i for i, s in enumerate(states) if s.drafter != DrafterKind.NONE]
        if not idx:
            return proposals, drafts
        assert self.draft is not None, "sessions want drafts but no draft replica is configured"
        ks = {i: states[i].next_k() for i in idx}

        def request(which: list[int], full: bool) -> draft_pb2.ProposeRequest:
            sessions = [
                draft_wire.draft_session(states[i].draft_input(ks[i], full=full), states[i].drafter)
                for i in which
            ]
            return draft_pb2.ProposeRequest(sessions=sessions)

        response = await self._call("Propose", self.draft.Propose, request(idx, False), len(idx))
        results = dict(zip(idx, response.results, strict=True))
        stale = [i for i in idx if results[i].status == common_pb2.SESSION_STATUS_NEEDS_HISTORY]
        if stale:  # the replica lost these caches: resend the whole history
            again = await self._call(
                "Propose", self.draft.Propose, request(stale, True), len(stale)
            )
            results.update(zip(stale, again.results, strict=True))
        for i in idx:
            p = draft_wire.proposal(results[i], ks[i])
            assert p is not None, "a full-history draft cannot be stale"
            proposals[i] = p
            drafts[i] = results[i]
            states[i].note_draft_synced()
        return proposals, drafts

    async def _verify(
        self,
        states: Sequence[DecodeState],
        proposals: list[Proposal],
        drafts: dict[int, draft_pb2.DraftResult],
    ) -> list[Verdict]:
        def request(which: Sequence[int], full: bool) -> target_pb2.VerifyRequest:
            sessions = [
                target_wire.verify_session(
                    states[i].verify_input(proposals[i], full=full), drafts.get(i)
                )
                for i in which
            ]
            return target_pb2.VerifyRequest(sessions=sessions)

        everyone = range(len(states))
        response = await self._call(
            "Verify", self.target.Verify, request(everyone, False), len(states)
        )
        verdicts = [
            target_wire.verdict(r, len(p.tokens))
            for r, p in zip(response.results, proposals, strict=True)
        ]
        stale = [i for i, v in enumerate(verdicts) if v is None]
        if stale:  # the target lost these caches: resend the whole history
            again = await self._call("Verify", self.target.Verify, request(stale, True), len(stale))
            for i, r in zip(stale, again.results, strict=True):
                verdicts[i] = target_wire.verdict(r, len(proposals[i].tokens))
        assert all(v is not None for v in verdicts), "a full-history verify cannot be stale"
        return verdicts  # type: ignore[return-value]

    async def _call(self, method: str, rpc: Callable[..., Any], request: Any, sessions: int) -> Any:
        t0 = time.perf_counter_ns()
        response = await rpc(request, timeout=self.timeout_s)
        wall = time.perf_counter_ns() - t0
        if self.on_rpc is not None:  # sizes are taken after the clock stopped
            self.on_rpc(
                RpcTiming(
                    method,
                    sessions,
                    wall,
                    response.compute_ns,
                    response.batch_size,
                    request.ByteSize(),
                    response.ByteSize(),
                )
            )
        return response
