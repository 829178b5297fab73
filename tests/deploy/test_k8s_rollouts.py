"""Rollouts and starts that an operator meets first (issue: production holes).

* A Deployment whose pods request GPUs rolls with ``maxSurge: 0``: a rollout must
  not need a spare GPU (the target had it; the GPU draft did not).
* Every overlay's namespace enforces Pod Security ``restricted`` (the gpu overlay
  had no Namespace at all).
* Every container with a liveness probe has a startup probe, so liveness cannot
  kill a process still loading (the orchestrator's tokenizer had none).
* A server under torchrun drains within torchrun's own 30 s between forwarding
  SIGTERM and SIGKILL (the TP target had ``--grace-s 40``: draining batches killed).
* The draft pool and the orchestrators prefer the zones the target pods run in: a
  round calls both replicas, and it should not cross zones (they had no affinity).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.manifests import OVERLAYS, Doc, by_kind, needs_kubectl, render_overlay

pytestmark = needs_kubectl


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Doc]]:
    return {overlay: render_overlay(overlay) for overlay in OVERLAYS}


def _requests_gpus(dep: Doc) -> bool:
    pod = dep["spec"]["template"]["spec"]
    return any(
        "nvidia.com/gpu" in c.get("resources", {}).get("limits", {}) for c in pod["containers"]
    )


def surge_problems(docs: list[Doc]) -> list[str]:
    out = []
    for name, dep in by_kind(docs, "Deployment").items():
        rolling: dict[str, Any] = dep["spec"].get("strategy", {}).get("rollingUpdate", {})
        if _requests_gpus(dep) and rolling.get("maxSurge") != 0:
            out.append(f"{name} requests GPUs but may surge ({rolling or 'the default 25%'})")
    return out


def startup_problems(docs: list[Doc]) -> list[str]:
    out = []
    for name, dep in by_kind(docs, "Deployment").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if "livenessProbe" in c and "startupProbe" not in c:
                out.append(f"{name}/{c['name']}: a liveness probe without a startup probe")
    return out


def test_gpu_pools_roll_without_a_spare_gpu(rendered: dict[str, list[Doc]]) -> None:
    assert any(_requests_gpus(d) for d in by_kind(rendered["gpu"], "Deployment").values())
    for overlay, docs in rendered.items():
        assert surge_problems(docs) == [], overlay


def test_a_surging_gpu_pool_would_be_caught(rendered: dict[str, list[Doc]]) -> None:
    docs = [dict(d) for d in rendered["gpu"]]
    for d in docs:
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "specserve-draft":
            d["spec"] = {**d["spec"], "strategy": {"type": "RollingUpdate"}}
    assert surge_problems(docs) == ["specserve-draft requests GPUs but may surge (the default 25%)"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_namespace_enforces_restricted(
    rendered: dict[str, list[Doc]], overlay: str
) -> None:
    namespaces = by_kind(rendered[overlay], "Namespace")
    workload_namespaces = {
        d["metadata"].get("namespace") for d in rendered[overlay] if d["kind"] == "Deployment"
    }
    assert set(namespaces) == workload_namespaces == {"specserve"}
    labels = namespaces["specserve"]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


def test_liveness_waits_for_the_first_start(rendered: dict[str, list[Doc]]) -> None:
    for overlay, docs in rendered.items():
        assert startup_problems(docs) == [], overlay


TORCHRUN_KILL_AFTER_S = 30  # torch.distributed.elastic: SIGTERM, then SIGKILL 30 s later


def torchrun_problems(docs: list[Doc]) -> list[str]:
    out = []
    for name, dep in by_kind(docs, "Deployment").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if c.get("command", [""])[0] != "torchrun":
                continue
            args = c.get("args", [])
            grace = float(args[args.index("--grace-s") + 1]) if "--grace-s" in args else 10.0
            if grace >= TORCHRUN_KILL_AFTER_S:
                out.append(f"{name}: --grace-s {grace:g} under torchrun, which kills at 30 s")
    return out


def test_torchrun_targets_drain_before_torchrun_kills_them(
    rendered: dict[str, list[Doc]],
) -> None:
    torchrun = [
        c
        for d in by_kind(rendered["gpu"], "Deployment").values()
        for c in d["spec"]["template"]["spec"]["containers"]
        if c.get("command", [""])[0] == "torchrun"
    ]
    assert torchrun  # the gpu overlay's TP target
    for overlay, docs in rendered.items():
        assert torchrun_problems(docs) == [], overlay


def zone_problems(docs: list[Doc]) -> list[str]:
    """Draft and orchestrator Deployments without a preferred zone affinity to the pods
    of the target Deployment."""
    deployments = by_kind(docs, "Deployment")
    target = deployments["specserve-target"]["spec"]["template"]["metadata"]["labels"]
    out = []
    for name in ("specserve-draft", "specserve-orchestrator"):
        pod = deployments[name]["spec"]["template"]["spec"]
        terms = pod.get("affinity", {}).get("podAffinity", {})
        preferred = terms.get("preferredDuringSchedulingIgnoredDuringExecution", [])
        near = [
            t["podAffinityTerm"]
            for t in preferred
            if t["podAffinityTerm"].get("topologyKey") == "topology.kubernetes.io/zone"
            and t["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= target.items()
        ]
        if not near:
            out.append(f"{name}: no preferred affinity to the target pods' zone")
    return out


def test_rounds_stay_in_the_target_pods_zones(rendered: dict[str, list[Doc]]) -> None:
    for overlay, docs in rendered.items():
        assert zone_problems(docs) == [], overlay


def test_a_pool_without_zone_affinity_would_be_caught(rendered: dict[str, list[Doc]]) -> None:
    docs = [dict(d) for d in rendered["cpu"]]
    for i, d in enumerate(docs):
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "specserve-draft":
            spec = {**d["spec"]["template"]["spec"]}
            spec.pop("affinity")
            template = {**d["spec"]["template"], "spec": spec}
            docs[i] = {**d, "spec": {**d["spec"], "template": template}}
    assert zone_problems(docs) == [
        "specserve-draft: no preferred affinity to the target pods' zone"
    ]
