"""The scheduling policy: a pure package (no grpc, redis, opentelemetry or asyncio).

:class:`Planner` plans a batch's round from plain
:class:`~specserve.orchestrator.policy.views.SessionView` data and learns from its
:class:`~specserve.orchestrator.policy.views.RoundOutcome`; :class:`PolicyConfig`
holds every constant and switch (docs/scheduling.md).
"""

from specserve.orchestrator.policy.config import (
    Devices,
    PolicyConfig,
    with_overrides,
)
from specserve.orchestrator.policy.planner import Planner
from specserve.orchestrator.policy.views import (
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
