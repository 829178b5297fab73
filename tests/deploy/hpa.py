"""The Kubernetes HPA's arithmetic over metrics scraped from running servers.

The per-pod values are computed from two scrapes of a replica's ``/metrics`` the
way the prometheus-adapter rules (``k8s/monitoring/prometheus-adapter-values.yaml``)
compute them from Prometheus: ``rate()`` becomes the difference over the interval,
``histogram_quantile`` interpolates linearly inside a bucket as Prometheus does.
The replica count is the HPA controller's (Kubernetes docs, "Algorithm details"):
``desired = ceil(current * value / target)`` per metric, unchanged within the 10 %
tolerance, the largest over the metrics, clamped to ``[minReplicas, maxReplicas]``.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

TOLERANCE = 0.1  # the controller's default --horizontal-pod-autoscaler-tolerance

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Series:
    """Every sample of ``http://127.0.0.1:port/metrics``, keyed by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def delta(before: Series, after: Series, name: str, **labels: str) -> dict[frozenset, float]:
    """``after - before`` of the series of ``name`` carrying ``labels`` (a counter's rate
    times the interval), keyed by their other labels."""
    out = {}
    for (n, lbls), value in after.items():
        if n != name or not set(labels.items()) <= lbls:
            continue
        rest = frozenset((k, v) for k, v in lbls if k not in labels)
        out[rest] = value - before.get((n, lbls), 0.0)
    return out


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float:
    """Prometheus' ``histogram_quantile`` over cumulative counts by upper bound (NaN: none)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower  # the highest finite bound, as Prometheus answers
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def queue_wait_p90(before: Series, after: Series, pool: str, op: str) -> float:
    """``specserve_<pool>_<op>_queue_wait_p90_seconds``: 0 when no call came (as the rule)."""
    name = f"specserve_{pool}_queue_wait_seconds_bucket"
    by_le = {float(dict(k)["le"]): v for k, v in delta(before, after, name, op=op).items()}
    value = histogram_quantile(0.9, by_le) if by_le else math.nan
    return 0.0 if math.isnan(value) else value


def busy_ratio(before: Series, after: Series, pool: str, op: str, seconds: float) -> float:
    """``specserve_<pool>_<op>_busy_ratio``: model-thread seconds per second."""
    name = f"specserve_{pool}_forward_duration_seconds_sum"
    return sum(delta(before, after, name, op=op).values()) / seconds


def mean_forward_s(before: Series, after: Series, pool: str, op: str) -> float:
    """The mean batched-forward time of ``op`` over the interval."""
    name = f"specserve_{pool}_forward_duration_seconds"
    total = sum(delta(before, after, f"{name}_sum", op=op).values())
    count = sum(delta(before, after, f"{name}_count", op=op).values())
    return total / count if count else 0.0


@dataclass(frozen=True)
class Decision:
    """The controller's answer for one HPA: the count and the metric that set it."""

    replicas: int
    ratios: dict[str, float]  # metric -> value / target


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity as the HPA reads it ("100m" = 0.1)."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def desired_replicas(
    hpa: Mapping,
    current: int,
    values: Mapping[str, float],
    targets: Mapping[str, float] | None = None,
) -> Decision:
    """The HPA's desired replica count for per-pod averages ``values`` (by metric name).

    ``targets`` overrides a manifest's setpoint (the tiny models' forward times are not
    a real model's); every other setpoint is the manifest's.
    """
    spec, targets = hpa["spec"], targets or {}
    proposals, ratios = [], {}
    for metric in spec["metrics"]:
        if metric["type"] != "Pods":
            continue
        name = metric["pods"]["metric"]["name"]
        target = targets.get(name, quantity(metric["pods"]["target"]["averageValue"]))
        ratio = values[name] / target
        ratios[name] = ratio
        proposals.append(current if abs(ratio - 1) <= TOLERANCE else math.ceil(current * ratio))
    desired = max(proposals)
    return Decision(max(spec["minReplicas"], min(spec["maxReplicas"], desired)), ratios)
