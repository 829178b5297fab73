"""Prometheus metrics every replica serves: its queue, batches, sessions and KV pool.

Read at scrape time from the :class:`~specserve.serving.executor.ModelExecutor`
(queue depth, :class:`~specserve.serving.batch_stats.BatchStats`) and the
backend's ``load`` snapshot (sessions, KV bytes). Names carry the pool:
``specserve_draft_*`` or ``specserve_target_*``. Each service adds its own
counters (:mod:`specserve.draft_service.metrics`, :mod:`specserve.target_service.metrics`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.serving.executor import State
from specserve.serving.server import RunningServer
from specserve.telemetry.prometheus import histogram_family, serve

# The batched operation each pool's autoscaler reads (its HPA metrics select this op).
POOL_OP = {"draft": "propose", "target": "verify"}


class ReplicaCollector(Collector):
    """The metrics every replica of ``pool`` ("draft" or "target") shares. The pool's
    operation has its histogram series from the start, at zero: an autoscaler reading
    them finds the pod before its first call (else: FailedGetPodsMetric until traffic)."""

    def __init__(self, running: RunningServer[Any], pool: str) -> None:
        self.running = running
        self.prefix = f"specserve_{pool}"
        if pool in POOL_OP:
            running.executor.stats.kind(POOL_OP[pool])

    def collect(self) -> Iterator[Metric]:
        p, executor = self.prefix, self.running.executor
        yield GaugeMetricFamily(
            f"{p}_up",
            "1 while the replica serves (model loaded, healthy), else 0",
            float(executor.state is State.READY),
        )
        yield GaugeMetricFamily(
            f"{p}_queue_depth", "Calls waiting for the model thread", executor.queue_depth()
        )
        load = getattr(executor.loaded_backend, "load", None)
        if load is not None:
            yield GaugeMetricFamily(f"{p}_sessions", "Sessions with a cache here", load.sessions)
            yield GaugeMetricFamily(
                f"{p}_kv_cache_used_bytes", "KV cache memory in use (bytes)", load.kv_bytes_used
            )
            yield GaugeMetricFamily(
                f"{p}_kv_cache_free_bytes",
                "KV cache memory left in the budget (bytes)",
                load.kv_bytes_free,
            )
            # The ratio the HPAs' capacity guard reads, so no adapter has to divide.
            budget = load.kv_bytes_used + load.kv_bytes_free
            yield GaugeMetricFamily(
                f"{p}_kv_utilization",
                "Share of the KV cache budget in use (0 to 1)",
                load.kv_bytes_used / budget if budget > 0 else 0.0,
            )
        kinds = executor.stats.items()
        yield histogram_family(
            f"{p}_batch_sessions",
            "Sessions per batched forward (coalesced calls), by operation",
            [((op,), s.batch_sessions.snapshot()) for op, s in kinds],
            labels=["op"],
        )
        yield histogram_family(
            f"{p}_queue_wait_seconds",
            "Time a call waited for its batch to start on the model thread (seconds)",
            [((op,), s.queue_wait_s.snapshot()) for op, s in kinds],
            labels=["op"],
        )
        yield histogram_family(
            f"{p}_forward_duration_seconds",
            "Wall time of one batched call on the model thread (seconds)",
            [((op,), s.compute_s.snapshot()) for op, s in kinds],
            labels=["op"],
        )


def serve_replica_metrics(
    running: RunningServer[Any], pool: str, extra: Sequence[Collector] = ()
) -> None:
    """Serve the replica's metrics if ``--metrics-port`` is set (records the bound port)."""
    port = running.options.telemetry.metrics_port
    if port is None:
        return
    collectors = [ReplicaCollector(running, pool), *extra]
    running.metrics_port = serve(collectors, running.options.host, port)
