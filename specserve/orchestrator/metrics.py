"""Prometheus metrics of the orchestrator, read from the runner's state at scrape time.

A collector rather than counters sprinkled through the round loop: the runner
keeps plain counts (:class:`~specserve.orchestrator.rounds.RunnerStats`) and this
module names them. Served on ``--metrics-port`` when given.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.orchestrator.draft_ahead import Outcome
from specserve.orchestrator.rounds import RoundRunner


class RunnerCollector(Collector):
    """Exposes a :class:`RoundRunner`'s counters and gauges."""

    def __init__(self, runner: RoundRunner) -> None:
        self.runner = runner

    def collect(self) -> Iterator[Metric]:
        stats = self.runner.stats
        yield GaugeMetricFamily(
            "specserve_orchestrator_sessions", "Sessions decoding now", len(self.runner.sessions)
        )
        yield CounterMetricFamily(
            "specserve_orchestrator_rounds", "Rounds run (one per lane batch)", stats.rounds
        )
        batches = CounterMetricFamily(
            "specserve_orchestrator_verify_calls",
            "Verify calls by the batch size the target reported for its forward",
            labels=["batch_size"],
        )
        for size, count in sorted(stats.verify_batch_sizes.items()):
            batches.add_metric([str(size)], count)
        yield batches
        yield CounterMetricFamily(
            "specserve_orchestrator_draft_fallbacks",
            "Sessions verified at k = 0 because their draft replica failed",
            stats.draft_fallbacks,
        )
        yield CounterMetricFamily(
            "specserve_orchestrator_target_failovers",
            "Sessions whose round was replayed on another target replica",
            stats.target_failovers,
        )
        yield CounterMetricFamily(
            "specserve_orchestrator_draft_ahead_bets",
            "Sessions whose next round was drafted while this one was verified",
            stats.draft_ahead_bets,
        )
        yield CounterMetricFamily(
            "specserve_orchestrator_draft_ahead_hits",
            "Draft-ahead bets that came true and stood in for the next round's Propose",
            stats.draft_ahead[Outcome.HIT],
        )
        misses = CounterMetricFamily(
            "specserve_orchestrator_draft_ahead_misses",
            "Draft-ahead bets discarded: drafts rejected, a wrong guess of the bonus token, "
            "or no usable answer (lost)",
            labels=["reason"],
        )
        for outcome in (Outcome.REJECTED, Outcome.GUESS, Outcome.LOST):
            misses.add_metric([outcome.value], stats.draft_ahead[outcome])
        yield misses
        for role, pool in (("draft", self.runner.drafts), ("target", self.runner.targets)):
            yield GaugeMetricFamily(
                f"specserve_orchestrator_{role}_replicas_up",
                f"{role.capitalize()} replicas currently usable",
                len(pool.usable()),
            )


def serve_metrics(runner: RoundRunner, host: str, port: int) -> int:
    """Serve the runner's metrics over HTTP in a daemon thread; returns the bound port."""
    registry = CollectorRegistry()
    registry.register(RunnerCollector(runner))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
