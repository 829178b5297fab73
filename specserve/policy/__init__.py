"""The scheduling policy, for the local loop and the orchestrator alike: a pure package
(no torch, grpc, redis, opentelemetry or asyncio; ``tests/test_layering.py``).

:mod:`~specserve.policy.k_policy` decides one session's drafts a round,
:mod:`~specserve.policy.round_cost` fits what a round costs, and
:mod:`~specserve.policy.plain_steps` bounds a plain Verify's steps (the engine's loop
uses these three); :class:`Planner` plans an orchestrator batch's round from plain
:class:`~specserve.policy.views.SessionView` data and learns from its
:class:`~specserve.policy.views.RoundOutcome`; :class:`PolicyConfig`
holds every constant and switch of the orchestrator's policy (docs/scheduling.md).
"""

from specserve.policy.config import (
    Devices,
    PolicyConfig,
    with_overrides,
)
from specserve.policy.planner import Planner
from specserve.policy.views import (
    BatchPlan,
    Cache,
    RoundOutcome,
    SessionView,
    WarmWhere,
)

__all__ = [
    "BatchPlan",
    "Cache",
    "Devices",
    "Planner",
    "PolicyConfig",
    "RoundOutcome",
    "SessionView",
    "WarmWhere",
    "with_overrides",
]
