"""The HPAs ask for replicas of the pool that is the bottleneck, from real metrics.

Tiny draft and target servers run in child processes; eight clients run
speculative rounds (Propose, then Verify) against a pair for two seconds; the
servers' ``/metrics`` are scraped before and after. The per-pod values the
prometheus-adapter rules would serve are computed from the two scrapes, and each
pool's HPA from ``k8s/base/autoscaling.yaml`` decides its replica count with the
Kubernetes formula.

The bottleneck is made with ``--max-batch-sessions 1`` on one server of the pair:
that replica runs one session's call at a time, so under eight callers its calls
queue while the other replica batches them. The queue-wait setpoint is the
manifests' rule (a p90 wait of two batched calls of that pool) applied to the tiny
models' own measured call time; the busy-ratio and KV setpoints are the manifests'
as written.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from bench.round_client import RoundClient
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.sampling import SamplingParams
from specserve.policy.k_policy import KPolicy
from specserve.serving.launch import ServerProcess
from tests.deploy import hpa
from tests.deploy.manifests import K8S, by_kind, load_docs
from tests.orchestrator.redis_server import free_port
from tests.services.conftest import COMMON, DRAFT, TARGET, Stubs, sid, start_all

CLIENTS = 8
LOAD_S = 2.0
NEW_TOKENS = 12
STOP_S = 3.0
QUEUE_WAIT_CALLS = 2.0  # the queue-wait setpoint, in batched calls of the pool
REPLICAS = {"draft": 1, "target": 2}  # each pool at its HPA's minReplicas
POOL_OP = {"draft": "propose", "target": "verify"}
# A wide vocabulary makes each server call cost more than the clients' own work (one
# Python process drives all eight), so the servers, not the clients, set the pace.
VOCAB = 32768


@dataclass
class Pool:
    server: ServerProcess
    metrics_port: int


def pair(serialised: str) -> dict[str, Pool]:
    """A draft and a target server; ``serialised`` runs one session's call at a time."""
    pools = {}
    for role, model in (("target", TARGET), ("draft", DRAFT)):
        model += f":vocab={VOCAB}"
        port = free_port()
        flags = ["--model", model, *COMMON, "--metrics-port", str(port), "--grace-s", "1"]
        if role == serialised:
            flags += ["--max-batch-sessions", "1"]
        pools[role] = Pool(ServerProcess(role, flags), port)
    return pools


async def load(pools: dict[str, Pool], seconds: float) -> int:
    """``CLIENTS`` clients decode one session after another until ``seconds`` pass;
    returns the rounds run."""
    rng = random.Random(0)
    deadline = time.monotonic() + seconds
    rounds = 0

    async def client() -> None:
        nonlocal rounds
        async with Stubs(pools["target"].server, pools["draft"].server) as stubs:
            rc = RoundClient(stubs.target, stubs.draft)
            while time.monotonic() < deadline:
                prompt = [rng.randrange(256) for _ in range(8)] * 2
                state = DecodeState(
                    sid("hpa"),
                    prompt,
                    SamplingParams(),
                    StopCriteria(NEW_TOKENS),
                    KPolicy(4),
                    drafter="model",
                )
                await rc.run([state])
                rounds += state.round_index

    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return rounds


@dataclass
class Outcome:
    decisions: dict[str, hpa.Decision]  # each pool's HPA's answer
    before: dict[str, hpa.Series]  # each pool's metrics before its first call


def decide(pools: dict[str, Pool]) -> Outcome:
    """Run the load against ``pools``; each pool's HPA's answer."""
    hpas = by_kind(load_docs([K8S / "base" / "autoscaling.yaml"]), "HorizontalPodAutoscaler")
    before = {role: hpa.scrape(p.metrics_port) for role, p in pools.items()}
    start = time.monotonic()
    rounds = asyncio.run(load(pools, LOAD_S))
    seconds = time.monotonic() - start
    after = {role: hpa.scrape(p.metrics_port) for role, p in pools.items()}
    assert rounds > 0
    decisions = {}
    for pool, op in POOL_OP.items():
        b, a = before[pool], after[pool]
        wait = f"specserve_{pool}_{op}_queue_wait_p90_seconds"
        values = {
            wait: hpa.queue_wait_p90(b, a, pool, op),
            f"specserve_{pool}_{op}_busy_ratio": hpa.busy_ratio(b, a, pool, op, seconds),
            "specserve_target_kv_utilization": a.get(
                ("specserve_target_kv_utilization", frozenset()), 0.0
            ),
        }
        setpoint = {wait: QUEUE_WAIT_CALLS * hpa.mean_forward_s(b, a, pool, op)}
        decisions[pool] = hpa.desired_replicas(
            hpas[f"specserve-{pool}"], REPLICAS[pool], values, setpoint
        )
    return Outcome(decisions, before)


@pytest.fixture(scope="module")
def outcomes() -> Iterator[dict[str, Outcome]]:
    """The HPAs' answers with the draft, then the target, as the bottleneck."""
    pairs = {bound: pair(bound) for bound in ("draft", "target")}
    servers = [p.server for pools in pairs.values() for p in pools.values()]
    try:
        start_all(*servers)  # the four start-ups overlap; the loads run one at a time
        yield {bound: decide(pools) for bound, pools in pairs.items()}
    finally:
        # The four shutdowns overlap too, and are cut short: they are not under test here
        # (after this load a server took up to 15 s to exit on SIGTERM).
        deadline = time.monotonic() + STOP_S
        for server in servers:
            if server.proc is not None and server.proc.poll() is None:
                server.proc.send_signal(signal.SIGTERM)
        for server in servers:
            server.stop(timeout_s=max(0.1, deadline - time.monotonic()))


@pytest.fixture(scope="module")
def decisions(outcomes: dict[str, Outcome]) -> dict[str, dict[str, hpa.Decision]]:
    return {bound: o.decisions for bound, o in outcomes.items()}


def test_the_autoscaled_series_exist_at_zero_before_the_first_call(
    outcomes: dict[str, Outcome],
) -> None:
    """An HPA reads a pod's queue wait from the histogram of its pool's operation: the
    series must exist from the start (at zero), or the adapter serves nothing for the
    pod and the HPA reports FailedGetPodsMetric until traffic arrives."""
    for o in outcomes.values():
        for pool, op in POOL_OP.items():
            count = o.before[pool].get(
                (f"specserve_{pool}_queue_wait_seconds_count", frozenset({("op", op)}))
            )
            assert count == 0.0, (pool, sorted(k for k in o.before[pool] if "queue" in k[0]))


def scale(decision: hpa.Decision, pool: str) -> float:
    return decision.replicas / REPLICAS[pool]


def test_the_draft_pool_grows_when_drafting_is_the_bottleneck(
    decisions: dict[str, dict[str, hpa.Decision]],
) -> None:
    d, t = decisions["draft"]["draft"], decisions["draft"]["target"]
    assert d.replicas > REPLICAS["draft"], decisions["draft"]
    assert scale(d, "draft") > scale(t, "target"), decisions["draft"]


def test_the_target_pool_grows_when_verification_is_the_bottleneck(
    decisions: dict[str, dict[str, hpa.Decision]],
) -> None:
    d, t = decisions["target"]["draft"], decisions["target"]["target"]
    assert t.replicas > REPLICAS["target"], decisions["target"]
    assert scale(t, "target") > scale(d, "draft"), decisions["target"]


def test_the_formula_matches_the_kubernetes_docs() -> None:
    """1 replica at 200m against 100m asks for 2; within 10 % it stays; clamped to max."""
    target = {"averageValue": "100m"}
    spec = {
        "spec": {
            "minReplicas": 1,
            "maxReplicas": 10,
            "metrics": [{"type": "Pods", "pods": {"metric": {"name": "m"}, "target": target}}],
        }
    }
    assert hpa.desired_replicas(spec, 1, {"m": 0.2}).replicas == 2
    assert hpa.desired_replicas(spec, 4, {"m": 0.105}).replicas == 4
    assert hpa.desired_replicas(spec, 4, {"m": 0.05}).replicas == 2
    assert hpa.desired_replicas(spec, 4, {"m": 5.0}).replicas == 10
    # histogram_quantile: 9 of 10 observations in (0, 1]: p90 at the bound 1.
    assert hpa.histogram_quantile(0.9, {1.0: 9, 2.0: 10, float("inf"): 10}) == 1.0
    assert hpa.histogram_quantile(0.5, {1.0: 0, 2.0: 10, float("inf"): 10}) == 1.5
