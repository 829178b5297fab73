"""A live session's lifecycle is one Phase: WAITING <-> IN_ROUND, then ENDED for good."""

from __future__ import annotations

import asyncio

import pytest

from specserve.engine.decode_state import DecodeState, FinishReason, StopCriteria
from specserve.engine.sampling import SamplingParams
from specserve.orchestrator.session import Ended, LiveSession, Phase
from specserve.orchestrator.types import Usage
from specserve.policy.k_policy import KPolicy
from specserve.v1 import session_pb2


def make_session() -> LiveSession:
    state = DecodeState("s", [1, 2, 3], SamplingParams(), StopCriteria(8), KPolicy(None, k_max=4))
    record = session_pb2.SessionRecord(session_id="s")
    return LiveSession(
        record, state, prompt_tokens=3, base_usage=Usage(), pre_turn=None, deadline=None
    )


def test_a_round_takes_a_waiting_session_and_gives_it_back() -> None:
    async def body() -> None:
        s = make_session()
        assert s.phase is Phase.WAITING and not s.done
        s.enter_round()
        assert s.phase is Phase.IN_ROUND
        s.leave_round()
        assert s.phase is Phase.WAITING

    asyncio.run(body())


def test_a_session_that_ends_in_its_round_stays_ended() -> None:
    async def body() -> None:
        s = make_session()
        s.enter_round()
        s.end(FinishReason.STOP)
        s.leave_round()  # the lane's cleanup after the round
        assert s.phase is Phase.ENDED and s.done
        assert s.outbox.get_nowait() == Ended(FinishReason.STOP)

    asyncio.run(body())


def test_a_session_in_a_round_cannot_start_another() -> None:
    async def body() -> None:
        s = make_session()
        s.enter_round()
        with pytest.raises(AssertionError):
            s.enter_round()
        s.end(None, RuntimeError("x"))
        with pytest.raises(AssertionError):
            s.enter_round()

    asyncio.run(body())
