"""Each round, the sessions' k policies plan with the drafting cost the orchestrator
measured on the target at that batch size (the round runner with its replica pools
never started; the round stops at its propose)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.k_policy import KPolicy
from specserve.engine.sampling import SamplingParams
from specserve.orchestrator.round_spans import RoundSpans
from specserve.orchestrator.rounds import RoundRunner
from tests.orchestrator.test_slow_replicas import live, offline_runner


class Stop(Exception):
    """Ends the round where the test has seen what it needs."""


def adaptive(sid: str) -> Any:
    """A live session at adaptive k, ten tokens in."""
    s = live(sid, list(range(10)))
    s.state = DecodeState(sid, list(range(10)), SamplingParams(), StopCriteria(64), KPolicy(None))
    s.rounds_committed, s.trace_context = 3, None
    return s


def planned_costs(runner: RoundRunner, batch: list[Any]) -> list[object]:
    """The cost each session's policy holds when the round proposes."""
    seen: list[object] = []

    async def propose(target: str, live: list[Any], spans: Any, cap: int) -> dict[str, Any]:
        seen.extend(s.state.k_policy.cost for s in live)
        raise Stop

    runner._propose = propose  # type: ignore[method-assign]

    async def body() -> None:
        with pytest.raises(Stop):
            await runner._traced_round("t", batch, RoundSpans(batch, "t"))

    asyncio.run(body())
    return seen


def test_a_round_plans_with_the_measured_cost_of_its_batch_size() -> None:
    runner = offline_runner()
    assert runner.caps is not None
    batch = [adaptive("a"), adaptive("b")]
    static = [s.state.k_policy.static for s in batch]
    assert planned_costs(runner, batch) == static  # nothing measured: the static guess
    runner.caps.observe("t", 2, 0, 0, 0.30)  # a plain round of 2 and drafting rounds
    for depth in (1, 2, 4):
        runner.caps.observe("t", 2, depth, 2 * depth, 0.30 + 0.05 * depth + 0.02 * 2 * depth)
    measured, fit = runner.caps.relative_cost("t", 2), runner.caps.cost("t")
    assert measured is not None and fit is not None
    # A session is charged the steps and the verify tokens of its own drafts.
    assert measured.round(4) == pytest.approx(1 + 4 * (fit.per_step + fit.per_token) / 0.30)
    assert planned_costs(runner, batch) == [measured, measured]
    runner.caps.forget("t")  # the target left the pool: back to the guess
    assert planned_costs(runner, batch) == static
