"""Prometheus metrics of the orchestrator, read from its plain counts at scrape time.

A collector rather than counters sprinkled through the round loop: the runner
keeps plain counts (:class:`~specserve.orchestrator.round.stats.RunnerStats`), the
request path its latencies (:class:`~specserve.orchestrator.api.request_stats.RequestStats`),
and this module names them. Served on ``--metrics-port`` when given. The token
counts grow exactly as the requests' usage does, so
``specserve_orchestrator_accepted_tokens_total`` over a run equals the sum of
``usage.accepted_tokens`` of its requests.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.orchestrator.api.request_stats import RequestStats
from specserve.orchestrator.round.runner import RoundRunner
from specserve.orchestrator.snapshots.kv_snapshots import SnapshotStats
from specserve.telemetry.prometheus import histogram_family, serve

P = "specserve_orchestrator"


class RunnerCollector(Collector):
    """Exposes a :class:`RoundRunner`'s counters and gauges, and the request latencies."""

    def __init__(self, runner: RoundRunner, requests: RequestStats | None = None) -> None:
        self.runner = runner
        self.requests = requests

    def collect(self) -> Iterator[Metric]:
        yield from self._rounds()
        if self.requests is not None:
            yield from self._requests(self.requests)

    def _rounds(self) -> Iterator[Metric]:
        stats = self.runner.stats
        yield GaugeMetricFamily(f"{P}_sessions", "Sessions decoding now", len(self.runner.sessions))
        yield CounterMetricFamily(f"{P}_rounds", "Batch rounds (one per lane batch)", stats.rounds)
        yield CounterMetricFamily(
            f"{P}_multi_step_rounds",
            "Batch rounds without drafts whose one Verify decoded several plain steps",
            stats.multi_step_rounds,
        )
        yield CounterMetricFamily(
            f"{P}_session_rounds",
            "Session rounds: one verdict per session per round, a multi-step verdict as its "
            "steps (usage.rounds summed)",
            stats.session_rounds,
        )
        batches = CounterMetricFamily(
            f"{P}_verify_calls",
            "Verify calls by the batch size the target reported for its forward",
            labels=["batch_size"],
        )
        for size, count in sorted(stats.verify_batch_sizes.items()):
            batches.add_metric([str(size)], count)
        yield batches
        yield CounterMetricFamily(
            f"{P}_drafts", "Session rounds that verified at least one draft token", stats.drafts
        )
        yield CounterMetricFamily(
            f"{P}_draft_tokens",
            "Draft tokens verified (usage.drafted_tokens summed)",
            stats.draft_tokens,
        )
        yield CounterMetricFamily(
            f"{P}_accepted_tokens",
            "Draft tokens accepted (usage.accepted_tokens summed)",
            stats.accepted_tokens,
        )
        drafted = CounterMetricFamily(
            f"{P}_draft_tokens_by_position",
            "Draft tokens verified at each draft position (1 = the first draft token)",
            labels=["position"],
        )
        for position, count in sorted(stats.drafted_by_position.items()):
            drafted.add_metric([str(position)], count)
        yield drafted
        accepted = CounterMetricFamily(
            f"{P}_accepted_tokens_by_position",
            "Draft tokens accepted at each draft position (1 = the first draft token)",
            labels=["position"],
        )
        for position, count in sorted(stats.accepted_by_position.items()):
            accepted.add_metric([str(position)], count)
        yield accepted
        yield GaugeMetricFamily(
            f"{P}_acceptance_ratio",
            "Accepted over drafted tokens since start (0 before any draft)",
            stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else 0.0,
        )
        yield GaugeMetricFamily(
            f"{P}_mean_acceptance_length",
            "Tokens committed per session round since start: 1 + accepted / session rounds "
            "(0 before any round)",
            1 + stats.accepted_tokens / stats.session_rounds if stats.session_rounds else 0.0,
        )
        yield CounterMetricFamily(
            f"{P}_draft_fallbacks",
            "Session rounds that wanted drafts but verified at k = 0 (draft replica failed, "
            "too slow, refused, or none usable)",
            stats.draft_fallbacks,
        )
        yield CounterMetricFamily(
            f"{P}_draft_warmups",
            "Sessions whose draft cache was rebuilt beside the rounds (a new prompt, "
            "a new draft replica); they verify at k = 0 meanwhile",
            stats.draft_warmups,
        )
        caps = CounterMetricFamily(
            f"{P}_k_cap_rounds",
            "Batch rounds by the k cap they ran under (the load curve's bound, or below "
            "it the cap predicted to finish the batch's slowest turn soonest; "
            "0 = no speculation)",
            labels=["cap"],
        )
        for cap, count in sorted(stats.k_caps.items()):
            caps.add_metric([str(cap)], count)
        yield caps
        yield CounterMetricFamily(
            f"{P}_target_failovers",
            "Sessions whose round was replayed on another target replica",
            stats.target_failovers,
        )
        yield CounterMetricFamily(
            f"{P}_replayed_rounds",
            "Verify batches replayed on another target replica after theirs was lost",
            stats.replayed_rounds,
        )
        yield CounterMetricFamily(
            f"{P}_slow_verifies",
            "Verify batches past the target timeout on a target that answered SERVING",
            stats.slow_verifies,
        )
        yield CounterMetricFamily(
            f"{P}_target_history_resends",
            "Sessions a target answered NEEDS_HISTORY and got the whole history",
            stats.target_history_resends,
        )
        yield CounterMetricFamily(
            f"{P}_prefill_chunks",
            "Session rounds that sent part of a prompt past the round's token budget "
            "(a chunked prefill; the session emits nothing in them)",
            stats.prefill_chunks,
        )
        if self.runner.snapshots is not None:
            yield from snapshot_metrics(self.runner.snapshots.stats)
        for role, pool in (("draft", self.runner.drafts), ("target", self.runner.targets)):
            yield GaugeMetricFamily(
                f"{P}_{role}_replicas_up",
                f"{role.capitalize()} replicas currently usable",
                len(pool.usable()),
            )

    def _requests(self, r: RequestStats) -> Iterator[Metric]:
        yield histogram_family(
            f"{P}_time_to_first_token_seconds",
            "From a request's arrival to its first token (seconds)",
            [((), r.time_to_first_token_s.snapshot())],
        )
        yield histogram_family(
            f"{P}_inter_token_latency_seconds",
            "Time per token after the first: a delivery's gap to the previous one over its "
            "tokens, one observation per token (seconds)",
            [((), r.inter_token_latency_s.snapshot())],
        )
        yield histogram_family(
            f"{P}_request_duration_seconds",
            "From a request's arrival to its last chunk (seconds)",
            [((), r.duration_s.snapshot())],
        )
        finished = CounterMetricFamily(
            f"{P}_requests",
            "Requests ended, by finish reason (length, eos, stop, cancelled, error)",
            labels=["finish_reason"],
        )
        for reason, count in r.finished_counts():
            finished.add_metric([reason], count)
        yield finished
        yield CounterMetricFamily(
            f"{P}_prompt_tokens", "Prompt tokens of ended requests", r.prompt_tokens
        )
        yield CounterMetricFamily(
            f"{P}_completion_tokens", "Tokens generated by ended requests", r.completion_tokens
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


def serve_metrics(runner: RoundRunner, requests: RequestStats | None, host: str, port: int) -> int:
    """Serve the orchestrator's metrics over HTTP in a daemon thread; returns the bound port."""
    return serve([RunnerCollector(runner, requests)], host, port)
