"""An idle lane's first round waits its admission window, so requests that arrive
together start together (the round runner with its replica pools never started)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from specserve.orchestrator.fleet.scheduler import Placement, Scheduler, SchedulerConfig
from specserve.orchestrator.round.runner import RoundRunner
from specserve.orchestrator.session import Phase
from tests.orchestrator.test_slow_replicas import offline_runner


class WaitingSession(SimpleNamespace):
    """Just the lifecycle of a live session that the lane loop reads."""

    phase = Phase.WAITING
    done = False

    def enter_round(self) -> None:
        self.phase = Phase.IN_ROUND

    def leave_round(self) -> None:
        self.phase = Phase.WAITING


def first_round(window_s: float, gaps_s: list[float]) -> list[str]:
    """Sessions joining one lane ``gaps_s`` apart: the ids of the lane's first round."""

    async def body() -> list[str]:
        runner: RoundRunner = offline_runner()
        runner.scheduler = Scheduler(SchedulerConfig(admission_window_s=window_s))
        rounds: list[list[str]] = []

        async def record(target: str, batch: list[Any], pending: None) -> None:
            rounds.append([s.sid for s in batch])
            for s in batch:
                runner.scheduler.leave(s.sid)

        runner._round = record  # type: ignore[method-assign]
        for i, gap in enumerate(gaps_s):
            await asyncio.sleep(gap)
            sid = f"s{i}"
            state = SimpleNamespace(
                tokens=[1, 2], target_start=1, finished=False
            )  # decoding: one new token
            runner.sessions[sid] = WaitingSession(  # type: ignore[assignment]
                sid=sid, state=state, trace_context=None
            )
            runner._run_lane(runner.scheduler.join(sid, Placement("t", None)))
        await asyncio.wait_for(asyncio.gather(*runner._lanes.values()), timeout=5)
        return rounds[0]

    return asyncio.run(body())


def test_requests_arriving_within_the_window_share_the_first_round() -> None:
    assert first_round(0.1, [0.0, 0.005, 0.005]) == ["s0", "s1", "s2"]


def test_without_a_window_the_first_request_starts_alone() -> None:
    assert first_round(0.0, [0.0, 0.01, 0.01]) == ["s0"]


def test_the_window_is_validated() -> None:
    with pytest.raises(ValueError, match="admission_window_s"):
        SchedulerConfig(admission_window_s=-0.001)
