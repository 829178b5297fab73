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

from specserve.orchestrator.kv_snapshots import SnapshotStats
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
            "specserve_orchestrator_target_history_resends",
            "Sessions a target answered NEEDS_HISTORY and got the whole history",
            stats.target_history_resends,
        )
        if self.runner.snapshots is not None:
            yield from snapshot_metrics(self.runner.snapshots.stats)
        for role, pool in (("draft", self.runner.drafts), ("target", self.runner.targets)):
            yield GaugeMetricFamily(
                f"specserve_orchestrator_{role}_replicas_up",
                f"{role.capitalize()} replicas currently usable",
                len(pool.usable()),
            )


_SNAPSHOT_COUNTERS = (
    ("chunks_exported", "KV snapshot chunks exported from targets and stored"),
    ("bytes_exported", "K/V bytes of the chunks stored"),
    ("chunks_found", "Chunks an export found stored already (shared prefixes)"),
    ("export_failures", "Exports that failed (logged; the request went on)"),
    ("restores", "Sessions restored from KV snapshots on a target failover"),
    ("restore_misses", "Failovers that found no stored chunk for the session"),
    ("restore_failures", "Restores that failed part-way and fell back to re-prefill"),
    ("chunks_imported", "Chunks imported into targets"),
    ("tokens_restored", "Committed tokens restored instead of re-prefilled"),
    ("tail_tokens", "Committed tokens a restored target still prefilled (the tail)"),
)


def snapshot_metrics(stats: SnapshotStats) -> Iterator[Metric]:
    """``specserve_orchestrator_kv_*``: what KV snapshots saved and restored."""
    for name, doc in _SNAPSHOT_COUNTERS:
        yield CounterMetricFamily(f"specserve_orchestrator_kv_{name}", doc, getattr(stats, name))
    yield CounterMetricFamily(
        "specserve_orchestrator_kv_restore_seconds",
        "Wall time of the restores (Redis reads and ImportKv calls)",
        stats.restore_ns / 1e9,
    )


def serve_metrics(runner: RoundRunner, host: str, port: int) -> int:
    """Serve the runner's metrics over HTTP in a daemon thread; returns the bound port."""
    registry = CollectorRegistry()
    registry.register(RunnerCollector(runner))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
