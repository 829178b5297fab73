"""A round's commit in flight (:class:`specserve.orchestrator.round.ledger.PendingCommit`),
on the embedded store with the store's commit held until the test lets it go.

Tokens reach the outbox only once their commit is written; a commit that conflicts
hands its ending to whoever settles and sends nothing; a finished session is ended
in the background after its commit; a session never has two commits in flight.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from specserve.engine.decode_state import DecodeState, FinishReason, StopCriteria
from specserve.engine.rejection import Proposal, Verdict
from specserve.engine.sampling import SamplingParams
from specserve.orchestrator.errors import VersionConflict
from specserve.orchestrator.fleet.scheduler import Placement
from specserve.orchestrator.round.runner import RoundRunner
from specserve.orchestrator.round.spans import RoundSpans
from specserve.orchestrator.session import Ended, LiveSession
from specserve.orchestrator.store import keys
from specserve.orchestrator.types import Usage
from specserve.policy.k_policy import KPolicy
from specserve.v1 import generate_pb2, session_pb2
from tests.orchestrator.test_slow_replicas import offline_runner


class HeldCommits:
    """The store's commits wait for :attr:`go` (set it to let them through)."""

    def __init__(self, runner: RoundRunner) -> None:
        self.go = asyncio.Event()
        self.real = runner.store.commit_many
        runner.store.commit_many = self  # type: ignore[method-assign]

    async def __call__(self, *a: Any, **kw: Any) -> Any:
        await self.go.wait()
        return await self.real(*a, **kw)


async def decoding(runner: RoundRunner, sid: str, max_new: int = 8) -> LiveSession:
    """A session whose turn is stored (version 1) and placed on lane "t"."""
    record = session_pb2.SessionRecord(
        session_id=sid, tokens=[1, 2, 3], state=generate_pb2.SESSION_STATE_ACTIVE
    )
    written = await runner.store.create(record)
    state = DecodeState(sid, [1, 2, 3], SamplingParams(), StopCriteria(max_new), KPolicy(0))
    s = LiveSession(
        written, state, prompt_tokens=3, base_usage=Usage(), pre_turn=None, deadline=None
    )
    runner.sessions[sid] = s
    runner.scheduler.join(sid, Placement("t", None))
    return s


def a_round(runner: RoundRunner, s: LiveSession, token: int) -> Any:
    """Round r of ``s`` verified (no drafts, ``token`` next) and its commit started."""
    kept = s.state.commit(Proposal(tokens=[]), Verdict(accepted=0, next_token=token))
    return runner.commits.start("t", [(s, kept)], {}, RoundSpans([s], "t"))


def test_tokens_reach_the_outbox_only_once_their_commit_is_written() -> None:
    async def body() -> None:
        runner = offline_runner()
        held = HeldCommits(runner)
        s = await decoding(runner, "a")
        pending = a_round(runner, s, 7)
        await asyncio.sleep(0.05)  # the commit is in flight, held
        assert s.committing and s.outbox.empty() and s.rounds_committed == 0
        with pytest.raises(AssertionError, match="two commits in flight"):
            a_round(runner, s, 8)  # the runner never starts a second one
        held.go.set()
        assert await runner.commits.settle(pending) == []
        assert s.outbox.get_nowait() == [7]
        assert not s.committing and s.rounds_committed == 1 and s.record.version == 2
        stored = await runner.store.get("a")
        assert stored is not None and list(stored.tokens) == [1, 2, 3, 7]

    asyncio.run(body())


def test_a_conflicting_commit_sends_nothing_and_hands_its_ending_to_the_settler() -> None:
    async def body() -> None:
        runner = offline_runner()
        held = HeldCommits(runner)
        s = await decoding(runner, "b")
        pending = a_round(runner, s, 7)
        await runner.store.redis.hincrby(keys.session_key("b"), "v", 5)  # another writer
        held.go.set()
        [(ended, reason, error)] = await runner.commits.settle(pending)
        assert ended is s and reason is None and isinstance(error, VersionConflict)
        assert s.gone and not s.done  # the settler ends it: it may be in a Propose now
        assert s.outbox.empty()  # round r's token was never sent

    asyncio.run(body())


def test_a_finished_session_is_ended_in_the_background_after_its_commit() -> None:
    async def body() -> None:
        runner = offline_runner()
        held = HeldCommits(runner)
        s = await decoding(runner, "c", max_new=1)
        pending = a_round(runner, s, 7)
        assert s.state.finished and not s.done
        held.go.set()
        assert await runner.commits.settle(pending) == []  # nothing left to the settler
        await runner.ledger.drain()
        assert s.done and "c" not in runner.sessions
        assert s.outbox.get_nowait() == [7]
        assert s.outbox.get_nowait() == Ended(FinishReason.LENGTH)
        assert await runner.store.get("c") is None  # not kept: deleted

    asyncio.run(body())
